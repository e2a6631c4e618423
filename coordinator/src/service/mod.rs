//! The coordinator service (`chorus serve`): registry and discovery, broadcast, the
//! dead-letter queue and metrics.
//!
//! It holds no state it cannot rebuild: the registry is a key-value bucket, dead letters and
//! captured advisories are streams, and the in-memory view of who is live is rebuilt from the
//! bucket and the next round of heartbeats. Several coordinators can run side by side:
//! discovery and broadcast requests go to one of them (a queue group), advisories are shared
//! through one durable consumer, and registry writes are conditional.
//!
//! [`Coordinator::start`] connects, provisions the streams and buckets (`provision`), then
//! starts each task with its own spawn function (`tasks`); every task runs in one
//! [`TaskTracker`] and stops on one [`CancellationToken`], cancelled by
//! [`Coordinator::shutdown`] or when the `Coordinator` is dropped.

mod broadcast;
pub use broadcast::ORIGIN_HEADER;
pub mod dlq;
mod endpoints;
mod guard;
mod hosting;
pub mod http;
pub mod metrics;
mod provision;
pub mod registry;
pub mod sd;
mod tasks;
mod usage;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chorus_broker_adapter::{Broker, BrokerOptions, JetStream};
use chorus_sdk::{Agent, AgentOptions, Subjects};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::CoordinatorConfig;
use crate::error::{Error, ErrorKind, Result};
use http::{MetricsServer, Readiness, ReadinessCheck};
use registry::Registry;

/// The `from` of messages the coordinator sends, and its reply-inbox prefix's token.
pub const COORDINATOR_ID: &str = chorus_sdk::registry::COORDINATOR_ID;
/// Name of the durable consumer the coordinators share on the advisory stream.
pub const DLQ_CONSUMER: &str = "chorus-dlq";
/// Suffix of the registry bucket's name.
pub const REGISTRY_BUCKET: &str = "registry";
/// The coordinator's NATS connection name.
pub const CONNECTION_NAME: &str = "chorus-coordinator";
/// How long a JetStream API call (stream, bucket, consumer, stored message) may take.
pub const JETSTREAM_TIMEOUT: Duration = Duration::from_secs(10);
/// Messages (heartbeats, discovery queries, broadcasts) handled at once; beyond that they wait
/// in the endpoints' bounded queues (a full queue answers a request with 5019 at once).
pub const MAX_IN_FLIGHT: usize = 512;

/// What every task of one coordinator shares.
pub(crate) struct Shared {
    pub(crate) config: CoordinatorConfig,
    pub(crate) subjects: Subjects,
    pub(crate) broker: Broker,
    pub(crate) js: JetStream,
    pub(crate) registry: Registry,
    /// The key broadcast copies are signed with, as `coordinator`.
    pub(crate) identity: Option<Arc<chorus_sdk::security::Identity>>,
    /// Checks broadcast requests: a signed one must verify against its sender's key, and an
    /// unsigned one is refused where `require_signed_broadcasts` says so.
    pub(crate) broadcast_verifier: chorus_sdk::security::Verifier,
    /// Checks the signatures of commands that need a role (`guard`), against the keys the
    /// configuration holds only.
    pub(crate) command_verifier: chorus_sdk::security::Verifier,
    /// The numbers (`seq`) of its protocol-level announcements on `<root>.sys.wire`.
    pub(crate) wire_numbers: chorus_sdk::EventNumbers,
    /// Hosted agents' desired state and the hosts' reports.
    pub(crate) hosting: hosting::Hosting,
    /// The coordinator as an agent of the bus: its endpoints go through the SDK's inbound
    /// pipeline, and its connection is the one every task uses.
    agent: Agent,
    stop: CancellationToken,
    tracker: TaskTracker,
    /// Who asked for what (`guard`'s decisions), written to the audit stream in the
    /// background.
    pub(crate) audit: chorus_sdk::audit::AuditSink,
    /// Cleared when shutdown begins, so `/readyz` says so at once.
    ready: AtomicBool,
}

impl CoordinatorConfig {
    /// The default broadcast timeout.
    pub fn broadcast_timeout(&self) -> Duration {
        Duration::from_millis(self.broadcast_timeout_ms)
    }
}

/// A running coordinator. Dropping it stops its tasks (without waiting for them);
/// [`shutdown`](Coordinator::shutdown) stops them and waits.
pub struct Coordinator {
    shared: Arc<Shared>,
    metrics_server: Option<MetricsServer>,
    gateway: Option<chorus_gateway::Gateway>,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("root", &self.shared.subjects.root())
            .field("metrics_addr", &self.metrics_addr())
            .finish_non_exhaustive()
    }
}

