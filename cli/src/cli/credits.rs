//! `chorus credits`: the credits ledger (PROTOCOL.md section 7.15): what each agent earned and
//! spent in negotiations settled at a price, or what was spent for each customer; `--rounds`
//! lists the settled rounds themselves.

use std::process::ExitCode;

use anyhow::bail;
use chorus_sdk::credits::{BalanceBy, balances};

use super::{ConnectionArgs, print_json};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// What to sum by: agent (earned and spent) or customer (spent for it).
    #[arg(long, default_value = "agent")]
    by: String,
    /// List the settled rounds instead of the balances.
    #[arg(long)]
    rounds: bool,
    /// Only rounds of this customer.
    #[arg(long)]
    customer: Option<String>,
    /// Print as JSON (one line).
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let by = match args.by.as_str() {
        "agent" => BalanceBy::Agent,
        "customer" => BalanceBy::Customer,
        other => bail!("--by {other:?}: give agent or customer"),
    };
    let agent = conn.agent().await?;
    let entries = match agent.ledger().await {
        Ok(ledger) => ledger.entries().await,
        Err(e) => Err(e),
    };
    agent.shutdown().await;
    let mut entries = entries?;
    if let Some(customer) = &args.customer {
        entries.retain(|e| e.customer.as_deref() == Some(customer.as_str()));
    }
    if args.rounds {
        if args.json {
            print_json(&entries)?;
        } else {
            outln!(
                "{:<36}  {:<20} {:<20} {:<20} {:<16} {:>10}",
                "round",
                "capability",
                "payer",
                "payee",
                "customer",
                "price"
            );
            for e in &entries {
                outln!(
                    "{:<36}  {:<20} {:<20} {:<20} {:<16} {:>10}",
                    e.round,
                    e.capability,
                    e.payer,
                    e.payee,
                    e.customer.as_deref().unwrap_or("-"),
                    e.price
                );
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let lines = balances(&entries, by);
    if args.json {
        print_json(&lines)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{:<24} {:>12} {:>12} {:>12} {:>8}",
        if by == BalanceBy::Agent {
            "agent"
        } else {
            "customer"
        },
        "earned",
        "spent",
        "net",
        "rounds"
    );
    for b in &lines {
        outln!(
            "{:<24} {:>12} {:>12} {:>12} {:>8}",
            b.name,
            b.earned,
            b.spent,
            b.earned - b.spent,
            b.rounds
        );
    }
    eprintln!("{} settled rounds", entries.len());
    Ok(ExitCode::SUCCESS)
}
