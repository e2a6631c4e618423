//! The peer's part for the Python SDK's access and outbound tests (`test_access.py`).
//!
//! Settings: `PEER_GRANT` (`agent=perm,perm;agent=perm`: grants), `PEER_REQUIRE`
//! (`command=perm,perm`: what `guarded` requires, default `ledger:write`), `PEER_RATE_LIMIT`
//! (`per_second,burst`), `PEER_BREAKER` (`failures,open_ms`), `PEER_PERSIST_SEEN` (`1`: keep
//! verified ids across restarts), `PEER_ROUTING` (`least_loaded`), `PEER_TRUST_MORE`
//! (`agent=U...;agent=U...`: more keys to verify, beside `PEER_TRUST`'s),
//! `PEER_ROUTE_CAPABILITY` (a capability this peer holds, answered with its id).
//!
//! Handlers: `guarded` (returns `"posted"`, requires `PEER_REQUIRE`'s permissions), `charge`
//! (`{"amount"}`: counts its runs, the first sleeps 400 ms; returns `"charged <amount>"`),
//! `runs` (how many times `charge` ran), `unavailable` (always 5019), `call` (`{"to",
//! "command", "capability", "payload", "id", "timeout_ms", "times", "exactly_once", "retry",
//! "dead_letter", "session", "customer"}`: makes that call `times` times in a row, through this
//! agent's breakers, routing and retries, and returns each outcome), and `context` (returns
//! the session and customer it was sent with, and those of the reply to a request it makes
//! in turn to `{"to", "command"}` when given).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chorus_sdk::{
    Agent, AgentOptions, BreakerPolicy, Call, Context, DeliveryClass, HandlerError, RateLimit,
    RetryPolicy, Routing, StatusCode,
};
use serde::Deserialize;
use serde_json::{Value, json};

type Error = Box<dyn std::error::Error>;

/// Settings of this part, from the environment.
pub fn options(mut options: AgentOptions) -> Result<AgentOptions, Error> {
    if let Ok(grants) = std::env::var("PEER_GRANT") {
        for grant in grants.split(';').filter(|g| !g.is_empty()) {
            let (agent, permissions) = grant
                .split_once('=')
                .ok_or("PEER_GRANT is agent=perm,perm;...")?;
            options = options.grant(agent, permissions.split(','));
        }
    }
    if let Ok(limit) = std::env::var("PEER_RATE_LIMIT") {
        let (per_second, burst) = limit
            .split_once(',')
            .ok_or("PEER_RATE_LIMIT is per_second,burst")?;
        options = options.rate_limit(RateLimit {
            per_second: per_second.parse()?,
            burst: burst.parse()?,
        });
    }
    if let Ok(breaker) = std::env::var("PEER_BREAKER") {
        let (failures, open_ms) = breaker
            .split_once(',')
            .ok_or("PEER_BREAKER is failures,open_ms")?;
        options = options.circuit_breaker(BreakerPolicy::new(
            failures.parse()?,
            Duration::from_millis(open_ms.parse()?),
        ));
    }
    if let Ok(keys) = std::env::var("PEER_TRUST_MORE") {
        for pair in keys.split(';').filter(|p| !p.is_empty()) {
            let (agent, key) = pair
                .split_once('=')
                .ok_or("PEER_TRUST_MORE is agent=U...;agent=U...")?;
            options = options.trust(agent, key);
        }
    }
    if std::env::var("PEER_PERSIST_SEEN").as_deref() == Ok("1") {
        options = options.persist_seen_ids(true);
    }
    if let Ok(capability) = std::env::var("PEER_ROUTE_CAPABILITY") {
        options = options.capability(capability);
    }
    if std::env::var("PEER_ROUTING").as_deref() == Ok("least_loaded") {
        options = options.capability_routing(Routing::LeastLoaded);
    }
    Ok(options)
}

