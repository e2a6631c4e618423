//! The edge gateway: callers that do not speak NATS reach the bus over HTTP, as one of the
//! edge identities in `[gateway]`, and what they send becomes ordinary envelopes from that
//! identity, with the same permissions, signatures and dead letters as native traffic
//! (`docs/INTEROP.md`).
//!
//! Each identity is an SDK agent of its own (its own connection, its nkey if configured):
//! what it sends goes through the SDK's outbound path, and every command sent to it, core or
//! durable, passes its inbound pipeline and waits in its [`inbox::EdgeInbox`] for a poll.

mod a2a;
mod api;
mod auth;
pub mod config;
mod inbox;
mod limits;
mod openapi;
mod sap;
mod tasks;
mod ws;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use agent_sdk::{Agent, AgentOptions, Subjects};
use axum::routing::{get, post};
use broker_adapter::BrokerOptions;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{ConnectionSecurity, CoordinatorConfig};
use crate::error::{Error, ErrorKind, Result};
pub use config::GatewayConfig;
use inbox::{EdgeHandler, EdgeInbox};

/// One edge identity: its agent on the bus and the messages waiting for its polls.
pub(crate) struct Edge {
    agent: Agent,
    inbox: Arc<EdgeInbox>,
}

/// What the routes share.
pub(crate) struct GatewayState {
    config: GatewayConfig,
    auth: auth::Authenticator,
    edges: HashMap<String, Edge>,
    /// Cancelled when the gateway stops: open WebSockets close.
    stop: CancellationToken,
    limits: limits::Limits,
}

/// A running gateway. [`Gateway::stop`] stops it and waits; dropping it stops the listener
/// without waiting.
pub struct Gateway {
    /// Where the HTTP gateway listens, if it does.
    addr: Option<SocketAddr>,
    stop: CancellationToken,
    /// The HTTP listener and the SAP agents' tasks.
    tracker: TaskTracker,
    state: Arc<GatewayState>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// The connection name of an edge identity's agent.
fn connection_name(id: &str) -> String {
    format!("chorus-gateway-{id}")
}

async fn connect_edge(
    config: &CoordinatorConfig,
    subjects: &Subjects,
    identity: &config::EdgeIdentity,
    stop: &CancellationToken,
) -> Result<Edge> {
    let gateway = &config.gateway;
    let security = ConnectionSecurity {
        nkey_seed_file: identity
            .nkey_seed_file
            .clone()
            .or_else(|| config.security.nkey_seed_file.clone()),
        ..config.security.clone()
    };
    let inbox_prefix = subjects
        .inbox_prefix(&identity.id)
        .map_err(Error::wrap(ErrorKind::Config, "gateway: identity"))?;
    let broker = security.apply(
        BrokerOptions::new([config.servers.as_str()])
            .name(connection_name(&identity.id))
            .inbox_prefix(inbox_prefix),
    )?;
    let mut options = AgentOptions::new(identity.id.clone())
        .root(&config.root)
        .broker(broker)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        // Durable commands to the identity wait in its inbox stream for a poll.
        .durable_inbox(true)
        .shutdown_timeout(config.shutdown_timeout());
    if let Some(breaker) = &config.circuit_breaker {
        options = options.circuit_breaker(breaker.policy());
    }
    // Signed only with the identity's own key: the coordinator's would not verify as it.
    if identity.nkey_seed_file.is_some()
        && let Some(signing) = security.identity()?
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
    Ok(Edge { agent, inbox })
}

impl Gateway {
    /// Connects every edge identity, registers the SAP agents of `config.gateway.sap` and
    /// listens on `config.gateway.listen` if set (port 0 picks a free one). Fails with a
    /// configuration error when the gateway has nothing to do.
    pub async fn start(config: &CoordinatorConfig) -> Result<Gateway> {
        let gateway = &config.gateway;
        gateway.validate()?;
        if !gateway.enabled() {
            return Err(Error::new(
                ErrorKind::Config,
                "gateway: no listen address and no SAP agents",
            ));
        }
        let auth = auth::Authenticator::new(gateway)?;
        let subjects =
            Subjects::new(&config.root).map_err(Error::wrap(ErrorKind::Config, "invalid root"))?;
        let stop = CancellationToken::new();
        let mut edges = HashMap::new();
        for identity in &gateway.identities {
            let edge = connect_edge(config, &subjects, identity, &stop).await?;
            edges.insert(identity.id.clone(), edge);
        }
        let state = Arc::new(GatewayState {
            config: gateway.clone(),
            auth,
            edges,
            stop: stop.clone(),
            limits: limits::Limits::new(gateway),
        });
        let tracker = TaskTracker::new();
        let mut started = Gateway {
            addr: None,
            stop: stop.clone(),
            tracker: tracker.clone(),
            state: Arc::clone(&state),
        };
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
        let Some(listen) = gateway.listen else {
            tracing::info!(sap = gateway.sap.len(), "gateway started without HTTP");
            return Ok(started);
        };
        let app = axum::Router::new()
            .route("/v1/agents", get(api::agents))
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
                "/a2a/capabilities/{capability}/.well-known/agent-card.json",
                get(a2a::capability_card),
            )
            .route("/a2a/capabilities/{capability}/", post(a2a::capability_rpc))
            .route("/a2a/capabilities/{capability}", post(a2a::capability_rpc))
            .route("/agent/message", post(api::agentify))
            .route("/openapi.json", get(api::openapi))
            .fallback(api::not_found)
            .layer(axum::middleware::from_fn_with_state(
                Arc::clone(&state),
                limits::concurrency,
            ))
            .layer(axum::extract::DefaultBodyLimit::max(gateway.max_body_bytes))
            .with_state(Arc::clone(&state));
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
        tracker.spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { shutdown.cancelled().await })
                .await;
            if let Err(err) = served {
                tracing::error!(error = %err, "gateway listener failed");
            }
        });
        tracing::info!(%addr, identities = state.edges.len(), "gateway listening");
        started.addr = Some(addr);
        Ok(started)
    }

    /// Where the HTTP gateway listens, if it does.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.addr
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
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop.cancel();
        for edge in self.state.edges.values() {
            edge.agent.stop();
        }
    }
}
