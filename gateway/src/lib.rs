//! The Chorus edge gateway: callers that do not speak NATS reach the bus over HTTP, as one of the
//! edge identities in `[gateway]`, and what they send becomes ordinary envelopes from that
//! identity, with the same permissions, signatures and dead letters as native traffic
//! (`docs/INTEROP.md`).
//!
//! Each identity is an SDK agent of its own (its own connection, its nkey if configured):
//! what it sends goes through the SDK's outbound path, and every command sent to it, core or
//! durable, passes its inbound pipeline and waits in its inbox (`inbox.rs`) for a poll.

// Every public item is documented, and every fallible one says how it fails.
#![warn(missing_docs, clippy::missing_errors_doc)]

mod a2a;
mod agentify;
mod api;
mod auth;
pub mod config;
mod conn;
mod console;
pub mod error;
mod https;
mod iacp;
mod inbox;
mod limits;
mod mcp;
mod metrics;
mod openapi;
mod sap;
mod scopes;
mod tasks;
mod tls;
mod webhook;
mod ws;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{any, get, post};
use chorus_sdk::BrokerOptions;
use chorus_sdk::{Agent, AgentOptions, Subjects};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use chorus_sdk::security::ConnectionSecurity;

pub use a2a::push::PUSH_BUCKET;
pub use agentify::TASK_HEADER as AGENTIFY_TASK_HEADER;
pub use config::{
    CircuitBreakerConfig, ConsoleConfig, GatewayConfig, McpConfig, PushConfig, ScopeConfig, Tenant,
};
pub use error::{Error, ErrorKind, Result};
/// The HTTP client the gateway fetches and posts with (rustls on ring, the system's CAs and a
/// file's, no redirects), for other parts of Chorus that speak HTTP out: `chorus mcp bridge --url`.
pub use https::client as https_client;
use inbox::{EdgeHandler, EdgeInbox};

/// How the gateway's edge identities reach the bus: the settings of the process that runs the
/// gateway (the coordinator passes its own).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Bus {
    /// NATS server URLs, comma-separated.
    pub servers: String,
    /// Subject root of the bus.
    pub root: String,
    /// TLS and credentials; an identity's own nkey seed file replaces the seed here.
    pub security: ConnectionSecurity,
    /// Circuit breakers on the requests the edge identities make for their callers.
    pub circuit_breaker: Option<CircuitBreakerConfig>,
    /// How long an identity's shutdown waits for its in-flight work.
    pub shutdown_timeout: Duration,
    /// The nkey seed file of the coordinator's signing key, when the console runs in the
    /// coordinator's process: the console's dead-letter replays are signed with it as
    /// `coordinator` (docs/PROTOCOL.md 7.8), so an agent that verifies signatures and trusts
    /// the coordinator's key handles them. Unsigned replays without it.
    pub replay_seed_file: Option<std::path::PathBuf>,
}

impl Bus {
    /// A bus at `servers` under the default root, plain and anonymous, without breakers.
    pub fn new(servers: impl Into<String>) -> Self {
        Bus {
            servers: servers.into(),
            root: chorus_sdk::subject::DEFAULT_ROOT.into(),
            security: ConnectionSecurity::default(),
            circuit_breaker: None,
            shutdown_timeout: chorus_sdk::DEFAULT_SHUTDOWN_TIMEOUT,
            replay_seed_file: None,
        }
    }
}

/// One edge identity: its agent on the bus and the messages waiting for its polls.
pub(crate) struct Edge {
    agent: Agent,
    inbox: Arc<EdgeInbox>,
    /// IACP's replies waiting for the identity's poll (`iacp.rs`).
    iacp: Arc<iacp::Outbox>,
    /// The tenant the identity belongs to, if any (its agent lives under the tenant's root).
    tenant: Option<String>,
    /// Its callers' writes, in the audit stream (`limits::concurrency`).
    audit: chorus_sdk::audit::AuditSink,
}

