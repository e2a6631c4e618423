//! Contract-net (IACP's negotiate, Agentify's propose / refuse / assign): a requester calls
//! for proposals from every live holder of a capability (or a list it names), each answers
//! with a proposal (price, ETA, confidence, free terms) or a refusal before a deadline, the
//! requester's policy picks one, the winner gets the work as a task, the other proposers are
//! told they lost, and a settlement event records what was agreed; a price agreed is recorded in the credits
//! ledger ([`crate::credits`]).
//!
//! A bidder serves [`Agent::on_bid`](crate::Agent::on_bid) for the capability, beside its task
//! handler ([`Agent::on_task_capability`](crate::Agent::on_task_capability)) that does the work
//! once awarded. The requester runs [`Agent::negotiate`](crate::Agent::negotiate).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::SdkError;
use crate::protocol::codec::encode_payload;
use crate::protocol::envelope::{CONTENT_TYPE_MSGPACK, ContentType};
use crate::protocol::status::StatusCode;
use crate::task::TaskHandle;

/// How long bidders have to answer by default.
pub const DEFAULT_BID_DEADLINE: Duration = Duration::from_secs(2);
/// The topic of the settlement event a round ends with (`<root>.evt.negotiation.settled`).
pub const SETTLED_TOPIC: &str = "negotiation.settled";
/// The envelope header naming the round an awarded task came from.
pub const ROUND_HEADER: &str = "chorus-round";

/// What a bidder offers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Proposal {
    /// What it asks for the work (IACP's reward, in the requester's unit), if it says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price: Option<f64>,
    /// How long until the work is done, in milliseconds, if it says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_ms: Option<u64>,
    /// How sure it is of a good result, from 0 to 1, if it says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence: Option<f32>,
    /// Anything else, free-form.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub terms: serde_json::Value,
}

/// What one bidder answered.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// A proposal.
    Proposed(Proposal),
    /// A refusal, with its code and reason.
    Refused {
        /// Its code.
        status: StatusCode,
        /// Why.
        reason: String,
    },
    /// No answer before the deadline (or nobody listening).
    Silent,
}

/// One bidder's part in a round.
#[derive(Debug, Clone, PartialEq)]
pub struct Bid {
    /// The bidder.
    pub agent: String,
    /// Its answer.
    pub answer: Answer,
}

impl Bid {
    /// Its proposal, if it made one.
    pub fn proposal(&self) -> Option<&Proposal> {
        match &self.answer {
            Answer::Proposed(p) => Some(p),
            _ => None,
        }
    }
}

/// A function that picks a bid: the index of the winner among `bids` (every bid has a
/// proposal), or `None` to award nothing.
pub type PickFn = dyn Fn(&[Bid]) -> Option<usize> + Send + Sync;

/// How the requester picks among the proposals.
#[derive(Clone)]
#[non_exhaustive]
pub enum Policy {
    /// The lowest price (a proposal without one comes last).
    Cheapest,
    /// The shortest ETA (a proposal without one comes last).
    Fastest,
    /// The highest confidence (a proposal without one comes last).
    MostConfident,
    /// A function of its own.
    Pick(Arc<PickFn>),
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Policy::Cheapest => "Cheapest",
            Policy::Fastest => "Fastest",
            Policy::MostConfident => "MostConfident",
            Policy::Pick(_) => "Pick",
        })
    }
}

impl Policy {
    /// A policy that picks with `f`.
    pub fn pick(f: impl Fn(&[Bid]) -> Option<usize> + Send + Sync + 'static) -> Self {
        Policy::Pick(Arc::new(f))
    }

