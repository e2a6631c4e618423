//! `chorus request`: ask an agent or a capability and print the reply.

use std::process::ExitCode;
use std::time::Duration;

use chorus_cli::duration::parse_timeout;
use chorus_sdk::Call;

use super::{ConnectionArgs, check_payload_size, parse_json, print_reply};

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["to", "capability"])))]
pub(crate) struct Args {
    /// Agent to ask.
    #[arg(long, requires = "command", conflicts_with = "capability")]
    to: Option<String>,
    /// The command's name.
    #[arg(long, requires = "to")]
    command: Option<String>,
    /// Capability to ask (any one agent serving it answers).
    #[arg(long)]
    capability: Option<String>,
    /// The payload, as JSON (default: null); `-` reads it from standard input, `@file` from a
    /// file.
    #[arg(value_name = "PAYLOAD")]
    payload: Option<String>,
    /// How long to wait for the reply.
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    timeout: Duration,
    /// Print the reply as one JSON line: `status`, `label`, `from`, `payload` (or `reason`).
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let payload = parse_json(args.payload.as_deref())?;
    let agent = conn.agent().await?;
    check_payload_size(&payload)?;
    let call = match (args.to, args.command, args.capability) {
        (Some(to), Some(command), _) => Call::agent(to, command),
        (_, _, Some(capability)) => Call::capability(capability),
        _ => anyhow::bail!("give --to with --command, or --capability"),
    };
    let code = print_reply(&agent, call, &payload, args.timeout, args.json).await?;
    agent.shutdown().await;
    Ok(code)
}
