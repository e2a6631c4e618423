//! The peer's part for the Python SDK's multicast tests. As a recipient it serves `vote`, whose
//! ballot (`{"refuse": [ids], "slow": [ids], "slow_ms"}`) says who refuses (5018, "<id>
//! refuses") and who answers only after `slow_ms` milliseconds (at most ten seconds); it
//! answers `{"agent", "id", "conversation", "to"}`: its id and the copy's message id,
//! conversation and `to`. As a sender it serves `multicast` (`{"to", "command", "payload",
//! "collect": "all" | "first" | "quorum", "n", "timeout_ms"}`): it multicasts that call as a
//! forward of the request and answers the report as JSON (`{"multicast_id", "met",
//! "elapsed_ms", "counts", "recipients": [{"agent", "outcome", "status", "reason",
//! "answer"}]}`), or fails with the multicast's own code (5018 for bad input).

use std::time::Duration;

use chorus_sdk::{Agent, AgentOptions, Call, Collect, Context, HandlerError, MulticastOutcome};
use serde::Deserialize;
use serde_json::{Value, json};

/// The longest a slow voter waits.
const MAX_SLOW: Duration = Duration::from_secs(10);

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Ballot {
    refuse: Vec<String>,
    slow: Vec<String>,
    slow_ms: u64,
}

#[derive(Debug, Deserialize)]
struct Order {
    to: Vec<String>,
    command: String,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    collect: Option<String>,
    #[serde(default)]
    n: usize,
    timeout_ms: u64,
}

/// Settings of this part (none).
pub fn options(options: AgentOptions) -> Result<AgentOptions, Box<dyn std::error::Error>> {
    Ok(options)
}

/// The handlers of this part.
pub async fn register(peer: &Agent) -> Result<(), Box<dyn std::error::Error>> {
    peer.on_command("vote", |ctx: Context, ballot: Option<Ballot>| async move {
        let ballot = ballot.unwrap_or_default();
        let me = ctx.agent_id().to_owned();
        let env = ctx.message();
        let seen = json!({
            "agent": me,
            "id": env.id.to_string(),
            "conversation": env.conversation().to_string(),
            "to": env.to,
        });
        if ballot.slow.contains(&me) {
            tokio::time::sleep(Duration::from_millis(ballot.slow_ms).min(MAX_SLOW)).await;
        }
        if ballot.refuse.contains(&me) {
            return Err(HandlerError::invalid_argument(format!("{me} refuses")));
        }
        Ok::<_, HandlerError>(seen)
    })
    .await?;
    peer.on_command("multicast", |ctx: Context, order: Order| async move {
        let collect = match order.collect.as_deref() {
            None | Some("all") => Collect::All,
            Some("first") => Collect::First(order.n),
            Some("quorum") => Collect::Quorum(order.n),
            Some(other) => {
                return Err(HandlerError::invalid_argument(format!(
                    "collect {other:?}: all, first or quorum"
                )));
            }
        };
        let call = Call::multicast(order.command)
            .payload(&order.payload)?
            .timeout(Duration::from_millis(order.timeout_ms));
        let report = ctx.multicast(call, &order.to, collect).await?;
        let recipients: Vec<Value> = report
            .recipients
            .iter()
            .map(|r| {
                let (reason, answer) = match &r.outcome {
                    MulticastOutcome::Replied(reply) => {
                        (None, reply.payload_as::<Value>().unwrap_or(Value::Null))
                    }
                    MulticastOutcome::Refused { reason, .. }
                    | MulticastOutcome::Failed { reason, .. } => {
                        (Some(reason.clone()), Value::Null)
                    }
                    _ => (None, Value::Null),
                };
                json!({
                    "agent": r.agent,
                    "outcome": r.outcome.label(),
                    "status": r.outcome.status().map(|s| s.0),
                    "reason": reason,
                    "answer": answer,
                })
            })
            .collect();
        let counts = report.counts();
        Ok::<_, HandlerError>(json!({
            "multicast_id": report.multicast_id.to_string(),
            "met": report.met,
            "elapsed_ms": u64::try_from(report.elapsed.as_millis()).unwrap_or(u64::MAX),
            "counts": {
                "replied": counts.replied,
                "refused": counts.refused,
                "no_responders": counts.no_responders,
                "silent": counts.silent,
                "not_awaited": counts.not_awaited,
                "failed": counts.failed,
            },
            "recipients": recipients,
        }))
    })
    .await?;
    Ok(())
}
