//! A publisher's malformed header block must not reset a subscriber's connection (issue 13,
//! defect 2). The server forwards whatever header bytes a client sends in an HPUB; async-nats
//! 0.51.0 treated a block it could not parse as a protocol error and dropped the connection,
//! losing what was in transit and failing the requests in flight. The vendored client
//! (vendor/async-nats, see vendor/README.md) delivers such a message without headers instead.
//!
//! A raw TCP client publishes here, since no client library sends such blocks.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::{Broker, BrokerOptions, Message, Subscription};
use chorus_nats_server::NatsServer;
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The deadline of every wait.
const WAIT: Duration = Duration::from_secs(10);

const SUBJECT: &str = "hostile.headers";

async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(WAIT, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} not done within {WAIT:?}"))
}

/// A bare protocol connection, to send what no client library would.
struct RawClient {
    stream: TcpStream,
    read: Vec<u8>,
}

impl RawClient {
    async fn connect(server: &NatsServer) -> RawClient {
        let addr = server
            .url()
            .strip_prefix("nats://")
            .expect("a nats:// URL")
            .to_owned();
        let stream = within("raw connect", TcpStream::connect(addr))
            .await
            .expect("raw connect");
        let mut raw = RawClient {
            stream,
            read: Vec::new(),
        };
        raw.read_until(b"\r\n", "INFO").await;
        assert!(raw.read.starts_with(b"INFO "), "{:?}", raw.text());
        raw.send(b"CONNECT {\"headers\":true,\"verbose\":false,\"pedantic\":false}\r\n")
            .await;
        raw.ping().await;
        raw
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.read).into_owned()
    }

    async fn send(&mut self, bytes: &[u8]) {
        within("raw write", self.stream.write_all(bytes))
            .await
            .expect("raw write");
    }

    /// Reads until `needle` has been received (or the server reports an error).
    async fn read_until(&mut self, needle: &[u8], what: &str) {
        let stream = &mut self.stream;
        let read = &mut self.read;
        within(what, async {
            let mut chunk = [0u8; 4096];
            while !read.windows(needle.len()).any(|w| w == needle) {
                assert!(
                    !read.windows(4).any(|w| w == b"-ERR"),
                    "the server refused: {}",
                    String::from_utf8_lossy(read)
                );
                let n = stream.read(&mut chunk).await.expect("raw read");
                assert!(n > 0, "server closed: {}", String::from_utf8_lossy(read));
                read.extend_from_slice(&chunk[..n]);
            }
        })
        .await;
    }

    /// PING and wait for the PONG: the server has processed everything sent before it, and
    /// refused none of it.
    async fn ping(&mut self) {
        self.read.clear();
        self.send(b"PING\r\n").await;
        self.read_until(b"PONG\r\n", "PONG").await;
        assert!(
            !self.read.windows(4).any(|w| w == b"-ERR"),
            "the server refused: {}",
            self.text()
        );
    }

    async fn publish(&mut self, subject: &str, payload: &[u8]) {
        let mut op = format!("PUB {subject} {}\r\n", payload.len()).into_bytes();
        op.extend_from_slice(payload);
        op.extend_from_slice(b"\r\n");
        self.send(&op).await;
    }

    /// An HPUB with `header` as the header block, exactly as given.
    async fn publish_with_header_block(&mut self, subject: &str, header: &[u8], payload: &[u8]) {
        let mut op = format!(
            "HPUB {subject} {} {}\r\n",
            header.len(),
            header.len() + payload.len()
        )
        .into_bytes();
        op.extend_from_slice(header);
        op.extend_from_slice(payload);
        op.extend_from_slice(b"\r\n");
        self.send(&op).await;
    }
}

/// The next message, within the deadline; a miss names the connection's counters, so a reset
/// connection shows as such.
async fn next(broker: &Broker, sub: &mut Subscription, what: &str) -> Message {
    match tokio::time::timeout(WAIT, sub.next()).await {
        Ok(Some(msg)) => msg,
        Ok(None) => panic!("subscription ended before {what}"),
        Err(_) => panic!(
            "{what} not received within {WAIT:?}; connection stats: {:?}",
            broker.stats()
        ),
    }
}

#[tokio::test]
async fn malformed_header_blocks_are_delivered_without_headers_and_keep_the_connection() {
    let server = NatsServer::builder()
        .jetstream(false)
        .start()
        .unwrap_or_else(|e| panic!("nats-server did not start: {e}"));
    let options = BrokerOptions::new([server.url()]).name("hostile-headers-test");
    let broker = within("connect", Broker::connect(options))
        .await
        .expect("connect");

    let mut sub = broker.subscribe(SUBJECT).await.expect("subscribe");
    // A responder on the same connection, for the request afterwards.
    let mut echo = broker.subscribe("hostile.echo").await.expect("subscribe");
    let responder = broker.clone();
    let echoing = tokio::spawn(async move {
        while let Some(request) = echo.next().await {
            if let Some(reply) = request.reply() {
                let _ = responder.publish(reply, request.payload().clone()).await;
            }
        }
    });
    within("sync", broker.sync(WAIT)).await.expect("sync");

    let hostile: [(&str, &[u8], &[u8]); 3] = [
        (
            "no NATS/1.0 line",
            b"X-Hostile: no-version-line\r\n\r\n",
            b"hostile-1",
        ),
        (
            "a header line without a colon",
            b"NATS/1.0\r\nX-Hostile no colon\r\n\r\n",
            b"hostile-2",
        ),
        (
            "a header line with invalid UTF-8",
            b"NATS/1.0\r\nX-Hostile: \xff\xfe\xc3\x28\r\n\r\n",
            b"hostile-3",
        ),
    ];

    let mut raw = RawClient::connect(&server).await;
    raw.publish(SUBJECT, b"good-before").await;
    for (_, header, payload) in &hostile {
        raw.publish_with_header_block(SUBJECT, header, payload)
            .await;
    }
    raw.publish(SUBJECT, b"good-after").await;
    // The server took all five (no -ERR), so it forwarded them.
    raw.ping().await;

    let first = next(&broker, &mut sub, "the first good message").await;
    assert_eq!(first.payload().as_ref(), b"good-before");
    for (what, _, payload) in &hostile {
        let msg = next(&broker, &mut sub, &format!("the message with {what}")).await;
        assert_eq!(msg.payload().as_ref(), *payload, "{what}");
        assert_eq!(msg.header("X-Hostile"), None, "{what}: headers are dropped");
    }
    let last = next(&broker, &mut sub, "the good message after the hostile ones").await;
    assert_eq!(last.payload().as_ref(), b"good-after");

    // The same connection still answers a request, and it was never lost.
    let reply = within(
        "request",
        broker.request("hostile.echo", None, Bytes::from_static(b"ping"), WAIT),
    )
    .await
    .expect("request after the hostile messages");
    assert_eq!(reply.payload().as_ref(), b"ping");
    assert!(broker.is_connected());
    let stats = broker.stats();
    assert_eq!(stats.disconnects, 0, "{stats:?}");
    assert_eq!(stats.reconnects, 0, "{stats:?}");

    echoing.abort();
}
