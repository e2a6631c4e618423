//! The agent handle: [`Agent`], a cheap clone in front of the parts one agent is made of,
//! each with one job (`outbound` sends, `inbound` takes messages in, `durable` keeps the
//! inbox, `presence` announces the agent). This room wires them together at `connect` and
//! takes them down at `shutdown`; `handlers` registers what the agent serves and `calls` is
//! what it asks of others.

mod batch;
mod calls;
mod config;
mod handlers;
mod negotiate;
mod options;
mod tasks;
pub use batch::{Batcher, Batching, MAX_BATCH_DELAY, MAX_BATCH_MESSAGES, Queued};
pub use config::{
    AgentConfig, BatchingConfig, BusConfig, MonitoringConfig, ReliabilityConfig, SecurityConfig,
};
pub use tasks::TaskSummary;

use crate::Report;
use std::sync::Arc;
use std::time::Duration;

use chorus_broker_adapter::{Broker, BrokerOptions};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use options::{
    AgentOptions, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_QUEUE_CAPACITY,
    DEFAULT_REQUEST_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT, JETSTREAM_TIMEOUT,
};

use crate::durable::inbox::DurableInbox;
use crate::durable::send::Sender;
use crate::error::SdkError;
use crate::handler::endpoint::Endpoints;
use crate::inbound::Pipeline;
use crate::inbound::exactly_once::ExactlyOnce;
use crate::inbound::pipeline::PipelineParts;
use crate::inbound::reader::Dispatcher;
use crate::metrics::StatsSource;
use crate::outbound::Outbound;
use crate::presence::Presence;
use crate::protocol::envelope::now_ms;
use crate::security::Verifier;
use crate::security::access::Access;
use crate::stats::{AgentCounters, AgentStats};
use crate::subject::{Subjects, validate_token};

/// How long a subscribe waits for the server to confirm it has the subscription.
const SYNC_TIMEOUT: Duration = Duration::from_secs(10);

/// What [`Agent::shutdown`] observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Whether every in-flight handler finished before the deadline.
    pub completed: bool,
    /// Tasks still running when the deadline passed.
    pub abandoned: usize,
}

/// A connected agent. Cheap to clone; all clones share one connection. When the last clone is
/// dropped the agent stops taking messages; call [`shutdown`](Agent::shutdown) to also wait
/// for in-flight work and drain the connection.
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<Inner>,
    _guard: Arc<StopOnDrop>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("id", &self.inner.link.id)
            .finish()
    }
}

#[derive(Debug)]
struct StopOnDrop(CancellationToken);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// The parts of one agent. Every task any of them spawns is tracked by `tracker` and stops
/// on `stop`.
pub(crate) struct Inner {
    /// Identity, subjects, connection and counters, as every part shares them.
    pub(crate) link: Arc<crate::link::Link>,
    /// What only sending needs.
    pub(crate) out: Arc<Outbound>,
    pub(crate) pipeline: Arc<Pipeline>,
    pub(crate) dispatcher: Arc<Dispatcher>,
    pub(crate) presence: Arc<Presence>,
    pub(crate) sender: Sender,
    pub(crate) durable: Option<Arc<DurableInbox>>,
    pub(crate) access: Arc<Access>,
    pub(crate) endpoints: Arc<Endpoints>,
    /// Tasks this agent submits, watches and works on.
    pub(crate) tasks: Arc<crate::task::Tasks>,
    /// What this agent learns of the contract-net rounds it proposed in.
    pub(crate) rounds: tokio::sync::broadcast::Sender<crate::negotiate::RoundResult>,
    /// How this agent answers counter-offers, per capability it bids for.
    pub(crate) counters: negotiate::Counters,
    pub(crate) tracker: TaskTracker,
    pub(crate) stop: CancellationToken,
    shutdown_timeout: Duration,
    /// Whether the agent's command subject is subscribed yet.
    commands_subscribed: tokio::sync::Mutex<bool>,
    /// A second connection for event subscriptions, opened on first use: an event firehose
    /// never delays commands and replies, and drops on it are counted exactly
    /// ([`Broker::undelivered`]).
    events_broker: tokio::sync::OnceCell<Broker>,
    broker_options: BrokerOptions,
    /// Whether the connection is shared with other agents (theirs to drain, not this one's;
    /// event subscriptions use it too).
    shared_connection: bool,
    /// The bus's credits ledger, opened on first use.
    ledger: tokio::sync::OnceCell<crate::credits::Ledger>,
    /// Replicas of the streams and buckets it makes.
    replicas: usize,
    /// What [`Agent::default_batcher`] batches by.
    pub(crate) batching: batch::Batching,
}

