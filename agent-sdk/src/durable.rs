//! Durable delivery: commands stored in JetStream until their agent takes them, retried by the
//! retry policy, and dead-lettered when they cannot be handled.
//!
//! - The inbox stream (`CHORUS_INBOX`, subjects `<root>.inbox.<agent>.<command>`) keeps each
//!   command until the recipient acks it (work-queue retention), up to its limits.
//! - Each agent with a durable inbox has a durable pull consumer named after it, filtered to its
//!   own subjects, with `MaxDeliver` set to the largest attempt count of the retry policies.
//! - A failed attempt is NAK'd with the policy's delay for that delivery count; the last
//!   attempt, or a failure the policy does not retry, is written to the dead-letter stream
//!   (`CHORUS_DLQ`) with its reason and then terminated. Deliveries that never get an answer
//!   (a crashed handler) reach `MaxDeliver`; the coordinator dead-letters those from the
//!   server's advisories, captured in `CHORUS_ADVISORIES`.
//! - Dead letters are published with the message id `dlq:<stream>:<sequence>`, so however many
//!   times a failure is reported (a retried write, two coordinators), it is stored once.

use std::sync::Arc;
use std::time::Duration;

use broker_adapter::{
    BatchMessage, ConsumerSpec, Delivery, ErrorKind, JetStream, Kv, KvSpec, PubAck, StreamSpec,
};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::agent::{Agent, Inner};
use crate::call::{Call, Target};
use crate::codec::{self, CodecError, Encoding};
use crate::envelope::{DeliveryClass, Envelope, Kind, Priority, bytes_field, now_ms};
use crate::error::{HandlerError, SdkError};
use crate::handler::Output;
use crate::stats::AgentCounters;
use crate::status::StatusCode;
use crate::subject::Subjects;

/// Suffix of the inbox stream's name.
pub const INBOX_STREAM: &str = "INBOX";
/// Suffix of the dead-letter stream's name.
pub const DLQ_STREAM: &str = "DLQ";
/// Suffix of the stream that keeps the server's max-deliveries and terminated advisories.
pub const ADVISORY_STREAM: &str = "ADVISORIES";
/// Suffix of the exactly-once idempotency bucket.
pub const IDEMPOTENCY_BUCKET: &str = "idempotency";
/// Acks outstanding at once in [`Agent::send_batch`].
pub const BATCH_ACKS_IN_FLIGHT: usize = 256;
/// Suffix of the configuration bucket (retry policies live under [`RETRY_KEY`]).
pub const CONFIG_BUCKET: &str = "config";
/// Key of the retry policies in the configuration bucket.
pub const RETRY_KEY: &str = "retry";
/// How long a repeated dead letter (same source message) is recognised and dropped.
pub const DLQ_DEDUPE_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// Limits of the inbox stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InboxLimits {
    /// Oldest command kept, in seconds (default 7 days).
    pub max_age_secs: u64,
    /// Most bytes kept across all inboxes (default 1 GiB).
    pub max_bytes: i64,
    /// Most commands kept per agent and command name (-1: no limit, the default).
    pub max_msgs_per_subject: i64,
    /// Stream replicas (1 on one server, 3 on a cluster).
    pub replicas: usize,
    /// Window in which a repeated message id is dropped, in seconds (default 120).
    pub duplicate_window_secs: u64,
}

impl Default for InboxLimits {
    fn default() -> Self {
        InboxLimits {
            max_age_secs: 7 * 24 * 3600,
            max_bytes: 1 << 30,
            max_msgs_per_subject: -1,
            replicas: 1,
            duplicate_window_secs: 120,
        }
    }
}

/// The inbox stream for `subjects`' root.
pub fn inbox_stream(subjects: &Subjects, limits: &InboxLimits) -> StreamSpec {
    let mut spec = StreamSpec::new(
        subjects.stream_name(INBOX_STREAM),
        vec![subjects.durable_all()],
    );
    spec.max_age = Duration::from_secs(limits.max_age_secs);
    spec.max_bytes = limits.max_bytes;
    spec.max_msgs_per_subject = limits.max_msgs_per_subject;
    spec.replicas = limits.replicas;
    spec.duplicate_window = Duration::from_secs(limits.duplicate_window_secs.max(1));
    spec.work_queue = true;
    spec.description = "Chorus durable inboxes: commands waiting for their agent".into();
    spec
}

