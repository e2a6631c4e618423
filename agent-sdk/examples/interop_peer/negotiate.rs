//! The peer's part for the Python SDK's negotiate tests (contract-net, section 7.10).
//!
//! As a bidder, when `PEER_BID_CAPABILITY` names a capability: it holds it (discovery finds
//! it), answers its calls for proposals with `PEER_BID_PRICE` (a number, default 5; `refuse`:
//! refused with 5019; `silent`: no answer), with `PEER_BID_ETA_MS` and `PEER_BID_CONFIDENCE`
//! when set, answers counter-offers as `PEER_COUNTER` says (`accept`: the offer itself;
//! `split`: the midpoint of its price and the offer's; unset: none taken, 5016), and does the
//! work when awarded: the task answers `<id> did <payload as JSON>`.
//!
//! - the command `rounds`: the outcomes of the rounds it proposed in so far, `[{"round",
//!   "capability", "won"}]`;
//! - the command `negotiate` (`{"capability", "payload", "bidders", "deadline_ms", "policy":
//!   "cheapest" | "fastest" | "confident", "counter_by", "counter_rounds", "wait"}`): runs a
//!   round as the requester (countering each proposal at its price less `counter_by` when
//!   given) and returns `{"round", "winner", "proposal", "task", "bids": [{"agent", "answer",
//!   "proposal" | "status", "reason"}], "state", "output"}` (`state` and `output` of the
//!   winner's task with `wait`), or fails with the round's code and reason.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_sdk::negotiate::{Answer, CounterOffer, Negotiation, Policy, Proposal};
use chorus_sdk::{Agent, AgentOptions, Context, HandlerError, StatusCode, TaskContext};
use serde::Deserialize;
use serde_json::{Value, json};

/// How the peer bids, from the environment.
#[derive(Debug, Clone)]
struct Bidding {
    capability: String,
    price: Price,
    eta_ms: Option<u64>,
    confidence: Option<f32>,
    counter: Option<String>,
}

#[derive(Debug, Clone, Copy)]
enum Price {
    At(f64),
    Refuse,
    Silent,
}

fn bidding() -> Result<Option<Bidding>, Box<dyn std::error::Error>> {
    let Ok(capability) = std::env::var("PEER_BID_CAPABILITY") else {
        return Ok(None);
    };
    let price = match std::env::var("PEER_BID_PRICE").as_deref() {
        Err(_) => Price::At(5.0),
        Ok("refuse") => Price::Refuse,
        Ok("silent") => Price::Silent,
        Ok(number) => Price::At(number.parse()?),
    };
    let eta_ms = match std::env::var("PEER_BID_ETA_MS") {
        Ok(v) => Some(v.parse()?),
        Err(_) => None,
    };
    let confidence = match std::env::var("PEER_BID_CONFIDENCE") {
        Ok(v) => Some(v.parse()?),
        Err(_) => None,
    };
    let counter = std::env::var("PEER_COUNTER").ok();
    if let Some(c) = &counter
        && c != "accept"
        && c != "split"
    {
        return Err(format!("PEER_COUNTER {c:?}: accept or split").into());
    }
    Ok(Some(Bidding {
        capability,
        price,
        eta_ms,
        confidence,
        counter,
    }))
}

/// Settings of this part, from the environment.
pub fn options(options: AgentOptions) -> Result<AgentOptions, Box<dyn std::error::Error>> {
    Ok(match bidding()? {
        Some(b) => options.capability(b.capability),
        None => options,
    })
}

#[derive(Debug, Deserialize)]
struct Round {
    capability: String,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    bidders: Vec<String>,
    #[serde(default)]
    deadline_ms: Option<u64>,
    #[serde(default)]
    policy: Option<String>,
    #[serde(default)]
    counter_by: Option<f64>,
    #[serde(default)]
    counter_rounds: Option<u32>,
    #[serde(default)]
    wait: bool,
}

