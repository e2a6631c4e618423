//! The peer's part for the Python SDK's notification tests: every notification it gets is
//! recorded (`{"name", "from", "origin", "payload", "headers", "priority", "delivery",
//! "session", "customer", "attempt"}`) and listed by the command `notifications`, with its
//! counts (`{"seen": [...], "received", "unhandled"}`); a notification called `fail` fails
//! its handler (5018), for the retries of a durable one. The command `notify` (`{"to" or
//! "group", "name", "payload", "headers", "priority", "durable"}`) sends that notification
//! and answers its report. Settings: `PEER_GROUPS` (comma-separated broadcast groups to join)
//! and `PEER_NOTIFY_HANDLER` (`none`: no notification handler, so every one is counted as
//! unhandled).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use chorus_sdk::{Agent, AgentOptions, Context, HandlerError, Notify, Priority};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Deserialize)]
struct Order {
    #[serde(default)]
    to: Option<String>,
    #[serde(default)]
    group: Option<String>,
    name: String,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    priority: Option<String>,
    #[serde(default)]
    durable: bool,
}

/// Settings of this part: the groups to join.
pub fn options(mut options: AgentOptions) -> Result<AgentOptions, Box<dyn std::error::Error>> {
    if let Ok(groups) = std::env::var("PEER_GROUPS") {
        for group in groups.split(',').filter(|g| !g.is_empty()) {
            options = options.group(group);
        }
    }
    Ok(options)
}

/// The handlers of this part.
pub async fn register(peer: &Agent) -> Result<(), Box<dyn std::error::Error>> {
    let seen: Arc<Mutex<Vec<Value>>> = Arc::default();
    if std::env::var("PEER_NOTIFY_HANDLER").as_deref() != Ok("none") {
        let record = Arc::clone(&seen);
        peer.on_notification("*", move |ctx: Context, payload: Value| {
            let record = Arc::clone(&record);
            async move {
                let env = ctx.message();
                let name = env.name.clone().unwrap_or_default();
                record
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(json!({
                        "name": name,
                        "from": env.from.as_str(),
                        "origin": ctx.header("chorus-origin"),
                        "payload": payload,
                        "headers": ctx.headers(),
                        "priority": env.priority.as_str(),
                        "delivery": env.delivery.as_str(),
                        "session": env.session_id,
                        "customer": env.customer_id,
                        "attempt": ctx.attempt(),
                    }));
                if name == "fail" {
                    return Err(HandlerError::invalid_argument("asked to fail"));
                }
                Ok(())
            }
        })
        .await?;
    }
    let handle = peer.clone();
    peer.on_command("notifications", move |_ctx: Context, _v: Value| {
        let seen = Arc::clone(&seen);
        let stats = handle.stats();
        async move {
            let seen = seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            Ok::<_, HandlerError>(json!({
                "seen": seen,
                "received": stats.notifications_received,
                "unhandled": stats.notifications_unhandled,
            }))
        }
    })
    .await?;
    let sender = peer.clone();
    peer.on_command("notify", move |_ctx: Context, order: Order| {
        let sender = sender.clone();
        async move {
            let mut notify = match (order.to, order.group) {
                (Some(to), None) => Notify::agent(to, order.name),
                (None, Some(group)) => Notify::group(group, order.name),
                _ => {
                    return Err(HandlerError::invalid_argument(
                        "notify takes either to or group",
                    ));
                }
            }
            .payload(&order.payload)?;
            for (name, value) in order.headers {
                notify = notify.header(name, value);
            }
            if let Some(priority) = order.priority {
                notify = notify.priority(priority.parse().unwrap_or(Priority::Normal));
            }
            if order.durable {
                notify = notify.durable();
            }
            let report = sender.notify(notify).await?;
            serde_json::to_value(report)
                .map_err(|e| HandlerError::new(chorus_sdk::StatusCode::INTERNAL, e.to_string()))
        }
    })
    .await?;
    Ok(())
}
