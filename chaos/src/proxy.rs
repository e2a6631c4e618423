//! A TCP proxy on loopback that can be cut: every connection through it closed at once and
//! new ones refused, until it is healed. The partition scenario puts one on each route of one
//! cluster node; the leaf-node test one between a leaf and its hub.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long the proxy waits to reach its target for one connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long [`Proxy::close`] waits for its tasks.
const CLOSE_DEADLINE: Duration = Duration::from_secs(5);

/// One listener forwarding every connection to a target set after it listens.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
    tasks: TaskTracker,
}

#[derive(Debug)]
struct State {
    target: Option<String>,
    /// `None` while cut; otherwise the token the live connections end on.
    open: Option<CancellationToken>,
}

impl Proxy {
    /// Listens on a free loopback port; connections are refused until a target is set.
    pub async fn bind() -> anyhow::Result<Proxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .context("cannot bind a proxy on loopback")?;
        let addr = listener.local_addr().context("proxy address")?;
        let state = Arc::new(Mutex::new(State {
            target: None,
            open: Some(CancellationToken::new()),
        }));
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let (s, st, t) = (Arc::clone(&state), stop.clone(), tasks.clone());
        tasks.spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = st.cancelled() => break,
                };
                let Ok((client, _)) = accepted else { continue };
                let (target, open) = {
                    let state = s.lock().unwrap_or_else(|p| p.into_inner());
                    (state.target.clone(), state.open.clone())
                };
                // Cut, or nowhere to go yet: the connection is dropped, as a refusal.
                let (Some(target), Some(open)) = (target, open) else {
                    continue;
                };
                t.spawn(forward(client, target, open));
            }
        });
        Ok(Proxy {
            addr,
            state,
            stop,
            tasks,
        })
    }

    /// Where it listens, `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// A handle that sets the target from any thread (the cluster builder runs on a blocking
    /// one).
    pub fn target_setter(&self) -> impl Fn(&str) + Send + Sync + 'static {
        let state = Arc::clone(&self.state);
        move |target: &str| {
            state.lock().unwrap_or_else(|p| p.into_inner()).target = Some(target.to_owned());
        }
    }

    /// Closes every connection through it and refuses new ones.
    pub fn cut(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(open) = state.open.take() {
            open.cancel();
        }
    }

    /// Lets connections through again.
    pub fn heal(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.open.is_none() {
            state.open = Some(CancellationToken::new());
        }
    }

    /// Stops listening, closes every connection and waits for its tasks.
    pub async fn close(self) {
        self.cut();
        self.stop.cancel();
        self.tasks.close();
        let _ = tokio::time::timeout(CLOSE_DEADLINE, self.tasks.wait()).await;
    }
}

impl Drop for Proxy {
    /// A proxy left without [`close`](Proxy::close) stops listening and closes its
    /// connections; its tasks end on their own.
    fn drop(&mut self) {
        self.cut();
        self.stop.cancel();
    }
}

/// Copies both ways between `client` and `target` until either side closes or `open` is
/// cancelled.
async fn forward(mut client: TcpStream, target: String, open: CancellationToken) {
    let upstream =
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target.as_str())).await {
            Ok(Ok(s)) => s,
            _ => return,
        };
    let mut upstream = upstream;
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
        _ = open.cancelled() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo_server() -> (String, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        (addr, task)
    }

    async fn echoes(addr: &str) -> bool {
        let attempt = async {
            let mut s = TcpStream::connect(addr).await.ok()?;
            s.write_all(b"ping").await.ok()?;
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).await.ok()?;
            Some(&buf == b"ping")
        };
        tokio::time::timeout(Duration::from_secs(5), attempt)
            .await
            .ok()
            .flatten()
            .unwrap_or(false)
    }

    #[tokio::test]
    async fn a_cut_proxy_closes_its_connections_and_refuses_until_healed() {
        let (target, echo) = echo_server().await;
        let proxy = Proxy::bind().await.expect("bind");
        assert!(!echoes(&proxy.addr()).await, "no target yet");
        proxy.target_setter()(&target);
        assert!(echoes(&proxy.addr()).await);

        let mut live = TcpStream::connect(proxy.addr()).await.expect("connect");
        live.write_all(b"x").await.expect("write");
        let mut one = [0u8; 1];
        live.read_exact(&mut one).await.expect("echo");
        proxy.cut();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), live.read_to_end(&mut rest))
            .await
            .expect("closed within the deadline");
        assert!(closed.is_ok_and(|n| n == 0) || rest.is_empty());
        assert!(!echoes(&proxy.addr()).await, "refused while cut");

        proxy.heal();
        assert!(echoes(&proxy.addr()).await);
        proxy.close().await;
        echo.abort();
    }
}
