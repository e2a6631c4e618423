//! Which programs a host lets manifests start (`chorus host --allow-program`, docs/HOSTING.md
//! "Who agents run as").
//!
//! Without a list every program may run (as the host's agent user). With one, a manifest's
//! `run.command` and its health command must each be on it, as the manifest writes them:
//!
//! - an absolute path (`/usr/bin/python3`): that program;
//! - a folder, ending in `/` (`/opt/agents/`): any program inside it;
//! - a name (`python3`): a command written as that name, found on the host's `PATH`.
//!
//! A relative path (`./agent`) is taken in the manifest's working folder. A path with `..` in
//! it is refused, and so is a manifest with a `[build]`: its build runs a command of its own.

use std::path::{Component, Path, PathBuf};

use crate::manifest::{HealthCheck, Manifest};

/// The programs a host allows; empty: any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedPrograms {
    entries: Vec<String>,
}

impl AllowedPrograms {
    /// A list of entries (paths, folders ending in `/`, names).
    pub fn new(entries: impl IntoIterator<Item = String>) -> AllowedPrograms {
        AllowedPrograms {
            entries: entries.into_iter().filter(|e| !e.is_empty()).collect(),
        }
    }

    /// Whether any program may run.
    pub fn is_open(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries, as given.
    pub fn entries(&self) -> &[String] {
        &self.entries
    }

    /// Whether `manifest` may run here.
    ///
    /// # Errors
    ///
    /// Why not, naming the program and what the host allows, for its `deploy_failure`.
    pub fn check(&self, manifest: &Manifest) -> Result<(), String> {
        if self.is_open() {
            return Ok(());
        }
        if manifest.build.is_some() {
            return Err(format!(
                "this host runs only the programs it allows ({}); a manifest with a [build] runs its own build command",
                self.entries.join(", ")
            ));
        }
        let cwd = manifest.run.working_dir.as_deref();
        self.program(&manifest.run.command, cwd, "run.command")?;
        if manifest.health.check == HealthCheck::Command
            && let Some(program) = manifest.health.command.first()
        {
            self.program(program, cwd, "health.command")?;
        }
        Ok(())
    }

    fn program(&self, command: &str, cwd: Option<&Path>, field: &str) -> Result<(), String> {
        let refused = || {
            format!(
                "{field} {command:?} is not a program this host allows ({})",
                self.entries.join(", ")
            )
        };
        if !command.contains('/') {
            return self
                .entries
                .iter()
                .any(|e| e == command)
                .then_some(())
                .ok_or_else(refused);
        }
        let path = match (Path::new(command).is_absolute(), cwd) {
            (true, _) => PathBuf::from(command),
            (false, Some(cwd)) => cwd.join(command),
            (false, None) => {
                return Err(format!(
                    "{} (a relative path without a working folder)",
                    refused()
                ));
            }
        };
        if path.components().any(|c| c == Component::ParentDir) {
            return Err(format!("{} (a path with ..)", refused()));
        }
        let path: PathBuf = path
            .components()
            .filter(|c| *c != Component::CurDir)
            .collect();
        let allowed = self
            .entries
            .iter()
            .any(|entry| match entry.strip_suffix('/') {
                Some(folder) => path.starts_with(folder) && path != Path::new(folder),
                None => entry.starts_with('/') && path == Path::new(entry),
            });
        allowed.then_some(()).ok_or_else(refused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(command: &str, cwd: Option<&str>) -> Manifest {
        let mut text = format!("id = \"a\"\n[run]\ncommand = {command:?}\n");
        if let Some(cwd) = cwd {
            text.push_str(&format!("working_dir = {cwd:?}\n"));
        }
        Manifest::from_toml(&text).expect("manifest")
    }

    fn allow(entries: &[&str]) -> AllowedPrograms {
        AllowedPrograms::new(entries.iter().map(|e| (*e).to_owned()))
    }

    #[test]
    fn without_a_list_anything_runs() {
        assert!(allow(&[]).check(&manifest("sh", None)).is_ok());
    }

    #[test]
    fn names_paths_and_folders_allow_what_they_name_and_nothing_else() {
        let list = allow(&["python3", "/usr/bin/node", "/opt/agents/"]);
        for ok in [
            manifest("python3", None),
            manifest("/usr/bin/node", None),
            manifest("/opt/agents/echo/run", None),
            manifest("./run", Some("/opt/agents/echo")),
        ] {
            assert!(list.check(&ok).is_ok(), "{:?}", ok.run.command);
        }
        for (refused, why) in [
            (manifest("sh", None), "not a program this host allows"),
            (manifest("/usr/bin/python3", None), "not a program"),
            (manifest("/opt/agents", None), "not a program"),
            (manifest("/opt/agents/../../bin/sh", None), "a path with .."),
            (manifest("./run", None), "without a working folder"),
            (manifest("./run", Some("/tmp")), "not a program"),
        ] {
            let err = list.check(&refused).expect_err(&refused.run.command);
            assert!(
                err.contains(why) && err.contains("python3, /usr/bin/node, /opt/agents/"),
                "{err}"
            );
            assert!(err.contains("run.command"), "{err}");
        }
    }

    #[test]
    fn a_health_command_and_a_build_are_checked_too() {
        let list = allow(&["python3"]);
        let health = Manifest::from_toml(
            "id = \"a\"\n[run]\ncommand = \"python3\"\n[health]\ncheck = \"command\"\ncommand = [\"sh\", \"-c\", \"true\"]\n",
        )
        .expect("manifest");
        let err = list.check(&health).expect_err("sh");
        assert!(err.contains("health.command"), "{err}");
        let build = Manifest::from_toml(
            "id = \"a\"\n[run]\ncommand = \"python3\"\n[build]\nrepository = \"https://example.com/a.git\"\ncommand = \"make\"\n",
        )
        .expect("manifest");
        assert!(list.check(&build).expect_err("build").contains("[build]"));
    }
}
