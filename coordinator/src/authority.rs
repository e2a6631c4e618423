//! Who may do what: the roles of the bus and the commands each one opens (docs/SECURITY.md,
//! "Roles and authority").
//!
//! A connection proves who it is at the door; the power is checked here, where it is used.
//! Every coordinator command that changes the bus or runs code names the [`Action`] it is, and
//! the coordinator asks [`decide`] before it acts: the sender's role comes from the
//! `[authority]` configuration, and counts only for a sender whose signature verified against
//! the key the configuration holds for it (`trusted_keys`), unless the bus runs without
//! signatures (`require_signed = false`), where the `from` alone is taken.
//!
//! This room is pure: the signature arithmetic happens in the service, which passes the
//! result as a [`Proof`].

use serde::{Deserialize, Serialize};

use chorus_sdk::StatusCode;

/// A role: what a sender may do besides being an agent. Each role includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Every sender: register, discover, broadcast, call agents.
    Agent,
    /// Reads the bus's state: deployments, hosts, hosted agents' logs, usage.
    Operator,
    /// Changes the bus and runs code: deploy, scale, terminate.
    Admin,
}

impl Role {
    /// Its name, as the docs and refusals say it.
    pub fn name(self) -> &'static str {
        match self {
            Role::Agent => "agent",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

/// A coordinator command that needs more than the agent role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// `deploy`: runs a program on hosts.
    Deploy,
    /// `scale`: starts or stops replicas.
    Scale,
    /// `terminate`: stops a deployment.
    Terminate,
    /// `deployments`: lists the deployments.
    Deployments,
    /// `hosts`: lists the hosts.
    Hosts,
    /// `logs`: reads a hosted agent's output.
    Logs,
    /// `usage`: reads what every agent handled, by customer.
    Usage,
}

impl Action {
    /// The role it needs.
    pub fn needs(self) -> Role {
        match self {
            Action::Deploy | Action::Scale | Action::Terminate => Role::Admin,
            Action::Deployments | Action::Hosts | Action::Logs | Action::Usage => Role::Operator,
        }
    }

    /// The command's name.
    pub fn name(self) -> &'static str {
        match self {
            Action::Deploy => "deploy",
            Action::Scale => "scale",
            Action::Terminate => "terminate",
            Action::Deployments => "deployments",
            Action::Hosts => "hosts",
            Action::Logs => "logs",
            Action::Usage => "usage",
        }
    }
}

/// The ids the CLI connects as when not told (`cli-<pid>`): the admins of a development bus.
pub const DEVELOPMENT_ADMINS: &str = "cli-*";

/// `[authority]`: who holds which role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthorityConfig {
    /// Ids with the admin role: an agent id, or a prefix ending in `*` (`cli-*`).
    pub admins: Vec<String>,
    /// Ids with the operator role, written the same way.
    pub operators: Vec<String>,
    /// Whether a role counts only for a sender whose signature verified against its key in
    /// `trusted_keys`. Unset: yes when the coordinator itself connects with an nkey (a secured
    /// bus), no otherwise (a development bus, where the `from` alone is taken).
    pub require_signed: Option<bool>,
}

impl Default for AuthorityConfig {
    fn default() -> Self {
        AuthorityConfig {
            admins: vec![DEVELOPMENT_ADMINS.to_owned()],
            operators: Vec::new(),
            require_signed: None,
        }
    }
}

/// Whether `id` is one `pattern` names: the same id, or one starting with what comes before a
/// final `*`.
fn names(pattern: &str, id: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => id.starts_with(prefix),
        None => pattern == id,
    }
}

impl AuthorityConfig {
    /// The role `id` holds by the configuration.
    pub fn role_of(&self, id: &str) -> Role {
        if self.admins.iter().any(|p| names(p, id)) {
            Role::Admin
        } else if self.operators.iter().any(|p| names(p, id)) {
            Role::Operator
        } else {
            Role::Agent
        }
    }

    /// Checks every pattern: an agent id, or a non-empty prefix of one followed by `*`.
    ///
    /// # Errors
    /// Which entry is not a valid id or pattern.
    pub fn validate(&self) -> Result<(), String> {
        for (list, patterns) in [("admins", &self.admins), ("operators", &self.operators)] {
            for pattern in patterns {
                let id = pattern.strip_suffix('*').unwrap_or(pattern);
                let id = id.trim_end_matches(['-', '_']);
                chorus_sdk::subject::validate_token("agent id", id).map_err(|e| {
                    format!("authority.{list}: {pattern:?} is not an agent id or a prefix ending in *: {e}")
                })?;
            }
        }
        Ok(())
    }
}

