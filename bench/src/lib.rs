//! `chorus bench`: each scenario run against raw async-nats and against Chorus, alternating,
//! in one process and against one server, so the ratio is measured rather than remembered.
//!
//! - `baseline`: the raw side, through `chorus_broker_adapter::raw`.
//! - `scenarios`: the Chorus side, through the SDK.
//! - `memory`: resident memory of `chorus listen` and `chorus serve`.
//! - `fleet`: the fleet simulator (`--only scale`): 1,000 to 100,000 simulated agents against a
//!   coordinator process.
//! - `report`: rows, medians and the table.
//!
//! The crate does not depend on the coordinator: the `chorus bench` subcommand passes a
//! [`CoordinatorLauncher`] for the discovery scenario and its own executable for the memory
//! scenarios.

mod baseline;
mod fleet;
mod http;
mod measure;
mod memory;
mod reference;
mod report;
mod scenarios;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use chorus_nats_server::NatsServer;
use chorus_sdk::durable::{BATCH_ACKS_IN_FLIGHT, InboxConsumers};
use futures::future::BoxFuture;

use baseline::JsDesign;
use measure::{IDLE, Usage};
use report::{Pair, percentile};
/// How long each request-throughput measurement runs.
const THROUGHPUT_WINDOW: Duration = Duration::from_secs(3);
/// Messages per atomic batch in the durable path's candidate row (a quarter of the acks in
/// flight: four batches outstanding).
const ATOMIC_BATCH: usize = 64;
/// The same with `--quick`.
const QUICK_THROUGHPUT_WINDOW: Duration = Duration::from_secs(1);
/// Chunks each streamed task of the task rows sends.
const TASK_CHUNKS: usize = 10;

pub use report::{Row, table};

/// Starts a coordinator in this process for the discovery scenario.
pub trait CoordinatorLauncher: Send + Sync + std::fmt::Debug {
    /// A coordinator on the server at `url`, with the default root and no metrics listener.
    fn start<'a>(
        &'a self,
        url: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn RunningCoordinator>>>;

    /// The same with its HTTP gateway on a free loopback port and one edge identity; with
    /// `tls`, the gateway serves HTTPS with a certificate from a CA of this run.
    fn start_with_gateway<'a>(
        &'a self,
        url: &'a str,
        tls: bool,
    ) -> BoxFuture<'a, anyhow::Result<WithGateway>>;
}

/// A coordinator with its HTTP gateway, for the gateway scenario.
pub struct WithGateway {
    /// The coordinator.
    pub coordinator: Box<dyn RunningCoordinator>,
    /// Where its gateway listens.
    pub addr: std::net::SocketAddr,
    /// The API key of its one edge identity.
    pub api_key: String,
    /// The CA (PEM) that signed the gateway's certificate, when it serves HTTPS.
    pub ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for WithGateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of logs.
        f.debug_struct("WithGateway")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// A coordinator a [`CoordinatorLauncher`] started.
pub trait RunningCoordinator: Send {
    /// How many live agents its registry holds.
    fn registered(&self) -> usize;
    /// Stops it and waits for its tasks.
    fn shutdown(self: Box<Self>) -> BoxFuture<'static, ()>;
}

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
    /// The `chorus` executable, whose `listen` and `serve` the memory scenarios measure.
    pub program: PathBuf,
    /// The envelope form the Chorus side writes: the compact one (protocol 2), as agents on a
    /// bus whose agents all read it do, or the named one (protocol 1).
    pub wire: chorus_sdk::Encoding,
    /// Starts the coordinator the discovery scenario queries.
    pub coordinator: Arc<dyn CoordinatorLauncher>,
    /// A Python with a2a-sdk's server (`scripts/install-python-sdk`): the gateway scenario
    /// then also times A2A calls to the official a2a-sdk server beside the gateway's binding.
    pub python: Option<PathBuf>,
}

