//! `chorus agents`: list live agents, least loaded first.

use std::process::ExitCode;

use super::{ConnectionArgs, print_json};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Only agents offering this capability.
    #[arg(long)]
    capability: Option<String>,
    /// Only agents in this group.
    #[arg(long)]
    group: Option<String>,
    /// Print the registry's records as one JSON array (manifest and `last_seen_ms` each).
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let agent = conn.agent().await?;
    let query = chorus_sdk::DiscoverQuery {
        capability: args.capability,
        group: args.group,
        ..Default::default()
    };
    let found = agent.discover(&query).await;
    agent.shutdown().await;
    let found =
        found.map_err(|e| anyhow::anyhow!("discovery failed (is `chorus serve` running?): {e}"))?;
    if args.json {
        print_json(&found)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!("{:<24} {:>5} {:<10} capabilities", "agent", "load", "state");
    for r in &found {
        let m = &r.manifest;
        let caps: Vec<&str> = m.capabilities.iter().map(|c| c.name.as_str()).collect();
        outln!(
            "{:<24} {:>5.2} {:<10} {}",
            m.agent,
            m.load,
            format!("{:?}", m.availability).to_lowercase(),
            caps.join(", ")
        );
        if !m.open_circuits.is_empty() {
            outln!("{:<24} circuits open: {}", "", m.open_circuits.join(", "));
        }
    }
    eprintln!("{} live agent(s)", found.len());
    Ok(ExitCode::SUCCESS)
}
