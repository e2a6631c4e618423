//! The demo's agents hosted: `chorus demo-agent NAME` runs one of them on its own, as a host runs
//! it from its manifest in `deploy/demo/` (its id from `CHORUS_AGENT_ID`, its metrics served and
//! announced to the coordinator's service discovery, what its handlers narrate printed, so kept
//! in its log under a host; SIGTERM stops it); and [`HostedDemo`] is how `chorus up` runs them: a
//! host in its own process, each manifest deployed through the coordinator.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use chorus_demo::{AGENTS, Role};
use chorus_host::manifest::Manifest;
use chorus_host::service::Host;
use chorus_sdk::{Agent, AgentOptions};

use super::ConnectionArgs;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Which of the demo's agents.
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(AGENTS))]
    name: String,
    /// Where it serves its metrics, announced to the coordinator for Prometheus (/sd/agents).
    #[arg(long, default_value = "127.0.0.1:0")]
    metrics_addr: SocketAddr,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let Some(role) = Role::named(&args.name) else {
        bail!(
            "no demo agent {:?}: one of {}",
            args.name,
            AGENTS.join(", ")
        );
    };
    // A replica's id, as its host sets it, or the demo's own.
    let id = std::env::var(chorus_host::process::ENV_AGENT_ID)
        .ok()
        .filter(|id| !id.trim().is_empty())
        .unwrap_or_else(|| args.name.clone());
    chorus_sdk::subject::validate_token("agent id", &id)?;
    let _otel = chorus_cli::otel::from_env()?;
    let mut signals = crate::Signals::new()?;
    let (metrics, url) = super::metrics_http::serve_metrics(args.metrics_addr, None).await?;
    let mut options = AgentOptions::new(&id)
        .broker(conn.broker_options()?)
        .root(conn.root())
        .metrics_url(&url);
    if let Some(customer) = super::agent::hosted_customer() {
        options = options.customer(customer);
    }
    let say: fn(&str) = |line| outln!("{line}");
    let agent = role.start(options, say).await?;
    outln!("{id} ({}) running; metrics at {url}", args.name);
    signals.recv().await;
    outln!("{id} stopping");
    agent.shutdown().await;
    metrics.stop().await;
    Ok(ExitCode::SUCCESS)
}

/// The name of the host `chorus up` runs (its agent is `host-local`).
const HOST_NAME: &str = "local";
/// How long the demo agents have to be healthy on the host once deployed.
const DEPLOY_WAIT: Duration = Duration::from_secs(60);

/// The demo agents as `chorus up` runs them: a host in this process and each manifest deployed
/// through the coordinator; [`HostedDemo::stop`] terminates the deployments and stops the host.
pub(crate) struct HostedDemo {
    host: Host,
    operator: Agent,
    deployments: Vec<String>,
    /// The agents' logs, gone when the demo stops.
    logs: tempfile::TempDir,
}

impl HostedDemo {
    /// Starts a host on the bus `conn` reaches and deploys `manifests` onto it, waiting until
    /// every replica is healthy.
    pub(crate) async fn start(
        conn: &ConnectionArgs,
        manifests: Vec<Manifest>,
    ) -> anyhow::Result<HostedDemo> {
        let logs = tempfile::Builder::new()
            .prefix("chorus-up-logs-")
            .tempdir()
            .context("cannot make a folder for the demo agents' logs")?;
        let mut args = super::host::Args::local(HOST_NAME, logs.path().into());
        // The agents' spans go where this process's go.
        if let Ok(endpoint) = std::env::var(chorus_cli::otel::ENDPOINT_VAR) {
            args.env
                .push((chorus_cli::otel::ENDPOINT_VAR.to_owned(), endpoint));
        }
        let (host, _, _) = super::host::start(args, conn).await?;
        let operator = conn.agent().await?;
        let deployments = manifests.iter().map(|m| m.id.clone()).collect();
        let demo = HostedDemo {
            host,
            operator,
            deployments,
            logs,
        };
        if let Err(e) = super::hosting::deploy_all(&demo.operator, manifests, DEPLOY_WAIT).await {
            demo.stop().await;
            return Err(e.context("the demo agents did not start on the host"));
        }
        Ok(demo)
    }

    /// The deployed agents' ids.
    pub(crate) fn agent_ids(&self) -> &[String] {
        &self.deployments
    }

    /// Where the agents' output is kept while the demo runs.
    pub(crate) fn log_dir(&self) -> &Path {
        self.logs.path()
    }

    /// Terminates the demo's deployments (so that no other host takes them up) and stops the
    /// host and its agents.
    pub(crate) async fn stop(self) {
        for id in &self.deployments {
            if let Err(e) = super::hosting::terminate_one(&self.operator, id).await {
                eprintln!("chorus up: could not terminate the deployment {id}: {e:#}");
            }
        }
        self.operator.shutdown().await;
        self.host.shutdown().await;
        drop(self.logs);
    }
}

/// The manifests in `dir` (every `*.toml` in it, by name), each checked.
pub(crate) fn manifests_in(dir: &Path) -> anyhow::Result<Vec<Manifest>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read the manifests in {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "toml"))
        .collect();
    paths.sort();
    if paths.is_empty() {
        bail!("no manifests (*.toml) in {}", dir.display());
    }
    paths
        .iter()
        .map(|path| Manifest::load(path).map_err(anyhow::Error::from))
        .collect()
}

/// The Python agent's manifest beside the demo's (`python/py-analyst.toml` in `dir`), run with
/// the interpreter `python`; `None` when `dir` has none.
pub(crate) fn python_manifest(dir: &Path, python: &Path) -> anyhow::Result<Option<Manifest>> {
    let path = dir
        .join("python")
        .join(format!("{}.toml", chorus_demo::PYTHON_AGENT));
    if !path.is_file() {
        return Ok(None);
    }
    let mut manifest = Manifest::load(&path)?;
    // The host may run it from another folder.
    let python =
        std::path::absolute(python).with_context(|| format!("--python {}", python.display()))?;
    manifest.run.command = python.to_string_lossy().into_owned();
    manifest.validate()?;
    Ok(Some(manifest))
}
