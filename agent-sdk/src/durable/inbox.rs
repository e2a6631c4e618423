//! An agent's durable inbox: its two consumers (normal and high priority), the lanes that keep
//! one sender's commands in order, and the one place a durable delivery's outcome becomes an
//! ack, a nak with the retry policy's delay, or a dead letter.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use broker_adapter::{ConsumerSpec, Deliveries, Delivery};
use opentelemetry::trace::SpanKind;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{
    CONFIG_BUCKET, DeadLetter, DeadLetterNote, DeadLetterReason, INBOX_STREAM, InboxLimits,
    RETRY_KEY, advisory_stream, dlq_stream, inbox_stream, write_dead_letter,
};
use crate::error::SdkError;
use crate::inbound::admit::Refused;
use crate::inbound::{Outcome, Pipeline, Retry, Target, Via};
use crate::protocol::codec::Encoding;
use crate::protocol::envelope::{Envelope, Kind, now_ms};
use crate::protocol::status::StatusCode;
use crate::retry::RetryPolicies;
use crate::stats::AgentCounters;
use crate::sync::{read, write};

/// How long a durable delivery may go without an ack or progress report before the server
/// redelivers it. Every delivery an instance holds, running or waiting its turn, is kept alive
/// by a progress report every third of this; so this is also the longest a crashed instance's
/// deliveries wait before they go to another instance.
pub const DURABLE_ACK_WAIT: Duration = Duration::from_secs(5);
/// The shortest ack wait an agent may set.
pub const MIN_DURABLE_ACK_WAIT: Duration = Duration::from_millis(300);
/// Default number of ordering lanes of a durable inbox.
pub const DEFAULT_ORDERING_LANES: usize = 16;
/// Most deliveries a consumer pulls at once.
const MAX_PULL_BATCH: usize = 256;
/// The high-priority consumer gets a quarter of the lanes (at least one).
const HIGH_PRIORITY_LANE_SHARE: usize = 4;
/// How long a delivery whose dead letter could not be written waits before it is tried again.
const DEAD_LETTER_RETRY_DELAY: Duration = Duration::from_secs(5);

type Decoded = Result<(Envelope, Encoding), Refused>;

/// What the durable inbox needs of its agent.
pub(crate) struct DurableInbox {
    pub(crate) pipeline: Arc<Pipeline>,
    pub(crate) retry_policies: RwLock<RetryPolicies>,
    pub(crate) ack_wait: Duration,
    pub(crate) lanes: usize,
    pub(crate) max_in_flight: usize,
    pub(crate) tracker: TaskTracker,
    pub(crate) stop: CancellationToken,
    started: tokio::sync::Mutex<bool>,
    /// Deliveries taken and not yet settled, by stream sequence: the keeper reports progress
    /// on each, so one waiting its turn in a lane is not redelivered meanwhile.
    held: std::sync::Mutex<std::collections::HashMap<u64, Arc<Delivery>>>,
    /// Stream sequences delivered here lately: a server that lost its consumer's delivery
    /// counts in a crash delivers again as a first delivery, and this still tells a repeat.
    recent: std::sync::Mutex<Recent>,
    #[cfg(feature = "fault-injection")]
    pub(crate) skip_acks: std::sync::atomic::AtomicU64,
}

/// What becomes of one durable delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Settle {
    Ack,
    /// An exactly-once message already handled: acked without running the handler again.
    AckRepeated,
    Nak(Duration),
    DeadLetter(DeadLetterNote),
}

