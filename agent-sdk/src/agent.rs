//! The agent: options, the handle, and the paths every message takes in and out.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::Poll;
use std::time::Duration;

use broker_adapter::{Broker, BrokerOptions, ErrorKind, JetStream, Kv, Message, Subscription};
use futures::{Stream, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::call::{Call, Reply, Target};
use crate::codec::{self, CodecError, Encoding, decode_payload, encode_payload};
use crate::context::Context;
use crate::durable::{self, InboxLimits};
use crate::envelope::{
    CONTENT_TYPE_MSGPACK, DEFAULT_HOP_LIMIT, DeliveryClass, Envelope, ExpectedReply, Kind,
    Performative, now_ms,
};
use crate::error::{HandlerError, SdkError};
use crate::handler::{EventHandler, Handler, Output, Typed};
use crate::metrics::{StatsSource, sdk_metrics};
use crate::presence::Endpoint;
use crate::registry::{AgentRecord, Availability, BroadcastReport, BroadcastTarget, DiscoverQuery};
use crate::retry::RetryPolicies;
use crate::stats::{AgentCounters, AgentStats};
use crate::status::StatusCode;
use crate::subject::{Subjects, validate_token};

/// Default time a request waits for its reply.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Default number of messages an agent handles at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;
/// Default size limit of an inbound message (NATS's default `max_payload`).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1024 * 1024;
/// Default time between heartbeats.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);
/// How long a durable delivery may go without an ack or progress report before the server
/// redelivers it. Handlers that run longer report progress automatically.
pub const DURABLE_ACK_WAIT: Duration = Duration::from_secs(30);
/// Timeout of JetStream API calls and publish acks.
pub const JETSTREAM_TIMEOUT: Duration = Duration::from_secs(10);
/// Default lifetime of exactly-once idempotency records.
pub const DEFAULT_IDEMPOTENCY_TTL: Duration = Duration::from_secs(24 * 3600);
/// Default number of ordering lanes of a durable inbox.
pub const DEFAULT_ORDERING_LANES: usize = 16;
/// Default bound of the core message queue per subscription.
pub const DEFAULT_QUEUE_CAPACITY: usize = 4096;
/// How long a subscribe waits for the server to confirm it has the subscription.
const SYNC_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time [`Agent::shutdown`] waits for in-flight handlers.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// How to build an [`Agent`].
///
/// ```no_run
/// # async fn run() -> Result<(), agent_sdk::SdkError> {
/// let agent = agent_sdk::AgentOptions::new("calculator")
///     .servers(["nats://127.0.0.1:4222"])
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct AgentOptions {
    id: String,
    capabilities: Vec<String>,
    broker: BrokerOptions,
    root: String,
    encoding: Encoding,
    hop_limit: u8,
    request_timeout: Duration,
    max_in_flight: usize,
    max_message_bytes: usize,
    shutdown_timeout: Duration,
    groups: Vec<String>,
    capability_version: String,
    heartbeat_interval: Duration,
    service_discovery: bool,
    durable_inbox: bool,
    inbox_limits: InboxLimits,
    retry_policies: Option<RetryPolicies>,
    durable_ack_wait: Duration,
    default_delivery: DeliveryClass,
    idempotency_ttl: Duration,
    ordering_lanes: usize,
    queue_capacity: usize,
    identity: Option<Arc<crate::security::Identity>>,
    signature_policy: Option<crate::security::SignaturePolicy>,
    trusted: Vec<(String, String)>,
    grants: Vec<(String, Vec<String>)>,
    rate_limit: Option<RateLimit>,
    decryption: Option<Arc<crate::encryption::EncryptionKey>>,
    encryption_trust: Vec<(String, String)>,
    #[cfg(feature = "fault-injection")]
    skip_acks: u64,
}

/// A per-sender request rate limit: a token bucket of `burst` requests refilled at
/// `per_second`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Sustained requests a second, per sender.
    pub per_second: f64,
    /// Requests a sender may make at once.
    pub burst: f64,
}

impl AgentOptions {
    /// Options for agent `id` (one subject token: letters, digits, `_`, `-`), connecting to
    /// `nats://127.0.0.1:4222` unless told otherwise.
    pub fn new(id: impl Into<String>) -> Self {
        AgentOptions {
            id: id.into(),
            capabilities: Vec::new(),
            broker: BrokerOptions::default(),
            root: crate::subject::DEFAULT_ROOT.to_owned(),
            encoding: Encoding::MsgPack,
            hop_limit: DEFAULT_HOP_LIMIT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            groups: Vec::new(),
            capability_version: "1.0".to_owned(),
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            service_discovery: true,
            durable_inbox: false,
            inbox_limits: InboxLimits::default(),
            retry_policies: None,
            durable_ack_wait: DURABLE_ACK_WAIT,
            default_delivery: DeliveryClass::AtMostOnce,
            idempotency_ttl: DEFAULT_IDEMPOTENCY_TTL,
            ordering_lanes: DEFAULT_ORDERING_LANES,
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            identity: None,
            signature_policy: None,
            trusted: Vec::new(),
            grants: Vec::new(),
            rate_limit: None,
            decryption: None,
            encryption_trust: Vec::new(),
            #[cfg(feature = "fault-injection")]
            skip_acks: 0,
        }
    }

    /// The agent's decryption key: payloads encrypted for it are opened before its handlers
    /// see them, and its public half is announced in the manifest.
    pub fn encryption_key(mut self, key: crate::encryption::EncryptionKey) -> Self {
        self.decryption = Some(Arc::new(key));
        self
    }

    /// Registers `agent`'s public encryption key, for [`Call::encrypt_for`], in addition to
    /// the registry's.
    pub fn trust_encryption(
        mut self,
        agent: impl Into<String>,
        public_key: impl Into<String>,
    ) -> Self {
        self.encryption_trust
            .push((agent.into(), public_key.into()));
        self
    }

    /// Grants `agent` permissions (strings the application chooses, such as
    /// `payments:write`), checked against what handlers require ([`Agent::require`]). Grants
    /// name the sender by its `from` field: pair them with signature checks so that field is
    /// proven.
    pub fn grant<I, S>(mut self, agent: impl Into<String>, permissions: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.grants.push((
            agent.into(),
            permissions.into_iter().map(Into::into).collect(),
        ));
        self
    }

    /// Limits how many requests and commands each sender may make (refused with 5013 beyond).
    pub fn rate_limit(mut self, limit: RateLimit) -> Self {
        self.rate_limit = Some(limit);
        self
    }

    /// Signs everything the agent sends with `identity` (and announces its public key in the
    /// manifest, so the registry holds it for receivers).
    pub fn identity(mut self, identity: crate::security::Identity) -> Self {
        self.identity = Some(Arc::new(identity));
        self
    }

    /// Checks signatures on what the agent receives: signed messages must verify against the
    /// sender's registered key (from [`trust`](AgentOptions::trust) or the registry), within
    /// the timestamp tolerance and never twice; unsigned ones are refused if the policy says
    /// so. Off unless set.
    pub fn verify_signatures(mut self, policy: crate::security::SignaturePolicy) -> Self {
        self.signature_policy = Some(policy);
        self
    }

    /// Registers `agent`'s public key for signature checks, in addition to the registry's.
    pub fn trust(mut self, agent: impl Into<String>, public_key: impl Into<String>) -> Self {
        self.trusted.push((agent.into(), public_key.into()));
        self
    }

    /// The delivery class [`Agent::send`] uses when a call does not name one (default
    /// at-most-once).
    pub fn default_delivery(mut self, class: DeliveryClass) -> Self {
        self.default_delivery = class;
        self
    }

    /// How long exactly-once idempotency records are kept (default 24 h): a copy of a message
    /// arriving later than this runs its handler again.
    pub fn idempotency_ttl(mut self, ttl: Duration) -> Self {
        self.idempotency_ttl = ttl;
        self
    }

