//! The Chorus coordinator service.
//!
//! The [`Coordinator`] keeps the agent registry and answers discovery, fans broadcasts out
//! with per-recipient reports, dead-letters what agents give up on (fed by JetStream's
//! advisories), sweeps expired payloads and serves Prometheus metrics; with a `[gateway]`
//! section it also runs the edge gateway (`chorus-gateway`). `chorus serve` runs it.
//! [`creds`] writes the `nats.conf` authorization entries of the bus's roles.
//!
//! The library returns its own [`Error`], whose [`ErrorKind`] a caller matches on.

// Every public item is documented, and every fallible one says how it fails.
#![warn(missing_docs, clippy::missing_errors_doc)]

pub mod authority;
pub mod config;
pub mod creds;
pub mod error;
pub mod service;

pub use config::CoordinatorConfig;
pub use error::{Error, ErrorKind, Result};
pub use service::Coordinator;
pub use service::http::MetricsServer;

/// The git revision the coordinator was built from, or `unknown` outside a git checkout; the
/// `chorus_build_info` metric and `chorus --version` show it.
pub const REVISION: &str = env!("CHORUS_GIT_REVISION");

/// The version and the revision, as `chorus --version` prints them: `0.1.0 (abc123def456)`.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("CHORUS_GIT_REVISION"),
    ")"
);
