//! How to build an agent: [`AgentOptions`], a by-value builder ending in `connect()`, and the
//! defaults it starts from.

use std::sync::Arc;
use std::time::Duration;

use chorus_broker_adapter::BrokerOptions;

use super::Agent;
use crate::durable::inbox::{DEFAULT_ORDERING_LANES, DURABLE_ACK_WAIT, MIN_DURABLE_ACK_WAIT};
use crate::durable::{InboxConsumers, InboxLimits};
use crate::error::SdkError;
use crate::inbound::exactly_once::DEFAULT_IDEMPOTENCY_TTL;
use crate::presence::{DEFAULT_CAPABILITY_VERSION, DEFAULT_HEARTBEAT_INTERVAL};
use crate::protocol::codec::Encoding;
use crate::protocol::envelope::{DEFAULT_HOP_LIMIT, DeliveryClass};
use crate::retry::RetryPolicies;
use crate::security::access::RateLimit;
use crate::security::encryption::EncryptionKey;
use crate::security::{Identity, SignaturePolicy};

/// Default time a request waits for its reply.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Default number of messages an agent handles at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;
/// Default size limit of an inbound message (NATS's default `max_payload`).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1024 * 1024;
pub use crate::durable::JETSTREAM_TIMEOUT;
/// Default bound of the core message queue per subscription.
pub const DEFAULT_QUEUE_CAPACITY: usize = 4096;
/// Default time [`Agent::shutdown`] waits for in-flight handlers.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// How to build an [`Agent`].
///
/// ```no_run
/// # async fn run() -> Result<(), chorus_sdk::SdkError> {
/// let agent = chorus_sdk::AgentOptions::new("calculator")
///     .servers(["nats://127.0.0.1:4222"])
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub(crate) id: String,
    pub(crate) capabilities: Vec<String>,
    pub(crate) broker: BrokerOptions,
    pub(crate) root: String,
    pub(crate) encoding: Option<Encoding>,
    pub(crate) hop_limit: u8,
    pub(crate) request_timeout: Duration,
    pub(crate) max_in_flight: usize,
    pub(crate) max_message_bytes: usize,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) groups: Vec<String>,
    pub(crate) customer: Option<String>,
    pub(crate) batching: super::batch::Batching,
    pub(crate) capability_version: String,
    /// Per capability: the models behind it and its throughput (IACP), announced.
    pub(crate) capability_details: Vec<(String, Vec<String>, Option<f64>)>,
    pub(crate) capability_max_tokens: Vec<(String, u64)>,
    pub(crate) routing: crate::outbound::Routing,
    pub(crate) routing_refresh: Duration,
    pub(crate) breaker: Option<crate::outbound::BreakerPolicy>,
    pub(crate) payload_limits: crate::payload::PayloadLimits,
    pub(crate) heartbeat_interval: Duration,
    pub(crate) usage_interval: Duration,
    /// A connection shared with other agents of this process, instead of one of its own.
    pub(crate) connection: Option<chorus_broker_adapter::Broker>,
    pub(crate) service_discovery: bool,
    pub(crate) durable_inbox: bool,
    pub(crate) inbox_limits: InboxLimits,
    pub(crate) inbox_consumers: InboxConsumers,
    pub(crate) retry_policies: Option<RetryPolicies>,
    pub(crate) durable_ack_wait: Duration,
    pub(crate) default_delivery: DeliveryClass,
    pub(crate) idempotency_ttl: Duration,
    pub(crate) ordering_lanes: usize,
    pub(crate) queue_capacity: usize,
    pub(crate) identity: Option<Arc<Identity>>,
    pub(crate) signature_policy: Option<SignaturePolicy>,
    pub(crate) token: Option<crate::inbound::layers::TokenCheck>,
    pub(crate) trusted: Vec<(String, String)>,
    pub(crate) grants: Vec<(String, Vec<String>)>,
    pub(crate) trust_unverified_senders: bool,
    pub(crate) persist_seen_ids: bool,
    pub(crate) rate_limit: Option<RateLimit>,
    pub(crate) decryption: Option<Arc<EncryptionKey>>,
    pub(crate) encryption_trust: Vec<(String, String)>,
    pub(crate) rekey: crate::security::encryption::Rekey,
    pub(crate) metrics_url: Option<String>,
    #[cfg(feature = "fault-injection")]
    pub(crate) skip_acks: u64,
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
            encoding: None,
            hop_limit: DEFAULT_HOP_LIMIT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            groups: Vec::new(),
            customer: None,
            batching: super::batch::Batching::default(),
            capability_version: DEFAULT_CAPABILITY_VERSION.to_owned(),
            capability_details: Vec::new(),
            capability_max_tokens: Vec::new(),
            routing: crate::outbound::Routing::QueueGroup,
            routing_refresh: crate::outbound::DEFAULT_ROUTING_REFRESH,
            breaker: None,
            payload_limits: crate::payload::PayloadLimits::default(),
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            usage_interval: crate::usage::DEFAULT_USAGE_INTERVAL,
            connection: None,
            service_discovery: true,
            durable_inbox: false,
            inbox_limits: InboxLimits::default(),
            inbox_consumers: InboxConsumers::default(),
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
            trust_unverified_senders: false,
            persist_seen_ids: false,
            rate_limit: None,
            decryption: None,
            token: None,
            encryption_trust: Vec::new(),
            rekey: crate::security::encryption::Rekey::default(),
            metrics_url: None,
            #[cfg(feature = "fault-injection")]
            skip_acks: 0,
        }
    }

    /// Requires a token of every command and request (the envelope's `token`, which a gateway
    /// fills with the edge caller's bearer JWT): `check` gets the token and the message and
    /// says whether it is good; a message without one, or with one it refuses, is answered
    /// 5014 before the handler runs. Events are not checked.
    pub fn require_token(
        mut self,
        check: impl Fn(&str, &crate::Envelope) -> Result<(), crate::Rejection> + Send + Sync + 'static,
    ) -> Self {
        self.token = Some(crate::inbound::layers::TokenCheck::new(check));
        self
    }

    /// The agent's decryption key: payloads encrypted for it are opened before its handlers
    /// see them, and its public half is announced in the manifest.
    pub fn encryption_key(mut self, key: EncryptionKey) -> Self {
        self.decryption = Some(Arc::new(key));
        self
    }

    /// Registers `agent`'s public encryption key, for [`Call::encrypt_for`](crate::Call::encrypt_for), in addition to
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

    /// When this agent begins a new encryption session with a recipient (docs/PROTOCOL.md
    /// section 4.2): after `rekey.messages` messages to it or `rekey.age`, whichever comes
    /// first. The default is 100,000 messages or 10 minutes.
    pub fn encryption_rekey(mut self, rekey: crate::security::encryption::Rekey) -> Self {
        self.rekey = rekey;
        self
    }

    /// Grants `agent` permissions (strings the application chooses, such as
    /// `payments:write`), checked against what handlers require ([`Agent::require`]).
    ///
    /// Grants name the sender by its `from` field, so they apply only to a message whose
    /// signature verified against `agent`'s key: the sender signs
    /// ([`AgentOptions::identity`]) and this agent verifies
    /// ([`AgentOptions::verify_signatures`], with the key from the registry or
    /// [`AgentOptions::trust`]). An unsigned message from a granted sender is refused with 5007
    /// ("not verified") unless [`AgentOptions::trust_unverified_senders`] is on.
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

    /// Lets grants apply to a sender's self-declared `from` when no verified signature proves
    /// it (default off).
    ///
    /// Unsafe unless something else proves who sent a message: with it on, any client that may
    /// publish to this agent's subjects can claim to be a granted agent and get its rights.
    /// Turn it on only where NATS permissions alone confine who can reach this agent (for
    /// example while a fleet moves to signing), and prefer signing and verifying.
    pub fn trust_unverified_senders(mut self, on: bool) -> Self {
        self.trust_unverified_senders = on;
        self
    }

    /// Keeps the ids of verified (signed) commands and requests in a key-value bucket
    /// (`<root>_seen`, entries expiring after the signature tolerance) as well as in memory,
    /// so a restarted agent still refuses a replay with 5015 (default off; needs
    /// [`AgentOptions::verify_signatures`], JetStream, and with per-agent credentials the
    /// `--durable` rights of `chorus creds`). If the bucket cannot be written the message is
    /// refused with 5019 (a durable delivery retries).
    pub fn persist_seen_ids(mut self, on: bool) -> Self {
        self.persist_seen_ids = on;
        self
    }

    /// Limits how many requests and commands each sender may make (refused with 5013 beyond).
    pub fn rate_limit(mut self, limit: RateLimit) -> Self {
        self.rate_limit = Some(limit);
        self
    }

    /// Signs everything the agent sends with `identity` (and announces its public key in the
    /// manifest, so the registry holds it for receivers).
    pub fn identity(mut self, identity: Identity) -> Self {
        self.identity = Some(Arc::new(identity));
        self
    }

    /// Checks signatures on what the agent receives: signed messages must verify against the
    /// sender's registered key (from [`trust`](AgentOptions::trust) or the registry), within
    /// the timestamp tolerance and never twice; unsigned ones are refused if the policy says
    /// so. Off unless set.
    pub fn verify_signatures(mut self, policy: SignaturePolicy) -> Self {
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

    /// The customer this agent is dedicated to (one token; Agentify's per-customer agents, a
    /// hosting manifest's `customer`): its manifest says so, and a discovery for another
    /// customer passes it by. Unset, it serves every customer.
    pub fn customer(mut self, customer: impl Into<String>) -> Self {
        self.customer = Some(customer.into());
        self
    }

    /// The batching [`Agent::default_batcher`](crate::Agent::default_batcher) uses (002's
    /// `flow_control`; `[batching]` in the agent's configuration file); checked when the
    /// batcher is made.
    pub fn batching(mut self, batching: super::batch::Batching) -> Self {
        self.batching = batching;
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

    /// Announces the models behind `capability` and its throughput (IACP's capability
    /// manifest: tokens a second for a model, or whatever unit the capability names), so
    /// callers choosing among its holders can tell them apart.
    pub fn capability_details<I, S>(
        mut self,
        capability: impl Into<String>,
        models: I,
        throughput: Option<f64>,
    ) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let capability = capability.into();
        self.capability_details.retain(|(c, _, _)| *c != capability);
        self.capability_details.push((
            capability,
            models.into_iter().map(Into::into).collect(),
            throughput.filter(|t| t.is_finite() && *t >= 0.0),
        ));
        self
    }

    /// Announces the most tokens one request to `capability` may carry (IACP's
    /// `max_tokens`): a discovery asking for more (`DiscoverQuery::max_tokens`) passes this
    /// agent by. Unsaid, the capability states no limit.
    pub fn capability_max_tokens(mut self, capability: impl Into<String>, tokens: u64) -> Self {
        let capability = capability.into();
        self.capability_max_tokens.retain(|(c, _)| *c != capability);
        self.capability_max_tokens.push((capability, tokens));
        self
    }

    /// How this agent's capability calls pick their agent unless a call says
    /// ([`Call::least_loaded`](crate::Call::least_loaded)): the queue group (default), or the
    /// least-loaded holder by the registry ([`Routing::LeastLoaded`](crate::Routing)).
    pub fn capability_routing(mut self, routing: crate::outbound::Routing) -> Self {
        self.routing = routing;
        self
    }

    /// How long a capability's holders, as discovery returned them, are used for routing by
    /// load before it is asked again (default 1 s).
    pub fn routing_refresh(mut self, refresh: Duration) -> Self {
        self.routing_refresh = refresh;
        self
    }

    /// Circuit breakers on this agent's requests and commands, per destination (an agent, or
    /// a capability's queue group): after `policy.failures` failures in a row (no reply in
    /// time, no responders, 5019, 5017, a disconnect, 5022) calls to it are refused at once
    /// with 5019 for `policy.open_for`, then one call tries it again. Off by default. See
    /// [`BreakerPolicy`](crate::BreakerPolicy).
    pub fn circuit_breaker(mut self, policy: crate::outbound::BreakerPolicy) -> Self {
        self.breaker = Some(policy);
        self
    }

    /// When payloads are compressed and when they go by reference through the object store
    /// (see [`PayloadLimits`](crate::payload::PayloadLimits) and `docs/PROTOCOL.md` section
    /// 7.11): by default payloads of 64 KiB and more are compressed with zstd for readers that
    /// read it, payloads over the server's `max_payload` (less 64 KiB) go by reference, and
    /// nothing over 64 MiB is sent or taken.
    pub fn payload_limits(mut self, limits: crate::payload::PayloadLimits) -> Self {
        self.payload_limits = limits;
        self
    }

    /// Time between heartbeats (default 5 s); the registry declares the agent gone after three
    /// missed. Zero turns heartbeats off (the agent then does not appear in discovery).
    pub fn heartbeat_interval(mut self, interval: Duration) -> Self {
        self.heartbeat_interval = interval;
        self
    }

    /// How often the agent reports what it handled, per endpoint, customer and session, to the
    /// usage stream (default 5 s; PROTOCOL.md section 7.13), and once more at shutdown. Zero
    /// turns usage counting off.
    pub fn usage_interval(mut self, interval: Duration) -> Self {
        self.usage_interval = interval;
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

    /// When the durable inbox holds its consumers on the server: only while commands wait
    /// (the default, [`InboxConsumers::OnDemand`], so idle agents cost the server a
    /// subscription each) or always ([`InboxConsumers::Always`]).
    pub fn inbox_consumers(mut self, consumers: InboxConsumers) -> Self {
        self.inbox_consumers = consumers;
        self
    }

    /// Retry policies for the durable inbox. Without them the agent reads the policies the
    /// coordinator publishes from its configuration, or uses the defaults.
    pub fn retry_policies(mut self, policies: RetryPolicies) -> Self {
        self.retry_policies = Some(policies);
        self
    }

    /// How long a durable delivery may go unacknowledged before it is redelivered (default
    /// 5 s). Every delivery the agent holds, running or waiting its turn, reports progress
    /// every third of it; so this is how long a crashed instance's deliveries wait before they
    /// go to another.
    pub fn durable_ack_wait(mut self, wait: Duration) -> Self {
        self.durable_ack_wait = wait.max(MIN_DURABLE_ACK_WAIT);
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

    /// The JetStream domain the agent's durable inbox, buckets and object store are reached in
    /// (`$JS.<domain>.API`), for an agent on a leaf node without JetStream of its own whose
    /// hub runs JetStream in that domain (docs/OPERATIONS.md, "Sites and leaf nodes"). Keeps
    /// the other broker settings; set after [`broker`](Self::broker) if both are used.
    pub fn jetstream_domain(mut self, domain: impl Into<String>) -> Self {
        self.broker = self.broker.jetstream_domain(domain);
        self
    }

    /// All broker settings (credentials, TLS, ping interval...). The connection name and inbox
    /// prefix are set from the agent id unless given here.
    pub fn broker(mut self, broker: BrokerOptions) -> Self {
        self.broker = broker;
        self
    }

    /// The connection settings these options connect with: to open one connection that
    /// several agents share ([`connection`](AgentOptions::connection)).
    pub fn broker_options(&self) -> &BrokerOptions {
        &self.broker
    }

    /// Serves the agent on `connection`, shared with the process's other agents, instead of a
    /// connection of its own: one process and one NATS connection can host hundreds or
    /// thousands of agents, each with its own id, handlers, heartbeats and usage. Every agent
    /// on it uses its reply prefix and credentials (the connection's), so NATS permissions
    /// apply to the process, not to each agent; shutting an agent down leaves the connection
    /// to its owner, who drains it ([`Broker::drain`](chorus_broker_adapter::Broker::drain))
    /// after the last agent. The broker settings of these options are not used.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), chorus_sdk::SdkError> {
    /// use chorus_sdk::{AgentOptions, BrokerOptions};
    /// let connection = BrokerOptions::new(["nats://127.0.0.1:4222"])
    ///     .name("calculators")
    ///     .connect()
    ///     .await?;
    /// let mut agents = Vec::new();
    /// for i in 0..100 {
    ///     agents.push(
    ///         AgentOptions::new(format!("calc-{i}"))
    ///             .connection(connection.clone())
    ///             .connect()
    ///             .await?,
    ///     );
    /// }
    /// # Ok(()) }
    /// ```
    pub fn connection(mut self, connection: chorus_broker_adapter::Broker) -> Self {
        self.connection = Some(connection);
        self
    }

    /// The subject root (default `chorus`).
    pub fn root(mut self, root: impl Into<String>) -> Self {
        self.root = root.into();
        self
    }

    /// How this agent encodes what it sends, fixed. Without it, the agent follows its bus:
    /// the compact form (protocol 2) once the coordinator announces that every live agent
    /// reads it (`<root>.sys.wire`), MessagePack with field names (protocol 1) until then and
    /// whenever one does not. It reads every form whatever it writes, and answers each request
    /// in the form it came in.
    pub fn encoding(mut self, encoding: Encoding) -> Self {
        self.encoding = Some(encoding);
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

    /// Announces where this agent's process serves its Prometheus metrics
    /// (`http://host:port/metrics`, reachable by Prometheus), so the coordinator's service
    /// discovery (`/sd/agents`) gives Prometheus this process as a target. Serve
    /// [`metrics::render`](crate::metrics::render)`(`[`metrics::registry`](crate::metrics::registry)`())`
    /// there; agents of one process share one registry and may announce the same URL.
    pub fn metrics_url(mut self, url: impl Into<String>) -> Self {
        self.metrics_url = Some(url.into());
        self
    }

    /// Connects and returns the agent.
    ///
    /// # Errors
    /// [`SdkError::Subject`] for an invalid id, group or root; [`SdkError::InvalidCall`] for a bad
    /// metrics URL; [`SdkError::Broker`] when the server cannot be reached or refuses, or the
    /// subscriptions or durable inbox cannot be set up.
    pub async fn connect(self) -> Result<Agent, SdkError> {
        Agent::connect(self).await
    }
}
