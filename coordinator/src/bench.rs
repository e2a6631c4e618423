//! `chorus bench`: each scenario run against raw async-nats and against Chorus, alternating,
//! in one process and against one server, so the ratio is measured rather than remembered.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agent_sdk::codec::{self, Encoding};
use agent_sdk::envelope::CONTENT_TYPE_MSGPACK;
use agent_sdk::{
    Agent, AgentOptions, Call, Context, DeliveryClass, DiscoverQuery, Envelope, HandlerError, Kind,
    Manifest, Performative,
};
use broker_adapter::baseline;
use broker_adapter::server::NatsServer;
use bytes::Bytes;
use futures::StreamExt;
use serde::Serialize;

/// Silence that ends a count once messages have started arriving.
const IDLE: Duration = Duration::from_secs(2);

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// A running server to use instead of starting one.
    pub url: Option<String>,
    /// Smaller counts, for CI.
    pub quick: bool,
    /// Alternating rounds per scenario; the median of each side is reported.
    pub rounds: usize,
    /// Only scenarios whose name contains this.
    pub only: Option<String>,
}

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Scenario.
    pub scenario: String,
    /// Unit of `raw` and `chorus`.
    pub unit: String,
    /// Raw async-nats figure (median of the rounds), if the scenario has one.
    pub raw: Option<f64>,
    /// Chorus figure (median of the rounds).
    pub chorus: Option<f64>,
    /// `chorus / raw`.
    pub ratio: Option<f64>,
    /// The goal, as text.
    pub goal: String,
    /// Whether the goal is met, when the scenario has one.
    pub met: Option<bool>,
    /// Messages sent in all the Chorus rounds together (a loss in any round shows).
    pub sent: u64,
    /// Messages received in all the Chorus rounds together.
    pub received: u64,
    /// `sent - received`.
    pub lost: u64,
}

impl Row {
    /// A scenario with no raw counterpart.
    fn chorus_only(scenario: &str, unit: &str, value: f64, goal: &str, met: Option<bool>) -> Row {
        Row {
            scenario: scenario.to_owned(),
            unit: unit.to_owned(),
            raw: None,
            chorus: Some(value),
            ratio: None,
            goal: goal.to_owned(),
            met,
            sent: 0,
            received: 0,
            lost: 0,
        }
    }

    /// Sets the message counts.
    fn counts(mut self, sent: u64, received: u64) -> Row {
        self.sent = sent;
        self.received = received;
        self.lost = sent.saturating_sub(received);
        self
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e6
}

struct Pair {
    raw: Vec<f64>,
    chorus: Vec<f64>,
    sent: u64,
    received: u64,
}

impl Pair {
    fn new() -> Self {
        Pair {
            raw: Vec::new(),
            chorus: Vec::new(),
            sent: 0,
            received: 0,
        }
    }