/// The dead-letter stream.
pub fn dlq_stream(subjects: &Subjects, replicas: usize) -> StreamSpec {
    let mut spec = StreamSpec::new(
        subjects.stream_name(DLQ_STREAM),
        vec![format!("{}.dlq.>", subjects.root())],
    );
    spec.max_age = Duration::from_secs(30 * 24 * 3600);
    spec.duplicate_window = DLQ_DEDUPE_WINDOW;
    spec.replicas = replicas;
    spec.description = "Chorus dead letters".into();
    spec
}

/// The stream capturing the server's advisories about the inbox stream, so none is lost
/// while no coordinator runs.
pub fn advisory_stream(subjects: &Subjects, replicas: usize) -> StreamSpec {
    let inbox = subjects.stream_name(INBOX_STREAM);
    let mut spec = StreamSpec::new(
        subjects.stream_name(ADVISORY_STREAM),
        vec![
            format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{inbox}.*"),
            format!("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{inbox}.*"),
        ],
    );
    spec.max_age = Duration::from_secs(7 * 24 * 3600);
    spec.replicas = replicas;
    spec.description =
        "JetStream advisories about Chorus inboxes, for the dead-letter queue".into();
    spec
}

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterReason {
    /// Every attempt the retry policy allows failed.
    MaxAttempts,
    /// Delivered `MaxDeliver` times without an answer (crashes, ack timeouts).
    MaxDeliveries,
    /// The agent refused it as poison: undecodable, unknown command, a non-retryable failure.
    Refused,
    /// Its TTL or deadline passed before it was handled.
    Expired,
    /// A broadcast copy no agent could take.
    Undeliverable,
}

impl DeadLetterReason {
    /// The wire and subject form.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::MaxAttempts => "max_attempts",
            DeadLetterReason::MaxDeliveries => "max_deliveries",
            DeadLetterReason::Refused => "refused",
            DeadLetterReason::Expired => "expired",
            DeadLetterReason::Undeliverable => "undeliverable",
        }
    }
}

/// A dead letter: the original message, untouched, and what happened to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// Why it is here.
    pub reason: DeadLetterReason,
    /// The status code of the last failure.
    pub status: StatusCode,
    /// The last failure's explanation.
    pub detail: String,
    /// The agent it was for.
    pub agent: String,
    /// The subject it was published to; replay publishes there again.
    pub subject: String,
    /// The original envelope bytes, exactly as published (an encrypted payload stays
    /// encrypted).
    #[serde(with = "bytes_field")]
    pub envelope: Bytes,
    /// The original message id, when the envelope decoded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<Uuid>,
    /// Deliveries made.
    pub attempts: u64,
    /// When the original was stored, ms since the epoch.
    pub stored_ms: u64,
    /// When it was dead-lettered, ms since the epoch.
    pub dead_lettered_ms: u64,
    /// The stream and sequence it came from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<(String, u64)>,
}

impl DeadLetter {
    /// The message id that makes repeated reports of the same failure one entry.
    pub fn dedupe_id(&self) -> String {
        match &self.source {
            Some((stream, seq)) => format!("dlq:{stream}:{seq}"),
            None => format!(
                "dlq:{}:{}",
                self.message_id.map(|u| u.to_string()).unwrap_or_default(),
                self.agent
            ),
        }
    }
}

/// Writes `letter` to the dead-letter stream (once, whatever the number of calls).
pub async fn write_dead_letter(
    js: &JetStream,
    subjects: &Subjects,
    letter: &DeadLetter,
) -> Result<PubAck, broker_adapter::Error> {
    let agent = if crate::subject::validate_token("agent id", &letter.agent).is_ok() {
        letter.agent.as_str()
    } else {
        "unknown"
    };
    let subject = subjects
        .dead_letter(&format!("{}.{agent}", letter.reason.as_str()))
        .map_err(|e| {
            broker_adapter::Error::new(broker_adapter::ErrorKind::InvalidSubject, e.to_string())
        })?;
    let body = serde_json::to_vec(letter).map_err(|e| {
        broker_adapter::Error::new(broker_adapter::ErrorKind::InvalidInput, e.to_string())
    })?;
    js.publish(
        &subject,
        None,
        Some(&letter.dedupe_id()),
        None,
        Bytes::from(body),
    )
    .await
}

