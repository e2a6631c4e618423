//! `chorus chaos --soak <duration>`: a long run at a steady rate with periodic faults, that
//! samples the memory and descriptors of every process it can see and flags growth.
//!
//! One `nats-server` (`sync_interval: always`) as a child process, a coordinator through the
//! [`CoordinatorLauncher`] (a `chorus serve` child from the CLI, in process in the test), a
//! worker agent on a runtime of its own ([`Isolated`], so that it can crash), and in this
//! process the senders of durable commands (at-least-once and exactly-once), an event
//! publisher with a subscriber, and a requester asking the worker to echo numbers. Every
//! `fault_every`, in turn: the server killed with SIGKILL and restarted on its store, the
//! worker crashed and another started, the coordinator killed and another started.
//!
//! Every `sample_every` the sampler reads each process's resident memory and open
//! descriptors from `/proc` (see [`sampler`]); at the end, each process and resource gets a
//! trend (see [`growth`]): the samples of its warm-up left out (the run's first 20 %, at least
//! a minute unless that is more than half the run; and as long again after each restart), a
//! least-squares slope fitted per incarnation, projected over the measured window and compared
//! with [`GrowthLimits`]. The counters are the fault scenarios' for the durable classes, plus
//! received + lost = sent for the events and no wrong answer for the requests.
//!
//! The accounting is kept in memory sized for the whole run at the start (see [`tally`]), so
//! the tool does not measure its own bookkeeping as growth. The worker's exactly-once records
//! live [`SoakOptions::idempotency_ttl`] (a minute by default, where the SDK keeps them a day)
//! so that the server's store of them levels off within the warm-up: at a day, that store
//! grows by design for a day, which a soak of minutes would report as growth.

mod growth;
mod load;
mod sampler;
mod tally;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chorus_nats_server::NatsServer;
use chorus_sdk::{Agent, AgentOptions, Context, HandlerError};
use serde::Serialize;

pub use growth::{GrowthLimits, Resource, Trend, Verdict};
pub use sampler::{Sample, Series};

use self::load::{ECHO, Load, REQUEST_TIMEOUT, Rates, Requests, TOPIC};
use self::sampler::{Sampler, Watched};
use self::tally::{Seen, Tally};
use crate::coordinator::{CoordinatorLauncher, RunningCoordinator};
use crate::ledger::Class;
use crate::report::{Check, Row};
use crate::scenarios::{
    checker, connect, durable_server, senders, shutdown, start_coordinator, worker_options,
};
use crate::worker::{Isolated, WORK};
use crate::{WAIT, dlq};

/// How long a killed server or coordinator stays down.
const DOWN: Duration = Duration::from_secs(2);
/// The worker's ack wait: how soon a crashed instance's deliveries go to the next one.
const ACK_WAIT: Duration = Duration::from_secs(1);
/// Each durable handler run's work, so that a crash finds runs in progress.
const WORK_TIME: Duration = Duration::from_millis(2);
/// How long after a fault the first completion of each class is waited for.
const RECOVERY_LIMIT: Duration = Duration::from_secs(30);
/// How often that wait looks.
const RECOVERY_POLL: Duration = Duration::from_millis(20);
/// The deadline for the inbox to drain once traffic stops.
const SETTLE: Duration = Duration::from_secs(120);
/// How long the closing event sentinels are published for, and each waited for.
const SENTINELS: Duration = Duration::from_secs(30);
const SENTINEL_WAIT: Duration = Duration::from_millis(500);
/// Shares of the rate: durable commands, events, requests.
const DURABLE_SHARE: f64 = 0.6;
const EVENT_SHARE: f64 = 0.3;
/// Room in the accounting for the traffic after the planned duration (stopping, draining,
/// sentinels), and a margin on the rate.
const ACCOUNTING_EXTRA: Duration = Duration::from_secs(60);
const ACCOUNTING_MARGIN: f64 = 1.25;
/// The most the accounting sets aside at the start, per buffer: a longer or faster run grows
/// its buffers as it goes (a byte per message, and shows in the agents' memory).
const ACCOUNTING_MAX: usize = 64 << 20;
/// The shortest time between samples.
const MIN_SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// The most samples a series sets room aside for at the start.
const SAMPLES_MAX: usize = 1 << 16;