    /// Durable deliveries are handled in lanes, one at a time per lane; all messages from one
    /// sender use the same lane, so they are handled in the order they were sent (default 16
    /// lanes: up to 16 senders' messages at once).
    pub fn ordering_lanes(mut self, lanes: usize) -> Self {
        self.ordering_lanes = lanes.max(1);
        self
    }

    /// Core messages waiting for a free handler slot, per subscription (default 4096). When
    /// full, new events are dropped and counted, and new requests are answered at once with
    /// 5019 (unavailable), so memory stays bounded under any burst.
    pub fn queue_capacity(mut self, capacity: usize) -> Self {
        self.queue_capacity = capacity.max(1);
        self
    }

    /// Test hook: the first `n` successfully handled durable deliveries are not acknowledged,
    /// so the server redelivers them after the ack wait (a lost ack).
    #[cfg(feature = "fault-injection")]
    pub fn skip_acks(mut self, n: u64) -> Self {
        self.skip_acks = n;
        self
    }

    /// Joins a broadcast group (one token).
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.groups.push(group.into());
        self
    }

    /// The version announced for this agent's capabilities (default `1.0`).
    pub fn capability_version(mut self, version: impl Into<String>) -> Self {
        self.capability_version = version.into();
        self
    }

    /// Time between heartbeats (default 5 s); the registry declares the agent gone after three
    /// missed. Zero turns heartbeats off (the agent then does not appear in discovery).
    pub fn heartbeat_interval(mut self, interval: Duration) -> Self {
        self.heartbeat_interval = interval;
        self
    }

    /// Whether the agent answers NATS service discovery (`$SRV.*`; default on).
    pub fn service_discovery(mut self, on: bool) -> Self {
        self.service_discovery = on;
        self
    }

    /// Gives the agent a durable inbox: commands sent with [`Agent::send_durable`] wait in
    /// JetStream while it is offline, are retried by the retry policy and dead-lettered when
    /// they cannot be handled. Its command handlers serve both paths.
    pub fn durable_inbox(mut self, on: bool) -> Self {
        self.durable_inbox = on;
        self
    }

    /// Limits of the inbox stream, used when this agent creates it.
    pub fn inbox_limits(mut self, limits: InboxLimits) -> Self {
        self.inbox_limits = limits;
        self
    }

    /// Retry policies for the durable inbox. Without them the agent reads the policies the
    /// coordinator publishes from its configuration, or uses the defaults.
    pub fn retry_policies(mut self, policies: RetryPolicies) -> Self {
        self.retry_policies = Some(policies);
        self
    }

    /// How long a durable delivery may go unacknowledged before it is redelivered (default
    /// 30 s; running handlers report progress every third of it).
    pub fn durable_ack_wait(mut self, wait: Duration) -> Self {
        self.durable_ack_wait = wait.max(Duration::from_millis(300));
        self
    }

    /// Declares a capability the agent offers (serving it takes [`Agent::on_capability`]).
    pub fn capability(mut self, capability: impl Into<String>) -> Self {
        self.capabilities.push(capability.into());
        self
    }

    /// The NATS servers to connect to (keeps the other broker settings).
    pub fn servers<I, S>(mut self, servers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.broker = self.broker.with_servers(servers);
        self
    }

    /// All broker settings (credentials, TLS, ping interval...). The connection name and inbox
    /// prefix are set from the agent id unless given here.
    pub fn broker(mut self, broker: BrokerOptions) -> Self {
        self.broker = broker;
        self
    }

    /// The subject root (default `chorus`).
    pub fn root(mut self, root: impl Into<String>) -> Self {
        self.root = root.into();
        self
    }

    /// How this agent encodes what it sends (default MessagePack). It reads both, and answers
    /// each request in the encoding it came in.
    pub fn encoding(mut self, encoding: Encoding) -> Self {
        self.encoding = encoding;
        self
    }

    /// The most hops this agent accepts and gives to the chains it starts (default 16).
    pub fn hop_limit(mut self, limit: u8) -> Self {
        self.hop_limit = limit;
        self
    }

    /// Default reply timeout of calls.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// How many messages are handled at once; more wait in the subscription buffer.
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// Inbound messages larger than this are refused with 5006 without being decoded.
    pub fn max_message_bytes(mut self, n: usize) -> Self {
        self.max_message_bytes = n;
        self
    }

    /// How long [`Agent::shutdown`] waits for in-flight handlers.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// Connects and returns the agent.
    pub async fn connect(self) -> Result<Agent, SdkError> {
        Agent::connect(self).await
    }
}

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
        f.debug_struct("Agent").field("id", &self.inner.id).finish()
    }
}

#[derive(Debug)]
struct StopOnDrop(CancellationToken);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

#[derive(Clone)]
enum Route {
    /// Everything under `<root>.agent.<id>.*`, dispatched by command name.
    Commands,
    Capability(Arc<Endpoint>),
    Event(Arc<dyn EventHandler>),
    /// NATS service discovery (`$SRV.*`).
    Service,
}

/// The message being handled when a handler sends: its envelope (for correlation, hops,
/// deadline) and its handling span (the parent of what it sends).
#[derive(Clone, Copy)]
pub(crate) struct Parent<'a> {
    pub(crate) env: &'a Envelope,
    pub(crate) otel: &'a opentelemetry::Context,
}

/// Why an inbound message is not handled, and what to answer.
struct Refusal {
    status: StatusCode,
    reason: String,
    request: Option<Box<Envelope>>,
    /// The encoding to answer in: the request's when it decoded.
    encoding: Encoding,
}

pub(crate) struct Inner {
    pub(crate) id: String,
    pub(crate) subjects: Subjects,
    pub(crate) broker: Broker,
    pub(crate) encoding: Encoding,
    pub(crate) hop_limit: u8,
    request_timeout: Duration,
    pub(crate) max_message_bytes: usize,
    shutdown_timeout: Duration,
    pub(crate) capabilities: Mutex<Vec<String>>,
    pub(crate) commands: RwLock<HashMap<String, Arc<Endpoint>>>,
    endpoints: Mutex<Vec<Arc<Endpoint>>>,
    inbound: tokio::sync::Mutex<bool>,
    pub(crate) counters: AgentCounters,
    pub(crate) tracker: TaskTracker,
    pub(crate) stop: CancellationToken,
    in_flight: Arc<Semaphore>,
    pub(crate) max_in_flight: usize,
    pub(crate) instance: String,
    pub(crate) started_ms: u64,
    pub(crate) groups: Vec<String>,
    pub(crate) capability_version: String,
    pub(crate) heartbeat_interval: Duration,
    pub(crate) presence_changed: tokio::sync::Notify,
    load_override: Mutex<Option<(f32, Availability)>>,
    pub(crate) js: JetStream,
    pub(crate) retry_policies: RwLock<RetryPolicies>,
    pub(crate) durable_ack_wait: Duration,
    pub(crate) default_delivery: DeliveryClass,
    pub(crate) idempotency: tokio::sync::OnceCell<Kv>,
    pub(crate) inbox_ready: tokio::sync::OnceCell<()>,
    /// Whether this agent has a durable inbox, and whether its consumers run yet.
    durable_inbox: bool,
    durable_started: tokio::sync::Mutex<bool>,
    /// A second connection for event subscriptions, opened on first use: an event firehose
    /// never delays commands and replies, and drops on it are counted exactly
    /// ([`Broker::undelivered`]).
    events_broker: tokio::sync::OnceCell<Broker>,
    broker_options: BrokerOptions,
    pub(crate) idempotency_ttl: Duration,
    pub(crate) ordering_lanes: usize,
    queue_capacity: usize,
    pub(crate) identity: Option<Arc<crate::security::Identity>>,
    pub(crate) verifier: Option<crate::security::Verifier>,
    grants: RwLock<HashMap<String, std::collections::HashSet<String>>>,
    rate_limit: Option<RateLimit>,
    buckets: Mutex<HashMap<String, (f64, std::time::Instant)>>,
    pub(crate) decryption: Option<Arc<crate::encryption::EncryptionKey>>,
    encryption_keys: RwLock<HashMap<String, String>>,
    #[cfg(feature = "fault-injection")]
    pub(crate) skip_acks: std::sync::atomic::AtomicU64,
}

