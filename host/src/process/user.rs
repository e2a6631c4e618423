//! Who a host's agents run as (docs/HOSTING.md, "Who agents run as").
//!
//! A host started by root never hands root to the programs manifests name: its agents, their
//! health commands and their builds run as an unprivileged user, `nobody` unless the host is
//! told another (`chorus host --user NAME`); root only when named (`--user root`), and said in
//! the host's log. A host started by anyone else runs its agents as itself: it cannot switch
//! users, and a `--user` naming someone else is refused at start.

use std::path::{Path, PathBuf};

/// The user a host started by root runs its agents as when it is not told one.
pub const DEFAULT_AGENT_USER: &str = "nobody";

/// A user agents are switched to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentUser {
    /// Its name.
    pub name: String,
    /// Its user id.
    pub uid: u32,
    /// Its primary group, the only group the agent keeps.
    pub gid: u32,
    /// Its home folder, the agent's `HOME`.
    pub home: PathBuf,
}

/// A `--user` a host cannot honour.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum UserError {
    /// No such user on this machine.
    #[error("no user {name:?} on this machine (chorus host --user names the user agents run as)")]
    Unknown {
        /// The name given.
        name: String,
    },
    /// Only root can run agents as another user.
    #[error(
        "this host runs as {current}, so its agents do too: running them as {requested} needs a host started by root"
    )]
    NeedsRoot {
        /// The host's own user.
        current: String,
        /// The user asked for.
        requested: String,
    },
}

/// What the host's agents run as, decided once at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunAs {
    /// The host's own user: a host not started by root, or root named explicitly.
    Host {
        /// Its name, for the log line.
        name: String,
    },
    /// Switched to this user before the agent's program starts.
    User(AgentUser),
}

impl RunAs {
    /// What a host running with effective user id `euid` (named `current`) runs its agents as
    /// when asked for `requested`; `lookup` finds a user by name.
    ///
    /// # Errors
    ///
    /// [`UserError::Unknown`] for a name `lookup` does not know; [`UserError::NeedsRoot`] for
    /// another user than the host's own when the host is not root.
    pub fn decide(
        euid: u32,
        current: &str,
        requested: Option<&str>,
        lookup: impl Fn(&str) -> Option<AgentUser>,
    ) -> Result<RunAs, UserError> {
        if euid != 0 {
            return match requested {
                None => Ok(RunAs::Host {
                    name: current.to_owned(),
                }),
                Some(name) if name == current => Ok(RunAs::Host {
                    name: current.to_owned(),
                }),
                Some(name) => Err(UserError::NeedsRoot {
                    current: current.to_owned(),
                    requested: name.to_owned(),
                }),
            };
        }
        let name = requested.unwrap_or(DEFAULT_AGENT_USER);
        let user = lookup(name).ok_or_else(|| UserError::Unknown {
            name: name.to_owned(),
        })?;
        if user.uid == 0 {
            return Ok(RunAs::Host { name: user.name });
        }
        Ok(RunAs::User(user))
    }

    /// What this process's agents run as when asked for `requested`, from the machine's user
    /// database.
    ///
    /// # Errors
    ///
    /// As [`RunAs::decide`].
    pub fn of_this_process(requested: Option<&str>) -> Result<RunAs, UserError> {
        RunAs::decide(
            nix::unistd::geteuid().as_raw(),
            &current_user(),
            requested,
            lookup,
        )
    }

    /// The user switched to, if any.
    pub fn user(&self) -> Option<&AgentUser> {
        match self {
            RunAs::Host { .. } => None,
            RunAs::User(user) => Some(user),
        }
    }

    /// The name agents run under.
    pub fn name(&self) -> &str {
        match self {
            RunAs::Host { name } => name,
            RunAs::User(user) => &user.name,
        }
    }

    /// Whether agents run as root.
    pub fn is_root(&self) -> bool {
        matches!(self, RunAs::Host { name } if name == "root")
    }

    /// Gives `path` (a folder the host made for its agents: a build's clone) to the user,
    /// with everything in it; nothing to do when agents run as the host.
    ///
    /// # Errors
    ///
    /// The first file that could not be changed.
    pub fn hand_over(&self, path: &Path) -> std::io::Result<()> {
        let Some(user) = self.user() else {
            return Ok(());
        };
        let (uid, gid) = (
            Some(nix::unistd::Uid::from_raw(user.uid)),
            Some(nix::unistd::Gid::from_raw(user.gid)),
        );
        let mut stack = vec![path.to_owned()];
        while let Some(next) = stack.pop() {
            nix::unistd::chown(&next, uid, gid).map_err(std::io::Error::from)?;
            let meta = std::fs::symlink_metadata(&next)?;
            if meta.is_dir() {
                for entry in std::fs::read_dir(&next)? {
                    stack.push(entry?.path());
                }
            }
        }
        Ok(())
    }

