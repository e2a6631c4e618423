//! `chorus agents`: list live agents, least loaded first (soonest first with `--priority`),
//! with the ETA of the query's work at each.

use std::process::ExitCode;

use super::{ConnectionArgs, print_json};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Only agents offering this capability; repeat it for agents offering all of them
    /// (IACP's `capabilities`).
    #[arg(long)]
    capability: Vec<String>,
    /// Only agents in this group.
    #[arg(long)]
    group: Option<String>,
    /// Only agents whose named capabilities take requests of this many tokens (IACP's
    /// `max_tokens`; a capability that states no limit takes any).
    #[arg(long)]
    max_tokens: Option<u64>,
    /// The priority the work would be sent at (critical, high, normal, low): the ETAs are at
    /// it, and the agents listed soonest first.
    #[arg(long, value_parser = priority)]
    priority: Option<chorus_sdk::Priority>,
    /// Only agents serving this customer: those dedicated to it, and those dedicated to none.
    #[arg(long)]
    customer: Option<String>,
    /// Only agents whose availability is `available`.
    #[arg(long)]
    available_only: bool,
    /// Only agents at or below this load (0 to 1).
    #[arg(long, value_parser = load)]
    max_load: Option<f32>,
    /// Print the registry's records as one JSON array (manifest and `last_seen_ms` each).
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let query = chorus_sdk::DiscoverQuery {
        capabilities: args.capability,
        group: args.group,
        available_only: args.available_only,
        max_load: args.max_load,
        max_tokens: args.max_tokens,
        priority: args.priority,
        customer: args.customer,
        ..Default::default()
    };
    let agent = conn.agent().await?;
    let found = agent.discover(&query).await;
    agent.shutdown().await;
    let found =
        found.map_err(|e| anyhow::anyhow!("discovery failed (is `chorus serve` running?): {e}"))?;
    if args.json {
        print_json(&found)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{:<24} {:>5} {:<10} {:>9} capabilities",
        "agent",
        "load",
        "state",
        "eta"
    );
    for r in &found {
        let m = &r.manifest;
        let caps: Vec<&str> = m.capabilities.iter().map(|c| c.name.as_str()).collect();
        let eta = r
            .eta_ms
            .map_or_else(|| "-".to_owned(), |ms| format!("{ms} ms"));
        outln!(
            "{:<24} {:>5.2} {:<10} {:>9} {}",
            m.agent,
            m.load,
            format!("{:?}", m.availability).to_lowercase(),
            eta,
            caps.join(", ")
        );
        if let Some(customer) = &m.customer {
            outln!("{:<24} customer: {customer}", "");
        }
        if !m.open_circuits.is_empty() {
            outln!("{:<24} circuits open: {}", "", m.open_circuits.join(", "));
        }
    }
    eprintln!("{} live agent(s)", found.len());
    Ok(ExitCode::SUCCESS)
}

fn priority(text: &str) -> Result<chorus_sdk::Priority, String> {
    match text.parse::<chorus_sdk::Priority>() {
        Ok(chorus_sdk::Priority::Unknown) | Err(_) => {
            Err(format!("{text:?}: one of critical, high, normal, low"))
        }
        Ok(p) => Ok(p),
    }
}

fn load(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(l) if (0.0..=1.0).contains(&l) => Ok(l),
        _ => Err(format!("{text:?}: a load from 0 to 1")),
    }
}
