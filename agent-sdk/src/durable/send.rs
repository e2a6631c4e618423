//! Sending in a delivery class: at most once on core NATS, at least once and exactly once into
//! the recipient's durable inbox (JetStream), with the publish retried when its ack is lost.

use crate::Report;
use std::sync::Arc;

use chorus_broker_adapter::{BatchMessage, ErrorKind};
use uuid::Uuid;

use super::{DEAD_LETTER_HEADROOM, InboxLimits, inbox_stream};
use crate::error::SdkError;
use crate::outbound::{Call, Notify, NotifyReport, NotifyTarget, Outbound, Parent, Target};
use crate::protocol::codec::CodecError;
use crate::protocol::envelope::{DeliveryClass, Envelope, Kind, Priority};
use crate::protocol::registry::{BroadcastReport, Outcome, RecipientReport};
use crate::protocol::status::StatusCode;
use crate::stats::AgentCounters;

/// Acks outstanding at once in [`Agent::send_batch`](crate::Agent::send_batch).
pub const BATCH_ACKS_IN_FLIGHT: usize = 256;
/// How many times a durable publish is sent when its ack does not come back.
const PUBLISH_ATTEMPTS: u32 = 3;

/// What [`Agent::send`](crate::Agent::send) got back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Receipt {
    /// The message id (for durable classes also its JetStream dedupe id).
    pub id: Uuid,
    /// The delivery class it was sent with.
    pub delivery: DeliveryClass,
    /// Its sequence in the inbox stream, for durable classes.
    pub stream_seq: Option<u64>,
    /// Whether the server already had it (an exactly-once resend of the same id).
    pub duplicate: bool,
}

/// Sends one-way messages for one agent.
pub(crate) struct Sender {
    /// The agent's identity, subjects, connection and counters.
    pub(crate) link: Arc<crate::link::Link>,
    pub(crate) out: Arc<Outbound>,
}

impl Sender {
    pub(crate) fn new(out: Arc<Outbound>) -> Self {
        Sender {
            link: Arc::clone(&out.link),
            out,
        }
    }

    /// Makes sure the inbox stream exists before the first durable send, so commands for an
    /// agent that has never run are kept (the coordinator normally creates it first).
    async fn ensure_inbox(&self) -> Result<(), chorus_broker_adapter::Error> {
        self.link
            .inbox_ready
            .get_or_try_init(|| async {
                self.link
                    .js
                    .ensure_stream_exists(&inbox_stream(
                        &self.link.subjects,
                        &InboxLimits::default(),
                    ))
                    .await
            })
            .await
            .map(|_| ())
    }

    /// Builds the envelope and subject of a one-way send in `class`.
    fn prepare_send(
        &self,
        call: Call,
        class: DeliveryClass,
        parent: Option<&Envelope>,
    ) -> Result<(String, Envelope), SdkError> {
        let ttl = call.ttl;
        let high = matches!(call.priority, Priority::High | Priority::Critical);
        let notification = call.kind == Kind::Notification;
        let durable_target = match (&call.target, class) {
            (_, DeliveryClass::AtMostOnce) => None,
            (Target::Agent(agent), _) => {
                Some((agent.clone(), call.name.clone().unwrap_or_default()))
            }
            (Target::Capability(_) | Target::CapabilityAt { .. }, _) => {
                return Err(SdkError::InvalidCall(
                    "durable messages go to one agent's inbox, not to a capability".into(),
                ));
            }
        };
        let (core_subject, mut env, _) = self.out.prepare(call, parent)?;
        env.expect = None;
        env.ttl_ms = ttl.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
        env.delivery = class;
        let (span, trace) = crate::trace::start(
            opentelemetry::trace::SpanKind::Producer,
            &opentelemetry::Context::current(),
            env.trace.as_ref(),
            || format!("chorus.send {}", env.name.as_deref().unwrap_or_default()),
            || crate::trace::attributes(&self.link.id, &env),
        );
        env.trace = Some(trace);
        crate::trace::finish(span.as_ref(), None);
        let subject = match durable_target {
            None => core_subject,
            Some((agent, _)) if notification => {
                self.link.subjects.durable_notification(&agent, high)?
            }
            Some((agent, command)) => self.link.subjects.durable(&agent, &command, high)?,
        };
        Ok((subject, env))
    }

