//! The model of agents hosted by the bus (docs/HOSTING.md), with no process and no connection:
//! an agent's [`manifest`] (what to run, with which resources, how many replicas, where, how
//! to restart and check it), a [`replica`] as its host reports it, what hosts and the
//! coordinator say to each other ([`protocol`]), and what the coordinator decides with them:
//! [`placement`] of replicas on hosts and [`reconcile`]iation of the desired state with what
//! the hosts run. `chorus-host` runs agents from it; the coordinator plans with it.

// Every public item is documented, and every fallible one says how it fails.
#![warn(missing_docs, clippy::missing_errors_doc)]

pub mod duration;
pub mod manifest;
pub mod placement;
pub mod protocol;
pub mod reconcile;
pub mod replica;
