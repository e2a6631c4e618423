//! The Chorus coordinator service and command-line tool (`chorus`).
//!
//! This release carries the local launcher and demo (`chorus up`) and the client commands
//! (`send`, `request`, `listen`); the coordinator service itself (`chorus serve`: registry,
//! broadcast, retries, dead letters, metrics) builds on them.

pub mod demo;
pub mod duration;
pub mod local;
