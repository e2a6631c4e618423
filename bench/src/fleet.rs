//! The fleet simulator (`chorus bench --only scale`): thousands of simulated agents in this
//! process, against a coordinator in its own process (`chorus serve`) and a server of their
//! own, so each one's memory and CPU are read apart.
//!
//! The agents run in a light mode, documented in docs/SCALE.md: they are not SDK agents but
//! what the coordinator and the server see of agents. Their heartbeats (each a full manifest,
//! every 5 s as the SDK's default) go out on a few shared connections, spread evenly over the
//! interval; one wildcard subscription answers every request any of them is sent (broadcast
//! copies); each is counted in the server's subscriptions once, not once per agent (an SDK
//! agent holds a handful: see the table's note). What is measured is the coordinator and the
//! server under that load: resident memory and CPU, the server's subscriptions and consumers,
//! discovery latency, heartbeats handled per second, and a broadcast to 10,000 of them.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agent_sdk::codec::{self, Encoding};
use agent_sdk::envelope::CONTENT_TYPE_MSGPACK;
use agent_sdk::registry::{BroadcastTarget, CapabilityInfo, DiscoverQuery, Outcome};
use agent_sdk::{
    AgentOptions, Availability, Envelope, Kind, Manifest, Performative, StatusCode, Subjects,
};
use broker_adapter::{Broker, BrokerOptions};
use bytes::Bytes;
use chorus_nats_server::NatsServer;
use futures::StreamExt;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::memory::rss_of;
use crate::report::{Row, percentile};

/// The subject root of the simulated bus.
const ROOT: &str = "fleet";
/// The heartbeat interval the simulated agents announce and keep: the SDK's default.
const HEARTBEAT: Duration = Duration::from_secs(5);
/// How often each connection publishes its share of a heartbeat round.
const TICK: Duration = Duration::from_millis(50);
/// Connections the heartbeats are spread over.
const CONNECTIONS: usize = 4;
/// One agent in this many offers the capability the discovery queries ask for.
const RARE_EVERY: usize = 1_000;
/// Agents in the group the broadcast goes to (the first ones).
const BROADCAST_GROUP_SIZE: usize = 10_000;
/// How long the coordinator is watched under steady heartbeats for CPU and rates.
const STEADY_WINDOW: Duration = Duration::from_secs(10);
/// Discovery queries per size.
const QUERIES: usize = 300;
/// The broadcast's deadline for its recipients.
const BROADCAST_TIMEOUT: Duration = Duration::from_secs(10);

/// What one size of fleet measured.
#[derive(Debug, Clone)]
pub(crate) struct Figures {
    pub(crate) agents: usize,
    pub(crate) live: u64,
    pub(crate) registration: Duration,
    pub(crate) coordinator_rss: u64,
    pub(crate) coordinator_cpu: f64,
    pub(crate) server_rss: u64,
    pub(crate) subscriptions: u64,
    /// Subscriptions one SDK agent (a command, a capability) adds.
    pub(crate) per_agent: u64,
    pub(crate) consumers: u64,
    pub(crate) discovery: Vec<Duration>,
    pub(crate) heartbeats_per_second: f64,
    pub(crate) heartbeats_sent_per_second: f64,
    /// Registry writes while the heartbeats were steady (every agent's load changing).
    pub(crate) registry_writes: u64,
    /// Time to the report, and how many of the recipients were reported delivered.
    pub(crate) broadcast: Option<(Duration, usize)>,
}

