//! `chorus notify`: push a notification to one agent, or through the coordinator to a group,
//! a capability's holders or every live agent, with a line per recipient. Nothing is answered.

use std::process::ExitCode;
use std::time::Duration;

use chorus_cli::duration::parse_timeout;
use chorus_sdk::{Notify, Outcome};

use super::{ConnectionArgs, check_payload_size, parse_json, print_json};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The notification's name (what the receiver's notification handlers are chosen by).
    #[arg(value_name = "NAME")]
    name: String,
    /// The payload, as JSON (default: null); `-` reads it from standard input, `@file` from a
    /// file.
    #[arg(value_name = "PAYLOAD")]
    payload: Option<String>,
    /// One agent, directly.
    #[arg(long, conflicts_with_all = ["all", "group", "capability"])]
    to: Option<String>,
    /// Every live agent, through the coordinator.
    #[arg(long, conflicts_with_all = ["group", "capability"])]
    all: bool,
    /// A group's live members, through the coordinator.
    #[arg(long, conflicts_with = "capability")]
    group: Option<String>,
    /// A capability's live holders, through the coordinator.
    #[arg(long)]
    capability: Option<String>,
    /// Keep it in each recipient's durable inbox until its handler takes it (otherwise it
    /// is gone for an agent that is away).
    #[arg(long)]
    durable: bool,
    /// How long to wait for the coordinator's report (a group).
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    timeout: Duration,
    /// With --durable: how long it may wait in an inbox before it is dead-lettered as
    /// expired (default: until taken).
    #[arg(long, requires = "durable", value_parser = parse_timeout)]
    ttl: Option<Duration>,
    /// Print the report as one JSON line.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let mut notify = match (args.to, args.group, args.capability, args.all) {
        (Some(to), ..) => Notify::agent(to, &args.name),
        (_, Some(group), ..) => Notify::group(group, &args.name),
        (_, _, Some(capability), _) => Notify::capability(capability, &args.name),
        (_, _, _, true) => Notify::all(&args.name),
        _ => anyhow::bail!("give --to AGENT, --group GROUP, --capability CAPABILITY or --all"),
    };
    let payload = parse_json(args.payload.as_deref())?;
    check_payload_size(&payload)?;
    notify = notify.json_payload(&payload)?.timeout(args.timeout);
    if args.durable {
        notify = notify.durable();
    }
    if let Some(ttl) = args.ttl {
        notify = notify.ttl(ttl);
    }
    let agent = conn.agent().await?;
    let report = agent.notify(notify).await;
    if report.is_ok() {
        agent.broker().flush().await?;
        conn.settle_permissions().await?;
    }
    agent.shutdown().await;
    let report = report.map_err(|e| anyhow::anyhow!("the notification: {e}"))?;
    if args.json {
        print_json(&report)?;
    } else {
        super::print_recipients(&report.recipients);
        eprintln!(
            "notification {}: {} delivered, {} stored, {} failed",
            report.id,
            report.count(Outcome::Delivered),
            report.count(Outcome::Stored),
            report.count(Outcome::Failed)
        );
    }
    let failed = report.count(Outcome::Failed) > 0;
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