/// What the service found of the sender's signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proof {
    /// It verified against the key the configuration holds for the sender.
    Verified,
    /// The message is unsigned, or signed by a sender whose key the configuration does not
    /// hold.
    Unproven,
}

/// Why a sender may not do something.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// 5007 (a role it does not hold) or 5014 (unproven where proof is required).
    pub status: StatusCode,
    /// The refusal's words: what was asked, what it needs, what the sender holds.
    pub reason: String,
    /// The metric label: `role` or `unsigned`.
    pub label: &'static str,
}

/// Decides whether `from` may do `action`: the role it holds counts when its signature
/// verified, or when the bus does not require one.
///
/// # Errors
/// A [`Refusal`] saying why not.
pub fn decide(
    config: &AuthorityConfig,
    require_signed: bool,
    from: &str,
    proof: Proof,
    action: Action,
) -> Result<Role, Refusal> {
    let needs = action.needs();
    if needs == Role::Agent {
        return Ok(Role::Agent);
    }
    let held = config.role_of(from);
    if held < needs {
        return Err(Refusal {
            status: StatusCode::ACCESS,
            reason: format!(
                "{} needs the {} role; {from:?} holds {} (the coordinator's [authority] names \
                 who holds which role: docs/SECURITY.md)",
                action.name(),
                needs.name(),
                held.name()
            ),
            label: "role",
        });
    }
    if require_signed && proof != Proof::Verified {
        return Err(Refusal {
            status: StatusCode::UNAUTHORIZED,
            reason: format!(
                "{} needs the {} role, which counts only for a signed sender: sign as {from:?} \
                 with the key in the coordinator's trusted_keys",
                action.name(),
                needs.name()
            ),
            label: "unsigned",
        });
    }
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(admins: &[&str], operators: &[&str]) -> AuthorityConfig {
        AuthorityConfig {
            admins: admins.iter().map(|s| (*s).to_owned()).collect(),
            operators: operators.iter().map(|s| (*s).to_owned()).collect(),
            require_signed: None,
        }
    }

    #[test]
    fn roles_come_from_the_names_and_patterns_configured() {
        let c = config(&["ops", "cli-*"], &["grafana"]);
        assert_eq!(c.role_of("ops"), Role::Admin);
        assert_eq!(c.role_of("cli-4242"), Role::Admin);
        assert_eq!(c.role_of("grafana"), Role::Operator);
        assert_eq!(c.role_of("ops2"), Role::Agent);
        assert_eq!(c.role_of("cli"), Role::Agent);
        assert_eq!(c.role_of("nlp-agent"), Role::Agent);
        c.validate().expect("valid patterns");
        assert!(
            config(&["*"], &[]).validate().is_err(),
            "everyone is not a pattern"
        );
        assert!(config(&["a b"], &[]).validate().is_err());
        assert!(config(&[], &["x.>"]).validate().is_err());
    }

    #[test]
    fn hosting_needs_an_admin_and_reading_it_an_operator() {
        let c = config(&["ops"], &["grafana"]);
        for action in [Action::Deploy, Action::Scale, Action::Terminate] {
            assert_eq!(
                decide(&c, false, "ops", Proof::Unproven, action),
                Ok(Role::Admin)
            );
            let refused = decide(&c, false, "grafana", Proof::Verified, action)
                .expect_err("an operator does not deploy");
            assert_eq!(refused.status, StatusCode::ACCESS);
            assert_eq!(refused.label, "role");
            assert!(refused.reason.contains("admin role"), "{}", refused.reason);
            assert!(refused.reason.contains("\"grafana\" holds operator"));
        }
        for action in [
            Action::Deployments,
            Action::Hosts,
            Action::Logs,
            Action::Usage,
        ] {
            assert!(decide(&c, false, "grafana", Proof::Unproven, action).is_ok());
            assert!(decide(&c, false, "ops", Proof::Unproven, action).is_ok());
            let refused = decide(&c, false, "nlp-agent", Proof::Verified, action)
                .expect_err("an agent reads no hosting state");
            assert_eq!(refused.status, StatusCode::ACCESS);
        }
    }

    #[test]
    fn where_signatures_are_required_a_role_counts_only_for_a_verified_sender() {
        let c = config(&["ops"], &[]);
        let refused = decide(&c, true, "ops", Proof::Unproven, Action::Deploy)
            .expect_err("an unproven claim to be ops");
        assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
        assert_eq!(refused.label, "unsigned");
        assert_eq!(
            decide(&c, true, "ops", Proof::Verified, Action::Deploy),
            Ok(Role::Admin)
        );
        // A verified agent is still an agent.
        assert_eq!(
            decide(&c, true, "nlp-agent", Proof::Verified, Action::Deploy).map_err(|r| r.status),
            Err(StatusCode::ACCESS)
        );
    }
}