    /// The order of `bids` (all proposals) from best to worst.
    pub(crate) fn rank(&self, bids: &[Bid]) -> Vec<usize> {
        let key = |i: &usize| -> f64 {
            let Some(p) = bids[*i].proposal() else {
                return f64::INFINITY;
            };
            match self {
                Policy::Cheapest => p.price.unwrap_or(f64::INFINITY),
                #[allow(clippy::cast_precision_loss)]
                Policy::Fastest => p.eta_ms.map_or(f64::INFINITY, |e| e as f64),
                Policy::MostConfident => -f64::from(p.confidence.unwrap_or(f32::NEG_INFINITY)),
                Policy::Pick(_) => 0.0,
            }
        };
        let mut order: Vec<usize> = (0..bids.len()).collect();
        if let Policy::Pick(f) = self {
            // The chosen one first, then the rest as they came.
            if let Some(first) = f(bids).filter(|i| *i < bids.len()) {
                order.retain(|i| *i != first);
                order.insert(0, first);
                return order;
            }
            return Vec::new();
        }
        // Stable: equal keys keep the order the bids came in.
        order.sort_by(|a, b| key(a).total_cmp(&key(b)));
        order
    }
}

/// What a requester puts to a proposer instead of accepting its proposal as it is: its own
/// offer, beside the proposal it answers. The payload of a counter (section 7.10).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CounterOffer {
    /// What the requester offers.
    pub offer: Proposal,
    /// The proposal it answers.
    pub previous: Proposal,
}

/// How a requester counters: for each proposal, its own offer, or `None` to take it as it is.
pub type CounterFn = dyn Fn(&Bid) -> Option<Proposal> + Send + Sync;

/// A call for proposals.
#[derive(Debug, Clone)]
pub struct Negotiation {
    pub(crate) capability: String,
    pub(crate) payload: Bytes,
    pub(crate) content_type: ContentType,
    pub(crate) deadline: Duration,
    pub(crate) policy: Policy,
    pub(crate) bidders: Vec<String>,
    pub(crate) task_deadline: Option<Duration>,
    pub(crate) counter: Option<Counter>,
    pub(crate) customer: Option<String>,
}

/// A requester's counter function and how many times it may counter.
#[derive(Clone)]
pub(crate) struct Counter {
    pub(crate) offer: Arc<CounterFn>,
    pub(crate) rounds: u32,
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counter")
            .field("rounds", &self.rounds)
            .finish_non_exhaustive()
    }
}

impl Negotiation {
    /// A round for work on `capability`, put to every live holder of it (from discovery).
    pub fn capability(capability: impl Into<String>) -> Self {
        Negotiation {
            capability: capability.into(),
            payload: Bytes::new(),
            content_type: ContentType::default(),
            deadline: DEFAULT_BID_DEADLINE,
            policy: Policy::Cheapest,
            bidders: Vec::new(),
            task_deadline: None,
            counter: None,
            customer: None,
        }
    }

    /// Counters proposals before the award: for each proposal `offer` returns the requester's
    /// own offer (or `None` to take it as it is), put to the proposer, who answers with a new
    /// proposal (accepting the offer or meeting it part way) or refuses it, in which case its
    /// proposal stands. Up to `rounds` times (at least 1), each within the round's deadline;
    /// the policy then ranks what stands.
    pub fn counter(
        mut self,
        rounds: u32,
        offer: impl Fn(&Bid) -> Option<Proposal> + Send + Sync + 'static,
    ) -> Self {
        self.counter = Some(Counter {
            offer: Arc::new(offer),
            rounds: rounds.max(1),
        });
        self
    }

    /// The work, as the bidders see it and as the winner's task gets it.
    ///
    /// # Errors
    /// [`SdkError::Codec`] when `value` does not encode as MessagePack.
    pub fn payload<T: Serialize + ?Sized>(mut self, value: &T) -> Result<Self, SdkError> {
        self.payload = encode_payload(value, CONTENT_TYPE_MSGPACK)?;
        self.content_type = ContentType::default();
        Ok(self)
    }

    /// How long bidders have to answer (default 2 s); a bidder silent past it loses.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// How the winner is picked (default [`Policy::Cheapest`]).
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Asks these agents instead of the capability's live holders.
    pub fn bidders<I, S>(mut self, agents: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.bidders = agents.into_iter().map(Into::into).collect();
        self
    }

    /// The deadline of the task the winner is given.
    pub fn task_deadline(mut self, deadline: Duration) -> Self {
        self.task_deadline = Some(deadline);
        self
    }

