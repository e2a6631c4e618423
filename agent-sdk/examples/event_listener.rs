//! Listens to events on `task.>` and prints each, until Ctrl-C, SIGTERM, or as many events as
//! its first argument says. Every event a subscriber missed on the way is counted (`lost`).
//!
//! ```sh
//! scripts/up                                  # a local bus (its demo publishes task events)
//! cargo run -p chorus-sdk --example event_listener -- 5
//! chorus send --topic task.completed '"by hand"'
//! ```
//!
//! The bus is `CHORUS_NATS_URL` (default `nats://127.0.0.1:4222`).

use chorus_sdk::AgentOptions;
use futures::StreamExt;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CHORUS_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let limit: Option<usize> = std::env::args().nth(1).map(|n| n.parse()).transpose()?;
    let listener = AgentOptions::new("event-listener")
        .servers([url.as_str()])
        .connect()
        .await?;
    let mut events = listener.subscribe("task.>").await?;
    println!("event_listener: listening on task.> at {url}");
    let mut seen = 0;
    let stop = tokio::signal::ctrl_c();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            event = events.next() => {
                let Some(event) = event else { break };
                let payload: serde_json::Value =
                    event.payload_as().unwrap_or(serde_json::Value::Null);
                println!("event_listener: {} from {}: {payload}", event.topic(), event.envelope.from);
                seen += 1;
                if limit.is_some_and(|n| seen >= n) {
                    break;
                }
            }
            _ = &mut stop => break,
        }
    }
    let stats = listener.stats();
    println!(
        "event_listener: {seen} event(s), {} lost on the way",
        stats.lost
    );
    listener.shutdown().await;
    Ok(())
}