/// The process roles the sampler knows.
const NATS: &str = "nats-server";
const COORDINATOR: &str = "coordinator";
const AGENTS: &str = "agents";
const AGENTS_AND_COORDINATOR: &str = "agents+coordinator";

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    /// How long the traffic runs.
    pub duration: Duration,
    /// Messages a second offered, all kinds together: 60 % durable commands (half
    /// at-least-once, half exactly-once), 30 % events, 10 % requests.
    pub rate: u32,
    /// Agents sending the durable commands.
    pub senders: usize,
    /// Time between faults; `None` picks a fifth of the run (between 30 s and 5 min), zero
    /// injects none.
    pub fault_every: Option<Duration>,
    /// Time between samples (at least 100 ms); `None` picks 1/120 of the run, between 1 s
    /// and 5 s.
    pub sample_every: Option<Duration>,
    /// Samples left out at the start (and after each restart); `None` picks 20 % of the run,
    /// at least a minute unless that is more than half of it.
    pub warmup: Option<Duration>,
    /// How long the worker's exactly-once records live (the bucket's max age).
    pub idempotency_ttl: Duration,
    /// When projected growth is flagged.
    pub limits: GrowthLimits,
    /// Starts the coordinator (and each one after a kill).
    pub coordinator: Arc<dyn CoordinatorLauncher>,
}

impl SoakOptions {
    /// A soak of `duration` at 300 messages a second with 3 senders, the rest picked from
    /// the duration.
    pub fn new(duration: Duration, coordinator: Arc<dyn CoordinatorLauncher>) -> Self {
        SoakOptions {
            duration,
            rate: 300,
            senders: 3,
            fault_every: None,
            sample_every: None,
            warmup: None,
            idempotency_ttl: Duration::from_secs(60),
            limits: GrowthLimits::default(),
            coordinator,
        }
    }

    /// The timeline these options come to.
    pub fn plan(&self) -> SoakPlan {
        let run = self.duration.as_secs_f64();
        let sample_every = self
            .sample_every
            .filter(|d| !d.is_zero())
            .map_or((run / 120.0).clamp(1.0, 5.0), |d| d.as_secs_f64())
            .max(MIN_SAMPLE_EVERY.as_secs_f64());
        let warmup = self
            .warmup
            .map_or((run * 0.2).max(60.0_f64.min(run / 2.0)), |d| {
                d.as_secs_f64()
            });
        let fault_every = match self.fault_every {
            Some(d) if d.is_zero() => None,
            Some(d) => Some(d.as_secs_f64()),
            None => Some((run / 5.0).clamp(30.0, 300.0)),
        };
        // No fault in the last tenth (and three samples) of the run, so that the last samples
        // show what the faults left behind.
        let last_fault = run - (run / 10.0).max(3.0 * sample_every);
        let faults = fault_every.map_or(Vec::new(), |every| {
            (1..)
                .map(|k| f64::from(k) * every)
                .take_while(|t| *t <= last_fault)
                .collect()
        });
        let rate = f64::from(self.rate);
        SoakPlan {
            seconds: run,
            rate: self.rate,
            senders: self.senders.max(1),
            commands_per_s: rate * DURABLE_SHARE,
            events_per_s: rate * EVENT_SHARE,
            requests_per_s: rate * (1.0 - DURABLE_SHARE - EVENT_SHARE),
            fault_every_s: fault_every,
            fault_at_s: faults,
            sample_every_s: sample_every,
            warmup_s: warmup,
            idempotency_ttl_s: self.idempotency_ttl.as_secs_f64(),
            limits: self.limits,
        }
    }
}

/// The timeline and rates a soak runs with.
#[derive(Debug, Clone, Serialize)]
pub struct SoakPlan {
    /// Seconds of traffic.
    pub seconds: f64,
    /// Messages a second offered, and their split.
    pub rate: u32,
    pub senders: usize,
    pub commands_per_s: f64,
    pub events_per_s: f64,
    pub requests_per_s: f64,
    /// Time between faults (none: no faults), and when each comes.
    pub fault_every_s: Option<f64>,
    pub fault_at_s: Vec<f64>,
    pub sample_every_s: f64,
    pub warmup_s: f64,
    pub idempotency_ttl_s: f64,
    pub limits: GrowthLimits,
}

