//! A Rust agent for cross-language tests: the Python SDK's tests (`python/tests`) start it and
//! talk to it in every message kind, both ways. It serves:
//!
//! - `echo` (returns its argument), `fail` (always 5018), `ask` (`{"to", "command",
//!   "payload"}`: asks that agent in turn and returns its answer, or fails with its code;
//!   `ask_sealed` the same with the payload encrypted for that agent; `ask_capability`
//!   (`{"capability", "payload"}`: asks that capability's holders and returns the answer),
//!   `emit` (`{"topic", "payload"}`: publishes that event), `send` (`{"to", "command",
//!   "payload", "delivery"}`: sends that command, stored unless `at_most_once`), and `record` (durable: publishes
//!   `interop.recorded` with its argument and the attempt);
//! - the capability `interop.upper` (a string, upper-cased);
//! - events on `interop.ping.>`, answered with the event `interop.pong` (`{"from", "topic",
//!   "payload"}`);
//! - the tasks `draft` (progress and a streamed text), `slow` (runs until cancelled) and
//!   `question` (asks its requester a colour), and the command `submit` (`{"to", "command",
//!   "payload", "answer", "cancel_after_chunks"}`: submits that task, answers its question,
//!   cancels it after that many chunks, and returns the states, chunks and progress it saw
//!   with the outcome).
//!
//! Settings from the environment: `CHORUS_NATS_URL`, `PEER_ID` (default `rust-peer`),
//! `PEER_ENCODING` (`msgpack`, `json` or `compact`; default: follow the bus), `PEER_SEED` (a
//! file with an nkey seed: sign what it sends), `PEER_TRUST` (`agent=U...`: verify signatures
//! and refuse unsigned messages), `PEER_ENCRYPTION_SECRET` (its X25519 key, base64: open
//! payloads encrypted for it) and `PEER_TRUST_ENCRYPTION` (`agent=<base64 public key>`: whom
//! `ask_sealed` encrypts for). It prints `interop_peer: ready` once everything is
//! subscribed, and stops on Ctrl-C, SIGTERM or the end of its standard input.
//!
//! ```sh
//! cargo run -p chorus-sdk --example interop_peer
//! ```
//!
//! Each area of the parity tests has its part in a module of its own (`access`, `headers`,
//! `metrics`, `multicast`, `negotiate`, `notify`, `payloads`, `priority`, `tasks`): its settings
//! and its handlers.

mod access;
mod headers;
mod metrics;
mod multicast;
mod negotiate;
mod notify;
mod payloads;
mod priority;
mod tasks;

use chorus_sdk::encryption::EncryptionKey;
use chorus_sdk::security::{Identity, SignaturePolicy};
use chorus_sdk::{
    AgentOptions, Call, Context, DeliveryClass, Encoding, HandlerError, StatusCode, TaskContext,
    TaskState, Typed,
};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Deserialize)]
struct AskCapability {
    capability: String,
    #[serde(default)]
    payload: Value,
}