    /// Sends a one-way command in the call's delivery class (or the agent's default):
    ///
    /// - at most once: published on core NATS to the agent's command subject; no reply, no
    ///   storage; gone if nobody is listening;
    /// - at least once: stored in the recipient's durable inbox, redelivered until handled,
    ///   retried by the retry policy, dead-lettered when it cannot be handled;
    /// - exactly once: at least once, and the recipient records the message id so the handler
    ///   runs once however many copies arrive.
    ///
    /// Durable sends return once JetStream has stored the message; a publish whose ack is lost
    /// is sent again, stored once for exactly-once (the server dedupes its message id) and
    /// possibly twice for at least once (which allows a duplicate).
    pub(crate) async fn send(&self, call: Call) -> Result<Receipt, SdkError> {
        self.send_from(call, None).await
    }

    /// Sends as [`send`](Sender::send) does, as a forward of `parent` when given (its
    /// conversation, one more hop, its deadline).
    pub(crate) async fn send_from(
        &self,
        call: Call,
        parent: Option<&Envelope>,
    ) -> Result<Receipt, SdkError> {
        let class = call.delivery.unwrap_or(self.out.default_delivery);
        let (subject, mut env) = self.prepare_send(call, class, parent)?;
        self.out.fit(&mut env).await?;
        self.out.seal(&subject, &mut env);
        let bytes = self.out.encode(&subject, &env)?;
        AgentCounters::bump(&self.link.counters.requests_sent);
        if class == DeliveryClass::AtMostOnce {
            self.link.broker.publish(&subject, bytes).await?;
            return Ok(Receipt {
                id: env.id,
                delivery: class,
                stream_seq: None,
                duplicate: false,
            });
        }
        self.leaves_room_for_a_dead_letter(bytes.len())?;
        self.ensure_inbox().await?;
        let msg_id = dedupe_id(&env.id, class);
        let mut attempt = 0;
        let ack = loop {
            attempt += 1;
            match self
                .link
                .js
                .publish(&subject, None, msg_id.as_deref(), None, bytes.clone())
                .await
            {
                Ok(ack) => break ack,
                Err(e) if e.kind() == ErrorKind::TimedOut && attempt < PUBLISH_ATTEMPTS => {
                    tracing::debug!(agent = %self.link.id, id = %env.id, "durable publish ack lost; resending");
                }
                Err(e) => return Err(SdkError::Broker(e)),
            }
        };
        Ok(Receipt {
            id: env.id,
            delivery: class,
            stream_seq: Some(ack.sequence),
            duplicate: ack.duplicate,
        })
    }