#[derive(Debug, Deserialize)]
struct Charge {
    amount: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Order {
    to: Option<String>,
    command: Option<String>,
    capability: Option<String>,
    payload: Value,
    /// A message id (text: MessagePack carries a UUID as bytes otherwise).
    id: Option<String>,
    timeout_ms: Option<u64>,
    times: Option<u32>,
    exactly_once: bool,
    retry: Option<RetryPolicy>,
    dead_letter: bool,
    session: Option<String>,
    customer: Option<String>,
}

impl Order {
    fn call(&self) -> Result<Call, HandlerError> {
        let mut call = match (&self.to, &self.command, &self.capability) {
            (Some(to), Some(command), _) => Call::agent(to, command),
            (Some(to), None, Some(capability)) => Call::capability_at(to, capability),
            (None, _, Some(capability)) => Call::capability(capability),
            _ => {
                return Err(HandlerError::new(
                    StatusCode::INVALID_ARGUMENT,
                    "call needs to and command, or capability",
                ));
            }
        }
        .payload(&self.payload)?;
        if let Some(id) = &self.id {
            let id = uuid::Uuid::parse_str(id).map_err(|e| {
                HandlerError::new(StatusCode::INVALID_ARGUMENT, format!("id {id:?}: {e}"))
            })?;
            call = call.id(id);
        }
        if let Some(ms) = self.timeout_ms {
            call = call.timeout(Duration::from_millis(ms));
        }
        if self.exactly_once {
            call = call.delivery(DeliveryClass::ExactlyOnce);
        }
        if let Some(policy) = &self.retry {
            call = call.retry(policy.clone());
        }
        if self.dead_letter {
            call = call.dead_letter_on_failure();
        }
        if let Some(session) = &self.session {
            call = call.session(session);
        }
        if let Some(customer) = &self.customer {
            call = call.customer(customer);
        }
        Ok(call)
    }
}

/// The handlers of this part.
pub async fn register(peer: &Agent) -> Result<(), Error> {
    if let Ok(capability) = std::env::var("PEER_ROUTE_CAPABILITY") {
        let id = peer.id().to_owned();
        peer.on_capability(&capability, move |_ctx: Context, _v: Value| {
            let id = id.clone();
            async move { Ok::<_, HandlerError>(id) }
        })
        .await?;
    }
    peer.on_command("guarded", |_ctx: Context, _v: Value| async move {
        Ok::<_, HandlerError>("posted")
    })
    .await?;
    let required = std::env::var("PEER_REQUIRE").unwrap_or_else(|_| "ledger:write".into());
    let required: Vec<&str> = required.split(',').collect();
    peer.require("guarded", &required)?;

    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    peer.on_command("charge", move |_ctx: Context, charge: Charge| {
        let runs = Arc::clone(&counted);
        async move {
            if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            Ok::<_, HandlerError>(format!("charged {}", charge.amount))
        }
    })
    .await?;
    peer.on_command("runs", move |_ctx: Context, _v: Value| {
        let runs = runs.load(Ordering::SeqCst);
        async move { Ok::<_, HandlerError>(runs) }
    })
    .await?;
    peer.on_command("unavailable", |_ctx: Context, _v: Value| async move {
        Err::<Value, _>(HandlerError::new(
            StatusCode::UNAVAILABLE,
            "down for maintenance",
        ))
    })
    .await?;

    let caller = peer.clone();
    peer.on_command("call", move |_ctx: Context, order: Order| {
        let caller = caller.clone();
        async move {
            let mut outcomes = Vec::new();
            for _ in 0..order.times.unwrap_or(1).min(100) {
                let call = order.call()?;
                outcomes.push(match caller.call(call).await {
                    Ok(reply) => json!({
                        "status": reply.status().0,
                        "from": reply.envelope.from.to_string(),
                        "in_reply_to": reply.envelope.in_reply_to.map(|id| id.to_string()),
                        "session": reply.envelope.session_id,
                        "customer": reply.envelope.customer_id,
                        "value": reply.payload_as::<Value>().unwrap_or(Value::Null),
                    }),
                    Err(err) => json!({
                        "status": err.status().0,
                        "error": err.to_string(),
                    }),
                });
            }
            Ok::<_, HandlerError>(outcomes)
        }
    })
    .await?;

    peer.on_command("context", |ctx: Context, order: Order| async move {
        let message = ctx.message();
        let mut seen = json!({
            "session": message.session_id,
            "customer": message.customer_id,
        });
        if let (Some(to), Some(command)) = (&order.to, &order.command) {
            let reply = ctx
                .call(Call::agent(to, command).payload(&order.payload)?)
                .await?;
            seen["reply_session"] = json!(reply.envelope.session_id);
            seen["reply_customer"] = json!(reply.envelope.customer_id);
            seen["reply"] = reply.payload_as::<Value>().unwrap_or(Value::Null);
        }
        Ok::<_, HandlerError>(seen)
    })
    .await?;
    Ok(())
}
