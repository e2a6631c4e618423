//! The scenarios, one file each (the three cluster ones share `cluster`), and the harness they
//! share: the scale of a run, connecting agents, and turning what happened into a report.

mod agent_kill;
mod clock_skew;
mod cluster;
mod coordinator_kill;
mod hostile;
mod server_kill;
mod slow_backlog;

pub(crate) use server_kill::durable_server;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chorus_broker_adapter::{Broker, BrokerOptions, JetStream};
use chorus_sdk::{Agent, AgentOptions, Subjects};

use crate::coordinator::{CoordinatorLauncher, CoordinatorSpec, RunningCoordinator};
use crate::ledger::{self, Class, Ledger, Probe};
use crate::report::{Check, ScenarioReport};
use crate::traffic::{Plan, Route};
use crate::worker::WORK;
use crate::{ChaosOptions, WAIT, dlq};

/// The agent id of every scenario's worker.
pub(crate) const WORKER: &str = "worker";
/// The timeout of the checker's JetStream calls.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long agents keep trying to connect to a cluster whose JetStream is still electing its
/// meta leader (a replicated stream cannot be made before).
pub(crate) const CLUSTER_READY: Duration = Duration::from_secs(60);
/// The pause between two connection attempts while a cluster gets ready.
const CONNECT_RETRY: Duration = Duration::from_millis(500);
/// How long an agent's shutdown may take before it is left.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(15);
/// The longest a scenario's classes may take to be handled again after a fault ends (issue
/// 38: commands handled within 2 s of a restarted server being ready): a single server
/// restarted, a worker or coordinator replaced. The worker renews its pulls when its
/// connection comes back, and a client retries its connection at least every second.
pub(crate) const RECOVERY_LIMIT: Duration = Duration::from_secs(2);
/// The same for a cluster node lost (killed, stopped, cut off), held today at what the design
/// gives, not at the 2 s goal: the inbox's stream and consumer leaders move, and a pull that
/// waits on a consumer leader that moved while the worker's connection lived is renewed only
/// once it has missed two heartbeats (10 s from the fault, so up to about 10 s after the node
/// is back), then an election. A shorter pull heartbeat or the server's leader-election
/// advisories would bring it down; see docs/RELIABILITY.md.
pub(crate) const CLUSTER_RECOVERY_LIMIT: Duration = Duration::from_secs(12);

/// A fault to inject, by its `--only` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scenario {
    /// One server with `sync_always`, killed with SIGKILL mid-traffic and restarted on its
    /// store.
    ServerKill,
    /// A 3-node cluster, the node leading the inbox stream killed and restarted.
    LeaderKill,
    /// A 3-node cluster, the inbox stream leader's node stopped (SIGSTOP) and resumed.
    PauseNode,
    /// A 3-node cluster, one node's routes cut by proxies and healed.
    Partition,
    /// The worker killed mid-handler; a new instance takes over.
    AgentKill,
    /// Poison commands while the coordinator is killed and another started.
    CoordinatorKill,
    /// Garbage on the worker's subjects while traffic flows.
    Hostile,
    /// A slow handler with a backlog far longer than the ack wait.
    SlowBacklog,
    /// Signed commands whose sender's clock is skewed, within and beyond the tolerance.
    ClockSkew,
}

impl Scenario {
    /// Every scenario, in the order a run takes them.
    pub const ALL: [Scenario; 9] = [
        Scenario::ServerKill,
        Scenario::AgentKill,
        Scenario::SlowBacklog,
        Scenario::CoordinatorKill,
        Scenario::Hostile,
        Scenario::ClockSkew,
        Scenario::LeaderKill,
        Scenario::PauseNode,
        Scenario::Partition,
    ];

