//! Connection events: what the client library reports through a callback, turned into typed
//! events, counted, logged, and offered to anyone who subscribes.

use std::sync::atomic::{AtomicU64, Ordering};

use std::future::Future;
use std::time::Duration;

use tokio::sync::{broadcast, watch};

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

/// How long an answer to a request sent before the connection was lost is still awaited once
/// the connection is back on the same server, before it is given up.
pub(crate) const LATE_ANSWER_GRACE: Duration = Duration::from_millis(250);

/// Whether the connection is up, how many times it has been lost, and which server (its
/// address, hashed; 0 while unknown) it was on when last read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LinkState {
    losses: u64,
    up: bool,
    server: u64,
}

/// What the connection's state is kept in, shared by its event sink and every [`Link`].
#[derive(Debug)]
pub(crate) struct LinkShared {
    state: watch::Sender<LinkState>,
    /// The client, once connected: which server it is on now.
    client: std::sync::OnceLock<async_nats::Client>,
}

impl LinkShared {
    fn new() -> Self {
        LinkShared {
            state: watch::Sender::new(LinkState::default()),
            client: std::sync::OnceLock::new(),
        }
    }

    /// The server the client is on now (its address, hashed), if known.
    fn server_now(&self) -> u64 {
        match self.client.get() {
            Some(client) => server_key(&client.server_info()),
            None => self.state.borrow().server,
        }
    }
}

/// A server told apart by the address the client reached it at: a restarted server keeps it,
/// another node of a cluster has its own.
fn server_key(info: &async_nats::ServerInfo) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (info.host.as_str(), info.port).hash(&mut h);
    h.finish().max(1)
}

/// The state of one connection, for requests that must not wait out their whole timeout for an
/// answer that went with a lost connection.
#[derive(Debug, Clone)]
pub(crate) struct Link(std::sync::Arc<LinkShared>);

impl Link {
    /// The connection as it is now, before a request is sent on it.
    pub(crate) fn sent(&self) -> Sent {
        let mut state = self.0.state.subscribe();
        let mut at = *state.borrow_and_update();
        if at.up && at.server == 0 {
            // The first request after a (re)connect learns which server it is.
            let server = self.0.server_now();
            self.0.state.send_if_modified(|l| {
                let learn = l.up && l.losses == at.losses && l.server == 0;
                if learn {
                    l.server = server;
                }
                learn
            });
            at.server = server;
            state.mark_unchanged();
        }
        Sent {
            shared: std::sync::Arc::clone(&self.0),
            state,
            at,
        }
    }

    /// [`Sent::answered`] for a request that is sent when `request` is first polled.
    pub(crate) fn answered<'a, T: Send + 'a>(
        &self,
        what: impl FnOnce() -> String + Send + 'a,
        request: impl Future<Output = crate::Result<T>> + Send + 'a,
    ) -> impl Future<Output = crate::Result<T>> + Send + 'a {
        self.sent().answered(what, request)
    }
}

/// A request sent on a connection in the state it was then, waiting for its answer.
#[derive(Debug)]
pub(crate) struct Sent {
    shared: std::sync::Arc<LinkShared>,
    state: watch::Receiver<LinkState>,
    at: LinkState,
}

/// An answer being awaited, on the heap: the futures of JetStream requests are large, and
/// these waits sit inside many callers' futures.
type Answer<'a, O> = std::pin::Pin<Box<dyn Future<Output = O> + Send + 'a>>;

