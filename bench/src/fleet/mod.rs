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
//!
//! Rooms: `sizes` (one coordinator at 1,000 to 100,000 agents), `shared` (several
//! coordinators sharing a fleet), `inboxes` (durable inboxes at scale, consumers always held
//! and on demand); this file holds what they share: the server, the coordinator processes, the
//! simulated heartbeats and answers, and reading `/proc` and the monitoring port.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chorus_broker_adapter::{Broker, BrokerOptions};
use chorus_nats_server::NatsServer;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::envelope::CONTENT_TYPE_MSGPACK;
use chorus_sdk::registry::{BroadcastTarget, CapabilityInfo, DiscoverQuery, Outcome};
use chorus_sdk::{
    AgentOptions, Availability, Envelope, Kind, Manifest, Performative, StatusCode, Subjects,
};
use futures::StreamExt;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::memory::rss_of;
use crate::report::{Row, percentile};

mod hosted;
mod inboxes;
mod shared;
mod sizes;

pub(crate) use hosted::hosted;
pub(crate) use inboxes::{durable, durable_on_demand};
pub(crate) use shared::coordinators;
pub(crate) use sizes::scale;

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
fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
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
        max_tokens: None,
        handling_ms: None,
    }];
    if i.is_multiple_of(RARE_EVERY) {
        capabilities.push(CapabilityInfo {
            name: "rare".into(),
            version: "1".into(),
            models: Vec::new(),
            throughput: None,
            max_tokens: None,
            handling_ms: None,
        });
    }
    Manifest {
        agent: sim_agent(i),
        instance: "fleet".into(),
        capabilities,
        commands: vec!["ping".into()],
        groups: if i < BROADCAST_GROUP_SIZE {
            vec!["ten-k".into()]
        } else {
            Vec::new()
        },
        customer: None,
        content_types: vec![CONTENT_TYPE_MSGPACK.into()],
        load: 0.0,
        slots: Some(1),
        availability: Availability::Available,
        eta_ms: None,
        handling_ms: None,
        waiting: Default::default(),
        public_key: None,
        encryption_key: None,
        heartbeat_ms: u64::try_from(HEARTBEAT.as_millis()).unwrap_or(u64::MAX),
        started_ms: chorus_sdk::envelope::now_ms(),
        sdk_version: "fleet".into(),
        metrics_url: None,
        wire_versions: vec![1, 2],
        open_circuits: Vec::new(),
        content_encodings: Vec::new(),
        endpoints: Vec::new(),
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
        shares[i % CONNECTIONS].push((subjects.heartbeat(&sim_agent(i))?, loads));
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

/// The SDK agent that asks the coordinators (discovery, broadcasts) for a measurement.
async fn client(url: &str) -> anyhow::Result<chorus_sdk::Agent> {
    // A CLI user's id: `chorus serve`'s development default makes the CLI's ids (`cli-*`) the
    // admins that may deploy (docs/SECURITY.md, "Roles and authority").
    Ok(AgentOptions::new("cli-fleet")
        .servers([url])
        .root(ROOT)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .request_timeout(Duration::from_secs(30))
        .connect()
        .await?)
}

/// Simulated agent number `i`.
fn sim_agent(i: usize) -> String {
    format!("sim-{i:06}")
}

/// The simulated fleet's traffic, until `stop`: an answer to every request any agent is sent,
/// and the heartbeats of `n` agents (counted in `sent`).
async fn start_fleet(
    url: &str,
    subjects: &Subjects,
    n: usize,
    tracker: &TaskTracker,
    stop: &CancellationToken,
    sent: &Arc<AtomicU64>,
) -> anyhow::Result<()> {
    answer_requests(url, subjects, tracker, stop.clone()).await?;
    heartbeat(url, subjects, n, tracker, stop.clone(), Arc::clone(sent)).await
}

/// How long the fleet's agents have to be live in a coordinator's registry after their
/// heartbeats began.
fn registration_deadline(started: Instant) -> Instant {
    started + Duration::from_secs(60) + HEARTBEAT * 4
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
                Ok(chorus_broker_adapter::ConnectionEvent::Closed) | Err(_) => break,
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

    /// Waits until `n` agents are live in this coordinator's registry, up to `deadline`;
    /// fails with how many were.
    async fn wait_live(&self, n: usize, deadline: Instant) -> anyhow::Result<u64> {
        loop {
            let live = self
                .gauge("chorus_coordinator_agents", "state=\"live\"")
                .await? as u64;
            if live >= n as u64 {
                return Ok(live);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the coordinator saw only {live} of {n} agents live"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
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