/// How long shutdown waits to store the last usage report.
const USAGE_LAST_REPORT: Duration = Duration::from_secs(2);

/// Round results kept for a slow reader of [`Agent::round_results`] before the oldest are
/// dropped.
const ROUND_RESULTS: usize = 256;

impl Agent {
    async fn connect(options: AgentOptions) -> Result<Agent, SdkError> {
        validate_token("agent id", &options.id)?;
        for group in &options.groups {
            validate_token("group", group)?;
        }
        if let Some(customer) = &options.customer {
            validate_token("customer", customer)?;
        }
        options.batching.check()?;
        if let Some(url) = &options.metrics_url
            && crate::protocol::registry::MetricsTarget::parse(url).is_none()
        {
            return Err(SdkError::InvalidCall(format!(
                "metrics URL {url:?} is not http[s]://host:port[/path]"
            )));
        }
        let subjects = Subjects::new(&options.root)?;
        let broker_options = options
            .broker
            .clone()
            .name_if_unset(options.id.clone())
            .inbox_prefix_if_unset(subjects.inbox_prefix(&options.id)?);
        let shared = options.connection.clone();
        let broker = match &shared {
            Some(connection) => connection.clone(),
            None => broker_options.clone().connect().await?,
        };
        let js = broker.jetstream(JETSTREAM_TIMEOUT);
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        let counters = Arc::new(AgentCounters::default());
        // Wakes the heartbeat loop when the manifest changes (a capability, the load, a
        // circuit breaker).
        let changed = Arc::new(tokio::sync::Notify::new());
        let link = Arc::new(crate::link::Link {
            id: options.id.clone(),
            subjects,
            broker,
            js,
            counters,
            inbox_ready: tokio::sync::OnceCell::new(),
        });
        let verifier = options.signature_policy.clone().map(|policy| {
            let verifier = Verifier::new(policy);
            for (agent, key) in &options.trusted {
                verifier.pin(agent, key);
            }
            Arc::new(verifier)
        });
        let out = Arc::new(Outbound {
            link: Arc::clone(&link),
            wire: crate::outbound::Wire::new(options.encoding),
            hop_limit: options.hop_limit,
            request_timeout: options.request_timeout,
            default_delivery: options.default_delivery,
            max_message_bytes: options.max_message_bytes,
            identity: options.identity.clone(),
            encryption_keys: std::sync::RwLock::new(
                options.encryption_trust.iter().cloned().collect(),
            ),
            sessions: crate::security::encryption::EncryptionSessions::new(options.rekey),
            encode_chunk: std::sync::Mutex::new(bytes::BytesMut::new()),
            sequencer: Default::default(),
            routing: options.routing,
            router: crate::outbound::Router::new(options.routing_refresh),
            breakers: crate::outbound::Breakers::new(
                options.breaker,
                &options.id,
                Arc::clone(&changed),
            ),
            payload_limits: options.payload_limits,
            readers: crate::outbound::Readers::default(),
            verifier: verifier.clone(),
        });
        let access = Arc::new(
            Access::new(options.grants.clone(), options.rate_limit)
                .trusting_unverified_senders(options.trust_unverified_senders),
        );
        let endpoints = Arc::new(Endpoints::default());
        let instance = uuid::Uuid::now_v7().simple().to_string();
        let usage = Arc::new(crate::usage::Usage::new(
            &options.id,
            &instance,
            !options.usage_interval.is_zero(),
        ));
        let pipeline = Arc::new(Pipeline::new(PipelineParts {
            out: Arc::clone(&out),
            endpoints: Arc::clone(&endpoints),
            verifier: verifier.clone(),
            decryption: options.decryption.clone(),
            token: options.token.clone(),
            access: Arc::clone(&access),
            exactly_once: ExactlyOnce::new(
                Arc::clone(&link),
                options.idempotency_ttl,
                options.inbox_limits.replicas,
                instance.clone(),
            ),
            seen: options
                .signature_policy
                .as_ref()
                .filter(|_| options.persist_seen_ids)
                .map(|policy| {
                    crate::inbound::seen::SeenIds::new(
                        Arc::clone(&link),
                        policy.tolerance,
                        options.inbox_limits.replicas,
                    )
                }),
            usage: Arc::clone(&usage),
            tracker: tracker.clone(),
            stop: stop.clone(),
            notifier: Arc::new(Sender::new(Arc::clone(&out))),
        }));
        let dispatcher = Arc::new(Dispatcher {
            pipeline: Arc::clone(&pipeline),
            in_flight: Arc::new(Semaphore::new(options.max_in_flight)),
            max_in_flight: options.max_in_flight,
            queue_capacity: options.queue_capacity,
            tracker: tracker.clone(),
            stop: stop.clone(),
            waiting: Default::default(),
        });
        let presence = Arc::new(Presence {
            link: Arc::clone(&link),
            out: Arc::clone(&out),
            endpoints: Arc::clone(&endpoints),
            dispatcher: Arc::clone(&dispatcher),
            capabilities: std::sync::Mutex::new(options.capabilities.clone()),
            instance,
            started_ms: now_ms(),
            groups: options.groups.clone(),
            customer: options.customer.clone(),
            capability_version: options.capability_version.clone(),
            capability_details: options.capability_details.clone(),
            capability_max_tokens: options.capability_max_tokens.clone(),
            heartbeat_interval: options.heartbeat_interval,
            encryption_key: options.decryption.as_ref().map(|k| k.public_key()),
            metrics_url: options.metrics_url.clone(),
            changed,
            load_override: std::sync::Mutex::new(None),
            stop: stop.clone(),
        });
        let durable = options.durable_inbox.then(|| {
            let inbox = DurableInbox::new(
                Arc::clone(&pipeline),
                options.retry_policies.clone().unwrap_or_default(),
                crate::durable::inbox::Taking {
                    ack_wait: options.durable_ack_wait,
                    lanes: options.ordering_lanes,
                    max_in_flight: options.max_in_flight,
                    consumers: options.inbox_consumers,
                },
                tracker.clone(),
                stop.clone(),
            );
            #[cfg(feature = "fault-injection")]
            inbox
                .skip_acks
                .store(options.skip_acks, std::sync::atomic::Ordering::Relaxed);
            Arc::new(inbox)
        });
        let tasks = Arc::new(crate::task::Tasks::new(
            crate::task::store::TaskStore::new(
                Arc::clone(&out),
                options.inbox_limits.replicas,
                tracker.clone(),
            ),
            tracker.clone(),
            stop.clone(),
            Arc::clone(&endpoints),
            Arc::clone(&usage),
        ));
        let inner = Arc::new(Inner {
            link,
            sender: Sender::new(Arc::clone(&out)),
            tasks,
            rounds: tokio::sync::broadcast::channel(ROUND_RESULTS).0,
            counters: negotiate::Counters::default(),
            out,
            pipeline,
            dispatcher,
            presence,
            durable,
            access,
            endpoints,
            tracker,
            stop: stop.clone(),
            shutdown_timeout: options.shutdown_timeout,
            commands_subscribed: tokio::sync::Mutex::new(false),
            events_broker: tokio::sync::OnceCell::new(),
            broker_options,
            shared_connection: shared.is_some(),
            ledger: tokio::sync::OnceCell::new(),
            replicas: options.inbox_limits.replicas,
            batching: options.batching,
        });
        inner.start(&options, verifier).await?;
        tracing::info!(agent = %inner.link.id, "agent connected");
        Ok(Agent {
            inner,
            _guard: Arc::new(StopOnDrop(stop)),
        })
    }