impl Agent {
    async fn connect(options: AgentOptions) -> Result<Agent, SdkError> {
        validate_token("agent id", &options.id)?;
        let subjects = Subjects::new(&options.root)?;
        let broker_options = options
            .broker
            .name_if_unset(options.id.clone())
            .inbox_prefix_if_unset(subjects.inbox_prefix(&options.id)?);
        let broker = broker_options.clone().connect().await?;
        let stop = CancellationToken::new();
        for group in &options.groups {
            validate_token("group", group)?;
        }
        let js = broker.jetstream(JETSTREAM_TIMEOUT);
        let inner = Arc::new(Inner {
            id: options.id,
            subjects,
            broker,
            encoding: options.encoding,
            hop_limit: options.hop_limit,
            request_timeout: options.request_timeout,
            max_message_bytes: options.max_message_bytes,
            shutdown_timeout: options.shutdown_timeout,
            capabilities: Mutex::new(options.capabilities),
            commands: RwLock::new(HashMap::new()),
            endpoints: Mutex::new(Vec::new()),
            inbound: tokio::sync::Mutex::new(false),
            counters: AgentCounters::default(),
            tracker: TaskTracker::new(),
            stop: stop.clone(),
            in_flight: Arc::new(Semaphore::new(options.max_in_flight)),
            max_in_flight: options.max_in_flight,
            instance: uuid::Uuid::now_v7().simple().to_string(),
            started_ms: now_ms(),
            groups: options.groups,
            capability_version: options.capability_version,
            heartbeat_interval: options.heartbeat_interval,
            presence_changed: tokio::sync::Notify::new(),
            load_override: Mutex::new(None),
            js,
            retry_policies: RwLock::new(options.retry_policies.clone().unwrap_or_default()),
            durable_ack_wait: options.durable_ack_wait,
            default_delivery: options.default_delivery,
            idempotency: tokio::sync::OnceCell::new(),
            inbox_ready: tokio::sync::OnceCell::new(),
            durable_inbox: options.durable_inbox,
            durable_started: tokio::sync::Mutex::new(false),
            events_broker: tokio::sync::OnceCell::new(),
            broker_options,
            idempotency_ttl: options.idempotency_ttl,
            ordering_lanes: options.ordering_lanes,
            queue_capacity: options.queue_capacity,
            identity: options.identity.clone(),
            verifier: options.signature_policy.clone().map(|policy| {
                let verifier = crate::security::Verifier::new(policy);
                for (agent, key) in &options.trusted {
                    verifier.trust(agent, key);
                }
                verifier
            }),
            grants: RwLock::new(
                options
                    .grants
                    .iter()
                    .map(|(a, p)| (a.clone(), p.iter().cloned().collect()))
                    .collect(),
            ),
            rate_limit: options.rate_limit,
            buckets: Mutex::new(HashMap::new()),
            decryption: options.decryption.clone(),
            encryption_keys: RwLock::new(options.encryption_trust.iter().cloned().collect()),
            #[cfg(feature = "fault-injection")]
            skip_acks: std::sync::atomic::AtomicU64::new(options.skip_acks),
        });
        if inner.verifier.is_some() || inner.decryption.is_some() {
            inner
                .tracker
                .spawn(Arc::clone(&inner).watch_registered_keys());
        }
        let weak: std::sync::Weak<dyn StatsSource> =
            Arc::downgrade(&(Arc::clone(&inner) as Arc<dyn StatsSource>));
        crate::metrics::track(weak);
        if options.service_discovery {
            for subject in inner.service_subjects() {
                let sub = inner.broker.subscribe(&subject).await?;
                Inner::spawn_reader(&inner, sub, Route::Service);
            }
        }
        if options.durable_inbox {
            if options.retry_policies.is_none() {
                inner.load_retry_policies().await;
            }
            inner.prepare_durable_inbox(&options.inbox_limits).await?;
        }
        if !inner.heartbeat_interval.is_zero() {
            inner.tracker.spawn(Arc::clone(&inner).presence_loop());
        }
        inner.broker.sync(SYNC_TIMEOUT).await?;
        tracing::info!(agent = %inner.id, "agent connected");
        Ok(Agent {
            inner,
            _guard: Arc::new(StopOnDrop(stop)),
        })
    }

    /// The agent's id.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The subject builder this agent uses.
    pub fn subjects(&self) -> &Subjects {
        &self.inner.subjects
    }

    /// The underlying broker connection.
    pub fn broker(&self) -> &Broker {
        &self.inner.broker
    }

    /// Capabilities declared or served.
    pub fn capabilities(&self) -> Vec<String> {
        lock(&self.inner.capabilities).clone()
    }

    /// The agent's counters.
    pub fn stats(&self) -> AgentStats {
        self.inner.agent_stats()
    }

    /// Registers a typed handler for command `name`, sent to this agent with
    /// [`Call::agent`]. The payload is decoded into `T`; the handler's `R` is the reply.
    /// Returns once the server routes the agent's commands here.
    pub async fn on_command<T, R, F, Fut>(&self, name: &str, f: F) -> Result<(), SdkError>
    where
        F: Fn(Context, T) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<R, HandlerError>> + Send + 'static,
        T: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
    {
        self.handle_command(name, Typed::new(f)).await
    }

    /// Registers an untyped [`Handler`] for command `name`.
    pub async fn handle_command(&self, name: &str, handler: impl Handler) -> Result<(), SdkError> {
        let subject = self.inner.subjects.command(&self.inner.id, name)?;
        let endpoint = Arc::new(Endpoint::new(
            name.to_owned(),
            subject,
            None,
            false,
            Arc::new(handler),
        ));
        let previous = write(&self.inner.commands).insert(name.to_owned(), Arc::clone(&endpoint));
        {
            let mut endpoints = lock(&self.inner.endpoints);
            endpoints.retain(|e| e.is_capability || e.name != name);
            endpoints.push(endpoint);
        }
        if previous.is_some() {
            tracing::warn!(agent = %self.inner.id, command = name, "command handler replaced");
        }
        self.inner.presence_changed.notify_one();
        if self.inner.durable_inbox {
            let mut started = self.inner.durable_started.lock().await;
            if !*started {
                self.inner.start_durable_inbox().await?;
                *started = true;
            }
        }
        let mut subscribed = self.inner.inbound.lock().await;
        if !*subscribed {
            let subject = self.inner.subjects.agent_inbound(&self.inner.id)?;
            let sub = self.inner.broker.subscribe(&subject).await?;
            self.inner.broker.sync(SYNC_TIMEOUT).await?;
            Inner::spawn_reader(&self.inner, sub, Route::Commands);
            *subscribed = true;
        }
        Ok(())
    }

    /// Serves `capability` with a typed handler: requests to the capability's access point
    /// are shared among all agents serving it (a queue group). Returns once subscribed.
    pub async fn on_capability<T, R, F, Fut>(&self, capability: &str, f: F) -> Result<(), SdkError>
    where
        F: Fn(Context, T) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<R, HandlerError>> + Send + 'static,
        T: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
    {
        self.handle_capability(capability, Typed::new(f)).await
    }

    /// Serves `capability` with an untyped [`Handler`].
    pub async fn handle_capability(
        &self,
        capability: &str,
        handler: impl Handler,
    ) -> Result<(), SdkError> {
        let subject = self.inner.subjects.capability(capability)?;
        let sub = self
            .inner
            .broker
            .queue_subscribe(&subject, &subject)
            .await?;
        self.inner.broker.sync(SYNC_TIMEOUT).await?;
        {
            let mut caps = lock(&self.inner.capabilities);
            if !caps.iter().any(|c| c == capability) {
                caps.push(capability.to_owned());
            }
        }
        let endpoint = Arc::new(Endpoint::new(
            capability.to_owned(),
            subject.clone(),
            Some(subject),
            true,
            Arc::new(handler),
        ));
        lock(&self.inner.endpoints).push(Arc::clone(&endpoint));
        Inner::spawn_reader(&self.inner, sub, Route::Capability(endpoint));
        self.inner.presence_changed.notify_one();
        Ok(())
    }

