//! The agent `scripts/a2a-tck` holds to the A2A test kit through the gateway: the kit's own
//! reference agent (its "TCK core agent") as a Chorus task handler, with the same answers and
//! the same pace: about a second of work in three steps, cancellable at each.
//!
//! ```sh
//! scripts/up                                                # a local bus
//! cargo run -p chorus-sdk --example a2a_tck_agent           # the agent `tck`, task `chat`
//! ```
//!
//! The bus is `CHORUS_NATS_URL` (default `nats://127.0.0.1:4222`); the agent id is
//! `TCK_AGENT_ID` (default `tck`). It prints `a2a_tck_agent: ready` once it serves, and stops on
//! Ctrl-C.

use std::time::Duration;

use chorus_sdk::{AgentOptions, HandlerError, StatusCode, TaskContext};
use serde_json::Value;

/// The reference agent's answers.
fn answer(query: &str) -> String {
    if query.trim().is_empty() {
        return "Hello! Please provide a message for me to respond to.".into();
    }
    let q = query.to_lowercase();
    if q.contains("hello") || q.contains("hi") {
        "Hello World! Nice to meet you!".into()
    } else if q.contains("how are you") {
        "I'm doing great! Thanks for asking. How can I help you today?".into()
    } else if q.contains("goodbye") || q.contains("bye") {
        "Goodbye! Have a wonderful day!".into()
    } else {
        format!("Hello World! You said: '{query}'. Thanks for your message!")
    }
}

/// Waits `ms`, or fails the task as cancelled if a cancel comes first.
async fn pause(task: &TaskContext, ms: u64) -> Result<(), HandlerError> {
    tokio::select! {
        why = task.cancelled() => Err(HandlerError::new(StatusCode::CANCELLED, format!("{why:?}"))),
        () = tokio::time::sleep(Duration::from_millis(ms)) => Ok(()),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CHORUS_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let id = std::env::var("TCK_AGENT_ID").unwrap_or_else(|_| "tck".into());
    let agent = AgentOptions::new(id.as_str())
        .servers([url.as_str()])
        .connect()
        .await?;
    agent
        .on_task("chat", |task: TaskContext, input: Value| async move {
            let query = match &input {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            pause(&task, 500).await?;
            task.progress(None, "working").await?;
            pause(&task, 500).await?;
            let text = answer(&query);
            pause(&task, 200).await?;
            Ok::<_, HandlerError>(text)
        })
        .await?;
    println!("a2a_tck_agent: ready");
    tokio::signal::ctrl_c().await?;
    agent.shutdown().await;
    Ok(())
}
