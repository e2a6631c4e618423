//! The metrics listener: `/metrics`, `/healthz` and `/readyz` on their own address, and the
//! coordinator's Prometheus service discovery (`/sd/agents`) beside them.
//!
//! It serves the process-wide registry the SDK's agents and the coordinator record into
//! ([`chorus_sdk::metrics::registry`]), so a process running the coordinator and agents (as
//! `chorus up` does) has one `/metrics`.

use chorus_sdk::Report;
use std::net::SocketAddr;
use std::sync::Arc;

use chorus_sdk::metrics::{registry, render};
use tokio_util::sync::CancellationToken;

/// The content type of the Prometheus text format.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What `/readyz` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// 200: ready for work.
    Ready,
    /// 503, with the reason as the body.
    NotReady(&'static str),
}

/// Asked on every `/readyz` request.
pub type ReadinessCheck = Arc<dyn Fn() -> Readiness + Send + Sync>;

/// A running metrics listener. Stopped by [`MetricsServer::stop`], or when dropped.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl MetricsServer {
    /// Serves the process registry on `addr` (port 0 picks a free port). `ready` answers
    /// `/readyz`; `/healthz` answers 200 while the process runs; `routes` are served beside
    /// them (an empty `Router` for none).
    ///
    /// # Errors
    /// The I/O error when `addr` cannot be bound: in use, or not an address of this machine.
    pub async fn start(
        addr: SocketAddr,
        ready: ReadinessCheck,
        routes: axum::Router,
    ) -> std::io::Result<MetricsServer> {
        use axum::http::StatusCode;
        use axum::routing::get;
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let app = axum::Router::new()
            .route(
                "/metrics",
                get(|| async { ([("content-type", METRICS_CONTENT_TYPE)], render(registry())) }),
            )
            .route("/healthz", get(|| async { "ok\n" }))
            .route(
                "/readyz",
                get(move || {
                    let ready = Arc::clone(&ready);
                    async move {
                        match ready() {
                            Readiness::Ready => (StatusCode::OK, "ready\n".to_owned()),
                            Readiness::NotReady(why) => {
                                (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"))
                            }
                        }
                    }
                }),
            )
            .merge(routes);
        let stop = CancellationToken::new();
        let shutdown = stop.clone();
        // Owned by this value: `stop` waits for it, dropping cancels it.
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { shutdown.cancelled().await })
                .await;
            if let Err(err) = served {
                tracing::error!(error = %Report(&err), "metrics listener failed");
            }
        });
        Ok(MetricsServer {
            addr,
            stop,
            task: Some(task),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops listening and waits for the listener task.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