    /// Handles events on topics matching `pattern` (`*` one token, `>` the rest) with a typed
    /// handler. Every subscriber gets every event. Returns once subscribed.
    pub async fn on_event<T, F, Fut>(&self, pattern: &str, f: F) -> Result<(), SdkError>
    where
        F: Fn(Context, T) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), HandlerError>> + Send + 'static,
        T: DeserializeOwned + Send + 'static,
    {
        self.handle_events(pattern, Typed::<F, T, ()>::new(f)).await
    }

    /// Handles events matching `pattern` with an untyped [`EventHandler`].
    pub async fn handle_events(
        &self,
        pattern: &str,
        handler: impl EventHandler,
    ) -> Result<(), SdkError> {
        let subject = self.inner.subjects.event_pattern(pattern)?;
        let events = self.inner.events_connection().await?;
        let sub = events.subscribe(&subject).await?;
        events.sync(SYNC_TIMEOUT).await?;
        Inner::spawn_reader(&self.inner, sub, Route::Event(Arc::new(handler)));
        Ok(())
    }

    /// Events on topics matching `pattern`, as a stream. Messages that are not valid events,
    /// or have expired or looped, are counted and skipped.
    pub async fn subscribe(&self, pattern: &str) -> Result<EventStream, SdkError> {
        let subject = self.inner.subjects.event_pattern(pattern)?;
        let events = self.inner.events_connection().await?;
        let sub = events.subscribe(&subject).await?;
        events.sync(SYNC_TIMEOUT).await?;
        Ok(EventStream {
            sub,
            inner: Arc::clone(&self.inner),
            ready: std::collections::VecDeque::new(),
        })
    }

    /// Publishes an event on `topic`.
    pub async fn publish<T: Serialize + ?Sized>(
        &self,
        topic: &str,
        value: &T,
    ) -> Result<(), SdkError> {
        self.inner.publish(topic, value, None).await
    }

    /// Publishes an event whose payload is `payload` as it is, labelled `content_type` (for
    /// binary payloads, or payloads already encoded).
    pub async fn publish_raw(
        &self,
        topic: &str,
        payload: bytes::Bytes,
        content_type: &str,
    ) -> Result<(), SdkError> {
        let subject = self.inner.subjects.event(topic)?;
        let mut env = Envelope::new_typed(
            Kind::Event,
            Performative::Inform,
            self.inner.id.as_str(),
            content_type.to_owned(),
        );
        env.topic = Some(topic.to_owned());
        env.payload = payload;
        self.inner
            .publish_envelope(subject, env, &opentelemetry::Context::current())
            .await
    }

    /// Sends a call and waits for its reply. A reply with an error status is returned as
    /// [`SdkError::Remote`] with that status.
    pub async fn call(&self, call: Call) -> Result<Reply, SdkError> {
        self.inner.call(call, None).await
    }

    /// Requests `command` from agent `agent` and decodes the result.
    pub async fn request<T, R>(&self, agent: &str, command: &str, args: &T) -> Result<R, SdkError>
    where
        T: Serialize + ?Sized,
        R: DeserializeOwned,
    {
        self.call(Call::agent(agent, command).payload(args)?)
            .await?
            .payload_as()
    }

    /// Sends command `command` to agent `agent` and waits for its result.
    pub async fn command<T, R>(&self, agent: &str, command: &str, args: &T) -> Result<R, SdkError>
    where
        T: Serialize + ?Sized,
        R: DeserializeOwned,
    {
        self.call(Call::agent(agent, command).command().payload(args)?)
            .await?
            .payload_as()
    }

    /// Requests from whichever agent serves `capability`, and decodes the result.
    pub async fn request_capability<T, R>(&self, capability: &str, args: &T) -> Result<R, SdkError>
    where
        T: Serialize + ?Sized,
        R: DeserializeOwned,
    {
        self.call(Call::capability(capability).payload(args)?)
            .await?
            .payload_as()
    }

    /// Asks the coordinator which agents match `query`: live agents only, least loaded first.
    pub async fn discover(&self, query: &DiscoverQuery) -> Result<Vec<AgentRecord>, SdkError> {
        let mut env = Envelope::new(
            Kind::Request,
            Performative::Discover,
            self.inner.id.as_str(),
        );
        env.content_type = CONTENT_TYPE_MSGPACK.to_owned();
        env.payload = encode_payload(query, CONTENT_TYPE_MSGPACK)?;
        let subject = self.inner.subjects.discover();
        let reply = self
            .inner
            .exchange(
                &subject,
                env,
                self.inner.request_timeout,
                &opentelemetry::Context::current(),
            )
            .await?;
        reply.payload_as()
    }

    /// Agents offering `capability`, least loaded first.
    pub async fn discover_capability(
        &self,
        capability: &str,
    ) -> Result<Vec<AgentRecord>, SdkError> {
        self.discover(&DiscoverQuery::capability(capability)).await
    }

    /// Sends command `command` to every live agent in `target` through the coordinator and
    /// returns its report: per recipient, delivered, failed (with the code) or timed out.
    /// `timeout` is how long each recipient has to answer.
    pub async fn broadcast<T: Serialize + ?Sized>(
        &self,
        target: &BroadcastTarget,
        command: &str,
        args: &T,
        timeout: Duration,
    ) -> Result<BroadcastReport, SdkError> {
        validate_token("command name", command)?;
        let subject = self.inner.subjects.broadcast(target)?;
        let mut env = Envelope::new(Kind::Command, Performative::Request, self.inner.id.as_str());
        env.name = Some(command.to_owned());
        env.content_type = CONTENT_TYPE_MSGPACK.to_owned();
        env.payload = encode_payload(args, CONTENT_TYPE_MSGPACK)?;
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        env.expect = Some(ExpectedReply {
            performative: Performative::Inform,
            timeout_ms,
        });
        // The coordinator needs the recipients' time plus its own fan-out and report.
        let overall = timeout + Duration::from_secs(5);
        let reply = self
            .inner
            .exchange(&subject, env, overall, &opentelemetry::Context::current())
            .await?;
        reply.payload_as()
    }

    /// Requires `permissions` of senders of command or capability `name` (registered before):
    /// a request from a sender not granted all of them is refused with 5007 and a reason
    /// naming what is missing.
    pub fn require(&self, name: &str, permissions: &[&str]) -> Result<(), SdkError> {
        let endpoints = self.inner.endpoints();
        let endpoint = endpoints.iter().find(|e| e.name == name).ok_or_else(|| {
            SdkError::Subject(crate::subject::SubjectError::new(
                "command or capability",
                name,
                "no handler is registered under this name",
            ))
        })?;
        *write(&endpoint.required) = permissions.iter().map(|p| (*p).to_owned()).collect();
        Ok(())
    }

    /// Grants `agent` more permissions at run time.
    pub fn grant(&self, agent: &str, permissions: &[&str]) {
        write(&self.inner.grants)
            .entry(agent.to_owned())
            .or_default()
            .extend(permissions.iter().map(|p| (*p).to_owned()));
    }

    /// Overrides the load and availability announced in heartbeats (by default the load is
    /// the share of `max_in_flight` in use).
    pub fn set_load(&self, load: f32, availability: Availability) {
        *lock(&self.inner.load_override) = Some((load.clamp(0.0, 1.0), availability));
        self.inner.presence_changed.notify_one();
    }

    /// The agent's current capability manifest.
    pub fn manifest(&self) -> crate::registry::Manifest {
        self.inner.manifest()
    }

    /// Stops taking new messages, lets in-flight handlers finish (up to the shutdown
    /// timeout), sends their replies, and drains the connection.
    pub async fn shutdown(&self) -> ShutdownReport {
        let inner = &self.inner;
        tracing::info!(agent = %inner.id, "agent shutting down");
        inner.stop.cancel();
        inner.tracker.close();
        let completed = tokio::time::timeout(inner.shutdown_timeout, inner.tracker.wait())
            .await
            .is_ok();
        let abandoned = inner.tracker.len();
        if !completed {
            tracing::warn!(agent = %inner.id, abandoned, "handlers still running at the shutdown deadline");
        }
        if let Err(err) = inner.broker.flush().await {
            tracing::debug!(agent = %inner.id, error = %err, "flush at shutdown failed");
        }
        if let Err(err) = inner.broker.drain().await {
            tracing::debug!(agent = %inner.id, error = %err, "drain at shutdown failed");
        }
        if let Some(events) = inner.events_broker.get()
            && let Err(err) = events.drain().await
        {
            tracing::debug!(agent = %inner.id, error = %err, "events connection drain failed");
        }
        ShutdownReport {
            completed,
            abandoned,
        }
    }
}

