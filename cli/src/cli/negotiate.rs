//! `chorus negotiate`: run a contract-net round for a capability and print the bids, the award
//! and (with --wait) the winner's result.

use std::process::ExitCode;
use std::time::Duration;

use chorus_cli::duration::parse_duration;
use chorus_sdk::negotiate::{Answer, Negotiation, Policy};
use serde_json::{Value, json};

use super::{ConnectionArgs, check_payload_size, parse_json, print_json};

/// How the winner is picked.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum PolicyArg {
    /// The lowest price.
    Cheapest,
    /// The shortest ETA.
    Fastest,
    /// The highest confidence.
    Confident,
}

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The capability to call for proposals on.
    #[arg(long)]
    capability: String,
    /// The work, as JSON (default: null); `-` reads standard input, `@file` a file.
    #[arg(value_name = "PAYLOAD")]
    payload: Option<String>,
    /// Ask these agents (comma-separated) instead of the capability's live holders.
    #[arg(long, value_delimiter = ',')]
    bidders: Vec<String>,
    /// How long bidders have to answer.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    deadline: Duration,
    /// How the winner is picked.
    #[arg(long, value_enum, default_value_t = PolicyArg::Cheapest)]
    policy: PolicyArg,
    /// The customer the work is for: the winner's task carries it, and the ledger records the
    /// price under it (`chorus credits --by customer`).
    #[arg(long)]
    customer: Option<String>,
    /// Wait for the winner's task and print its result.
    #[arg(long)]
    wait: bool,
    /// Print one JSON object: the round, the bids, the winner, the task (and its result).
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let payload = parse_json(args.payload.as_deref())?;
    let agent = conn.agent().await?;
    check_payload_size(&payload)?;
    let policy = match args.policy {
        PolicyArg::Cheapest => Policy::Cheapest,
        PolicyArg::Fastest => Policy::Fastest,
        PolicyArg::Confident => Policy::MostConfident,
    };
    let mut round = Negotiation::capability(&args.capability)
        .payload(&payload)?
        .deadline(args.deadline)
        .policy(policy)
        .bidders(args.bidders);
    if let Some(customer) = args.customer {
        round = round.customer(customer);
    }
    let award = match agent.negotiate(round).await {
        Ok(award) => award,
        Err(err) => {
            agent.shutdown().await;
            return Err(err.into());
        }
    };
    let result = if args.wait {
        Some(award.task.result().await?)
    } else {
        None
    };
    let bids: Vec<Value> = award
        .bids
        .iter()
        .map(|b| match &b.answer {
            Answer::Proposed(p) => json!({"agent": b.agent, "answer": "proposed", "proposal": p}),
            Answer::Refused { status, reason } => {
                json!({"agent": b.agent, "answer": "refused", "status": status.0, "reason": reason})
            }
            Answer::Silent => json!({"agent": b.agent, "answer": "silent"}),
        })
        .collect();
    let output = result.as_ref().map(|r| {
        if r.output.is_empty() {
            Value::Null
        } else {
            chorus_sdk::codec::decode_payload::<Value>(&r.output, &r.content_type)
                .unwrap_or(Value::Null)
        }
    });
    if args.json {
        print_json(&json!({
            "round": award.round,
            "capability": award.capability,
            "winner": award.winner,
            "proposal": award.proposal,
            "task": award.task.id(),
            "bids": bids,
            "state": result.as_ref().map(|r| r.state.as_str()),
            "output": output,
        }))?;
    } else {
        outln!("round {} for {}", award.round, award.capability);
        for bid in &award.bids {
            let what = match &bid.answer {
                Answer::Proposed(p) => format!(
                    "proposed price {} eta {} confidence {}",
                    p.price.map_or("-".into(), |v| v.to_string()),
                    p.eta_ms.map_or("-".into(), |v| format!("{v} ms")),
                    p.confidence.map_or("-".into(), |v| v.to_string()),
                ),
                Answer::Refused { status, reason } => format!("refused ({status}): {reason}"),
                Answer::Silent => "silent".to_owned(),
            };
            outln!("  {:<24} {what}", bid.agent);
        }
        outln!("awarded to {}: task {}", award.winner, award.task.id());
        if let (Some(result), Some(output)) = (&result, &output) {
            outln!("{} ({}): {output}", result.state, result.status);
        }
    }
    agent.shutdown().await;
    Ok(match &result {
        Some(r) if !r.is_completed() => ExitCode::from(super::exit::REFUSED),
        _ => ExitCode::SUCCESS,
    })
}
