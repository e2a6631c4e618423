//! `chorus usage`: what the agents handled, per customer, session, agent, endpoint or kind,
//! over a window, summed by the coordinator from the usage stream (PROTOCOL.md section 7.13).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use chorus_cli::duration::parse_duration;
use chorus_sdk::usage::{USAGE_COMMAND, UsageBy, UsageQuery, UsageSummary};
use chorus_sdk::{Call, registry::COORDINATOR_ID};

use super::{ConnectionArgs, print_json};

/// How long the coordinator may take to read the window.
const USAGE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// What to group by, comma-separated: customer, session, agent, endpoint, kind (none: one
    /// total).
    #[arg(long, value_delimiter = ',')]
    by: Vec<String>,
    /// The window: reports stored this long ago up to now.
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    since: Duration,
    /// Only this customer's usage.
    #[arg(long)]
    customer: Option<String>,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let mut by = Vec::new();
    for name in &args.by {
        match UsageBy::parse(name.trim()) {
            Some(dimension) => by.push(dimension),
            None => bail!(
                "--by {name:?}: give customer, session, agent, endpoint or kind (comma-separated)"
            ),
        }
    }
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let since = u64::try_from(args.since.as_millis()).unwrap_or(u64::MAX);
    let query = UsageQuery {
        by: by.clone(),
        since_ms: now_ms.saturating_sub(since),
        until_ms: None,
        customer: args.customer,
    };
    let agent = conn.agent().await?;
    let reply = agent
        .call(
            Call::agent(COORDINATOR_ID, USAGE_COMMAND)
                .payload(&query)?
                .timeout(USAGE_TIMEOUT),
        )
        .await;
    agent.shutdown().await;
    let summary: UsageSummary = reply
        .map_err(|e| {
            anyhow::anyhow!("the coordinator did not answer (is `chorus serve` running?): {e}")
        })?
        .payload_as()?;
    if args.json {
        print_json(&summary)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut header: Vec<String> = by.iter().map(|b| format!("{:<20}", b.as_str())).collect();
    header.extend([
        "handled".into(),
        " failed".into(),
        "  bytes in".into(),
        " bytes out".into(),
        "  handling ms".into(),
    ]);
    outln!("{}", header.join(" "));
    for line in &summary.lines {
        let mut cells: Vec<String> = by
            .iter()
            .map(|b| {
                let value = line.group.get(b.as_str()).map_or("", String::as_str);
                format!("{:<20}", if value.is_empty() { "-" } else { value })
            })
            .collect();
        cells.push(format!("{:>7}", line.handled));
        cells.push(format!("{:>7}", line.failed));
        cells.push(format!("{:>10}", line.bytes_in));
        cells.push(format!("{:>10}", line.bytes_out));
        // Agentify's `duration`: the time spent, in ms.
        cells.push(format!("{:>13}", line.handling_us.div_ceil(1000)));
        outln!("{}", cells.join(" "));
    }
    eprintln!("{} usage report(s) in the window", summary.reports);
    Ok(ExitCode::SUCCESS)
}
