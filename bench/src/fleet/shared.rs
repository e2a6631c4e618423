//! Several coordinators sharing one fleet (docs/SCALE.md, "Several coordinators sharing the
//! work").

use super::*;
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
        start_fleet(&url, &subjects, n, &tracker, &stop, &sent).await?;
        let deadline = registration_deadline(started);
        for c in &coordinators {
            c.wait_live(n, deadline).await?;
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
        let client = client(&url).await?;
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
