//! The hosted agents' commands, answered by the coordinator (docs/HOSTING.md): `chorus deploy
//! MANIFEST` (and wait until each replica is healthy on its host, or say why it failed),
//! `chorus scale AGENT N`, `chorus terminate AGENT`, `chorus deployments`, `chorus hosts` and
//! `chorus logs AGENT`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use chorus_cli::duration::parse_timeout;
use chorus_host::manifest::Manifest;
use chorus_host::protocol::{
    COORDINATOR, DeployRequest, DeploymentView, HostReport, LogLines, LogsRequest, ScaleRequest,
    TerminateRequest, coordinator_commands,
};
use chorus_sdk::{Agent, Call};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{ConnectionArgs, print_json};

/// How long a hosting command waits for the coordinator (it places and tells the hosts before
/// it answers).
const COORDINATOR_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, clap::Args)]
pub(crate) struct DeployArgs {
    /// The agent's manifest (TOML, docs/HOSTING.md).
    manifest: PathBuf,
    /// Replicas, instead of the manifest's.
    #[arg(long)]
    replicas: Option<u32>,
    /// How long to wait until every replica is healthy on its host (0s: do not wait).
    #[arg(long, default_value = "60s", value_parser = chorus_cli::duration::parse_duration)]
    wait: Duration,
    /// Print the placement as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ScaleArgs {
    /// The deployment (its manifest's id).
    deployment: String,
    /// Replicas wanted.
    replicas: u32,
    /// How long to wait until every replica is healthy on its host (0s: do not wait).
    #[arg(long, default_value = "60s", value_parser = chorus_cli::duration::parse_duration)]
    wait: Duration,
    /// Print the placement as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct TerminateArgs {
    /// The deployment (its manifest's id).
    deployment: String,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ListArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct LogsArgs {
    /// The hosted agent (a replica's id: `calculator`, `calculator-2`).
    agent: String,
    /// Lines from the end.
    #[arg(long, short = 'n', default_value_t = 100)]
    lines: usize,
    /// How long to wait for the answer.
    #[arg(long, default_value = "10s", value_parser = parse_timeout)]
    timeout: Duration,
}

async fn ask<T: Serialize, R: DeserializeOwned>(
    agent: &Agent,
    command: &str,
    body: &T,
    timeout: Duration,
) -> anyhow::Result<R> {
    let reply = agent
        .call(
            Call::agent(COORDINATOR, command)
                .payload(body)?
                .timeout(timeout),
        )
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "the coordinator did not take {command} (is `chorus serve` running?): {e}"
            )
        })?;
    Ok(reply.payload_as()?)
}

/// How often `deploy` and `scale` look at the deployment while they wait.
const WAIT_POLL: Duration = Duration::from_millis(500);

/// Every deployment as the coordinator shows it now.
async fn all_deployments(agent: &Agent) -> anyhow::Result<Vec<DeploymentView>> {
    ask(
        agent,
        coordinator_commands::DEPLOYMENTS,
        &serde_json::json!({}),
        COORDINATOR_TIMEOUT,
    )
    .await
}

/// The deployment `id` as the coordinator shows it now.
async fn current(agent: &Agent, id: &str) -> anyhow::Result<DeploymentView> {
    all_deployments(agent)
        .await?
        .into_iter()
        .find(|v| v.deployment == id)
        .ok_or_else(|| anyhow::anyhow!("deployment {id} is gone (terminated meanwhile?)"))
}

/// Prints where each replica went, then waits up to `wait` until every replica that did not
/// fail is healthy on its host (its first heartbeat, or its health command passing), saying
/// each as it comes; a replica that fails meanwhile is said with its reason.
async fn report(
    agent: &Agent,
    mut view: DeploymentView,
    wait: Duration,
    json: bool,
) -> anyhow::Result<ExitCode> {
    if json {
        print_json(&view)?;
    }
    let mut said: BTreeSet<String> = BTreeSet::new();
    let mut failed: BTreeSet<u32> = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        for placed in &view.placed {
            if said.insert(format!("placed {}", placed.agent)) && !json {
                eprintln!("{} -> host {}", placed.agent, placed.host);
            }
            if placed.healthy && said.insert(placed.agent.clone()) {
                eprintln!("{} running on {}", placed.agent, placed.host);
            }
        }
        for (replica, reason) in &view.failed {
            if failed.insert(*replica) {
                let agent = chorus_host::manifest::replica_id(&view.deployment, *replica);
                eprintln!("{agent} failed: {reason}");
            }
        }
        let waiting = unhealthy(&view);
        if waiting.is_empty() || wait.is_zero() {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "not healthy within {wait:?}: {} (see `chorus deployments`, `chorus logs AGENT`)",
                waiting.join(", ")
            );
        }
        tokio::time::sleep(WAIT_POLL).await;
        view = current(agent, &view.deployment).await?;
    }
    Ok(if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The replicas of `view` that did not fail and are not yet healthy on a host.
fn unhealthy(view: &DeploymentView) -> Vec<String> {
    (1..=view.replicas)
        .filter(|r| !view.failed.contains_key(r))
        .map(|r| chorus_host::manifest::replica_id(&view.deployment, r))
        .filter(|agent| !view.placed.iter().any(|p| p.agent == *agent && p.healthy))
        .collect()
}

/// Deploys every manifest of `manifests` as `agent`, then waits up to `wait` until each
/// replica of each is healthy on its host (quietly: `chorus up` deploys its demo agents so).
/// Fails naming the replicas that failed, with their reasons, or are not healthy in time.
pub(crate) async fn deploy_all(
    agent: &Agent,
    manifests: Vec<Manifest>,
    wait: Duration,
) -> anyhow::Result<Vec<DeploymentView>> {
    let mut ids = BTreeSet::new();
    for manifest in manifests {
        ids.insert(manifest.id.clone());
        let _: DeploymentView = ask(
            agent,
            coordinator_commands::DEPLOY,
            &DeployRequest { manifest },
            COORDINATOR_TIMEOUT,
        )
        .await?;
    }
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let ours: Vec<DeploymentView> = all_deployments(agent)
            .await?
            .into_iter()
            .filter(|v| ids.contains(&v.deployment))
            .collect();
        let failed: Vec<String> = ours
            .iter()
            .flat_map(|v| {
                v.failed.iter().map(|(replica, reason)| {
                    let agent = chorus_host::manifest::replica_id(&v.deployment, *replica);
                    format!("{agent} failed: {reason}")
                })
            })
            .collect();
        if !failed.is_empty() {
            bail!("{} (see `chorus logs AGENT`)", failed.join("; "));
        }
        let gone: Vec<&String> = ids
            .iter()
            .filter(|id| !ours.iter().any(|v| v.deployment == **id))
            .collect();
        if !gone.is_empty() {
            bail!("deployments gone meanwhile (terminated?): {gone:?}");
        }
        let waiting: Vec<String> = ours.iter().flat_map(unhealthy).collect();
        if waiting.is_empty() {
            return Ok(ours);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "not healthy within {wait:?}: {} (see `chorus deployments`, `chorus logs AGENT`)",
                waiting.join(", ")
            );
        }
        tokio::time::sleep(WAIT_POLL).await;
    }
}

