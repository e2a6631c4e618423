//! Connection events: what the client library reports through a callback, turned into typed
//! events, counted, logged, and offered to anyone who subscribes.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::broadcast;

use crate::classify::server_text;

/// Something that happened to a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionEvent {
    /// The first connection is up.
    Connected,
    /// The connection was lost; the client is reconnecting.
    Disconnected,
    /// The connection is back after a loss. Subscriptions are restored by the client.
    Reconnected,
    /// A subscription's buffer was full and a message for it was dropped.
    SlowConsumer {
        /// The client-side id of the subscription.
        subscription: u64,
    },
    /// The server refused something this client did: credentials, or a permission on a
    /// subject. Publishes and subscriptions refused this way fail only through this event.
    PermissionViolation(String),
    /// Another error the server reported.
    ServerError(String),
    /// An error inside the client (for example, the reconnect limit reached).
    ClientError(String),
    /// The server is shutting down gracefully and asks clients to move.
    LameDuck,
    /// The connection is draining.
    Draining,
    /// The connection is closed for good.
    Closed,
}

/// Counters of connection events since connect.
#[derive(Debug, Default)]
pub struct ConnectionStats {
    connects: AtomicU64,
    disconnects: AtomicU64,
    reconnects: AtomicU64,
    slow_consumer_drops: AtomicU64,
    permission_violations: AtomicU64,
    server_errors: AtomicU64,
    client_errors: AtomicU64,
    lame_duck: AtomicU64,
}

/// A point-in-time copy of [`ConnectionStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Successful connects, the first one included.
    pub connects: u64,
    /// Connections lost.
    pub disconnects: u64,
    /// Connections restored after a loss.
    pub reconnects: u64,
    /// Messages the client dropped for a full subscription buffer, as reported by slow
    /// consumer events (a lower bound if the client's event queue itself overflowed).
    pub slow_consumer_drops: u64,
    /// Permission violations reported by the server.
    pub permission_violations: u64,
    /// Other server errors.
    pub server_errors: u64,
    /// Client-side errors.
    pub client_errors: u64,
    /// Lame-duck notices.
    pub lame_duck: u64,
}

impl StatsSnapshot {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &StatsSnapshot) {
        self.connects += other.connects;
        self.disconnects += other.disconnects;
        self.reconnects += other.reconnects;
        self.slow_consumer_drops += other.slow_consumer_drops;
        self.permission_violations += other.permission_violations;
        self.server_errors += other.server_errors;
        self.client_errors += other.client_errors;
        self.lame_duck += other.lame_duck;
    }
}

impl ConnectionStats {
    /// Copies the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            connects: get(&self.connects),
            disconnects: get(&self.disconnects),
            reconnects: get(&self.reconnects),
            slow_consumer_drops: get(&self.slow_consumer_drops),
            permission_violations: get(&self.permission_violations),
            server_errors: get(&self.server_errors),
            client_errors: get(&self.client_errors),
            lame_duck: get(&self.lame_duck),
        }
    }
}

/// Turns client-library events into [`ConnectionEvent`]s, counts and logs them, and forwards
/// them to subscribers.
#[derive(Debug)]
pub(crate) struct EventSink {
    pub(crate) stats: ConnectionStats,
    pub(crate) tx: broadcast::Sender<ConnectionEvent>,
    name: String,
    /// Between a disconnect and the reconnect: each failed attempt is then a client error
    /// that says nothing new, logged at debug only (the loss was logged once).
    away: std::sync::atomic::AtomicBool,
}

impl EventSink {
    pub(crate) fn new(name: String) -> Self {
        let (tx, _) = broadcast::channel(256);
        EventSink {
            stats: ConnectionStats::default(),
            tx,
            name,
            away: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub(crate) fn handle(&self, event: async_nats::Event) {
        use async_nats::{Event, ServerError};
        let bump = |c: &AtomicU64| c.fetch_add(1, Ordering::Relaxed) + 1;
        let name = self.name.as_str();
        let event = match event {
            Event::Connected => {
                if bump(&self.stats.connects) == 1 {
                    tracing::debug!(connection = name, "connected to NATS");
                    ConnectionEvent::Connected
                } else {
                    bump(&self.stats.reconnects);
                    self.away.store(false, Ordering::Relaxed);
                    tracing::info!(connection = name, "reconnected to NATS");
                    ConnectionEvent::Reconnected
                }
            }
            Event::Disconnected => {
                bump(&self.stats.disconnects);
                self.away.store(true, Ordering::Relaxed);
                tracing::warn!(connection = name, "disconnected from NATS; reconnecting");
                ConnectionEvent::Disconnected
            }
            Event::SlowConsumer(sid) | Event::ServerError(ServerError::SlowConsumer(sid)) => {
                let n = bump(&self.stats.slow_consumer_drops);
                // One event per dropped message: log the first and then at powers of two.
                if n.is_power_of_two() {
                    tracing::warn!(
                        connection = name,
                        subscription = sid,
                        dropped_total = n,
                        "slow consumer: messages dropped for a full subscription buffer"
                    );
                }
                ConnectionEvent::SlowConsumer { subscription: sid }
            }
            Event::ServerError(ServerError::AuthorizationViolation) => {
                bump(&self.stats.permission_violations);
                tracing::error!(connection = name, "authorization violation");
                ConnectionEvent::PermissionViolation("authorization violation".to_owned())
            }
            Event::ServerError(ServerError::Other(text)) => {
                // The server gives permission refusals as text only; see `server_text`.
                if server_text::is_permissions_violation(&text) {
                    bump(&self.stats.permission_violations);
                    tracing::error!(connection = name, error = %text, "permission violation");
                    ConnectionEvent::PermissionViolation(text)
                } else {
                    bump(&self.stats.server_errors);
                    tracing::error!(connection = name, error = %text, "server error");
                    ConnectionEvent::ServerError(text)
                }
            }
            Event::ClientError(err) => {
                bump(&self.stats.client_errors);
                if self.away.load(Ordering::Relaxed) {
                    tracing::debug!(connection = name, error = %err, "reconnect attempt failed");
                } else {
                    tracing::error!(connection = name, error = %err, "client error");
                }
                ConnectionEvent::ClientError(err.to_string())
            }
            Event::LameDuckMode => {
                bump(&self.stats.lame_duck);
                tracing::warn!(connection = name, "server entered lame duck mode");
                ConnectionEvent::LameDuck
            }
            Event::Draining => ConnectionEvent::Draining,
            Event::Closed => {
                tracing::debug!(connection = name, "connection closed");
                ConnectionEvent::Closed
            }
        };
        // No receivers is normal; a lagging receiver loses old events but the counters hold.
        let _ = self.tx.send(event);
    }
}