/// A fault the soak injects, in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SoakFault {
    /// The server killed with SIGKILL, restarted on its store after [`DOWN`].
    ServerKill,
    /// The worker's runtime dropped where it stands, a new instance started.
    WorkerCrash,
    /// The coordinator killed (SIGKILL of `chorus serve`), another started after [`DOWN`].
    CoordinatorKill,
}

impl SoakFault {
    const TURN: [SoakFault; 3] = [
        SoakFault::ServerKill,
        SoakFault::WorkerCrash,
        SoakFault::CoordinatorKill,
    ];

    /// Its name in the table.
    pub fn name(self) -> &'static str {
        match self {
            SoakFault::ServerKill => "server-kill",
            SoakFault::WorkerCrash => "worker-crash",
            SoakFault::CoordinatorKill => "coordinator-kill",
        }
    }
}

/// One fault injected.
#[derive(Debug, Clone, Serialize)]
pub struct FaultRecord {
    /// When it began, seconds since the traffic began.
    pub at_s: f64,
    pub fault: SoakFault,
    /// From the kill to the process serving again.
    pub down_ms: u64,
    /// From then to the first durable command of each class handled (the later of the two);
    /// none if one was not within 30 s.
    pub recovered_ms: Option<u64>,
}

/// Events published, received (distinct), and counted as missed by the subscriber.
#[derive(Debug, Clone, Serialize)]
pub struct EventCounts {
    pub sent: u64,
    pub received: u64,
    /// The subscriber's `AgentStats::lost`: gaps in the publisher's sequence, and drops.
    pub lost: u64,
    /// Of those, dropped on the subscriber's full queue.
    pub dropped: u64,
}

/// Requests sent, answered with their own number, failed (timeout, no responder while a
/// fault lasts) and answered with another number.
#[derive(Debug, Clone, Serialize)]
pub struct RequestCounts {
    pub sent: u64,
    pub answered: u64,
    pub failed: u64,
    pub wrong: u64,
}

/// What a soak found.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub plan: SoakPlan,
    /// Seconds of traffic, and of the whole run (setup and draining included).
    pub traffic_seconds: f64,
    pub seconds: f64,
    /// The server version.
    pub nats_server: String,
    /// The processes sampled, by role.
    pub processes: Vec<String>,
    pub faults: Vec<FaultRecord>,
    /// The durable classes' counters.
    pub rows: Vec<Row>,
    pub events: EventCounts,
    pub requests: RequestCounts,
    /// Per process and resource.
    pub trends: Vec<Trend>,
    /// Checks of the whole run (the rows have their own).
    pub checks: Vec<Check>,
    pub notes: Vec<String>,
    /// Every sample, per process incarnation.
    pub series: Vec<Series>,
}

impl SoakReport {
    /// Whether every check held: nothing lost, no growth flagged.
    pub fn ok(&self) -> bool {
        self.checks.iter().all(|c| c.passed) && self.rows.iter().all(|r| r.ok)
    }