impl Inner {
    /// Sets what a message inherits from the one being handled, and refuses a forward past
    /// the hop limit or the inherited deadline.
    fn inherit(&self, env: &mut Envelope, parent: Option<&Envelope>) -> Result<(), SdkError> {
        let Some(parent) = parent else {
            env.hop_limit = self.hop_limit;
            return Ok(());
        };
        env.correlation_id = Some(parent.conversation());
        env.hop_limit = parent.hop_limit.min(self.hop_limit);
        env.hops = parent.hops.saturating_add(1);
        if env.hops > env.hop_limit {
            AgentCounters::bump(&self.counters.loop_refused);
            return Err(SdkError::LoopDetected {
                hops: env.hops,
                limit: env.hop_limit,
            });
        }
        if parent.is_expired() {
            AgentCounters::bump(&self.counters.expired);
            return Err(SdkError::Expired);
        }
        env.deadline_ms = parent.expires_at_ms();
        env.trace = parent.trace.clone();
        env.session_id = parent.session_id.clone();
        env.customer_id = parent.customer_id.clone();
        Ok(())
    }

    /// Builds the envelope of a call and the subject it goes to.
    pub(crate) fn prepare(
        &self,
        call: Call,
        parent: Option<&Envelope>,
    ) -> Result<(String, Envelope, Duration), SdkError> {
        let mut env = Envelope::new(call.kind, Performative::Request, self.id.as_str());
        let subject = match call.target {
            Target::Agent(agent) => {
                let name = call.name.as_deref().unwrap_or_default();
                let subject = self.subjects.command(&agent, name)?;
                env.to = vec![agent];
                subject
            }
            Target::Capability(capability) => {
                let subject = self.subjects.capability(&capability)?;
                env.capability = Some(capability);
                subject
            }
        };
        env.name = call.name;
        self.inherit(&mut env, parent)?;
        let mut timeout = call.timeout.unwrap_or(self.request_timeout);
        if let Some(left) = env.remaining_at(now_ms()) {
            timeout = timeout.min(left);
        }
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        env.ttl_ms = Some(timeout_ms);
        env.expect = Some(ExpectedReply {
            performative: Performative::Inform,
            timeout_ms,
        });
        env.priority = call.priority;
        env.headers = call.headers;
        env.content_type = call.content_type;
        env.payload = call.payload;
        env.delivery = call.delivery.unwrap_or_default();
        if let Some(id) = call.id {
            env.id = id;
        }
        if !call.encrypt_for.is_empty() {
            let keys = read(&self.encryption_keys);
            let recipients = call
                .encrypt_for
                .iter()
                .map(|agent| {
                    keys.get(agent)
                        .map(|k| (agent.clone(), k.clone()))
                        .ok_or_else(|| {
                            SdkError::Encryption(format!("no encryption key is known for {agent}"))
                        })
                })
                .collect::<Result<Vec<_>, _>>()?;
            drop(keys);
            crate::encryption::encrypt(&mut env, &recipients).map_err(SdkError::Encryption)?;
        }
        Ok((subject, env, timeout))
    }

    pub(crate) async fn call(
        &self,
        call: Call,
        parent: Option<Parent<'_>>,
    ) -> Result<Reply, SdkError> {
        let (subject, env, timeout) = self.prepare(call, parent.map(|p| p.env))?;
        let otel = parent.map_or_else(opentelemetry::Context::current, |p| p.otel.clone());
        self.exchange(&subject, env, timeout, &otel).await
    }

    /// Sends `env` as a request on `subject` and waits up to `timeout` for the reply.
    pub(crate) async fn exchange(
        &self,
        subject: &str,
        mut env: Envelope,
        timeout: Duration,
        parent: &opentelemetry::Context,
    ) -> Result<Reply, SdkError> {
        let (span, trace) = crate::trace::start(
            opentelemetry::trace::SpanKind::Client,
            parent,
            env.trace.as_ref(),
            || {
                format!(
                    "chorus.request {}",
                    env.name
                        .as_deref()
                        .or(env.capability.as_deref())
                        .unwrap_or(subject)
                )
            },
            || crate::trace::attributes(&self.id, &env),
        );
        env.trace = Some(trace);
        self.seal(subject, &mut env);
        let bytes = codec::encode(&env, self.encoding)?;
        AgentCounters::bump(&self.counters.requests_sent);
        let started = std::time::Instant::now();
        let result = self.request_reply(subject, bytes, timeout).await;
        let status = match &result {
            Ok(reply) => reply.status(),
            Err(err) => err.status(),
        };
        sdk_metrics()
            .request_seconds
            .with_label_values(&[self.id.as_str(), status.label()])
            .observe(started.elapsed().as_secs_f64());
        crate::trace::finish(span.as_ref(), result.as_ref().err().map(|e| e.to_string()));
        result
    }

    async fn request_reply(
        &self,
        subject: &str,
        bytes: bytes::Bytes,
        timeout: Duration,
    ) -> Result<Reply, SdkError> {
        let msg = self
            .broker
            .request(subject, None, bytes, timeout)
            .await
            .map_err(|e| match e.kind() {
                ErrorKind::TimedOut => SdkError::Timeout(timeout),
                ErrorKind::NoResponders => SdkError::NoResponders(subject.to_owned()),
                _ => SdkError::Broker(e),
            })?;
        let (reply, _) = codec::decode_limited(msg.payload(), self.max_message_bytes)?;
        match reply.status {
            Some(status) if !status.is_success() => Err(SdkError::Remote {
                status,
                reason: reply.reason.unwrap_or_default(),
            }),
            _ => Ok(Reply { envelope: reply }),
        }
    }

    pub(crate) async fn publish<T: Serialize + ?Sized>(
        &self,
        topic: &str,
        value: &T,
        parent: Option<Parent<'_>>,
    ) -> Result<(), SdkError> {
        let subject = self.subjects.event(topic)?;
        let content_type = self.encoding.content_type();
        let mut env = Envelope::new_typed(
            Kind::Event,
            Performative::Inform,
            self.id.as_str(),
            content_type.to_owned(),
        );
        env.topic = Some(topic.to_owned());
        self.inherit(&mut env, parent.map(|p| p.env))?;
        env.payload = encode_payload(value, content_type)?;
        let otel = parent.map_or_else(opentelemetry::Context::current, |p| p.otel.clone());
        self.publish_envelope(subject, env, &otel).await
    }