/// What the routes share.
pub(crate) struct GatewayState {
    config: GatewayConfig,
    auth: auth::Authenticator,
    edges: HashMap<String, Edge>,
    /// Cancelled when the gateway stops: open WebSockets close.
    stop: CancellationToken,
    limits: limits::Limits,
    /// The bus's tasks, for A2A's `ListTasks`.
    a2a_index: a2a::TaskIndex,
    /// A2A push notifications, when `[gateway.push]` is set.
    push: Option<Arc<a2a::push::Push>>,
    /// What each scope grants.
    scopes: scopes::Scopes,
    /// The OpenAPI document, with this gateway's limits.
    openapi: String,
    /// The MCP server's sessions, calls in flight and tool tables.
    mcp: mcp::Mcp,
    /// Owns the tasks routes start that outlive a request (MCP's tool list watchers).
    tracker: TaskTracker,
}

/// A running gateway. [`Gateway::stop`] stops it and waits; dropping it stops the listener
/// without waiting.
pub struct Gateway {
    /// Where the HTTP gateway listens, if it does.
    addr: Option<SocketAddr>,
    /// Where the web console listens, if it does, and its agent.
    console: Option<(SocketAddr, Agent)>,
    stop: CancellationToken,
    /// The HTTP listener and the SAP agents' tasks.
    tracker: TaskTracker,
    state: Arc<GatewayState>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("addr", &self.addr)
            .field("console", &self.console.as_ref().map(|(addr, _)| addr))
            .finish_non_exhaustive()
    }
}

/// The connection name of an edge identity's agent.
fn connection_name(id: &str) -> String {
    format!("chorus-gateway-{id}")
}

/// Where an edge identity's replies come back: under its own id when it connects as its own
/// user (`chorus creds <id>` allows `_INBOX.<id>.>`); under the coordinator's, as
/// `_INBOX.coordinator.edge-<id>`, when it shares the coordinator's user, whose entry allows
/// that prefix and no other identity's.
fn edge_inbox_prefix(
    subjects: &Subjects,
    identity: &config::EdgeIdentity,
) -> std::result::Result<String, chorus_sdk::subject::SubjectError> {
    let own = subjects.inbox_prefix(&identity.id)?;
    if identity.nkey_seed_file.is_some() {
        return Ok(own);
    }
    let shared = subjects.inbox_prefix(chorus_sdk::registry::COORDINATOR_ID)?;
    Ok(format!("{shared}.edge-{}", identity.id))
}

async fn connect_edge(
    bus: &Bus,
    gateway: &GatewayConfig,
    subjects: &Subjects,
    identity: &config::EdgeIdentity,
    stop: &CancellationToken,
    tracker: &TaskTracker,
) -> Result<Edge> {
    let mut security = bus.security.clone();
    if let Some(seed) = &identity.nkey_seed_file {
        security.nkey_seed_file = Some(seed.clone());
    }
    let inbox_prefix = edge_inbox_prefix(subjects, identity)
        .map_err(Error::wrap(ErrorKind::Config, "gateway: identity"))?;
    let broker = security
        .apply(
            BrokerOptions::new([bus.servers.as_str()])
                .name(connection_name(&identity.id))
                .inbox_prefix(inbox_prefix),
        )
        .map_err(Error::wrap(
            ErrorKind::Config,
            format!("gateway: identity {}", identity.id),
        ))?;
    // A tenant's identity lives under its tenant's root: its own registry, tasks and streams.
    let root = match &identity.tenant {
        Some(name) => gateway
            .tenants
            .iter()
            .find(|t| &t.name == name)
            .map(|t| t.root.as_str())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    format!("gateway: identity {}: no tenant {name}", identity.id),
                )
            })?,
        None => bus.root.as_str(),
    };
    // An identity with a key of its own announces it: it heartbeats, so the registry holds its
    // public key and an agent that requires signatures verifies its callers' requests (and
    // sees who they are). One without a key sends unsigned and stays out of the registry.
    let mut options = AgentOptions::new(identity.id.clone())
        .root(root)
        .broker(broker)
        .service_discovery(false)
        // Durable commands to the identity wait in its inbox stream for a poll.
        .durable_inbox(true)
        .shutdown_timeout(bus.shutdown_timeout);
    if identity.nkey_seed_file.is_none() {
        options = options.heartbeat_interval(Duration::ZERO);
    }
    if let Some(breaker) = &bus.circuit_breaker {
        options = options.circuit_breaker(breaker.policy());
    }
    // Signed only with the identity's own key: the coordinator's would not verify as it.
    if identity.nkey_seed_file.is_some()
        && let Some(signing) = security.identity().map_err(Error::wrap(
            ErrorKind::Config,
            format!("gateway: identity {}", identity.id),
        ))?
    {
        options = options.identity(signing);
    }
    let agent = options.connect().await.map_err(Error::wrap(
        ErrorKind::Connect,
        format!("gateway: identity {} cannot reach NATS", identity.id),
    ))?;
    let inbox = Arc::new(EdgeInbox::new(
        gateway.inbox_capacity,
        gateway.hold(),
        stop.child_token(),
    ));
    agent
        .handle_other_commands(EdgeHandler {
            inbox: Arc::clone(&inbox),
        })
        .await
        .map_err(Error::wrap(
            ErrorKind::Broker,
            format!("gateway: cannot receive commands for {}", identity.id),
        ))?;
    // What the identity's callers change, written as the identity (its credentials let it
    // write records only under its own id).
    let audit = chorus_sdk::audit::AuditSink::start(
        chorus_sdk::audit::AuditLog::new(
            agent.broker(),
            agent.subjects().clone(),
            identity.id.clone(),
        ),
        tracker,
        stop.child_token(),
    );
    Ok(Edge {
        audit,
        agent,
        inbox,
        iacp: Arc::new(iacp::Outbox::new(gateway.inbox_capacity)),
        tenant: identity.tenant.clone(),
    })
}

