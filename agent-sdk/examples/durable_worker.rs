//! A worker with a durable inbox: `post` commands sent at least once are stored until it takes
//! them, so those sent while it was offline are handled when it starts. A negative amount is
//! refused as poison and lands in the dead-letter queue (`chorus dlq ls`). Runs until Ctrl-C,
//! SIGTERM, or as many postings as its first argument says.
//!
//! ```sh
//! scripts/up                                  # a local bus, in another terminal
//! chorus send --durable --to ledger-worker --command post '{"account":"acme","amount":250}'
//! cargo run -p chorus-sdk --example durable_worker -- 1
//! ```
//!
//! The bus is `CHORUS_NATS_URL` (default `nats://127.0.0.1:4222`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use chorus_sdk::{AgentOptions, Context, HandlerError};
use serde::Deserialize;

/// One ledger posting.
#[derive(Debug, Deserialize)]
struct Posting {
    account: String,
    amount: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CHORUS_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let limit: Option<usize> = std::env::args().nth(1).map(|n| n.parse()).transpose()?;
    let worker = AgentOptions::new("ledger-worker")
        .servers([url.as_str()])
        .durable_inbox(true)
        .connect()
        .await?;
    let posted = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(tokio::sync::Notify::new());
    let (count, notify) = (Arc::clone(&posted), Arc::clone(&done));
    worker
        .on_command("post", move |ctx: Context, p: Posting| {
            let (count, notify) = (Arc::clone(&count), Arc::clone(&notify));
            async move {
                if p.amount < 0 {
                    return Err(HandlerError::invalid_argument("a negative amount"));
                }
                println!(
                    "durable_worker: posted {} to {} (attempt {})",
                    p.amount,
                    p.account,
                    ctx.attempt()
                );
                if limit.is_some_and(|n| count.fetch_add(1, Ordering::SeqCst) + 1 >= n) {
                    notify.notify_one();
                }
                Ok(())
            }
        })
        .await?;
    println!("durable_worker: taking `post` commands from its inbox at {url}");
    tokio::select! {
        _ = done.notified() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    worker.shutdown().await;
    println!(
        "durable_worker: stopped after {} posting(s)",
        posted.load(Ordering::SeqCst)
    );
    Ok(())
}
