//! The one inbound pipeline. Every message an agent takes, core or durable, request, command
//! or event, goes through the same steps in the same order:
//!
//! decode → admit (size, version, kind, expiry, hops) → layers (verify, token, authorize and
//! rate-limit) → the payload opened (fetched when it came by reference, decrypted,
//! decompressed) → exactly-once → handle → [`Outcome`].
//!
//! The caller turns the outcome into a reply (`inbound::reply`) or an ack, nak or dead letter
//! (`durable::inbox`), each in one place.

use crate::Report;
use std::sync::Arc;

use chorus_broker_adapter::Subject;
use opentelemetry::trace::SpanKind;

use super::admit::{self, Limits, Refused};
use super::exactly_once::{Before, ExactlyOnce};
use super::layers::{
    Authorize, Batches, Decompress, Decrypt, Inbound, Layer, RequireToken, TokenCheck, Verify,
};
use super::outcome::{Failure, Outcome, Retry};
use crate::error::HandlerError;
use crate::handler::endpoint::{Endpoint, Endpoints};
use crate::handler::{Context, EventHandler, Output};
use crate::metrics::sdk_metrics;
use crate::outbound::Outbound;
use crate::protocol::codec::{Encoding, decode_payload};
use crate::protocol::envelope::{DeliveryClass, Envelope, Kind, now_ms};
use crate::protocol::registry::{COORDINATOR_ID, WIRE_NOTIFICATION, WireLevel};
use crate::protocol::status::StatusCode;
use crate::security::Verifier;
use crate::security::access::Access;
use crate::security::encryption::EncryptionKey;
use crate::stats::AgentCounters;
use crate::usage::{Usage, UsageKind};

/// What handles a message, resolved from the subject it came on.
#[derive(Clone)]
pub(crate) enum Target {
    /// A command or capability endpoint.
    Endpoint(Arc<Endpoint>),
    /// An event handler.
    Event(Arc<dyn EventHandler>),
    /// A command nobody here handles (its subject).
    Unknown(String),
    /// A notification (on `<root>.agent.<id>.$notify` or its durable lane): its handler is
    /// chosen by the envelope's `name`; none is not an error (counted, dropped).
    Notification,
}

/// A message that went through the pipeline.
pub(crate) struct Processed {
    /// The request as handled (decrypted), when it decoded.
    pub(crate) request: Option<Arc<Envelope>>,
    /// The encoding to answer in.
    pub(crate) encoding: Encoding,
    pub(crate) outcome: Outcome,
}

/// The parts of an agent the pipeline needs.
pub(crate) struct PipelineParts {
    pub(crate) out: Arc<Outbound>,
    pub(crate) endpoints: Arc<Endpoints>,
    pub(crate) verifier: Option<Arc<Verifier>>,
    pub(crate) decryption: Option<Arc<EncryptionKey>>,
    /// The check of a message's token, when the agent requires one.
    pub(crate) token: Option<TokenCheck>,
    pub(crate) access: Arc<Access>,
    pub(crate) exactly_once: ExactlyOnce,
    /// Seen ids kept where a restart finds them ([`crate::AgentOptions::persist_seen_ids`]).
    pub(crate) seen: Option<super::seen::SeenIds>,
    /// What the agent handled, per endpoint, customer and session.
    pub(crate) usage: Arc<Usage>,
    /// The agent's tasks and its stop, for the signature checks' collector.
    pub(crate) tracker: tokio_util::task::TaskTracker,
    pub(crate) stop: tokio_util::sync::CancellationToken,
    /// How handlers' notifications go out ([`Context::notify`]).
    pub(crate) notifier: Arc<dyn crate::handler::context::Notifier>,
}

/// The inbound pipeline of one agent.
pub(crate) struct Pipeline {
    /// The agent's identity, subjects, connection and counters.
    pub(crate) link: Arc<crate::link::Link>,
    pub(crate) out: Arc<Outbound>,
    pub(crate) endpoints: Arc<Endpoints>,
    layers: Vec<Box<dyn Layer>>,
    /// The layers that open the payload (decrypt, decompress), after it is fetched when it
    /// came by reference.
    opening: Vec<Box<dyn Layer>>,
    /// Whether the signature check runs (the event stream batches it when it does).
    verifies: bool,
    /// Signature checks in batches for the handler routes, when the agent verifies.
    batches: Option<Batches>,
    exactly_once: ExactlyOnce,
    seen: Option<super::seen::SeenIds>,
    pub(crate) usage: Arc<Usage>,
    notifier: Arc<dyn crate::handler::context::Notifier>,
}

