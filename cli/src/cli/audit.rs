//! `chorus audit`: who asked for what, and what came of it (docs/SECURITY.md, "The audit
//! trail"): the coordinator's hosting commands, the gateway's writes by edge identity, the web
//! console's actions by person, from the audit stream.

use std::process::ExitCode;
use std::time::Duration;

use chorus_cli::duration::parse_duration;
use chorus_sdk::audit::AuditLog;

use super::{ConnectionArgs, print_json};

const CONNECTION_NAME: &str = "chorus-audit-cli";

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The window: records this long ago up to now.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    since: Duration,
    /// Only what this actor did (an agent id, an edge identity, a console user).
    #[arg(long)]
    actor: Option<String>,
    /// The newest records shown at most.
    #[arg(long, default_value_t = 100)]
    limit: usize,
    /// Print the records as JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let subjects = conn.subjects()?;
    let broker = conn.broker(CONNECTION_NAME).await?;
    let log = AuditLog::new(&broker, subjects, conn.agent_id());
    let now_ms = chorus_sdk::envelope::now_ms();
    let since = u64::try_from(args.since.as_millis()).unwrap_or(u64::MAX);
    let entries = log
        .list(
            now_ms.saturating_sub(since),
            args.actor.as_deref(),
            args.limit,
        )
        .await?;
    if args.json {
        print_json(&entries)?;
        return Ok(ExitCode::SUCCESS);
    }
    for e in &entries {
        let r = &e.record;
        let when = super::dlq::utc(r.ms);
        let status = r.status.map(|s| format!(" {s}")).unwrap_or_default();
        let target = r
            .target
            .as_deref()
            .map(|t| format!(" {t}"))
            .unwrap_or_default();
        let detail = r
            .detail
            .as_deref()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default();
        outln!(
            "{when} {via:<11} {actor:<16} {action}{target}: {outcome}{status}{detail}",
            via = r.via,
            actor = r.actor,
            action = r.action,
            outcome = r.outcome,
        );
    }
    eprintln!(
        "{} record(s) in the last {}",
        entries.len(),
        chorus_cli::duration::format_duration(args.since)
    );
    Ok(ExitCode::SUCCESS)
}