    /// The checks that did not hold.
    pub fn failures(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| c.name.clone())
            .collect();
        for row in &self.rows {
            out.extend(
                row.checks
                    .iter()
                    .filter(|c| !c.passed)
                    .map(|c| format!("{}: {}", row.class, c.name)),
            );
        }
        out
    }

    /// The report as text: the plan, the faults, the counters and the trends.
    pub fn table(&self) -> String {
        let p = &self.plan;
        let mut out = format!(
            "soak: {:.0} s of traffic at {} msg/s ({:.0} commands, {:.0} events, {:.0} requests), {} senders; {}; samples every {:.0} s, warm-up {:.0} s; nats-server {}\n",
            self.traffic_seconds,
            p.rate,
            p.commands_per_s,
            p.events_per_s,
            p.requests_per_s,
            p.senders,
            p.fault_every_s
                .map_or("no faults".into(), |s| format!("a fault every {s:.0} s")),
            p.sample_every_s,
            p.warmup_s,
            self.nats_server,
        );
        for f in &self.faults {
            out.push_str(&format!(
                "  {:>6.0} s  {:<16}  down {:.1} s, commands handled again {}\n",
                f.at_s,
                f.fault.name(),
                f.down_ms as f64 / 1e3,
                f.recovered_ms
                    .map_or("not within 30 s".into(), |ms| format!("{ms} ms later")),
            ));
        }
        out.push('\n');
        out.push_str(&crate::report::header());
        for r in &self.rows {
            out.push_str(&crate::report::line(r));
        }
        let e = &self.events;
        out.push_str(&format!(
            "events: sent {}, received {}, lost {} (dropped {}): received + lost {} sent\n",
            e.sent,
            e.received,
            e.lost,
            e.dropped,
            if e.received + e.lost == e.sent {
                "="
            } else {
                "!="
            }
        ));
        let r = &self.requests;
        out.push_str(&format!(
            "requests: sent {}, answered {}, failed {}, wrong {}\n\n",
            r.sent, r.answered, r.failed, r.wrong
        ));
        out.push_str(&format!(
            "{:<18} {:<3} {:>3} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8}  {}\n",
            "process",
            "res",
            "inc",
            "samples",
            "measured",
            "first",
            "last",
            "min",
            "max",
            "slope/h",
            "growth",
            "limit",
            "verdict"
        ));
        for t in &self.trends {
            let show = |v: Option<f64>| v.map_or("-".into(), |v| t.resource.show(v));
            let signed = |v: Option<f64>| {
                v.map_or("-".into(), |v| {
                    format!(
                        "{}{}",
                        if v >= 0.0 { "+" } else { "-" },
                        t.resource.show(v.abs())
                    )
                })
            };
            out.push_str(&format!(
                "{:<18} {:<3} {:>3} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8}  {}\n",
                t.process,
                t.resource.name(),
                t.incarnations,
                t.samples,
                t.measured,
                t.resource.show(t.first),
                t.resource.show(t.last),
                t.resource.show(t.min),
                t.resource.show(t.max),
                signed(t.slope_per_hour),
                signed(t.growth),
                show(t.limit),
                match t.verdict {
                    Verdict::Steady => "steady",
                    Verdict::Growth => "GROWTH",
                    Verdict::TooFew => "too few samples",
                }
            ));
        }
        out.push('\n');
        for note in &self.notes {
            out.push_str(&format!("  {note}\n"));
        }
        for check in self.checks.iter().filter(|c| c.passed) {
            out.push_str(&format!("  ok: {}\n", check.name));
        }
        for failure in self.failures() {
            out.push_str(&format!("  FAILED: {failure}\n"));
        }
        out
    }
}

/// Registers the worker's handlers: [`WORK`] (recorded as it begins and as it takes effect)
/// and [`ECHO`].
async fn serve(agent: &Agent, tally: &Arc<Tally>) -> anyhow::Result<()> {
    let t = Arc::clone(tally);
    agent
        .on_command(WORK, move |_ctx: Context, id: u64| {
            t.start(id);
            let t = Arc::clone(&t);
            async move {
                tokio::time::sleep(WORK_TIME).await;
                t.complete(id);
                Ok::<_, HandlerError>(())
            }
        })
        .await
        .context("cannot register the work handler")?;
    agent
        .on_command(ECHO, |_ctx: Context, n: u64| async move {
            Ok::<_, HandlerError>(n)
        })
        .await
        .context("cannot register the echo handler")?;
    Ok(())
}

/// A worker instance on a runtime of its own.
async fn instance(
    options: &AgentOptions,
    tally: &Arc<Tally>,
    n: usize,
) -> anyhow::Result<Isolated> {
    let (options, tally) = (options.clone(), Arc::clone(tally));
    Isolated::start(&format!("soak-worker-{n}"), move || async move {
        let agent = options.connect().await?;
        serve(&agent, &tally).await?;
        Ok(agent)
    })
    .await
}

/// What the faults act on.
struct Bus {
    server: Option<NatsServer>,
    coordinator: Option<Box<dyn RunningCoordinator>>,
    launcher: Arc<dyn CoordinatorLauncher>,
    worker: Isolated,
    worker_options: AgentOptions,
    instances: usize,
    urls: Vec<String>,
    tally: Arc<Tally>,
    watched: Arc<Watched>,
}