    fn row(self, scenario: &str, unit: &str, goal: &str, check: impl Fn(f64) -> bool) -> Row {
        let raw = median(self.raw);
        let chorus = median(self.chorus);
        let ratio = match (raw, chorus) {
            (Some(r), Some(c)) if r > 0.0 => Some(c / r),
            _ => None,
        };
        Row {
            scenario: scenario.to_owned(),
            unit: unit.to_owned(),
            raw,
            chorus,
            ratio,
            goal: goal.to_owned(),
            met: ratio.map(check),
            sent: self.sent,
            received: self.received,
            lost: self.sent.saturating_sub(self.received),
        }
    }
}

async fn agent(url: &str, id: &str) -> anyhow::Result<Agent> {
    Ok(AgentOptions::new(id)
        .servers([url])
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .queue_capacity(64 * 1024)
        .connect()
        .await?)
}

/// Chorus: `count` events of `size` bytes from one agent to `subscribers` agents.
async fn chorus_events(
    url: &str,
    count: u64,
    size: usize,
    subscribers: usize,
) -> anyhow::Result<baseline::Throughput> {
    let topic = format!("bench.events.{}", uuid::Uuid::now_v7().simple());
    let mut counters = Vec::new();
    let mut keep = Vec::new();
    for i in 0..subscribers {
        let sub = agent(url, &format!("bench-sub-{i}")).await?;
        let mut events = sub.subscribe(&topic).await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        counters.push(rx);
        keep.push(sub);
        tokio::spawn(async move {
            let _ = tx.send(baseline::count_arrivals(&mut events, count, IDLE).await);
        });
    }
    let publisher = agent(url, "bench-pub").await?;
    let payload = Bytes::from(vec![0x5a; size]);
    let started = Instant::now();
    for _ in 0..count {
        publisher
            .publish_raw(&topic, payload.clone(), "application/octet-stream")
            .await?;
    }
    publisher.broker().flush().await?;
    let mut received = 0;
    let mut end = started;
    for rx in counters {
        if let Ok((n, last)) = rx.await {
            received += n;
            end = end.max(last);
        }
    }
    for a in keep {
        a.shutdown().await;
    }
    publisher.shutdown().await;
    Ok(baseline::Throughput {
        sent: count * subscribers as u64,
        received,
        elapsed: end - started,
    })
}

async fn echo_agent(url: &str, id: &str) -> anyhow::Result<Agent> {
    let echo = agent(url, id).await?;
    echo.handle_command("echo", EchoHandler).await?;
    Ok(echo)
}

/// Replies with the request's payload as it is (no decode, no encode): the SDK's own cost.
struct EchoHandler;

impl agent_sdk::Handler for EchoHandler {
    fn call(&self, ctx: Context) -> agent_sdk::BoxFuture<Result<agent_sdk::Output, HandlerError>> {
        let m = ctx.message();
        let out = agent_sdk::Output {
            payload: m.payload.clone(),
            content_type: m.content_type.clone(),
        };
        Box::pin(async move { Ok(out) })
    }
}

fn echo_call(id: &str, payload: &Bytes) -> Call {
    Call::agent(id, "echo").raw_payload(payload.clone(), "application/octet-stream")
}

async fn chorus_latency(url: &str, n: usize, size: usize) -> anyhow::Result<Vec<Duration>> {
    let echo = echo_agent(url, "bench-echo").await?;
    let client = agent(url, "bench-client").await?;
    let payload = Bytes::from(vec![1u8; size]);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        client.call(echo_call("bench-echo", &payload)).await?;
        out.push(t.elapsed());
    }
    client.shutdown().await;
    echo.shutdown().await;
    Ok(out)
}

async fn chorus_request_throughput(
    url: &str,
    concurrency: usize,
    duration: Duration,
    size: usize,
) -> anyhow::Result<baseline::Throughput> {
    let echo = echo_agent(url, "bench-echo").await?;
    let client = agent(url, "bench-client").await?;
    let payload = Bytes::from(vec![1u8; size]);
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let client = client.clone();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                if client.call(echo_call("bench-echo", &payload)).await.is_ok() {
                    n += 1;
                }
            }
            n
        }));
    }
    let mut done = 0;
    for t in tasks {
        done += t.await.unwrap_or(0);
    }
    client.shutdown().await;
    echo.shutdown().await;
    Ok(baseline::Throughput {
        sent: done,
        received: done,
        elapsed: started.elapsed(),
    })
}