    /// Its `--only` key.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::ServerKill => "server-kill",
            Scenario::LeaderKill => "leader-kill",
            Scenario::PauseNode => "pause-node",
            Scenario::Partition => "partition",
            Scenario::AgentKill => "agent-kill",
            Scenario::CoordinatorKill => "coordinator-kill",
            Scenario::Hostile => "hostile",
            Scenario::SlowBacklog => "slow-backlog",
            Scenario::ClockSkew => "clock-skew",
        }
    }

    /// The fault, in a few words.
    pub fn fault(self) -> &'static str {
        match self {
            Scenario::ServerKill => {
                "kill -9 of the only server (sync_always) mid-traffic, restarted on its store"
            }
            Scenario::LeaderKill => {
                "kill -9 of the node leading the 3-replica inbox stream, restarted"
            }
            Scenario::PauseNode => "SIGSTOP of the inbox stream leader's node, then SIGCONT",
            Scenario::Partition => "one node's routes cut by loopback proxies, then healed",
            Scenario::AgentKill => {
                "the worker killed mid-handler (its runtime dropped), a new instance takes over"
            }
            Scenario::CoordinatorKill => {
                "poison commands; the coordinator killed mid-traffic, another started"
            }
            Scenario::Hostile => {
                "malformed header blocks, garbage, truncated and oversized envelopes on the worker's subjects"
            }
            Scenario::SlowBacklog => {
                "a 100 ms handler behind a backlog far longer than its 600 ms ack wait"
            }
            Scenario::ClockSkew => {
                "signed commands from a sender whose clock is skewed within and beyond the receiver's tolerance"
            }
        }
    }

    /// How soon each class must be handled again after a fault ends, and what ends it:
    /// [`RECOVERY_LIMIT`] for a single server restarted (counted from the restarted process
    /// ready: its ports file written, so its client port listens), a worker or a coordinator
    /// replaced (from the new one serving); [`CLUSTER_RECOVERY_LIMIT`] for a cluster node
    /// lost (from the node back, resumed or healed). None where no fault ends (hostile input,
    /// a slow handler, skewed clocks).
    pub(crate) fn recovery_limit(self) -> Option<ledger::RecoveryLimit> {
        let (limit, from) = match self {
            Scenario::ServerKill => (RECOVERY_LIMIT, "the restarted server ready"),
            Scenario::AgentKill => (RECOVERY_LIMIT, "the new worker instance serving"),
            Scenario::CoordinatorKill => (RECOVERY_LIMIT, "the new coordinator serving"),
            Scenario::LeaderKill => (CLUSTER_RECOVERY_LIMIT, "the restarted node ready"),
            Scenario::PauseNode => (CLUSTER_RECOVERY_LIMIT, "the stopped node resumed"),
            Scenario::Partition => (CLUSTER_RECOVERY_LIMIT, "the partition healed"),
            Scenario::Hostile | Scenario::SlowBacklog | Scenario::ClockSkew => return None,
        };
        Some(ledger::RecoveryLimit { limit, from })
    }

    /// Runs the scenario and reports; a setup failure is reported, not returned.
    pub(crate) async fn run(self, scale: &Scale, opts: &ChaosOptions) -> ScenarioReport {
        let started = Instant::now();
        let outcome = match self {
            Scenario::ServerKill => server_kill::run(scale, opts).await,
            Scenario::LeaderKill => cluster::leader_kill(scale, opts).await,
            Scenario::PauseNode => cluster::pause_node(scale, opts).await,
            Scenario::Partition => cluster::partition(scale, opts).await,
            Scenario::AgentKill => agent_kill::run(scale, opts).await,
            Scenario::CoordinatorKill => coordinator_kill::run(scale, opts).await,
            Scenario::Hostile => hostile::run(scale, opts).await,
            Scenario::SlowBacklog => slow_backlog::run(scale, opts).await,
            Scenario::ClockSkew => clock_skew::run(scale, opts).await,
        };
        match outcome {
            Ok(report) => report,
            Err(e) => ScenarioReport::failed(
                self.name(),
                self.fault(),
                started.elapsed().as_secs_f64(),
                format!("{e:#}"),
            ),
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is no scenario's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownScenario(pub String);

impl fmt::Display for UnknownScenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Scenario::ALL.iter().map(|s| s.name()).collect();
        write!(
            f,
            "no scenario {:?} (there are: {})",
            self.0,
            names.join(", ")
        )
    }
}

impl std::error::Error for UnknownScenario {}

impl FromStr for Scenario {
    type Err = UnknownScenario;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Scenario::ALL
            .into_iter()
            .find(|c| c.name() == s.trim())
            .ok_or_else(|| UnknownScenario(s.to_owned()))
    }
}

/// How big a run is: the short form for CI, the full form for a person.
#[derive(Debug, Clone)]
pub(crate) struct Scale {
    /// Traffic before the first fault, between faults and after the last.
    pub(crate) phase: Duration,
    /// Sending agents.
    pub(crate) senders: usize,
    /// Messages per batch, and the pause after each: the offered rate per sender.
    pub(crate) batch: usize,
    pub(crate) pace: Duration,
    /// How many times a repeatable fault (a kill) is injected.
    pub(crate) faults: usize,
    /// How long a killed process stays down.
    pub(crate) down: Duration,
    /// How long a node stays stopped (SIGSTOP).
    pub(crate) pause: Duration,
    /// How long a partition lasts.
    pub(crate) partition: Duration,
    /// The deadline for the inbox to drain once traffic stops.
    pub(crate) settle: Duration,
    /// Slow-backlog messages per class and sender.
    pub(crate) backlog: usize,
    /// Clock-skew messages per kind of skew.
    pub(crate) skewed: usize,
}

