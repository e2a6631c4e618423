//! Real SDK agents hosted by the bus (`chorus bench --only hosted`; docs/SCALE.md, "Real agents
//! in host processes"): not the light mode's simulated agents but `chorus agent` processes,
//! each serving its share of the agents on one connection, started by `chorus host` processes
//! from shared manifests (`run.shared`, 1,000 replicas each) that a coordinator process places
//! on the hosts in turn. Measured: the time until every agent is live in the registry, the agent processes'
//! memory per agent, the server's connections and subscriptions, heartbeats per second,
//! discovery latency, and a broadcast to every agent, reported.

use std::collections::BTreeSet;

use anyhow::Context as _;

use chorus_host::manifest::Manifest;
use chorus_host::protocol::{
    COORDINATOR, DeployRequest, DeploymentView, HostReport, coordinator_commands,
};
use chorus_sdk::Call;

use super::*;

/// Agents per host (the hosts are as many as it takes); each deployment is at most a
/// manifest's replica limit, so a host runs several `chorus agent` processes.
const AGENTS_PER_HOST: usize = 10_000;
/// Hosts at least (so that placement spreads over several).
const MIN_HOSTS: usize = 2;
/// The capability the hosted agents serve, but for one in [`RARE_EVERY`], which serve `rare`
/// (a deployment of their own) for the discovery queries.
const WORK: &str = "fleet.work";
/// How long the hosted agents have to be live after the deploys were taken.
const LIVE_DEADLINE: Duration = Duration::from_secs(600);

/// How long a deployment refused for want of a live host is asked for again.
const DEPLOY_RETRY: Duration = Duration::from_secs(120);
/// How often the CPU of the run's parts is sampled while the agents come up.
const CPU_SAMPLE_EVERY: Duration = Duration::from_secs(30);

/// The processes of a hosted run, by part.
struct Parts<'a> {
    server: u32,
    coordinator: u32,
    hosts: &'a [u32],
}

/// CPU seconds used so far, by part: the server, the coordinator, the hosts, and the agent
/// processes (the hosts' children); and the machine's idle seconds (all cores).
#[derive(Debug, Clone, Copy, Default)]
struct CpuUse {
    server: f64,
    coordinator: f64,
    hosts: f64,
    agents: f64,
    idle: f64,
}

impl Parts<'_> {
    /// Reads every process's CPU and parent from `/proc`; a process gone meanwhile is skipped.
    fn cpu(&self) -> CpuUse {
        let mut u = CpuUse {
            idle: machine_idle_seconds().unwrap_or(0.0),
            ..CpuUse::default()
        };
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return u;
        };
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            let Some((ppid, cpu)) = parent_and_cpu(pid) else {
                continue;
            };
            if pid == self.server {
                u.server += cpu;
            } else if pid == self.coordinator {
                u.coordinator += cpu;
            } else if self.hosts.contains(&pid) {
                u.hosts += cpu;
            } else if self.hosts.contains(&ppid) {
                u.agents += cpu;
            }
        }
        u
    }
}

impl CpuUse {
    /// The CPU each part used between `before` and this, `elapsed` apart, in % of one core.
    fn since(&self, before: &CpuUse, elapsed: Duration) -> String {
        let secs = elapsed.as_secs_f64().max(f64::EPSILON);
        let pct = |now: f64, then: f64| 100.0 * (now - then).max(0.0) / secs;
        format!(
            "CPU over the last {:.0} s (100 = one core): server {:.0}, coordinator {:.0}, hosts \
             {:.0}, agent processes {:.0}; the machine idle {:.0}",
            secs,
            pct(self.server, before.server),
            pct(self.coordinator, before.coordinator),
            pct(self.hosts, before.hosts),
            pct(self.agents, before.agents),
            pct(self.idle, before.idle),
        )
    }
}

/// A process's parent and its user and system CPU seconds so far.
fn parent_and_cpu(pid: u32) -> Option<(u32, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state, ppid, ...; utime and stime are the 12th and 13th.
    let ppid = fields.get(1)?.parse().ok()?;
    let ticks: f64 = fields
        .get(11..13)?
        .iter()
        .map(|f| f.parse::<f64>().unwrap_or(0.0))
        .sum();
    Some((ppid, ticks / CLOCK_TICKS))
}

