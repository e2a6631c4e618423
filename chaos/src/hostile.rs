//! A bare NATS protocol client that sends what no client library would: malformed header
//! blocks, garbage and oversized envelopes, truncated MessagePack.

use std::time::Duration;

use anyhow::Context as _;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::{Envelope, Kind, Performative};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The deadline of each protocol exchange.
const EXCHANGE: Duration = Duration::from_secs(10);
/// The largest oversized envelope sent: under the server's 1 MiB `max_payload` (so it is
/// forwarded), over what a durable message may be once its dead letter's headers are added.
const OVERSIZED: usize = 1_048_000;

/// A raw protocol connection.
#[derive(Debug)]
pub(crate) struct RawClient {
    stream: TcpStream,
    read: Vec<u8>,
}

impl RawClient {
    /// Connects to `url` (`nats://host:port`) with headers on, and waits for the server.
    pub(crate) async fn connect(url: &str) -> anyhow::Result<RawClient> {
        let addr = url.strip_prefix("nats://").unwrap_or(url).to_owned();
        let stream = tokio::time::timeout(EXCHANGE, TcpStream::connect(addr))
            .await
            .context("raw connect timed out")?
            .context("raw connect")?;
        let mut raw = RawClient {
            stream,
            read: Vec::new(),
        };
        raw.read_until(b"\r\n").await?;
        anyhow::ensure!(raw.read.starts_with(b"INFO "), "no INFO from the server");
        raw.send(b"CONNECT {\"headers\":true,\"verbose\":false,\"pedantic\":false}\r\n")
            .await?;
        raw.ping().await?;
        Ok(raw)
    }

    async fn send(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        tokio::time::timeout(EXCHANGE, self.stream.write_all(bytes))
            .await
            .context("raw write timed out")?
            .context("raw write")
    }

    async fn read_until(&mut self, needle: &[u8]) -> anyhow::Result<()> {
        let stream = &mut self.stream;
        let read = &mut self.read;
        tokio::time::timeout(EXCHANGE, async {
            let mut chunk = [0u8; 4096];
            while !read.windows(needle.len()).any(|w| w == needle) {
                let n = stream.read(&mut chunk).await?;
                anyhow::ensure!(n > 0, "the server closed the raw connection");
                read.extend_from_slice(&chunk[..n]);
            }
            Ok(())
        })
        .await
        .context("raw read timed out")?
    }

    /// PING and wait for the PONG: the server has taken everything sent before it. A `-ERR`
    /// it answered meanwhile is an error.
    pub(crate) async fn ping(&mut self) -> anyhow::Result<()> {
        self.read.clear();
        self.send(b"PING\r\n").await?;
        self.read_until(b"PONG\r\n").await?;
        anyhow::ensure!(
            !self.read.windows(4).any(|w| w == b"-ERR"),
            "the server refused: {}",
            String::from_utf8_lossy(&self.read)
        );
        Ok(())
    }

    async fn publish(&mut self, subject: &str, payload: &[u8]) -> anyhow::Result<()> {
        let mut op = format!("PUB {subject} {}\r\n", payload.len()).into_bytes();
        op.extend_from_slice(payload);
        op.extend_from_slice(b"\r\n");
        self.send(&op).await
    }

    async fn publish_with_header_block(
        &mut self,
        subject: &str,
        header: &[u8],
        payload: &[u8],
    ) -> anyhow::Result<()> {
        let mut op = format!(
            "HPUB {subject} {} {}\r\n",
            header.len(),
            header.len() + payload.len()
        )
        .into_bytes();
        op.extend_from_slice(header);
        op.extend_from_slice(payload);
        op.extend_from_slice(b"\r\n");
        self.send(&op).await
    }
}

/// Header blocks the server forwards and a strict parser refuses.
const MALFORMED_HEADERS: [&[u8]; 4] = [
    b"X-Hostile: no-version-line\r\n\r\n",
    b"NATS/1.0\r\nX-Hostile no colon\r\n\r\n",
    b"NATS/1.0\r\nX-Hostile: \xff\xfe\xc3\x28\r\n\r\n",
    b"NATS/1.0 503\r\n\r\n",
];

/// What one round of [`attack`] sent.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Sent {
    pub(crate) malformed_headers: u64,
    pub(crate) garbage: u64,
    pub(crate) truncated: u64,
    pub(crate) oversized: u64,
}

impl Sent {
    pub(crate) fn add(&mut self, other: Sent) {
        self.malformed_headers += other.malformed_headers;
        self.garbage += other.garbage;
        self.truncated += other.truncated;
        self.oversized += other.oversized;
    }

    pub(crate) fn total(&self) -> u64 {
        self.malformed_headers + self.garbage + self.truncated + self.oversized
    }
}

/// A well-formed `work` command for `agent` whose payload is no message id (so that, should
/// it ever be handled, it shows as unexpected rather than as some message).
fn valid_envelope(agent: &str) -> anyhow::Result<Vec<u8>> {
    let mut env = Envelope::new(Kind::Command, Performative::Request, "hostile");
    env.to = vec![agent.to_owned()];
    env.name = Some(crate::worker::WORK.to_owned());
    env.payload = codec::encode_payload(&"not an id", "application/msgpack")
        .map_err(|e| anyhow::anyhow!("payload: {e}"))?;
    Ok(codec::encode(&env, Encoding::MsgPack)
        .map_err(|e| anyhow::anyhow!("envelope: {e}"))?
        .to_vec())
}

/// One round of hostile input to each of `subjects`, varied by `round`: malformed header
/// blocks, random bytes, MessagePack that is not an envelope, truncated envelopes, and (every
/// tenth round) one oversized envelope.
pub(crate) async fn attack(
    raw: &mut RawClient,
    subjects: &[String],
    agent: &str,
    round: u64,
) -> anyhow::Result<Sent> {
    let mut sent = Sent::default();
    let envelope = valid_envelope(agent)?;
    // A cheap, deterministic spread of lengths and bytes.
    let mut x = round.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for subject in subjects {
        for header in MALFORMED_HEADERS {
            raw.publish_with_header_block(subject, header, &envelope)
                .await?;
            sent.malformed_headers += 1;
        }
        let garbage: Vec<u8> = (0..(next() % 200 + 1))
            .map(|_| (next() & 0xff) as u8)
            .collect();
        raw.publish(subject, &garbage).await?;
        // MessagePack of something else: a map, an array, a bare integer.
        raw.publish(subject, &[0x81, 0xa1, b'x', 0x01]).await?;
        raw.publish(subject, &[0x93, 0x01, 0x02, 0x03]).await?;
        raw.publish(subject, &[0xcf, 0, 0, 0, 0, 0, 0, 0, 7])
            .await?;
        sent.garbage += 4;
        let cut = 1 + (next() as usize) % envelope.len().saturating_sub(1).max(1);
        raw.publish(subject, &envelope[..cut]).await?;
        sent.truncated += 1;
        if round.is_multiple_of(10) {
            let mut big = envelope.clone();
            big.resize(OVERSIZED, 0xc1);
            raw.publish(subject, &big).await?;
            sent.oversized += 1;
        }
    }
    raw.ping().await?;
    Ok(sent)
}