    /// The variables that say who the agent is (`HOME`, `USER`, `LOGNAME`), replacing the
    /// host's own when agents run as another user.
    pub fn env(&self) -> Vec<(String, String)> {
        match self {
            RunAs::Host { .. } => Vec::new(),
            RunAs::User(user) => vec![
                ("HOME".to_owned(), user.home.display().to_string()),
                ("USER".to_owned(), user.name.clone()),
                ("LOGNAME".to_owned(), user.name.clone()),
            ],
        }
    }
}

/// This process's user name (its id when it has none).
pub fn current_user() -> String {
    let euid = nix::unistd::geteuid();
    nix::unistd::User::from_uid(euid)
        .ok()
        .flatten()
        .map_or_else(|| euid.to_string(), |u| u.name)
}

/// A user of this machine by name.
fn lookup(name: &str) -> Option<AgentUser> {
    let user = nix::unistd::User::from_name(name).ok().flatten()?;
    Some(AgentUser {
        name: user.name,
        uid: user.uid.as_raw(),
        gid: user.gid.as_raw(),
        home: user.dir,
    })
}

/// Drops this process to `uid`/`gid` for good: its only group `gid`, no way back through a
/// set-user-id program (`PR_SET_NO_NEW_PRIVS`). The launcher calls it last, after joining the
/// replica's cgroup, which needs the host's rights.
///
/// # Errors
///
/// The call that failed.
pub fn become_user(uid: u32, gid: u32) -> std::io::Result<()> {
    let gid = nix::unistd::Gid::from_raw(gid);
    let uid = nix::unistd::Uid::from_raw(uid);
    let step = |what: &str, r: nix::Result<()>| {
        r.map_err(|errno| std::io::Error::other(format!("cannot {what}: {errno}")))
    };
    step("set no_new_privs", nix::sys::prctl::set_no_new_privs())?;
    step("drop supplementary groups", nix::unistd::setgroups(&[gid]))?;
    step("set the group id", nix::unistd::setgid(gid))?;
    step("set the user id", nix::unistd::setuid(uid))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn users(name: &str) -> Option<AgentUser> {
        let (uid, gid) = match name {
            "root" => (0, 0),
            "nobody" => (65534, 65534),
            "agents" => (1001, 1001),
            _ => return None,
        };
        Some(AgentUser {
            name: name.to_owned(),
            uid,
            gid,
            home: PathBuf::from("/nonexistent"),
        })
    }

    #[test]
    fn root_runs_agents_as_nobody_unless_told_and_as_root_only_when_named() {
        let nobody = RunAs::decide(0, "root", None, users).expect("default");
        assert_eq!(nobody.user().map(|u| u.uid), Some(65534));
        let agents = RunAs::decide(0, "root", Some("agents"), users).expect("named");
        assert_eq!(agents.name(), "agents");
        let root = RunAs::decide(0, "root", Some("root"), users).expect("root named");
        assert!(root.is_root() && root.user().is_none());
        assert_eq!(
            RunAs::decide(0, "root", Some("ghost"), users),
            Err(UserError::Unknown {
                name: "ghost".into()
            })
        );
    }

    #[test]
    fn a_host_not_started_by_root_runs_agents_as_itself_and_refuses_another_user() {
        let own = RunAs::decide(1000, "alice", None, users).expect("own");
        assert_eq!(
            own,
            RunAs::Host {
                name: "alice".into()
            }
        );
        assert_eq!(
            RunAs::decide(1000, "alice", Some("alice"), users).expect("named self"),
            own
        );
        let refused = RunAs::decide(1000, "alice", Some("nobody"), users).expect_err("needs root");
        assert!(
            refused.to_string().contains("needs a host started by root"),
            "{refused}"
        );
    }

    #[test]
    fn an_agent_user_replaces_the_hosts_home_and_name() {
        let nobody = RunAs::decide(0, "root", None, users).expect("default");
        let env = nobody.env();
        assert!(env.contains(&("USER".into(), "nobody".into())), "{env:?}");
        assert!(
            RunAs::Host {
                name: "root".into()
            }
            .env()
            .is_empty()
        );
    }
}