/// The handlers of this part.
pub async fn register(peer: &Agent) -> Result<(), Box<dyn std::error::Error>> {
    let rounds = Arc::new(Mutex::new(Vec::<Value>::new()));
    if let Some(b) = bidding()? {
        let mut results = peer.round_results();
        let seen = Arc::clone(&rounds);
        tokio::spawn(async move {
            while let Ok(r) = results.recv().await {
                if let Ok(mut seen) = seen.lock() {
                    seen.push(json!({"round": r.round, "capability": r.capability, "won": r.won}));
                }
            }
        });
        let bid = b.clone();
        peer.on_bid(&b.capability, move |_ctx: Context, _work: Value| {
            let bid = bid.clone();
            async move {
                match bid.price {
                    Price::At(price) => {
                        let mut p = Proposal::at(price);
                        p.eta_ms = bid.eta_ms;
                        p.confidence = bid.confidence;
                        Ok(p)
                    }
                    Price::Refuse => Err(HandlerError::new(
                        StatusCode::UNAVAILABLE,
                        "busy with other work",
                    )),
                    Price::Silent => {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        Ok(Proposal::at(0.0))
                    }
                }
            }
        })
        .await?;
        match b.counter.as_deref() {
            Some("accept") => {
                peer.on_counter(&b.capability, |_ctx: Context, c: CounterOffer| async move {
                    Ok(c.offer)
                });
            }
            Some(_) => {
                peer.on_counter(&b.capability, |_ctx: Context, c: CounterOffer| async move {
                    let asked = c.previous.price.unwrap_or_default();
                    let offered = c.offer.price.unwrap_or_default();
                    Ok(Proposal::at(f64::midpoint(asked, offered)))
                });
            }
            None => {}
        }
        peer.on_task_capability(&b.capability, |task: TaskContext, work: Value| async move {
            Ok::<_, HandlerError>(format!("{} did {work}", task.agent_id()))
        })
        .await?;
    }
    peer.on_command("rounds", move |_ctx: Context, _v: Value| {
        let rounds = Arc::clone(&rounds);
        async move {
            let seen = rounds.lock().map(|r| r.clone()).unwrap_or_default();
            Ok::<_, HandlerError>(Value::Array(seen))
        }
    })
    .await?;
    let requester = peer.clone();
    peer.on_command("negotiate", move |_ctx: Context, order: Round| {
        let requester = requester.clone();
        async move { run_round(&requester, order).await }
    })
    .await?;
    Ok(())
}

/// Runs the round `order` describes and says how it went.
async fn run_round(requester: &Agent, order: Round) -> Result<Value, HandlerError> {
    let policy = match order.policy.as_deref() {
        None | Some("cheapest") => Policy::Cheapest,
        Some("fastest") => Policy::Fastest,
        Some("confident") => Policy::MostConfident,
        Some(other) => {
            return Err(HandlerError::invalid_argument(format!(
                "policy {other:?}: cheapest, fastest or confident"
            )));
        }
    };
    let mut round = Negotiation::capability(&order.capability)
        .payload(&order.payload)?
        .policy(policy)
        .bidders(order.bidders);
    if let Some(ms) = order.deadline_ms {
        round = round.deadline(Duration::from_millis(ms));
    }
    if let Some(by) = order.counter_by {
        round = round.counter(order.counter_rounds.unwrap_or(1), move |bid| {
            bid.proposal()
                .and_then(|p| p.price)
                .map(|price| Proposal::at(price - by))
        });
    }
    let award = requester.negotiate(round).await?;
    let bids: Vec<Value> = award
        .bids
        .iter()
        .map(|b| match &b.answer {
            Answer::Proposed(p) => json!({"agent": b.agent, "answer": "proposed", "proposal": p}),
            Answer::Refused { status, reason } => {
                json!({"agent": b.agent, "answer": "refused", "status": status.0, "reason": reason})
            }
            Answer::Silent => json!({"agent": b.agent, "answer": "silent"}),
        })
        .collect();
    let mut out = json!({
        "round": award.round,
        "winner": award.winner,
        "proposal": award.proposal,
        "task": award.task.id(),
        "bids": bids,
    });
    if order.wait {
        let report = award.task.result().await?;
        out["state"] = json!(report.state.to_string());
        out["output"] = report.output_as::<Value>().unwrap_or(Value::Null);
    }
    Ok(out)
}