/// Runs every scenario and returns the report.
pub async fn run(opts: &BenchOptions, progress: fn(&str)) -> anyhow::Result<(Vec<Row>, String)> {
    // Kept (and killed on drop) until the report is done.
    let server;
    let url = match &opts.url {
        Some(u) => u.clone(),
        None => {
            server = tokio::task::spawn_blocking(NatsServer::start).await??;
            server.url().to_owned()
        }
    };
    let version = {
        let b = chorus_broker_adapter::BrokerOptions::new([url.as_str()])
            .connect()
            .await?;
        let v = b.server_version();
        let _ = b.drain().await;
        v
    };
    let bus = scenarios::Bus {
        url: &url,
        wire: opts.wire,
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
        // The raw side beside the plainest async-nats program (its yardstick), each round.
        let mut yardstick = Pair::new();
        for _ in 0..rounds {
            if size == 128 {
                match baseline::plain_pubsub(&opts.program, &url, count, size).await {
                    Ok(y) => yardstick.raw.push(y.per_second()),
                    Err(e) => progress(&format!("the plain async-nats program: {e:#}")),
                }
            }
            let cpu = Usage::start();
            let r = baseline::pubsub(&url, count, size, 1, IDLE).await?;
            p.raw_cpu(cpu, r.received);
            p.raw.push(r.per_second());
            if size == 128 {
                yardstick.chorus.push(r.per_second());
            }
            let cpu = Usage::start();
            let c = scenarios::chorus_events(&bus, count, size, 1).await?;
            p.chorus_cpu(cpu, c.received);
            p.chorus.push(c.per_second());
            p.sent += c.sent;
            p.received += c.received;
        }
        let lossless = p.sent == p.received;
        rows.push(p.row(
            &format!("event publish->subscribe {size} B"),
            "msg/s",
            ">= 0.85 of raw, no loss",
            move |r| r >= 0.85 && lossless,
        ));
        if size == 128 {
            // Its "raw" column is the plain program (a process of its own), its "chorus" column
            // the raw side above.
            rows.push(yardstick.row(
                "the raw side above / a plain async-nats program (own process), 128 B",
                "msg/s",
                ">= 0.95: the raw side as fast as plain async-nats",
                |r| r >= 0.95,
            ));
        }
    }

    // The sender's share of the events' cost: the same 128-byte events with nobody
    // subscribed, so the rows above split into what a publisher and a subscriber pay.
    if want("events") {
        let count = if q { 20_000 } else { 200_000 };
        progress(&format!("publish only 128 B x {count}"));
        let mut p = Pair::new();
        for _ in 0..rounds {
            let cpu = Usage::start();
            let r = baseline::publish_only(&url, count, 128).await?;
            p.raw_cpu(cpu, r.sent);
            p.raw.push(r.per_second());
            let cpu = Usage::start();
            let c = scenarios::chorus_publish_only(&bus, count, 128).await?;
            p.chorus_cpu(cpu, c.sent);
            p.chorus.push(c.per_second());
        }
        rows.push(p.row(
            "event publish only, nobody subscribed, 128 B",
            "msg/s",
            "(reported: the sender's share)",
            |_| true,
        ));
    }

    let n = if q { 500 } else { 5_000 };
    if want("latency") {
        progress(&format!("request latency x {n}"));
        let (mut raw_l, mut ch_l) = (Vec::new(), Vec::new());
        let mut cpu_use = Pair::new();
        for _ in 0..rounds {
            let cpu = Usage::start();
            raw_l.extend(baseline::request_latency(&url, n, 128).await?);
            cpu_use.raw_cpu(cpu, n as u64);
            let cpu = Usage::start();
            ch_l.extend(scenarios::chorus_latency(&bus, n, 128).await?);
            cpu_use.chorus_cpu(cpu, n as u64);
        }
        let (raw_cpu_us, chorus_cpu_us) = cpu_use.cpu_medians();
        raw_l.sort();
        ch_l.sort();
        for (label, p, goal, limit) in [
            ("p50", 0.50, "<= 1.10 x raw", 1.10),
            ("p99", 0.99, "<= 1.20 x raw", 1.20),
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
                raw_cpu_us,
                chorus_cpu_us,
            });
        }
    }
    if want("tasks") {
        let n = if q { 50 } else { 500 };
        progress(&format!("tasks x {n}, beside request-reply"));
        let mut raw_l = Vec::new();
        let (mut round_trips, mut first_chunks) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            raw_l.extend(baseline::request_latency(&url, n, 128).await?);
            let (r, f) = scenarios::chorus_tasks(&bus, n, 128, TASK_CHUNKS).await?;
            round_trips.extend(r);
            first_chunks.extend(f);
        }
        raw_l.sort();
        round_trips.sort();
        first_chunks.sort();
        let raw = percentile(&raw_l, 0.5);
        let n_rounds = if q { 20 } else { 100 };
        progress(&format!("contract-net rounds x {n_rounds}, 10 bidders"));
        let mut rounds_l = Vec::new();
        for _ in 0..rounds {
            rounds_l.extend(scenarios::chorus_negotiation(&bus, n_rounds, 10).await?);
        }
        rounds_l.sort();
        for (label, sample) in [
            (
                "task round trip p50 (submit -> completed report)",
                &round_trips,
            ),
            (
                "contract-net round p50, 10 bidders (call -> award -> completed)",
                &rounds_l,
            ),
            (
                "task first chunk p50 (submit -> first of 10 streamed chunks)",
                &first_chunks,
            ),
        ] {
            let chorus = percentile(sample, 0.5);
            rows.push(Row {
                scenario: label.into(),
                unit: "us".into(),
                raw: Some(raw),
                chorus: Some(chorus),
                ratio: Some(chorus / raw.max(1e-9)),
                goal: "(reported; raw: a request-reply p50)".into(),
                met: None,
                sent: sample.len() as u64,
                received: sample.len() as u64,
                lost: 0,
                raw_cpu_us: None,
                chorus_cpu_us: None,
            });
        }
    }
    let dur = if q {
        QUICK_THROUGHPUT_WINDOW
    } else {
        THROUGHPUT_WINDOW
    };
    if want("throughput") {
        progress("request throughput, 64 concurrent");
        let mut p = Pair::new();
        for _ in 0..rounds {
            let cpu = Usage::start();
            let r = baseline::request_throughput(&url, 64, dur, 128).await?;
            p.raw_cpu(cpu, r.received);
            p.raw.push(r.per_second());
            let cpu = Usage::start();
            let c = scenarios::chorus_request_throughput(&bus, 64, dur, 128, false).await?;
            p.chorus_cpu(cpu, c.received);
            p.chorus.push(c.per_second());
            p.sent += c.sent;
            p.received += c.received;
        }
        rows.push(p.row(
            "request-reply throughput, 64 concurrent",
            "req/s",
            ">= 0.85 of raw",
            |r| r >= 0.85,
        ));
    }

    let count = if q { 2_000 } else { 20_000 };
    if want("durable") {
        progress(&format!("durable at-least-once x {count}"));
        let mut p = Pair::new();
        let mut writes = Pair::new();
        let mut held = Pair::new();
        let (mut atomic, mut grouped) = (Pair::new(), Pair::new());
        for _ in 0..rounds {
            let usage = Usage::start();
            let r = baseline::jetstream_roundtrip(
                &url,
                count,
                128,
                BATCH_ACKS_IN_FLIGHT,
                JsDesign::Today,
            )
            .await?;
            p.raw_cpu(usage, r.received);
            writes.raw.extend(usage.writes_per_message(r.received));
            p.raw.push(r.per_second());
            let usage = Usage::start();
            let c = scenarios::chorus_durable(&bus, count, 128, InboxConsumers::default()).await?;
            p.chorus_cpu(usage, c.received);
            writes.chorus.extend(usage.writes_per_message(c.received));
            p.chorus.push(c.per_second());
            p.sent += c.sent;
            p.received += c.received;
            // The same with the consumers held from the start: no bell per stored command.
            let cpu = Usage::start();
            let c = scenarios::chorus_durable(&bus, count, 128, InboxConsumers::Always).await?;
            held.chorus_cpu(cpu, c.received);
            held.chorus.push(c.per_second());
            held.sent += c.sent;
            held.received += c.received;
            // The candidates for the durable path (issue 38), with async-nats alone beside
            // today's design in the same round: a refusal by the server is said, not fatal.
            for (design, pair) in [
                (JsDesign::AtomicBatches(ATOMIC_BATCH), &mut atomic),
                (JsDesign::PriorityGroup, &mut grouped),
            ] {
                match baseline::jetstream_roundtrip(&url, count, 128, BATCH_ACKS_IN_FLIGHT, design)
                    .await
                {
                    Ok(t) => {
                        pair.raw.push(r.per_second());
                        pair.chorus.push(t.per_second());
                        pair.sent += t.sent;
                        pair.received += t.received;
                    }
                    Err(e) => progress(&format!(
                        "raw JetStream, {design:?}: not measured: {}",
                        chorus_sdk::Report(&e)
                    )),
                }
            }
        }
        held.raw.clone_from(&p.raw);
        held.raw_cpu.clone_from(&p.raw_cpu);
        rows.push(p.row(
            &format!(
                "durable at-least-once publish->handled, {BATCH_ACKS_IN_FLIGHT} acks in flight"
            ),
            "msg/s",
            ">= 0.8 of raw",
            |r| r >= 0.8,
        ));
        rows.push(held.row(
            "durable at-least-once, consumers always held (no bells)",
            "msg/s",
            "(reported)",
            |_| true,
        ));
        for (pair, what) in [
            (
                atomic,
                format!(
                    "raw JetStream, atomic batches of {ATOMIC_BATCH} (raw: one publish each, \
                     {BATCH_ACKS_IN_FLIGHT} acks in flight)"
                ),
            ),
            (
                grouped,
                "raw JetStream, the pull consumer in a priority group (raw: a plain one)".into(),
            ),
        ] {
            if !pair.chorus.is_empty() {
                rows.push(pair.row(&what, "msg/s", "(reported: a candidate)", |_| true));
            }
        }
        // Acks are not sent one write each: the connection writes whatever is queued
        // (publishes, acks, pulls) in one call. This row counts the writes.
        rows.push(writes.row(
            "durable at-least-once: socket writes per message (acks included)",
            "writes",
            "(reported: acks coalesced per flush)",
            |_| true,
        ));
    }

    if want("batching") {
        // Automatic batching (a Batcher: 100 messages or 5 ms) beside sending one at a time,
        // each message confirmed either way: what batching saves is the round trips.
        let batching = chorus_sdk::Batching::new()
            .max_messages(100)
            .max_delay(Duration::from_millis(5));
        for (what, name, count) in [
            (
                scenarios::Batched::Commands,
                "durable commands",
                if q { 300 } else { 3_000 },
            ),
            (
                scenarios::Batched::Events,
                "events",
                if q { 1_000 } else { 10_000 },
            ),
        ] {
            progress(&format!("batching: {name} x {count}"));
            let (mut single, mut batched) = (Vec::new(), Vec::new());
            let (mut sent, mut received) = (0, 0);
            for _ in 0..rounds {
                for (out, how) in [(&mut single, None), (&mut batched, Some(batching))] {
                    let t = scenarios::chorus_batching(&bus, count, what, how).await?;
                    out.push(t.per_second());
                    sent += t.sent;
                    received += t.received;
                }
            }
            let (single, batched) = (report::median(single), report::median(batched));
            let ratio = match (single, batched) {
                (Some(s), Some(b)) if s > 0.0 => Some(b / s),
                _ => None,
            };
            rows.push(Row {
                chorus: single,
                ..Row::chorus_only(
                    &format!("{name}, 128 B, one at a time, each confirmed"),
                    "msg/s",
                    0.0,
                    "(reported: the reference for the row below)",
                    None,
                )
            });
            rows.push(
                Row {
                    chorus: batched,
                    ratio,
                    met: ratio.map(|r| r >= 2.0),
                    ..Row::chorus_only(
                        &format!("{name}, 128 B, batched (100 msgs / 5 ms)"),
                        "msg/s",
                        0.0,
                        "ratio to one at a time (row above) >= 2, no loss",
                        None,
                    )
                }
                .counts(sent, received),
            );
            if sent != received
                && let Some(last) = rows.last_mut()
            {
                last.met = Some(false);
            }
        }
    }

    let count = if q { 200 } else { 2_000 };
    if want("fan-out") {
        progress(&format!("fan-out to 100 x {count}"));
        let mut p = Pair::new();
        for _ in 0..rounds.min(2) {
            let cpu = Usage::start();
            let r = baseline::pubsub(&url, count, 128, 100, IDLE).await?;
            p.raw_cpu(cpu, r.received);
            p.raw.push(r.per_second());
            let cpu = Usage::start();
            let c = scenarios::chorus_events(&bus, count, 128, 100).await?;
            p.chorus_cpu(cpu, c.received);
            p.chorus.push(c.per_second());
            p.sent += c.sent;
            p.received += c.received;
        }
        rows.push(p.row(
            "event fan-out to 100 subscribers (deliveries)",
            "msg/s",
            ">= 0.85 of raw",
            |r| r >= 0.85,
        ));
    }

    if want("secure") {
        let count = if q { 200 } else { 20_000 };
        progress(&format!("signed and verified events x {count}"));
        let cpu = Usage::start();
        let signed = scenarios::secure_events(&bus, count, scenarios::Secured::Events).await?;
        let signed_cpu = cpu.per_message_us(signed.received);
        let met = signed.per_second() >= 50_000.0 && signed.received == signed.sent;
        rows.push(Row {
            chorus_cpu_us: signed_cpu,
            ..Row::chorus_only(
                "signed and verified events, 128 B",
                "msg/s",
                signed.per_second(),
                ">= 50,000/s",
                Some(met),
            )
            .counts(signed.sent, signed.received)
        });
        progress("signed and verified requests, 64 concurrent");
        let cpu = Usage::start();
        let signed = scenarios::chorus_request_throughput(&bus, 64, dur, 128, true).await?;
        rows.push(Row {
            chorus_cpu_us: cpu.per_message_us(signed.received),
            ..Row::chorus_only(
                "signed and verified requests, 64 concurrent",
                "req/s",
                signed.per_second(),
                "(reported)",
                None,
            )
            .counts(signed.sent, signed.received)
        });
        // Encrypted commands beside the same commands signed only, each round: "raw" is the
        // signed-only figure here, the ratio what encryption leaves of it.
        progress(&format!("signed commands, encrypted and not, x {count}"));
        let mut p = Pair::new();
        for _ in 0..rounds {
            let cpu = Usage::start();
            let plain = scenarios::secure_events(&bus, count, scenarios::Secured::Commands).await?;
            p.raw_cpu(cpu, plain.received);
            p.raw.push(plain.per_second());
            let cpu = Usage::start();
            let sealed =
                scenarios::secure_events(&bus, count, scenarios::Secured::EncryptedCommands)
                    .await?;
            p.chorus_cpu(cpu, sealed.received);
            p.chorus.push(sealed.per_second());
            p.sent += sealed.sent;
            p.received += sealed.received;
        }
        let lossless = p.sent == p.received;
        rows.push(p.row(
            "encrypted and signed commands / signed only, 128 B (raw column: signed only)",
            "msg/s",
            ">= 0.5: encrypted within 2x of signed only",
            move |r| r >= 0.5 && lossless,
        ));
    }

    if want("gateway") {
        let n = if q { 200 } else { 2_000 };
        progress(&format!("request-reply through the HTTP gateway x {n}"));
        let WithGateway {
            coordinator,
            addr,
            api_key: key,
            ..
        } = opts.coordinator.start_with_gateway(&url, false).await?;
        let (mut nats_l, mut http_l, mut floor_l) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = scenarios::gateway_latency(&bus, addr, &key, n, 128).await?;
            nats_l.extend(t.nats);
            http_l.extend(t.http);
            floor_l.extend(t.floor);
        }
        progress(&format!(
            "MCP tools/call through the gateway and the same native request x {n}"
        ));
        let (mut native_l, mut mcp_l) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let (native, mcp) = scenarios::gateway_mcp(&bus, addr, &key, n, 128).await?;
            native_l.extend(native);
            mcp_l.extend(mcp);
        }
        let a2a = match &opts.python {
            Some(python) => {
                progress(&format!(
                    "A2A SendMessage: the a2a-sdk server and the gateway x {n}"
                ));
                let reference = reference::A2aServer::start(python).await?;
                let (mut ref_l, mut gw_l) = (Vec::new(), Vec::new());
                for _ in 0..rounds {
                    let (r, g) =
                        scenarios::gateway_a2a(&bus, addr, &key, reference.addr(), n / 2).await?;
                    ref_l.extend(r);
                    gw_l.extend(g);
                }
                Some((ref_l, gw_l))
            }
            None => None,
        };
        coordinator.shutdown().await;
        rows.extend(reported_latencies(
            "request-reply {} through the HTTP gateway (raw: the same over NATS)",
            nats_l.clone(),
            http_l,
        ));
        rows.extend(reported_latencies(
            "its HTTP round trip alone {}, a 404 from the gateway (raw: over NATS)",
            nats_l,
            floor_l,
        ));
        rows.extend(reported_latencies(
            "MCP tools/call {} through the gateway (raw: the same as a native Chorus request)",
            native_l,
            mcp_l,
        ));
        if let Some((ref_l, gw_l)) = a2a {
            rows.extend(reported_latencies(
                "A2A SendMessage {}, gateway (raw: the official a2a-sdk server)",
                ref_l,
                gw_l,
            ));
        }
        // The same requests over HTTPS and over plain HTTP, to two gateways side by side (a
        // gateway serves one or the other), alternating call by call.
        progress(&format!(
            "request-reply through the gateway, HTTPS and plain HTTP x {n}"
        ));
        let plain = opts.coordinator.start_with_gateway(&url, false).await?;
        let tls = opts.coordinator.start_with_gateway(&url, true).await?;
        let ca = tls
            .ca_pem
            .clone()
            .ok_or_else(|| anyhow::anyhow!("the HTTPS gateway came without its CA"))?;
        let (mut plain_l, mut tls_l) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let (p, t) = scenarios::gateway_https(
                &bus,
                (plain.addr, &plain.api_key),
                (tls.addr, &tls.api_key, &ca),
                n,
                128,
            )
            .await?;
            plain_l.extend(p);
            tls_l.extend(t);
        }
        plain.coordinator.shutdown().await;
        tls.coordinator.shutdown().await;
        rows.extend(reported_latencies(
            "request-reply {} through the gateway over HTTPS (raw: the same over plain HTTP)",
            plain_l,
            tls_l,
        ));
    }

    if want("routing") {
        let n = if q { 300 } else { 3_000 };
        progress(&format!(
            "capability requests x {n}, 8 at a time, to 3 holders (one 10x slower): queue group, then least loaded"
        ));
        let (mut group_l, mut least_l) = (Vec::new(), Vec::new());
        let (mut group_slow, mut least_slow) = (0, 0);
        for _ in 0..rounds {
            let (group, least) =
                scenarios::chorus_routing(&url, opts.coordinator.as_ref(), bus.wire, n, 8).await?;
            group_l.extend(group.latencies);
            least_l.extend(least.latencies);
            group_slow += group.to_slow;
            least_slow += least.to_slow;
        }
        group_l.sort();
        least_l.sort();
        let total = group_l.len() as u64;
        for (label, q) in [
            (
                "capability request p50 under uneven load, least loaded (raw: queue group)",
                0.5,
            ),
            (
                "capability request p99 under uneven load, least loaded (raw: queue group)",
                0.99,
            ),
        ] {
            let (raw, chorus) = (percentile(&group_l, q), percentile(&least_l, q));
            rows.push(Row {
                scenario: label.into(),
                unit: "us".into(),
                raw: Some(raw),
                chorus: Some(chorus),
                ratio: Some(chorus / raw.max(1e-9)),
                goal: "(reported)".into(),
                met: None,
                sent: total,
                received: least_l.len() as u64,
                lost: total.saturating_sub(least_l.len() as u64),
                raw_cpu_us: None,
                chorus_cpu_us: None,
            });
        }
        #[allow(clippy::cast_precision_loss)]
        let share = |slow: usize| 100.0 * slow as f64 / total.max(1) as f64;
        rows.push(Row {
            scenario: "share of those requests the slow holder answered (raw: queue group)".into(),
            unit: "%".into(),
            raw: Some(share(group_slow)),
            chorus: Some(share(least_slow)),
            ratio: Some(share(least_slow) / share(group_slow).max(1e-9)),
            goal: "(reported)".into(),
            met: None,
            sent: total,
            received: total,
            lost: 0,
            raw_cpu_us: None,
            chorus_cpu_us: None,
        });
    }

    if want("payloads") {
        let (n_big, n_small) = if q { (2, 20) } else { (5, 200) };
        progress(&format!(
            "large payloads: 50 MiB by reference x {n_big}, 512 KiB compressible x {n_small} compressed and plain"
        ));
        let (mut raw_big, mut big, mut compressed, mut plain) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            raw_big.extend(baseline::object_transfer(&url, 50 << 20, n_big).await?);
            let p = scenarios::chorus_payloads(
                &url,
                opts.coordinator.as_ref(),
                bus.wire,
                (50 << 20, n_big),
                (512 << 10, n_small),
            )
            .await?;
            big.extend(p.by_reference);
            compressed.extend(p.compressed);
            plain.extend(p.plain);
        }
        for v in [&mut raw_big, &mut big, &mut compressed, &mut plain] {
            v.sort();
        }
        for (label, unit, raw, chorus, n) in [
            (
                "50 MiB payload by reference p50, request -> handled -> answered (raw: object store put + get)",
                "ms",
                percentile(&raw_big, 0.5) / 1000.0,
                percentile(&big, 0.5) / 1000.0,
                big.len(),
            ),
            (
                "512 KiB compressible request p50, zstd (raw: the same request uncompressed)",
                "us",
                percentile(&plain, 0.5),
                percentile(&compressed, 0.5),
                compressed.len(),
            ),
        ] {
            rows.push(Row {
                scenario: label.into(),
                unit: unit.into(),
                raw: Some(raw),
                chorus: Some(chorus),
                ratio: Some(chorus / raw.max(1e-9)),
                goal: "(reported)".into(),
                met: None,
                sent: n as u64,
                received: n as u64,
                lost: 0,
                raw_cpu_us: None,
                chorus_cpu_us: None,
            });
        }
    }

    if want("discovery") {
        progress("discovery with 1,000 agents");
        let (mut lat, registered) = scenarios::discovery(
            &url,
            opts.coordinator.as_ref(),
            1_000,
            if q { 100 } else { 1_000 },
        )
        .await?;
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

    // The fleet runs only when asked for (`--only scale`): at 100,000 agents it takes minutes.
    if opts.only.as_deref() == Some("scale") {
        let sizes: &[usize] = if q {
            &[1_000]
        } else {
            &[1_000, 10_000, 100_000]
        };
        rows.extend(fleet::scale(&opts.program, sizes, progress).await?);
        let (agents, active) = if q { (1_000, 100) } else { (10_000, 1_000) };
        let shared = if q { 1_000 } else { 10_000 };
        let counts: &[usize] = if q { &[1, 2] } else { &[1, 2, 3] };
        rows.extend(fleet::coordinators(&opts.program, shared, counts, progress).await?);
        rows.extend(fleet::durable_on_demand(agents, active, 10, progress).await?);
        rows.extend(fleet::durable(agents, active, 10, progress).await?);
    }

    // Real SDK agents in host processes, only when asked for (`--only hosted`): minutes. The
    // agents' manifests say 5 s; at 100,000 the coordinator paces them to its 2,000
    // heartbeats a second (one every 50 s each, docs/COORDINATOR.md).
    if opts.only.as_deref() == Some("hosted") {
        let s = Duration::from_secs;
        let sizes: &[(usize, Duration)] = if q {
            &[(1_000, s(5))]
        } else {
            &[(10_000, s(5)), (100_000, s(5))]
        };
        rows.extend(fleet::hosted(&opts.program, sizes, progress).await?);
    }

    if want("memory") {
        progress("idle agent memory");
        let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
        // A row against a limit in MiB, or (`None`) reported with `why`.
        let memory_row =
            |scenario: &str, limit_mib: Option<u64>, why: &str, rss: anyhow::Result<u64>| {
                let goal = limit_mib
                    .map_or_else(|| format!("(reported: {why})"), |l| format!("< {l} MiB"));
                match rss {
                    Ok(rss) => Row::chorus_only(
                        scenario,
                        "MiB",
                        mib(rss),
                        &goal,
                        limit_mib.map(|l| rss < l << 20),
                    ),
                    Err(e) => Row {
                        chorus: None,
                        goal: format!("{goal}; not measured: {e}"),
                        met: limit_mib.map(|_| false),
                        ..Row::chorus_only(scenario, "MiB", 0.0, "", None)
                    },
                }
            };
        rows.push(memory_row(
            "idle SDK agent resident memory (examples/event_listener)",
            Some(10),
            "",
            memory::idle_sdk_agent_rss(&opts.program, &url).await,
        ));
        // The CLI's agent: the same work, in an executable that holds the coordinator, the
        // CLI and this benchmark too.
        rows.push(memory_row(
            "idle agent resident memory (chorus listen)",
            None,
            "most of it the chorus executable's pages",
            memory::idle_agent_rss(&opts.program, &url).await,
        ));
        rows.push(memory_row(
            "coordinator resident memory, 1,000 agents registered",
            Some(64),
            "",
            memory::coordinator_rss(&opts.program, &url, 1_000).await,
        ));
    }

    Ok((rows, version))
}

/// p50 and p99 rows of two latency samples side by side, reported without a goal; `{}` in
/// `scenario` becomes the percentile's label.
fn reported_latencies(
    scenario: &str,
    mut raw_l: Vec<Duration>,
    mut chorus_l: Vec<Duration>,
) -> Vec<Row> {
    raw_l.sort();
    chorus_l.sort();
    [("p50", 0.50), ("p99", 0.99)]
        .into_iter()
        .map(|(label, p)| {
            let raw = percentile(&raw_l, p);
            let chorus = percentile(&chorus_l, p);
            Row {
                scenario: scenario.replace("{}", label),
                unit: "us".into(),
                raw: Some(raw),
                chorus: Some(chorus),
                ratio: Some(chorus / raw.max(1e-9)),
                goal: "(reported)".into(),
                met: None,
                sent: chorus_l.len() as u64,
                received: chorus_l.len() as u64,
                lost: 0,
                raw_cpu_us: None,
                chorus_cpu_us: None,
            }
        })
        .collect()
}