impl Coordinator {
    /// Connects, makes sure the streams and buckets exist, publishes the retry policies and
    /// starts every task. `serve_metrics` starts the `/metrics` listener on the configured
    /// address.
    ///
    /// ```no_run
    /// use chorus_coordinator::{Coordinator, CoordinatorConfig};
    ///
    /// # async fn run() -> chorus_coordinator::Result<()> {
    /// let config = CoordinatorConfig::load(Some("chorus.toml".as_ref()))?; // or ::default()
    /// let coordinator = Coordinator::start(config, true).await?;
    /// println!("metrics at {:?}", coordinator.metrics_addr());
    /// // ... until SIGTERM:
    /// coordinator.shutdown().await;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// A configuration error when the settings or the signing key cannot work, a connection error
    /// when NATS is out of reach, a broker error when a stream, bucket or subscription cannot be
    /// set up, a listen error when an address is taken, an I/O error for an unreadable JWT key.
    pub async fn start(mut config: CoordinatorConfig, serve_metrics: bool) -> Result<Coordinator> {
        config.validate()?;
        config.read_trusted_keys()?;
        // Read once: broadcast copies, task records and registry events are signed with it.
        let identity = config.signing_identity()?.map(Arc::new);
        let broadcast_verifier =
            chorus_sdk::security::Verifier::new(chorus_sdk::security::SignaturePolicy {
                require_signed: config.require_signed_broadcasts,
                ..chorus_sdk::security::SignaturePolicy::default()
            });
        let subjects =
            Subjects::new(&config.root).map_err(Error::wrap(ErrorKind::Config, "invalid root"))?;
        let inbox_prefix = subjects
            .inbox_prefix(COORDINATOR_ID)
            .map_err(Error::wrap(ErrorKind::Config, "invalid inbox prefix"))?;
        let broker_options = config
            .security
            .apply(
                BrokerOptions::new([config.servers.as_str()])
                    .name(CONNECTION_NAME)
                    .inbox_prefix(inbox_prefix),
            )
            .map_err(Error::wrap(ErrorKind::Config, "security"))?;
        // No heartbeat or `$SRV` answers of its own: the coordinator is not in its registry.
        let mut options = AgentOptions::new(COORDINATOR_ID);
        // With a key, everything it sends as an agent is signed (its replies, its
        // notifications, its commands to hosts), so agents that require signatures and trust
        // its key take them.
        if let Some(own) = config.signing_identity()? {
            options = options.identity(own);
        }
        let agent = options
            .root(&config.root)
            .broker(broker_options)
            .heartbeat_interval(Duration::ZERO)
            // What the coordinator itself handles is the bus's work, not a customer's.
            .usage_interval(Duration::ZERO)
            .service_discovery(false)
            .max_in_flight(MAX_IN_FLIGHT)
            .shutdown_timeout(config.shutdown_timeout())
            .connect()
            .await
            .map_err(Error::wrap(
                ErrorKind::Connect,
                format!("coordinator cannot reach NATS at {}", config.servers),
            ))?;
        let broker = agent.broker().clone();
        let js = broker.jetstream(JETSTREAM_TIMEOUT);
        let buckets = provision::provision(&config, &subjects, &js).await?;

        let registry = Registry::new(
            subjects.clone(),
            broker.clone(),
            buckets.registry.clone(),
            config.missed_heartbeats,
            identity.clone(),
        );
        let entries = buckets
            .registry
            .entries()
            .await
            .map_err(Error::wrap(ErrorKind::Broker, "cannot read the registry"))?;
        for entry in entries {
            registry.apply_kv(entry);
        }
        let (stop, tracker) = (CancellationToken::new(), TaskTracker::new());
        let audit = chorus_sdk::audit::AuditSink::start(
            chorus_sdk::audit::AuditLog::new(&broker, subjects.clone(), COORDINATOR_ID),
            &tracker,
            stop.clone(),
        );
        let shared = Arc::new(Shared {
            audit,
            config,
            subjects,
            broker,
            js,
            registry,
            identity,
            broadcast_verifier,
            command_verifier: chorus_sdk::security::Verifier::new(
                chorus_sdk::security::SignaturePolicy::default(),
            ),
            wire_numbers: chorus_sdk::EventNumbers::default(),
            hosting: hosting::Hosting::new(buckets.deployments, buckets.hosts),
            agent,
            stop,
            tracker,
            ready: AtomicBool::new(true),
        });
        // From here on, an early return drops `coordinator`, whose guard stops what started.
        let mut coordinator = Coordinator {
            shared: Arc::clone(&shared),
            metrics_server: None,
            gateway: None,
        };
        tasks::spawn_registry_watch(&shared, &buckets.registry).await?;
        tasks::spawn_registry_writer(&shared);
        endpoints::serve(&shared.agent, &shared)
            .await
            .map_err(Error::wrap(
                ErrorKind::Broker,
                "cannot serve the coordinator's subjects",
            ))?;
        hosting::follow(&shared).await?;
        hosting::serve(&shared.agent, &shared)
            .await
            .map_err(Error::wrap(
                ErrorKind::Broker,
                "cannot serve the hosting subjects",
            ))?;
        hosting::spawn_reconciler(&shared);
        usage::serve(&shared.agent, &shared)
            .await
            .map_err(Error::wrap(ErrorKind::Broker, "cannot serve usage queries"))?;
        usage::spawn_metrics(&shared);
        tasks::spawn_reaper(&shared);
        tasks::spawn_dead_letter_worker(&shared).await?;
        if serve_metrics {
            coordinator.metrics_server = Some(start_metrics(&shared).await?);
        }
        if shared.config.gateway.enabled() {
            let gateway = chorus_gateway::Gateway::start(
                &shared.config.gateway_bus(),
                &shared.config.gateway,
            )
            .await
            .map_err(|err| {
                let kind = match err.kind() {
                    chorus_gateway::ErrorKind::Connect => ErrorKind::Connect,
                    chorus_gateway::ErrorKind::Broker => ErrorKind::Broker,
                    chorus_gateway::ErrorKind::Listen => ErrorKind::Listen,
                    chorus_gateway::ErrorKind::Io => ErrorKind::Io,
                    _ => ErrorKind::Config,
                };
                Error::with_source(kind, "cannot start the gateway", err)
            })?;
            coordinator.gateway = Some(gateway);
        }
        let _ = metrics::metrics();
        tracing::info!(root = shared.subjects.root(), "coordinator started");
        Ok(coordinator)
    }

