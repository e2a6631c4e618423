//! One coordinator under fleets of growing size: memory, CPU, heartbeats handled, registry
//! writes, discovery latency and a broadcast to 10,000 (docs/SCALE.md, "One size after another").

use super::*;
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
        start_fleet(&url, &subjects, n, &tracker, &stop, &sent).await?;
        // Registered: every agent live in the coordinator's registry.
        let live = coordinator
            .wait_live(n, registration_deadline(started))
            .await?;
        let registration = started.elapsed();
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
        let client = client(&url).await?;
        // What one SDK agent with a command and a capability holds on the server, which the
        // light mode leaves out: the subscriptions it adds once serving.
        let before = monitor_number(&monitor, "/subsz", "num_subscriptions").await?;
        let real = AgentOptions::new("fleet-real")
            .servers([url.as_str()])
            .root(ROOT)
            .connect()
            .await?;
        real.on_command("ping", |_ctx: chorus_sdk::Context, (): ()| async {
            Ok::<_, chorus_sdk::HandlerError>(())
        })
        .await?;
        real.on_capability("fleet.work", |_ctx: chorus_sdk::Context, (): ()| async {
            Ok::<_, chorus_sdk::HandlerError>(())
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
