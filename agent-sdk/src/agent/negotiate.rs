//! Contract-net from the agent's side: bidding, and running a round.

use crate::Report;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Agent, SYNC_TIMEOUT};
use crate::credits::LedgerEntry;
use crate::error::{HandlerError, SdkError};
use crate::handler::endpoint::{Endpoint, EndpointKind};
use crate::handler::{BoxFuture, Context, Handler, Output};
use crate::inbound::reader::Route;
use crate::negotiate::{
    Answer, Award, Bid, CounterOffer, Negotiation, Proposal, ROUND_HEADER, RoundResult,
    SETTLED_TOPIC, Settlement,
};
use crate::outbound::Call;
use crate::protocol::codec::{decode_payload, encode_payload};
use crate::protocol::envelope::{CONTENT_TYPE_MSGPACK, Envelope, Kind, Performative};
use crate::protocol::status::StatusCode;

/// How a bid handler is called: the call for proposals decoded as `T`.
type BidFn<T> = dyn Fn(Context, T) -> BoxFuture<Result<Proposal, HandlerError>> + Send + Sync;

/// How a counter handler is called.
type CounterHandler =
    dyn Fn(Context, CounterOffer) -> BoxFuture<Result<Proposal, HandlerError>> + Send + Sync;

/// An agent's counter handlers, by capability.
#[derive(Clone, Default)]
pub(crate) struct Counters(
    Arc<std::sync::Mutex<std::collections::HashMap<String, Arc<CounterHandler>>>>,
);

impl Counters {
    fn get(&self, capability: &str) -> Option<Arc<CounterHandler>> {
        crate::sync::lock(&self.0).get(capability).cloned()
    }
}

/// Serves one capability's calls for proposals and counter-offers, and hears the rounds'
/// outcomes.
struct BidEndpoint<T> {
    capability: String,
    bid: Arc<BidFn<T>>,
    rounds: tokio::sync::broadcast::Sender<RoundResult>,
    counters: Counters,
}

impl<T: DeserializeOwned + Send + 'static> Handler for BidEndpoint<T> {
    fn call(&self, ctx: Context) -> BoxFuture<Result<Output, HandlerError>> {
        let message = ctx.message();
        match message.performative {
            Performative::Negotiate => {
                let args = decode_payload::<T>(&message.payload, &message.content_type);
                let bid = Arc::clone(&self.bid);
                Box::pin(async move {
                    let proposal = bid(ctx, args?).await?;
                    Ok(Output {
                        payload: encode_payload(&proposal, CONTENT_TYPE_MSGPACK)?,
                        content_type: CONTENT_TYPE_MSGPACK.into(),
                    })
                })
            }
            // A counter-offer to its proposal.
            Performative::Propose => {
                let counter = self.counters.get(&self.capability);
                let capability = self.capability.clone();
                let offer = decode_payload::<CounterOffer>(&message.payload, &message.content_type);
                Box::pin(async move {
                    let Some(counter) = counter else {
                        return Err(HandlerError::new(
                            StatusCode::UNKNOWN_COMMAND,
                            format!(
                                "no counter-offers taken for {capability}: the proposal stands"
                            ),
                        ));
                    };
                    let proposal = counter(ctx, offer?).await?;
                    Ok(Output {
                        payload: encode_payload(&proposal, CONTENT_TYPE_MSGPACK)?,
                        content_type: CONTENT_TYPE_MSGPACK.into(),
                    })
                })
            }
            // The outcome of a round it proposed in.
            Performative::Refuse | Performative::Agree => {
                if let Some(round) = message.correlation_id {
                    let _ = self.rounds.send(RoundResult {
                        round,
                        capability: self.capability.clone(),
                        won: message.performative == Performative::Agree,
                    });
                }
                Box::pin(async { Ok(Output::default()) })
            }
            other => Box::pin(async move {
                Err(HandlerError::invalid_argument(format!(
                    "a bid subject takes calls for proposals (negotiate) and outcomes, not {other}"
                )))
            }),
        }
    }
}