/// The machine's idle seconds so far, summed over its cores (`/proc/stat`).
fn machine_idle_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().next()?.strip_prefix("cpu ")?;
    let idle: f64 = cpu.split_whitespace().nth(3)?.parse().ok()?;
    Some(idle / CLOCK_TICKS)
}

/// One size's figures.
#[derive(Debug, Clone)]
struct Figures {
    agents: usize,
    processes: usize,
    live_after: Duration,
    agents_rss: u64,
    server_rss: u64,
    coordinator_rss: u64,
    connections: u64,
    subscriptions: u64,
    heartbeats_per_second: f64,
    /// Each agent's heartbeat interval.
    heartbeat: Duration,
    discovery: Vec<Duration>,
    broadcast: (Duration, usize),
}

/// Runs the hosted fleet at each size in `sizes` and returns its rows; a size that cannot be
/// reached (memory, time) is a row saying why.
pub(crate) async fn hosted(
    program: &Path,
    sizes: &[(usize, Duration)],
    progress: fn(&str),
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &(n, heartbeat) in sizes {
        progress(&format!(
            "{n} real SDK agents in host processes, a heartbeat every {} s each unless the coordinator paces them",
            heartbeat.as_secs_f64()
        ));
        match run(program, n, heartbeat, progress).await {
            Ok(f) => rows.extend(rows_of(&f)),
            Err(e) => {
                // Said at once: the rows come only at the end of every size.
                progress(&format!("{n} hosted agents: not reached: {e:#}"));
                rows.push(Row {
                    chorus: None,
                    goal: format!("not reached: {e:#}"),
                    met: Some(false),
                    ..Row::chorus_only(
                        &format!("{n} hosted agents, manifests' heartbeat {heartbeat:?}"),
                        "",
                        0.0,
                        "",
                        None,
                    )
                });
            }
        }
    }
    Ok(rows)
}

fn rows_of(f: &Figures) -> Vec<Row> {
    let n = f.agents;
    let at = |what: &str| {
        format!(
            "{n} hosted SDK agents in {} processes, manifests' heartbeat {:?}: {what}",
            f.processes, f.heartbeat
        )
    };
    let mut discovery = f.discovery.clone();
    discovery.sort();
    let (took, delivered) = f.broadcast;
    vec![
        Row::chorus_only(
            &at("all live after the deploys"),
            "s",
            f.live_after.as_secs_f64(),
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("agent processes' resident memory per agent"),
            "KiB",
            f.agents_rss as f64 / 1024.0 / n as f64,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("agent processes' resident memory"),
            "MiB",
            mib(f.agents_rss),
            "(reported)",
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
            &at("coordinator resident memory"),
            "MiB",
            mib(f.coordinator_rss),
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("server connections"),
            "conns",
            f.connections as f64,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("server subscriptions"),
            "subs",
            f.subscriptions as f64,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("heartbeats handled per second"),
            "msg/s",
            f.heartbeats_per_second,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("discovery p99 (a capability 1 in 1,000 offer)"),
            "us",
            percentile(&discovery, 0.99),
            "< 5,000 us",
            Some(percentile(&discovery, 0.99) < 5_000.0),
        ),
        Row::chorus_only(
            &at("broadcast to all but the rare holders, reported (counted with them)"),
            "ms",
            took.as_secs_f64() * 1e3,
            "(reported)",
            Some(delivered == n),
        )
        .counts(n as u64, delivered as u64),
    ]
}

/// `chorus host` in its own process.
async fn host(
    program: &Path,
    url: &str,
    name: &str,
    logs: &Path,
) -> anyhow::Result<tokio::process::Child> {
    Ok(tokio::process::Command::new(program)
        .args(["--server", url, "--root", ROOT, "host", "--name", name])
        .args(["--max-agents", "1000000", "--report-interval", "2s"])
        // The agents are this benchmark's own program, run as whoever runs it, unsandboxed:
        // what is measured is the hosting, not the isolation.
        .args(["--user", &chorus_host::process::user::current_user()])
        .args(["--sandbox", "none"])
        .arg("--log-dir")
        .arg(logs.join(name))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?)
}

