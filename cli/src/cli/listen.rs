//! `chorus listen`: print events on topics matching a pattern until Ctrl-C (or a count).

use std::process::ExitCode;

use futures::StreamExt;

use super::{ConnectionArgs, print_json};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Topic pattern.
    #[arg(default_value = ">")]
    pattern: String,
    /// Exit after this many events.
    #[arg(long)]
    count: Option<usize>,
    /// Print each event as one JSON line: `topic`, `from`, `id`, `correlation_id`,
    /// `timestamp_ms`, `seq`, `payload` (or `payload_bytes` and `content_type` when it is not
    /// JSON or MessagePack).
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let Args {
        pattern,
        count,
        json,
    } = args;
    let agent = conn.agent().await?;
    let mut events = agent.subscribe(&pattern).await?;
    let _notices = super::connection_notices(agent.broker(), conn.url());
    // `chorus bench` waits for this line on stderr: the subscription is in place.
    eprintln!("listening on {pattern} at {} (Ctrl-C to stop)", conn.url());
    let mut seen = 0;
    let stop = crate::shutdown_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            event = events.next() => {
                let Some(event) = event else { break };
                if json {
                    let e = &event.envelope;
                    let payload = event.payload_as::<serde_json::Value>().ok();
                    print_json(&serde_json::json!({
                        "topic": event.topic(),
                        "from": e.from,
                        "id": e.id,
                        "correlation_id": e.conversation(),
                        "timestamp_ms": e.timestamp_ms,
                        "seq": e.seq,
                        "payload": payload,
                        "payload_bytes": payload.is_none().then_some(e.payload.len()),
                        "content_type": payload.is_none().then_some(e.content_type.as_str()),
                    }))?;
                    seen += 1;
                    if count.is_some_and(|n| seen >= n) {
                        break;
                    }
                    continue;
                }
                let payload = event
                    .payload_as::<serde_json::Value>()
                    .map(|v| v.to_string())
                    .unwrap_or_else(|_| format!("<{} bytes of {}>", event.envelope.payload.len(), event.envelope.content_type));
                outln!("{} from {}: {payload}", event.topic(), event.envelope.from);
                seen += 1;
                if count.is_some_and(|n| seen >= n) {
                    break;
                }
            }
            _ = &mut stop => break,
        }
    }
    agent.shutdown().await;
    Ok(ExitCode::SUCCESS)
}