impl Pipeline {
    pub(crate) fn new(parts: PipelineParts) -> Self {
        let PipelineParts {
            out,
            endpoints,
            verifier,
            decryption,
            token,
            access,
            exactly_once,
            seen,
            usage,
            tracker,
            stop,
            notifier,
        } = parts;
        let counters = Arc::clone(&out.link.counters);
        let mut layers: Vec<Box<dyn Layer>> = Vec::new();
        let verifies = verifier.is_some();
        let batches = verifier.as_ref().map(|verifier| {
            Batches::start(Arc::clone(verifier), Arc::clone(&counters), &tracker, stop)
        });
        if let Some(verifier) = verifier {
            // The signature covers the payload as sent (ciphertext, a reference): check it,
            // then open the payload.
            layers.push(Box::new(Verify {
                agent: out.link.id.clone(),
                verifier,
                counters: Arc::clone(&counters),
            }));
        }
        if let Some(check) = token {
            layers.push(Box::new(RequireToken { check }));
        }
        layers.push(Box::new(Authorize {
            access,
            counters: Arc::clone(&counters),
        }));
        let opening: Vec<Box<dyn Layer>> = vec![
            Box::new(Decrypt {
                agent: out.link.id.clone(),
                key: decryption,
            }),
            Box::new(Decompress {
                limit: out.payload_limits.max_bytes,
                counters,
            }),
        ];
        Pipeline {
            link: Arc::clone(&out.link),
            out,
            endpoints,
            layers,
            opening,
            verifies,
            batches,
            exactly_once,
            seen,
            usage,
            notifier,
        }
    }