async fn chorus_durable(
    url: &str,
    count: u64,
    size: usize,
) -> anyhow::Result<baseline::Throughput> {
    let id = format!("bench-durable-{}", uuid::Uuid::now_v7().simple());
    let worker = AgentOptions::new(id.clone())
        .servers([url])
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .durable_inbox(true)
        .connect()
        .await?;
    let tally = Arc::new(Tally::new(count));
    worker
        .handle_command("work", SignalHandler(Arc::clone(&tally)))
        .await?;
    let sender = agent(url, "bench-sender").await?;
    let payload = Bytes::from(vec![7u8; size]);
    let started = Instant::now();
    let calls: Vec<Call> = (0..count)
        .map(|_| {
            Call::agent(id.clone(), "work")
                .command()
                .delivery(DeliveryClass::AtLeastOnce)
                .raw_payload(payload.clone(), "application/octet-stream")
        })
        .collect();
    // One batch, so that 256 acks stay in flight from the first publish to the last, as on
    // the raw side (chunks would drain the window at each boundary).
    for r in sender.send_batch(calls).await {
        r?;
    }

    let (received, end) = tally.wait(IDLE).await;

    sender.shutdown().await;
    worker.shutdown().await;
    Ok(baseline::Throughput {
        sent: count,
        received,
        elapsed: end - started,
    })
}

/// Counts handled messages in the handler itself, with no task hop per message: the raw
/// side counts in its reading loop, so a channel to a counting task here would charge Chorus
/// a wake-up per message that the baseline does not pay.
struct Tally {
    target: u64,
    handled: AtomicU64,
    /// When the last one was handled, in nanoseconds after `base`.
    last_ns: AtomicU64,
    base: Instant,
    done: tokio::sync::Notify,
}

impl Tally {
    fn new(target: u64) -> Self {
        Tally {
            target,
            handled: AtomicU64::new(0),
            last_ns: AtomicU64::new(0),
            base: Instant::now(),
            done: tokio::sync::Notify::new(),
        }
    }

    fn hit(&self) {
        let ns = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last_ns.fetch_max(ns, Ordering::Relaxed);
        if self.handled.fetch_add(1, Ordering::Relaxed) + 1 == self.target {
            self.done.notify_one();
        }
    }

    /// Waits until all have been handled, or `idle` passes without one (up to 30 s for the
    /// first). Returns the count and when the last was handled.
    async fn wait(&self, idle: Duration) -> (u64, Instant) {
        let mut seen = 0;
        let mut wait = Duration::from_secs(30).max(idle);
        while tokio::time::timeout(wait, self.done.notified())
            .await
            .is_err()
        {
            let now = self.handled.load(Ordering::Relaxed);
            if now == seen {
                break;
            }
            seen = now;
            wait = idle;
        }
        let last = self.base + Duration::from_nanos(self.last_ns.load(Ordering::Relaxed));
        (self.handled.load(Ordering::Relaxed), last)
    }
}

struct SignalHandler(Arc<Tally>);

impl agent_sdk::Handler for SignalHandler {
    fn call(&self, _ctx: Context) -> agent_sdk::BoxFuture<Result<agent_sdk::Output, HandlerError>> {
        self.0.hit();
        Box::pin(async { Ok(agent_sdk::Output::default()) })
    }
}

