//! What answers at an address that did not speak NATS: the reason a client command names when
//! it was pointed at a metrics, monitoring or HTTP port.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::local::host_port;

/// How long each step of the probe waits: the connect, the server's first bytes, an HTTP answer.
const STEP: Duration = Duration::from_millis(800);

/// What listens at the first address of `urls`, when it is not a NATS server: `None` when
/// nothing answers there at all or a NATS server does (its `INFO` line), so the caller's own
/// error stands.
pub async fn not_nats(urls: &str) -> Option<String> {
    let (host, port) = host_port(urls)?;
    let mut stream = tokio::time::timeout(STEP, TcpStream::connect((host.as_str(), port)))
        .await
        .ok()?
        .ok()?;
    let mut first = [0u8; 256];
    // A NATS server speaks first; an HTTP server waits for a request.
    match tokio::time::timeout(STEP, stream.read(&mut first)).await {
        Ok(Ok(0)) => {
            return Some(format!(
                "something at {host}:{port} accepts connections and closes them without a word; \
                 a NATS server (port 4222 by default) sends INFO first"
            ));
        }
        Ok(Ok(n)) => {
            let text = &first[..n];
            if text.starts_with(b"INFO ") {
                return None;
            }
            return Some(format!(
                "{host}:{port} answers, but not as NATS (it sent {:?}); a NATS server (port \
                 4222 by default) sends INFO first",
                printable(text)
            ));
        }
        Ok(Err(_)) => return None,
        Err(_) => {}
    }
    let request = format!("GET / HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let n = tokio::time::timeout(STEP, stream.read(&mut first))
        .await
        .ok()?
        .ok()?;
    let text = &first[..n];
    if text.starts_with(b"HTTP/") {
        let status = printable(
            text.split(|b| *b == b'\r' || *b == b'\n')
                .next()
                .unwrap_or(text),
        );
        Some(format!(
            "an HTTP server answers at {host}:{port} ({status}), not NATS: is it the \
             coordinator's metrics (9464), the NATS monitoring port (8222) or the gateway? NATS \
             clients connect to the client port (4222 by default)"
        ))
    } else {
        Some(format!(
            "{host}:{port} accepts connections but never speaks NATS; a NATS server (port 4222 \
             by default) sends INFO first"
        ))
    }
}

/// The first bytes as text a person can read: at most 60 characters, control bytes escaped.
fn printable(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .chars()
        .take(60)
        .flat_map(char::escape_default)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A one-connection server on loopback that runs `serve` on its socket.
    async fn serving<F, Fut>(serve: F) -> (String, tokio::task::JoinHandle<()>)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let task = tokio::spawn(async move {
            if let Ok((socket, _)) = listener.accept().await {
                serve(socket).await;
            }
        });
        (format!("nats://{addr}"), task)
    }

    #[tokio::test]
    async fn an_http_port_is_named_as_one() {
        let (url, task) = serving(|mut s| async move {
            let mut buf = [0u8; 512];
            let _ = s.read(&mut buf).await;
            let _ = s
                .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                .await;
        })
        .await;
        let said = not_nats(&url).await.expect("not NATS");
        assert!(said.contains("an HTTP server answers"), "{said}");
        assert!(said.contains("HTTP/1.1 404 Not Found"), "{said}");
        task.await.expect("server");
    }

    #[tokio::test]
    async fn a_nats_server_and_an_empty_port_leave_the_error_alone() {
        let (url, task) = serving(|mut s| async move {
            let _ = s.write_all(b"INFO {\"server_id\":\"x\"}\r\n").await;
        })
        .await;
        assert_eq!(not_nats(&url).await, None);
        task.await.expect("server");
        let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = closed.local_addr().expect("addr");
        drop(closed);
        assert_eq!(not_nats(&format!("nats://{addr}")).await, None);
    }

    #[tokio::test]
    async fn another_protocol_is_quoted() {
        let (url, task) = serving(|mut s| async move {
            let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").await;
        })
        .await;
        let said = not_nats(&url).await.expect("not NATS");
        assert!(said.contains("SSH-2.0-OpenSSH_9.6"), "{said}");
        task.await.expect("server");
    }
}
