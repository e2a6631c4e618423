//! `chorus send`: publish an event, send a command and print its result, or store a command
//! in an agent's durable inbox.

use std::process::ExitCode;
use std::time::Duration;

use chorus_cli::duration::parse_timeout;
use chorus_sdk::Call;

use super::{ConnectionArgs, check_payload_size, parse_json, print_json, print_reply};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Topic of the event to publish.
    #[arg(long, conflicts_with_all = ["to", "command"], required_unless_present = "to")]
    topic: Option<String>,
    /// Agent to send a command to.
    #[arg(long, requires = "command")]
    to: Option<String>,
    /// The command's name.
    #[arg(long, requires = "to")]
    command: Option<String>,
    /// The payload, as JSON (default: null); `-` reads it from standard input, `@file` from a
    /// file.
    #[arg(value_name = "PAYLOAD")]
    payload: Option<String>,
    /// How long to wait for a command's result (with --durable: how long it may wait in
    /// the inbox before it expires).
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    timeout: Duration,
    /// Store the command in the agent's durable inbox instead of waiting for a result.
    #[arg(long, requires = "to")]
    durable: bool,
    /// Print the outcome as one JSON line.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let payload = parse_json(args.payload.as_deref())?;
    let agent = conn.agent().await?;
    check_payload_size(&payload)?;
    let timeout = args.timeout;
    let code = match (args.topic, args.to, args.command) {
        (None, Some(to), Some(command)) if args.durable => {
            let call = Call::agent(to.clone(), command)
                .command()
                .json_payload(&payload)?
                .timeout(timeout);
            let receipt = agent.send_durable(call).await?;
            if args.json {
                print_json(&serde_json::json!({
                    "stored_for": to,
                    "id": receipt.id,
                    "stream_seq": receipt.stream_seq,
                    "duplicate": receipt.duplicate,
                }))?;
            } else {
                outln!(
                    "stored for {to}: message {} at inbox sequence {}{}",
                    receipt.id,
                    receipt.stream_seq.unwrap_or_default(),
                    if receipt.duplicate {
                        " (already there)"
                    } else {
                        ""
                    }
                );
            }
            ExitCode::SUCCESS
        }
        (Some(topic), _, _) => {
            agent.publish(&topic, &payload).await?;
            agent.broker().flush().await?;
            conn.settle_permissions().await?;
            if args.json {
                print_json(&serde_json::json!({ "published_to": topic }))?;
            } else {
                outln!("published to {topic}");
            }
            ExitCode::SUCCESS
        }
        (None, Some(to), Some(command)) => {
            let call = Call::agent(to, command).command();
            print_reply(&agent, call, &payload, timeout, args.json).await?
        }
        _ => anyhow::bail!("give --topic, or --to with --command"),
    };
    agent.shutdown().await;
    Ok(code)
}