/// Discovery with `agents` registered (synthetic heartbeats): query latencies.
async fn discovery(
    url: &str,
    agents: usize,
    queries: usize,
) -> anyhow::Result<(Vec<Duration>, usize)> {
    let config = crate::CoordinatorConfig {
        servers: url.to_owned(),
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        ..crate::CoordinatorConfig::default()
    };
    let coordinator = crate::Coordinator::start(config, false).await?;
    let publisher = register_fakes(url, agents).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut registered = 0;
    while Instant::now() < deadline {
        registered = coordinator.discover(&DiscoverQuery::default()).len();
        if registered >= agents {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut lat = Vec::with_capacity(queries);
    for _ in 0..queries {
        let t = Instant::now();
        publisher.discover_capability("ocr").await?;
        lat.push(t.elapsed());
    }
    publisher.shutdown().await;
    coordinator.shutdown().await;
    Ok((lat, registered))
}

/// Resident memory of a process, in bytes.
fn rss_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// RSS of an idle agent: `chorus listen` in its own process (one agent, one subscription).
async fn idle_agent_rss(url: &str) -> anyhow::Result<u64> {
    // It prints "listening on ..." to stderr once subscribed.
    let mut child = start_self(&["--server", url, "listen", "bench.idle.>"], &[], true).await?;
    // Give it a moment of idleness (heartbeats, pings) before reading.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss = resident_bytes(&mut child).await;
    let _ = child.kill().await;
    rss
}

/// Publishes one heartbeat for each of `agents` synthetic agents (every tenth offering `ocr`).
async fn publish_fake_heartbeats(publisher: &Agent, agents: usize) -> anyhow::Result<()> {
    let subjects = publisher.subjects().clone();
    for i in 0..agents {
        let id = format!("fake-{i:04}");
        let manifest = Manifest {
            agent: id.clone(),
            instance: "bench".into(),
            capabilities: vec![agent_sdk::registry::CapabilityInfo {
                name: if i % 10 == 0 {
                    "ocr".into()
                } else {
                    format!("cap{}", i % 50)
                },
                version: "1".into(),
            }],
            commands: vec![],
            groups: vec![],
            content_types: vec![],
            load: (i % 100) as f32 / 100.0,
            availability: agent_sdk::Availability::Available,
            eta_ms: None,
            public_key: None,
            encryption_key: None,
            heartbeat_ms: 60_000,
            started_ms: agent_sdk::envelope::now_ms(),
            sdk_version: String::new(),
        };
        let mut env = Envelope::new(Kind::Heartbeat, Performative::Health, id.as_str());
        env.payload = codec::encode_payload(&manifest, CONTENT_TYPE_MSGPACK)?;
        let bytes = codec::encode(&env, Encoding::MsgPack)?;
        publisher
            .broker()
            .publish(&subjects.heartbeat(&id)?, bytes)
            .await?;
    }
    publisher.broker().flush().await?;
    Ok(())
}

/// Publishes heartbeats for `agents` synthetic agents (every third with capability `ocr`).
async fn register_fakes(url: &str, agents: usize) -> anyhow::Result<Agent> {
    let publisher = agent(url, "bench-registrar").await?;
    publish_fake_heartbeats(&publisher, agents).await?;
    Ok(publisher)
}

/// RSS of `chorus serve` in its own process once it holds `agents` registered agents.
async fn coordinator_rss(url: &str, agents: usize) -> anyhow::Result<u64> {
    // It prints its metrics address to stdout once serving.
    let mut child = start_self(
        &["--server", url, "--root", "benchmem", "serve"],
        &[("CHORUS_SERVE__METRICS_ADDR", "127.0.0.1:0")],
        false,
    )
    .await?;
    let publisher = AgentOptions::new("bench-registrar")
        .servers([url])
        .root("benchmem")
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .connect()
        .await?;
    publish_fake_heartbeats(&publisher, agents).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && child.try_wait()?.is_none() {
        if publisher
            .discover(&DiscoverQuery::default())
            .await
            .map(|v| v.len())
            .unwrap_or(0)
            >= agents
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let registered = publisher
        .discover(&DiscoverQuery::default())
        .await
        .map(|v| v.len())
        .unwrap_or(0);
    let rss = resident_bytes(&mut child).await;
    publisher.shutdown().await;
    let _ = child.kill().await;
    let rss = rss?;
    anyhow::ensure!(
        registered >= agents,
        "only {registered} of {agents} agents were registered within 30 s"
    );
    Ok(rss)
}

/// Starts this binary with `args` and `env` and waits (up to 20 s) for its first line, on
/// stderr or stdout as `ready_on_stderr` says: its sign that it is up. The other stream is
/// kept for [`resident_bytes`] to report why it exited, if it did.
async fn start_self(
    args: &[&str],
    env: &[(&str, &str)],
    ready_on_stderr: bool,
) -> anyhow::Result<tokio::process::Child> {
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let ready: Box<dyn tokio::io::AsyncRead + Unpin + Send> = if ready_on_stderr {
        Box::new(
            child
                .stderr
                .take()
                .ok_or_else(|| anyhow::anyhow!("no stderr"))?,
        )
    } else {
        Box::new(
            child
                .stdout
                .take()
                .ok_or_else(|| anyhow::anyhow!("no stdout"))?,
        )
    };
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(ready));
    tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await??;
    Ok(child)
}

/// Resident memory of a child that must still be running: an error, with what it printed,
/// if it has exited (a reading of zero would pass any memory goal).
async fn resident_bytes(child: &mut tokio::process::Child) -> anyhow::Result<u64> {
    if let Some(status) = child.try_wait()? {
        let mut said = String::new();
        if let Some(mut stderr) = child.stderr.take() {
            let _ = tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut said).await;
        }
        anyhow::bail!("it exited ({status}): {}", said.trim());
    }
    child
        .id()
        .and_then(rss_of)
        .ok_or_else(|| anyhow::anyhow!("its resident memory could not be read"))
}

/// Signed events from one agent to another that verifies every signature; with `encrypt`,
/// one-way commands encrypted for the receiver as well.
async fn secure_events(
    url: &str,
    count: u64,
    encrypt: bool,
) -> anyhow::Result<baseline::Throughput> {
    use agent_sdk::encryption::EncryptionKey;
    use agent_sdk::security::{Identity, SignaturePolicy};
    let sender_id = Identity::generate();
    let receiver_key = EncryptionKey::generate();
    let receiver_public = receiver_key.public_key();
    let base = |id: &str| {
        AgentOptions::new(id)
            .servers([url])
            .heartbeat_interval(Duration::ZERO)
            .service_discovery(false)
            .queue_capacity(64 * 1024)
    };
    let receiver = base("bench-verifier")
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..SignaturePolicy::default()
        })
        .trust("bench-signer", sender_id.public_key())
        .encryption_key(receiver_key)
        .connect()
        .await?;
    let topic = format!("bench.signed.{}", uuid::Uuid::now_v7().simple());
    let mut events = receiver.subscribe(&topic).await?;
    let tally = Arc::new(Tally::new(count));
    if encrypt {
        receiver
            .handle_command("sealed", SignalHandler(Arc::clone(&tally)))
            .await?;
    } else {
        let tally = Arc::clone(&tally);
        tokio::spawn(async move {
            while events.next().await.is_some() {
                tally.hit();
            }
        });
    }
    let sender = base("bench-signer")
        .identity(sender_id)
        .trust_encryption("bench-verifier", receiver_public)
        .connect()
        .await?;
    let payload = Bytes::from(vec![0x5a; 128]);
    let started = Instant::now();
    for _ in 0..count {
        if encrypt {
            sender
                .send(
                    Call::agent("bench-verifier", "sealed")
                        .raw_payload(payload.clone(), "application/octet-stream")
                        .encrypt_for(["bench-verifier"]),
                )
                .await?;
        } else {
            sender
                .publish_raw(&topic, payload.clone(), "application/octet-stream")
                .await?;
        }
    }
    sender.broker().flush().await?;
    let (received, end) = tally.wait(IDLE).await;
    sender.shutdown().await;
    receiver.shutdown().await;
    Ok(baseline::Throughput {
        sent: count,
        received,
        elapsed: end - started,
    })
}