    /// Sends many one-way commands at once. Durable ones are published with up to
    /// [`BATCH_ACKS_IN_FLIGHT`] acks outstanding and their acks awaited together; core ones
    /// are published and flushed once. Results come back in the order of `calls`; a
    /// publisher that outruns the server waits here instead of buffering without bound.
    pub(crate) async fn send_batch(&self, calls: Vec<Call>) -> Vec<Result<Receipt, SdkError>> {
        let mut results: Vec<Option<Result<Receipt, SdkError>>> = Vec::with_capacity(calls.len());
        let mut durable: Vec<(usize, Uuid, DeliveryClass)> = Vec::new();
        let mut batch = Vec::new();
        let mut core_sent = false;
        for call in calls {
            let class = call.delivery.unwrap_or(self.out.default_delivery);
            let prepared = match self.prepare_send(call, class, None) {
                Ok((subject, mut env)) => match self.out.fit(&mut env).await {
                    Ok(()) => {
                        self.out.seal(&subject, &mut env);
                        self.out
                            .encode(&subject, &env)
                            .map(|bytes| (subject, bytes, env.id))
                            .map_err(SdkError::from)
                    }
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            let (subject, bytes, id) = match prepared {
                Ok(p) => p,
                Err(e) => {
                    results.push(Some(Err(e)));
                    continue;
                }
            };
            AgentCounters::bump(&self.link.counters.requests_sent);
            if class == DeliveryClass::AtMostOnce {
                let sent = self.link.broker.publish(&subject, bytes).await;
                core_sent = true;
                results.push(Some(sent.map_err(SdkError::Broker).map(|()| Receipt {
                    id,
                    delivery: class,
                    stream_seq: None,
                    duplicate: false,
                })));
            } else if let Err(e) = self.leaves_room_for_a_dead_letter(bytes.len()) {
                results.push(Some(Err(e)));
            } else {
                durable.push((results.len(), id, class));
                results.push(None);
                batch.push(BatchMessage {
                    subject,
                    msg_id: dedupe_id(&id, class),
                    payload: bytes,
                });
            }
        }
        if core_sent && let Err(e) = self.link.broker.flush().await {
            tracing::debug!(agent = %self.link.id, error = %Report(&e), "flush after batch failed");
        }
        if !batch.is_empty()
            && let Err(e) = self.ensure_inbox().await
        {
            tracing::debug!(agent = %self.link.id, error = %Report(&e), "inbox stream not ensured; publishing anyway");
        }
        let acks = self
            .link
            .js
            .publish_batch(batch, BATCH_ACKS_IN_FLIGHT)
            .await;
        for ((slot, id, class), ack) in durable.into_iter().zip(acks) {
            results[slot] = Some(ack.map_err(SdkError::Broker).map(|a| Receipt {
                id,
                delivery: class,
                stream_seq: Some(a.sequence),
                duplicate: a.duplicate,
            }));
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(SdkError::Expired)))
            .collect()
    }
}

impl Sender {
    /// Refuses a durable message that would leave no room under the server's `max_payload`
    /// for its dead letter's headers: every stored command can then be dead-lettered whole.
    fn leaves_room_for_a_dead_letter(&self, size: usize) -> Result<(), SdkError> {
        let limit = self
            .link
            .broker
            .max_payload()
            .saturating_sub(DEAD_LETTER_HEADROOM);
        if size > limit {
            return Err(SdkError::Codec(CodecError::TooLarge { size, limit }));
        }
        Ok(())
    }
}

/// The `Nats-Msg-Id` a durable publish carries: the message id for exactly-once, so the
/// server stores a resent copy once; none for at-least-once, which allows a duplicate and
/// saves the server's dedupe work (about a fifth of JetStream's publish throughput, measured
/// in docs/PERFORMANCE.md).
fn dedupe_id(id: &Uuid, class: DeliveryClass) -> Option<String> {
    (class == DeliveryClass::ExactlyOnce).then(|| id.to_string())
}

impl Sender {
    /// Sends `notify` ([`Agent::notify`](crate::Agent::notify)), as a forward of `parent`
    /// when a handler sends it.
    pub(crate) async fn notify(
        &self,
        notify: Notify,
        parent: Option<Parent<'_>>,
    ) -> Result<NotifyReport, SdkError> {
        let out = &self.out;
        match &notify.to {
            NotifyTarget::Agent(agent) => {
                let agent = agent.clone();
                let receipt = self.send_from(notify.call, parent.map(|p| p.env)).await?;
                out.notification_sent();
                let outcome = if receipt.delivery == DeliveryClass::AtMostOnce {
                    Outcome::Delivered
                } else {
                    Outcome::Stored
                };
                Ok(NotifyReport {
                    id: receipt.id,
                    recipients: vec![RecipientReport {
                        agent,
                        outcome,
                        status: StatusCode::OK,
                        reason: None,
                    }],
                })
            }
            NotifyTarget::Group(target) => {
                let subject = self.link.subjects.broadcast(target)?;
                let wait = notify.report_timeout.unwrap_or(out.request_timeout);
                let env = out.group_notification(&notify, wait, parent.map(|p| p.env))?;
                let current = opentelemetry::Context::current();
                let otel = parent.map_or(&current, |p| p.otel);
                let reply = out.exchange(&subject, env, wait, otel).await?;
                let report: BroadcastReport = reply.payload_as()?;
                Ok(report.into())
            }
        }
    }
}

impl crate::handler::context::Notifier for Sender {
    fn notify<'a>(
        &'a self,
        notify: Notify,
        parent: Parent<'a>,
    ) -> futures::future::BoxFuture<'a, Result<NotifyReport, SdkError>> {
        Box::pin(Sender::notify(self, notify, Some(parent)))
    }
}