impl Agent {
    /// Bids for work on `capability` (contract-net): each call for proposals is decoded as `T`
    /// and `f` answers with a [`Proposal`], or an error to refuse (its code goes back). Serve
    /// the work itself with [`Agent::on_task_capability`]: a won round arrives as a task.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `capability` is not a valid capability name; [`SdkError::Broker`]
    /// when the subscription cannot be made or the server does not confirm it in time.
    pub async fn on_bid<T, F, Fut>(&self, capability: &str, f: F) -> Result<(), SdkError>
    where
        F: Fn(Context, T) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Proposal, HandlerError>> + Send + 'static,
        T: DeserializeOwned + Send + 'static,
    {
        let inner = &self.inner;
        let subject = inner.link.subjects.bid(&inner.link.id, capability)?;
        let sub = inner.link.broker.subscribe(&subject).await?;
        inner.link.broker.sync(SYNC_TIMEOUT).await?;
        let bid: Arc<BidFn<T>> = Arc::new(move |ctx, args| Box::pin(f(ctx, args)));
        let endpoint = Arc::new(Endpoint::new(
            format!("bid.{capability}"),
            subject,
            None,
            EndpointKind::Capability,
            Arc::new(BidEndpoint {
                capability: capability.to_owned(),
                bid,
                rounds: inner.rounds.clone(),
                counters: inner.counters.clone(),
            }),
        ));
        inner.endpoints.add(Arc::clone(&endpoint));
        inner.dispatcher.spawn(sub, Route::Capability(endpoint));
        Ok(())
    }

    /// Answers counter-offers to this agent's proposals for `capability` (contract-net): `f`
    /// gets the requester's offer beside the proposal it answers and returns a new proposal
    /// (the offer itself to accept it, or something between), or an error to refuse it, in which
    /// case the earlier proposal stands. Without it, counter-offers are refused with 5016.
    pub fn on_counter<F, Fut>(&self, capability: &str, f: F)
    where
        F: Fn(Context, CounterOffer) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Proposal, HandlerError>> + Send + 'static,
    {
        let handler: Arc<CounterHandler> = Arc::new(move |ctx, offer| Box::pin(f(ctx, offer)));
        crate::sync::lock(&self.inner.counters.0).insert(capability.to_owned(), handler);
    }

    /// The outcomes of the rounds this agent proposes in, from now on: lost (told by the
    /// requester) or won.
    pub fn round_results(&self) -> tokio::sync::broadcast::Receiver<RoundResult> {
        self.inner.rounds.subscribe()
    }