/// Runs the fleet at each size in `sizes` and returns its rows.
pub(crate) async fn scale(
    program: &Path,
    sizes: &[usize],
    progress: fn(&str),
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &n in sizes {
        progress(&format!("fleet of {n} simulated agents"));
        let f = run(program, n).await?;
        rows.extend(rows_of(&f));
    }
    Ok(rows)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

fn rows_of(f: &Figures) -> Vec<Row> {
    let n = f.agents;
    let at = |what: &str| format!("{n} agents: {what}");
    let big = n >= 100_000;
    let mut discovery = f.discovery.clone();
    discovery.sort();
    let p99 = percentile(&discovery, 0.99);
    let mut rows = vec![
        Row::chorus_only(
            &at("registered (live) after heartbeats began"),
            "s",
            f.registration.as_secs_f64(),
            "(reported)",
            None,
        )
        .counts(n as u64, f.live),
        Row::chorus_only(
            &at("coordinator resident memory"),
            "MiB",
            mib(f.coordinator_rss),
            if big { "< 256 MiB" } else { "(reported)" },
            big.then_some(f.coordinator_rss < 256 << 20),
        ),
        Row::chorus_only(
            &at("coordinator CPU, steady heartbeats"),
            "%",
            f.coordinator_cpu,
            "(reported; 100 = one core)",
            None,
        ),
        Row::chorus_only(
            &at("server resident memory"),
            "MiB",
            mib(f.server_rss),
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("server subscriptions"),
            "subs",
            f.subscriptions as f64,
            "(reported; light mode)",
            None,
        ),
        Row::chorus_only(
            &at("subscriptions one SDK agent adds (a command and a capability)"),
            "subs",
            f.per_agent as f64,
            "(reported; the light mode holds 0)",
            None,
        ),
        Row::chorus_only(
            &at("server JetStream consumers"),
            "consumers",
            f.consumers as f64,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at(&format!(
                "discovery p50, capability held by {}",
                n / RARE_EVERY
            )),
            "us",
            percentile(&discovery, 0.5),
            "(reported)",
            None,
        )
        .counts(QUERIES as u64, discovery.len() as u64),
        Row::chorus_only(
            &at("discovery p99"),
            "us",
            p99,
            if big { "< 5,000 us" } else { "(reported)" },
            big.then_some(p99 < 5_000.0),
        ),
        Row::chorus_only(
            &at(&format!(
                "heartbeats handled per second (sent {:.0}/s)",
                f.heartbeats_sent_per_second
            )),
            "msg/s",
            f.heartbeats_per_second,
            "(reported)",
            None,
        ),
    ];
    rows.push(Row::chorus_only(
        &at("registry writes, steady heartbeats (every agent's load changing)"),
        "writes",
        f.registry_writes as f64,
        "none",
        Some(f.registry_writes == 0),
    ));
    if let Some((took, delivered)) = f.broadcast {
        rows.push(
            Row::chorus_only(
                &at("broadcast to 10,000 reported"),
                "ms",
                took.as_secs_f64() * 1e3,
                "< 5,000 ms",
                Some(took < Duration::from_secs(5) && delivered == BROADCAST_GROUP_SIZE),
            )
            .counts(BROADCAST_GROUP_SIZE as u64, delivered as u64),
        );
    }
    rows
}

/// One size: a fresh server, a coordinator process, the fleet, the measurements.
async fn run(program: &Path, n: usize) -> anyhow::Result<Figures> {
    let (server, url, monitor) = monitored_server().await?;
    let coordinator = Coordinator::start(program, &url).await?;
    let subjects = Subjects::new(ROOT)?;
    let stop = CancellationToken::new();
    let tracker = TaskTracker::new();
    let sent = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let result = async {
        answer_requests(&url, &subjects, &tracker, stop.clone()).await?;
        heartbeat(
            &url,
            &subjects,
            n,
            &tracker,
            stop.clone(),
            Arc::clone(&sent),
        )
        .await?;
        // Registered: every agent live in the coordinator's registry.
        let deadline = started + Duration::from_secs(60) + HEARTBEAT * 4;
        let mut live = 0;
        while Instant::now() < deadline {
            live = coordinator
                .gauge("chorus_coordinator_agents", "state=\"live\"")
                .await? as u64;
            if live >= n as u64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let registration = started.elapsed();
        anyhow::ensure!(
            live >= n as u64,
            "only {live} of {n} agents were live after {registration:?}"
        );
        // Steady state: heartbeats handled and CPU over a window.
        let hb = "chorus_coordinator_messages_total";
        let js = connect(&url, "fleet-registry")
            .await?
            .jetstream(Duration::from_secs(10));
        let registry = format!("KV_{ROOT}_registry");
        let writes0 = js.stream_state(&registry).await?.last_seq;
        let (cpu0, hb0, sent0, t0) = (
            coordinator.cpu_seconds()?,
            coordinator.gauge(hb, "kind=\"heartbeat\"").await?,
            sent.load(Ordering::Relaxed),
            Instant::now(),
        );
        tokio::time::sleep(STEADY_WINDOW).await;
        let secs = t0.elapsed().as_secs_f64();
        let coordinator_cpu = 100.0 * (coordinator.cpu_seconds()? - cpu0) / secs;
        let heartbeats_per_second =
            (coordinator.gauge(hb, "kind=\"heartbeat\"").await? - hb0) / secs;
        let heartbeats_sent_per_second = (sent.load(Ordering::Relaxed) - sent0) as f64 / secs;
        let registry_writes = js.stream_state(&registry).await?.last_seq - writes0;
        let coordinator_rss = coordinator.rss()?;
        let server_rss = server.pid().and_then(rss_of).unwrap_or(0);
        let subscriptions = monitor_number(&monitor, "/subsz", "num_subscriptions").await?;
        let consumers = monitor_number(&monitor, "/jsz", "consumers").await?;
        // Discovery and a broadcast, from an SDK agent.
        let client = AgentOptions::new("fleet-client")
            .servers([url.as_str()])
            .root(ROOT)
            .heartbeat_interval(Duration::ZERO)
            .service_discovery(false)
            .request_timeout(Duration::from_secs(30))
            .connect()
            .await?;
        // What one SDK agent with a command and a capability holds on the server, which the
        // light mode leaves out: the subscriptions it adds once serving.
        let before = monitor_number(&monitor, "/subsz", "num_subscriptions").await?;
        let real = AgentOptions::new("fleet-real")
            .servers([url.as_str()])
            .root(ROOT)
            .connect()
            .await?;
        real.on_command("ping", |_ctx: agent_sdk::Context, (): ()| async {
            Ok::<_, agent_sdk::HandlerError>(())
        })
        .await?;
        real.on_capability("fleet.work", |_ctx: agent_sdk::Context, (): ()| async {
            Ok::<_, agent_sdk::HandlerError>(())
        })
        .await?;
        real.broker().flush().await?;
        let per_agent = monitor_number(&monitor, "/subsz", "num_subscriptions").await? - before;
        real.shutdown().await;
        let query = DiscoverQuery::capability("rare");
        let mut discovery = Vec::with_capacity(QUERIES);
        for _ in 0..QUERIES {
            let t = Instant::now();
            let found = client.discover(&query).await?;
            discovery.push(t.elapsed());
            anyhow::ensure!(
                found.len() == n.div_ceil(RARE_EVERY),
                "discovery found {} holders of {}",
                found.len(),
                n.div_ceil(RARE_EVERY)
            );
        }
        let broadcast = if n >= BROADCAST_GROUP_SIZE {
            let t = Instant::now();
            let report = client
                .broadcast(
                    &BroadcastTarget::Group("ten-k".into()),
                    "ping",
                    &(),
                    BROADCAST_TIMEOUT,
                )
                .await?;
            Some((t.elapsed(), report.count(Outcome::Delivered)))
        } else {
            None
        };
        client.shutdown().await;
        Ok(Figures {
            agents: n,
            live,
            registration,
            coordinator_rss,
            coordinator_cpu,
            server_rss,
            subscriptions,
            per_agent,
            consumers,
            discovery,
            heartbeats_per_second,
            heartbeats_sent_per_second,
            registry_writes,
            broadcast,
        })
    }
    .await;
    stop.cancel();
    tracker.close();
    tracker.wait().await;
    coordinator.stop().await;
    drop(server);
    result
}

/// A fresh server of its own with monitoring on a free port: it, its client URL and its
/// monitoring URL.
async fn monitored_server() -> anyhow::Result<(NatsServer, String, String)> {
    let server = tokio::task::spawn_blocking(|| {
        NatsServer::builder()
            .arg("-m")
            .arg("-1")
            .sync_always(false)
            .start()
    })
    .await??;
    let url = server.url().to_owned();
    let monitor = server
        .monitor_url()
        .ok_or_else(|| anyhow::anyhow!("the server has no monitoring port"))?
        .to_owned();
    Ok((server, url, monitor))
}

/// The simulated agents' manifests: every one offers `fleet.work`; one in [`RARE_EVERY`]
/// also `rare`; the first [`BROADCAST_GROUP_SIZE`] are in the group `ten-k`.
fn manifest(i: usize) -> Manifest {
    let mut capabilities = vec![CapabilityInfo {
        name: "fleet.work".into(),
        version: "1".into(),
        models: Vec::new(),
        throughput: None,
    }];
    if i.is_multiple_of(RARE_EVERY) {
        capabilities.push(CapabilityInfo {
            name: "rare".into(),
            version: "1".into(),
            models: Vec::new(),
            throughput: None,
        });
    }
    Manifest {
        agent: format!("sim-{i:06}"),
        instance: "fleet".into(),
        capabilities,
        commands: vec!["ping".into()],
        groups: if i < BROADCAST_GROUP_SIZE {
            vec!["ten-k".into()]
        } else {
            Vec::new()
        },
        content_types: vec![CONTENT_TYPE_MSGPACK.into()],
        load: 0.0,
        slots: Some(1),
        availability: Availability::Available,
        eta_ms: None,
        public_key: None,
        encryption_key: None,
        heartbeat_ms: u64::try_from(HEARTBEAT.as_millis()).unwrap_or(u64::MAX),
        started_ms: agent_sdk::envelope::now_ms(),
        sdk_version: "fleet".into(),
        metrics_url: None,
        wire_versions: vec![1, 2],
        open_circuits: Vec::new(),
        content_encodings: Vec::new(),
    }
}

/// Starts the heartbeats of `n` agents on [`CONNECTIONS`] connections, each sending its share
/// of a round every [`TICK`], until `stop`; counts what was sent in `sent`.
async fn heartbeat(
    url: &str,
    subjects: &Subjects,
    n: usize,
    tracker: &TaskTracker,
    stop: CancellationToken,
    sent: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    // Encoded once, at two loads: each agent's load changes with every round (as a busy
    // agent's does), which must cost the coordinator no write; otherwise a heartbeat is the
    // same bytes every time (the coordinator keys nothing on the envelope's id).
    let mut shares: Vec<Vec<(String, [Bytes; 2])>> = vec![Vec::new(); CONNECTIONS];
    for i in 0..n {
        let mut m = manifest(i);
        let mut at_load = |load: f32| -> anyhow::Result<Bytes> {
            m.load = load;
            let mut env = Envelope::new(Kind::Heartbeat, Performative::Health, m.agent.as_str());
            env.payload = codec::encode_payload(&m, CONTENT_TYPE_MSGPACK)?;
            Ok(codec::encode(&env, Encoding::MsgPack)?)
        };
        let loads = [at_load(0.25)?, at_load(0.75)?];
        shares[i % CONNECTIONS].push((subjects.heartbeat(&format!("sim-{i:06}"))?, loads));
    }
    let ticks_per_round = (HEARTBEAT.as_millis() / TICK.as_millis()).max(1) as usize;
    for (c, share) in shares.into_iter().enumerate() {
        let broker = connect(url, &format!("fleet-heartbeats-{c}")).await?;
        let stop = stop.clone();
        let sent = Arc::clone(&sent);
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            // Each tick sends what is due by then, so a round takes the interval exactly.
            let (mut ticks, mut published) = (0usize, 0usize);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.cancelled() => break,
                }
                ticks += 1;
                let due = ticks * share.len() / ticks_per_round;
                while published < due {
                    let (subject, loads) = &share[published % share.len()];
                    let bytes = &loads[(published / share.len()) % 2];
                    if broker.publish(subject, bytes.clone()).await.is_ok() {
                        sent.fetch_add(1, Ordering::Relaxed);
                    }
                    published += 1;
                }
            }
            let _ = broker.drain().await;
        });
    }
    Ok(())
}

