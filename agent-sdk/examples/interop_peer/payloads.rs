//! The peer's part for the Python SDK's payloads tests (`python/tests/test_payloads.py`): large
//! payloads (compressed, by reference) both ways.
//!
//! - `digest` (any payload, raw): returns `{"sha256", "len", "content_type"}` of the payload
//!   its handler saw, and publishes the same as the event `interop.digest` with the subject
//!   it came on and the attempt (so a durable command's digest is seen too);
//! - `make` (`{"len", "kind"}`): returns `len` bytes, `kind` `noise` (does not compress,
//!   `application/octet-stream`) or `text` (compresses well, `application/json`), and
//!   publishes their digest as `interop.digest` (with `"made": true`);
//! - `push` (`{"to", "command", "len", "kind", "delivery"}`): sends that many bytes to that
//!   agent's command, as a request (`delivery` absent), or stored (`at_least_once`,
//!   `exactly_once`); returns `{"sha256", "len"}` of what it sent, with the answer
//!   (`answer`, and `answer_sha256` and `answer_len` of its raw payload) or the stream
//!   sequence (`stored`);
//! - `emit_large` (`{"topic", "len", "kind"}`): publishes that many bytes as an event;
//!   returns `{"sha256", "len"}`;
//! - events on `interop.bulk.>`, read through `Agent::subscribe` (an event stream): each
//!   publishes `interop.digest` as `digest` does.
//!
//! Setting: `PEER_PAYLOAD_MAX_BYTES` (the largest payload it sends or takes; default 64 MiB).

use bytes::Bytes;
use chorus_sdk::payload::PayloadLimits;
use chorus_sdk::{
    Agent, AgentOptions, BoxFuture, Call, Context, DeliveryClass, Handler, HandlerError, Output,
    codec,
};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Settings of this part, from the environment.
pub fn options(options: AgentOptions) -> Result<AgentOptions, Box<dyn std::error::Error>> {
    Ok(match std::env::var("PEER_PAYLOAD_MAX_BYTES") {
        Ok(max) => options.payload_limits(PayloadLimits::default().max_bytes(max.parse()?)),
        Err(_) => options,
    })
}

#[derive(Debug, Deserialize)]
struct Make {
    len: usize,
    #[serde(default)]
    kind: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Push {
    to: String,
    command: String,
    len: usize,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    delivery: Option<String>,
}

#[derive(Debug, Deserialize)]
struct EmitLarge {
    topic: String,
    len: usize,
    #[serde(default)]
    kind: Option<String>,
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// `len` bytes of `kind` (`text`: repetitive JSON-like lines; anything else: noise), with
/// their content type.
fn bytes_of(len: usize, kind: Option<&str>) -> (Bytes, &'static str) {
    if kind == Some("text") {
        let mut out = String::with_capacity(len + 64);
        let mut i = 0u64;
        while out.len() < len {
            out.push_str(&format!("{{\"row\":{i},\"status\":\"ok\"}}\n"));
            i += 1;
        }
        out.truncate(len);
        return (Bytes::from(out), "application/json");
    }
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    (Bytes::from(out), "application/octet-stream")
}

/// What a handler saw of a payload, as MessagePack.
fn seen(payload: &[u8], content_type: &str) -> Value {
    json!({ "sha256": sha256(payload), "len": payload.len(), "content_type": content_type })
}

fn msgpack(value: &Value) -> Result<Output, HandlerError> {
    Ok(Output {
        payload: codec::encode_payload(value, "application/msgpack")?,
        content_type: "application/msgpack".into(),
    })
}

/// Reports the digest of any payload, raw.
struct DigestOf;

impl Handler for DigestOf {
    fn call(&self, ctx: Context) -> BoxFuture<Result<Output, HandlerError>> {
        Box::pin(async move {
            let request = ctx.message();
            let mut report = seen(&request.payload, &request.content_type);
            report["subject"] = json!(ctx.subject());
            report["attempt"] = json!(ctx.attempt());
            ctx.publish("interop.digest", &report).await?;
            msgpack(&report)
        })
    }
}

/// Returns `len` bytes, raw.
struct MakeBytes;

impl Handler for MakeBytes {
    fn call(&self, ctx: Context) -> BoxFuture<Result<Output, HandlerError>> {
        let request = ctx.message();
        let order = codec::decode_payload::<Make>(&request.payload, &request.content_type);
        Box::pin(async move {
            let order = order?;
            let (payload, content_type) = bytes_of(order.len, order.kind.as_deref());
            let mut report = seen(&payload, content_type);
            report["made"] = json!(true);
            ctx.publish("interop.digest", &report).await?;
            Ok(Output {
                payload,
                content_type: content_type.into(),
            })
        })
    }
}

/// The handlers of this part.
pub async fn register(peer: &Agent) -> Result<(), Box<dyn std::error::Error>> {
    peer.handle_command("digest", DigestOf).await?;
    peer.handle_command("make", MakeBytes).await?;
    let sender = peer.clone();
    peer.on_command("push", move |_ctx: Context, push: Push| {
        let sender = sender.clone();
        async move {
            let (payload, content_type) = bytes_of(push.len, push.kind.as_deref());
            let mut report = json!({ "sha256": sha256(&payload), "len": payload.len() });
            let call = Call::agent(&push.to, &push.command).raw_payload(payload, content_type);
            let class = match push.delivery.as_deref() {
                None => {
                    let reply = sender.call(call).await?;
                    report["answer"] = reply.payload_as::<Value>().unwrap_or(Value::Null);
                    report["answer_sha256"] = json!(sha256(reply.payload()));
                    report["answer_len"] = json!(reply.payload().len());
                    return Ok::<_, HandlerError>(report);
                }
                Some("exactly_once") => DeliveryClass::ExactlyOnce,
                Some("at_most_once") => DeliveryClass::AtMostOnce,
                Some(_) => DeliveryClass::AtLeastOnce,
            };
            let receipt = sender.send(call.command().delivery(class)).await?;
            report["stored"] = json!(receipt.stream_seq);
            Ok(report)
        }
    })
    .await?;
    let publisher = peer.clone();
    peer.on_command("emit_large", move |_ctx: Context, emit: EmitLarge| {
        let publisher = publisher.clone();
        async move {
            let (payload, content_type) = bytes_of(emit.len, emit.kind.as_deref());
            let report = json!({ "sha256": sha256(&payload), "len": payload.len() });
            publisher
                .publish_raw(&emit.topic, payload, content_type)
                .await?;
            Ok::<_, HandlerError>(report)
        }
    })
    .await?;
    // Events read as a stream: a payload by reference is fetched for the stream's reader too.
    let mut bulk = peer.subscribe("interop.bulk.>").await?;
    let reporter = peer.clone();
    tokio::spawn(async move {
        while let Some(event) = bulk.next().await {
            let env = &event.envelope;
            let mut report = seen(&env.payload, &env.content_type);
            report["topic"] = json!(event.topic());
            if let Err(e) = reporter.publish("interop.digest", &report).await {
                eprintln!(
                    "interop_peer: digest of {} not published: {e}",
                    event.topic()
                );
            }
        }
    });
    Ok(())
}
