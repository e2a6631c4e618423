//! The Chorus broker adapter: everything that touches NATS.
//!
//! No other crate in the workspace imports `async_nats`; they use [`Broker`], [`Subscription`],
//! [`Message`] and [`Headers`] from here, and match on [`ErrorKind`] to tell a timeout from
//! nobody listening from a refusal.
//!
//! The `raw` module, unwrapped async-nats for `chorus bench`'s baseline, is behind the `raw`
//! feature, off by default; the `nats-server` launcher for tests and the local demo is its own
//! crate, `chorus-nats-server`.
//!
//! The NATS client is `chorus-async-nats`, a fork of async-nats 0.51.0 whose parser delivers a
//! message with a malformed header block instead of resetting the connection.

// Every public item is documented, and every fallible one says how it fails.
#![warn(missing_docs, clippy::missing_errors_doc)]

mod classify;
mod client;
pub mod error;
mod events;
pub mod jetstream;
mod message;
mod options;
#[cfg(feature = "raw")]
pub mod raw;
mod subject;

/// A received message's subject, shared rather than copied: cloning one counts a reference to
/// the bytes the client read.
pub use async_nats::Subject;
pub use client::{Broker, Subscription};
pub use error::{Error, ErrorKind, PermissionViolation, Report, Result};
pub use events::{ConnectionEvent, ConnectionStats, StatsSnapshot};
pub use jetstream::{
    BatchMessage, Consumer, ConsumerSpec, ConsumerState, Deliveries, Delivery, Follow, JetStream,
    Kv, KvEntry, KvOp, KvSpec, KvWatch, ObjectEntry, ObjectSpec, Objects, PubAck, StoredMessage,
    StreamSpec, StreamState,
};
pub use message::{Headers, Message};
pub use options::{
    BrokerOptions, Credentials, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PING_INTERVAL,
    DEFAULT_RECONNECT_MAX_DELAY, DEFAULT_SUBSCRIPTION_CAPACITY, TlsOptions, reconnect_delay,
};
pub use subject::{MAX_SUBJECT_LEN, Wildcards, validate_queue_group, validate_subject};