/// Answers every request sent to any simulated agent (`<root>.agent.*.>`) with success,
/// until `stop`.
async fn answer_requests(
    url: &str,
    subjects: &Subjects,
    tracker: &TaskTracker,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let broker = connect(url, "fleet-answers").await?;
    let mut sub = broker
        .subscribe(&format!("{}.agent.*.>", subjects.root()))
        .await?;
    broker.flush().await?;
    tracker.spawn(async move {
        while let Some(msg) = sub.next_until(stop.cancelled()).await {
            let Some(reply_to) = msg.reply() else {
                continue;
            };
            let Ok((request, encoding)) = codec::decode(msg.payload()) else {
                continue;
            };
            let Some(to) = request.to.first() else {
                continue;
            };
            let reply = request.reply(to.as_str(), StatusCode::OK);
            if let Ok(bytes) = codec::encode(&reply, encoding) {
                let _ = broker.publish(reply_to, bytes).await;
            }
        }
        let _ = broker.drain().await;
    });
    Ok(())
}

async fn connect(url: &str, name: &str) -> anyhow::Result<Broker> {
    Ok(BrokerOptions::new([url])
        .name(name)
        .subscription_capacity(1 << 20)
        .connect()
        .await?)
}

/// Drains `broker` and waits (a few seconds at most) until its connection is closed, so the
/// server can go without the client trying to reconnect to it.
async fn close(broker: Broker) {
    let mut events = broker.events();
    if broker.drain().await.is_err() {
        return;
    }
    let closed = async {
        loop {
            match events.recv().await {
                Ok(broker_adapter::ConnectionEvent::Closed) | Err(_) => break,
                Ok(_) => {}
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), closed).await;
}

/// `chorus serve` in its own process, with its metrics listener.
struct Coordinator {
    child: tokio::process::Child,
    metrics: String,
}

impl Coordinator {
    async fn start(program: &Path, url: &str) -> anyhow::Result<Coordinator> {
        let mut child = tokio::process::Command::new(program)
            .args(["--server", url, "--root", ROOT, "serve"])
            .env("CHORUS_SERVE__METRICS_ADDR", "127.0.0.1:0")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await??
            .ok_or_else(|| anyhow::anyhow!("chorus serve exited before serving"))?;
        let metrics = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .ok_or_else(|| anyhow::anyhow!("no metrics address in {line:?}"))?
            .to_owned();
        Ok(Coordinator { child, metrics })
    }

    /// The sum of the samples of `name` whose labels contain `label`.
    async fn gauge(&self, name: &str, label: &str) -> anyhow::Result<f64> {
        let text = http_get(&self.metrics, "/metrics").await?;
        Ok(text
            .lines()
            .filter(|l| l.starts_with(name) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum())
    }

    fn pid(&self) -> anyhow::Result<u32> {
        self.child
            .id()
            .ok_or_else(|| anyhow::anyhow!("the coordinator has exited"))
    }

    fn rss(&self) -> anyhow::Result<u64> {
        rss_of(self.pid()?).ok_or_else(|| anyhow::anyhow!("no resident memory"))
    }

    /// User and system CPU seconds used so far.
    fn cpu_seconds(&self) -> anyhow::Result<f64> {
        cpu_seconds_of(self.pid()?)
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// User and system CPU seconds process `pid` used so far.
fn cpu_seconds_of(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command (which may hold spaces) in parentheses.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| anyhow::anyhow!("unreadable /proc stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the command.
    let ticks: f64 = fields
        .get(11..13)
        .ok_or_else(|| anyhow::anyhow!("short /proc stat"))?
        .iter()
        .map(|f| f.parse::<f64>().unwrap_or(0.0))
        .sum();
    Ok(ticks / CLOCK_TICKS)
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`), 100 on Linux.
const CLOCK_TICKS: f64 = 100.0;

/// A number at the top level of a JSON document from the server's monitoring port.
async fn monitor_number(monitor: &str, path: &str, field: &str) -> anyhow::Result<u64> {
    let address = monitor
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let body = http_get(&address, path).await?;
    let json: serde_json::Value = serde_json::from_str(&body)?;
    json.get(field)
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| anyhow::anyhow!("no {field} in {path}"))
}

/// The body of `GET path` from `address` (`host:port`), over HTTP/1.0.
async fn http_get(address: &str, path: &str) -> anyhow::Result<String> {
    let get = async {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())
            .await?;
        let mut text = String::new();
        stream.read_to_string(&mut text).await?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok::<_, anyhow::Error>(body)
    };
    tokio::time::timeout(Duration::from_secs(10), get).await?
}

/// What the durable-inbox fleet measured.
#[derive(Debug, Clone)]
pub(crate) struct DurableFigures {
    pub(crate) agents: usize,
    pub(crate) consumers: u64,
    pub(crate) created_in: Duration,
    pub(crate) server_rss_before: u64,
    pub(crate) server_rss_after: u64,
    pub(crate) active: usize,
    pub(crate) sent: u64,
    pub(crate) delivered: u64,
    pub(crate) in_order: bool,
    pub(crate) delivered_in: Duration,
}

/// Durable inboxes at scale with consumers always held (`InboxConsumers::Always`, the naive
/// design): `agents` agents each with its
/// two consumers (normal and high priority) on the inbox stream, most of them idle; then
/// `per_agent` commands to each of `active` of them, pulled and acked through their consumers
/// and checked for order and loss.
pub(crate) async fn durable(
    agents: usize,
    active: usize,
    per_agent: u32,
    progress: fn(&str),
) -> anyhow::Result<Vec<Row>> {
    use agent_sdk::durable::{InboxLimits, inbox_stream};
    use broker_adapter::{BatchMessage, ConsumerSpec};
    progress(&format!(
        "durable inboxes: {agents} agents with their consumers, {per_agent} commands to {active} of them"
    ));
    let (server, url, monitor) = monitored_server().await?;
    let subjects = Subjects::new(ROOT)?;
    let broker = connect(&url, "fleet-durable").await?;
    let js = broker.jetstream(Duration::from_secs(30));
    let inbox = inbox_stream(&subjects, &InboxLimits::default());
    js.ensure_stream(&inbox).await?;
    let server_rss_before = server.pid().and_then(rss_of).unwrap_or(0);
    // Each agent's consumers as the SDK makes them (durable/inbox.rs).
    let spec_of = |i: usize, high: bool| -> anyhow::Result<ConsumerSpec> {
        let agent = format!("sim-{i:06}");
        let mut spec = ConsumerSpec::new(if high {
            format!("{agent}_high")
        } else {
            agent.clone()
        });
        spec.filter_subjects = vec![subjects.durable_inbox(&agent, high)?];
        spec.ack_wait = Duration::from_secs(30);
        spec.max_deliver = 5;
        spec.max_ack_pending = 64;
        spec.description = format!("durable inbox of agent {agent}");
        Ok(spec)
    };
    let t = Instant::now();
    let specs: Vec<ConsumerSpec> = (0..agents)
        .flat_map(|i| [spec_of(i, false), spec_of(i, true)])
        .collect::<anyhow::Result<_>>()?;
    let mut created = futures::stream::iter(
        specs
            .iter()
            .map(|spec| js.ensure_consumer(&inbox.name, spec)),
    )
    .buffer_unordered(32);
    while let Some(consumer) = created.next().await {
        consumer?;
    }
    drop(created);
    let created_in = t.elapsed();
    let consumers = monitor_number(&monitor, "/jsz", "consumers").await?;
    let server_rss_after = server.pid().and_then(rss_of).unwrap_or(0);
    // Commands to the active agents, every agent's in order.
    let mut batch = Vec::with_capacity(active * per_agent as usize);
    for n in 0..per_agent {
        for i in 0..active {
            batch.push(BatchMessage {
                subject: subjects.durable(&format!("sim-{i:06}"), "work", false)?,
                msg_id: None,
                payload: Bytes::from(n.to_be_bytes().to_vec()),
            });
        }
    }
    let sent = batch.len() as u64;
    let t = Instant::now();
    for ack in js.publish_batch(batch, 256).await {
        ack?;
    }
    let pull = |i: usize| {
        let js = js.clone();
        let spec = spec_of(i, false);
        let stream = inbox.name.clone();
        async move {
            let consumer = js.ensure_consumer(&stream, &spec?).await?;
            let mut deliveries = consumer.messages(per_agent as usize).await?;
            let mut got = Vec::with_capacity(per_agent as usize);
            while got.len() < per_agent as usize {
                let next = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
                    .await
                    .map_err(|_| anyhow::anyhow!("agent {i}: no delivery within 30 s"))?;
                let Some(delivery) = next else { break };
                let Ok(delivery) = delivery else { continue };
                let n = delivery
                    .payload()
                    .get(..4)
                    .and_then(|b| <[u8; 4]>::try_from(b).ok())
                    .map(u32::from_be_bytes);
                delivery.ack().await?;
                got.extend(n);
            }
            Ok::<_, anyhow::Error>(got)
        }
    };
    let mut delivered = 0u64;
    let mut in_order = true;
    let mut pulls = futures::stream::iter((0..active).map(pull)).buffer_unordered(16);
    while let Some(got) = pulls.next().await {
        let got = got?;
        delivered += got.len() as u64;
        in_order &= got == (0..per_agent).collect::<Vec<_>>();
    }
    let delivered_in = t.elapsed();
    drop(pulls);
    drop(js);
    close(broker).await;
    drop(server);
    let f = DurableFigures {
        agents,
        consumers,
        created_in,
        server_rss_before,
        server_rss_after,
        active,
        sent,
        delivered,
        in_order,
        delivered_in,
    };
    Ok(durable_rows(&f))
}

fn durable_rows(f: &DurableFigures) -> Vec<Row> {
    let at = |what: &str| format!("{} durable agents, consumers always held: {what}", f.agents);
    let per_consumer_kib = (f.server_rss_after.saturating_sub(f.server_rss_before)) as f64
        / 1024.0
        / f.consumers.max(1) as f64;
    vec![
        Row::chorus_only(
            &at("JetStream consumers (two per agent, as the SDK makes them)"),
            "consumers",
            f.consumers as f64,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("time to create their consumers, 32 at a time"),
            "s",
            f.created_in.as_secs_f64(),
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("server resident memory with them"),
            "MiB",
            mib(f.server_rss_after),
            &format!(
                "(reported; {:.1} MiB before, {per_consumer_kib:.1} KiB per consumer)",
                mib(f.server_rss_before)
            ),
            None,
        ),
        Row::chorus_only(
            &at(&format!(
                "commands to {} of them delivered in order, every one acked",
                f.active
            )),
            "s",
            f.delivered_in.as_secs_f64(),
            "in order, lost 0",
            Some(f.in_order && f.delivered == f.sent),
        )
        .counts(f.sent, f.delivered),
    ]
}

/// What the on-demand durable-inbox fleet measured.
#[derive(Debug, Clone)]
pub(crate) struct OnDemandFigures {
    pub(crate) agents: usize,
    pub(crate) started_in: Duration,
    pub(crate) idle_consumers: u64,
    pub(crate) subscriptions: u64,
    pub(crate) server_rss_before: u64,
    pub(crate) server_rss_idle: u64,
    pub(crate) active: usize,
    pub(crate) sent: u64,
    pub(crate) delivered: u64,
    pub(crate) in_order: bool,
    pub(crate) delivered_in: Duration,
    pub(crate) peak_consumers: u64,
    pub(crate) released_in: Duration,
    pub(crate) consumers_after: u64,
    /// A durable command to an SDK agent, sent to handled: with no consumer (the bell opens
    /// one), and with its consumer open.
    pub(crate) cold: Vec<Duration>,
    pub(crate) warm: Vec<Duration>,
    /// Server CPU (100 = one core) while idle agents' looks arrive at the rate of `agents`
    /// and of 100,000 agents, each looking every `DEFAULT_INBOX_RECHECK`.
    pub(crate) look_cpu: Vec<(usize, f64)>,
}

/// How long the looks of idle agents are sent at their rate to measure the server's CPU.
const LOOK_WINDOW: Duration = Duration::from_secs(10);

/// Sends the looks `agents` idle agents make (one for both lanes every
/// `DEFAULT_INBOX_RECHECK`),
/// spread evenly over [`LOOK_WINDOW`], and returns the server's CPU meanwhile.
async fn look_load(
    js: &broker_adapter::JetStream,
    stream: &str,
    subjects: &Subjects,
    server_pid: u32,
    agents: usize,
) -> anyhow::Result<f64> {
    use agent_sdk::durable::DEFAULT_INBOX_RECHECK;
    let per_second = agents as f64 / DEFAULT_INBOX_RECHECK.as_secs_f64();
    let total = (per_second * LOOK_WINDOW.as_secs_f64()) as usize;
    let cpu0 = cpu_seconds_of(server_pid)?;
    let t = Instant::now();
    let mut tick = tokio::time::interval(TICK);
    let mut sent = 0usize;
    let mut looks = futures::stream::FuturesUnordered::new();
    while sent < total {
        tick.tick().await;
        let due = ((t.elapsed().as_secs_f64() * per_second) as usize).min(total);
        while sent < due {
            let filter = subjects.durable_agent_all(&format!("sim-{:06}", sent % agents.max(1)))?;
            let js = js.clone();
            let stream = stream.to_owned();
            looks.push(async move { js.subject_counts(&stream, &filter).await });
            sent += 1;
        }
        while let Some(Some(look)) = futures::FutureExt::now_or_never(looks.next()) {
            look?;
        }
    }
    while let Some(look) = looks.next().await {
        look?;
    }
    Ok(100.0 * (cpu_seconds_of(server_pid)? - cpu0) / t.elapsed().as_secs_f64())
}

/// Rounds of the cold and warm durable command measurement.
const FIRST_COMMAND_ROUNDS: usize = 20;

/// A durable command's time from send to handled at one SDK agent, on demand: cold (its
/// consumer released, so the bell opens one) and warm (the consumer still open), `rounds`
/// times each.
async fn first_command(url: &str, rounds: usize) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    use agent_sdk::durable::InboxConsumers;
    let release_after = Duration::from_millis(200);
    let worker = AgentOptions::new("fleet-durable")
        .servers([url])
        .root(ROOT)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .durable_inbox(true)
        .inbox_consumers(InboxConsumers::OnDemand {
            release_after,
            recheck: Duration::from_secs(60),
        })
        .connect()
        .await?;
    let (handled_tx, mut handled) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    worker
        .on_command("work", move |_ctx: agent_sdk::Context, (): ()| {
            let _ = handled_tx.send(Instant::now());
            async { Ok::<_, agent_sdk::HandlerError>(()) }
        })
        .await?;
    let sender = AgentOptions::new("fleet-sender")
        .servers([url])
        .root(ROOT)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .connect()
        .await?;
    let call = || {
        agent_sdk::Call::agent("fleet-durable", "work")
            .command()
            .payload(&())
    };
    let mut one = async |released: u64| -> anyhow::Result<Duration> {
        // Cold rounds wait for the release first.
        let deadline = Instant::now() + Duration::from_secs(10);
        while worker.stats().inbox_consumers_released < released {
            anyhow::ensure!(Instant::now() < deadline, "the consumer was not released");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let t = Instant::now();
        sender.send_durable(call()?).await?;
        let at = tokio::time::timeout(Duration::from_secs(10), handled.recv())
            .await?
            .ok_or_else(|| anyhow::anyhow!("the worker stopped"))?;
        Ok(at.duration_since(t))
    };
    let (mut cold, mut warm) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for round in 0..rounds as u64 {
        cold.push(one(round).await?);
        warm.push(one(0).await?);
    }
    sender.shutdown().await;
    worker.shutdown().await;
    cold.sort();
    warm.sort();
    Ok((cold, warm))
}

/// How long a simulated on-demand agent waits with nothing arriving before it releases its
/// consumer (the SDK's default is 30 s; shorter here so the run is short).
const SIM_RELEASE_AFTER: Duration = Duration::from_secs(2);

/// Durable inboxes at scale with on-demand consumers (`InboxConsumers::OnDemand`, the SDK's
/// default), as the SDK runs them (durable/inbox.rs): each of `agents` agents subscribes to
/// its bells and looks for stored commands of both lanes at start, holding no consumer; then
/// `per_agent` commands to each of `active` of them ring their bells, each of those opens its
/// normal lane's consumer, takes and acks its commands (checked for order and loss), and
/// deletes the consumer once nothing has arrived for a quiet time and nothing is pending.
pub(crate) async fn durable_on_demand(
    agents: usize,
    active: usize,
    per_agent: u32,
    progress: fn(&str),
) -> anyhow::Result<Vec<Row>> {
    use agent_sdk::durable::{ABANDONED_CONSUMER_AFTER, InboxLimits, inbox_stream};
    use broker_adapter::{BatchMessage, ConsumerSpec};
    progress(&format!(
        "durable inboxes on demand: {agents} agents with their bells, {per_agent} commands to {active} of them"
    ));
    let (server, url, monitor) = monitored_server().await?;
    let subjects = Subjects::new(ROOT)?;
    let broker = connect(&url, "fleet-on-demand").await?;
    let js = broker.jetstream(Duration::from_secs(30));
    let inbox = inbox_stream(&subjects, &InboxLimits::default());
    js.ensure_stream(&inbox).await?;
    let server_rss_before = server.pid().and_then(rss_of).unwrap_or(0);
    let agent = |i: usize| format!("sim-{i:06}");
    // The agents' start: a bell subscription each (on shared connections), then a look at both
    // lanes for stored commands, 32 agents at a time.
    let mut connections = Vec::with_capacity(CONNECTIONS);
    for c in 0..CONNECTIONS {
        connections.push(connect(&url, &format!("fleet-bells-{c}")).await?);
    }
    let t = Instant::now();
    let mut bells = Vec::with_capacity(agents);
    for i in 0..agents {
        let subject = subjects.bells(&agent(i))?;
        bells.push(Some(
            connections[i % CONNECTIONS].subscribe(&subject).await?,
        ));
    }
    let mut looks = futures::stream::iter((0..agents).map(|i| {
        let js = js.clone();
        let filter = subjects.durable_agent_all(&agent(i));
        let stream = inbox.name.clone();
        async move {
            js.subject_counts(&stream, &filter?)
                .await
                .map_err(anyhow::Error::from)
        }
    }))
    .buffer_unordered(32);
    while let Some(found) = looks.next().await {
        if !found?.is_empty() {
            anyhow::bail!("an empty inbox reported stored commands");
        }
    }
    drop(looks);
    let started_in = t.elapsed();
    for c in &connections {
        c.flush().await?;
    }
    let idle_consumers = monitor_number(&monitor, "/jsz", "consumers").await?;
    let subscriptions = monitor_number(&monitor, "/varz", "subscriptions").await?;
    let server_rss_idle = server.pid().and_then(rss_of).unwrap_or(0);

    // The active agents wait for their bells; each opens its consumer when one rings.
    let spec_of = |i: usize| -> anyhow::Result<ConsumerSpec> {
        let mut spec = ConsumerSpec::new(agent(i));
        spec.filter_subjects = vec![subjects.durable_inbox(&agent(i), false)?];
        spec.ack_wait = Duration::from_secs(30);
        spec.max_deliver = 5;
        spec.max_ack_pending = 64;
        spec.inactive_threshold = ABANDONED_CONSUMER_AFTER;
        spec.description = format!("durable inbox of agent {}", agent(i));
        Ok(spec)
    };
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let tracker = TaskTracker::new();
    let mut handles = Vec::with_capacity(active);
    for (i, bell) in bells.iter_mut().enumerate().take(active) {
        let Some(mut bell) = bell.take() else {
            continue;
        };
        let js = js.clone();
        let spec = spec_of(i)?;
        let stream = inbox.name.clone();
        let done = done_tx.clone();
        handles.push(tracker.spawn(async move {
            let run = async {
                tokio::time::timeout(Duration::from_secs(120), bell.next())
                    .await
                    .map_err(|_| anyhow::anyhow!("agent {i}: no bell within 120 s"))?;
                let consumer = js.ensure_consumer(&stream, &spec).await?;
                let mut deliveries = consumer.messages(per_agent as usize).await?;
                let mut got = Vec::with_capacity(per_agent as usize);
                loop {
                    // Quiet once everything arrived and nothing more comes for the release time.
                    let wait = if got.len() >= per_agent as usize {
                        SIM_RELEASE_AFTER
                    } else {
                        Duration::from_secs(60)
                    };
                    let Ok(next) = tokio::time::timeout(wait, deliveries.next()).await else {
                        break;
                    };
                    let Some(delivery) = next else { break };
                    let Ok(delivery) = delivery else { continue };
                    let n = delivery
                        .payload()
                        .get(..4)
                        .and_then(|b| <[u8; 4]>::try_from(b).ok())
                        .map(u32::from_be_bytes);
                    delivery.ack().await?;
                    got.extend(n);
                    if got.len() == per_agent as usize {
                        let _ = done.send(Instant::now());
                    }
                }
                drop(deliveries);
                let state = js.consumer_state(&stream, &spec.durable).await?;
                if state.pending == 0 && state.ack_pending == 0 {
                    js.delete_consumer(&stream, &spec.durable).await?;
                }
                Ok::<_, anyhow::Error>(got)
            };
            run.await
        }));
    }
    drop(done_tx);
    // Commands to the active agents, every agent's in order.
    let mut batch = Vec::with_capacity(active * per_agent as usize);
    for n in 0..per_agent {
        for i in 0..active {
            batch.push(BatchMessage {
                subject: subjects.durable(&agent(i), "work", false)?,
                msg_id: None,
                payload: Bytes::from(n.to_be_bytes().to_vec()),
            });
        }
    }
    let sent = batch.len() as u64;
    let t = Instant::now();
    // Sample the consumer count while the commands are taken.
    let sampling = CancellationToken::new();
    let sampler = {
        let monitor = monitor.clone();
        let stop = sampling.clone();
        tokio::spawn(async move {
            let mut peak = 0u64;
            loop {
                if let Ok(n) = monitor_number(&monitor, "/jsz", "consumers").await {
                    peak = peak.max(n);
                }
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
            peak
        })
    };
    for ack in js.publish_batch(batch, 256).await {
        ack?;
    }
    let mut last_done = t;
    while let Some(at) = done_rx.recv().await {
        last_done = last_done.max(at);
    }
    // Every sender of `done` is gone: every active agent released (or failed).
    let mut delivered = 0u64;
    let mut in_order = true;
    for handle in handles {
        let got = handle.await??;
        delivered += got.len() as u64;
        in_order &= got == (0..per_agent).collect::<Vec<_>>();
    }
    tracker.close();
    tracker.wait().await;
    let released_in = t.elapsed();
    sampling.cancel();
    let peak_consumers = sampler.await.unwrap_or(0);
    let consumers_after = monitor_number(&monitor, "/jsz", "consumers").await?;
    let delivered_in = last_done.duration_since(t);
    let (cold, warm) = first_command(&url, FIRST_COMMAND_ROUNDS).await?;
    let mut look_cpu = Vec::new();
    if let Some(pid) = server.pid() {
        for fleet in [agents, 100_000] {
            look_cpu.push((
                fleet,
                look_load(&js, &inbox.name, &subjects, pid, fleet).await?,
            ));
        }
    }
    drop(bells);
    drop(js);
    for c in connections {
        close(c).await;
    }
    close(broker).await;
    drop(server);
    let f = OnDemandFigures {
        agents,
        started_in,
        idle_consumers,
        subscriptions,
        server_rss_before,
        server_rss_idle,
        active,
        sent,
        delivered,
        in_order,
        delivered_in,
        peak_consumers,
        released_in,
        consumers_after,
        cold,
        warm,
        look_cpu,
    };
    Ok(on_demand_rows(&f))
}

fn on_demand_rows(f: &OnDemandFigures) -> Vec<Row> {
    let at = |what: &str| format!("{} durable agents, consumers on demand: {what}", f.agents);
    let mut rows = vec![
        Row::chorus_only(
            &at("time for all to start (a bell subscription and one look each)"),
            "s",
            f.started_in.as_secs_f64(),
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("JetStream consumers while idle"),
            "consumers",
            f.idle_consumers as f64,
            "none",
            Some(f.idle_consumers == 0),
        ),
        Row::chorus_only(
            &at("server subscriptions (one bell each)"),
            "subscriptions",
            f.subscriptions as f64,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("server resident memory with them"),
            "MiB",
            mib(f.server_rss_idle),
            &format!("(reported; {:.1} MiB before)", mib(f.server_rss_before)),
            None,
        ),
        Row::chorus_only(
            &at(&format!(
                "commands to {} of them delivered in order, every one acked",
                f.active
            )),
            "s",
            f.delivered_in.as_secs_f64(),
            "in order, lost 0",
            Some(f.in_order && f.delivered == f.sent),
        )
        .counts(f.sent, f.delivered),
        Row::chorus_only(
            &at("consumers at the busiest"),
            "consumers",
            f.peak_consumers as f64,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at(&format!(
                "consumers after {} s quiet, all released in",
                SIM_RELEASE_AFTER.as_secs()
            )),
            "s",
            f.released_in.as_secs_f64(),
            &format!("{} left: none", f.consumers_after),
            Some(f.consumers_after == 0),
        ),
        Row::chorus_only(
            "a durable command to an SDK agent, sent to handled, its consumer released (p50)",
            "us",
            percentile(&f.cold, 0.5),
            &format!(
                "(reported; p99 {:.0} us; the bell opens the consumer)",
                percentile(&f.cold, 0.99)
            ),
            None,
        )
        .counts(f.cold.len() as u64, f.cold.len() as u64),
        Row::chorus_only(
            "a durable command to an SDK agent, sent to handled, its consumer open (p50)",
            "us",
            percentile(&f.warm, 0.5),
            &format!("(reported; p99 {:.0} us)", percentile(&f.warm, 0.99)),
            None,
        )
        .counts(f.warm.len() as u64, f.warm.len() as u64),
    ];
    for (fleet, cpu) in &f.look_cpu {
        rows.push(Row::chorus_only(
            &format!(
                "server CPU for the looks of {fleet} idle agents (one look every {} s each)",
                agent_sdk::durable::DEFAULT_INBOX_RECHECK.as_secs()
            ),
            "%",
            *cpu,
            &format!(
                "(reported; {:.0} looks/s; 100 = one core)",
                *fleet as f64 / agent_sdk::durable::DEFAULT_INBOX_RECHECK.as_secs_f64()
            ),
            None,
        ));
    }
    rows
}

/// How long discovery is asked for, many queries in flight, when coordinators share the work.
const SHARED_WINDOW: Duration = Duration::from_secs(5);
/// Discovery queries in flight at once then.
const SHARED_IN_FLIGHT: usize = 32;
/// Broadcasts sent then (to the group of the first 10,000 agents, or to all of a smaller fleet).
const SHARED_BROADCASTS: usize = 4;

/// What one count of coordinators sharing a fleet measured.
#[derive(Debug, Clone)]
struct SharedFigures {
    coordinators: usize,
    agents: usize,
    /// Each coordinator's resident memory, CPU under steady heartbeats (%), heartbeats/s.
    each: Vec<(u64, f64, f64)>,
    queries_per_second: f64,
    discovery_p99: f64,
    /// CPU while discovery was asked (100 = one core): all coordinators together, the server,
    /// the simulator (the asking agent, the heartbeats).
    discovery_cpu: (f64, f64, f64),
    /// Each coordinator's share of the discovery queries answered.
    query_shares: Vec<f64>,
    /// Broadcasts each coordinator fanned out.
    broadcasts: Vec<u64>,
    broadcasts_delivered: bool,
}

/// Several coordinators sharing one fleet of `n` agents: for each count in `counts`, a fresh
/// server, that many `chorus serve` processes, the fleet's heartbeats; then discovery with
/// many queries in flight for a while and a few broadcasts. Prints what each coordinator
/// held, used and answered: discovery and broadcasts go to one of the coordinators' queue
/// group, heartbeats to every one.
pub(crate) async fn coordinators(
    program: &Path,
    n: usize,
    counts: &[usize],
    progress: fn(&str),
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let mut single_rate = None;
    for &count in counts {
        progress(&format!(
            "{count} coordinators sharing {n} simulated agents"
        ));
        let f = shared(program, n, count).await?;
        single_rate.get_or_insert(f.queries_per_second);
        rows.extend(shared_rows(&f, single_rate.unwrap_or(f.queries_per_second)));
    }
    Ok(rows)
}

async fn shared(program: &Path, n: usize, count: usize) -> anyhow::Result<SharedFigures> {
    let (server, url, _monitor) = monitored_server().await?;
    let mut coordinators = Vec::with_capacity(count);
    for _ in 0..count {
        coordinators.push(Coordinator::start(program, &url).await?);
    }
    let subjects = Subjects::new(ROOT)?;
    let stop = CancellationToken::new();
    let tracker = TaskTracker::new();
    let sent = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let result = async {
        answer_requests(&url, &subjects, &tracker, stop.clone()).await?;
        heartbeat(
            &url,
            &subjects,
            n,
            &tracker,
            stop.clone(),
            Arc::clone(&sent),
        )
        .await?;
        let deadline = started + Duration::from_secs(60) + HEARTBEAT * 4;
        for c in &coordinators {
            loop {
                let live = c
                    .gauge("chorus_coordinator_agents", "state=\"live\"")
                    .await? as u64;
                if live >= n as u64 {
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "a coordinator saw only {live} of {n} agents live"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        // Steady heartbeats: each coordinator's CPU, memory and heartbeats handled.
        let hb = "chorus_coordinator_messages_total";
        let mut before = Vec::with_capacity(count);
        for c in &coordinators {
            before.push((c.cpu_seconds()?, c.gauge(hb, "kind=\"heartbeat\"").await?));
        }
        let t0 = Instant::now();
        tokio::time::sleep(STEADY_WINDOW).await;
        let secs = t0.elapsed().as_secs_f64();
        let mut each = Vec::with_capacity(count);
        for (c, (cpu0, hb0)) in coordinators.iter().zip(before) {
            each.push((
                c.rss()?,
                100.0 * (c.cpu_seconds()? - cpu0) / secs,
                (c.gauge(hb, "kind=\"heartbeat\"").await? - hb0) / secs,
            ));
        }
        // Discovery, many queries in flight, from one SDK agent.
        let client = AgentOptions::new("fleet-client")
            .servers([url.as_str()])
            .root(ROOT)
            .heartbeat_interval(Duration::ZERO)
            .service_discovery(false)
            .request_timeout(Duration::from_secs(30))
            .connect()
            .await?;
        let request = "kind=\"request\"";
        let mut answered0 = Vec::with_capacity(count);
        for c in &coordinators {
            answered0.push(c.gauge(hb, request).await?);
        }
        let query = DiscoverQuery::capability("rare");
        let holders = n.div_ceil(RARE_EVERY);
        let cpu_now = |coordinators: &[Coordinator]| -> anyhow::Result<(f64, f64, f64)> {
            let mut sum = 0.0;
            for c in coordinators {
                sum += c.cpu_seconds()?;
            }
            let server_cpu = match server.pid() {
                Some(pid) => cpu_seconds_of(pid)?,
                None => 0.0,
            };
            Ok((sum, server_cpu, cpu_seconds_of(std::process::id())?))
        };
        let cpu0 = cpu_now(&coordinators)?;
        let t = Instant::now();
        let mut latencies = Vec::new();
        let mut asked = futures::stream::iter(0..)
            .map(|_| {
                let client = client.clone();
                let query = query.clone();
                async move {
                    let t = Instant::now();
                    let found = client.discover(&query).await?;
                    anyhow::ensure!(found.len() == holders, "discovery found {}", found.len());
                    Ok::<_, anyhow::Error>(t.elapsed())
                }
            })
            .buffer_unordered(SHARED_IN_FLIGHT);
        while t.elapsed() < SHARED_WINDOW {
            match asked.next().await {
                Some(latency) => latencies.push(latency?),
                None => break,
            }
        }
        drop(asked);
        let window = t.elapsed().as_secs_f64();
        let cpu1 = cpu_now(&coordinators)?;
        let discovery_cpu = (
            100.0 * (cpu1.0 - cpu0.0) / window,
            100.0 * (cpu1.1 - cpu0.1) / window,
            100.0 * (cpu1.2 - cpu0.2) / window,
        );
        let queries_per_second = latencies.len() as f64 / window;
        latencies.sort();
        let discovery_p99 = percentile(&latencies, 0.99);
        let mut query_shares = Vec::with_capacity(count);
        let mut total = 0.0;
        for (c, a0) in coordinators.iter().zip(&answered0) {
            let a = c.gauge(hb, request).await? - a0;
            total += a;
            query_shares.push(a);
        }
        for share in &mut query_shares {
            *share /= total.max(1.0);
        }
        // A few broadcasts: each goes to one coordinator of the group.
        let target = if n >= BROADCAST_GROUP_SIZE {
            BroadcastTarget::Group("ten-k".into())
        } else {
            BroadcastTarget::All
        };
        let expected = n.min(BROADCAST_GROUP_SIZE);
        let mut broadcasts_delivered = true;
        for _ in 0..SHARED_BROADCASTS {
            let report = client
                .broadcast(&target, "ping", &(), BROADCAST_TIMEOUT)
                .await?;
            broadcasts_delivered &= report.count(Outcome::Delivered) >= expected;
        }
        let mut broadcasts = Vec::with_capacity(count);
        for c in &coordinators {
            broadcasts.push(c.gauge("chorus_coordinator_broadcasts_total", "").await? as u64);
        }
        client.shutdown().await;
        Ok(SharedFigures {
            coordinators: count,
            agents: n,
            each,
            queries_per_second,
            discovery_p99,
            discovery_cpu,
            query_shares,
            broadcasts,
            broadcasts_delivered,
        })
    }
    .await;
    stop.cancel();
    tracker.close();
    tracker.wait().await;
    for c in coordinators {
        c.stop().await;
    }
    drop(server);
    result
}

fn shared_rows(f: &SharedFigures, single_rate: f64) -> Vec<Row> {
    let at = |what: &str| {
        format!(
            "{} coordinator(s), {} agents: {what}",
            f.coordinators, f.agents
        )
    };
    let list = |values: Vec<String>| values.join(" / ");
    let min_share = f.query_shares.iter().copied().fold(1.0, f64::min);
    vec![
        Row::chorus_only(
            &at("resident memory of each"),
            "MiB",
            f.each.iter().map(|e| mib(e.0)).fold(0.0, f64::max),
            &format!(
                "(reported; each: {} MiB)",
                list(f.each.iter().map(|e| format!("{:.0}", mib(e.0))).collect())
            ),
            None,
        ),
        Row::chorus_only(
            &at("CPU of each, steady heartbeats"),
            "%",
            f.each.iter().map(|e| e.1).fold(0.0, f64::max),
            &format!(
                "(reported; each: {} %; every one hears every heartbeat: {} /s)",
                list(f.each.iter().map(|e| format!("{:.1}", e.1)).collect()),
                list(f.each.iter().map(|e| format!("{:.0}", e.2)).collect())
            ),
            None,
        ),
        Row::chorus_only(
            &at(&format!("discovery answered, {SHARED_IN_FLIGHT} in flight")),
            "q/s",
            f.queries_per_second,
            &format!(
                "(reported; {:.2} of one coordinator's; p99 {:.0} us; CPU: coordinators {:.0} %, server {:.0} %, asker {:.0} %)",
                f.queries_per_second / single_rate.max(1.0),
                f.discovery_p99,
                f.discovery_cpu.0,
                f.discovery_cpu.1,
                f.discovery_cpu.2
            ),
            None,
        ),
        Row::chorus_only(
            &at("share of the queries each answered"),
            "%",
            100.0 * min_share,
            &format!(
                "(smallest; each: {} %)",
                list(
                    f.query_shares
                        .iter()
                        .map(|s| format!("{:.0}", 100.0 * s))
                        .collect()
                )
            ),
            None,
        ),
        Row::chorus_only(
            &at(&format!(
                "{SHARED_BROADCASTS} broadcasts, each fanned out by one"
            )),
            "broadcasts",
            f.broadcasts.iter().sum::<u64>() as f64,
            &format!(
                "all delivered; each coordinator: {}",
                list(f.broadcasts.iter().map(u64::to_string).collect())
            ),
            Some(
                f.broadcasts_delivered
                    && f.broadcasts.iter().sum::<u64>() == SHARED_BROADCASTS as u64,
            ),
        ),
    ]
}