impl Bus {
    /// Injects `fault`, returns once the process is back and each durable class has been
    /// handled again (or [`RECOVERY_LIMIT`] has passed).
    async fn inject(
        &mut self,
        fault: SoakFault,
    ) -> anyhow::Result<(FaultRecord, [Option<u64>; 2])> {
        let at_s = self.watched.now_s();
        let down = Instant::now();
        match fault {
            SoakFault::ServerKill => {
                let mut server = self.server.take().context("no server to kill")?;
                self.watched.set(NATS, None);
                server = tokio::task::spawn_blocking(move || {
                    server.kill();
                    server
                })
                .await?;
                // The outage itself.
                tokio::time::sleep(DOWN).await;
                let server = tokio::task::spawn_blocking(move || server.restart().map(|()| server))
                    .await?
                    .context("the killed server did not restart")?;
                self.watched.set(NATS, server.pid());
                self.server = Some(server);
            }
            SoakFault::WorkerCrash => {
                self.worker.crash().await;
                self.instances += 1;
                self.worker = instance(&self.worker_options, &self.tally, self.instances)
                    .await
                    .context("no new worker after a crash")?;
            }
            SoakFault::CoordinatorKill => {
                let in_child = self.coordinator.as_ref().and_then(|c| c.pid()).is_some();
                if let Some(c) = self.coordinator.take() {
                    c.kill().await;
                }
                if in_child {
                    self.watched.set(COORDINATOR, None);
                }
                tokio::time::sleep(DOWN).await;
                let c = start_coordinator(self.launcher.as_ref(), &self.urls)
                    .await
                    .context("no new coordinator after a kill")?;
                if let Some(pid) = c.pid() {
                    self.watched.set(COORDINATOR, Some(pid));
                }
                self.coordinator = Some(c);
            }
        }
        let back = Instant::now();
        let recovered = self.recovery(back).await;
        let record = FaultRecord {
            at_s,
            fault,
            down_ms: back.duration_since(down).as_millis() as u64,
            recovered_ms: match recovered {
                [Some(a), Some(b)] => Some(a.max(b)),
                _ => None,
            },
        };
        Ok((record, recovered))
    }

    /// Per durable class, the milliseconds from `back` to its first completion after.
    async fn recovery(&self, back: Instant) -> [Option<u64>; 2] {
        let classes = [Class::AtLeastOnce, Class::ExactlyOnce];
        let before = classes.map(|c| self.tally.completions(c));
        let mut out = [None, None];
        let deadline = back + RECOVERY_LIMIT;
        while out.iter().any(Option::is_none) && Instant::now() < deadline {
            for (i, class) in classes.into_iter().enumerate() {
                if out[i].is_none() && self.tally.completions(class) > before[i] {
                    out[i] = Some(back.elapsed().as_millis() as u64);
                }
            }
            tokio::time::sleep(RECOVERY_POLL).await;
        }
        out
    }
}

