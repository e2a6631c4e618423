//! `chorus listen`: print events on topics matching a pattern until Ctrl-C (or a count).

use std::process::ExitCode;

use futures::StreamExt;

use super::ConnectionArgs;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Topic pattern.
    #[arg(default_value = ">")]
    pattern: String,
    /// Exit after this many events.
    #[arg(long)]
    count: Option<usize>,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let Args { pattern, count } = args;
    let agent = conn.agent().await?;
    let mut events = agent.subscribe(&pattern).await?;
    // `chorus bench` waits for this line on stderr: the subscription is in place.
    eprintln!("listening on {pattern} at {} (Ctrl-C to stop)", conn.url());
    let mut seen = 0;
    let stop = crate::shutdown_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            event = events.next() => {
                let Some(event) = event else { break };
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