    /// What admission checks against.
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            max_message_bytes: self.out.max_message_bytes,
            hop_limit: self.out.hop_limit,
            encoding: self.out.wire.encoding(),
        }
    }

    pub(crate) fn counters(&self) -> &AgentCounters {
        &self.link.counters
    }

    pub(crate) fn verifies(&self) -> bool {
        self.verifies
    }

    /// Decodes `payload` within the size limit (the first step; the durable inbox does it
    /// early to choose a delivery's lane).
    /// A compact envelope gets back what its `subject` carries.
    pub(crate) fn decode(
        &self,
        subject: &str,
        payload: &bytes::Bytes,
    ) -> Result<(Envelope, Encoding), Refused> {
        let mut decoded = admit::decode(payload, self.limits(), self.counters());
        if let Ok((env, Encoding::Compact)) = &mut decoded {
            self.link.subjects.implied(subject).restore(env);
        }
        decoded
    }

    /// Decodes and admits `payload` (an event stream's first steps).
    pub(crate) fn admit(
        &self,
        subject: &str,
        payload: &bytes::Bytes,
    ) -> Result<(Envelope, Encoding), Refused> {
        let (env, encoding) = self.decode(subject, payload)?;
        let now = clock_if_expiring(&env);
        admit::admit_decoded(env, encoding, self.limits().hop_limit, self.counters(), now)
    }

    /// Whether `env` carries its payload by reference: it is fetched ([`Self::open_fetched`])
    /// before it is opened.
    pub(crate) fn by_reference(env: &Envelope) -> bool {
        env.content_type == crate::payload::CONTENT_TYPE_OBJECT
    }

    /// Runs the layers over one admitted message that has no endpoint (an event); `None` if
    /// one refused it. A payload by reference is left unopened, with the subject it came on:
    /// the caller fetches and opens it with [`Self::open_fetched`].
    pub(crate) fn check(&self, subject: &str, env: Envelope) -> Option<Checked> {
        let mut msg = Inbound::new(subject, env, None);
        for layer in &self.layers {
            layer.check(&mut msg).ok()?;
        }
        self.open_inline(msg)
    }

    /// Opens a message that passed the layers, unless its payload is still to be fetched.
    fn open_inline(&self, mut msg: Inbound<'_>) -> Option<Checked> {
        if Self::by_reference(&msg.env) {
            return Some((msg.env, Some(msg.subject.to_owned())));
        }
        for layer in &self.opening {
            layer.check(&mut msg).ok()?;
        }
        Some((msg.env, None))
    }

    /// Runs the layers over several admitted messages at once; keeps those that pass, in
    /// order. Payloads by reference are left unopened, as by [`Self::check`].
    pub(crate) fn check_batch(&self, msgs: Vec<(&str, Envelope)>) -> Vec<Checked> {
        let mut live: Vec<Inbound<'_>> = msgs
            .into_iter()
            .map(|(subject, env)| Inbound::new(subject, env, None))
            .collect();
        for layer in &self.layers {
            let results = layer.check_batch(&mut live);
            live = live
                .into_iter()
                .zip(results)
                .filter_map(|(msg, result)| result.ok().map(|()| msg))
                .collect();
        }
        live.into_iter()
            .filter_map(|msg| self.open_inline(msg))
            .collect()
    }

    /// Fetches the payload an event that passed [`Self::check`] carries by reference (its
    /// size and digest checked), then opens it (decrypted, decompressed); `None` if that
    /// fails (counted, and logged at debug level).
    pub(crate) async fn open_fetched(&self, subject: &str, mut env: Envelope) -> Option<Envelope> {
        if let Err(failure) = Box::pin(self.fetch_payload(&mut env)).await {
            AgentCounters::bump(&self.counters().bad_input);
            tracing::debug!(agent = %self.link.id, topic = ?env.topic, status = %failure.status, reason = %failure.reason, "event skipped: its payload was not fetched");
            return None;
        }
        let mut msg = Inbound::new(subject, env, None);
        for layer in &self.opening {
            layer.check(&mut msg).ok()?;
        }
        Some(msg.env)
    }

    /// Takes one decoded message through every step after decoding, and handles it with
    /// `target`; `via` says how it came.
    pub(crate) async fn run(
        &self,
        subject: &Subject,
        decoded: Result<(Envelope, Encoding), Refused>,
        target: Target,
        via: Via,
    ) -> Processed {
        AgentCounters::bump(&self.counters().received);
        // Usage counts what came for an endpoint or an event handler.
        let counted = match &target {
            Target::Endpoint(e) => Some((Some(e.name.clone()), e.is_task())),
            Target::Event(_) => Some((None, false)),
            Target::Unknown(_) | Target::Notification => None,
        };
        // Timed only when usage is counted: two clock reads per message otherwise saved.
        let started = (counted.is_some() && self.usage.enabled()).then(std::time::Instant::now);
        let processed = self.steps(subject, decoded, target, via).await;
        let kind = processed.request.as_ref().map_or(Kind::Unknown, |r| r.kind);
        if !matches!(processed.outcome, Outcome::Repeated(_)) {
            self.record_handled(kind, processed.outcome.status());
            if let (Some((name, task)), Some(request)) = (counted, &processed.request) {
                let took = started.map(|s| s.elapsed()).unwrap_or_default();
                self.record_usage(request, name, task, &processed.outcome, took);
            }
        }
        processed
    }

    async fn steps(
        &self,
        subject: &Subject,
        decoded: Result<(Envelope, Encoding), Refused>,
        target: Target,
        mut via: Via,
    ) -> Processed {
        let refused = |refused: Refused| Processed {
            request: refused.request.map(|r| Arc::new(*r)),
            encoding: refused.encoding,
            outcome: Outcome::Failed(refused.failure),
        };
        let (env, encoding) = match decoded {
            Ok(decoded) => decoded,
            Err(refusal) => return refused(refusal),
        };
        let now = clock_if_expiring(&env);
        let (env, encoding) = match admit::admit_decoded(
            env,
            encoding,
            self.out.hop_limit,
            self.counters(),
            now,
        ) {
            Ok(admitted) => admitted,
            Err(refusal) => {
                tracing::debug!(agent = %self.link.id, status = %refusal.failure.status, reason = %refusal.failure.reason, "message refused");
                return refused(refusal);
            }
        };
        let endpoint = match &target {
            Target::Endpoint(endpoint) => Some(endpoint.as_ref()),
            _ => None,
        };
        // A signed message is checked with whatever else is waiting (the layer takes the
        // verdict); an unsigned one has nothing to batch.
        let (env, preverified) = match &self.batches {
            Some(batches) if env.signature.is_some() && via.replay.is_none() => {
                batches.verify(subject, env, via.stored).await
            }
            _ => (env, None),
        };
        let mut msg = Inbound::new(subject, env, endpoint);
        msg.preverified = preverified;
        msg.stored = via.stored;
        msg.replay = via.replay.take();
        for layer in &self.layers {
            if let Err(failure) = layer.check(&mut msg) {
                return Processed {
                    request: Some(Arc::new(msg.env)),
                    encoding,
                    outcome: Outcome::Failed(failure),
                };
            }
        }
        if msg.env.content_type == crate::payload::CONTENT_TYPE_OBJECT
            && let Err(failure) = Box::pin(self.fetch_payload(&mut msg.env)).await
        {
            return Processed {
                request: Some(Arc::new(msg.env)),
                encoding,
                outcome: Outcome::Failed(failure),
            };
        }
        for layer in &self.opening {
            if let Err(failure) = layer.check(&mut msg) {
                return Processed {
                    request: Some(Arc::new(msg.env)),
                    encoding,
                    outcome: Outcome::Failed(failure),
                };
            }
        }
        // A verified command or request is remembered across restarts, where asked. (Boxed,
        // as the exactly-once calls below: a key-value call is a large future.)
        if msg.verified
            && msg.endpoint.is_some()
            && let Some(seen) = &self.seen
            && let Err(failure) = Box::pin(seen.record(&msg.env, msg.seen_id, msg.stored)).await
        {
            return Processed {
                request: Some(Arc::new(msg.env)),
                encoding,
                outcome: Outcome::Failed(failure),
            };
        }
        let request = Arc::new(msg.env);
        let exactly_once =
            request.delivery == DeliveryClass::ExactlyOnce && matches!(target, Target::Endpoint(_));
        // Boxed: the key-value calls are large futures that every other message would carry.
        let claim = if exactly_once {
            match Box::pin(self.exactly_once.before(&request)).await {
                Before::Run(claim) => Some(claim),
                Before::Settled(outcome) => {
                    return Processed {
                        request: Some(request),
                        encoding,
                        outcome,
                    };
                }
            }
        } else {
            None
        };
        let outcome = self.handle(&request, subject, target, via).await;
        if let Some(claim) = claim {
            Box::pin(self.exactly_once.after(&request, claim, &outcome)).await;
        }
        Processed {
            request: Some(request),
            encoding,
            outcome,
        }
    }

    /// Fetches a payload that came by reference, its size and digest checked.
    async fn fetch_payload(&self, env: &mut Envelope) -> Result<(), Failure> {
        crate::payload::fetch(&self.link.js, env, self.out.payload_limits.max_bytes)
            .await
            .map_err(|(status, reason)| {
                tracing::debug!(agent = %self.link.id, %status, %reason, "payload by reference refused");
                Failure {
                    status,
                    reason,
                    // The object store out of reach may come back: a durable delivery waits
                    // for it; a missing or damaged object never will.
                    retry: if status == StatusCode::UNAVAILABLE {
                        Retry::After(FETCH_RETRY_DELAY)
                    } else {
                        Retry::Never
                    },
                }
            })?;
        AgentCounters::bump(&self.counters().payloads_fetched);
        Ok(())
    }

    /// The last step: the handler runs under a span, and its result becomes the outcome.
    async fn handle(
        &self,
        request: &Arc<Envelope>,
        subject: &Subject,
        target: Target,
        via: Via,
    ) -> Outcome {
        let counters = self.counters();
        let (name, result) = match target {
            Target::Unknown(subject) => {
                AgentCounters::bump(&counters.unknown_command);
                return Outcome::Failed(unknown_command(&self.link.id, &subject));
            }
            Target::Notification => {
                AgentCounters::bump(&counters.notifications_received);
                let name = request.name.as_deref().unwrap_or_default();
                if name == WIRE_NOTIFICATION && request.from.as_str() == COORDINATOR_ID {
                    // The coordinator's word on the bus's level and heartbeat floor, for this
                    // agent alone (section 3.5): taken here, never a handler's. Where the
                    // agent knows the coordinator's key, an unsigned one is not its word (a
                    // signed one passed the signature check already).
                    let keyed = self
                        .out
                        .verifier
                        .as_ref()
                        .is_some_and(|v| v.key_of(COORDINATOR_ID).is_some());
                    if keyed && request.signature.is_none() {
                        AgentCounters::bump(&counters.security_refused);
                        tracing::warn!(agent = %self.link.id, "an unsigned wire notification from the coordinator ignored");
                        return Outcome::Done(Output::default());
                    }
                    match decode_payload::<WireLevel>(&request.payload, &request.content_type) {
                        Ok(level) => self.out.take_wire(&level),
                        Err(err) => {
                            tracing::debug!(agent = %self.link.id, error = %Report(&err), "the coordinator's wire notification did not decode");
                        }
                    }
                    return Outcome::Done(Output::default());
                }
                let Some(handler) = self.endpoints.notification(name) else {
                    // Nobody here takes it: counted, never answered. A core one is dropped; a
                    // durable one waits while the retry policy's attempts last (a handler
                    // registered a moment later, or another instance, may take it), then is
                    // dead-lettered as a durable command without a handler is.
                    AgentCounters::bump(&counters.notifications_unhandled);
                    tracing::debug!(agent = %self.link.id, notification = name, from = %request.from, "notification without a handler");
                    if self
                        .link
                        .subjects
                        .durable_command(subject.as_str())
                        .is_some()
                    {
                        return Outcome::Failed(Failure {
                            status: StatusCode::UNKNOWN_COMMAND,
                            reason: format!(
                                "agent {} has no handler for notification {name:?}",
                                self.link.id
                            ),
                            retry: Retry::Attempts,
                        });
                    }
                    return Outcome::Done(Output::default());
                };
                let ctx = self.context(request, subject, via, name);
                let otel = ctx.otel.clone();
                let result = guarded(&self.link.id, name, || handler.call(ctx))
                    .await
                    .map(|()| Output::default());
                crate::trace::finish(Some(&otel), result.as_ref().err().map(|e| e.to_string()));
                (name, result)
            }
            Target::Event(handler) => {
                let topic = request.topic.as_deref().unwrap_or_default();
                let ctx = self.context(request, subject, via, topic);
                let otel = ctx.otel.clone();
                let result = guarded(&self.link.id, topic, || handler.call(ctx))
                    .await
                    .map(|()| Output::default());
                crate::trace::finish(Some(&otel), result.as_ref().err().map(|e| e.to_string()));
                (topic, result)
            }
            Target::Endpoint(endpoint) => {
                let ctx = self.context(request, subject, via, &endpoint.name);
                let otel = ctx.otel.clone();
                let started = std::time::Instant::now();
                let span = tracing::info_span!(
                    "chorus.handle",
                    agent = %self.link.id,
                    command = %endpoint.name,
                    message_id = %request.id,
                    correlation_id = %request.conversation(),
                );
                let result = guarded(&self.link.id, &endpoint.name, || {
                    tracing::Instrument::instrument(endpoint.handler.call(ctx), span)
                })
                .await;
                crate::trace::finish(Some(&otel), result.as_ref().err().map(|e| e.to_string()));
                let took = started.elapsed();
                let task = endpoint.is_task();
                endpoint.record(took, result.as_ref().err().map(|e| e.reason.as_str()), task);
                if !task {
                    self.endpoints.handling.record(took);
                }
                return self.outcome(request, &endpoint.name, result);
            }
        };
        self.outcome(request, name, result)
    }

    fn outcome(
        &self,
        request: &Envelope,
        name: &str,
        result: Result<Output, HandlerError>,
    ) -> Outcome {
        match result {
            Ok(output) => {
                AgentCounters::bump(&self.counters().handled_ok);
                Outcome::Done(output)
            }
            Err(err) => {
                AgentCounters::bump(&self.counters().handler_errors);
                tracing::debug!(agent = %self.link.id, handler = name, id = %request.id, correlation = %request.conversation(), error = %Report(&err), "handler returned an error");
                Outcome::Failed(Failure::from(err))
            }
        }
    }

    /// The context a handler runs in, with its handling span started.
    fn context(&self, request: &Arc<Envelope>, subject: &Subject, via: Via, name: &str) -> Context {
        let otel = crate::trace::handle(
            via.span,
            request,
            || format!("chorus.handle {name}"),
            || crate::trace::attributes(&self.link.id, request),
        );
        Context {
            out: Arc::clone(&self.out),
            request: Arc::clone(request),
            subject: subject.clone(),
            attempt: via.attempt,
            otel,
            notifier: Arc::clone(&self.notifier),
        }
    }

    /// Counts one handled message in the agent's usage: at its endpoint (`name`) or, for an
    /// event, its topic.
    fn record_usage(
        &self,
        request: &Envelope,
        name: Option<String>,
        task: bool,
        outcome: &Outcome,
        took: std::time::Duration,
    ) {
        let kind = match request.kind {
            _ if task => UsageKind::Task,
            Kind::Request => UsageKind::Request,
            Kind::Command => UsageKind::Command,
            Kind::Event => UsageKind::Event,
            _ => return,
        };
        // An event without a topic is the bus's own traffic (heartbeats, goodbyes), not usage.
        let Some(endpoint) = name.or_else(|| request.topic.as_ref().map(ToString::to_string))
        else {
            return;
        };
        let (failed, bytes_out) = match outcome {
            Outcome::Done(output) => (false, output.payload.len()),
            _ => (true, 0),
        };
        let handled = crate::usage::Handled {
            failed,
            bytes_out,
            took,
        };
        self.usage.record(request, &endpoint, kind, handled);
    }

    /// Counts one message's outcome in `chorus_handled_total`.
    pub(crate) fn record_handled(&self, kind: Kind, status: StatusCode) {
        sdk_metrics()
            .handled
            .with_label_values(&[self.link.id.as_str(), kind.as_str(), status.label()])
            .inc();
    }
}

