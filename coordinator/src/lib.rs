//! The Chorus coordinator service and command-line tool (`chorus`).
//!
//! `chorus serve` runs the [`Coordinator`]: the agent registry and discovery, broadcast with
//! per-recipient reports, the dead-letter queue fed by JetStream advisories, and Prometheus
//! metrics. `chorus up` runs a local NATS server, a coordinator and the demo agents;
//! `send`, `request`, `listen`, `agents`, `broadcast` and `dlq` talk to any running bus.
//!
//! The library returns its own [`Error`], whose [`ErrorKind`] a caller matches on; the
//! `chorus` binary (`src/main.rs`, one file per subcommand under `src/cli/`) maps it to an
//! exit code.

pub mod certs;
pub mod config;
pub mod creds;
pub mod demo;
pub mod duration;
pub mod error;
pub mod gateway;
pub mod local;
pub mod otel;
pub mod service;

pub use config::CoordinatorConfig;
pub use error::{Error, ErrorKind, Result};
pub use service::Coordinator;
pub use service::http::MetricsServer;
