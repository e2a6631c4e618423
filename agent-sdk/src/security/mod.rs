//! Message security: ed25519 signatures over nkey identities ([`Identity`], [`Verifier`]),
//! end-to-end encryption for named recipients ([`encryption`]), and the application's own
//! access rules (permissions and per-sender rate limits, in `access`); and how a connection
//! reaches a secured NATS ([`ConnectionSecurity`]).

pub(crate) mod access;
mod connection;
pub mod encryption;
mod identity;
pub mod replay;
mod session;
pub(crate) mod signing;

pub use connection::{ConnectionSecurity, ConnectionSecurityError};
pub use signing::*;

/// Suffix of the key-value bucket of seen message ids
/// ([`crate::AgentOptions::persist_seen_ids`]).
pub const SEEN_BUCKET: &str = "seen";
