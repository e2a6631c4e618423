//! A project of a user's own, outside the Chorus workspace, depending on the SDK exactly as
//! the README's dependency lines say (`scripts/check-dependent` writes its `Cargo.toml` from
//! them). It checks which NATS client it was built with, by what that client does with a
//! message whose header block does not parse: Chorus's fork delivers it without headers and
//! keeps the connection; async-nats 0.51.0 drops the connection, losing what is in transit.
//!
//! ```sh
//! dependent nats://127.0.0.1:4222   # exit 0: the connection survived; 1: it was reset
//! ```

use std::time::Duration;

use chorus_sdk::{AgentOptions, Context, HandlerError};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// The deadline of every wait.
const WAIT: Duration = Duration::from_secs(10);
/// The good messages sent right behind the malformed one.
const GOOD: [&str; 3] = ["good-1", "good-2", "good-3"];

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let listener = AgentOptions::new("dependent-listener")
        .servers([url.as_str()])
        .connect()
        .await?;
    let (heard, mut hear) = mpsc::channel::<String>(8);
    listener
        .on_event("probe.*", move |_ctx: Context, text: String| {
            let heard = heard.clone();
            async move {
                let _ = heard.send(text).await;
                Ok::<(), HandlerError>(())
            }
        })
        .await?;
    // A plain subscription on the agent's own connection, for what a raw client sends.
    let mut raw_messages = listener.broker().subscribe("dependent.probe").await?;
    listener.broker().sync(WAIT).await?;

    // What no client library sends: an HPUB whose header block has no `NATS/1.0` line, then
    // three good messages in the same write, so they are in transit together. The server
    // forwards them as they are; a client that drops its connection on the first loses the
    // others with it.
    let header = b"X-Hostile: no-version-line\r\n\r\n";
    let payload = b"hostile";
    let mut op = format!(
        "CONNECT {{\"headers\":true,\"verbose\":false}}\r\nHPUB dependent.probe {} {}\r\n",
        header.len(),
        header.len() + payload.len()
    )
    .into_bytes();
    op.extend_from_slice(header);
    op.extend_from_slice(payload);
    op.extend_from_slice(b"\r\n");
    for good in GOOD {
        op.extend_from_slice(
            format!("PUB dependent.probe {}\r\n{good}\r\n", good.len()).as_bytes(),
        );
    }
    op.extend_from_slice(b"PING\r\n");
    let address = url.strip_prefix("nats://").unwrap_or(&url);
    let mut raw = tokio::time::timeout(WAIT, TcpStream::connect(address)).await??;
    raw.write_all(&op).await?;
    tokio::time::timeout(WAIT, read_until_pong(&mut raw)).await??;

    let mut received = Vec::new();
    while received.len() < GOOD.len() {
        match tokio::time::timeout(WAIT, raw_messages.next()).await {
            Ok(Some(message)) => {
                let text = String::from_utf8_lossy(message.payload()).into_owned();
                if text != "hostile" {
                    received.push(text);
                }
            }
            _ => break,
        }
    }

    // The agent still works end to end: an event from another agent reaches its handler.
    let sender = AgentOptions::new("dependent-sender")
        .servers([url.as_str()])
        .connect()
        .await?;
    sender
        .publish("probe.after", &"after the hostile one")
        .await?;
    let heard = tokio::time::timeout(WAIT, hear.recv()).await;
    let stats = listener.broker().stats();
    sender.shutdown().await;
    listener.shutdown().await;
    let heard = matches!(heard, Ok(Some(_)));
    if received == GOOD && heard && stats.disconnects == 0 {
        println!(
            "dependent: the connection survived the malformed header block: {} good messages \
             in transit with it arrived, and an event after it was handled",
            received.len()
        );
        Ok(())
    } else {
        eprintln!(
            "dependent: the malformed header block reset the connection: good messages \
             received {received:?} of {GOOD:?}, event after it handled: {heard}, \
             disconnects {}",
            stats.disconnects
        );
        std::process::exit(1);
    }
}

/// Reads the raw connection until the server's PONG: it has forwarded what came before.
async fn read_until_pong(raw: &mut TcpStream) -> std::io::Result<()> {
    let mut read = Vec::new();
    let mut chunk = [0u8; 4096];
    while !read.windows(6).any(|w| w == b"PONG\r\n") {
        let n = raw.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::other(
                "the server closed the raw connection",
            ));
        }
        read.extend_from_slice(&chunk[..n]);
        if read.windows(4).any(|w| w == b"-ERR") {
            return Err(std::io::Error::other(
                String::from_utf8_lossy(&read).into_owned(),
            ));
        }
    }
    Ok(())
}