impl Gateway {
    /// Connects every edge identity and builds what the routes share; nothing is served yet.
    async fn connect(bus: &Bus, gateway: &GatewayConfig) -> Result<Gateway> {
        let auth = auth::Authenticator::new(gateway)?;
        let subjects =
            Subjects::new(&bus.root).map_err(Error::wrap(ErrorKind::Config, "invalid root"))?;
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        let mut edges = HashMap::new();
        for identity in &gateway.identities {
            let edge = connect_edge(bus, gateway, &subjects, identity, &stop, &tracker).await?;
            edges.insert(identity.id.clone(), edge);
        }
        let push = match &gateway.push {
            Some(push) => Some(Arc::new(
                a2a::push::Push::new(push, tracker.clone(), stop.child_token())
                    .map_err(|e| Error::new(ErrorKind::Config, format!("gateway.push: {e}")))?,
            )),
            None => None,
        };
        // Each identity's kept push configs, read back and resumed before anything is served.
        if let Some(push) = &push {
            for edge in edges.values() {
                push.open(&edge.agent)
                    .await
                    .map_err(|e| Error::new(ErrorKind::Config, format!("gateway.push: {e}")))?;
            }
        }
        let state = Arc::new(GatewayState {
            config: gateway.clone(),
            auth,
            edges,
            stop: stop.clone(),
            limits: {
                metrics::register();
                limits::Limits::new(gateway)
            },
            a2a_index: a2a::TaskIndex::default(),
            push,
            scopes: scopes::Scopes::new(&gateway.scopes),
            openapi: openapi::document(gateway),
            mcp: mcp::Mcp::new(&gateway.mcp),
            tracker: tracker.clone(),
        });
        // Owned by the gateway from here: a start that fails later stops it as it drops.
        if let Some(refresh) = state.auth.jwks_refresh(stop.child_token()) {
            tracker.spawn(refresh);
        }
        tracker.spawn(mcp::sweep_sessions(Arc::clone(&state), stop.child_token()));
        Ok(Gateway {
            addr: None,
            console: None,
            stop,
            tracker,
            state,
        })
    }

