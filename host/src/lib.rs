//! Agents hosted by the bus (docs/HOSTING.md): an agent's [`manifest`] (what to run, with which
//! resources, how many replicas, where, how to restart and check it), the [`process`]
//! supervision a `chorus host` does on its machine (start, limit, log, restart with backoff,
//! stop), the [`build`] of an agent from a repository before it starts, the host on the bus ([`service`]: its commands, health, reports and events), and
//! what the coordinator decides with them: [`placement`] of replicas on hosts and
//! [`reconcile`]iation of the desired state with what the hosts run ([`protocol`] holds what
//! they say to each other).

// Every public item is documented, and every fallible one says how it fails.
#![warn(missing_docs, clippy::missing_errors_doc)]

pub mod build;
pub mod duration;
pub mod manifest;
pub mod placement;
pub mod process;
pub mod protocol;
pub mod reconcile;
pub mod service;