/// An event that passed the layers: opened, or with the subject it came on when its payload
/// is still to be fetched ([`Pipeline::open_fetched`]).
pub(crate) type Checked = (Envelope, Option<String>);

/// How long a durable delivery whose payload could not be fetched waits before it is tried
/// again.
const FETCH_RETRY_DELAY: std::time::Duration = std::time::Duration::from_secs(2);

/// How a message came to the pipeline.
#[derive(Debug, Clone)]
pub(crate) struct Via {
    /// The kind of the handling span: server for a request, consumer for an event or a durable
    /// delivery.
    pub(crate) span: SpanKind,
    /// Which delivery of the message this is: 1 for a core message; the server's count for a
    /// durable one.
    pub(crate) attempt: u32,
    /// The stream sequence of the stored copy it was delivered from (a durable delivery): a
    /// redelivery of the same copy is not a replay.
    pub(crate) stored: Option<u64>,
    /// A replayer's signed word that this is its replay of a dead letter, read from the
    /// message's headers (or why it could not be read).
    pub(crate) replay: Option<Result<crate::security::replay::ReplayProof, String>>,
}

impl Via {
    /// A core message (delivered once).
    pub(crate) fn core(span: SpanKind) -> Via {
        Via {
            span,
            attempt: 1,
            stored: None,
            replay: None,
        }
    }
}

