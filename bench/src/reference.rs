//! The official a2a-sdk's own A2A server (Python, `python/benchmarks/a2a_reference_server.py`),
//! started for the gateway scenario and stopped when dropped.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};

/// The server's script, carried in the binary so `chorus bench` runs from anywhere.
const SCRIPT: &str = include_str!("../../python/benchmarks/a2a_reference_server.py");
/// How long the server may take to listen.
const START: Duration = Duration::from_secs(30);

/// A running reference server; killed on drop.
pub(crate) struct A2aServer {
    child: std::process::Child,
    addr: SocketAddr,
}

impl A2aServer {
    /// Starts it with `python` on a free loopback port and waits until it accepts connections.
    pub(crate) async fn start(python: &Path) -> anyhow::Result<A2aServer> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let child = std::process::Command::new(python)
            .args(["-c", SCRIPT, &port.to_string()])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start {}", python.display()))?;
        let mut server = A2aServer { child, addr };
        let deadline = tokio::time::Instant::now() + START;
        loop {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                bail!(
                    "the a2a-sdk server exited ({status}): is a2a-sdk[http-server] installed for {}? (scripts/install-python-sdk)",
                    python.display()
                );
            }
            if tokio::time::Instant::now() > deadline {
                bail!("the a2a-sdk server did not listen within {START:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for A2aServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