    /// Serves the MCP server over `input` and `output` (JSON-RPC messages, one per line: MCP's
    /// stdio transport) as the first identity of `gateway.identities`, until `input` ends; a
    /// desktop MCP host starts it as a local command (`chorus mcp serve --stdio`). Nothing
    /// listens on the network; what the identity may do is what its NATS credentials allow.
    ///
    /// # Errors
    /// A configuration error when `gateway` names no identity; a connection error when it
    /// cannot reach NATS; an I/O error when `input` or `output` fails.
    pub async fn serve_mcp_stdio<R, W>(
        bus: &Bus,
        gateway: &GatewayConfig,
        input: R,
        output: W,
    ) -> Result<()>
    where
        R: tokio::io::AsyncRead + Unpin + Send,
        W: tokio::io::AsyncWrite + Unpin + Send,
    {
        let Some(identity) = gateway.identities.first() else {
            return Err(Error::new(
                ErrorKind::Config,
                "gateway: MCP over standard input and output needs an identity to act as",
            ));
        };
        let served = Gateway::connect(bus, gateway).await?;
        let state = Arc::clone(&served.state);
        let outcome = mcp::stdio::serve(state, identity.id.clone(), input, output).await;
        served.stop().await;
        outcome.map_err(Error::wrap(
            ErrorKind::Io,
            "MCP over standard input and output",
        ))
    }

    /// Connects every edge identity to `bus`, registers the SAP agents of `gateway.sap` and
    /// listens on `gateway.listen` if set (port 0 picks a free one).
    ///
    /// ```no_run
    /// use chorus_gateway::config::EdgeIdentity;
    /// use chorus_gateway::{Bus, Gateway, GatewayConfig};
    ///
    /// # async fn run() -> chorus_gateway::Result<()> {
    /// let mut config = GatewayConfig::default();
    /// config.listen = Some("127.0.0.1:8080".parse().expect("an address"));
    /// config.identities = vec![EdgeIdentity { id: "web-ui".into(), nkey_seed_file: None, tenant: None }];
    /// let gateway = Gateway::start(&Bus::new("nats://127.0.0.1:4222"), &config).await?;
    /// println!("gateway at {:?}", gateway.local_addr());
    /// gateway.stop().await;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// A configuration error when the gateway has nothing to do or its settings cannot work,
    /// a connection error when an identity cannot reach NATS, a listen error when the
    /// address is taken.
    pub async fn start(bus: &Bus, gateway: &GatewayConfig) -> Result<Gateway> {
        gateway.validate()?;
        if !gateway.enabled() {
            return Err(Error::new(
                ErrorKind::Config,
                "gateway: no listen address and no SAP agents",
            ));
        }
        let mut started = Gateway::connect(bus, gateway).await?;
        let (state, stop, tracker) = (
            Arc::clone(&started.state),
            started.stop.clone(),
            started.tracker.clone(),
        );
        for binding in &gateway.sap {
            let edge = &state.edges[&binding.identity];
            sap::start(
                binding,
                edge.agent.clone(),
                gateway.max_concurrent_requests,
                stop.child_token(),
                tracker.clone(),
            )
            .await?;
        }
        if let Some(listen) = gateway.console.listen {
            started.console = Some(
                console::start(
                    bus,
                    Arc::clone(&state),
                    listen,
                    stop.child_token(),
                    &tracker,
                )
                .await?,
            );
        }
        let Some(listen) = gateway.listen else {
            tracing::info!(sap = gateway.sap.len(), "gateway started without HTTP");
            return Ok(started);
        };
        let app = axum::Router::new()
            .route("/v1/agents", get(api::agents))
            .route("/v1/peers", get(iacp::peers))
            .route("/v1/messages", post(api::send).get(api::poll))
            .route("/v1/replies", post(api::reply))
            .route("/v1/requests", post(api::request))
            .route("/v1/tasks", post(tasks::submit))
            .route("/v1/tasks/{id}", get(tasks::get))
            .route("/v1/tasks/{id}/cancel", post(tasks::cancel))
            .route("/v1/tasks/{id}/input", post(tasks::input))
            .route("/v1/tasks/{id}/events", get(tasks::events))
            .route("/v1/ws", get(ws::upgrade))
            .route(
                "/a2a/agents/{agent}/{command}/.well-known/agent-card.json",
                get(a2a::agent_card),
            )
            .route("/a2a/agents/{agent}/{command}/", post(a2a::agent_rpc))
            .route("/a2a/agents/{agent}/{command}", post(a2a::agent_rpc))
            .route(
                "/a2a/agents/{agent}/{command}/{*rest}",
                any(a2a::rest::agent_rest),
            )
            .route(
                "/a2a/capabilities/{capability}/.well-known/agent-card.json",
                get(a2a::capability_card),
            )
            .route("/a2a/capabilities/{capability}/", post(a2a::capability_rpc))
            .route("/a2a/capabilities/{capability}", post(a2a::capability_rpc))
            .route(
                "/a2a/capabilities/{capability}/{*rest}",
                any(a2a::rest::capability_rest),
            )
            .route("/.well-known/agent-card.json", get(a2a::default_card))
            .route("/agent/message", post(agentify::message))
            .route("/agent/ws", get(agentify::upgrade))
            .route("/mcp", post(mcp::post).get(mcp::get).delete(mcp::delete))
            .route("/openapi.json", get(api::openapi))
            .fallback(api::not_found)
            .method_not_allowed_fallback(api::method_not_allowed)
            .layer(axum::middleware::from_fn_with_state(
                Arc::clone(&state),
                limits::concurrency,
            ))
            .layer(axum::extract::DefaultBodyLimit::max(gateway.max_body_bytes))
            .with_state(Arc::clone(&state));
        // Read before binding: a bad certificate stops the start with the file named.
        let tls = gateway.tls.as_ref().map(tls::server_config).transpose()?;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(Error::wrap(
                ErrorKind::Listen,
                format!("gateway: cannot listen on {listen}"),
            ))?;
        let addr = listener
            .local_addr()
            .map_err(Error::wrap(ErrorKind::Listen, "gateway: no local address"))?;
        let shutdown = stop.clone();
        // Owned by the `Gateway`: `stop` waits for it.
        let peers = conn::Peers::new(gateway.max_unproven_connections_per_peer);
        match tls {
            Some(config) => {
                let listener = tls::TlsListener::new(listener, config, stop.clone(), &tracker)
                    .map_err(Error::wrap(ErrorKind::Listen, "gateway: no local address"))?;
                tracker.spawn(conn::serve(listener, app, peers, shutdown, tracker.clone()));
            }
            None => {
                if !addr.ip().is_loopback() {
                    tracing::warn!(
                        %addr,
                        "gateway serves plain HTTP off loopback (allow_plain_http): keys, \
                         tokens and payloads cross the network in clear"
                    );
                }
                tracker.spawn(conn::serve(listener, app, peers, shutdown, tracker.clone()));
            }
        }
        tracing::info!(
            %addr,
            tls = gateway.tls.is_some(),
            identities = state.edges.len(),
            "gateway listening"
        );
        started.addr = Some(addr);
        Ok(started)
    }

