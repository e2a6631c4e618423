//! `chorus context`: saved connection settings, as `nats context` keeps them.
//!
//! A context is a named set of the connection flags (`--server`, `--tls-*`, `--nkey-file`,
//! `--id`, `--root`), saved as JSON in `<config>/contexts/<name>.json`, where `<config>` is
//! `$CHORUS_CONFIG_DIR`, or `$XDG_CONFIG_HOME/chorus`, or `~/.config/chorus`. One may be
//! selected (`<config>/context`); `--context NAME` (`CHORUS_CONTEXT`) picks one for a single
//! command. A flag or its environment variable wins over the context, which wins over the
//! defaults. `chorus serve` reads its own config file and takes no context.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};

use super::print_json;

/// The saved settings: every field optional, paths absolute.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct Saved {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) server: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_ca: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_cert: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_key: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) nkey_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) root: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) js_domain: Option<String>,
}

impl Saved {
    fn is_empty(&self) -> bool {
        *self == Saved::default()
    }

    /// `self`'s settings where `over` has none.
    pub(crate) fn under(self, over: Saved) -> Saved {
        Saved {
            server: over.server.or(self.server),
            tls_ca: over.tls_ca.or(self.tls_ca),
            tls_cert: over.tls_cert.or(self.tls_cert),
            tls_key: over.tls_key.or(self.tls_key),
            nkey_file: over.nkey_file.or(self.nkey_file),
            id: over.id.or(self.id),
            root: over.root.or(self.root),
            js_domain: over.js_domain.or(self.js_domain),
        }
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Save the connection flags given with this command (--server, --tls-*, --nkey-file,
    /// --id, --root, --js-domain) under NAME, replacing one of that name.
    Save {
        /// The context's name: letters, digits, `-` and `_`.
        name: String,
        /// Also select it for the commands that follow.
        #[arg(long)]
        select: bool,
    },
    /// Select NAME for the commands that follow (`--context` still picks another for one).
    Select {
        /// A saved context.
        name: String,
    },
    /// List the saved contexts; the selected one is marked `*`.
    Ls {
        /// One JSON line: `[{name, selected, settings}]`.
        #[arg(long)]
        json: bool,
    },
    /// Print a context's settings (the selected one's without NAME).
    Show {
        /// A saved context.
        name: Option<String>,
        /// As one JSON line.
        #[arg(long)]
        json: bool,
    },
    /// Delete a saved context (unselecting it if it was selected).
    Rm {
        /// A saved context.
        name: String,
    },
}

/// Where contexts live.
pub(crate) fn config_dir() -> anyhow::Result<PathBuf> {
    let from_env = |var: &str| {
        std::env::var_os(var)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = from_env("CHORUS_CONFIG_DIR") {
        return Ok(dir);
    }
    if let Some(dir) = from_env("XDG_CONFIG_HOME") {
        return Ok(dir.join("chorus"));
    }
    match from_env("HOME") {
        Some(home) => Ok(home.join(".config").join("chorus")),
        None => bail!("no place for contexts: set CHORUS_CONFIG_DIR, XDG_CONFIG_HOME or HOME"),
    }
}

fn validate_name(name: &str) -> anyhow::Result<()> {
    let valid = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !valid {
        bail!("invalid context name {name:?}: use letters, digits, `-` and `_`");
    }
    Ok(())
}

fn context_file(dir: &Path, name: &str) -> PathBuf {
    dir.join("contexts").join(format!("{name}.json"))
}

fn selected_file(dir: &Path) -> PathBuf {
    dir.join("context")
}

/// The names of the saved contexts, sorted.
fn names(dir: &Path) -> anyhow::Result<Vec<String>> {
    let entries = match std::fs::read_dir(dir.join("contexts")) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).context(format!("cannot read {}", dir.display())),
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .map(str::to_owned)
        })
        .collect();
    names.sort();
    Ok(names)
}

/// The selected context's name, if one is selected.
fn selected(dir: &Path) -> anyhow::Result<Option<String>> {
    match std::fs::read_to_string(selected_file(dir)) {
        Ok(text) => Ok(Some(text.trim().to_owned()).filter(|n| !n.is_empty())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).context("cannot read the selected context"),
    }
}

fn load(dir: &Path, name: &str) -> anyhow::Result<Saved> {
    validate_name(name)?;
    let path = context_file(dir, name);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let known = names(dir)?;
            bail!(
                "no context {name:?} (saved: {}); `chorus context save {name} --server ...` \
                 makes one",
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            );
        }
        Err(e) => return Err(e).context(format!("cannot read {}", path.display())),
    };
    serde_json::from_str(&text).with_context(|| format!("context {name:?} does not read"))
}