/// A shared deployment of `replicas` `chorus agent`s serving `capability`, on `host`, each
/// heartbeating every `heartbeat` (the host's health check following it).
fn manifest(
    program: &Path,
    id: &str,
    replicas: usize,
    capability: &str,
    host: &str,
    heartbeat: Duration,
) -> anyhow::Result<Manifest> {
    let mut m = Manifest::new(id, program.to_string_lossy().into_owned());
    m.replicas = u32::try_from(replicas)?;
    m.capabilities = vec![capability.to_owned()];
    m.run.args = vec![
        "agent".into(),
        "--capability".into(),
        capability.into(),
        "--heartbeat-ms".into(),
        heartbeat.as_millis().to_string(),
    ];
    m.health.interval = heartbeat;
    m.run.shared = true;
    m.placement.hosts = vec![host.to_owned()];
    // Thousands of agents connect one after another before the last heartbeats.
    m.health.start_grace = Duration::from_secs(600);
    m.validate()?;
    Ok(m)
}

async fn run(
    program: &Path,
    n: usize,
    heartbeat: Duration,
    progress: fn(&str),
) -> anyhow::Result<Figures> {
    let (server, url, monitor) = monitored_server().await?;
    let coordinator = Coordinator::start(program, &url).await?;
    let logs = tempfile::tempdir()?;
    let hosts_n = n.div_ceil(AGENTS_PER_HOST).max(MIN_HOSTS);
    let mut hosts = Vec::new();
    for i in 0..hosts_n {
        hosts.push(host(program, &url, &format!("h{i}"), logs.path()).await?);
    }
    let client = client(&url).await?;
    let result = async {
        let ask = |command: &'static str, body: serde_json::Value| {
            let client = client.clone();
            async move {
                let reply = client
                    .call(
                        Call::agent(COORDINATOR, command)
                            .payload(&body)?
                            .timeout(Duration::from_secs(60)),
                    )
                    .await?;
                anyhow::Ok(reply)
            }
        };
        // Every host reports before anything is placed.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let reply = ask(coordinator_commands::HOSTS, serde_json::json!({})).await?;
            let listed: Vec<serde_json::Value> = reply.payload_as()?;
            if listed.iter().filter(|h| h["state"] == "live").count() == hosts_n {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "the hosts did not all report");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Shared deployments of at most a manifest's replica limit, spread over the hosts in
        // turn, and the rare holders (one in 1,000) on the first.
        let rare = n.div_ceil(RARE_EVERY);
        let work = n - rare;
        let per = usize::try_from(chorus_host::manifest::MAX_REPLICAS)?;
        let t = Instant::now();
        for (i, start) in (0..work).step_by(per).enumerate() {
            let replicas = per.min(work - start);
            let m = manifest(
                program,
                &format!("w{i}"),
                replicas,
                WORK,
                &format!("h{}", i % hosts_n),
                heartbeat,
            )?;
            // A host saturated by the agents it starts may report late and be taken for
            // gone for a moment, and a coordinator that cannot write the deployment yet says
            // to try again (5019): its deployment is asked for again until it is placed.
            let asked = Instant::now();
            loop {
                let asking = ask(
                    coordinator_commands::DEPLOY,
                    serde_json::to_value(DeployRequest {
                        manifest: m.clone(),
                    })?,
                )
                .await;
                let reply = match asking {
                    Err(e) if unavailable(&e) && asked.elapsed() < DEPLOY_RETRY => {
                        progress(&format!("deployment w{i}: {e:#}; asked again"));
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        continue;
                    }
                    asked => asked?,
                };
                let view: DeploymentView = reply.payload_as()?;
                let Some((_, why)) = view.failed.first_key_value() else {
                    break;
                };
                let refused = format!(
                    "deployment w{i}: {} replicas not placed ({why})",
                    view.failed.len()
                );
                anyhow::ensure!(asked.elapsed() < DEPLOY_RETRY, "{refused}");
                progress(&format!("{refused}; asked again"));
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
        let m = manifest(program, "rare", rare, "rare", "h0", heartbeat)?;
        ask(
            coordinator_commands::DEPLOY,
            serde_json::to_value(DeployRequest { manifest: m })?,
        )
        .await?;
        // The hosts are agents of the registry too. Meanwhile, who uses the CPU.
        let host_pids: Vec<u32> = hosts.iter().filter_map(tokio::process::Child::id).collect();
        let parts = Parts {
            server: server.pid().unwrap_or(0),
            coordinator: coordinator.pid()?,
            hosts: &host_pids,
        };
        let live_wait = coordinator.wait_live(n + hosts_n, t + LIVE_DEADLINE);
        let mut live_wait = std::pin::pin!(live_wait);
        let mut tick = tokio::time::interval(CPU_SAMPLE_EVERY);
        tick.tick().await;
        let mut before = (Instant::now(), parts.cpu());
        let mut last = String::new();
        loop {
            tokio::select! {
                live = &mut live_wait => {
                    live.with_context(|| format!("the last sample: {last}"))?;
                    break;
                }
                _ = tick.tick() => {
                    let now = (Instant::now(), parts.cpu());
                    let live = coordinator
                        .gauge("chorus_coordinator_agents", "state=\"live\"")
                        .await
                        .unwrap_or(0.0);
                    last = format!(
                        "{live} of {} live after {:.0} s; {}",
                        n + hosts_n,
                        t.elapsed().as_secs_f64(),
                        now.1.since(&before.1, now.0 - before.0)
                    );
                    progress(&last);
                    before = now;
                }
            }
        }
        let live_after = t.elapsed();
        // The agent processes: every distinct pid the hosts report.
        let listed: Vec<serde_json::Value> =
            ask(coordinator_commands::HOSTS, serde_json::json!({}))
                .await?
                .payload_as()?;
        let pids: BTreeSet<u32> = listed
            .iter()
            .filter_map(|h| serde_json::from_value::<HostReport>(h["report"].clone()).ok())
            .flat_map(|r| r.agents().filter_map(|a| a.status.pid).collect::<Vec<_>>())
            .collect();
        let agents_rss = pids.iter().filter_map(|pid| rss_of(*pid)).sum();
        let hb = "chorus_coordinator_messages_total";
        let (hb0, t0) = (
            coordinator.gauge(hb, "kind=\"heartbeat\"").await?,
            Instant::now(),
        );
        tokio::time::sleep(STEADY_WINDOW).await;
        let heartbeats_per_second =
            (coordinator.gauge(hb, "kind=\"heartbeat\"").await? - hb0) / t0.elapsed().as_secs_f64();
        let connections = monitor_number(&monitor, "/varz", "connections").await?;
        let subscriptions = monitor_number(&monitor, "/subsz", "num_subscriptions").await?;
        let query = DiscoverQuery::capability("rare");
        let mut discovery = Vec::with_capacity(QUERIES);
        for _ in 0..QUERIES {
            let t = Instant::now();
            let found = client.discover(&query).await?;
            discovery.push(t.elapsed());
            anyhow::ensure!(
                found.len() == rare,
                "discovery found {} of {rare}",
                found.len()
            );
        }
        let t = Instant::now();
        let report = client
            .broadcast(
                &BroadcastTarget::Capability(WORK.into()),
                "ping",
                &(),
                Duration::from_secs(60),
            )
            .await?;
        let broadcast = (t.elapsed(), report.count(Outcome::Delivered) + rare);
        Ok(Figures {
            agents: n,
            processes: pids.len(),
            live_after,
            agents_rss,
            server_rss: server.pid().and_then(rss_of).unwrap_or(0),
            coordinator_rss: coordinator.rss()?,
            connections,
            subscriptions,
            heartbeats_per_second,
            heartbeat,
            discovery,
            broadcast,
        })
    }
    .await;
    client.shutdown().await;
    // The hosts stop their agents (SIGTERM, each its grace); killed, their agents die with
    // them.
    for mut h in hosts {
        if let Some(pid) = h.id() {
            let _ = tokio::process::Command::new("kill")
                .arg(pid.to_string())
                .status()
                .await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(30), h.wait()).await;
        let _ = h.kill().await;
    }
    coordinator.stop().await;
    drop(server);
    result
}

/// Whether `e` is the coordinator saying it cannot do it now (5019): asked again later.
fn unavailable(e: &anyhow::Error) -> bool {
    e.downcast_ref::<chorus_sdk::SdkError>()
        .is_some_and(|e| e.status() == chorus_sdk::StatusCode::UNAVAILABLE)
}