/// A number in `0..1` for jitter: the random bits of a fresh UUIDv7.
pub(crate) fn random_fraction() -> f64 {
    let bits = Uuid::now_v7().as_u128() as u64 & 0xFFFF_FFFF;
    bits as f64 / f64::from(u32::MAX)
}

/// What the agent does with one delivery after handling it.
enum Verdict {
    Ack,
    /// An exactly-once message already handled: ack without running the handler again.
    AlreadyDone,
    Retry(Duration),
    DeadLetter(DeadLetterReason, HandlerError),
}

impl Inner {
    /// Handles one durable delivery: decode, check, run the handler (extending the ack
    /// deadline while it runs), then ack, retry or dead-letter.
    pub(crate) async fn process_durable(
        self: Arc<Self>,
        delivery: Delivery,
        decoded: Result<(Envelope, Encoding), CodecError>,
    ) {
        AgentCounters::bump(&self.counters.received);
        let delivered = delivery.delivered();
        if delivered > 1 {
            AgentCounters::bump(&self.counters.redelivered);
        }
        let (verdict, envelope) = match decoded {
            Err(err) => {
                AgentCounters::bump(&self.counters.bad_input);
                let e = HandlerError::new(StatusCode::DATA_FORMAT, err.to_string());
                (Verdict::DeadLetter(DeadLetterReason::Refused, e), None)
            }
            Ok((env, _)) => {
                let env = Arc::new(env);
                let verdict = self.durable_verdict(&delivery, &env).await;
                (verdict, Some(env))
            }
        };
        let kind = envelope.as_ref().map_or(Kind::Unknown, |e| e.kind);
        let outcome = match verdict {
            Verdict::Ack => {
                self.record_handled(kind, StatusCode::OK);
                if self.fault_skip_ack() {
                    tracing::debug!(agent = %self.id, seq = delivery.stream_seq(), "fault injection: ack withheld");
                    Ok(())
                } else {
                    delivery.ack().await
                }
            }
            Verdict::AlreadyDone => {
                AgentCounters::bump(&self.counters.duplicates_suppressed);
                delivery.ack().await
            }
            Verdict::Retry(delay) => {
                AgentCounters::bump(&self.counters.retries);
                AgentCounters::bump(&self.counters.handler_errors);
                delivery.nak(Some(delay)).await
            }
            Verdict::DeadLetter(reason, err) => {
                self.record_handled(kind, err.status);
                let letter = DeadLetter {
                    reason,
                    status: err.status,
                    detail: err.reason.clone(),
                    agent: self.id.clone(),
                    subject: delivery.subject().to_owned(),
                    envelope: delivery.payload().clone(),
                    message_id: envelope.as_ref().map(|e| e.id),
                    attempts: delivered,
                    stored_ms: delivery.published_ms(),
                    dead_lettered_ms: now_ms(),
                    source: Some((
                        self.subjects.stream_name(INBOX_STREAM),
                        delivery.stream_seq(),
                    )),
                };
                match write_dead_letter(&self.js, &self.subjects, &letter).await {
                    Ok(_) => {
                        AgentCounters::bump(&self.counters.dead_lettered);
                        tracing::warn!(agent = %self.id, seq = delivery.stream_seq(), reason = reason.as_str(), status = %err.status, detail = %err.reason, "durable message dead-lettered");
                        let note = format!("{} {}: {}", err.status.0, reason.as_str(), err.reason);
                        delivery.term(&note).await
                    }
                    // Not stored in the DLQ: keep the message and try again later.
                    Err(write_err) => {
                        tracing::error!(agent = %self.id, error = %write_err, "dead letter not written; will retry");
                        delivery.nak(Some(Duration::from_secs(5))).await
                    }
                }
            }
        };
        if let Err(err) = outcome {
            tracing::warn!(agent = %self.id, seq = delivery.stream_seq(), error = %err, "ack not sent; the server will redeliver");
        }
    }

