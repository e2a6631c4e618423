//! `chorus agent`: run one or many SDK agents that answer a capability with what they were sent
//! and who answered, the way a host runs them (docs/HOSTING.md): to try hosting, to see replicas
//! share a capability's load, and to measure scale with real agents. It is also a complete
//! example of an agent written to be hosted: who it is comes from the environment the host
//! sets, several agents share one connection, and SIGTERM stops it cleanly.

use std::process::ExitCode;

use anyhow::{Context as _, bail};
use chorus_sdk::{Agent, AgentConfig, AgentOptions, Context, HandlerError};
use serde_json::{Value, json};

use super::ConnectionArgs;

/// Agents one `chorus agent` runs at most.
const MAX_AGENTS: usize = 100_000;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The agents' ids, comma-separated [default: `CHORUS_AGENT_IDS` or `CHORUS_AGENT_ID`, as a
    /// host sets them]. Several share one connection.
    #[arg(long, value_delimiter = ',')]
    agents: Vec<String>,
    /// The capability they serve: each request is answered with its payload, the agent that
    /// answered and its process id.
    #[arg(long, default_value = "echo")]
    capability: String,
    /// Whether each agent answers NATS service discovery (`$SRV.PING`, `INFO`, `STATS`), as SDK
    /// agents do by default: three subscriptions and three tasks per agent. `false` for large
    /// fleets, where one `$SRV.PING` would be answered by every agent and the subscriptions
    /// cost the server and the process (docs/SCALE.md).
    #[arg(long, action = clap::ArgAction::Set)]
    service_discovery: Option<bool>,
    /// How often each agent announces itself (its heartbeat), in ms [default: the SDK's
    /// 5000, or the configuration file's]. Longer for large fleets: every part's heartbeat
    /// work divides with it (docs/SCALE.md); the host's health check follows the manifest's
    /// `[health] interval`, so set it to match.
    #[arg(long, value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    heartbeat_ms: Option<u64>,
    /// An agent configuration file (docs/AGENT-CONFIG.md): the bus, its TLS and credentials,
    /// delivery, signing and monitoring, as both SDKs read it; its `id` names the agent when
    /// --agents does not. The connection flags are not used then.
    #[arg(long, env = "CHORUS_AGENT_CONFIG")]
    config: Option<std::path::PathBuf>,
}

/// The customer a host runs this process for (`CHORUS_CUSTOMER`, from its manifest's
/// `customer`), so its agents' manifests say so and discovery by customer finds them.
pub(crate) fn hosted_customer() -> Option<String> {
    std::env::var(chorus_host::process::ENV_CUSTOMER)
        .ok()
        .filter(|c| !c.trim().is_empty())
}

fn ids(args: &Args, config: Option<&AgentConfig>) -> anyhow::Result<Vec<String>> {
    let from_env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let listed = if !args.agents.is_empty() {
        args.agents.join(",")
    } else if let Some(ids) = from_env("CHORUS_AGENT_IDS") {
        ids
    } else if let Some(id) = from_env("CHORUS_AGENT_ID") {
        id
    } else if let Some(id) = config.and_then(|c| c.id.clone()) {
        id
    } else {
        bail!("no agent id: give --agents, or run it under `chorus host` (CHORUS_AGENT_ID)");
    };
    let ids: Vec<String> = listed
        .split(',')
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
        .collect();
    if ids.len() > MAX_AGENTS {
        bail!(
            "{} agents: one process runs at most {MAX_AGENTS}",
            ids.len()
        );
    }
    for id in &ids {
        chorus_sdk::subject::validate_token("agent id", id)?;
    }
    Ok(ids)
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let config = match &args.config {
        Some(path) => Some(AgentConfig::from_file(path)?),
        None => None,
    };
    let ids = ids(&args, config.as_ref())?;
    let mut signals = crate::Signals::new()?;
    let options_for = |id: &str| -> anyhow::Result<AgentOptions> {
        Ok(match &config {
            Some(config) => config.options(Some(id))?,
            None => AgentOptions::new(id)
                .broker(conn.broker_options()?)
                .root(conn.root()),
        })
    };
    // One agent: a connection of its own. Several: one they share.
    let shared = if ids.len() > 1 {
        Some(
            options_for(&ids[0])?
                .broker_options()
                .clone()
                .name(format!("chorus-agent-{}", std::process::id()))
                .connect()
                .await
                .context("cannot reach the bus")?,
        )
    } else {
        None
    };
    let mut agents: Vec<Agent> = Vec::with_capacity(ids.len());
    for id in &ids {
        let mut options = options_for(id)?;
        if let Some(on) = args.service_discovery {
            options = options.service_discovery(on);
        }
        if let Some(ms) = args.heartbeat_ms {
            options = options.heartbeat_interval(std::time::Duration::from_millis(ms));
        }
        if let Some(customer) = hosted_customer() {
            options = options.customer(customer);
        }
        if let Some(connection) = &shared {
            options = options.connection(connection.clone());
        }
        let agent = options.connect().await?;
        serve(&agent, &args.capability).await?;
        agents.push(agent);
    }
    let pid = std::process::id();
    let shown = match ids.len() {
        1..=8 => ids.join(","),
        n => format!("{n} agents ({} to {})", ids[0], ids[n - 1]),
    };
    println!("{shown} serving {} (pid {pid})", args.capability);
    signals.recv().await;
    println!("{shown} stopping");
    for agent in &agents {
        agent.shutdown().await;
    }
    if let Some(connection) = shared {
        connection.drain().await?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn serve(agent: &Agent, capability: &str) -> Result<(), chorus_sdk::SdkError> {
    agent
        .on_capability(capability, |ctx: Context, payload: Value| async move {
            Ok::<_, HandlerError>(json!({
                "agent": ctx.agent_id(),
                "pid": std::process::id(),
                "payload": payload,
            }))
        })
        .await?;
    // What a broadcast to the agents asks.
    agent
        .on_command("ping", |ctx: Context, _: Value| async move {
            Ok::<_, HandlerError>(ctx.agent_id().to_owned())
        })
        .await
}