impl DurableInbox {
    pub(crate) fn new(
        pipeline: Arc<Pipeline>,
        retry_policies: RetryPolicies,
        ack_wait: Duration,
        lanes: usize,
        max_in_flight: usize,
        tracker: TaskTracker,
        stop: CancellationToken,
    ) -> Self {
        DurableInbox {
            pipeline,
            retry_policies: RwLock::new(retry_policies),
            ack_wait,
            lanes,
            max_in_flight,
            tracker,
            stop,
            started: tokio::sync::Mutex::new(false),
            held: std::sync::Mutex::new(std::collections::HashMap::new()),
            recent: std::sync::Mutex::new(Recent::default()),
            #[cfg(feature = "fault-injection")]
            skip_acks: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Ensures the inbox, dead-letter and advisory streams the durable inbox needs.
    pub(crate) async fn prepare(&self, limits: &InboxLimits) -> Result<(), SdkError> {
        let out = &self.pipeline.out;
        out.js
            .ensure_stream(&inbox_stream(&out.subjects, limits))
            .await?;
        out.js
            .ensure_stream(&dlq_stream(&out.subjects, limits.replicas))
            .await?;
        // Captures the server's advisories even while no coordinator runs.
        out.js
            .ensure_stream(&advisory_stream(&out.subjects, limits.replicas))
            .await?;
        Ok(())
    }

    /// Reads the retry policies the coordinator published; keeps the defaults if none.
    pub(crate) async fn load_retry_policies(&self) {
        let out = &self.pipeline.out;
        let bucket = out.subjects.bucket_name(CONFIG_BUCKET);
        let Ok(kv) = out.js.open_kv(&bucket).await else {
            return;
        };
        let policies = match kv.get(RETRY_KEY).await {
            Ok(Some(entry)) => serde_json::from_slice::<RetryPolicies>(&entry.value)
                .map_err(|e| e.to_string())
                .and_then(|p| p.validate().map(|()| p).map_err(|e| e.to_string())),
            Ok(None) => return,
            Err(e) => Err(e.to_string()),
        };
        match policies {
            Ok(p) => *write(&self.retry_policies) = p,
            Err(err) => {
                tracing::warn!(agent = %out.id, error = %err, "published retry policies unusable; using defaults");
            }
        }
    }

    /// Creates this agent's two consumers (normal and high priority) and starts taking
    /// deliveries, once. Called when the first command handler is registered, so stored
    /// commands do not arrive before anything can handle them.
    pub(crate) async fn start(self: &Arc<Self>) -> Result<(), SdkError> {
        let mut started = self.started.lock().await;
        if *started {
            return Ok(());
        }
        let out = &self.pipeline.out;
        let inbox = inbox_stream(&out.subjects, &InboxLimits::default());
        for high in [false, true] {
            let durable = if high {
                format!("{}_high", out.id)
            } else {
                out.id.clone()
            };
            let mut spec = ConsumerSpec::new(durable);
            spec.filter_subjects = vec![out.subjects.durable_inbox(&out.id, high)?];
            spec.ack_wait = self.ack_wait;
            spec.max_deliver = i64::from(read(&self.retry_policies).max_attempts());
            spec.max_ack_pending = i64::try_from(self.max_in_flight).unwrap_or(i64::MAX);
            spec.description = format!(
                "durable inbox of agent {} ({} priority)",
                out.id,
                if high { "high" } else { "normal" }
            );
            let consumer = out.js.ensure_consumer(&inbox.name, &spec).await?;
            let deliveries = consumer
                .messages(self.max_in_flight.min(MAX_PULL_BATCH))
                .await?;
            let lanes = if high {
                (self.lanes / HIGH_PRIORITY_LANE_SHARE).max(1)
            } else {
                self.lanes
            };
            self.spawn_lanes(deliveries, lanes);
        }
        self.spawn_keeper();
        *started = true;
        Ok(())
    }

    fn held(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, Arc<Delivery>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every third of the ack wait, reports progress on every delivery this instance holds
    /// (handled or waiting its turn), so the server redelivers none of them while the
    /// instance lives, and all of them within one ack wait once it is gone.
    fn spawn_keeper(self: &Arc<Self>) {
        let inbox = Arc::clone(self);
        let period = self.ack_wait / 3;
        self.tracker.spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = inbox.stop.cancelled() => break,
                }
                let held: Vec<Arc<Delivery>> = inbox.held().values().cloned().collect();
                for delivery in held {
                    if let Err(err) = delivery.in_progress().await {
                        tracing::debug!(agent = %inbox.pipeline.out.id, error = %err, "in-progress ack not sent");
                    }
                }
            }
        });
    }

    /// One dispatcher per consumer sends each delivery to a lane chosen by its sender; each
    /// lane handles its deliveries one at a time, so one sender's messages are handled in the
    /// order they were stored. The dispatcher never waits for a lane: what it takes is held
    /// (and kept alive) at once, and the consumer's `max_ack_pending` bounds how much that is.
    fn spawn_lanes(self: &Arc<Self>, mut deliveries: Deliveries, lanes: usize) {
        let mut senders = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Arc<Delivery>, Decoded)>();
            senders.push(tx);
            let inbox = Arc::clone(self);
            self.tracker.spawn(async move {
                while let Some((delivery, decoded)) = rx.recv().await {
                    inbox.process(delivery, decoded).await;
                }
            });
        }
        let inbox = Arc::clone(self);
        self.tracker.spawn(async move {
            loop {
                let next = tokio::select! {
                    next = futures::StreamExt::next(&mut deliveries) => next,
                    _ = inbox.stop.cancelled() => break,
                };
                let delivery = match next {
                    Some(Ok(d)) => d,
                    Some(Err(err)) => {
                        tracing::debug!(agent = %inbox.pipeline.out.id, error = %err, "durable inbox: pull interrupted");
                        continue;
                    }
                    None => break,
                };
                let decoded = inbox.pipeline.decode(delivery.subject(), delivery.payload());
                let lane = match &decoded {
                    Ok((env, _)) => lane_of(&env.from, senders.len()),
                    Err(_) => 0,
                };
                let delivery = Arc::new(delivery);
                inbox
                    .held()
                    .insert(delivery.stream_seq(), Arc::clone(&delivery));
                if senders[lane].send((delivery, decoded)).is_err() {
                    break;
                }
            }
        });
    }

    /// One delivery through the pipeline, then settled and let go.
    async fn process(&self, delivery: Arc<Delivery>, decoded: Decoded) {
        let counters = self.pipeline.counters();
        let seen_here = self
            .recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(delivery.stream_seq());
        if delivery.delivered() > 1 || seen_here {
            AgentCounters::bump(&counters.redelivered);
        }
        let target = match self
            .pipeline
            .out
            .subjects
            .durable_command(delivery.subject())
            .and_then(|name| self.pipeline.endpoints.command(name))
        {
            Some(endpoint) => Target::Endpoint(endpoint),
            None => Target::Unknown(delivery.subject().to_owned()),
        };
        let processed = self
            .pipeline
            .run(
                delivery.subject(),
                decoded,
                target,
                Via {
                    span: SpanKind::Consumer,
                    attempt: u32::try_from(delivery.delivered()).unwrap_or(u32::MAX),
                },
            )
            .await;
        let kind = processed.request.as_ref().map_or(Kind::Unknown, |r| r.kind);
        let settle = settle(
            &read(&self.retry_policies),
            delivery.subject(),
            delivery.delivered(),
            kind,
            processed.outcome,
        );
        if let Settle::Nak(delay) = &settle {
            tracing::debug!(agent = %self.pipeline.out.id, seq = delivery.stream_seq(), delivered = delivery.delivered(), ?delay, "durable attempt failed; retrying");
        }
        let message_id = processed.request.as_ref().map(|r| r.id);
        self.apply(&delivery, settle, message_id).await;
        let mut held = self.held();
        // A later copy of the same message (redelivered meanwhile) stays held.
        if held
            .get(&delivery.stream_seq())
            .is_some_and(|h| Arc::ptr_eq(h, &delivery))
        {
            held.remove(&delivery.stream_seq());
        }
    }

    /// Acks, naks or dead-letters the delivery.
    async fn apply(&self, delivery: &Delivery, settle: Settle, message_id: Option<uuid::Uuid>) {
        let out = &self.pipeline.out;
        let counters = self.pipeline.counters();
        let sent = match settle {
            Settle::Ack if self.fault_skip_ack() => {
                tracing::debug!(agent = %out.id, seq = delivery.stream_seq(), "fault injection: ack withheld");
                Ok(())
            }
            Settle::Ack | Settle::AckRepeated => delivery.ack().await,
            Settle::Nak(delay) => {
                AgentCounters::bump(&counters.retries);
                delivery.nak(Some(delay)).await
            }
            Settle::DeadLetter(note) => {
                let letter = DeadLetter {
                    reason: note.reason,
                    status: note.status,
                    detail: note.detail.clone(),
                    agent: out.id.clone(),
                    subject: delivery.subject().to_owned(),
                    envelope: delivery.payload().clone(),
                    headers: delivery
                        .headers()
                        .iter()
                        .map(|(n, v)| (n.to_owned(), v.to_owned()))
                        .collect(),
                    message_id,
                    attempts: delivery.delivered(),
                    stored_ms: delivery.published_ms(),
                    dead_lettered_ms: now_ms(),
                    source: Some((
                        out.subjects.stream_name(INBOX_STREAM),
                        delivery.stream_seq(),
                    )),
                    omitted: None,
                };
                let max_payload = out.broker.max_payload();
                match write_dead_letter(&out.js, &out.subjects, &letter, max_payload).await {
                    Ok(_) => {
                        AgentCounters::bump(&counters.dead_lettered);
                        tracing::warn!(agent = %out.id, seq = delivery.stream_seq(), %note, "durable message dead-lettered");
                        delivery.term(&note.to_string()).await
                    }
                    // Not stored in the DLQ: keep the message and try again later.
                    Err(write_err) => {
                        tracing::error!(agent = %out.id, error = %write_err, "dead letter not written; will retry");
                        delivery.nak(Some(DEAD_LETTER_RETRY_DELAY)).await
                    }
                }
            }
        };
        if let Err(err) = sent {
            tracing::warn!(agent = %out.id, seq = delivery.stream_seq(), error = %err, "ack not sent; the server will redeliver");
        }
    }

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
}

