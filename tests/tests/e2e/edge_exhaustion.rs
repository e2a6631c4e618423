//! The gateway against hostile clients (docs/SECURITY.md, "The gateway under attack"):
//! half-open connections without credentials, by the thousand, do not stop a caller that
//! authenticates; every error comes in the documented JSON body.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use chorus_gateway::config::{ApiKey, EdgeIdentity, GatewayConfig};
use chorus_sdk::{Context, HandlerError};
use chorus_tests::{server, within};
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const API_KEY: &str = "edge-key-under-attack";

/// A gateway with one identity, `web-ui`, and an echo agent behind it.
async fn gateway_and_echo(
    server: &chorus_tests::NatsServer,
) -> (
    chorus_coordinator::Coordinator,
    SocketAddr,
    chorus_sdk::Agent,
) {
    let mut config = chorus_tests::coordinator_config(server);
    config.gateway = GatewayConfig {
        listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        identities: vec![EdgeIdentity {
            id: "web-ui".into(),
            nkey_seed_file: None,
            tenant: None,
        }],
        api_keys: vec![ApiKey {
            identity: "web-ui".into(),
            sha256: hex::encode(sha2::Sha256::digest(API_KEY.as_bytes())),
            scopes: Vec::new(),
        }],
        // Generous: the attack is not held off by the rate limit.
        rate_per_second: 100_000.0,
        rate_burst: 100_000.0,
        ..GatewayConfig::default()
    };
    let coordinator = chorus_tests::start_coordinator(config, true).await;
    let gw = coordinator.gateway_addr().expect("the gateway listens");
    let echo = chorus_tests::agent(server, "echo").await;
    echo.on_command("echo", |_ctx: Context, v: serde_json::Value| async move {
        Ok::<_, HandlerError>(v)
    })
    .await
    .expect("echo");
    (coordinator, gw, echo)
}

/// An HTTP/1.1 client on one kept-alive connection, as real clients use them.
struct KeptAlive {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl KeptAlive {
    async fn connect(addr: SocketAddr) -> KeptAlive {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        KeptAlive {
            stream,
            buf: Vec::new(),
        }
    }

    /// Sends one request and reads its answer: (status, body).
    async fn send(&mut self, method: &str, path: &str, headers: &str, body: &str) -> (u16, String) {
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: gw\r\n{headers}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.stream
            .write_all(request.as_bytes())
            .await
            .expect("write");
        self.read_answer().await
    }