    /// The agent's id.
    pub fn id(&self) -> &str {
        &self.inner.link.id
    }

    /// The bus's credits ledger (`docs/PROTOCOL.md` section 7.15): the negotiations settled at
    /// a price, by round, with balances by agent and customer
    /// ([`credits::balances`](crate::credits::balances)).
    ///
    /// # Errors
    /// [`SdkError::Broker`] when JetStream cannot make or open the ledger's bucket.
    pub async fn ledger(&self) -> Result<&crate::credits::Ledger, SdkError> {
        let link = &self.inner.link;
        self.inner
            .ledger
            .get_or_try_init(|| {
                crate::credits::Ledger::open(&link.js, &link.subjects, self.inner.replicas)
            })
            .await
    }

    /// The subject builder this agent uses.
    pub fn subjects(&self) -> &Subjects {
        &self.inner.link.subjects
    }

    /// The underlying broker connection.
    pub fn broker(&self) -> &Broker {
        &self.inner.link.broker
    }

    /// The agent's counters.
    pub fn stats(&self) -> AgentStats {
        self.inner.agent_stats()
    }

    /// Stops taking new messages at once, without waiting for in-flight handlers (for a
    /// `Drop` that cannot wait); [`shutdown`](Agent::shutdown) also waits and drains.
    pub fn stop(&self) {
        self.inner.stop.cancel();
    }