#[derive(Debug, Deserialize)]
struct Ask {
    to: String,
    command: String,
    #[serde(default)]
    payload: Value,
    /// For `send`: `at_most_once`, `at_least_once` (the default) or `exactly_once`.
    #[serde(default)]
    delivery: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Emit {
    topic: String,
    #[serde(default)]
    payload: Value,
}

#[derive(Debug, Deserialize)]
struct Submit {
    to: String,
    command: String,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    answer: Value,
    #[serde(default)]
    cancel_after_chunks: Option<usize>,
}

fn push(seen: &mut Value, key: &str, value: Value) {
    if let Some(list) = seen[key].as_array_mut() {
        list.push(value);
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CHORUS_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let id = std::env::var("PEER_ID").unwrap_or_else(|_| "rust-peer".into());
    let mut options = AgentOptions::new(id.as_str())
        .servers([url.as_str()])
        .durable_inbox(true)
        .capability("interop.upper");
    match std::env::var("PEER_ENCODING").as_deref() {
        Ok("msgpack") => options = options.encoding(Encoding::MsgPack),
        Ok("json") => options = options.encoding(Encoding::Json),
        Ok("compact") => options = options.encoding(Encoding::Compact),
        Ok(other) => {
            return Err(format!("PEER_ENCODING {other:?}: msgpack, json or compact").into());
        }
        Err(_) => {}
    }
    if let Ok(path) = std::env::var("PEER_SEED") {
        let seed = std::fs::read_to_string(&path)?;
        options = options.identity(Identity::from_seed(seed.trim())?);
    }
    if let Ok(secret) = std::env::var("PEER_ENCRYPTION_SECRET") {
        options = options.encryption_key(EncryptionKey::from_secret(secret.trim())?);
    }
    if let Ok(trust) = std::env::var("PEER_TRUST_ENCRYPTION") {
        let (agent, key) = trust
            .split_once('=')
            .ok_or("PEER_TRUST_ENCRYPTION is agent=<base64 key>")?;
        options = options.trust_encryption(agent, key);
    }
    if let Ok(trust) = std::env::var("PEER_TRUST") {
        let (agent, key) = trust.split_once('=').ok_or("PEER_TRUST is agent=U...")?;
        options = options
            .verify_signatures(SignaturePolicy {
                require_signed: true,
                ..SignaturePolicy::default()
            })
            .trust(agent, key);
    }
    options = access::options(options)?;
    options = headers::options(options)?;
    options = metrics::options(options)?;
    options = multicast::options(options)?;
    options = negotiate::options(options)?;
    options = notify::options(options)?;
    options = payloads::options(options)?;
    options = priority::options(options)?;
    options = tasks::options(options)?;
    let peer = options.connect().await?;
    access::register(&peer).await?;
    headers::register(&peer).await?;
    metrics::register(&peer).await?;
    multicast::register(&peer).await?;
    negotiate::register(&peer).await?;
    notify::register(&peer).await?;
    payloads::register(&peer).await?;
    priority::register(&peer).await?;
    tasks::register(&peer).await?;

    peer.on_command("echo", |_ctx: Context, v: Value| async move {
        Ok::<_, HandlerError>(v)
    })
    .await?;
    peer.on_command("fail", |_ctx: Context, _v: Value| async move {
        Err::<Value, _>(HandlerError::invalid_argument("asked to fail"))
    })
    .await?;
    peer.on_command("ask", |ctx: Context, ask: Ask| async move {
        let answer: Value = ctx.request(&ask.to, &ask.command, &ask.payload).await?;
        Ok::<_, HandlerError>(answer)
    })
    .await?;
    peer.on_command(
        "ask_capability",
        |ctx: Context, ask: AskCapability| async move {
            let call = Call::capability(&ask.capability).payload(&ask.payload)?;
            let answer: Value = ctx.call(call).await?.payload_as()?;
            Ok::<_, HandlerError>(answer)
        },
    )
    .await?;
    peer.on_command("ask_sealed", |ctx: Context, ask: Ask| async move {
        let call = Call::agent(&ask.to, &ask.command)
            .payload(&ask.payload)?
            .encrypt_for([ask.to.clone()]);
        let answer: Value = ctx.call(call).await?.payload_as()?;
        Ok::<_, HandlerError>(answer)
    })
    .await?;
    peer.on_command("emit", |ctx: Context, emit: Emit| async move {
        ctx.publish(&emit.topic, &emit.payload).await?;
        Ok::<_, HandlerError>(Value::Null)
    })
    .await?;
    let sender = peer.clone();
    peer.on_command("send", move |_ctx: Context, ask: Ask| {
        let sender = sender.clone();
        async move {
            let class = match ask.delivery.as_deref() {
                Some("at_most_once") => DeliveryClass::AtMostOnce,
                Some("exactly_once") => DeliveryClass::ExactlyOnce,
                _ => DeliveryClass::AtLeastOnce,
            };
            let call = Call::agent(&ask.to, &ask.command)
                .command()
                .delivery(class)
                .payload(&ask.payload)?;
            let receipt = sender.send(call).await?;
            Ok::<_, HandlerError>(json!({ "stored": receipt.stream_seq }))
        }
    })
    .await?;
    peer.on_command("record", |ctx: Context, v: Value| async move {
        let attempt = ctx.attempt();
        ctx.publish(
            "interop.recorded",
            &json!({ "payload": v, "attempt": attempt, "from": ctx.from() }),
        )
        .await?;
        Ok::<_, HandlerError>(Value::Null)
    })
    .await?;
    peer.on_capability("interop.upper", |_ctx: Context, s: String| async move {
        Ok::<_, HandlerError>(s.to_uppercase())
    })
    .await?;
    // Tasks a Python requester submits: a streamed draft, one that runs until cancelled, and
    // one that asks its requester a question.
    peer.on_task("draft", |task: TaskContext, topic: String| async move {
        let text = format!("a short draft about {topic}");
        let words: Vec<&str> = text.split(' ').collect();
        task.progress(Some(0.0), "writing").await?;
        for (i, word) in words.iter().enumerate() {
            if i + 1 == words.len() {
                task.last_chunk(word).await?;
            } else {
                task.chunk(word).await?;
            }
        }
        task.progress(Some(1.0), "written").await?;
        Ok::<_, HandlerError>(text)
    })
    .await?;
    // Streams its input back in pieces of three characters, spaces and all.
    peer.on_task("spell", |task: TaskContext, text: String| async move {
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(3) {
            task.chunk(&piece.iter().collect::<String>()).await?;
        }
        Ok::<_, HandlerError>(text)
    })
    .await?;
    peer.on_task("slow", |task: TaskContext, _v: Value| async move {
        task.progress(None, "waiting to be cancelled").await?;
        let why = task.cancelled().await;
        Err::<Value, _>(HandlerError::new(StatusCode::CANCELLED, format!("{why:?}")))
    })
    .await?;
    peer.on_task("question", |task: TaskContext, _v: Value| async move {
        let colour: String = task.ask("which colour?", &json!(["red", "blue"])).await?;
        Ok::<_, HandlerError>(format!("painted {colour}"))
    })
    .await?;
    // Submits a task to another agent, answers its question, cancels it after some chunks if
    // told to, and returns what it saw.
    let requester = peer.clone();
    peer.on_command("submit", move |_ctx: Context, order: Submit| {
        let requester = requester.clone();
        async move {
            let handle = requester
                .submit(Call::agent(&order.to, &order.command).payload(&order.payload)?)
                .await?;
            let mut seen = json!({ "states": [], "chunks": [], "fractions": [] });
            let mut updates = handle.updates().await?;
            while let Some(update) = updates.next().await {
                let update = update?;
                if let Some(state) = update.state() {
                    push(&mut seen, "states", json!(state.to_string()));
                    if state == TaskState::InputRequired {
                        handle.respond(&order.answer).await?;
                    }
                } else if update.chunk().is_some() {
                    push(&mut seen, "chunks", update.payload_as::<Value>()?);
                    let count = seen["chunks"].as_array().map_or(0, Vec::len);
                    if order.cancel_after_chunks == Some(count) {
                        handle.cancel().await?;
                    }
                } else if let Some(fraction) = update.fraction() {
                    push(&mut seen, "fractions", json!(fraction));
                }
            }
            let report = handle.result().await?;
            seen["state"] = json!(report.state.to_string());
            seen["status"] = json!(report.status.0);
            seen["worker"] = json!(report.attempts.last().map(|a| a.agent.clone()));
            seen["output"] = report.output_as::<Value>().unwrap_or(Value::Null);
            Ok::<_, HandlerError>(seen)
        }
    })
    .await?;
    peer.handle_events(
        "interop.ping.>",
        Typed::new(|ctx: Context, v: Value| async move {
            let event = ctx.message();
            let pong = json!({
                "from": event.from,
                "topic": event.topic,
                "payload": v,
            });
            ctx.publish("interop.pong", &pong).await?;
            Ok(())
        }),
    )
    .await?;
    peer.broker().flush().await?;
    println!("interop_peer: ready as {id} at {url}");

    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {
            sink.clear();
        }
    });
    tokio::select! {
        _ = shutdown_signal() => {}
        _ = stdin_closed => {}
    }
    peer.shutdown().await;
    println!("interop_peer: stopped");
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
