//! The coordinator each scenario runs beside its agents, started through a
//! [`CoordinatorLauncher`]: the crate does not depend on the coordinator, so `chorus chaos`
//! hands it [`ProcessLauncher`] (a `chorus serve` child process, killed with SIGKILL) and a
//! test binary hands it one that runs the coordinator in its own process.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::Context as _;
use futures::future::BoxFuture;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::WAIT;

/// What a coordinator is started for.
#[derive(Debug, Clone)]
pub struct CoordinatorSpec {
    /// The bus's server URLs.
    pub servers: Vec<String>,
    /// Replicas of the streams and buckets it provisions (the inbox included): 1 on one
    /// server, 3 on a cluster.
    pub replicas: usize,
}

/// Starts coordinators for the scenarios.
pub trait CoordinatorLauncher: Send + Sync + std::fmt::Debug {
    /// A coordinator on the bus `spec` describes, with the default root; returns once it
    /// serves.
    fn start<'a>(
        &'a self,
        spec: &'a CoordinatorSpec,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn RunningCoordinator>>>;
}

/// A coordinator a [`CoordinatorLauncher`] started.
pub trait RunningCoordinator: Send + std::fmt::Debug {
    /// Kills it as `kill -9` would: no drain, nothing acknowledged on its way out.
    fn kill(self: Box<Self>) -> BoxFuture<'static, ()>;
    /// Stops it gracefully and waits for it (with a deadline).
    fn shutdown(self: Box<Self>) -> BoxFuture<'static, ()>;
    /// Its process id, if it runs in a process of its own (none: it runs in this one).
    fn pid(&self) -> Option<u32> {
        None
    }
}

/// Runs `<program> serve --server <urls>` as a child process: `chorus chaos` passes its own
/// executable. Its metrics listen on a free loopback port; its log goes nowhere.
#[derive(Debug, Clone)]
pub struct ProcessLauncher {
    program: PathBuf,
}

impl ProcessLauncher {
    /// A launcher of `program serve`.
    pub fn new(program: impl Into<PathBuf>) -> Self {
        ProcessLauncher {
            program: program.into(),
        }
    }
}

/// The line `chorus serve` prints once the coordinator serves.
const READY_LINE: &str = "chorus serve: coordinator";

impl CoordinatorLauncher for ProcessLauncher {
    fn start<'a>(
        &'a self,
        spec: &'a CoordinatorSpec,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn RunningCoordinator>>> {
        Box::pin(async move {
            let replicas = spec.replicas.to_string();
            let mut command = tokio::process::Command::new(&self.program);
            // The bus is the scenario's, whatever this shell's environment says of another
            // (a root, credentials, a config override).
            for (name, _) in std::env::vars_os() {
                if name.to_string_lossy().starts_with("CHORUS_") {
                    command.env_remove(name);
                }
            }
            let mut child = command
                .arg("serve")
                .arg("--server")
                .arg(spec.servers.join(","))
                .env("CHORUS_SERVE__METRICS_ADDR", "127.0.0.1:0")
                .env("CHORUS_SERVE__REPLICAS", &replicas)
                .env("CHORUS_SERVE__INBOX__REPLICAS", &replicas)
                .env("RUST_LOG", "error")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("cannot run {} serve", self.program.display()))?;
            let stdout = child
                .stdout
                .take()
                .context("the coordinator's stdout is not piped")?;
            let mut lines = BufReader::new(stdout).lines();
            let ready = tokio::time::timeout(WAIT, async {
                while let Some(line) = lines.next_line().await? {
                    if line.starts_with(READY_LINE) {
                        return Ok(true);
                    }
                }
                Ok::<_, std::io::Error>(false)
            })
            .await;
            match ready {
                Ok(Ok(true)) => Ok(Box::new(ChildCoordinator {
                    child,
                    _stdout: lines,
                }) as Box<dyn RunningCoordinator>),
                Ok(Ok(false)) => {
                    let status = child.wait().await.ok();
                    anyhow::bail!("chorus serve exited before it served ({status:?})")
                }
                Ok(Err(e)) => Err(e).context("cannot read chorus serve's output"),
                Err(_) => anyhow::bail!("chorus serve did not serve within {WAIT:?}"),
            }
        })
    }
}

/// A `chorus serve` child process; killed if dropped.
#[derive(Debug)]
struct ChildCoordinator {
    child: tokio::process::Child,
    /// Kept open so that what it prints on its way out has somewhere to go.
    _stdout: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl RunningCoordinator for ChildCoordinator {
    fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    fn kill(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            // SIGKILL.
            let _ = self.child.start_kill();
            let _ = tokio::time::timeout(WAIT, self.child.wait()).await;
        })
    }

    fn shutdown(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            // SIGTERM through kill(1): the workspace has no unsafe code for kill(2).
            if let Some(pid) = self.child.id() {
                let _ = tokio::process::Command::new("kill")
                    .arg("-TERM")
                    .arg(pid.to_string())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .await;
            }
            if tokio::time::timeout(WAIT, self.child.wait()).await.is_err() {
                let _ = self.child.start_kill();
                let _ = tokio::time::timeout(WAIT, self.child.wait()).await;
            }
        })
    }
}