    /// Where the HTTP gateway listens, if it does.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// Where the web console listens, if it does (`[gateway.console] listen`).
    pub fn console_addr(&self) -> Option<SocketAddr> {
        self.console.as_ref().map(|(addr, _)| *addr)
    }

    /// Stops listening, answers held messages 5019 (durable ones stay stored) and SAP prompts
    /// in progress 503, and shuts the edge identities' agents down.
    pub async fn stop(self) {
        self.stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        for edge in self.state.edges.values() {
            edge.agent.shutdown().await;
        }
        if let Some((_, agent)) = &self.console {
            agent.shutdown().await;
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop.cancel();
        for edge in self.state.edges.values() {
            edge.agent.stop();
        }
        if let Some((_, agent)) = &self.console {
            agent.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_on_the_coordinators_user_takes_its_replies_under_the_coordinators_inbox() {
        let subjects = Subjects::default();
        let mut identity = config::EdgeIdentity {
            id: "ops".into(),
            nkey_seed_file: None,
            tenant: None,
        };
        assert_eq!(
            edge_inbox_prefix(&subjects, &identity).expect("prefix"),
            "_INBOX.coordinator.edge-ops"
        );
        identity.nkey_seed_file = Some("ops.nk".into());
        assert_eq!(
            edge_inbox_prefix(&subjects, &identity).expect("prefix"),
            "_INBOX.ops"
        );
        identity.id = "not.one.token".into();
        assert!(edge_inbox_prefix(&subjects, &identity).is_err());
    }
}