/// The context a command runs with: `--context` (or `CHORUS_CONTEXT`), else the selected one.
pub(crate) fn active(named: Option<&str>) -> anyhow::Result<Saved> {
    let dir = config_dir()?;
    match named {
        Some(name) => load(&dir, name),
        None => match selected(&dir)? {
            Some(name) => load(&dir, &name).with_context(|| {
                format!("the selected context {name:?} (`chorus context select`)")
            }),
            None => Ok(Saved::default()),
        },
    }
}

/// A path as saved: absolute, so the context works from any directory.
fn absolute(path: Option<PathBuf>) -> anyhow::Result<Option<PathBuf>> {
    path.map(|p| std::path::absolute(&p).with_context(|| format!("{}", p.display())))
        .transpose()
}

pub(crate) fn run(args: Args, given: Saved) -> anyhow::Result<ExitCode> {
    let dir = config_dir()?;
    match args.action {
        Action::Save { name, select } => {
            validate_name(&name)?;
            let saved = Saved {
                tls_ca: absolute(given.tls_ca)?,
                tls_cert: absolute(given.tls_cert)?,
                tls_key: absolute(given.tls_key)?,
                nkey_file: absolute(given.nkey_file)?,
                ..given
            };
            if saved.is_empty() {
                bail!(
                    "nothing to save: give the settings with the command, e.g. `chorus --server \
                     nats://host:4222 --nkey-file ops.nk context save {name}`"
                );
            }
            let path = context_file(&dir, &name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("cannot create {}", parent.display()))?;
            }
            std::fs::write(&path, serde_json::to_string_pretty(&saved)? + "\n")
                .with_context(|| format!("cannot write {}", path.display()))?;
            outln!("chorus: saved context {name:?} in {}", path.display());
            if select {
                write_selected(&dir, &name)?;
                outln!("chorus: selected context {name:?}");
            }
        }
        Action::Select { name } => {
            load(&dir, &name)?;
            write_selected(&dir, &name)?;
            outln!("chorus: selected context {name:?}");
        }
        Action::Ls { json } => {
            let current = selected(&dir)?;
            let mut rows = Vec::new();
            for name in names(&dir)? {
                let settings = load(&dir, &name)?;
                let is_selected = current.as_deref() == Some(name.as_str());
                rows.push(serde_json::json!({
                    "name": name, "selected": is_selected, "settings": settings,
                }));
                if !json {
                    let mark = if is_selected { "*" } else { " " };
                    let server = settings.server.as_deref().unwrap_or("(default server)");
                    outln!("{mark} {name:<16} {server}");
                }
            }
            if json {
                print_json(&rows)?;
            } else if rows.is_empty() {
                outln!("no contexts saved; `chorus --server URL context save NAME` saves one");
            }
        }
        Action::Show { name, json } => {
            let Some(name) = name.or(selected(&dir)?) else {
                bail!("no context selected; name one: `chorus context show NAME`");
            };
            let settings = load(&dir, &name)?;
            if json {
                print_json(&settings)?;
            } else {
                outln!("context {name}");
                let show = |key: &str, value: Option<String>| {
                    if let Some(v) = value {
                        outln!("  {key:<10} {v}");
                    }
                };
                let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
                show("server", settings.server.clone());
                show("tls-ca", path(&settings.tls_ca));
                show("tls-cert", path(&settings.tls_cert));
                show("tls-key", path(&settings.tls_key));
                show("nkey-file", path(&settings.nkey_file));
                show("id", settings.id.clone());
                show("root", settings.root.clone());
            }
        }
        Action::Rm { name } => {
            validate_name(&name)?;
            let path = context_file(&dir, &name);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    bail!("no context {name:?}")
                }
                Err(e) => return Err(e).context(format!("cannot remove {}", path.display())),
            }
            if selected(&dir)?.as_deref() == Some(name.as_str()) {
                std::fs::remove_file(selected_file(&dir)).context("cannot unselect")?;
            }
            outln!("chorus: removed context {name:?}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn write_selected(dir: &Path, name: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::write(selected_file(dir), format!("{name}\n")).context("cannot select")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_wins_over_the_context_which_fills_the_rest() {
        let context = Saved {
            server: Some("nats://saved:4222".into()),
            id: Some("ops".into()),
            ..Saved::default()
        };
        let flags = Saved {
            server: Some("nats://flag:4222".into()),
            ..Saved::default()
        };
        let merged = context.under(flags);
        assert_eq!(merged.server.as_deref(), Some("nats://flag:4222"));
        assert_eq!(merged.id.as_deref(), Some("ops"));
        assert_eq!(merged.root, None);
    }

    #[test]
    fn names_are_one_safe_token() {
        assert!(validate_name("prod-eu_1").is_ok());
        for bad in ["", "../x", "a b", "a.b", "a/b"] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }
}