    /// Runs a contract-net round: calls for proposals from the capability's live holders (or
    /// the bidders named), waits up to the deadline, ranks the proposals by the policy and
    /// gives the work to the best as a task (the next best if it will not take it), tells the
    /// other proposers they lost, and publishes a [`Settlement`] on `negotiation.settled`.
    /// Without any proposal (all refused or silent), or with a policy that picks none, no
    /// task is started and the error says what each bidder answered.
    ///
    /// # Errors
    /// Without named bidders, the errors of [`discover`](Agent::discover);
    /// [`SdkError::NoResponders`] when there is no bidder to ask; [`SdkError::Remote`] with 5019
    /// when no proposal was awarded (the reason says what each bidder answered).
    pub async fn negotiate(&self, round: Negotiation) -> Result<Award, SdkError> {
        let out = &self.inner.out;
        let capability = round.capability.clone();
        let bidders = if round.bidders.is_empty() {
            self.discover_capability(&capability)
                .await?
                .into_iter()
                .map(|r| r.manifest.agent)
                .filter(|a| *a != out.link.id)
                .collect()
        } else {
            round.bidders.clone()
        };
        if bidders.is_empty() {
            return Err(SdkError::NoResponders(format!("bids for {capability}")));
        }
        let id = uuid::Uuid::now_v7();
        let asks = bidders.iter().map(|bidder| self.ask(id, &round, bidder));
        let answers = futures::future::join_all(asks).await;
        let mut bids: Vec<Bid> = bidders
            .into_iter()
            .zip(answers)
            .map(|(agent, answer)| Bid { agent, answer })
            .collect();
        let mut countered = 0;
        if let Some(counter) = &round.counter {
            for _ in 0..counter.rounds {
                let offers: Vec<(usize, CounterOffer)> = bids
                    .iter()
                    .enumerate()
                    .filter_map(|(i, bid)| {
                        let previous = bid.proposal()?.clone();
                        let offer = (counter.offer)(bid)?;
                        Some((i, CounterOffer { offer, previous }))
                    })
                    .collect();
                if offers.is_empty() {
                    break;
                }
                let round = &round;
                let asks = offers.iter().map(|(i, offer)| {
                    let payload = encode_payload(offer, CONTENT_TYPE_MSGPACK);
                    let agent = bids[*i].agent.clone();
                    async move {
                        match payload {
                            Ok(p) => {
                                self.ask_with(id, round, &agent, Performative::Propose, p)
                                    .await
                            }
                            Err(err) => Answer::Refused {
                                status: StatusCode::DATA_FORMAT,
                                reason: err.to_string(),
                            },
                        }
                    }
                });
                let answers = futures::future::join_all(asks).await;
                for ((i, _), answer) in offers.into_iter().zip(answers) {
                    countered += 1;
                    match answer {
                        Answer::Proposed(p) => bids[i].answer = Answer::Proposed(p),
                        other => {
                            tracing::debug!(round = %id, agent = %bids[i].agent, answer = ?other, "counter-offer not taken: the proposal stands");
                        }
                    }
                }
            }
        }
        let proposals: Vec<Bid> = bids
            .iter()
            .filter(|b| b.proposal().is_some())
            .cloned()
            .collect();
        let order = round.policy.rank(&proposals);
        let mut task = None;
        for i in order {
            let winner = &proposals[i];
            let mut call = Call::capability_at(winner.agent.as_str(), capability.as_str())
                .raw_payload(round.payload.clone(), round.content_type.clone())
                .header(ROUND_HEADER, id.to_string());
            if let Some(deadline) = round.task_deadline {
                call = call.deadline(deadline);
            }
            if let Some(customer) = &round.customer {
                call = call.customer(customer.clone());
            }
            match self.submit(call).await {
                Ok(handle) => {
                    task = Some((winner.clone(), handle));
                    break;
                }
                Err(err) => {
                    tracing::info!(round = %id, agent = %winner.agent, error = %Report(&err), "award not taken; trying the next proposal");
                }
            }
        }
        let Some((winner, task)) = task else {
            let summary: Vec<String> = bids
                .iter()
                .map(|b| match &b.answer {
                    Answer::Proposed(_) => format!("{} proposed", b.agent),
                    Answer::Refused { status, .. } => format!("{} refused ({status})", b.agent),
                    Answer::Silent => format!("{} was silent", b.agent),
                })
                .collect();
            // Every proposer lost.
            for bid in &proposals {
                self.tell(id, &capability, &bid.agent, false).await;
            }
            return Err(SdkError::Remote {
                status: StatusCode::UNAVAILABLE,
                reason: format!(
                    "no proposal for {capability} was awarded: {}",
                    summary.join(", ")
                ),
                from: None,
            });
        };
        for bid in &proposals {
            self.tell(id, &capability, &bid.agent, bid.agent == winner.agent)
                .await;
        }
        let proposal = winner.proposal().cloned().unwrap_or_default();
        let credited = match proposal.price {
            Some(price) => {
                let entry = LedgerEntry {
                    round: id,
                    capability: capability.clone(),
                    payer: out.link.id.clone(),
                    payee: winner.agent.clone(),
                    customer: round.customer.clone(),
                    price,
                    task: task.id(),
                    settled_ms: crate::protocol::envelope::now_ms(),
                };
                match self.credit(&entry).await {
                    Ok(()) => true,
                    Err(err) => {
                        tracing::warn!(round = %id, error = %Report(&err), "price not recorded in the credits ledger");
                        false
                    }
                }
            }
            None => false,
        };
        let settlement = Settlement {
            round: id,
            capability: capability.clone(),
            requester: out.link.id.clone(),
            winner: winner.agent.clone(),
            proposal: proposal.clone(),
            task: task.id(),
            asked: bids.len(),
            proposals: proposals.len(),
            refusals: bids
                .iter()
                .filter(|b| matches!(b.answer, Answer::Refused { .. }))
                .count(),
            countered,
            customer: round.customer.clone(),
            credited,
        };
        if let Err(err) = self.publish(SETTLED_TOPIC, &settlement).await {
            tracing::warn!(round = %id, error = %Report(&err), "settlement not published");
        }
        Ok(Award {
            round: id,
            capability,
            winner: winner.agent,
            proposal,
            bids,
            task,
        })
    }

    /// Records `entry` in the credits ledger (once: a round recorded before stays as it is).
    async fn credit(&self, entry: &LedgerEntry) -> Result<(), SdkError> {
        self.ledger().await?.record(entry).await.map(|_| ())
    }