impl Sent {
    /// Awaits the `answer`. If the connection is lost after the request was sent and comes
    /// back **to the same server** before the answer, the answer is awaited
    /// [`LATE_ANSWER_GRACE`] more and then given up: `None`, its outcome unknown, as after a
    /// timeout. A restarted server has forgotten the request and will never answer it. Back on
    /// another server (a cluster's other node), the request may still be answered once the
    /// cluster has moved on, and it waits as it would. So does a request sent while the
    /// connection is away, or while the server it went to is not known.
    pub(crate) fn answer<'a, O: Send + 'a>(
        self,
        answer: impl Future<Output = O> + Send + 'a,
    ) -> impl Future<Output = Option<O>> + Send + 'a {
        self.wait(Box::pin(answer))
    }

    async fn wait<O>(mut self, mut answer: Answer<'_, O>) -> Option<O> {
        if !self.at.up || self.at.server == 0 {
            return Some(answer.await);
        }
        loop {
            tokio::select! {
                biased;
                out = &mut answer => return Some(out),
                changed = self.state.changed() => {
                    if changed.is_err() {
                        return Some(answer.await);
                    }
                    let now = *self.state.borrow_and_update();
                    if now.up && now.losses != self.at.losses {
                        if let Ok(out) = tokio::time::timeout(LATE_ANSWER_GRACE, &mut answer).await {
                            return Some(out);
                        }
                        if self.shared.server_now() == self.at.server {
                            return None;
                        }
                        return Some(answer.await);
                    }
                }
            }
        }
    }

    /// [`answer`](Sent::answer) for a request whose errors are this crate's: a given-up answer
    /// is [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) (the outcome unknown), in the
    /// context `what` names.
    pub(crate) fn answered<'a, T: Send + 'a>(
        self,
        what: impl FnOnce() -> String + Send + 'a,
        answer: impl Future<Output = crate::Result<T>> + Send + 'a,
    ) -> impl Future<Output = crate::Result<T>> + Send + 'a {
        let answer = self.answer(answer);
        async move {
            answer.await.unwrap_or_else(|| {
                Err(crate::Error::new(
                    crate::ErrorKind::TimedOut,
                    format!(
                        "{}: the connection was lost before the answer came and its server \
                         restarted; whether it took effect is unknown",
                        what()
                    ),
                ))
            })
        }
    }
}

/// Turns client-library events into [`ConnectionEvent`]s, counts and logs them, and forwards
/// them to subscribers.
#[derive(Debug)]
pub(crate) struct EventSink {
    pub(crate) stats: ConnectionStats,
    pub(crate) tx: broadcast::Sender<ConnectionEvent>,
    link: std::sync::Arc<LinkShared>,
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
            link: std::sync::Arc::new(LinkShared::new()),
            name,
            away: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The connection's state, for requests that wait for an answer ([`Link::sent`]).
    pub(crate) fn link(&self) -> Link {
        Link(std::sync::Arc::clone(&self.link))
    }

    /// The client whose events these are, once it is connected: the link then knows which
    /// server it is on.
    pub(crate) fn attach(&self, client: &async_nats::Client) {
        let _ = self.link.client.set(client.clone());
        if client.connection_state() == async_nats::connection::State::Connected {
            let server = server_key(&client.server_info());
            self.link.state.send_modify(|l| {
                l.up = true;
                l.server = server;
            });
        }
    }