    async fn durable_verdict(
        self: &Arc<Self>,
        delivery: &Delivery,
        env: &Arc<Envelope>,
    ) -> Verdict {
        let refuse = |status, reason: String| {
            Verdict::DeadLetter(DeadLetterReason::Refused, HandlerError::new(status, reason))
        };
        if env.kind == Kind::Unknown {
            AgentCounters::bump(&self.counters.bad_input);
            return refuse(StatusCode::DATA_FORMAT, "unsupported message kind".into());
        }
        if let Err((status, reason)) = self.verify(delivery.subject(), env) {
            return refuse(status, reason);
        }
        if env.is_expired() {
            AgentCounters::bump(&self.counters.expired);
            return Verdict::DeadLetter(
                DeadLetterReason::Expired,
                HandlerError::new(
                    StatusCode::EXPIRED,
                    "the TTL passed before the agent took it",
                ),
            );
        }
        let limit = env.hop_limit.min(self.hop_limit);
        if env.hops > limit {
            AgentCounters::bump(&self.counters.loop_refused);
            return refuse(
                StatusCode::LOOP_DETECTED,
                format!("hop {} is past the limit of {limit}", env.hops),
            );
        }
        let endpoint = self
            .subjects
            .durable_command(delivery.subject())
            .and_then(|name| crate::agent::read(&self.commands).get(name).cloned());
        let Some(endpoint) = endpoint else {
            AgentCounters::bump(&self.counters.unknown_command);
            // Not poison yet: another instance of this agent (a newer version in a rolling
            // deploy) may know the command, so it is retried like a failure until the policy's
            // attempts run out.
            let policies = crate::agent::read(&self.retry_policies);
            let policy = policies.for_message(delivery.subject(), env.kind);
            let delivered = delivery.delivered();
            if delivered < u64::from(policy.max_attempts) {
                return Verdict::Retry(policy.delay(delivered, random_fraction()));
            }
            return refuse(
                StatusCode::UNKNOWN_COMMAND,
                format!(
                    "agent {} has no handler for {}",
                    self.id,
                    delivery.subject()
                ),
            );
        };
        match self.authorize(&endpoint, env) {
            Ok(()) => {}
            Err((StatusCode::RATE_LIMITED, _)) => return Verdict::Retry(Duration::from_secs(1)),
            Err((status, reason)) => return refuse(status, reason),
        }
        let exactly_once = env.delivery == DeliveryClass::ExactlyOnce;
        if exactly_once {
            match self.seen(env).await {
                Ok(Some(_)) => return Verdict::AlreadyDone,
                Ok(None) => {}
                Err(err) => {
                    tracing::warn!(agent = %self.id, error = %err, "idempotency record unavailable; retrying later");
                    return Verdict::Retry(Duration::from_secs(1));
                }
            }
        }
        let otel = crate::trace::handle(
            opentelemetry::trace::SpanKind::Consumer,
            env,
            || format!("chorus.handle {}", endpoint.name),
            || crate::trace::attributes(&self.id, env),
        );
        // The handler shares the decoded envelope; only an encrypted one is copied, to open.
        let request = if env.encryption.is_some() {
            let mut plain = Envelope::clone(env);
            let opened = match &self.decryption {
                Some(key) => key.decrypt(&self.id, &mut plain),
                None => Err((
                    StatusCode::ACCESS,
                    "this agent has no decryption key".to_owned(),
                )),
            };
            if let Err((status, reason)) = opened {
                crate::trace::finish(Some(&otel), Some(reason.clone()));
                return refuse(status, reason);
            }
            Arc::new(plain)
        } else {
            Arc::clone(env)
        };
        let ctx = crate::context::Context {
            inner: Arc::clone(self),
            request,
            otel: otel.clone(),
        };
        let started = std::time::Instant::now();
        let handling = endpoint.handler.call(ctx);
        tokio::pin!(handling);
        // Tell the server the work goes on, well inside each ack wait.
        // (An interval's immediate first tick would cost a timer-wheel turn, about 1 ms, per
        // delivery: start it one period out instead.)
        let period = self.durable_ack_wait / 3;
        let mut progress = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        let result = loop {
            tokio::select! {
                result = &mut handling => break result,
                _ = progress.tick() => {
                    if let Err(err) = delivery.in_progress().await {
                        tracing::debug!(agent = %self.id, error = %err, "in-progress ack not sent");
                    }
                }
            }
        };
        endpoint.record(
            started.elapsed(),
            result.as_ref().err().map(|e| e.reason.as_str()),
        );
        crate::trace::finish(Some(&otel), result.as_ref().err().map(|e| e.to_string()));
        match result {
            Ok(output) => {
                AgentCounters::bump(&self.counters.handled_ok);
                if exactly_once {
                    self.remember(env, StatusCode::OK, &output).await;
                }
                Verdict::Ack
            }
            Err(err) => {
                let policies = crate::agent::read(&self.retry_policies);
                let policy = policies.for_message(delivery.subject(), env.kind);
                let delivered = delivery.delivered();
                if policy.should_retry(err.status, delivered) {
                    let delay = policy.delay(delivered, random_fraction());
                    tracing::debug!(agent = %self.id, seq = delivery.stream_seq(), delivered, ?delay, error = %err, "durable attempt failed; retrying");
                    Verdict::Retry(delay)
                } else if policy.retry_on.contains(&err.status) {
                    Verdict::DeadLetter(DeadLetterReason::MaxAttempts, err)
                } else {
                    Verdict::DeadLetter(DeadLetterReason::Refused, err)
                }
            }
        }
    }
}