    /// Reads one answer: (status, body).
    async fn read_answer(&mut self) -> (u16, String) {
        loop {
            if let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buf[..end]).to_ascii_lowercase();
                let status = head
                    .split_whitespace()
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .expect("a content-length");
                if self.buf.len() >= end + 4 + length {
                    let body =
                        String::from_utf8_lossy(&self.buf[end + 4..end + 4 + length]).into_owned();
                    self.buf.drain(..end + 4 + length);
                    return (status, body);
                }
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = self.stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "the gateway closed a kept-alive connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// 1,000 authenticated requests on one kept-alive connection: every latency, sorted.
async fn thousand_requests(gw: SocketAddr) -> Vec<Duration> {
    let mut client = KeptAlive::connect(gw).await;
    let key = format!("X-API-Key: {API_KEY}\r\n");
    let mut took = Vec::with_capacity(1_000);
    for i in 0..1_000 {
        let body = format!(r#"{{"to":"echo","command":"echo","payload":{{"n":{i}}}}}"#);
        let started = Instant::now();
        let (status, answer) = client.send("POST", "/v1/requests", &key, &body).await;
        took.push(started.elapsed());
        assert_eq!(status, 200, "request {i}: {answer}");
        assert!(
            answer.contains(&format!(r#""n":{i}"#)),
            "request {i}: {answer}"
        );
    }
    took.sort();
    took
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

/// Half-open connections without credentials: half of them stop inside the headers, half
/// inside a body they promised. Kept open by the caller.
async fn half_open(gw: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let mut stream = TcpStream::connect(gw).await.expect("attacker connects");
        let partial = if i % 2 == 0 {
            "POST /v1/requests HTTP/1.1\r\nHost: gw\r\nContent-Len".to_owned()
        } else {
            "POST /v1/requests HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"to\":".to_owned()
        };
        // A connection the gateway already closed to make room may refuse the write.
        let _ = stream.write_all(partial.as_bytes()).await;
        held.push(stream);
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_half_open_connections_do_not_stop_an_authenticated_caller() {
    let server = server();
    let (coordinator, gw, _echo) = gateway_and_echo(&server).await;
    // Before the attack.
    let quiet = within(
        Duration::from_secs(120),
        "1,000 requests, quiet",
        thousand_requests(gw),
    )
    .await;
    let attackers = within(
        Duration::from_secs(60),
        "2,000 half-open connections",
        half_open(gw, 2_000),
    )
    .await;
    let attacked = within(
        Duration::from_secs(120),
        "1,000 requests under attack",
        thousand_requests(gw),
    )
    .await;
    let p = |v: &[Duration], q: f64| {
        let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
        ms(v[i])
    };
    println!(
        "edge exhaustion: 1,000 requests on one kept-alive connection: quiet p50 {:.2} ms p99 {:.2} ms; \
         with 2,000 half-open unauthenticated connections p50 {:.2} ms p99 {:.2} ms",
        p(&quiet, 0.5),
        p(&quiet, 0.99),
        p(&attacked, 0.5),
        p(&attacked, 0.99)
    );
    // The gateway held no more of the attackers' connections than its per-peer allowance:
    // each past it was closed to make room, or refused 503 from the pool of requests without
    // credentials (a promised body), and its connection ended.
    let metrics = coordinator.metrics_addr().expect("metrics");
    let (_, text) = chorus_tests::http_get(metrics, "/metrics").await;
    let count = |reason: &str| {
        chorus_tests::metric_sum(
            &text,
            "chorus_gateway_refusals_total",
            &[&format!("reason=\"{reason}\"")],
        )
        .unwrap_or(0.0)
    };
    let closed = count("unproven_connection_closed") + count("unauthenticated_busy");
    let allowance = chorus_gateway::config::DEFAULT_MAX_UNPROVEN_CONNECTIONS_PER_PEER;
    let past = u32::try_from(2_000 - allowance).expect("a small count");
    assert!(
        closed >= f64::from(past),
        "attacker connections closed or refused: {closed} of the {past} past the allowance"
    );
    drop(attackers);
    coordinator.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_comes_in_the_documented_json_body() {
    let server = server();
    let (coordinator, gw, _echo) = gateway_and_echo(&server).await;
    let mut client = KeptAlive::connect(gw).await;
    let key = format!("X-API-Key: {API_KEY}\r\n");
    for (what, method, path, headers, body, want) in [
        ("no such route", "GET", "/nowhere", key.as_str(), "", 404),
        (
            "a method the route does not take",
            "DELETE",
            "/v1/requests",
            key.as_str(),
            "",
            405,
        ),
        ("no credentials", "POST", "/v1/requests", "", "{}", 401),
        (
            "not JSON",
            "POST",
            "/v1/requests",
            key.as_str(),
            "{not json",
            400,
        ),
        (
            "the coordinator's deploy, for a key without an admin scope",
            "POST",
            "/v1/requests",
            key.as_str(),
            r#"{"to":"coordinator","command":"deploy","payload":{"manifest":{"id":"pwn","run":{"command":"sh","args":["-c","id"]}}}}"#,
            403,
        ),
    ] {
        let (status, answer) = client.send(method, path, headers, body).await;
        assert_eq!(status, want, "{what}: {answer}");
        let json: serde_json::Value = serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {answer}"));
        assert!(
            json["status"]
                .as_u64()
                .is_some_and(|s| (5001..6000).contains(&s))
                && json["label"].is_string()
                && json["reason"].is_string(),
            "{what}: {json}"
        );
    }
    // A body declared over the limit is refused before it is read.
    let mut stream = TcpStream::connect(gw).await.expect("connect");
    let head = format!(
        "POST /v1/requests HTTP/1.1\r\nHost: gw\r\nX-API-Key: {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{\"to\":",
        4 << 20
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut raw = KeptAlive {
        stream,
        buf: Vec::new(),
    };
    let (status, answer) = raw.read_answer().await;
    assert_eq!(status, 413, "{answer}");
    let json: serde_json::Value = serde_json::from_str(&answer).expect("413 in JSON");
    assert_eq!(json["status"], 5006, "{json}");
    coordinator.shutdown().await;
}

/// JSON-RPC notifications are never run: an A2A `SendMessage` without an id is answered 204
/// with nothing, and the agent never sees it; the same with an id reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_a2a_notification_is_never_run() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let server = server();
    let (coordinator, gw, _echo) = gateway_and_echo(&server).await;
    let counter = chorus_tests::agent(&server, "counter").await;
    let runs = Arc::new(AtomicU64::new(0));
    let r = Arc::clone(&runs);
    counter
        .on_command("count", move |_ctx: Context, _v: serde_json::Value| {
            r.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, HandlerError>("counted".to_owned()) }
        })
        .await
        .expect("count");
    let mut client = KeptAlive::connect(gw).await;
    let key = format!("X-API-Key: {API_KEY}\r\n");
    let message =
        r#""params":{"message":{"messageId":"m1","role":"ROLE_USER","parts":[{"text":"one"}]}}"#;
    let notification = format!(r#"{{"jsonrpc":"2.0","method":"SendMessage",{message}}}"#);
    let request = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"SendMessage",{message}}}"#);
    let path = "/a2a/agents/counter/count";
    // A 204 has no body, and no content-length: read the head alone.
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: gw\r\n{key}Content-Type: application/json\r\nA2A-Version: 1.0\r\nContent-Length: {}\r\n\r\n{notification}",
        notification.len()
    );
    client
        .stream
        .write_all(head.as_bytes())
        .await
        .expect("write");
    let mut seen = Vec::new();
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut chunk = [0u8; 4096];
        let n = within(
            Duration::from_secs(20),
            "the 204",
            client.stream.read(&mut chunk),
        )
        .await
        .expect("read");
        assert!(n > 0, "closed");
        seen.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&seen);
    assert!(text.starts_with("HTTP/1.1 204"), "{text}");
    let mut fresh = KeptAlive::connect(gw).await;
    let headers = format!("{key}A2A-Version: 1.0\r\n");
    let (status, answer) = fresh.send("POST", path, &headers, &request).await;
    assert_eq!(status, 200, "{answer}");
    chorus_tests::eventually(chorus_tests::WAIT, "the request run", || async {
        (runs.load(Ordering::SeqCst) >= 1).then_some(())
    })
    .await;
    // Both were sent before the request's answer came: the notification would have run first.
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the notification ran");
    coordinator.shutdown().await;
}