/// Runs every scenario and returns the report.
pub async fn run(opts: &BenchOptions, progress: fn(&str)) -> anyhow::Result<(Vec<Row>, String)> {
    let server;
    let url = match &opts.url {
        Some(u) => u.clone(),
        None => {
            server = tokio::task::spawn_blocking(|| NatsServer::builder().start()).await??;
            server.url().to_owned()
        }
    };
    let version = {
        let b = broker_adapter::BrokerOptions::new([url.as_str()])
            .connect()
            .await?;
        let v = b.server_version();
        let _ = b.drain().await;
        v
    };
    let q = opts.quick;
    let rounds = opts.rounds.max(1);
    let mut rows = Vec::new();
    let want = |name: &str| opts.only.as_deref().is_none_or(|o| name.contains(o));

    for (size, count) in [
        (128usize, if q { 20_000 } else { 200_000 }),
        (4096, if q { 5_000 } else { 50_000 }),
    ] {
        if !want("events") {
            break;
        }
        progress(&format!("events {size} B x {count}"));
        let mut p = Pair::new();
        for _ in 0..rounds {
            let r = baseline::pubsub(&url, count, size, 1, Duration::from_secs(2)).await?;
            p.raw.push(r.per_second());
            let c = chorus_events(&url, count, size, 1).await?;
            p.chorus.push(c.per_second());
            p.sent += c.sent;
            p.received += c.received;
        }
        let goal = if size == 128 {
            ">= 0.85 of raw, no loss"
        } else {
            "(reported)"
        };
        let lossless = p.sent == p.received;
        rows.push(p.row(
            &format!("event publish->subscribe {size} B"),
            "msg/s",
            goal,
            move |r| size != 128 || (r >= 0.85 && lossless),
        ));
    }

    let n = if q { 500 } else { 5_000 };
    if want("latency") {
        progress(&format!("request latency x {n}"));
        let (mut raw_l, mut ch_l) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            raw_l.extend(baseline::request_latency(&url, n, 128).await?);
            ch_l.extend(chorus_latency(&url, n, 128).await?);
        }
        raw_l.sort();
        ch_l.sort();
        for (label, p, goal, limit) in [
            ("p50", 0.50, "<= 1.15 x raw", 1.15),
            ("p99", 0.99, "<= 1.3 x raw", 1.3),
            ("p999", 0.999, "(reported)", f64::INFINITY),
        ] {
            let raw = percentile(&raw_l, p);
            let chorus = percentile(&ch_l, p);
            let ratio = chorus / raw.max(1e-9);
            rows.push(Row {
                scenario: format!("request-reply latency {label}, sequential"),
                unit: "us".into(),
                raw: Some(raw),
                chorus: Some(chorus),
                ratio: Some(ratio),
                goal: goal.into(),
                met: limit.is_finite().then_some(ratio <= limit),
                sent: ch_l.len() as u64,
                received: ch_l.len() as u64,
                lost: 0,
            });
        }
    }
    let dur = if q {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(3)
    };
    if want("throughput") {
        progress("request throughput, 64 concurrent");
        let mut p = Pair::new();
        for _ in 0..rounds {
            p.raw.push(
                baseline::request_throughput(&url, 64, dur, 128)
                    .await?
                    .per_second(),
            );
            let c = chorus_request_throughput(&url, 64, dur, 128).await?;
            p.chorus.push(c.per_second());
            p.sent += c.sent;
            p.received += c.received;
        }
        rows.push(p.row(
            "request-reply throughput, 64 concurrent",
            "req/s",
            "(reported)",
            |_| true,
        ));
    }

    let count = if q { 2_000 } else { 20_000 };
    if want("durable") {
        progress(&format!("durable at-least-once x {count}"));
        let mut p = Pair::new();
        for _ in 0..rounds {
            p.raw.push(
                baseline::jetstream_roundtrip(&url, count, 128, 256)
                    .await?
                    .per_second(),
            );
            let c = chorus_durable(&url, count, 128).await?;
            p.chorus.push(c.per_second());
            p.sent += c.sent;
            p.received += c.received;
        }
        rows.push(p.row(
            "durable at-least-once publish->handled, 256 acks in flight",
            "msg/s",
            ">= 0.8 of raw",
            |r| r >= 0.8,
        ));
    }

    let count = if q { 200 } else { 2_000 };
    if want("fan-out") {
        progress(&format!("fan-out to 100 x {count}"));
        let mut p = Pair::new();
        for _ in 0..rounds.min(2) {
            p.raw.push(
                baseline::pubsub(&url, count, 128, 100, Duration::from_secs(2))
                    .await?
                    .per_second(),
            );
            let c = chorus_events(&url, count, 128, 100).await?;
            p.chorus.push(c.per_second());
            p.sent += c.sent;
            p.received += c.received;
        }
        rows.push(p.row(
            "event fan-out to 100 subscribers (deliveries)",
            "msg/s",
            "(reported)",
            |_| true,
        ));
    }

    if want("secure") {
        let count = if q { 200 } else { 20_000 };
        progress(&format!("signed and verified events x {count}"));
        let signed = secure_events(&url, count, false).await?;
        let met = signed.per_second() >= 25_000.0 && signed.received == signed.sent;
        rows.push(
            Row::chorus_only(
                "signed and verified events, 128 B",
                "msg/s",
                signed.per_second(),
                ">= 25,000/s",
                Some(met),
            )
            .counts(signed.sent, signed.received),
        );
        progress(&format!("encrypted and signed commands x {count}"));
        let sealed = secure_events(&url, count, true).await?;
        rows.push(
            Row::chorus_only(
                "encrypted (and signed) one-way commands, 128 B",
                "msg/s",
                sealed.per_second(),
                "(reported)",
                None,
            )
            .counts(sealed.sent, sealed.received),
        );
    }

    if want("discovery") {
        progress("discovery with 1,000 agents");
        let (mut lat, registered) = discovery(&url, 1_000, if q { 100 } else { 1_000 }).await?;
        lat.sort();
        let n = lat.len() as u64;
        rows.push(
            Row::chorus_only(
                &format!("discovery query, {registered} agents registered, p50"),
                "us",
                percentile(&lat, 0.5),
                "(reported)",
                None,
            )
            .counts(n, n),
        );
    }

    if want("memory") {
        progress("idle agent memory");
        let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
        let memory_row = |scenario: &str, limit_mib: u64, rss: anyhow::Result<u64>| match rss {
            Ok(rss) => Row::chorus_only(
                scenario,
                "MiB",
                mib(rss),
                &format!("< {limit_mib} MiB"),
                Some(rss < limit_mib << 20),
            ),
            Err(e) => Row {
                chorus: None,
                goal: format!(
                    "< {limit_mib} MiB; not measured: {}",
                    crate::error_chain(&e)
                ),
                met: Some(false),
                ..Row::chorus_only(scenario, "MiB", 0.0, "", None)
            },
        };
        rows.push(memory_row(
            "idle agent resident memory (chorus listen)",
            10,
            idle_agent_rss(&url).await,
        ));
        rows.push(memory_row(
            "coordinator resident memory, 1,000 agents registered",
            64,
            coordinator_rss(&url, 1_000).await,
        ));
    }

    Ok((rows, version))
}

/// The report as a table.
pub fn table(rows: &[Row]) -> String {
    let fmt = |v: Option<f64>| match v {
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) => format!("{x:.2}"),
        None => "-".into(),
    };
    let mut out = format!(
        "{:<62} {:>6} {:>11} {:>11} {:>6}  {:<5} {:>8} {:>8} {:>5}  goal\n",
        "scenario", "unit", "raw", "chorus", "ratio", "met", "sent", "received", "lost"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<62} {:>6} {:>11} {:>11} {:>6}  {:<5} {:>8} {:>8} {:>5}  {}\n",
            r.scenario,
            r.unit,
            fmt(r.raw),
            fmt(r.chorus),
            r.ratio.map_or("-".into(), |x| format!("{x:.2}")),
            r.met.map_or("-", |m| if m { "yes" } else { "NO" }),
            r.sent,
            r.received,
            r.lost,
            r.goal
        ));
    }
    out
}