/// Terminates the deployment `id` as `agent`: its replicas stop and its desired state is gone.
pub(crate) async fn terminate_one(agent: &Agent, id: &str) -> anyhow::Result<DeploymentView> {
    ask(
        agent,
        coordinator_commands::TERMINATE,
        &TerminateRequest {
            deployment: id.to_owned(),
        },
        COORDINATOR_TIMEOUT,
    )
    .await
}

pub(crate) async fn deploy(args: DeployArgs, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let mut manifest = Manifest::load(&args.manifest)?;
    if let Some(replicas) = args.replicas {
        manifest.replicas = replicas;
        manifest.validate()?;
    }
    let agent = conn.agent().await?;
    let view: DeploymentView = ask(
        &agent,
        coordinator_commands::DEPLOY,
        &DeployRequest { manifest },
        COORDINATOR_TIMEOUT,
    )
    .await?;
    let code = report(&agent, view, args.wait, args.json).await;
    agent.shutdown().await;
    code
}

pub(crate) async fn scale(args: ScaleArgs, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let agent = conn.agent().await?;
    let view: DeploymentView = ask(
        &agent,
        coordinator_commands::SCALE,
        &ScaleRequest {
            deployment: args.deployment,
            replicas: args.replicas,
        },
        COORDINATOR_TIMEOUT,
    )
    .await?;
    let code = report(&agent, view, args.wait, args.json).await;
    agent.shutdown().await;
    code
}

pub(crate) async fn terminate(
    args: TerminateArgs,
    conn: &ConnectionArgs,
) -> anyhow::Result<ExitCode> {
    let agent = conn.agent().await?;
    let view = terminate_one(&agent, &args.deployment).await;
    agent.shutdown().await;
    let view = view?;
    for placed in &view.placed {
        eprintln!("{} stopped on host {}", placed.agent, placed.host);
    }
    eprintln!("deployment {} terminated", view.deployment);
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn deployments(args: ListArgs, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let agent = conn.agent().await?;
    let views = all_deployments(&agent).await;
    agent.shutdown().await;
    let views = views?;
    if args.json {
        print_json(&views)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{:<24} {:>8} {:>7} placement",
        "deployment",
        "replicas",
        "failed"
    );
    for v in &views {
        let placed: Vec<String> = v
            .placed
            .iter()
            .map(|p| format!("{}@{}", p.agent, p.host))
            .collect();
        outln!(
            "{:<24} {:>8} {:>7} {}",
            v.deployment,
            v.replicas,
            v.failed.len(),
            placed.join(" ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn hosts(args: ListArgs, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let agent = conn.agent().await?;
    let hosts: anyhow::Result<Vec<serde_json::Value>> = ask(
        &agent,
        coordinator_commands::HOSTS,
        &serde_json::json!({}),
        COORDINATOR_TIMEOUT,
    )
    .await;
    agent.shutdown().await;
    let hosts = hosts?;
    if args.json {
        print_json(&hosts)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!("{:<20} {:<7} {:>7} agents", "host", "state", "slots");
    for h in &hosts {
        let Ok(report) = serde_json::from_value::<HostReport>(h["report"].clone()) else {
            continue;
        };
        let agents: Vec<String> = report.agents().map(|a| a.agent).collect();
        let shown = match agents.len() {
            0..=12 => agents.join(" "),
            n => format!("{n} agents ({} ... {})", agents[0], agents[n - 1]),
        };
        outln!(
            "{:<20} {:<7} {:>7} {}",
            report.name,
            h["state"].as_str().unwrap_or("?"),
            report.capacity.agents,
            shown
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn logs(args: LogsArgs, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let agent = conn.agent().await?;
    let lines: anyhow::Result<LogLines> = ask(
        &agent,
        coordinator_commands::LOGS,
        &LogsRequest {
            agent: args.agent,
            lines: args.lines,
        },
        args.timeout,
    )
    .await;
    agent.shutdown().await;
    for line in lines?.lines {
        outln!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}