    /// Stops taking new messages, lets in-flight handlers finish (up to the shutdown
    /// timeout), sends their replies, and drains the connection.
    pub async fn shutdown(&self) -> ShutdownReport {
        let inner = &self.inner;
        let id = &inner.link.id;
        tracing::info!(agent = %id, "agent shutting down");
        inner.stop.cancel();
        inner.tracker.close();
        let completed = tokio::time::timeout(inner.shutdown_timeout, inner.tracker.wait())
            .await
            .is_ok();
        let abandoned = inner.tracker.len();
        if !completed {
            tracing::warn!(agent = %id, abandoned, "handlers still running at the shutdown deadline");
        }
        // What was handled since the last usage report, stored before the connection goes.
        let usage = inner.pipeline.usage.report(&inner.link);
        if !tokio::time::timeout(USAGE_LAST_REPORT, usage)
            .await
            .unwrap_or(false)
        {
            tracing::warn!(agent = %id, "the last usage report was not stored");
        }
        if let Err(err) = inner.link.broker.flush().await {
            tracing::debug!(agent = %id, error = %Report(&err), "flush at shutdown failed");
        }
        // A shared connection goes on serving the process's other agents: this agent's
        // subscriptions already ended with its readers (each drains its own on the token).
        if !inner.shared_connection
            && let Err(err) = inner.link.broker.drain().await
        {
            tracing::debug!(agent = %id, error = %Report(&err), "drain at shutdown failed");
        }
        if let Some(events) = inner.events_broker.get()
            && let Err(err) = events.drain().await
        {
            tracing::debug!(agent = %id, error = %Report(&err), "events connection drain failed");
        }
        ShutdownReport {
            completed,
            abandoned,
        }
    }
}

impl Inner {
    /// Starts what runs from the start: the key watcher, metrics, service discovery, the
    /// durable inbox's streams and the heartbeat.
    async fn start(
        self: &Arc<Self>,
        options: &AgentOptions,
        verifier: Option<Arc<Verifier>>,
    ) -> Result<(), SdkError> {
        if verifier.is_some() || options.decryption.is_some() {
            self.tracker.spawn(crate::presence::watch_registered_keys(
                Arc::clone(&self.out),
                verifier,
                self.stop.clone(),
            ));
        }
        let weak: std::sync::Weak<dyn StatsSource> =
            Arc::downgrade(&(Arc::clone(self) as Arc<dyn StatsSource>));
        crate::metrics::track(weak);
        if options.service_discovery {
            for subject in self.presence.service_subjects()? {
                let sub = self.link.broker.subscribe(&subject).await?;
                self.presence.serve_discovery(&self.tracker, sub);
            }
        }
        if let Some(durable) = &self.durable {
            crate::durable::inbox::unless_jetstream_refused(&self.link, async {
                if options.retry_policies.is_none() {
                    durable.load_retry_policies().await;
                }
                durable.prepare(&options.inbox_limits).await
            })
            .await?;
        }
        if !self.presence.heartbeat_interval.is_zero() {
            self.tracker.spawn(Arc::clone(&self.presence).run());
        }
        if !options.usage_interval.is_zero() {
            let (pipeline, stop, every) = (
                Arc::clone(&self.pipeline),
                self.stop.clone(),
                options.usage_interval,
            );
            self.tracker.spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        // The last report is made at shutdown, after the handlers finish.
                        _ = stop.cancelled() => break,
                    }
                    pipeline.usage.report(&pipeline.link).await;
                }
            });
        }
        if self.out.wire.follows_bus() || !self.presence.heartbeat_interval.is_zero() {
            let sub = self
                .link
                .broker
                .subscribe(&self.link.subjects.wire())
                .await?;
            self.tracker.spawn(crate::presence::follow_wire(
                Arc::clone(&self.out),
                sub,
                self.stop.clone(),
            ));
        }
        self.link.broker.sync(SYNC_TIMEOUT).await?;
        Ok(())
    }

    /// The connection event subscriptions use, opened on first use (the shared connection,
    /// for an agent on one).
    async fn events_connection(&self) -> Result<&Broker, SdkError> {
        if self.shared_connection {
            return Ok(&self.link.broker);
        }
        let events = self
            .events_broker
            .get_or_try_init(|| {
                self.broker_options
                    .clone()
                    .name(format!("{}-events", self.link.id))
                    .connect()
            })
            .await?;
        Ok(events)
    }
}

impl StatsSource for Inner {
    fn agent_id(&self) -> &str {
        &self.link.id
    }

    fn agent_stats(&self) -> AgentStats {
        let mut stats = self.link.counters.snapshot();
        // Events the client dropped before the SDK's queue saw them.
        if let Some(events) = self.events_broker.get() {
            stats.dropped += events.undelivered();
        }
        stats
    }

    fn broker_stats(&self) -> chorus_broker_adapter::StatsSnapshot {
        self.link.broker.stats()
    }

    fn in_flight(&self) -> usize {
        self.dispatcher.busy()
    }

    fn connections(&self) -> Vec<Broker> {
        let mut all = vec![self.link.broker.clone()];
        all.extend(self.events_broker.get().cloned());
        all
    }
}