    /// The customer the work is for: the winner's task carries it, and the ledger records
    /// the price under it ([`crate::credits`]).
    pub fn customer(mut self, customer: impl Into<String>) -> Self {
        self.customer = Some(customer.into());
        self
    }
}

/// How a round ended: who won with what, every bid, and the winner's task.
#[derive(Debug, Clone)]
pub struct Award {
    /// The round's id (the correlation id of its messages).
    pub round: Uuid,
    /// The capability.
    pub capability: String,
    /// The winner.
    pub winner: String,
    /// Its proposal.
    pub proposal: Proposal,
    /// Every bidder's answer, in the order asked.
    pub bids: Vec<Bid>,
    /// The task the winner took.
    pub task: TaskHandle,
}

/// The payload of the settlement event (`negotiation.settled`) that ends an awarded round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settlement {
    /// The round.
    pub round: Uuid,
    /// The capability.
    pub capability: String,
    /// Who asked.
    pub requester: String,
    /// Who won.
    pub winner: String,
    /// What was agreed.
    pub proposal: Proposal,
    /// The winner's task.
    pub task: Uuid,
    /// Bidders asked.
    pub asked: usize,
    /// Proposals received.
    pub proposals: usize,
    /// Refusals received.
    pub refusals: usize,
    /// Counter-offers put to proposers.
    #[serde(default)]
    pub countered: usize,
    /// The customer the work is for, if the round named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub customer: Option<String>,
    /// Whether the price was recorded in the credits ledger (by this settlement or an
    /// earlier one of the same round); false without a price.
    #[serde(default)]
    pub credited: bool,
}

/// What a bidder learns of a round it proposed in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundResult {
    /// The round.
    pub round: Uuid,
    /// The capability.
    pub capability: String,
    /// Whether it won (it is then given the work as a task).
    pub won: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bid(agent: &str, price: Option<f64>, eta: Option<u64>, confidence: Option<f32>) -> Bid {
        Bid {
            agent: agent.into(),
            answer: Answer::Proposed(Proposal {
                price,
                eta_ms: eta,
                confidence,
                terms: serde_json::Value::Null,
            }),
        }
    }

    #[test]
    fn each_policy_ranks_the_proposals_its_way_and_missing_values_come_last() {
        let bids = vec![
            bid("a", Some(5.0), Some(300), Some(0.5)),
            bid("b", Some(2.0), None, Some(0.9)),
            bid("c", None, Some(100), None),
            bid("d", Some(2.0), Some(200), Some(0.7)),
        ];
        assert_eq!(Policy::Cheapest.rank(&bids), [1, 3, 0, 2]);
        assert_eq!(Policy::Fastest.rank(&bids), [2, 3, 0, 1]);
        assert_eq!(Policy::MostConfident.rank(&bids), [1, 3, 0, 2]);
        let last = Policy::pick(|bids: &[Bid]| Some(bids.len() - 1));
        assert_eq!(last.rank(&bids), [3, 0, 1, 2]);
        let none = Policy::pick(|_: &[Bid]| None);
        assert!(none.rank(&bids).is_empty());
        let out_of_range = Policy::pick(|_: &[Bid]| Some(99));
        assert!(out_of_range.rank(&bids).is_empty());
    }

    #[test]
    fn a_proposal_round_trips_and_leaves_out_what_it_does_not_say() {
        let p = Proposal {
            price: Some(3.5),
            eta_ms: None,
            confidence: Some(0.8),
            terms: serde_json::json!({"model": "small"}),
        };
        let json = serde_json::to_value(&p).expect("encodes");
        assert_eq!(
            json,
            serde_json::json!({"price": 3.5, "confidence": 0.800000011920929, "terms": {"model": "small"}})
        );
        let back: Proposal = serde_json::from_value(json).expect("decodes");
        assert_eq!(back.price, p.price);
        assert_eq!(
            serde_json::from_value::<Proposal>(serde_json::json!({})).expect("empty"),
            Proposal::default()
        );
    }
}
