//! The peer's part for the Python SDK's application-header tests: the command `headers`
//! answers `{"headers": <the headers it saw>, "forwarded": <answer>}`, where, when its argument
//! is `{"forward_to", "command"}`, it first asks that agent's command as a forward (without
//! headers of its own: none of the incoming ones may travel on) and `forwarded` is that
//! answer; the command `call_with_headers` (`{"to", "command", "payload", "headers"}`) asks that
//! agent with those headers and answers `{"answer": <its answer>, "reply_headers": <the
//! reply's headers>}`, or fails with the call's code (5018 for headers past the limits).

use std::collections::BTreeMap;

use chorus_sdk::{Agent, AgentOptions, Call, Context, HandlerError};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Default, Deserialize)]
struct Forward {
    #[serde(default)]
    forward_to: Option<String>,
    #[serde(default)]
    command: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WithHeaders {
    to: String,
    command: String,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

/// Settings of this part (none).
pub fn options(options: AgentOptions) -> Result<AgentOptions, Box<dyn std::error::Error>> {
    Ok(options)
}

/// The handlers of this part.
pub async fn register(peer: &Agent) -> Result<(), Box<dyn std::error::Error>> {
    peer.on_command(
        "headers",
        |ctx: Context, forward: Option<Forward>| async move {
            let forwarded = match forward.unwrap_or_default() {
                Forward {
                    forward_to: Some(to),
                    command: Some(command),
                } => ctx.call(Call::agent(to, command)).await?.payload_as()?,
                _ => Value::Null,
            };
            Ok::<_, HandlerError>(json!({ "headers": ctx.headers(), "forwarded": forwarded }))
        },
    )
    .await?;
    peer.on_command(
        "call_with_headers",
        |ctx: Context, order: WithHeaders| async move {
            let mut call = Call::agent(&order.to, &order.command).payload(&order.payload)?;
            for (name, value) in order.headers {
                call = call.header(name, value);
            }
            let reply = ctx.call(call).await?;
            let answer: Value = reply.payload_as()?;
            Ok::<_, HandlerError>(json!({
                "answer": answer,
                "reply_headers": reply.envelope.headers,
            }))
        },
    )
    .await?;
    Ok(())
}
