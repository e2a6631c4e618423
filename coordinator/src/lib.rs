//! The Chorus coordinator service and command-line tool (`chorus`).
//!
//! `chorus serve` runs the [`Coordinator`]: the agent registry and discovery, broadcast with
//! per-recipient reports, the dead-letter queue fed by JetStream advisories, and Prometheus
//! metrics. `chorus up` runs a local NATS server, a coordinator and the demo agents;
//! `send`, `request`, `listen`, `agents`, `broadcast` and `dlq` talk to any running bus.

pub mod bench;
pub mod certs;
pub mod config;
pub mod creds;
pub mod demo;
pub mod duration;
pub mod local;
pub mod otel;
pub mod service;

pub use config::CoordinatorConfig;
pub use service::Coordinator;

/// An error and its causes on one line, each cause once: the adapter's and the SDK's errors
/// already name their source in their own text, so a cause whose text is already there is
/// left out rather than repeated.
pub fn error_chain(err: &anyhow::Error) -> String {
    let mut out = err.to_string();
    for cause in err.chain().skip(1) {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_cause_is_told_once() {
        let inner = std::io::Error::other("disk full");
        let err = anyhow::Error::new(inner)
            .context("write failed (disk full)")
            .context("cannot create stream");
        assert_eq!(
            super::error_chain(&err),
            "cannot create stream: write failed (disk full)"
        );
        let err = anyhow::anyhow!("root").context("outer");
        assert_eq!(super::error_chain(&err), "outer: root");
    }
}