impl Scale {
    pub(crate) fn new(opts: &ChaosOptions) -> Scale {
        let mut scale = if opts.short {
            Scale {
                phase: Duration::from_millis(1500),
                senders: 3,
                batch: 8,
                pace: Duration::from_millis(50),
                faults: 2,
                down: Duration::from_millis(800),
                pause: Duration::from_secs(6),
                partition: Duration::from_secs(4),
                settle: Duration::from_secs(60),
                backlog: 20,
                skewed: 40,
            }
        } else {
            Scale {
                phase: Duration::from_secs(5),
                senders: 4,
                batch: 16,
                pace: Duration::from_millis(40),
                faults: 3,
                down: Duration::from_secs(2),
                pause: Duration::from_secs(15),
                partition: Duration::from_secs(10),
                settle: Duration::from_secs(180),
                backlog: 100,
                skewed: 400,
            }
        };
        if let Some(s) = opts.seconds.filter(|s| s.is_finite() && *s > 0.0) {
            scale.phase = Duration::from_secs_f64(s);
        }
        if let Some(n) = opts.senders.filter(|n| *n > 0) {
            scale.senders = n;
        }
        scale
    }

    /// The steady traffic of at-least-once and exactly-once commands to the worker.
    pub(crate) fn plan(&self) -> Plan {
        Plan {
            routes: vec![
                Route::new(Class::AtLeastOnce, WORKER, WORK),
                Route::new(Class::ExactlyOnce, WORKER, WORK),
            ],
            batch: self.batch,
            pace: self.pace,
        }
    }
}

/// Connects `options`, retrying (every [`CONNECT_RETRY`], up to `limit`) while the server or
/// cluster is not ready for it.
pub(crate) async fn connect(options: AgentOptions, limit: Duration) -> anyhow::Result<Agent> {
    let deadline = Instant::now() + limit;
    loop {
        match tokio::time::timeout(WAIT, options.clone().connect()).await {
            Ok(Ok(agent)) => return Ok(agent),
            Ok(Err(e)) if Instant::now() >= deadline => {
                return Err(e).context("agent did not connect");
            }
            Err(_) if Instant::now() >= deadline => {
                anyhow::bail!("agent did not connect within {WAIT:?}")
            }
            _ => tokio::time::sleep(CONNECT_RETRY).await,
        }
    }
}

/// How long to keep trying to connect to `urls`: a cluster's JetStream needs its meta leader.
pub(crate) fn ready_limit(urls: &[String]) -> Duration {
    if urls.len() > 1 { CLUSTER_READY } else { WAIT }
}

/// A worker's options: a durable inbox, the given servers.
pub(crate) fn worker_options(urls: &[String]) -> AgentOptions {
    AgentOptions::new(WORKER)
        .servers(urls.iter().cloned())
        .durable_inbox(true)
}

/// `n` sending agents, `sender-0` ...
pub(crate) async fn senders(urls: &[String], n: usize) -> anyhow::Result<Vec<Agent>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let options = AgentOptions::new(format!("sender-{i}")).servers(urls.iter().cloned());
        out.push(connect(options, ready_limit(urls)).await?);
    }
    Ok(out)
}

/// A plain connection to read the streams with.
pub(crate) async fn checker(urls: &[String]) -> anyhow::Result<(Broker, JetStream)> {
    let broker = tokio::time::timeout(
        WAIT,
        BrokerOptions::new(urls.iter().cloned())
            .name("chorus-chaos-checker")
            .connect(),
    )
    .await
    .context("checker did not connect in time")?
    .context("checker did not connect")?;
    let js = broker.jetstream(CHECK_TIMEOUT);
    Ok((broker, js))
}

/// Starts a coordinator on `urls` with the options' launcher (see [`start_coordinator`]).
pub(crate) async fn coordinator(
    opts: &ChaosOptions,
    urls: &[String],
) -> anyhow::Result<Box<dyn RunningCoordinator>> {
    start_coordinator(opts.coordinator.as_ref(), urls).await
}

/// Starts a coordinator on `urls`, retrying (every [`CONNECT_RETRY`], up to
/// [`ready_limit`]) while a cluster's JetStream cannot yet make its streams.
pub(crate) async fn start_coordinator(
    launcher: &dyn CoordinatorLauncher,
    urls: &[String],
) -> anyhow::Result<Box<dyn RunningCoordinator>> {
    let spec = CoordinatorSpec {
        servers: urls.to_vec(),
        replicas: if urls.len() > 1 { 3 } else { 1 },
    };
    let deadline = Instant::now() + ready_limit(urls);
    loop {
        match launcher.start(&spec).await {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() >= deadline => {
                return Err(e).context("coordinator did not start");
            }
            Err(_) => tokio::time::sleep(CONNECT_RETRY).await,
        }
    }
}

