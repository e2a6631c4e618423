//! A long task in one program: a `writer` agent drafts a text as a task, reporting progress
//! and streaming it word by word; a `reader` agent submits it, prints each update as it comes
//! (states, progress, chunks) and the final report. Then it submits a second draft and cancels
//! it midway. Both stop.
//!
//! ```sh
//! scripts/up                                  # a local bus, in another terminal
//! cargo run -p chorus-sdk --example long_task
//! ```
//!
//! The bus is `CHORUS_NATS_URL` (default `nats://127.0.0.1:4222`).

use std::time::Duration;

use chorus_sdk::{AgentOptions, Call, HandlerError, TaskContext};
use futures::StreamExt;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CHORUS_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let writer = AgentOptions::new("writer")
        .servers([url.as_str()])
        .connect()
        .await?;
    writer
        .on_task("draft", |task: TaskContext, topic: String| async move {
            let words: Vec<String> = format!("a short text about {topic}, written slowly")
                .split_whitespace()
                .map(str::to_owned)
                .collect();
            for (i, word) in words.iter().enumerate() {
                let fraction = (i + 1) as f32 / words.len() as f32;
                task.progress(Some(fraction), format!("word {}", i + 1))
                    .await?;
                task.chunk(word).await?;
                // A slow writer: a cancel stops it between two words.
                tokio::select! {
                    _ = task.cancelled() => {
                        return Err(HandlerError::new(chorus_sdk::StatusCode::CANCELLED, "stopped"));
                    }
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
            Ok::<_, HandlerError>(words.join(" "))
        })
        .await?;

    let reader = AgentOptions::new("reader")
        .servers([url.as_str()])
        .connect()
        .await?;
    let task = reader
        .submit(Call::agent("writer", "draft").payload(&"tasks")?)
        .await?;
    println!("long_task: submitted {}", task.id());
    let mut updates = task.updates().await?;
    while let Some(update) = updates.next().await {
        let update = update?;
        if let Some(state) = update.state() {
            println!("long_task: state {state}");
        } else if let Some(n) = update.chunk() {
            println!("long_task: chunk {n}: {}", update.payload_as::<String>()?);
        } else if let Some(fraction) = update.fraction() {
            println!("long_task: progress {:.0}%", fraction * 100.0);
        }
    }
    let report = task.result().await?;
    println!(
        "long_task: {} by {}: {:?}",
        report.state,
        report.attempts[0].agent,
        report.output_as::<String>()?
    );

    let second = reader
        .submit(Call::agent("writer", "draft").payload(&"cancelling")?)
        .await?;
    let mut updates = second.updates().await?;
    while let Some(update) = updates.next().await {
        if update?.chunk() == Some(2) {
            break;
        }
    }
    let cancelled = second.cancel().await?;
    println!(
        "long_task: the second draft is {} ({})",
        cancelled.state, cancelled.status
    );
    reader.shutdown().await;
    writer.shutdown().await;
    Ok(())
}
