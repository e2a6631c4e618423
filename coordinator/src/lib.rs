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
