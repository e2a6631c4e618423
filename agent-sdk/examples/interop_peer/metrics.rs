//! The peer's part for the Python SDK's metrics tests: with `PEER_METRICS_PORT` set it serves
//! `chorus_sdk::metrics::render(chorus_sdk::metrics::registry())` at
//! `http://127.0.0.1:<port>/metrics` (port 0: one the system picks) and announces that URL in
//! its manifest (`metrics_url`), printing `interop_peer: metrics at <url>`. With
//! `PEER_BREAKER_FAILURES` set its calls go through circuit breakers that open after that many
//! failures in a row (and stay open a minute), so its breaker series appear.

use std::time::Duration;

use chorus_sdk::{Agent, AgentOptions, BreakerPolicy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The most bytes of a request's head the listener reads.
const MAX_HEAD_BYTES: usize = 8192;
/// How long a scrape may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Settings of this part, from the environment.
pub fn options(mut options: AgentOptions) -> Result<AgentOptions, Box<dyn std::error::Error>> {
    if let Ok(failures) = std::env::var("PEER_BREAKER_FAILURES") {
        let failures: u32 = failures
            .parse()
            .map_err(|_| format!("PEER_BREAKER_FAILURES {failures:?}: a number"))?;
        options = options.circuit_breaker(BreakerPolicy::new(failures, Duration::from_secs(60)));
    }
    if let Ok(port) = std::env::var("PEER_METRICS_PORT") {
        let port: u16 = port
            .parse()
            .map_err(|_| format!("PEER_METRICS_PORT {port:?}: a port number"))?;
        let listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
        listener.set_nonblocking(true)?;
        let url = format!("http://{}/metrics", listener.local_addr()?);
        let listener = tokio::net::TcpListener::from_std(listener)?;
        tokio::spawn(serve(listener));
        println!("interop_peer: metrics at {url}");
        options = options.metrics_url(url);
    }
    Ok(options)
}

/// The handlers of this part.
pub async fn register(_peer: &Agent) -> Result<(), Box<dyn std::error::Error>> {
    Ok(())
}

/// Answers each connection with the process's metrics, until the process ends.
async fn serve(listener: tokio::net::TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(answer(stream));
            }
            Err(err) => {
                eprintln!("interop_peer: metrics listener: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Reads one request's head and answers it: the metrics for `GET /metrics`, 404 otherwise.
async fn answer(mut stream: tokio::net::TcpStream) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(READ_TIMEOUT, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD_BYTES {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        true
    })
    .await;
    if !matches!(read, Ok(true)) {
        return;
    }
    let line = String::from_utf8_lossy(&head);
    let target = line.split_whitespace().take(2).collect::<Vec<_>>();
    let (status, body) = if target == ["GET", "/metrics"] {
        (
            "200 OK",
            chorus_sdk::metrics::render(chorus_sdk::metrics::registry()),
        )
    } else {
        ("404 Not Found", "not found\n".to_owned())
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}