    /// Publishes an event envelope under a producer span.
    pub(crate) async fn publish_envelope(
        &self,
        subject: String,
        mut env: Envelope,
        parent: &opentelemetry::Context,
    ) -> Result<(), SdkError> {
        let (span, trace) = crate::trace::start(
            opentelemetry::trace::SpanKind::Producer,
            parent,
            env.trace.as_ref(),
            || {
                format!(
                    "chorus.publish {}",
                    env.topic.as_deref().unwrap_or(&subject)
                )
            },
            || crate::trace::attributes(&self.id, &env),
        );
        env.trace = Some(trace);
        self.seal(&subject, &mut env);
        let bytes = codec::encode(&env, self.encoding)?;
        let sent = self.broker.publish_owned(subject, bytes).await;
        crate::trace::finish(span.as_ref(), sent.as_ref().err().map(|e| e.to_string()));
        sent?;
        AgentCounters::bump(&self.counters.events_published);
        Ok(())
    }

    /// Decodes and checks an inbound message: size, encoding, version, expiry, hop limit.
    fn admit(&self, msg: &Message) -> Result<(Envelope, Encoding), Refusal> {
        let (env, encoding) =
            codec::decode_limited(msg.payload(), self.max_message_bytes).map_err(|err| {
                AgentCounters::bump(&self.counters.bad_input);
                tracing::debug!(agent = %self.id, subject = msg.subject(), error = %err, "bad input refused");
                Refusal {
                    status: StatusCode::DATA_FORMAT,
                    reason: err.to_string(),
                    request: None,
                    encoding: self.encoding,
                }
            })?;
        let limit = env.hop_limit.min(self.hop_limit);
        let refusal = if env.kind == Kind::Unknown {
            Some((
                StatusCode::DATA_FORMAT,
                "unsupported message kind".to_owned(),
                &self.counters.bad_input,
            ))
        } else if env.is_expired() {
            Some((
                StatusCode::EXPIRED,
                "the message's TTL or deadline passed before it was handled".to_owned(),
                &self.counters.expired,
            ))
        } else if env.hops > limit {
            Some((
                StatusCode::LOOP_DETECTED,
                format!("hop {} is past the limit of {limit}", env.hops),
                &self.counters.loop_refused,
            ))
        } else {
            None
        };
        if let Some((status, reason, counter)) = refusal {
            AgentCounters::bump(counter);
            tracing::debug!(agent = %self.id, id = %env.id, correlation = %env.conversation(), %status, %reason, "message refused");
            return Err(Refusal {
                status,
                reason,
                request: Some(Box::new(env)),
                encoding,
            });
        }
        Ok((env, encoding))
    }

    /// One reader per subscription takes messages off it as fast as they come and queues
    /// them (bounded); a dispatcher runs them as handler slots free up. A full queue drops an
    /// event (counted) or answers a request with 5019 at once, so a burst never grows memory
    /// and never goes unreported.
    fn spawn_reader(this: &Arc<Inner>, mut sub: Subscription, route: Route) {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Message>(this.queue_capacity);
        let inner = Arc::clone(this);
        let reader_route = route.clone();
        this.tracker.spawn(async move {
            while let Some(msg) = sub.next_until(inner.stop.cancelled()).await {
                // The common case, nothing queued and a slot free: start the handler here,
                // saving the hop through the queue and the dispatcher. Otherwise queue it
                // behind the others, in order.
                if tx.capacity() == tx.max_capacity()
                    && let Ok(permit) = Arc::clone(&inner.in_flight).try_acquire_owned()
                {
                    let task_inner = Arc::clone(&inner);
                    let route = reader_route.clone();
                    inner.tracker.spawn(async move {
                        Inner::process(task_inner, msg, route).await;
                        drop(permit);
                    });
                    continue;
                }
                match tx.try_send(msg) {
                    Ok(()) => {}
                    Err(tokio::sync::mpsc::error::TrySendError::Full(msg)) => {
                        inner.overflow(msg, &reader_route).await;
                    }
                    Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => break,
                }
            }
        });
        let inner = Arc::clone(this);
        this.tracker.spawn(async move {
            while let Some(msg) = rx.recv().await {
                let Ok(permit) = Arc::clone(&inner.in_flight).acquire_owned().await else {
                    break;
                };
                let task_inner = Arc::clone(&inner);
                let route = route.clone();
                inner.tracker.spawn(async move {
                    Inner::process(task_inner, msg, route).await;
                    drop(permit);
                });
            }
        });
    }

    /// A message that found its queue full.
    async fn overflow(&self, msg: Message, route: &Route) {
        match (route, msg.reply()) {
            (Route::Event(_), _) | (_, None) => self.count_drop(msg.subject()),
            (_, Some(reply_to)) => {
                let n = self
                    .counters
                    .shed
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    + 1;
                if n.is_power_of_two() {
                    tracing::warn!(agent = %self.id, shed_total = n, "overloaded: requests refused with 5019");
                }
                let refusal = Refusal {
                    status: StatusCode::UNAVAILABLE,
                    reason: "overloaded: the agent's queue is full".to_owned(),
                    request: None,
                    encoding: self.encoding,
                };
                self.send_refusal(reply_to, refusal).await;
            }
        }
    }

    async fn events_connection(&self) -> Result<&Broker, SdkError> {
        let events = self
            .events_broker
            .get_or_try_init(|| {
                self.broker_options
                    .clone()
                    .name(format!("{}-events", self.id))
                    .connect()
            })
            .await?;
        Ok(events)
    }

