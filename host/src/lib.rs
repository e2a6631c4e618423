//! The host of agents hosted by the bus (docs/HOSTING.md): the [`process`] supervision a
//! `chorus host` does on its machine (start, limit, log, restart with backoff, stop), the
//! [`build`] of an agent from a repository before it starts, and the host on the bus
//! ([`service`]: its commands, health, reports and events). The model it runs (manifests,
//! the protocol, placement and reconciliation) is `chorus-hosting`'s, re-exported here.

// Every public item is documented, and every fallible one says how it fails.
#![warn(missing_docs, clippy::missing_errors_doc)]

pub mod build;
pub mod process;
pub mod service;

// The model the daemon runs, its own crate (the coordinator needs it and not the daemon);
// named here as before.
pub use chorus_hosting::{duration, manifest, placement, protocol, reconcile, replica};