/// What [`Agent::send`] got back.
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

/// What an exactly-once receiver remembers of a handled message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct IdempotencyRecord {
    pub(crate) status: StatusCode,
    pub(crate) content_type: String,
    #[serde(with = "bytes_field")]
    pub(crate) payload: Bytes,
    pub(crate) handled_ms: u64,
}

impl Inner {
    fn fault_skip_ack(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        {
            use std::sync::atomic::Ordering;
            self.skip_acks
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            false
        }
    }

    async fn idempotency_kv(&self) -> Result<&Kv, broker_adapter::Error> {
        self.idempotency
            .get_or_try_init(|| async {
                let mut spec = KvSpec::new(self.subjects.bucket_name(IDEMPOTENCY_BUCKET));
                spec.max_age = self.idempotency_ttl;
                spec.description = "Chorus exactly-once records: handled message ids".into();
                self.js.ensure_kv(&spec).await
            })
            .await
    }

    fn idempotency_key(&self, env: &Envelope) -> String {
        format!("{}.{}", self.id, env.id)
    }

    /// The record of an exactly-once message handled before, if any.
    pub(crate) async fn seen(
        &self,
        env: &Envelope,
    ) -> Result<Option<IdempotencyRecord>, broker_adapter::Error> {
        let kv = self.idempotency_kv().await?;
        Ok(kv
            .get(&self.idempotency_key(env))
            .await?
            .and_then(|entry| serde_json::from_slice(&entry.value).ok()))
    }

    /// Records that an exactly-once message was handled, with its reply.
    pub(crate) async fn remember(&self, env: &Envelope, status: StatusCode, output: &Output) {
        let record = IdempotencyRecord {
            status,
            content_type: output.content_type.clone(),
            payload: output.payload.clone(),
            handled_ms: now_ms(),
        };
        let Ok(value) = serde_json::to_vec(&record) else {
            return;
        };
        let stored = match self.idempotency_kv().await {
            Ok(kv) => {
                kv.create(&self.idempotency_key(env), Bytes::from(value))
                    .await
            }
            Err(e) => Err(e),
        };
        match stored {
            Ok(_) => {}
            // Another copy was handled at the same moment and recorded first.
            Err(e) if e.kind() == ErrorKind::Conflict => {}
            Err(e) => {
                tracing::warn!(agent = %self.id, id = %env.id, error = %e, "idempotency record not written; a redelivery would run the handler again");
            }
        }
    }