    pub(crate) fn handle(&self, event: async_nats::Event) {
        use async_nats::{Event, ServerError};
        let bump = |c: &AtomicU64| c.fetch_add(1, Ordering::Relaxed) + 1;
        let name = self.name.as_str();
        let event = match event {
            Event::Connected => {
                // Which server it is on is learnt by the next request (the client's view of
                // the server may not be updated yet when this event comes).
                self.link.state.send_modify(|l| {
                    l.up = true;
                    l.server = 0;
                });
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
                self.link.state.send_modify(|l| {
                    l.up = false;
                    l.losses += 1;
                });
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A link on server 7, and what plays the connection's events.
    fn link() -> (std::sync::Arc<LinkShared>, Link) {
        let shared = std::sync::Arc::new(LinkShared::new());
        shared.state.send_modify(|l| {
            l.up = true;
            l.server = 7;
        });
        (std::sync::Arc::clone(&shared), Link(shared))
    }

    fn lose(shared: &LinkShared) {
        shared.state.send_modify(|l| {
            l.up = false;
            l.losses += 1;
        });
    }

    /// Back, on server `server`.
    fn restore(shared: &LinkShared, server: u64) {
        shared.state.send_modify(|l| {
            l.up = true;
            l.server = server;
        });
    }

    const DEADLINE: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn an_answer_lost_with_a_restarted_server_is_given_up_soon_after_it_is_back() {
        let (shared, link) = link();
        let waiting = tokio::spawn(async move {
            let started = tokio::time::Instant::now();
            let out = link.sent().answer(std::future::pending::<()>()).await;
            (out, started.elapsed())
        });
        tokio::task::yield_now().await;
        lose(&shared);
        tokio::time::sleep(Duration::from_millis(50)).await;
        restore(&shared, 7);
        let (out, took) = tokio::time::timeout(DEADLINE, waiting)
            .await
            .expect("given up within the deadline")
            .expect("the task ran");
        assert_eq!(out, None);
        assert!(took >= LATE_ANSWER_GRACE, "gave up after {took:?}");
    }

    #[tokio::test]
    async fn back_on_another_server_the_answer_is_still_awaited() {
        let (shared, link) = link();
        let (answer_tx, answer_rx) = tokio::sync::oneshot::channel::<u32>();
        let waiting = tokio::spawn(async move { link.sent().answer(answer_rx).await });
        tokio::task::yield_now().await;
        lose(&shared);
        restore(&shared, 9);
        // Past the grace: a cluster's other node may still deliver the answer.
        tokio::time::sleep(LATE_ANSWER_GRACE * 2).await;
        assert!(!waiting.is_finished(), "gave up on another server");
        answer_tx.send(5).expect("still waiting");
        let out = tokio::time::timeout(DEADLINE, waiting)
            .await
            .expect("answered within the deadline")
            .expect("the task ran");
        assert_eq!(out, Some(Ok(5)));
    }

    #[tokio::test]
    async fn an_answer_that_comes_after_the_reconnect_within_the_grace_is_kept() {
        let (shared, link) = link();
        let (answer_tx, answer_rx) = tokio::sync::oneshot::channel::<u32>();
        let waiting = tokio::spawn(async move { link.sent().answer(answer_rx).await });
        tokio::task::yield_now().await;
        lose(&shared);
        restore(&shared, 7);
        tokio::time::sleep(LATE_ANSWER_GRACE / 5).await;
        answer_tx.send(7).expect("still waiting");
        let out = tokio::time::timeout(DEADLINE, waiting)
            .await
            .expect("answered within the deadline")
            .expect("the task ran");
        assert_eq!(out, Some(Ok(7)));
    }

    #[tokio::test]
    async fn a_request_started_while_the_connection_is_away_waits_for_its_answer() {
        let (shared, link) = link();
        lose(&shared);
        let (answer_tx, answer_rx) = tokio::sync::oneshot::channel::<u32>();
        let waiting = tokio::spawn(async move { link.sent().answer(answer_rx).await });
        tokio::task::yield_now().await;
        restore(&shared, 7);
        // Longer than the grace: sent on the new connection, its answer is not lost.
        tokio::time::sleep(LATE_ANSWER_GRACE * 2).await;
        assert!(
            !waiting.is_finished(),
            "gave up a request sent after the loss"
        );
        answer_tx.send(9).expect("still waiting");
        let out = tokio::time::timeout(DEADLINE, waiting)
            .await
            .expect("answered within the deadline")
            .expect("the task ran");
        assert_eq!(out, Some(Ok(9)));
    }

    #[tokio::test]
    async fn a_loss_alone_does_not_end_the_wait() {
        let (shared, link) = link();
        let waiting =
            tokio::spawn(async move { link.sent().answer(std::future::pending::<()>()).await });
        tokio::task::yield_now().await;
        lose(&shared);
        tokio::time::sleep(LATE_ANSWER_GRACE * 2).await;
        assert!(
            !waiting.is_finished(),
            "gave up while the connection was still away"
        );
        waiting.abort();
    }
}