    /// Whether the sender of `env` may be served by `endpoint`: its permissions, then its rate.
    pub(crate) fn authorize(
        &self,
        endpoint: &Endpoint,
        env: &Envelope,
    ) -> Result<(), (StatusCode, String)> {
        let required = read(&endpoint.required);
        if !required.is_empty() {
            let grants = read(&self.grants);
            let held = grants.get(&env.from);
            let missing: Vec<&str> = required
                .iter()
                .filter(|p| !held.is_some_and(|h| h.contains(*p)))
                .map(String::as_str)
                .collect();
            if !missing.is_empty() {
                AgentCounters::bump(&self.counters.access_refused);
                return Err((
                    StatusCode::ACCESS,
                    format!(
                        "{} lacks permission {} for {}",
                        env.from,
                        missing.join(", "),
                        endpoint.name
                    ),
                ));
            }
        }
        if let Some(limit) = self.rate_limit {
            let now = std::time::Instant::now();
            let mut buckets = lock(&self.buckets);
            let (tokens, last) = buckets
                .entry(env.from.clone())
                .or_insert((limit.burst, now));
            *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * limit.per_second)
                .min(limit.burst);
            *last = now;
            if *tokens < 1.0 {
                AgentCounters::bump(&self.counters.rate_limited);
                return Err((
                    StatusCode::RATE_LIMITED,
                    format!(
                        "{} exceeds {} requests a second",
                        env.from, limit.per_second
                    ),
                ));
            }
            *tokens -= 1.0;
        }
        Ok(())
    }

    /// Signs `env` for `subject` when the agent has an identity.
    pub(crate) fn seal(&self, subject: &str, env: &mut Envelope) {
        if let Some(identity) = &self.identity {
            identity.sign(subject, env);
        }
    }

    /// Checks `env`'s signature, timestamp and id when the agent verifies signatures.
    pub(crate) fn verify(
        &self,
        subject: &str,
        env: &Envelope,
    ) -> Result<(), crate::security::Refused> {
        if self.verifier.is_none() {
            // Every handled message passes here: no allocation when there is nothing to check.
            return Ok(());
        }
        self.verify_batch(&[(subject, env)]).pop().unwrap_or(Ok(()))
    }

    /// [`Inner::verify`] for several received messages at once, signatures checked as a batch.
    fn verify_batch(
        &self,
        items: &[(&str, &Envelope)],
    ) -> Vec<Result<(), crate::security::Refused>> {
        let Some(verifier) = &self.verifier else {
            return items.iter().map(|_| Ok(())).collect();
        };
        let results = verifier.verify_batch(items, now_ms());
        for ((_, env), result) in items.iter().zip(&results) {
            if let Err((status, reason)) = result {
                AgentCounters::bump(&self.counters.security_refused);
                tracing::warn!(agent = %self.id, from = %env.from, id = %env.id, %status, %reason, "message refused by signature check");
            }
        }
        results
    }

    /// Keeps the verifier's keys in step with the public keys agents announce in the registry.
    async fn watch_registered_keys(self: Arc<Self>) {
        let bucket = self.subjects.bucket_name("registry");
        let Ok(kv) = self.js.open_kv(&bucket).await else {
            tracing::debug!(agent = %self.id, "no registry bucket: only explicitly trusted keys are known");
            return;
        };
        let Ok(mut watch) = kv.watch().await else {
            return;
        };
        loop {
            let change = tokio::select! {
                change = watch.next() => change,
                _ = self.stop.cancelled() => break,
            };
            let Some(Ok(entry)) = change else { break };
            match entry.op {
                broker_adapter::KvOp::Put => {
                    let Ok(record) = serde_json::from_slice::<AgentRecord>(&entry.value) else {
                        continue;
                    };
                    if let (Some(verifier), Some(key)) =
                        (&self.verifier, record.manifest.public_key)
                    {
                        verifier.trust(&entry.key, &key);
                    }
                    if let Some(key) = record.manifest.encryption_key {
                        write(&self.encryption_keys).insert(entry.key.clone(), key);
                    }
                }
                broker_adapter::KvOp::Delete => {
                    if let Some(verifier) = &self.verifier {
                        verifier.forget(&entry.key);
                    }
                }
            }
        }
    }

    pub(crate) fn count_drop(&self, subject: &str) {
        let n = self
            .counters
            .dropped
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if n.is_power_of_two() {
            tracing::warn!(agent = %self.id, subject, dropped_total = n, "slow subscriber: messages dropped on a full queue");
        }
    }

    async fn process(this: Arc<Inner>, msg: Message, route: Route) {
        if let Route::Service = route {
            this.answer_service(&msg).await;
            return;
        }
        AgentCounters::bump(&this.counters.received);
        let (env, encoding) = match this.admit(&msg) {
            Ok(admitted) => admitted,
            Err(refusal) => {
                let kind = refusal.request.as_ref().map_or(Kind::Unknown, |r| r.kind);
                this.record_handled(kind, refusal.status);
                if let Some(reply_to) = msg.reply() {
                    this.send_refusal(reply_to, refusal).await;
                }
                return;
            }
        };
        let mut env = env;
        // The signature covers the payload as sent (ciphertext): check it, then decrypt.
        let verified = this.verify(msg.subject(), &env).and_then(|()| {
            match (&env.encryption, &this.decryption) {
                (None, _) => Ok(()),
                (Some(_), Some(key)) => key.decrypt(&this.id, &mut env),
                (Some(_), None) => Err((
                    StatusCode::ACCESS,
                    "this agent has no decryption key".to_owned(),
                )),
            }
        });
        if let Err((status, reason)) = verified {
            this.record_handled(env.kind, status);
            if let Some(reply_to) = msg.reply() {
                let refusal = Refusal {
                    status,
                    reason,
                    request: Some(Box::new(env)),
                    encoding,
                };
                this.send_refusal(reply_to, refusal).await;
            }
            return;
        }
        let handler = match route {
            Route::Event(handler) => {
                let otel = crate::trace::handle(
                    opentelemetry::trace::SpanKind::Consumer,
                    &env,
                    || format!("chorus.handle {}", env.topic.as_deref().unwrap_or_default()),
                    || crate::trace::attributes(&this.id, &env),
                );
                let ctx = Context {
                    inner: Arc::clone(&this),
                    request: Arc::new(env),
                    otel: otel.clone(),
                };
                let result = handler.call(ctx).await;
                crate::trace::finish(Some(&otel), result.as_ref().err().map(|e| e.to_string()));
                match result {
                    Ok(()) => {
                        AgentCounters::bump(&this.counters.handled_ok);
                        this.record_handled(Kind::Event, StatusCode::OK);
                    }
                    Err(err) => {
                        AgentCounters::bump(&this.counters.handler_errors);
                        this.record_handled(Kind::Event, err.status);
                        tracing::warn!(agent = %this.id, subject = msg.subject(), error = %err, "event handler failed");
                    }
                }
                return;
            }
            Route::Service => return,
            Route::Capability(endpoint) => Some(endpoint),
            Route::Commands => this
                .subjects
                .command_name(msg.subject())
                .and_then(|name| read(&this.commands).get(name).cloned()),
        };
        let request = Arc::new(env);
        let exactly_once = request.delivery == DeliveryClass::ExactlyOnce;
        if exactly_once {
            match this.seen(&request).await {
                Ok(Some(record)) => {
                    // A copy of a request already answered: the same reply again, no rerun.
                    AgentCounters::bump(&this.counters.duplicates_suppressed);
                    if let Some(reply_to) = msg.reply() {
                        let result = if record.status.is_success() {
                            Ok(Output {
                                payload: record.payload,
                                content_type: record.content_type,
                            })
                        } else {
                            Err(HandlerError::new(record.status, "failed before"))
                        };
                        this.send_reply(reply_to, &request, encoding, result).await;
                    }
                    return;
                }
                Ok(None) => {}
                Err(err) => {
                    tracing::warn!(agent = %this.id, error = %err, "idempotency record unavailable");
                    if let Some(reply_to) = msg.reply() {
                        let e = HandlerError::new(
                            StatusCode::UNAVAILABLE,
                            "idempotency record unavailable; retry",
                        );
                        this.send_reply(reply_to, &request, encoding, Err(e)).await;
                    }
                    return;
                }
            }
        }
        let denied = handler
            .as_ref()
            .and_then(|endpoint| this.authorize(endpoint, &request).err());
        let result = match (handler, denied) {
            (Some(_), Some((status, reason))) => Err(HandlerError::new(status, reason)),
            (Some(endpoint), None) => {
                let otel = crate::trace::handle(
                    opentelemetry::trace::SpanKind::Server,
                    &request,
                    || format!("chorus.handle {}", endpoint.name),
                    || crate::trace::attributes(&this.id, &request),
                );
                let ctx = Context {
                    inner: Arc::clone(&this),
                    request: Arc::clone(&request),
                    otel: otel.clone(),
                };
                let started = std::time::Instant::now();
                let span = tracing::info_span!(
                    "chorus.handle",
                    agent = %this.id,
                    command = %endpoint.name,
                    message_id = %request.id,
                    correlation_id = %request.conversation(),
                );
                let result =
                    tracing::Instrument::instrument(endpoint.handler.call(ctx), span).await;
                crate::trace::finish(Some(&otel), result.as_ref().err().map(|e| e.to_string()));
                endpoint.record(
                    started.elapsed(),
                    result.as_ref().err().map(|e| e.reason.as_str()),
                );
                result
            }
            (None, _) => {
                AgentCounters::bump(&this.counters.unknown_command);
                Err(HandlerError::new(
                    StatusCode::UNKNOWN_COMMAND,
                    format!("agent {} has no handler for {}", this.id, msg.subject()),
                ))
            }
        };
        this.record_handled(
            request.kind,
            result
                .as_ref()
                .map_or_else(|e| e.status, |_| StatusCode::OK),
        );
        match &result {
            Ok(output) => {
                AgentCounters::bump(&this.counters.handled_ok);
                if exactly_once {
                    this.remember(&request, StatusCode::OK, output).await;
                }
            }
            Err(err) if err.status != StatusCode::UNKNOWN_COMMAND => {
                AgentCounters::bump(&this.counters.handler_errors);
                tracing::debug!(agent = %this.id, id = %request.id, correlation = %request.conversation(), error = %err, "handler returned an error");
            }
            Err(_) => {}
        }
        if let Some(reply_to) = msg.reply() {
            this.send_reply(reply_to, &request, encoding, result).await;
        }
    }

    pub(crate) fn record_handled(&self, kind: Kind, status: StatusCode) {
        sdk_metrics()
            .handled
            .with_label_values(&[self.id.as_str(), kind.as_str(), status.label()])
            .inc();
    }

    pub(crate) fn endpoints(&self) -> Vec<Arc<Endpoint>> {
        lock(&self.endpoints).clone()
    }

    pub(crate) fn load_and_availability(&self) -> (f32, Availability) {
        if let Some(set) = *lock(&self.load_override) {
            return set;
        }
        let busy = self.max_in_flight - self.in_flight.available_permits();
        let load = busy as f32 / self.max_in_flight as f32;
        let availability = if self.stop.is_cancelled() {
            Availability::Away
        } else if load >= 1.0 {
            Availability::Busy
        } else {
            Availability::Available
        };
        (load, availability)
    }

    /// Reads the retry policies the coordinator published; keeps the defaults if none.
    async fn load_retry_policies(&self) {
        let bucket = self.subjects.bucket_name(durable::CONFIG_BUCKET);
        let policies = match self.js.open_kv(&bucket).await {
            Ok(kv) => match kv.get(durable::RETRY_KEY).await {
                Ok(Some(entry)) => serde_json::from_slice::<RetryPolicies>(&entry.value)
                    .map_err(|e| e.to_string())
                    .and_then(|p| p.validate().map(|()| p)),
                Ok(None) => return,
                Err(e) => Err(e.to_string()),
            },
            Err(_) => return,
        };
        match policies {
            Ok(p) => *write(&self.retry_policies) = p,
            Err(err) => {
                tracing::warn!(agent = %self.id, error = %err, "published retry policies unusable; using defaults");
            }
        }
    }

    async fn send_refusal(&self, reply_to: &str, refusal: Refusal) {
        let encoding = refusal.encoding;
        let request = match refusal.request {
            Some(request) => *request,
            None => {
                let mut env = Envelope::new(Kind::Response, Performative::Refuse, "");
                env.content_type = encoding.content_type().to_owned();
                env
            }
        };
        let err = HandlerError::new(refusal.status, refusal.reason);
        self.send_reply(reply_to, &request, encoding, Err(err))
            .await;
    }

    async fn send_reply(
        &self,
        reply_to: &str,
        request: &Envelope,
        encoding: Encoding,
        result: Result<Output, HandlerError>,
    ) {
        let mut reply = match result {
            Ok(out) => {
                let mut reply = request.reply(self.id.as_str(), StatusCode::OK);
                reply.payload = out.payload;
                reply.content_type = out.content_type;
                reply
            }
            Err(err) => {
                let mut reply = request.reply(self.id.as_str(), err.status);
                reply.reason = Some(err.reason);
                reply
            }
        };
        if request.from.is_empty() {
            // A refusal of bytes that never decoded: there is no sender to name.
            reply.to.clear();
            reply.in_reply_to = None;
            reply.correlation_id = None;
        }
        let mut result = self.publish_reply(reply_to, &reply, encoding).await;
        if let Err(err) = &result
            && err.kind() == ErrorKind::TooLarge
        {
            // Tell the caller rather than leave it to time out.
            let mut refusal = request.reply(self.id.as_str(), StatusCode::DATA_FORMAT);
            refusal.reason = Some("the reply is larger than the server's max_payload".into());
            result = self.publish_reply(reply_to, &refusal, encoding).await;
        }
        match result {
            Ok(()) => AgentCounters::bump(&self.counters.replies_sent),
            Err(err) => {
                AgentCounters::bump(&self.counters.reply_failures);
                tracing::warn!(agent = %self.id, error = %err, "reply not sent");
            }
        }
    }

    async fn publish_reply(
        &self,
        reply_to: &str,
        reply: &Envelope,
        encoding: Encoding,
    ) -> Result<(), broker_adapter::Error> {
        let mut sealed;
        let reply = if self.identity.is_some() {
            sealed = reply.clone();
            self.seal(reply_to, &mut sealed);
            &sealed
        } else {
            reply
        };
        let bytes = codec::encode(reply, encoding).map_err(|e| {
            broker_adapter::Error::with_source(ErrorKind::InvalidInput, "reply does not encode", e)
        })?;
        self.broker.publish(reply_to, bytes).await
    }
}