/// The refusal of a command nobody here handles: retried while the retry policy's attempts
/// last, since another instance of the agent may know it.
pub(crate) fn unknown_command(agent: &str, subject: &str) -> Failure {
    Failure {
        status: StatusCode::UNKNOWN_COMMAND,
        reason: format!("agent {agent} has no handler for {subject}"),
        retry: Retry::Attempts,
    }
}

/// Runs a handler (`start` makes its future: a typed handler's own code runs there first);
/// a panic in either becomes a 5022 failure (retried or dead-lettered like any other) instead
/// of taking down the task that runs it, a durable lane with it.
async fn guarded<T, F>(
    agent: &str,
    handler: &str,
    start: impl FnOnce() -> F,
) -> Result<T, HandlerError>
where
    F: std::future::Future<Output = Result<T, HandlerError>>,
{
    use futures::FutureExt;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let result = match catch_unwind(AssertUnwindSafe(start)) {
        Ok(call) => AssertUnwindSafe(call).catch_unwind().await,
        Err(panic) => Err(panic),
    };
    result.unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        tracing::error!(agent, handler, panic = %what, "handler panicked");
        Err(HandlerError::new(
            StatusCode::INTERNAL,
            format!("the handler panicked: {what}"),
        ))
    })
}

/// The time to judge `env`'s expiry by: the clock only for a message that can expire (most
/// carry no TTL or deadline, and a clock read per message shows in the profile).
fn clock_if_expiring(env: &Envelope) -> u64 {
    if env.expires_at_ms().is_some() {
        now_ms()
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_command_is_5016_retried_while_attempts_last() {
        let failure = unknown_command("ledger", "chorus.agent.ledger.nope");
        assert_eq!(failure.status, StatusCode::UNKNOWN_COMMAND);
        assert_eq!(failure.retry, Retry::Attempts);
        assert_eq!(
            failure.reason,
            "agent ledger has no handler for chorus.agent.ledger.nope"
        );
    }
}