/// Stream sequences delivered to this instance lately, the oldest forgotten first.
#[derive(Debug, Default)]
struct Recent {
    set: std::collections::HashSet<u64>,
    order: std::collections::VecDeque<u64>,
}

/// How many stream sequences an instance remembers having been delivered.
const RECENT_DELIVERIES: usize = 16_384;

impl Recent {
    /// Notes `seq`; whether it was delivered here before.
    fn insert(&mut self, seq: u64) -> bool {
        if !self.set.insert(seq) {
            return true;
        }
        self.order.push_back(seq);
        if self.order.len() > RECENT_DELIVERIES
            && let Some(old) = self.order.pop_front()
        {
            self.set.remove(&old);
        }
        false
    }
}

/// Decides what becomes of delivery number `delivered` of a message on `subject` from its
/// outcome and the retry policy.
fn settle(
    policies: &RetryPolicies,
    subject: &str,
    delivered: u64,
    kind: Kind,
    outcome: Outcome,
) -> Settle {
    let failure = match outcome {
        Outcome::Done(_) => return Settle::Ack,
        Outcome::Repeated(_) => return Settle::AckRepeated,
        Outcome::Failed(failure) => failure,
    };
    let policy = policies.for_message(subject, kind);
    let last_attempt = delivered >= u64::from(policy.max_attempts);
    let reason = match failure.retry {
        Retry::After(delay) => return Settle::Nak(delay),
        Retry::Attempts if !last_attempt => {
            return Settle::Nak(policy.delay(delivered, crate::retry::random_fraction()));
        }
        Retry::Policy if policy.should_retry(failure.status, delivered) => {
            return Settle::Nak(policy.delay(delivered, crate::retry::random_fraction()));
        }
        Retry::Policy if policy.retry_on.contains(&failure.status) => DeadLetterReason::MaxAttempts,
        _ if failure.status == StatusCode::EXPIRED => DeadLetterReason::Expired,
        _ if failure.status == StatusCode::UNCERTAIN => DeadLetterReason::Uncertain,
        _ => DeadLetterReason::Refused,
    };
    Settle::DeadLetter(DeadLetterNote {
        status: failure.status,
        reason,
        detail: failure.reason,
    })
}

