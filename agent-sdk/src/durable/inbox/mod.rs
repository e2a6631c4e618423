//! An agent's durable inbox: its two consumers (normal and high priority), the lanes that keep
//! one sender's commands in order, and the one place a durable delivery's outcome becomes an
//! ack, a nak with the retry policy's delay, or a dead letter.
//!
//! Rooms: `consumer` (a lane's consumer, on demand or always held: the look for stored
//! commands, the bells, taking deliveries, releasing the consumer), `lanes` (the ordering
//! lanes and the keeper that reports progress on what is held), `settle` (the pure `settle()`
//! that decides and the `apply()` that acts, tested apart).

mod consumer;
mod lanes;
mod settle;

use std::sync::{Arc, RwLock};
use std::time::Duration;

use chorus_broker_adapter::{ConsumerSpec, Deliveries, Delivery, Subscription};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::durable::{
    CONFIG_BUCKET, INBOX_STREAM, InboxLimits, RETRY_KEY, advisory_stream, dlq_stream, inbox_stream,
};
use crate::error::SdkError;
use crate::inbound::Pipeline;
use crate::inbound::admit::Refused;
use crate::protocol::codec::Encoding;
use crate::protocol::envelope::Envelope;
use crate::retry::RetryPolicies;
use crate::sync::{read, write};

use settle::{Recent, Settle};

use crate::link::Link;

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
/// reach), while it lasts: the first time after `FIRST_LOOK_RETRY`, twice as long each further
/// time, up to this.
const LOOK_RETRY: Duration = Duration::from_secs(5);
/// The first wait after a look failed: right after a reconnect JetStream may still be electing
/// its leaders, and a command stored meanwhile should not wait the full `LOOK_RETRY`.
const FIRST_LOOK_RETRY: Duration = Duration::from_millis(250);
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
    /// reconnects or misses messages as a slow consumer, every `recheck` (jittered), and while
    /// looks fail after 0.25 s, then twice as long each time up to every 5 s; so a lost bell
    /// delays a command by at most `recheck`, and each
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
    /// The agent's identity, subjects, connection and counters.
    link: Arc<Link>,
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

/// Runs `work`, a durable inbox's JetStream calls, unless the server refuses one of them to the
/// connection's user: such a user gets no answer, only the server's word that it refused, which
/// ends `work` at once, saying what is missing, rather than after each call's timeout.
///
/// # Errors
/// `work`'s; a refused JetStream call as [`ErrorKind::Refused`](chorus_broker_adapter::ErrorKind).
pub(crate) async fn unless_jetstream_refused<T>(
    link: &crate::link::Link,
    work: impl std::future::Future<Output = Result<T, SdkError>>,
) -> Result<T, SdkError> {
    let mut events = link.broker.events();
    let refused = async move {
        loop {
            match events.recv().await {
                // A call the credentials deny on purpose (changing a bus stream) is not what
                // is missing; one the inbox needs is.
                Ok(chorus_broker_adapter::ConnectionEvent::PermissionViolation(text))
                    if text.contains("\"$JS.API.")
                        && ![
                            "STREAM.UPDATE.",
                            "STREAM.DELETE.",
                            "STREAM.PURGE.",
                            "MSG.DELETE.",
                        ]
                        .iter()
                        .any(|denied| text.contains(denied)) =>
                {
                    return text;
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                    std::future::pending::<()>().await;
                }
                _ => {}
            }
        }
    };
    tokio::select! {
        done = work => done,
        text = refused => Err(SdkError::Broker(chorus_broker_adapter::Error::with_source(
            chorus_broker_adapter::ErrorKind::Refused,
            format!(
                "agent {}: the server refused its JetStream calls to its user, so it has no durable inbox (a durable inbox needs JetStream rights: `chorus creds {} --durable`)",
                link.id, link.id
            ),
            chorus_broker_adapter::PermissionViolation(text),
        ))),
    }
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
            link: Arc::clone(&pipeline.out.link),
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
        let link = &self.link;
        // Created when missing, never changed: a stream that exists is its owner's (the
        // coordinator's, configured for the bus), which an agent's limits must not overwrite.
        link.js
            .ensure_stream_exists(&inbox_stream(&link.subjects, limits))
            .await?;
        link.js
            .ensure_stream_exists(&dlq_stream(&link.subjects, limits.replicas))
            .await?;
        // Captures the server's advisories even while no coordinator runs.
        link.js
            .ensure_stream_exists(&advisory_stream(&link.subjects, limits.replicas))
            .await?;
        Ok(())
    }

    /// Reads the retry policies the coordinator published; keeps the defaults if none.
    pub(crate) async fn load_retry_policies(&self) {
        let link = &self.link;
        let bucket = link.subjects.bucket_name(CONFIG_BUCKET);
        let Ok(kv) = link.js.open_kv(&bucket).await else {
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
                tracing::warn!(agent = %link.id, error = %err, "published retry policies unusable; using defaults");
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
        unless_jetstream_refused(&self.link, self.start_lanes()).await?;
        *started = true;
        Ok(())
    }

    /// [`DurableInbox::start`]'s work: the bells, the look and a consumer task per lane.
    async fn start_lanes(self: &Arc<Self>) -> Result<(), SdkError> {
        let link = &self.link;
        let mut bells = [None, None];
        let mut bell_subjects = [None, None];
        let mut heard = [None, None];
        let mut waiting = [false, false];
        if let InboxConsumers::OnDemand { recheck, .. } = self.consumers {
            // Bells heard before the look, so a command stored after it rings.
            for high in [false, true] {
                let subject = link.subjects.lane_bells(&link.id, high)?;
                heard[usize::from(high)] = Some(link.broker.subscribe(&subject).await?);
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
                filter: link.subjects.durable_inbox(&link.id, high)?,
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
        Ok(())
    }

    /// The consumer of one priority lane.
    fn consumer_spec(&self, high: bool) -> Result<ConsumerSpec, SdkError> {
        let link = &self.link;
        let durable = if high {
            format!("{}_high", link.id)
        } else {
            link.id.clone()
        };
        let mut spec = ConsumerSpec::new(durable);
        spec.filter_subjects = vec![link.subjects.durable_inbox(&link.id, high)?];
        spec.ack_wait = self.ack_wait;
        spec.max_deliver = i64::from(read(&self.retry_policies).max_attempts());
        spec.max_ack_pending = i64::try_from(self.max_in_flight).unwrap_or(i64::MAX);
        if let InboxConsumers::OnDemand { .. } = self.consumers {
            spec.inactive_threshold = ABANDONED_CONSUMER_AFTER;
        }
        spec.description = format!(
            "durable inbox of agent {} ({} priority)",
            link.id,
            if high { "high" } else { "normal" }
        );
        Ok(spec)
    }

    /// Creates or updates the consumer and starts pulling from it. The pull is renewed when
    /// the connection comes back, so a restarted server (which has forgotten every pull
    /// request) delivers again as soon as it answers.
    async fn open(&self, spec: &ConsumerSpec) -> Result<Deliveries, chorus_broker_adapter::Error> {
        let link = &self.link;
        let stream = link.subjects.stream_name(INBOX_STREAM);
        // Heard before the consumer is made, so a reconnect meanwhile renews the pull too.
        let events = link.broker.events();
        let consumer = link.js.ensure_consumer(&stream, spec).await?;
        Ok(consumer
            .messages(self.max_in_flight.min(MAX_PULL_BATCH))
            .await?
            .renew_on_reconnect(events))
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
}