/// An event received by an [`EventStream`].
#[derive(Debug, Clone)]
pub struct Event {
    /// The event's envelope.
    pub envelope: Envelope,
}

impl Event {
    /// The topic it was published on.
    pub fn topic(&self) -> &str {
        self.envelope.topic.as_deref().unwrap_or_default()
    }

    /// The payload decoded by its content type.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, CodecError> {
        decode_payload(&self.envelope.payload, &self.envelope.content_type)
    }
}

/// A stream of events from [`Agent::subscribe`], read straight off its subscription. Events
/// wait in the subscription's bounded buffer (64k by default); when the reader of the stream
/// falls that far behind, new events are dropped by the client and counted exactly in
/// [`AgentStats::dropped`]. Messages that are not valid events, or have expired or looped, are
/// counted and skipped. When the agent verifies signatures, the events already waiting (up to
/// 64) are verified together, which costs about half as much per signature as one by one.
pub struct EventStream {
    sub: Subscription,
    inner: Arc<Inner>,
    /// Checked events not yet handed out.
    ready: std::collections::VecDeque<Event>,
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventStream")
    }
}

impl EventStream {
    /// The next message off the subscription that passes [`Inner::admit`], counting each
    /// received and skipping the refused.
    fn poll_admitted(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<(Message, Envelope)>> {
        loop {
            match Pin::new(&mut self.sub).poll_next(cx) {
                Poll::Ready(Some(msg)) => {
                    AgentCounters::bump(&self.inner.counters.received);
                    if let Ok((envelope, _)) = self.inner.admit(&msg) {
                        return Poll::Ready(Some((msg, envelope)));
                    }
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// Most events an [`EventStream`] takes off its subscription at once, so that their
/// signatures are checked together.
const VERIFY_BATCH: usize = 64;

impl Stream for EventStream {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Option<Event>> {
        let this = &mut *self;
        if this.inner.verifier.is_none() {
            // Nothing to batch: each event is handed out as it is admitted.
            return this
                .poll_admitted(cx)
                .map(|next| next.map(|(_, envelope)| Event { envelope }));
        }
        loop {
            if let Some(event) = this.ready.pop_front() {
                return Poll::Ready(Some(event));
            }
            // Take what has already arrived, never waiting for more: a burst is checked as a
            // batch, a lone event alone.
            let mut batch = Vec::new();
            let mut ended = false;
            while batch.len() < VERIFY_BATCH {
                match this.poll_admitted(cx) {
                    Poll::Ready(Some(admitted)) => batch.push(admitted),
                    Poll::Ready(None) => {
                        ended = true;
                        break;
                    }
                    Poll::Pending => break,
                }
            }
            if batch.is_empty() {
                return if ended {
                    Poll::Ready(None)
                } else {
                    Poll::Pending
                };
            }
            let items: Vec<_> = batch.iter().map(|(m, e)| (m.subject(), e)).collect();
            let checked = this.inner.verify_batch(&items);
            for ((_, envelope), result) in batch.into_iter().zip(checked) {
                if result.is_ok() {
                    this.ready.push_back(Event { envelope });
                }
            }
            if ended && this.ready.is_empty() {
                return Poll::Ready(None);
            }
        }
    }
}

impl StatsSource for Inner {
    fn agent_id(&self) -> &str {
        &self.id
    }

    fn agent_stats(&self) -> AgentStats {
        let mut stats = self.counters.snapshot();
        // Events the client dropped before the SDK's queue saw them.
        if let Some(events) = self.events_broker.get() {
            stats.dropped += events.undelivered();
        }
        stats
    }

    fn broker_stats(&self) -> broker_adapter::StatsSnapshot {
        self.broker.stats()
    }

    fn in_flight(&self) -> usize {
        self.max_in_flight - self.in_flight.available_permits()
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(crate) fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}
