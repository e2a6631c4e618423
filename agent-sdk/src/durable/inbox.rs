//! An agent's durable inbox: its two consumers (normal and high priority), the lanes that keep
//! one sender's commands in order, and the one place a durable delivery's outcome becomes an
//! ack, a nak with the retry policy's delay, or a dead letter.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use chorus_broker_adapter::{ConsumerSpec, Deliveries, Delivery, Subscription};
use opentelemetry::trace::SpanKind;
use tokio::sync::mpsc::error::TrySendError;
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
/// How long an on-demand consumer stays once nothing has arrived and nothing is pending.
pub const DEFAULT_INBOX_RELEASE_AFTER: Duration = Duration::from_secs(30);
/// How often an agent without a consumer looks for stored commands itself, in case a bell was
/// lost (each look is one request to the server).
pub const DEFAULT_INBOX_RECHECK: Duration = Duration::from_secs(60);
/// How soon an agent looks for stored commands again after a look failed (JetStream out of
/// reach), while it lasts.
const LOOK_RETRY: Duration = Duration::from_secs(5);
/// How long the server keeps an on-demand consumer no client pulls from (its agent crashed or
/// left): its deliveries' counts last this long across a restart.
pub const ABANDONED_CONSUMER_AFTER: Duration = Duration::from_secs(3600);
/// How long a consumer that could not be opened waits before the first try again (each
/// further try waits twice as long).
const REOPEN_DELAY: Duration = Duration::from_secs(1);
/// Opens tried in a row before a lane gives up with an error (1 + 2 + 4 + 8 s of waits).
const MAX_OPEN_ATTEMPTS: u32 = 5;

/// When an agent's durable inbox holds its consumers on the server (docs/SCALE.md measures
/// both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxConsumers {
    /// From the first command handler on: two consumers per agent, busy or idle, each about
    /// 50 KiB of server memory (nats-server 2.15), and created at start even when nothing waits.
    Always,
    /// Only while commands wait (the default). The inbox stream republishes the headers of
    /// every stored command to its agent's bell (`_INBOX.<agent>.bell.<root>.<lane>.<command>`);
    /// a bell opens that lane's consumer, and the agent deletes it again once nothing has
    /// arrived for `release_after` and the server has nothing pending for it. An agent looks
    /// for stored commands itself (one request for both lanes) when it starts, after it
    /// reconnects or misses messages as a slow consumer, every `recheck` (jittered), and every
    /// 5 s while looks fail; so a lost bell delays a command by at most `recheck`, and each
    /// idle agent costs the server one look per `recheck`.
    OnDemand {
        /// Quiet time after which a consumer with nothing pending is deleted.
        release_after: Duration,
        /// Longest time between the agent's own looks for stored commands.
        recheck: Duration,
    },
}

impl Default for InboxConsumers {
    fn default() -> Self {
        InboxConsumers::OnDemand {
            release_after: DEFAULT_INBOX_RELEASE_AFTER,
            recheck: DEFAULT_INBOX_RECHECK,
        }
    }
}

/// A lane's bell: rung (capacity one: a ring not yet heard covers the next) when a command is
/// stored for it.
type Bell = tokio::sync::mpsc::Receiver<()>;
/// What rings the bells of the two lanes (normal, high).
type Rings = [tokio::sync::mpsc::Sender<()>; 2];

/// One priority lane's consumer: its spec, the lanes its deliveries go to, and its bell.
struct LaneConsumer {
    spec: ConsumerSpec,
    /// The lane's subjects, for the look for stored commands.
    filter: String,
    senders: Vec<tokio::sync::mpsc::UnboundedSender<(Arc<Delivery>, Decoded)>>,
    /// Rung by the looker when it finds commands stored for the lane (`None` with consumers
    /// always held).
    bell: Option<Bell>,
    /// The lane's bells (`_INBOX.<agent>.bell.<root>.<lane>.*`), one per command stored for
    /// it, heard only while the lane has no consumer: dropped (unsubscribed) when the consumer
    /// opens, so a busy lane is not sent a bell for every command it is delivered anyway.
    bells: Option<Subscription>,
    /// That subject (`None` with consumers always held: no bells).
    bell_subject: Option<String>,
}

/// Why a consumer's deliveries stopped being taken.
enum Ended {
    /// The agent is stopping.
    Stopped,
    /// Nothing arrived for the release time and nothing is held here.
    Quiet,
    /// The server ended the pull: the consumer is gone.
    Closed,
}

type Decoded = Result<(Envelope, Encoding), Refused>;