    /// One bidder's answer to the call for proposals, within the round's deadline.
    async fn ask(&self, round: uuid::Uuid, negotiation: &Negotiation, bidder: &str) -> Answer {
        self.ask_with(
            round,
            negotiation,
            bidder,
            Performative::Negotiate,
            negotiation.payload.clone(),
        )
        .await
    }

    /// A request on the bidder's bid subject (a call for proposals, or a counter-offer whose
    /// payload is a [`CounterOffer`]) and the proposal it answers with.
    async fn ask_with(
        &self,
        round: uuid::Uuid,
        negotiation: &Negotiation,
        bidder: &str,
        performative: Performative,
        payload: bytes::Bytes,
    ) -> Answer {
        let out = &self.inner.out;
        let subject = match out.link.subjects.bid(bidder, &negotiation.capability) {
            Ok(subject) => subject,
            Err(err) => {
                return Answer::Refused {
                    status: StatusCode::INVALID_ARGUMENT,
                    reason: err.to_string(),
                };
            }
        };
        let content_type = if performative == Performative::Negotiate {
            negotiation.content_type.clone()
        } else {
            CONTENT_TYPE_MSGPACK.into()
        };
        let call = Call::capability_at(bidder, negotiation.capability.as_str())
            .raw_payload(payload, content_type)
            .timeout(negotiation.deadline);
        let (_, mut env, timeout) = match out.prepare(call, None) {
            Ok(prepared) => prepared,
            Err(err) => {
                return Answer::Refused {
                    status: err.status(),
                    reason: err.to_string(),
                };
            }
        };
        env.performative = performative;
        env.correlation_id = Some(round);
        let otel = opentelemetry::Context::current();
        match out.exchange(&subject, env, timeout, &otel).await {
            Ok(reply) => match reply.payload_as::<Proposal>() {
                Ok(proposal) => Answer::Proposed(proposal),
                Err(err) => Answer::Refused {
                    status: StatusCode::DATA_FORMAT,
                    reason: format!("the proposal does not decode: {err}"),
                },
            },
            Err(SdkError::Remote { status, reason, .. }) => Answer::Refused { status, reason },
            Err(_) => Answer::Silent,
        }
    }

    /// Tells a proposer the round's outcome (one way: nothing is awaited).
    async fn tell(&self, round: uuid::Uuid, capability: &str, agent: &str, won: bool) {
        let out = &self.inner.out;
        let Ok(subject) = out.link.subjects.bid(agent, capability) else {
            return;
        };
        let performative = if won {
            Performative::Agree
        } else {
            Performative::Refuse
        };
        let mut env = Envelope::new(Kind::Command, performative, out.link.id.as_str());
        env.correlation_id = Some(round);
        env.to = vec![agent.to_owned()];
        env.capability = Some(capability.to_owned());
        env.reason = (!won).then(|| "another proposal was awarded".to_owned());
        out.seal(&subject, &mut env);
        let sent = match out.encode(&subject, &env) {
            Ok(bytes) => out
                .link
                .broker
                .publish(&subject, bytes)
                .await
                .map_err(SdkError::from),
            Err(err) => Err(err.into()),
        };
        if let Err(err) = sent {
            tracing::debug!(%round, %agent, error = %Report(&err), "round outcome not sent");
        }
    }
}

/// A proposal a bidder makes with `price`, `eta_ms` and `confidence`.
impl Proposal {
    /// A proposal at `price`.
    pub fn at(price: f64) -> Self {
        Proposal {
            price: Some(price),
            ..Proposal::default()
        }
    }

    /// With an ETA.
    pub fn eta_ms(mut self, eta_ms: u64) -> Self {
        self.eta_ms = Some(eta_ms);
        self
    }

    /// With a confidence (0 to 1).
    pub fn confidence(mut self, confidence: f32) -> Self {
        self.confidence = Some(confidence);
        self
    }

    /// With free-form terms.
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] when `terms` does not serialize to JSON.
    pub fn terms<T: Serialize>(mut self, terms: &T) -> Result<Self, SdkError> {
        self.terms = serde_json::to_value(terms)
            .map_err(|e| SdkError::InvalidCall(format!("terms do not encode: {e}")))?;
        Ok(self)
    }
}