    /// Makes sure the inbox stream exists before the first durable send, so commands for an
    /// agent that has never run are kept (the coordinator normally creates it first).
    async fn ensure_inbox(&self) -> Result<(), broker_adapter::Error> {
        self.inbox_ready
            .get_or_try_init(|| async {
                self.js
                    .ensure_stream_exists(&inbox_stream(&self.subjects, &InboxLimits::default()))
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
    ) -> Result<(String, Envelope), SdkError> {
        let ttl = call.ttl;
        let high = matches!(call.priority, Priority::High | Priority::Critical);
        let durable_target = match (&call.target, class) {
            (_, DeliveryClass::AtMostOnce) => None,
            (Target::Agent(agent), _) => {
                Some((agent.clone(), call.name.clone().unwrap_or_default()))
            }
            (Target::Capability(_), _) => {
                return Err(SdkError::Subject(crate::subject::SubjectError::new(
                    "durable target",
                    "capability",
                    "durable messages go to one agent's inbox",
                )));
            }
        };
        let (core_subject, mut env, _) = self.prepare(call, None)?;
        env.expect = None;
        env.ttl_ms = ttl.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
        env.delivery = class;
        let (span, trace) = crate::trace::start(
            opentelemetry::trace::SpanKind::Producer,
            &opentelemetry::Context::current(),
            env.trace.as_ref(),
            || format!("chorus.send {}", env.name.as_deref().unwrap_or_default()),
            || crate::trace::attributes(&self.id, &env),
        );
        env.trace = Some(trace);
        crate::trace::finish(span.as_ref(), None);
        let subject = match durable_target {
            None => core_subject,
            Some((agent, command)) => self.subjects.durable(&agent, &command, high)?,
        };
        Ok((subject, env))
    }

    /// Ensures the inbox, dead-letter and advisory streams the durable inbox needs.
    pub(crate) async fn prepare_durable_inbox(&self, limits: &InboxLimits) -> Result<(), SdkError> {
        self.js
            .ensure_stream(&inbox_stream(&self.subjects, limits))
            .await?;
        self.js
            .ensure_stream(&dlq_stream(&self.subjects, limits.replicas))
            .await?;
        // Captures the server's advisories even while no coordinator runs.
        self.js
            .ensure_stream(&advisory_stream(&self.subjects, limits.replicas))
            .await?;
        Ok(())
    }

    /// Creates this agent's two consumers (normal and high priority) and starts taking
    /// deliveries. Called when the first command handler is registered, so stored commands
    /// do not arrive before anything can handle them.
    pub(crate) async fn start_durable_inbox(self: &Arc<Self>) -> Result<(), SdkError> {
        let inbox = inbox_stream(&self.subjects, &InboxLimits::default());
        for high in [false, true] {
            let durable = if high {
                format!("{}_high", self.id)
            } else {
                self.id.clone()
            };
            let mut spec = ConsumerSpec::new(durable);
            spec.filter_subjects = vec![self.subjects.durable_inbox(&self.id, high)?];
            spec.ack_wait = self.durable_ack_wait;
            spec.max_deliver = i64::from(crate::agent::read(&self.retry_policies).max_attempts());
            spec.max_ack_pending = i64::try_from(self.max_in_flight).unwrap_or(i64::MAX);
            spec.description = format!(
                "durable inbox of agent {} ({} priority)",
                self.id,
                if high { "high" } else { "normal" }
            );
            let consumer = self.js.ensure_consumer(&inbox.name, &spec).await?;
            let deliveries = consumer.messages(self.max_in_flight.min(256)).await?;
            let lanes = if high {
                (self.ordering_lanes / 4).max(1)
            } else {
                self.ordering_lanes
            };
            self.spawn_lanes(deliveries, lanes);
        }
        Ok(())
    }

    /// One dispatcher per consumer sends each delivery to a lane chosen by its sender; each
    /// lane handles its deliveries one at a time, so one sender's messages are handled in the
    /// order they were stored.
    fn spawn_lanes(self: &Arc<Self>, mut deliveries: broker_adapter::Deliveries, lanes: usize) {
        let mut senders = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let (tx, mut rx) = tokio::sync::mpsc::channel::<(
                Delivery,
                Result<(Envelope, Encoding), CodecError>,
            )>(32);
            senders.push(tx);
            let inner = Arc::clone(self);
            self.tracker.spawn(async move {
                while let Some((delivery, decoded)) = rx.recv().await {
                    Arc::clone(&inner).process_durable(delivery, decoded).await;
                }
            });
        }
        let inner = Arc::clone(self);
        self.tracker.spawn(async move {
            loop {
                let next = tokio::select! {
                    next = futures::StreamExt::next(&mut deliveries) => next,
                    _ = inner.stop.cancelled() => break,
                };
                let delivery = match next {
                    Some(Ok(d)) => d,
                    Some(Err(err)) => {
                        tracing::debug!(agent = %inner.id, error = %err, "durable inbox: pull interrupted");
                        continue;
                    }
                    None => break,
                };
                let decoded = codec::decode_limited(delivery.payload(), inner.max_message_bytes);
                let lane = match &decoded {
                    Ok((env, _)) => lane_of(&env.from, senders.len()),
                    Err(_) => 0,
                };
                if senders[lane].send((delivery, decoded)).await.is_err() {
                    break;
                }
            }
        });
    }
}

/// The `Nats-Msg-Id` a durable publish carries: the message id for exactly-once, so the
/// server stores a resent copy once; none for at-least-once, which allows a duplicate and
/// saves the server's dedupe work (about a fifth of JetStream's publish throughput, measured
/// in docs/PERFORMANCE.md).
fn dedupe_id(id: &Uuid, class: DeliveryClass) -> Option<String> {
    (class == DeliveryClass::ExactlyOnce).then(|| id.to_string())
}

fn lane_of(sender: &str, lanes: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    sender.hash(&mut h);
    (h.finish() % lanes.max(1) as u64) as usize
}

impl Agent {
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
    pub async fn send(&self, call: Call) -> Result<Receipt, SdkError> {
        let inner = &self.inner;
        let class = call.delivery.unwrap_or(inner.default_delivery);
        let (subject, mut env) = inner.prepare_send(call, class)?;
        inner.seal(&subject, &mut env);
        let bytes = codec::encode(&env, inner.encoding)?;
        AgentCounters::bump(&inner.counters.requests_sent);
        if class == DeliveryClass::AtMostOnce {
            inner.broker.publish(&subject, bytes).await?;
            return Ok(Receipt {
                id: env.id,
                delivery: class,
                stream_seq: None,
                duplicate: false,
            });
        }
        inner.ensure_inbox().await?;
        let msg_id = dedupe_id(&env.id, class);
        let mut attempt = 0;
        let ack = loop {
            attempt += 1;
            match inner
                .js
                .publish(&subject, None, msg_id.as_deref(), None, bytes.clone())
                .await
            {
                Ok(ack) => break ack,
                Err(e) if e.kind() == ErrorKind::TimedOut && attempt < 3 => {
                    tracing::debug!(agent = %inner.id, id = %env.id, "durable publish ack lost; resending");
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

    /// [`send`](Agent::send) with at least once (or exactly once, if the call asks for it).
    pub async fn send_durable(&self, call: Call) -> Result<Receipt, SdkError> {
        let class = match call.delivery {
            Some(DeliveryClass::ExactlyOnce) => DeliveryClass::ExactlyOnce,
            _ => DeliveryClass::AtLeastOnce,
        };
        self.send(call.delivery(class)).await
    }

    /// Sends many one-way commands at once. Durable ones are published with up to
    /// [`BATCH_ACKS_IN_FLIGHT`] acks outstanding and their acks awaited together; core ones
    /// are published and flushed once. Results come back in the order of `calls`; a
    /// publisher that outruns the server waits here instead of buffering without bound.
    pub async fn send_batch(&self, calls: Vec<Call>) -> Vec<Result<Receipt, SdkError>> {
        let inner = &self.inner;
        let mut results: Vec<Option<Result<Receipt, SdkError>>> = Vec::with_capacity(calls.len());
        let mut durable: Vec<(usize, Uuid, DeliveryClass)> = Vec::new();
        let mut batch = Vec::new();
        let mut core_sent = false;
        for call in calls {
            let class = call.delivery.unwrap_or(inner.default_delivery);
            let prepared = inner
                .prepare_send(call, class)
                .and_then(|(subject, mut env)| {
                    inner.seal(&subject, &mut env);
                    Ok((subject, codec::encode(&env, inner.encoding)?, env.id))
                });
            let (subject, bytes, id) = match prepared {
                Ok(p) => p,
                Err(e) => {
                    results.push(Some(Err(e)));
                    continue;
                }
            };
            AgentCounters::bump(&inner.counters.requests_sent);
            if class == DeliveryClass::AtMostOnce {
                let sent = inner.broker.publish(&subject, bytes).await;
                core_sent = true;
                results.push(Some(sent.map_err(SdkError::Broker).map(|()| Receipt {
                    id,
                    delivery: class,
                    stream_seq: None,
                    duplicate: false,
                })));
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
        if core_sent && let Err(e) = inner.broker.flush().await {
            tracing::debug!(agent = %inner.id, error = %e, "flush after batch failed");
        }
        if !batch.is_empty()
            && let Err(e) = inner.ensure_inbox().await
        {
            tracing::debug!(agent = %inner.id, error = %e, "inbox stream not ensured; publishing anyway");
        }
        let acks = inner.js.publish_batch(batch, BATCH_ACKS_IN_FLIGHT).await;
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