/// What the durable inbox needs of its agent.
pub(crate) struct DurableInbox {
    pub(crate) pipeline: Arc<Pipeline>,
    pub(crate) retry_policies: RwLock<RetryPolicies>,
    pub(crate) ack_wait: Duration,
    pub(crate) lanes: usize,
    pub(crate) max_in_flight: usize,
    pub(crate) consumers: InboxConsumers,
    pub(crate) tracker: TaskTracker,
    pub(crate) stop: CancellationToken,
    started: tokio::sync::Mutex<bool>,
    /// Asks the looker (on demand) to look for stored commands now.
    look_soon: tokio::sync::Notify,
    /// Deliveries taken and not yet settled, by stream sequence: the keeper reports progress
    /// on each, so one waiting its turn in a lane is not redelivered meanwhile.
    held: std::sync::Mutex<std::collections::HashMap<u64, Arc<Delivery>>>,
    /// Stream sequences delivered here lately: a server that lost its consumer's delivery
    /// counts in a crash delivers again as a first delivery, and this still tells a repeat.
    recent: std::sync::Mutex<Recent>,
    #[cfg(feature = "fault-injection")]
    pub(crate) skip_acks: std::sync::atomic::AtomicU64,
}

/// How an agent takes its durable deliveries (from its options).
pub(crate) struct Taking {
    /// Redelivery after this long without an ack or progress.
    pub(crate) ack_wait: Duration,
    /// Ordering lanes of the normal-priority consumer.
    pub(crate) lanes: usize,
    /// Deliveries held at once per consumer.
    pub(crate) max_in_flight: usize,
    /// When the consumers exist.
    pub(crate) consumers: InboxConsumers,
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
        taking: Taking,
        tracker: TaskTracker,
        stop: CancellationToken,
    ) -> Self {
        DurableInbox {
            pipeline,
            retry_policies: RwLock::new(retry_policies),
            ack_wait: taking.ack_wait,
            lanes: taking.lanes,
            max_in_flight: taking.max_in_flight,
            consumers: taking.consumers,
            tracker,
            stop,
            started: tokio::sync::Mutex::new(false),
            look_soon: tokio::sync::Notify::new(),
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

    /// Starts taking this agent's deliveries, once: opens its two consumers (normal and high
    /// priority), or with [`InboxConsumers::OnDemand`] listens for its bells, looks for stored
    /// commands, and opens a consumer for each lane where some wait. Called when the first
    /// command handler is registered, so stored commands do not arrive before anything can
    /// handle them. An error here (the server's JetStream out of reach, a right missing) is
    /// the caller's.
    pub(crate) async fn start(self: &Arc<Self>) -> Result<(), SdkError> {
        let mut started = self.started.lock().await;
        if *started {
            return Ok(());
        }
        let out = &self.pipeline.out;
        let mut bells = [None, None];
        let mut bell_subjects = [None, None];
        let mut heard = [None, None];
        let mut waiting = [false, false];
        if let InboxConsumers::OnDemand { recheck, .. } = self.consumers {
            // Bells heard before the look, so a command stored after it rings.
            for high in [false, true] {
                let subject = out.subjects.lane_bells(&out.id, high)?;
                heard[usize::from(high)] = Some(out.broker.subscribe(&subject).await?);
                bell_subjects[usize::from(high)] = Some(subject);
            }
            let (normal_tx, normal) = tokio::sync::mpsc::channel(1);
            let (high_tx, high) = tokio::sync::mpsc::channel(1);
            bells = [Some(normal), Some(high)];
            waiting = self.look().await?;
            self.spawn_looker([normal_tx, high_tx], recheck);
        }
        for high in [false, true] {
            let lanes = if high {
                (self.lanes / HIGH_PRIORITY_LANE_SHARE).max(1)
            } else {
                self.lanes
            };
            let lane = LaneConsumer {
                spec: self.consumer_spec(high)?,
                filter: out.subjects.durable_inbox(&out.id, high)?,
                senders: self.spawn_lanes(lanes),
                bell: bells[usize::from(high)].take(),
                bells: heard[usize::from(high)].take(),
                bell_subject: bell_subjects[usize::from(high)].take(),
            };
            let opened = match self.consumers {
                InboxConsumers::Always => Some(self.open(&lane.spec).await?),
                InboxConsumers::OnDemand { .. } => None,
            };
            let inbox = Arc::clone(self);
            let waiting = waiting[usize::from(high)];
            self.tracker
                .spawn(async move { inbox.take_deliveries(lane, opened, waiting).await });
        }
        self.spawn_keeper();
        *started = true;
        Ok(())
    }

    /// The consumer of one priority lane.
    fn consumer_spec(&self, high: bool) -> Result<ConsumerSpec, SdkError> {
        let out = &self.pipeline.out;
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
        if let InboxConsumers::OnDemand { .. } = self.consumers {
            spec.inactive_threshold = ABANDONED_CONSUMER_AFTER;
        }
        spec.description = format!(
            "durable inbox of agent {} ({} priority)",
            out.id,
            if high { "high" } else { "normal" }
        );
        Ok(spec)
    }

    /// Creates or updates the consumer and starts pulling from it.
    async fn open(&self, spec: &ConsumerSpec) -> Result<Deliveries, chorus_broker_adapter::Error> {
        let out = &self.pipeline.out;
        let stream = out.subjects.stream_name(INBOX_STREAM);
        let consumer = out.js.ensure_consumer(&stream, spec).await?;
        consumer
            .messages(self.max_in_flight.min(MAX_PULL_BATCH))
            .await
    }

    /// One look at the stream for commands stored for this agent: which lanes (normal, high)
    /// have some. One request for both lanes.
    async fn look(&self) -> Result<[bool; 2], chorus_broker_adapter::Error> {
        let out = &self.pipeline.out;
        let stream = out.subjects.stream_name(INBOX_STREAM);
        let filter = out.subjects.durable_agent_all(&out.id).map_err(|e| {
            chorus_broker_adapter::Error::new(
                chorus_broker_adapter::ErrorKind::InvalidInput,
                e.to_string(),
            )
        })?;
        let mut waiting = [false, false];
        for (subject, count) in out.js.subject_counts(&stream, &filter).await? {
            if count > 0 {
                let high = subject.split('.').rev().nth(1) == Some("high");
                waiting[usize::from(high)] = true;
            }
        }
        Ok(waiting)
    }

    /// The agent's own looks for stored commands, in case bells were lost: every `recheck`
    /// (jittered), after the connection came back or dropped messages, when a lane asks
    /// (`look_soon`), and every 5 s while looks fail (JetStream out of reach: a leaf node cut
    /// off from its hub, a cluster without a leader). A lane found with commands is rung as a
    /// bell would. The only place an on-demand inbox looks again after a failure.
    fn spawn_looker(self: &Arc<Self>, rings: Rings, recheck: Duration) {
        let inbox = Arc::clone(self);
        let mut events = Some(self.pipeline.out.broker.events());
        self.tracker.spawn(async move {
            let mut look_in = recheck;
            loop {
                let next_look = tokio::time::Instant::now()
                    + look_in.mul_f64(0.75 + 0.5 * crate::retry::random_fraction());
                loop {
                    tokio::select! {
                        () = inbox.stop.cancelled() => return,
                        () = tokio::time::sleep_until(next_look) => break,
                        () = inbox.look_soon.notified() => break,
                        look = bells_may_be_lost(&mut events) => if look {
                            break;
                        },
                    }
                }
                look_in = match inbox.look().await {
                    Ok(waiting) => {
                        for (ring, waiting) in rings.iter().zip(waiting) {
                            if waiting && let Err(TrySendError::Closed(())) = ring.try_send(()) {
                                return;
                            }
                        }
                        recheck
                    }
                    Err(err) => {
                        tracing::debug!(agent = %inbox.pipeline.out.id, error = %err, "durable inbox: stored commands not looked for; looking again soon");
                        recheck.min(LOOK_RETRY)
                    }
                };
            }
        });
    }

    /// Takes one lane's deliveries until the agent stops: from its always-held consumer, or
    /// (on demand) from a consumer opened when commands wait and released when none do.
    /// `opened` is a consumer opened already; `waiting` says commands were found stored.
    async fn take_deliveries(
        self: Arc<Self>,
        mut lane: LaneConsumer,
        mut opened: Option<Deliveries>,
        waiting: bool,
    ) {
        let out = &self.pipeline.out;
        let stream = out.subjects.stream_name(INBOX_STREAM);
        let counters = self.pipeline.counters();
        let on_demand = self.consumers != InboxConsumers::Always;
        // On demand: whether the lane looks at its own commands before waiting for its bell.
        let mut look_now = waiting;
        // Opens that failed in a row: each waits twice as long as the one before, and the
        // last of them ends the try (on demand, until the next bell or look; always held,
        // for good), with an error that says why.
        let mut failed_opens = 0u32;
        loop {
            let mut deliveries = match opened.take() {
                Some(deliveries) => deliveries,
                None => {
                    if on_demand && !self.wait_for_commands(&mut lane, look_now).await {
                        return;
                    }
                    look_now = false;
                    match self.open(&lane.spec).await {
                        Ok(deliveries) => {
                            failed_opens = 0;
                            if on_demand {
                                AgentCounters::bump(&counters.inbox_consumers_opened);
                                // The consumer delivers what is stored: no bell for each.
                                lane.bells = None;
                            }
                            deliveries
                        }
                        Err(err) => {
                            failed_opens += 1;
                            if failed_opens >= MAX_OPEN_ATTEMPTS {
                                tracing::error!(agent = %out.id, consumer = %lane.spec.durable, error = %err, attempts = failed_opens, "durable inbox: consumer cannot be opened; {}", if on_demand { "trying again at the next bell or look" } else { "this lane takes no more deliveries" });
                                if !on_demand {
                                    return;
                                }
                                failed_opens = 0;
                                continue;
                            }
                            tracing::warn!(agent = %out.id, consumer = %lane.spec.durable, error = %err, "durable inbox: consumer not opened; trying again");
                            if !self.pause(REOPEN_DELAY * 2u32.pow(failed_opens - 1)).await {
                                return;
                            }
                            look_now = true;
                            continue;
                        }
                    }
                }
            };
            let release_after = match self.consumers {
                InboxConsumers::Always => None,
                InboxConsumers::OnDemand { release_after, .. } => Some(release_after),
            };
            match self
                .dispatch(&mut deliveries, &lane.senders, release_after)
                .await
            {
                Ended::Stopped => return,
                Ended::Closed => {
                    // Always held: opened again. On demand (another instance released it): a
                    // look decides.
                    tracing::debug!(agent = %out.id, consumer = %lane.spec.durable, "durable inbox: the server ended the pull");
                    look_now = true;
                }
                Ended::Quiet => {
                    drop(deliveries);
                    // Bells heard again before the state below is read: one from now on is
                    // for a command the state may not count yet, and opens the consumer again.
                    self.hear_bells(&mut lane).await;
                    if let Some(bell) = &mut lane.bell {
                        while bell.try_recv().is_ok() {}
                    }
                    look_now = match self.release(&stream, &lane).await {
                        Ok(true) => {
                            AgentCounters::bump(&counters.inbox_consumers_released);
                            false
                        }
                        // Something pending or held, or given up on: the consumer stays.
                        Ok(false) => true,
                        // Gone already (another instance released it): look.
                        Err(err) if err.kind() == chorus_broker_adapter::ErrorKind::NotFound => {
                            true
                        }
                        // Out of reach: the looker looks again until it answers.
                        Err(_) => {
                            self.look_soon.notify_one();
                            false
                        }
                    };
                }
            }
        }
    }

    /// Deletes the lane's consumer if it is idle: nothing pending, nothing awaiting an ack,
    /// and no command stored for the lane. Commands still stored that the consumer neither
    /// offers nor waits on are ones it gave up on (`max_deliver`), waiting for the coordinator
    /// to dead-letter them: the consumer stays, so a new one does not deliver them all over
    /// again. Whether it was deleted.
    async fn release(
        &self,
        stream: &str,
        lane: &LaneConsumer,
    ) -> Result<bool, chorus_broker_adapter::Error> {
        let js = &self.pipeline.out.js;
        let state = js.consumer_state(stream, &lane.spec.durable).await?;
        if state.pending > 0
            || state.ack_pending > 0
            || js.has_messages(stream, &lane.filter).await?
        {
            return Ok(false);
        }
        js.delete_consumer(stream, &lane.spec.durable).await?;
        Ok(true)
    }

    /// Waits until commands wait for this lane: its bell rings (the looker rings it too), or,
    /// with `look_now`, a look at the lane finds some. A look that fails asks the looker to
    /// look until one answers. `false` once the agent stops.
    async fn wait_for_commands(&self, lane: &mut LaneConsumer, mut look_now: bool) -> bool {
        if lane.bells.is_none() {
            // The consumer went away while bells were not heard: hear them, then look.
            self.hear_bells(lane).await;
            look_now = true;
        }
        if look_now {
            let out = &self.pipeline.out;
            let stream = out.subjects.stream_name(INBOX_STREAM);
            match out.js.has_messages(&stream, &lane.filter).await {
                Ok(true) => return true,
                Ok(false) => {}
                Err(err) => {
                    tracing::debug!(agent = %out.id, error = %err, "durable inbox: stored commands not looked for; the looker looks again");
                    self.look_soon.notify_one();
                }
            }
        }
        loop {
            tokio::select! {
                () = self.stop.cancelled() => return false,
                rung = next_bell(&mut lane.bell) => if rung {
                    return true;
                },
                heard = next_heard(&mut lane.bells) => if heard {
                    return true;
                },
            }
        }
    }

    /// Subscribes to the lane's bells, if it is not already. If that fails (the agent's
    /// connection is closing), the looker's looks still find what is stored.
    async fn hear_bells(&self, lane: &mut LaneConsumer) {
        let (None, Some(subject)) = (&lane.bells, &lane.bell_subject) else {
            return;
        };
        match self.pipeline.out.broker.subscribe(subject).await {
            Ok(sub) => lane.bells = Some(sub),
            Err(err) => {
                tracing::warn!(agent = %self.pipeline.out.id, error = %err, "durable inbox: bells not heard; stored commands are found by looks");
            }
        }
    }

    /// Sleeps `delay`; `false` if the agent stops meanwhile.
    async fn pause(&self, delay: Duration) -> bool {
        tokio::select! {
            () = self.stop.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        }
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

    /// Spawns `lanes` lanes: each handles its deliveries one at a time, so one sender's
    /// messages (always sent to the same lane) are handled in the order they were stored.
    fn spawn_lanes(
        self: &Arc<Self>,
        lanes: usize,
    ) -> Vec<tokio::sync::mpsc::UnboundedSender<(Arc<Delivery>, Decoded)>> {
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
        senders
    }

    /// Sends each delivery to the lane chosen by its sender. Never waits for a lane: what it
    /// takes is held (and kept alive) at once, and the consumer's `max_ack_pending` bounds how
    /// much that is. With `quiet`, returns once nothing has been delivered for that long and
    /// nothing is held here.
    async fn dispatch(
        &self,
        deliveries: &mut Deliveries,
        senders: &[tokio::sync::mpsc::UnboundedSender<(Arc<Delivery>, Decoded)>],
        quiet: Option<Duration>,
    ) -> Ended {
        let quiet_for = |from: tokio::time::Instant| quiet.map(|q| from + q);
        let mut quiet_at = quiet_for(tokio::time::Instant::now());
        loop {
            let next = tokio::select! {
                next = futures::StreamExt::next(deliveries) => next,
                () = sleep_until_some(quiet_at) => {
                    if self.held().is_empty() {
                        return Ended::Quiet;
                    }
                    quiet_at = quiet_for(tokio::time::Instant::now());
                    continue;
                }
                () = self.stop.cancelled() => return Ended::Stopped,
            };
            let delivery = match next {
                Some(Ok(d)) => d,
                Some(Err(err)) => {
                    tracing::debug!(agent = %self.pipeline.out.id, error = %err, "durable inbox: pull interrupted");
                    continue;
                }
                None => return Ended::Closed,
            };
            quiet_at = quiet_for(tokio::time::Instant::now());
            let decoded = self.pipeline.decode(delivery.subject(), delivery.payload());
            let lane = match &decoded {
                Ok((env, _)) => lane_of(&env.from, senders.len()),
                Err(_) => 0,
            };
            let delivery = Arc::new(delivery);
            self.held()
                .insert(delivery.stream_seq(), Arc::clone(&delivery));
            if senders[lane].send((delivery, decoded)).is_err() {
                return Ended::Stopped;
            }
        }
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
                &delivery.shared_subject(),
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

/// Sleeps until `at`; forever without one.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Whether the next bell rang: `false` (and no more bells) if the bell listener ended; forever
/// without a bell.
async fn next_bell(bell: &mut Option<tokio::sync::mpsc::Receiver<()>>) -> bool {
    let Some(rx) = bell else {
        return std::future::pending().await;
    };
    if rx.recv().await.is_some() {
        return true;
    }
    *bell = None;
    false
}

/// Whether a bell was heard on `bells`; pending forever without a subscription, and `false`
/// (the subscription dropped) once it ends.
async fn next_heard(bells: &mut Option<Subscription>) -> bool {
    use futures::StreamExt;
    let Some(sub) = bells else {
        return std::future::pending().await;
    };
    if sub.next().await.is_some() {
        return true;
    }
    *bells = None;
    false
}

/// Whether the next connection event may have cost bells (a reconnect, dropped messages, or
/// events missed); forever once the events end.
async fn bells_may_be_lost(
    events: &mut Option<tokio::sync::broadcast::Receiver<chorus_broker_adapter::ConnectionEvent>>,
) -> bool {
    use chorus_broker_adapter::ConnectionEvent;
    use tokio::sync::broadcast::error::RecvError;
    let Some(rx) = events else {
        return std::future::pending().await;
    };
    match rx.recv().await {
        Ok(ConnectionEvent::Reconnected | ConnectionEvent::SlowConsumer { .. }) => true,
        Ok(_) => false,
        Err(RecvError::Lagged(_)) => true,
        Err(RecvError::Closed) => {
            *events = None;
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
