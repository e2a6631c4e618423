//! `chorus broadcast`: one command to all live agents, a group or a capability's holders,
//! through the coordinator, with a line per recipient.

use std::process::ExitCode;
use std::time::Duration;

use chorus_cli::duration::parse_timeout;
use chorus_sdk::{BroadcastTarget, Outcome};

use super::{ConnectionArgs, parse_json, print_json};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Every live agent.
    #[arg(long, conflicts_with_all = ["group", "capability"])]
    all: bool,
    /// A group.
    #[arg(long)]
    group: Option<String>,
    /// Holders of a capability.
    #[arg(long)]
    capability: Option<String>,
    /// The command.
    #[arg(long)]
    command: String,
    /// The payload, as JSON (default: null); `-` reads it from standard input, `@file` from a
    /// file.
    #[arg(value_name = "PAYLOAD")]
    payload: Option<String>,
    /// How long each recipient has to answer.
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    timeout: Duration,
    /// Print the coordinator's report as one JSON line.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    // `--all` is the default target; the flag only documents it.
    let target = match (args.group, args.capability) {
        (Some(g), _) => BroadcastTarget::Group(g),
        (_, Some(c)) => BroadcastTarget::Capability(c),
        _ => BroadcastTarget::All,
    };
    let payload = parse_json(args.payload.as_deref())?;
    let agent = conn.agent().await?;
    let report = agent
        .broadcast(&target, &args.command, &payload, args.timeout)
        .await;
    agent.shutdown().await;
    let report = report
        .map_err(|e| anyhow::anyhow!("broadcast failed (is `chorus serve` running?): {e}"))?;
    if args.json {
        print_json(&report)?;
        return Ok(ExitCode::SUCCESS);
    }
    super::print_recipients(&report.recipients);
    eprintln!(
        "broadcast {}: {} delivered, {} failed, {} timed out",
        report.broadcast_id,
        report.count(Outcome::Delivered),
        report.count(Outcome::Failed),
        report.count(Outcome::TimedOut)
    );
    Ok(ExitCode::SUCCESS)
}
