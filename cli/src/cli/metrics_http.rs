//! The metrics endpoint of a process the CLI runs (`chorus up`, `chorus demo-agent`): its
//! address, the URL Prometheus reaches it at, and what to say when the port is taken.

use std::net::SocketAddr;

/// Serves this process's metrics (its agents') on `addr`; returns the server and the URL to
/// announce: `url`, or the address it listens on.
pub(super) async fn serve_metrics(
    addr: SocketAddr,
    url: Option<String>,
) -> anyhow::Result<(chorus_coordinator::MetricsServer, String)> {
    let ready: chorus_coordinator::service::http::ReadinessCheck =
        std::sync::Arc::new(|| chorus_coordinator::service::http::Readiness::Ready);
    let server = chorus_coordinator::MetricsServer::start(addr, ready, axum::Router::new())
        .await
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AddrInUse {
                taken_port_error(addr)
            } else {
                anyhow::Error::new(e).context(format!("cannot listen for metrics on {addr}"))
            }
        })?;
    let bound = server.local_addr();
    let url = match url {
        Some(url) => url,
        None if bound.ip().is_unspecified() => anyhow::bail!(
            "--metrics-addr {bound} listens on every interface: pass --metrics-url with the \
             address Prometheus reaches this process at"
        ),
        None => format!("http://{bound}/metrics"),
    };
    Ok((server, url))
}

/// The error for a metrics address already taken, naming the flag that moves it.
pub(super) fn taken_port_error(addr: SocketAddr) -> anyhow::Error {
    anyhow::anyhow!(
        "the metrics address {addr} is taken (another `chorus up` or `chorus serve`?): \
         pass --metrics-addr (or set CHORUS_METRICS_ADDR) with another, or 127.0.0.1:0 \
         for any free port"
    )
}