/// Publishes event sentinels, one at a time, until one arrives; returns whether one did
/// within [`SENTINELS`]. Once one has, every event before it was received or counted lost.
async fn sentinels(publisher: &Agent, seen: &Seen) -> bool {
    tokio::time::timeout(SENTINELS, async {
        loop {
            let n = seen.issue();
            let _ = publisher.publish(TOPIC, &n).await;
            let arrived = tokio::time::timeout(SENTINEL_WAIT, async {
                while !seen.contains(n) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
            if arrived.is_ok() {
                return;
            }
        }
    })
    .await
    .is_ok()
}

/// Runs a soak. `progress` hears of each fault and, now and then, of the counters and the
/// latest samples.
pub async fn soak(opts: &SoakOptions, progress: fn(&str)) -> anyhow::Result<SoakReport> {
    let started = Instant::now();
    let plan = opts.plan();
    let expected = |per_s: f64| {
        ((per_s * (plan.seconds + ACCOUNTING_EXTRA.as_secs_f64()) * ACCOUNTING_MARGIN) as usize)
            .saturating_add(4096)
            .min(ACCOUNTING_MAX)
    };
    let tally = Arc::new(Tally::new(expected(plan.commands_per_s)));
    let seen = Arc::new(Seen::new(expected(plan.events_per_s)));
    let requests = Arc::new(Requests::default());

    let server = durable_server().await?;
    let urls = vec![server.url().to_owned()];
    let coordinator = start_coordinator(opts.coordinator.as_ref(), &urls).await?;
    let worker_options = worker_options(&urls)
        .durable_ack_wait(ACK_WAIT)
        .idempotency_ttl(opts.idempotency_ttl);
    let worker = instance(&worker_options, &tally, 1).await?;
    let subscriber = connect(AgentOptions::new("subscriber").servers(urls.clone()), WAIT).await?;
    {
        let seen = Arc::clone(&seen);
        subscriber
            .on_event(TOPIC, move |_ctx: Context, n: u64| {
                seen.mark(n);
                async { Ok(()) }
            })
            .await
            .context("cannot subscribe to the soak's events")?;
    }
    let publisher = connect(AgentOptions::new("publisher").servers(urls.clone()), WAIT).await?;
    let requester = connect(
        AgentOptions::new("requester")
            .servers(urls.clone())
            .request_timeout(REQUEST_TIMEOUT),
        WAIT,
    )
    .await?;
    let senders = senders(&urls, plan.senders).await?;
    let (checker_broker, js) = checker(&urls).await?;
    let nats_server = checker_broker.server_version();

    let start = Instant::now();
    let watched = Arc::new(Watched::new(start));
    let own = if coordinator.pid().is_some() {
        AGENTS
    } else {
        AGENTS_AND_COORDINATOR
    };
    watched.set(own, Some(std::process::id()));
    watched.set(NATS, server.pid());
    if let Some(pid) = coordinator.pid() {
        watched.set(COORDINATOR, Some(pid));
    }
    let samples_expected = ((plan.seconds / plan.sample_every_s) as usize + 16).min(SAMPLES_MAX);
    let sampler = Sampler::start(
        Arc::clone(&watched),
        Duration::from_secs_f64(plan.sample_every_s),
        samples_expected,
    );
    let load = Load::start(
        senders,
        publisher,
        requester,
        Rates {
            durable: plan.commands_per_s,
            events: plan.events_per_s,
            requests: plan.requests_per_s,
        },
        &tally,
        &seen,
        &requests,
    );
    let mut bus = Bus {
        server: Some(server),
        coordinator: Some(coordinator),
        launcher: Arc::clone(&opts.coordinator),
        worker,
        worker_options,
        instances: 1,
        urls: urls.clone(),
        tally: Arc::clone(&tally),
        watched: Arc::clone(&watched),
    };

    let end = start
        .checked_add(Duration::from_secs_f64(plan.seconds))
        .context("the soak is longer than this clock can count")?;
    let progress_every = Duration::from_secs_f64((plan.seconds / 10.0).clamp(10.0, 300.0));
    let mut next_progress = start + progress_every;
    let mut faults = Vec::new();
    let mut recovered: [Vec<Option<u64>>; 2] = [Vec::new(), Vec::new()];
    let mut injected = 0usize;
    let mut failure = None;
    loop {
        let next_fault = plan
            .fault_at_s
            .get(injected)
            .and_then(|s| start.checked_add(Duration::from_secs_f64(*s)));
        let wake = [Some(end), next_fault, Some(next_progress)]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(end);
        // The timeline: the next fault, progress line or the end.
        tokio::time::sleep_until(wake.into()).await;
        let now = Instant::now();
        if let Some(at) = next_fault
            && now >= at
        {
            let fault = SoakFault::TURN[injected % SoakFault::TURN.len()];
            injected += 1;
            match bus.inject(fault).await {
                Ok((record, by_class)) => {
                    for (r, c) in recovered.iter_mut().zip(by_class) {
                        r.push(c);
                    }
                    progress(&format!(
                        "soak {:.0} s: {}, down {:.1} s, commands handled again {}",
                        record.at_s,
                        fault.name(),
                        record.down_ms as f64 / 1e3,
                        record
                            .recovered_ms
                            .map_or("not within 30 s".into(), |ms| format!("{ms} ms later"))
                    ));
                    faults.push(record);
                }
                Err(e) => {
                    failure = Some(e.context(format!("{} failed", fault.name())));
                    break;
                }
            }
            continue;
        }
        if now >= end {
            break;
        }
        if now >= next_progress {
            while next_progress <= now {
                next_progress += progress_every;
            }
            let latest: Vec<String> = sampler
                .latest()
                .into_iter()
                .map(|(p, s)| {
                    format!(
                        "{p} {} {} fds",
                        Resource::Rss.show(s.rss_bytes as f64),
                        s.fds
                    )
                })
                .collect();
            progress(&format!(
                "soak {:.0}/{:.0} s: {} commands sent, {} handled, {} events, {} requests; {}",
                watched.now_s(),
                plan.seconds,
                tally.sent(),
                tally.completions(Class::AtLeastOnce) + tally.completions(Class::ExactlyOnce),
                seen.sent(),
                requests.sent.load(Ordering::Relaxed),
                latest.join(", ")
            ));
        }
    }

    // Sampling ends with the traffic, so the draining is not measured.
    let series = sampler.stop().await;
    let traffic_seconds = watched.now_s();
    let stopped = load.stop().await;
    if let Some(e) = failure {
        shutdown(stopped.all().chain([subscriber])).await;
        return Err(e);
    }
    progress("soak: traffic stopped; draining");
    let mut checks = Vec::new();
    let mut notes = Vec::new();
    let subjects = chorus_sdk::Subjects::default();
    match dlq::drained(&js, &subjects, SETTLE).await {
        Some(took) => checks.push(Check::new(
            true,
            format!(
                "inbox drained {:.1} s after traffic stopped",
                took.as_secs_f64()
            ),
        )),
        None => checks.push(Check::new(
            false,
            format!("inbox drained within {SETTLE:?} (a hang)"),
        )),
    }
    let sentinel = match &stopped.publisher {
        Some(p) => sentinels(p, &seen).await,
        None => false,
    };
    let letters = dlq::letters(&js, &subjects).await?;
    // Recovery is reported fault by fault, not held: a soak judges leaks and loss, and the
    // scenarios hold recovery (a server kill can still wait out a lost JetStream answer,
    // docs/RELIABILITY.md).
    let rows = tally.rows(&letters, recovered, None);
    let stats = subscriber.stats();
    let events = EventCounts {
        sent: seen.sent(),
        received: seen.received(),
        lost: stats.lost,
        dropped: stats.dropped,
    };
    checks.push(Check::new(
        sentinel,
        "a closing event sentinel arrived (every event before it received or counted lost)",
    ));
    checks.push(Check::new(
        events.received + events.lost == events.sent && events.received > 0,
        format!(
            "events: received {} + lost {} = sent {}",
            events.received, events.lost, events.sent
        ),
    ));
    let requests = RequestCounts {
        sent: requests.sent.load(Ordering::Relaxed),
        answered: requests.answered.load(Ordering::Relaxed),
        failed: requests.failed.load(Ordering::Relaxed),
        wrong: requests.wrong.load(Ordering::Relaxed),
    };
    checks.push(Check::new(
        requests.wrong == 0 && requests.answered > 0,
        format!(
            "requests: {} answered, {} answered wrongly",
            requests.answered, requests.wrong
        ),
    ));
    let foreign = tally.foreign();
    checks.push(Check::new(
        foreign == 0,
        format!("handler runs of ids never sent: {foreign}"),
    ));
    let processes = watched.processes();
    for process in &processes {
        let n: usize = series
            .iter()
            .filter(|s| &s.process == process)
            .map(|s| s.samples.len())
            .sum();
        checks.push(Check::new(n > 0, format!("{process}: {n} samples")));
    }
    let trends = growth::trends(&processes, &series, plan.warmup_s, &plan.limits);
    for t in &trends {
        let shown = |v: Option<f64>| v.map_or("-".into(), |v| t.resource.show(v));
        let what = format!(
            "{} {}: growth {} over the measured window (limit {})",
            t.process,
            t.resource.name(),
            shown(t.growth),
            shown(t.limit)
        );
        match t.verdict {
            Verdict::Growth => checks.push(Check::new(false, format!("no steady growth: {what}"))),
            Verdict::Steady => checks.push(Check::new(true, format!("no steady growth: {what}"))),
            Verdict::TooFew => notes.push(format!(
                "{} {}: {} samples after the warm-up, too few to judge",
                t.process,
                t.resource.name(),
                t.measured
            )),
        }
    }
    notes.push(format!(
        "{} faults; reconnects of the event subscriber: {}",
        faults.len(),
        subscriber.broker().stats().reconnects
    ));

    shutdown(stopped.all().chain([subscriber])).await;
    bus.worker.crash().await;
    if let Some(c) = bus.coordinator.take() {
        c.shutdown().await;
    }
    drop(checker_broker);
    drop(bus);
    Ok(SoakReport {
        plan,
        traffic_seconds,
        seconds: started.elapsed().as_secs_f64(),
        nats_server,
        processes,
        faults,
        rows,
        events,
        requests,
        trends,
        checks,
        notes,
        series,
    })
}