/// Shuts agents down, each within [`SHUTDOWN_DEADLINE`].
pub(crate) async fn shutdown(agents: impl IntoIterator<Item = Agent>) {
    for agent in agents {
        let _ = tokio::time::timeout(SHUTDOWN_DEADLINE, agent.shutdown()).await;
    }
}

/// What one scenario records as it runs, and its report once traffic has stopped.
#[derive(Debug)]
pub(crate) struct Harness {
    pub(crate) scenario: Scenario,
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) probe: Arc<Probe>,
    /// When each fault ended (the process back, the partition healed).
    pub(crate) fault_ends: Vec<Instant>,
    pub(crate) checks: Vec<Check>,
    pub(crate) notes: Vec<String>,
    pub(crate) nats_server: String,
    started: Instant,
}

impl Harness {
    pub(crate) fn new(scenario: Scenario) -> Harness {
        Harness {
            scenario,
            ledger: Arc::default(),
            probe: Arc::default(),
            fault_ends: Vec::new(),
            checks: Vec::new(),
            notes: Vec::new(),
            nats_server: String::new(),
            started: Instant::now(),
        }
    }

    pub(crate) fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    pub(crate) fn check(&mut self, passed: bool, name: impl Into<String>) {
        self.checks.push(Check::new(passed, name));
    }

    /// Waits for the inbox to drain (up to the scale's deadline), reads the dead letters and
    /// counts each class.
    pub(crate) async fn finish(
        mut self,
        js: &JetStream,
        scale: &Scale,
        classes: &[Class],
    ) -> anyhow::Result<ScenarioReport> {
        if !self.fault_ends.is_empty() {
            let each: Vec<String> = self
                .fault_ends
                .iter()
                .map(|end| {
                    self.ledger
                        .acked_again(*end)
                        .map_or("-".into(), |d| d.as_millis().to_string())
                })
                .collect();
            self.note(format!(
                "senders acked again after each fault (ms): {}",
                each.join(", ")
            ));
        }
        let subjects = Subjects::default();
        let drained = dlq::drained(js, &subjects, scale.settle).await;
        match drained {
            Some(took) => self.check(
                true,
                format!(
                    "inbox drained {:.1} s after traffic stopped",
                    took.as_secs_f64()
                ),
            ),
            None => {
                let left = dlq::inbox_depth(js, &subjects).await;
                self.check(
                    false,
                    format!(
                        "inbox drained within {:?} (still {} stored: a hang)",
                        scale.settle,
                        left.map_or("?".into(), |n| n.to_string())
                    ),
                );
            }
        }
        let letters = dlq::letters(js, &subjects).await?;
        let foreign = letters.iter().filter(|l| l.id.is_none()).count();
        if foreign > 0 {
            self.note(format!(
                "{foreign} dead letters of messages that are no message id (garbage, forgeries)"
            ));
        }
        // `uncertain` is for a run that began and was interrupted; one whose handler never
        // started must have been taken over and run instead.
        let never_run = ledger::uncertain_never_run(&self.probe, &letters);
        if matches!(self.scenario, Scenario::AgentKill) {
            // An instance killed between claiming a message and starting its handler looks,
            // from the claim, the same as one killed mid-handler: uncertain is the policy.
            if never_run > 0 {
                self.note(format!(
                    "{never_run} exactly-once messages dead-lettered as uncertain were claimed by a killed instance before their handler started"
                ));
            }
        } else {
            self.check(
                never_run == 0,
                format!(
                    "no exactly-once message dead-lettered as uncertain unless a run of it began ({never_run} did)"
                ),
            );
        }
        let rows = ledger::count(
            self.scenario.name(),
            classes,
            &self.ledger,
            &self.probe,
            &letters,
            &self.fault_ends,
            self.scenario.recovery_limit(),
        );
        Ok(ScenarioReport {
            scenario: self.scenario.name().to_owned(),
            fault: self.scenario.fault().to_owned(),
            seconds: self.started.elapsed().as_secs_f64(),
            nats_server: self.nats_server,
            checks: self.checks,
            notes: self.notes,
            rows,
        }
        .finish())
    }
}

/// Lets the traffic flow for `phase` (a span of the timeline, not a wait for readiness).
pub(crate) async fn let_traffic_run(phase: Duration) {
    tokio::time::sleep(phase).await;
}