    /// Where `/metrics` listens, if it does.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_server.as_ref().map(MetricsServer::local_addr)
    }

    /// Where the edge gateway listens, if it runs.
    pub fn gateway_addr(&self) -> Option<SocketAddr> {
        self.gateway
            .as_ref()
            .and_then(chorus_gateway::Gateway::local_addr)
    }

    /// Where its gateway's web console listens, if it does.
    pub fn console_addr(&self) -> Option<SocketAddr> {
        self.gateway
            .as_ref()
            .and_then(chorus_gateway::Gateway::console_addr)
    }

    /// Agents the registry considers live and matching `query`, least loaded first.
    pub fn discover(&self, query: &chorus_sdk::DiscoverQuery) -> Vec<chorus_sdk::AgentRecord> {
        self.shared.registry.discover(query)
    }

    /// Stops taking work, finishes what is in flight (up to the configured deadline) and
    /// drains the connection. Returns whether everything finished in time.
    pub async fn shutdown(mut self) -> bool {
        let shared = Arc::clone(&self.shared);
        shared.ready.store(false, Ordering::Relaxed);
        // The edge stops first: what it holds is answered while the bus is still there.
        if let Some(gateway) = self.gateway.take() {
            gateway.stop().await;
        }
        shared.stop.cancel();
        shared.tracker.close();
        // The endpoints' in-flight requests finish and are answered while the coordinator's
        // own tasks stop; then the connection drains.
        let (tasks, endpoints) = tokio::join!(
            tokio::time::timeout(shared.config.shutdown_timeout(), shared.tracker.wait()),
            shared.agent.shutdown(),
        );
        let finished = tasks.is_ok() && endpoints.completed;
        if let Some(server) = self.metrics_server.take() {
            server.stop().await;
        }
        tracing::info!(finished, "coordinator stopped");
        finished
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.shared.ready.store(false, Ordering::Relaxed);
        self.shared.agent.stop();
        self.shared.stop.cancel();
        self.shared.tracker.close();
    }
}

/// Starts the metrics listener; `/readyz` is ready while connected and not shutting down.
async fn start_metrics(shared: &Arc<Shared>) -> Result<MetricsServer> {
    let s = Arc::clone(shared);
    let readiness: ReadinessCheck = Arc::new(move || {
        if !s.ready.load(Ordering::Relaxed) {
            Readiness::NotReady("shutting down")
        } else if !s.broker.is_connected() {
            Readiness::NotReady("not connected to NATS")
        } else {
            Readiness::Ready
        }
    });
    let registry = Arc::clone(shared);
    let routes = axum::Router::new().route(
        "/sd/agents",
        axum::routing::get(move || {
            let groups = sd::target_groups(
                &registry
                    .registry
                    .discover(&chorus_sdk::DiscoverQuery::default()),
            );
            async move { axum::Json(groups) }
        }),
    );
    let addr = shared.config.metrics_addr;
    MetricsServer::start(addr, readiness, routes)
        .await
        .map_err(Error::wrap(
            ErrorKind::Listen,
            format!("cannot listen for metrics on {addr}"),
        ))
}
