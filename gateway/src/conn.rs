//! Serving HTTP connections so that no client can hold the gateway: every connection is bounded
//! in time and, until it proves who is calling, in number per peer.
//!
//! - Request headers must arrive within [`HEADER_READ_TIMEOUT`] (hyper closes the connection
//!   otherwise), and so must the next request's on a kept-alive connection: an idle one is
//!   closed after that long.
//! - A connection that has not yet carried an authenticated request is *unproven*. A peer (an
//!   IP address) holds at most `max_unproven_connections_per_peer` of them; one more closes the
//!   peer's oldest unproven connection, so a client that floods half-open connections loses
//!   its own, never a caller's that authenticated, and the caller's new connection gets its
//!   turn.
//! - TCP_NODELAY on every accepted socket: an answer written in pieces (a server-sent event
//!   stream) does not wait for the client's delayed ACK.
//!
//! The request body's deadline and the concurrency limits counted per identity are the
//! `limits` room's, which marks a connection proven through the [`Conn`] each request carries.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_sdk::Report;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a client has to send a request's headers, and an idle kept-alive connection to
/// start its next request.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a connection is given to finish its answer when the gateway stops.
const DRAIN: Duration = Duration::from_secs(5);

/// A listener of connections and their peers' addresses: plain TCP, or TLS with the handshake
/// done.
pub(crate) trait Accept: Send + 'static {
    /// A connection.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The next connection; `None` once no more will come.
    fn next(&mut self) -> impl Future<Output = Option<(Self::Io, SocketAddr)>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;

    async fn next(&mut self) -> Option<(Self::Io, SocketAddr)> {
        loop {
            match self.accept().await {
                Ok((stream, peer)) => {
                    if let Err(err) = stream.set_nodelay(true) {
                        tracing::debug!(%peer, error = %err, "gateway: TCP_NODELAY not set");
                    }
                    return Some((stream, peer));
                }
                Err(err) => {
                    // Out of descriptors, a reset before accept: the next one may work.
                    tracing::debug!(error = %err, "gateway: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// The unproven connections of every peer, oldest first, each with the token that closes it.
#[derive(Debug)]
pub(crate) struct Peers {
    max_per_peer: usize,
    next_id: AtomicU64,
    unproven: Mutex<HashMap<IpAddr, VecDeque<(u64, CancellationToken)>>>,
}

impl Peers {
    pub(crate) fn new(max_per_peer: usize) -> Arc<Peers> {
        Arc::new(Peers {
            max_per_peer: max_per_peer.max(1),
            next_id: AtomicU64::new(0),
            unproven: Mutex::new(HashMap::new()),
        })
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<IpAddr, VecDeque<(u64, CancellationToken)>>> {
        self.unproven
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new connection from `peer`, unproven; the peer's oldest unproven one is closed when
    /// it already holds as many as it may.
    pub(crate) fn admit(self: &Arc<Self>, peer: IpAddr) -> Conn {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let close = CancellationToken::new();
        let mut unproven = self.lock();
        let queue = unproven.entry(peer).or_default();
        while queue.len() >= self.max_per_peer {
            if let Some((_, oldest)) = queue.pop_front() {
                oldest.cancel();
                crate::metrics::count_refusal("unproven_connection_closed");
            }
        }
        queue.push_back((id, close.clone()));
        Conn {
            id,
            peer,
            close,
            proven: Arc::new(AtomicBool::new(false)),
            known: Arc::default(),
            peers: Arc::clone(self),
        }
    }

    fn forget(&self, peer: IpAddr, id: u64) {
        let mut unproven = self.lock();
        if let Some(queue) = unproven.get_mut(&peer) {
            queue.retain(|(i, _)| *i != id);
            if queue.is_empty() {
                unproven.remove(&peer);
            }
        }
    }

    /// Unproven connections held now, by every peer.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.lock().values().map(VecDeque::len).sum()
    }
}

/// A credential's bytes and the identity they named.
type Proved = (Vec<u8>, String);

/// One connection, as each of its requests carries it (a request extension).
#[derive(Debug, Clone)]
pub(crate) struct Conn {
    id: u64,
    peer: IpAddr,
    close: CancellationToken,
    proven: Arc<AtomicBool>,
    /// The credential (a header's bytes) this connection last proved, and the identity it
    /// named: a kept-alive caller's next requests are placed without checking it again (its
    /// handler checks it as always).
    known: Arc<Mutex<Option<Proved>>>,
    peers: Arc<Peers>,
}

impl Conn {
    /// Marks the connection as one that carried a request whose `credential` checked as
    /// `identity`: no longer counted against its peer, never closed to make room, and the
    /// credential remembered for the connection's next requests.
    pub(crate) fn prove(&self, credential: Option<&[u8]>, identity: &str) {
        if !self.proven.swap(true, Ordering::AcqRel) {
            self.peers.forget(self.peer, self.id);
        }
        if let Some(credential) = credential {
            *self
                .known
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some((credential.to_vec(), identity.to_owned()));
        }
    }

    /// The identity `credential` named when this connection proved it, if it did.
    pub(crate) fn known(&self, credential: &[u8]) -> Option<String> {
        let known = self
            .known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        known
            .as_ref()
            .filter(|(c, _)| c.as_slice() == credential)
            .map(|(_, identity)| identity.clone())
    }
}

/// Forgets a connection when its task ends.
struct ConnGuard(Conn);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.peers.forget(self.0.peer, self.0.id);
    }
}

/// Serves `app` on connections from `listener` until `stop`, each connection a task of
/// `tracker`.
pub(crate) async fn serve<L: Accept>(
    mut listener: L,
    app: axum::Router,
    peers: Arc<Peers>,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    loop {
        let (io, peer) = tokio::select! {
            next = listener.next() => match next {
                Some(next) => next,
                None => break,
            },
            _ = stop.cancelled() => break,
        };
        let conn = peers.admit(peer.ip());
        let stop = stop.clone();
        let app = app.clone();
        tracker.spawn(connection(io, peer, conn, app, stop));
    }
}

async fn connection<I>(
    io: I,
    peer: SocketAddr,
    conn: Conn,
    app: axum::Router,
    stop: CancellationToken,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let close = conn.close.clone();
    // Forgets the connection however this task ends.
    let _guard = ConnGuard(conn.clone());
    let service =
        hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
            request.extensions_mut().insert(conn.clone());
            let request = request.map(axum::body::Body::new);
            let mut app = app.clone();
            async move {
                use tower_service::Service as _;
                app.call(request).await
            }
        });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .keep_alive(true);
    let served = http
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(served);
    let outcome = tokio::select! {
        outcome = served.as_mut() => outcome,
        _ = close.cancelled() => {
            tracing::debug!(%peer, "gateway: an unproven connection closed to make room for its peer's next");
            return;
        }
        _ = stop.cancelled() => {
            served.as_mut().graceful_shutdown();
            match tokio::time::timeout(DRAIN, served.as_mut()).await {
                Ok(outcome) => outcome,
                Err(_) => return,
            }
        }
    };
    if let Err(err) = outcome {
        tracing::debug!(%peer, error = %Report(&err), "gateway: connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_over_its_unproven_connections_loses_its_oldest_and_proven_ones_are_never_counted() {
        let peers = Peers::new(2);
        let a: IpAddr = [127, 0, 0, 2].into();
        let b: IpAddr = [127, 0, 0, 3].into();
        let first = peers.admit(a);
        let proven = peers.admit(a);
        proven.prove(Some(b"key"), "web-ui");
        assert_eq!(proven.known(b"key").as_deref(), Some("web-ui"));
        assert_eq!(proven.known(b"another key"), None);
        let second = peers.admit(a);
        assert_eq!(peers.held(), 2, "the proven one no longer counts");
        assert!(!first.close.is_cancelled() && !second.close.is_cancelled());
        let third = peers.admit(a);
        assert!(first.close.is_cancelled(), "the oldest unproven one closed");
        assert!(!proven.close.is_cancelled() && !second.close.is_cancelled());
        assert!(!third.close.is_cancelled());
        // Another peer has its own count.
        let other = peers.admit(b);
        assert!(!other.close.is_cancelled() && !second.close.is_cancelled());
        drop(ConnGuard(second));
        drop(ConnGuard(third));
        drop(ConnGuard(other));
        assert_eq!(peers.held(), 0);
    }
}
