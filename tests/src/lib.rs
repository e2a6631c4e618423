//! Helpers for the end-to-end tests: a real `nats-server` per test, agents connected to it,
//! and deadlines on every wait.

pub mod vectors;

use std::future::Future;
use std::time::Duration;

pub use broker_adapter::server::{NatsServer, ServerBuilder};

/// The deadline for any single wait in a test that has no reason to pick another.
pub const WAIT: Duration = Duration::from_secs(20);

/// Starts a fresh server (loopback, OS-chosen port, JetStream in a temp dir) and waits until
/// it listens. Panics with the server's log if it does not come up: a test cannot go on.
pub fn server() -> NatsServer {
    init_tracing();
    match NatsServer::start() {
        Ok(server) => server,
        Err(err) => panic!("nats-server did not start: {err}"),
    }
}

/// Awaits `fut`, failing the test if it takes longer than `limit`.
pub async fn within<F: Future>(limit: Duration, what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(limit, fut).await {
        Ok(out) => out,
        Err(_) => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

/// Agent options for `id` pointed at `server`.
pub fn agent_options(server: &NatsServer, id: &str) -> agent_sdk::AgentOptions {
    agent_sdk::AgentOptions::new(id).servers([server.url()])
}

/// Connects agent `id` to `server`.
pub async fn agent(server: &NatsServer, id: &str) -> agent_sdk::Agent {
    within(WAIT, "agent connect", agent_options(server, id).connect())
        .await
        .unwrap_or_else(|e| panic!("agent {id} did not connect: {e}"))
}

/// A raw broker connection to `server`, for sending bytes no SDK would send.
pub async fn raw_broker(server: &NatsServer) -> broker_adapter::Broker {
    within(
        WAIT,
        "broker connect",
        broker_adapter::BrokerOptions::new([server.url()])
            .name("raw-test-client")
            .connect(),
    )
    .await
    .unwrap_or_else(|e| panic!("raw broker did not connect: {e}"))
}

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}