fn lane_of(sender: &str, lanes: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    sender.hash(&mut h);
    (h.finish() % lanes.max(1) as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::HandlerError;
    use crate::handler::Output;
    use crate::inbound::outcome::Failure;

    const SUBJECT: &str = "chorus.inbox.ledger.post";

    fn settle_nth(delivered: u64, outcome: Outcome) -> Settle {
        let policies = RetryPolicies::default();
        settle(&policies, SUBJECT, delivered, Kind::Command, outcome)
    }

    fn failed(status: StatusCode, retry: Retry) -> Outcome {
        Outcome::Failed(Failure {
            status,
            reason: "why".into(),
            retry,
        })
    }

    fn dead_letter_reason(settle: Settle) -> DeadLetterReason {
        match settle {
            Settle::DeadLetter(note) => note.reason,
            other => panic!("expected a dead letter, got {other:?}"),
        }
    }

    #[test]
    fn a_stream_sequence_seen_before_is_a_repeat_until_it_is_forgotten() {
        let mut recent = Recent::default();
        assert!(!recent.insert(7));
        assert!(recent.insert(7));
        for seq in 100..100 + RECENT_DELIVERIES as u64 {
            assert!(!recent.insert(seq));
        }
        assert!(
            !recent.insert(7),
            "forgotten after RECENT_DELIVERIES others"
        );
        assert_eq!(recent.set.len(), RECENT_DELIVERIES);
    }

    #[test]
    fn success_and_a_repeat_are_acked() {
        assert_eq!(settle_nth(1, Outcome::Done(Output::default())), Settle::Ack);
        assert_eq!(
            settle_nth(1, Outcome::Repeated(Ok(Output::default()))),
            Settle::AckRepeated
        );
    }

    #[test]
    fn a_retryable_failure_is_retried_until_the_attempts_run_out() {
        let max = u64::from(RetryPolicies::default().default.max_attempts);
        let status = RetryPolicies::default().default.retry_on[0];
        for delivered in 1..max {
            assert!(matches!(
                settle_nth(delivered, failed(status, Retry::Policy)),
                Settle::Nak(_)
            ));
        }
        let last = settle_nth(max, failed(status, Retry::Policy));
        assert_eq!(dead_letter_reason(last), DeadLetterReason::MaxAttempts);
    }

    #[test]
    fn poison_expiry_and_a_non_retryable_failure_are_dead_lettered_at_once() {
        let refused = settle_nth(1, failed(StatusCode::DATA_FORMAT, Retry::Never));
        assert_eq!(dead_letter_reason(refused), DeadLetterReason::Refused);
        let expired = settle_nth(1, failed(StatusCode::EXPIRED, Retry::Never));
        assert_eq!(dead_letter_reason(expired), DeadLetterReason::Expired);
        let invalid = Outcome::Failed(Failure::from(HandlerError::invalid_argument("no")));
        assert_eq!(
            dead_letter_reason(settle_nth(1, invalid)),
            DeadLetterReason::Refused
        );
    }

    #[test]
    fn an_unknown_command_waits_for_another_instance_then_is_refused() {
        let max = u64::from(RetryPolicies::default().default.max_attempts);
        let unknown = || failed(StatusCode::UNKNOWN_COMMAND, Retry::Attempts);
        assert!(matches!(settle_nth(1, unknown()), Settle::Nak(_)));
        assert_eq!(
            dead_letter_reason(settle_nth(max, unknown())),
            DeadLetterReason::Refused
        );
    }

    #[test]
    fn an_uncertain_exactly_once_message_is_dead_lettered_for_a_person() {
        let uncertain = settle_nth(2, failed(StatusCode::UNCERTAIN, Retry::Never));
        assert_eq!(dead_letter_reason(uncertain), DeadLetterReason::Uncertain);
    }

    #[test]
    fn a_pause_is_a_nak_with_that_delay_whatever_the_attempt() {
        let pause = Duration::from_secs(1);
        let over = failed(StatusCode::RATE_LIMITED, Retry::After(pause));
        assert_eq!(settle_nth(100, over), Settle::Nak(pause));
    }

    #[test]
    fn the_note_the_coordinator_reads_says_why() {
        let settle = settle_nth(1, failed(StatusCode::DATA_FORMAT, Retry::Never));
        let Settle::DeadLetter(note) = settle else {
            panic!("expected a dead letter");
        };
        assert_eq!(note.to_string(), "5006 refused: why");
    }
}
