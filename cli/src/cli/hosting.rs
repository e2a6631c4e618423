//! The hosted agents' commands, answered by the coordinator (docs/HOSTING.md): `chorus deploy
//! MANIFEST` (and wait for each replica's `deploy_confirm`, or say its `deploy_failure`),
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
    COORDINATOR, DEPLOY_CONFIRM, DEPLOY_FAILURE, DeployConfirm, DeployFailure, DeployRequest,
    DeploymentView, HostReport, LogLines, LogsRequest, ScaleRequest, TerminateRequest,
    coordinator_commands,
};
use chorus_sdk::{Agent, Call, Context};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

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
    /// How long to wait for every replica's deploy_confirm (0s: do not wait).
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
    /// How long to wait for new replicas' deploy_confirm (0s: do not wait).
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

/// The confirmations and failures published from now on.
async fn outcomes(
    agent: &Agent,
) -> anyhow::Result<mpsc::UnboundedReceiver<Result<DeployConfirm, DeployFailure>>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let ok = tx.clone();
    agent
        .on_event(DEPLOY_CONFIRM, move |_ctx: Context, c: DeployConfirm| {
            let _ = ok.send(Ok(c));
            async { Ok(()) }
        })
        .await?;
    agent
        .on_event(DEPLOY_FAILURE, move |_ctx: Context, f: DeployFailure| {
            let _ = tx.send(Err(f));
            async { Ok(()) }
        })
        .await?;
    Ok(rx)
}

/// Prints where each replica went; waits for the confirmations of `waiting` (agent ids).
async fn report(
    view: &DeploymentView,
    mut events: mpsc::UnboundedReceiver<Result<DeployConfirm, DeployFailure>>,
    wait: Duration,
    json: bool,
) -> anyhow::Result<ExitCode> {
    if json {
        print_json(view)?;
    } else {
        for placed in &view.placed {
            eprintln!("{} -> host {}", placed.agent, placed.host);
        }
    }
    for (replica, reason) in &view.failed {
        eprintln!(
            "replica {replica} of {} not running: {reason}",
            view.deployment
        );
    }
    let mut waiting: BTreeSet<String> = view.placed.iter().map(|p| p.agent.clone()).collect();
    let mut failed = !view.failed.is_empty();
    if wait.is_zero() || waiting.is_empty() {
        return Ok(if failed {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        });
    }
    let deadline = tokio::time::Instant::now() + wait;
    while !waiting.is_empty() {
        let event = match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(event)) => event,
            Ok(None) => break,
            Err(_) => {
                let left: Vec<&str> = waiting.iter().map(String::as_str).collect();
                bail!(
                    "no deploy_confirm within {wait:?} from {} (see `chorus logs AGENT`)",
                    left.join(", ")
                );
            }
        };
        match event {
            Ok(c) if waiting.remove(&c.agent) => {
                eprintln!(
                    "{} running on {} (pid {}, {})",
                    c.agent,
                    c.host,
                    c.pid.map_or("?".into(), |p| p.to_string()),
                    c.health
                );
            }
            Err(f) if waiting.remove(&f.agent) => {
                eprintln!(
                    "{} failed{}: {}",
                    f.agent,
                    f.host.map(|h| format!(" on {h}")).unwrap_or_default(),
                    f.reason
                );
                failed = true;
            }
            _ => {}
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

pub(crate) async fn deploy(args: DeployArgs, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let mut manifest = Manifest::load(&args.manifest)?;
    if let Some(replicas) = args.replicas {
        manifest.replicas = replicas;
        manifest.validate()?;
    }
    let agent = conn.agent().await?;
    let events = outcomes(&agent).await?;
    let view: DeploymentView = ask(
        &agent,
        coordinator_commands::DEPLOY,
        &DeployRequest { manifest },
        COORDINATOR_TIMEOUT,
    )
    .await?;
    let code = report(&view, events, args.wait, args.json).await;
    agent.shutdown().await;
    code
}

pub(crate) async fn scale(args: ScaleArgs, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let agent = conn.agent().await?;
    let events = outcomes(&agent).await?;
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
    let code = report(&view, events, args.wait, args.json).await;
    agent.shutdown().await;
    code
}

pub(crate) async fn terminate(
    args: TerminateArgs,
    conn: &ConnectionArgs,
) -> anyhow::Result<ExitCode> {
    let agent = conn.agent().await?;
    let view: anyhow::Result<DeploymentView> = ask(
        &agent,
        coordinator_commands::TERMINATE,
        &TerminateRequest {
            deployment: args.deployment,
        },
        COORDINATOR_TIMEOUT,
    )
    .await;
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
    let views: anyhow::Result<Vec<DeploymentView>> = ask(
        &agent,
        coordinator_commands::DEPLOYMENTS,
        &serde_json::json!({}),
        COORDINATOR_TIMEOUT,
    )
    .await;
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
