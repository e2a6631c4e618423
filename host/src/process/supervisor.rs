//! The [`Supervisor`]: one task per replica, which starts its process, watches it, restarts it
//! under its manifest's policy and stops it; and the statuses and events it keeps.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::backoff::{Backoff, CrashWindow, Verdict};
use super::child::{Launch, Running, agent_env, describe_exit, usage};
use super::health::Probe;
use super::launch::LaunchSpec;
use super::limits::{self, CgroupHost, Enforcement};
use super::logs::{self, LogFile, LogLimits, SharedLog, StderrTail, Stream};
use super::user::RunAs;
use super::{DEFAULT_STOP_GRACE, KILL_WAIT, ProcessError, check_agent_id};
use super::{ReplicaState, ReplicaStatus};
use crate::duration::format_duration;
use crate::manifest::{Manifest, Resources, Restart, RestartPolicy};

/// Events kept for a slow subscriber before it starts missing them.
const EVENT_BUFFER: usize = 1024;
/// Time [`Supervisor::stop`] allows past the grace and the SIGKILL wait, for the last output
/// to be written and the replica's cgroup removed.
const STOP_MARGIN: Duration = Duration::from_secs(2);
const MIB: u64 = 1024 * 1024;

/// How a host supervises its agents.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    /// The host's id, given to every agent as `CHORUS_HOST`.
    pub host: String,
    /// Variables given to every agent (the bus's `CHORUS_NATS_URL` and such); they win over a
    /// manifest's `run.env`.
    pub env: Vec<(String, String)>,
    /// Where the replicas' logs are written, `<agent id>.log` each.
    pub log_dir: PathBuf,
    /// How large a replica's log may grow.
    pub log_limits: LogLimits,
    /// The `chorus` binary, to start agents through its `host-exec` launcher (limits, death
    /// with the host); without one, agents are started directly and nothing is limited.
    pub launcher: Option<PathBuf>,
    /// Time a replica has to exit after SIGTERM before SIGKILL.
    pub stop_grace: Duration,
    /// Who agents and their health commands run as ([`RunAs`]); the host's own user unless
    /// set.
    pub run_as: RunAs,
    /// The bubblewrap binary each agent runs inside (through the launcher:
    /// [`super::launch::sandbox_args`]); `None`: no sandbox.
    pub sandbox: Option<PathBuf>,
}

impl SupervisorConfig {
    /// A configuration for host `host` logging under `log_dir`, with default limits and grace,
    /// no launcher and no extra environment.
    pub fn new(host: impl Into<String>, log_dir: impl Into<PathBuf>) -> SupervisorConfig {
        SupervisorConfig {
            host: host.into(),
            env: Vec::new(),
            log_dir: log_dir.into(),
            log_limits: LogLimits::default(),
            launcher: None,
            stop_grace: DEFAULT_STOP_GRACE,
            run_as: RunAs::Host {
                name: String::from("the host's user"),
            },
            sandbox: None,
        }
    }
}

/// A change in a replica's life, for the host service to report on the bus.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplicaEvent {
    /// A process of the replica started (at first, and after each restart).
    Started {
        /// The replica's agent id.
        agent_id: String,
        /// Its deployment.
        deployment: String,
        /// Its number.
        replica: u32,
        /// The new process.
        pid: u32,
    },
    /// Its process exited.
    Exited {
        /// The replica's agent id.
        agent_id: String,
        /// The exit code, for a normal exit.
        code: Option<i32>,
        /// The signal that ended it, otherwise.
        signal: Option<i32>,
    },
    /// It will be started again after `delay`.
    Restarting {
        /// The replica's agent id.
        agent_id: String,
        /// Consecutive crashes so far.
        attempt: u32,
        /// The wait before the start.
        delay: Duration,
    },
    /// Given up on: no more starts.
    Failed {
        /// The replica's agent id.
        agent_id: String,
        /// Its deployment.
        deployment: String,
        /// Why.
        reason: String,
    },
    /// Stopped; no more starts.
    Stopped {
        /// The replica's agent id.
        agent_id: String,
    },
}

/// Runs agent processes on this machine: a cheap [`Clone`] handle over shared state; every
/// task it starts is owned by its [`TaskTracker`], and [`Supervisor::shutdown`] waits for all.
///
/// ```no_run
/// # async fn example(manifest: chorus_host::manifest::Manifest) -> Result<(), chorus_host::process::ProcessError> {
/// use chorus_host::process::{Supervisor, SupervisorConfig};
///
/// let supervisor = Supervisor::new(SupervisorConfig::new("host-a", "/var/log/chorus"));
/// let status = supervisor.run(&manifest, 1).await?;
/// println!("{} runs as pid {:?}", status.agent_id, status.pid);
/// supervisor.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: SupervisorConfig,
    /// The host's cgroup v2 setup, when it has a launcher and the machine allows it.
    cgroups: Option<CgroupHost>,
    slots: Mutex<HashMap<String, Slot>>,
    events: broadcast::Sender<ReplicaEvent>,
    tracker: TaskTracker,
    closing: AtomicBool,
    generations: AtomicU64,
}

/// A replica known to the supervisor.
#[derive(Debug)]
struct Slot {
    /// Which [`Supervisor::run`] of this agent id the slot belongs to: a task of an earlier
    /// one never writes into a later one's status.
    generation: u64,
    status: ReplicaStatus,
    control: Control,
}

/// How the supervisor reaches a replica's task.
#[derive(Debug, Clone)]
struct Control {
    stop: CancellationToken,
    restart: mpsc::Sender<String>,
    /// `true` once the task has ended.
    done: watch::Receiver<bool>,
}

impl Inner {
    fn slots(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn emit(&self, event: ReplicaEvent) {
        // No subscriber is not an error: the events are there for whoever listens.
        let _ = self.events.send(event);
    }
}

impl Supervisor {
    /// A supervisor with no replicas. With a launcher, it sets up cgroups v2 for its agents
    /// where the machine has them ([`limits`]), which may move the host into a leaf cgroup.
    pub fn new(config: SupervisorConfig) -> Supervisor {
        let cgroups = config
            .launcher
            .as_ref()
            .and_then(|_| CgroupHost::setup(Path::new("/"), std::process::id()));
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        Supervisor {
            inner: Arc::new(Inner {
                config,
                cgroups,
                slots: Mutex::new(HashMap::new()),
                events,
                tracker: TaskTracker::new(),
                closing: AtomicBool::new(false),
                generations: AtomicU64::new(0),
            }),
        }
    }

    /// The replicas' events from now on.
    pub fn events(&self) -> broadcast::Receiver<ReplicaEvent> {
        self.inner.events.subscribe()
    }

    /// Starts replica `replica` (from 1) of `manifest` as agent `manifest.replica_id(replica)`
    /// and supervises it from then on. Returns its status once its process runs.
    ///
    /// # Errors
    ///
    /// [`ProcessError::AlreadyRunning`] if that replica runs (or waits to restart);
    /// [`ProcessError::Spawn`] naming the command when its process cannot be started (not
    /// retried: a replica that never started has nothing to restart);
    /// [`ProcessError::Log`] when its log cannot be opened; [`ProcessError::InvalidReplica`]
    /// for replica 0; [`ProcessError::ShuttingDown`] after [`Supervisor::shutdown`].
    pub async fn run(
        &self,
        manifest: &Manifest,
        replica: u32,
    ) -> Result<ReplicaStatus, ProcessError> {
        if replica == 0 {
            return Err(ProcessError::InvalidReplica {
                deployment: manifest.id.clone(),
                replica,
            });
        }
        let agent_id = manifest.replica_id(replica);
        check_agent_id(&agent_id)?;
        let generation = self.inner.generations.fetch_add(1, Ordering::Relaxed);
        let stop = CancellationToken::new();
        let (restart_tx, restart_rx) = mpsc::channel(1);
        let (done_tx, done_rx) = watch::channel(false);
        {
            let mut slots = self.inner.slots();
            // Read under the lock `shutdown` sets it under: a replica is either refused here
            // or stopped there.
            if self.inner.closing.load(Ordering::SeqCst) {
                return Err(ProcessError::ShuttingDown);
            }
            if let Some(slot) = slots.get(&agent_id)
                && !slot.status.state.is_finished()
            {
                return Err(ProcessError::AlreadyRunning { agent_id });
            }
            slots.insert(
                agent_id.clone(),
                Slot {
                    generation,
                    status: ReplicaStatus::starting(manifest, replica),
                    control: Control {
                        stop: stop.clone(),
                        restart: restart_tx,
                        done: done_rx,
                    },
                },
            );
        }
        let handle = Handle {
            inner: Arc::clone(&self.inner),
            agent_id: agent_id.clone(),
            deployment: manifest.id.clone(),
            replica,
            generation,
        };
        let started = self.start(manifest, replica, handle, stop, restart_rx, done_tx);
        if started.is_err() {
            let mut slots = self.inner.slots();
            if slots
                .get(&agent_id)
                .is_some_and(|slot| slot.generation == generation)
            {
                slots.remove(&agent_id);
            }
        }
        started
    }

    /// The part of [`Supervisor::run`] after the replica's slot is taken.
    fn start(
        &self,
        manifest: &Manifest,
        replica: u32,
        handle: Handle,
        stop: CancellationToken,
        restart_rx: mpsc::Receiver<String>,
        done: watch::Sender<bool>,
    ) -> Result<ReplicaStatus, ProcessError> {
        let inner = &self.inner;
        let config = &inner.config;
        let agent_id = handle.agent_id.clone();
        let log =
            LogFile::open(&config.log_dir, &agent_id, config.log_limits).map_err(|source| {
                ProcessError::Log {
                    agent_id: agent_id.clone(),
                    source,
                }
            })?;
        let log = SharedLog::new(log);
        let mut env = agent_env(&config.host, &config.env, manifest, replica);
        let user = config.run_as.user().map(|u| (u.uid, u.gid));
        for (name, value) in config.run_as.env() {
            env.retain(|(k, _)| *k != name);
            env.push((name, value));
        }
        let (launch, enforcement, cgroup) = match &config.launcher {
            Some(launcher) => {
                let mut plan = plan_limits(inner.cgroups.as_ref(), &agent_id, &manifest.resources);
                plan.spec.user = user;
                if let Some(bwrap) = &config.sandbox {
                    plan.spec.sandbox = Some(bwrap.clone());
                    plan.spec.writable = manifest.run.working_dir.clone();
                }
                let launch = Launch::new(manifest, env.clone(), Some((launcher, &plan.spec)));
                (launch, plan.enforcement, plan.cgroup)
            }
            None => (
                Launch::new(manifest, env.clone(), None).run_by(user),
                Enforcement::None,
                None,
            ),
        };
        let probe = Probe::of(&manifest.health, &env, manifest.run.working_dir.clone())
            .map(|probe| probe.run_by(user));
        let tail = StderrTail::default();
        let running = match launch.spawn(&log, &tail, config.log_limits.line_bytes, &inner.tracker)
        {
            Ok(running) => running,
            Err(source) => {
                if let Some(cgroup) = &cgroup {
                    limits::remove_cgroup(cgroup);
                }
                log.write(
                    Stream::Host,
                    format!("cannot start {}: {source}", launch.command).as_bytes(),
                    false,
                );
                return Err(ProcessError::Spawn {
                    command: launch.command.clone(),
                    source,
                });
            }
        };
        handle.started(&running, &log);
        let status = handle
            .update(|status| status.limits = enforcement)
            .ok_or_else(|| {
                // Only `forget` removes a slot, and it leaves running ones alone.
                ProcessError::NotFound {
                    agent_id: agent_id.clone(),
                }
            })?;
        let task = ReplicaTask {
            handle,
            launch,
            probe,
            restart: manifest.restart.clone(),
            stop_grace: config.stop_grace,
            line_bytes: config.log_limits.line_bytes,
            log,
            tail,
            cgroup,
            stop,
            done,
        };
        inner.tracker.spawn(task.supervise(running, restart_rx));
        Ok(status)
    }

    /// Stops a replica: SIGTERM to its process group, [`SupervisorConfig::stop_grace`] to
    /// exit, then SIGKILL; waits for the exit; it is not restarted. A replica waiting to
    /// restart is not started again. Stopping a stopped or failed replica does nothing.
    ///
    /// # Errors
    ///
    /// [`ProcessError::NotFound`] for an unknown agent id; [`ProcessError::StopTimedOut`] if
    /// the process does not go even after SIGKILL.
    pub async fn stop(&self, agent_id: &str) -> Result<(), ProcessError> {
        let control = {
            let slots = self.inner.slots();
            let slot = slots.get(agent_id).ok_or_else(|| ProcessError::NotFound {
                agent_id: agent_id.to_owned(),
            })?;
            if slot.status.state.is_finished() {
                return Ok(());
            }
            slot.control.clone()
        };
        control.stop.cancel();
        let waited = self.inner.config.stop_grace + KILL_WAIT + STOP_MARGIN;
        let mut done = control.done;
        match tokio::time::timeout(waited, done.wait_for(|done| *done)).await {
            // An error is the task gone without a word: ended all the same.
            Ok(_) => Ok(()),
            Err(_) => Err(ProcessError::StopTimedOut {
                agent_id: agent_id.to_owned(),
                waited,
            }),
        }
    }

    /// Restarts a replica found unhealthy: stops its process (as [`Supervisor::stop`] does)
    /// and lets its restart policy take over as after a crash (counted in the crash window,
    /// after the backoff); `reason` becomes its `last_exit` and the failure's reason if it is
    /// given up. Returns once the restart is asked for; a replica not running at the moment
    /// (starting, or waiting to restart) is left as it is.
    ///
    /// # Errors
    ///
    /// [`ProcessError::NotFound`] for an unknown agent id, [`ProcessError::NotRunning`] for a
    /// stopped or failed one.
    pub async fn restart(&self, agent_id: &str, reason: &str) -> Result<(), ProcessError> {
        let slots = self.inner.slots();
        let slot = slots.get(agent_id).ok_or_else(|| ProcessError::NotFound {
            agent_id: agent_id.to_owned(),
        })?;
        match slot.status.state {
            ReplicaState::Running => {}
            ReplicaState::Starting | ReplicaState::BackingOff { .. } => return Ok(()),
            ReplicaState::Failed { .. } | ReplicaState::Stopped => {
                return Err(ProcessError::NotRunning {
                    agent_id: agent_id.to_owned(),
                });
            }
        }
        match slot.control.restart.try_send(reason.to_owned()) {
            // Full: a restart is asked for already.
            Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(ProcessError::NotRunning {
                agent_id: agent_id.to_owned(),
            }),
        }
    }

    /// Every replica known here (stopped and failed ones too, until [`Supervisor::forget`]),
    /// with the memory and CPU use of those running, read now.
    pub fn replicas(&self) -> Vec<ReplicaStatus> {
        let mut statuses: Vec<ReplicaStatus> = self
            .inner
            .slots()
            .values()
            .map(|slot| slot.status.clone())
            .collect();
        statuses.sort_by(|a, b| a.agent_id.cmp(&b.agent_id));
        for status in &mut statuses {
            if let Some(pid) = status.pid {
                (status.rss_bytes, status.cpu_seconds) = usage(pid);
            }
        }
        statuses
    }

    /// One replica's status, as [`Supervisor::replicas`] gives it.
    pub fn status(&self, agent_id: &str) -> Option<ReplicaStatus> {
        let mut status = self.inner.slots().get(agent_id)?.status.clone();
        if let Some(pid) = status.pid {
            (status.rss_bytes, status.cpu_seconds) = usage(pid);
        }
        Some(status)
    }

    /// Forgets a stopped or failed replica (its logs stay). Returns whether it was forgotten:
    /// a replica still running is not.
    pub fn forget(&self, agent_id: &str) -> bool {
        let mut slots = self.inner.slots();
        if slots
            .get(agent_id)
            .is_some_and(|slot| slot.status.state.is_finished())
        {
            slots.remove(agent_id);
            true
        } else {
            false
        }
    }

    /// The last `max_lines` lines of a replica's log, oldest first, across its rotated files;
    /// for a stopped replica too, while its files exist.
    ///
    /// # Errors
    ///
    /// [`ProcessError::NotFound`] when the agent has no log here;
    /// [`ProcessError::InvalidAgentId`] for a name that is not an agent id;
    /// [`ProcessError::Log`] when a file cannot be read.
    pub fn logs(&self, agent_id: &str, max_lines: usize) -> Result<Vec<String>, ProcessError> {
        check_agent_id(agent_id)?;
        let config = &self.inner.config;
        match logs::tail(
            &config.log_dir,
            agent_id,
            config.log_limits.files,
            max_lines,
        ) {
            Ok(Some(lines)) => Ok(lines),
            Ok(None) => Err(ProcessError::NotFound {
                agent_id: agent_id.to_owned(),
            }),
            Err(source) => Err(ProcessError::Log {
                agent_id: agent_id.to_owned(),
                source,
            }),
        }
    }

    /// Stops every replica (SIGTERM, grace, SIGKILL), starts nothing more, and waits for every
    /// task it started.
    pub async fn shutdown(&self) {
        let stops: Vec<CancellationToken> = {
            let slots = self.inner.slots();
            self.inner.closing.store(true, Ordering::SeqCst);
            slots
                .values()
                .map(|slot| slot.control.stop.clone())
                .collect()
        };
        for stop in stops {
            stop.cancel();
        }
        self.inner.tracker.close();
        self.inner.tracker.wait().await;
    }
}

/// A replica's task's way to its status and the events.
#[derive(Debug)]
struct Handle {
    inner: Arc<Inner>,
    agent_id: String,
    deployment: String,
    replica: u32,
    generation: u64,
}

impl Handle {
    /// Changes the replica's status (unless a later run owns the slot) and returns it.
    fn update(&self, change: impl FnOnce(&mut ReplicaStatus)) -> Option<ReplicaStatus> {
        let mut slots = self.inner.slots();
        let slot = slots
            .get_mut(&self.agent_id)
            .filter(|slot| slot.generation == self.generation)?;
        change(&mut slot.status);
        Some(slot.status.clone())
    }

    /// Records a started process: status, log line, event.
    fn started(&self, running: &Running, log: &SharedLog) {
        log.write(
            Stream::Host,
            format!("started pid {}", running.pid).as_bytes(),
            false,
        );
        self.update(|status| {
            status.pid = Some(running.pid);
            status.state = ReplicaState::Running;
            status.started = Some(running.started);
            status.healthy = None;
        });
        self.inner.emit(ReplicaEvent::Started {
            agent_id: self.agent_id.clone(),
            deployment: self.deployment.clone(),
            replica: self.replica,
            pid: running.pid,
        });
    }
}

/// How a replica's process ended, as the restart policy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Exit {
    /// It exited with this code.
    Code(i32),
    /// A signal ended it.
    Signal(i32),
    /// It was stopped for a restart (a failed health check); the reason.
    Unhealthy(String),
    /// It could not be started again; why.
    SpawnFailed(String),
    /// Its exit could not be learnt; why.
    Unknown(String),
    /// It was stopped by [`Supervisor::stop`] or the shutdown.
    Stopped,
}

/// What follows an exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    Restart,
    Stop,
    Fail,
}

/// The restart policy: `always` restarts every exit, `on-failure` all but a clean one
/// (exit code 0), `never` none (a clean exit is then `Stopped`, any other `Failed`).
fn decide(policy: RestartPolicy, exit: &Exit) -> Decision {
    let clean = matches!(exit, Exit::Code(0));
    match (exit, policy) {
        (Exit::Stopped, _) => Decision::Stop,
        (_, RestartPolicy::Always) => Decision::Restart,
        (_, RestartPolicy::OnFailure) if clean => Decision::Stop,
        (_, RestartPolicy::OnFailure) => Decision::Restart,
        (_, RestartPolicy::Never) if clean => Decision::Stop,
        (_, RestartPolicy::Never) => Decision::Fail,
    }
}

/// The limits of a replica started through the launcher.
#[derive(Debug)]
struct Plan {
    spec: LaunchSpec,
    enforcement: Enforcement,
    cgroup: Option<PathBuf>,
}

/// Chooses how a replica's limits are enforced: in a cgroup v2 of its own where the host has
/// the controller, else the memory limit as `RLIMIT_AS` (and the CPU limit not at all).
fn plan_limits(cgroups: Option<&CgroupHost>, agent_id: &str, resources: &Resources) -> Plan {
    let memory = resources.memory_mb.map(|mb| mb.saturating_mul(MIB));
    // Validated manifests have 0 < cpu <= 1024 cores; the cast saturates all the same.
    let cpu = resources
        .cpu
        .map(|cores| ((cores * 1000.0).round() as u64).max(1));
    let mut spec = LaunchSpec {
        parent_pid: Some(std::process::id()),
        ..LaunchSpec::default()
    };
    if memory.is_none() && cpu.is_none() {
        return Plan {
            spec,
            enforcement: Enforcement::None,
            cgroup: None,
        };
    }
    if let Some(host) = cgroups
        && ((memory.is_some() && host.memory) || (cpu.is_some() && host.cpu))
    {
        match host.prepare(agent_id, memory.is_some(), cpu.is_some()) {
            Ok((dir, enforcement)) => {
                spec.memory_bytes = memory.filter(|_| host.memory);
                spec.cpu_millis = cpu.filter(|_| host.cpu);
                spec.cgroup = Some(dir.clone());
                return Plan {
                    spec,
                    enforcement,
                    cgroup: Some(dir),
                };
            }
            Err(err) => {
                tracing::warn!(agent_id, error = %err, "cannot make the agent's cgroup; its memory limit falls back to RLIMIT_AS");
            }
        }
    }
    spec.memory_bytes = memory;
    Plan {
        spec,
        enforcement: if memory.is_some() {
            Enforcement::Rlimit { memory: true }
        } else {
            Enforcement::None
        },
        cgroup: None,
    }
}

/// The task that supervises one replica.
#[derive(Debug)]
struct ReplicaTask {
    handle: Handle,
    launch: Launch,
    probe: Option<Probe>,
    restart: Restart,
    stop_grace: Duration,
    line_bytes: usize,
    log: SharedLog,
    tail: StderrTail,
    cgroup: Option<PathBuf>,
    stop: CancellationToken,
    done: watch::Sender<bool>,
}

impl ReplicaTask {
    async fn supervise(self, first: Running, mut restart_rx: mpsc::Receiver<String>) {
        let mut backoff = Backoff::new(self.restart.initial_backoff, self.restart.max_backoff);
        let mut window = CrashWindow::new(self.restart.max_restarts, self.restart.window);
        let mut next: Result<Running, String> = Ok(first);
        let end = loop {
            let (exit, uptime) = match next {
                Ok(mut running) => self.watch(&mut running, &mut restart_rx).await,
                Err(why) => (Exit::SpawnFailed(why), Duration::ZERO),
            };
            let last = self.describe(&exit);
            self.handle.update(|status| {
                status.pid = None;
                status.last_exit = Some(last.clone());
            });
            match decide(self.restart.policy, &exit) {
                Decision::Stop => break ReplicaState::Stopped,
                Decision::Fail => break ReplicaState::Failed { reason: last },
                Decision::Restart => {}
            }
            if let Verdict::GiveUp { exits } = window.record(Instant::now()) {
                break ReplicaState::Failed {
                    reason: format!(
                        "crashed {exits} times within {}; last: {last}",
                        format_duration(window.window())
                    ),
                };
            }
            let delay = backoff.after_exit(uptime);
            let attempt = backoff.attempt();
            self.handle.update(|status| {
                status.state = ReplicaState::BackingOff {
                    attempt,
                    delay_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                };
                status.healthy = None;
            });
            self.handle.inner.emit(ReplicaEvent::Restarting {
                agent_id: self.handle.agent_id.clone(),
                attempt,
                delay,
            });
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.stop.cancelled() => break ReplicaState::Stopped,
            }
            // Asked while it was down: the restart under way answers them.
            while restart_rx.try_recv().is_ok() {}
            self.tail.clear();
            self.handle
                .update(|status| status.restarts = status.restarts.saturating_add(1));
            next = match self.launch.spawn(
                &self.log,
                &self.tail,
                self.line_bytes,
                &self.handle.inner.tracker,
            ) {
                Ok(running) => {
                    self.handle.started(&running, &self.log);
                    Ok(running)
                }
                Err(err) => {
                    let why = format!("cannot start {}: {err}", self.launch.command);
                    self.log.write(Stream::Host, why.as_bytes(), false);
                    Err(why)
                }
            };
        };
        if let Some(cgroup) = &self.cgroup {
            limits::remove_cgroup(cgroup);
        }
        let event = match &end {
            ReplicaState::Failed { reason } => {
                self.log
                    .write(Stream::Host, format!("failed: {reason}").as_bytes(), false);
                ReplicaEvent::Failed {
                    agent_id: self.handle.agent_id.clone(),
                    deployment: self.handle.deployment.clone(),
                    reason: reason.clone(),
                }
            }
            _ => ReplicaEvent::Stopped {
                agent_id: self.handle.agent_id.clone(),
            },
        };
        self.handle.update(|status| {
            status.state = end;
            status.pid = None;
            status.healthy = None;
        });
        self.handle.inner.emit(event);
        // Nobody waiting is fine: `stop` subscribes only when it is called.
        let _ = self.done.send(true);
    }

    /// Watches a running process until it exits, is stopped, or must be restarted (asked, or
    /// its health command failing); returns how it ended and how long it ran.
    async fn watch(
        &self,
        running: &mut Running,
        restart_rx: &mut mpsc::Receiver<String>,
    ) -> (Exit, Duration) {
        enum Cause {
            Exited(std::io::Result<std::process::ExitStatus>),
            Stop,
            Restart(String),
        }
        let pid = running.pid;
        let handle = &self.handle;
        let cause = {
            let health = async {
                match &self.probe {
                    Some(probe) => {
                        probe
                            .watch(pid, |healthy| {
                                handle.update(|status| status.healthy = Some(healthy));
                            })
                            .await
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                status = running.child.wait() => Cause::Exited(status),
                () = self.stop.cancelled() => Cause::Stop,
                Some(reason) = restart_rx.recv() => Cause::Restart(reason),
                reason = health => Cause::Restart(reason),
            }
        };
        let (status, exit) = match cause {
            Cause::Exited(Ok(status)) => (Some(status), None),
            Cause::Exited(Err(err)) => (
                None,
                Some(Exit::Unknown(format!("cannot wait for pid {pid}: {err}"))),
            ),
            Cause::Stop => (
                running.terminate(self.stop_grace, KILL_WAIT).await,
                Some(Exit::Stopped),
            ),
            Cause::Restart(reason) => {
                self.log.write(
                    Stream::Host,
                    format!("restarting: {reason}").as_bytes(),
                    false,
                );
                (
                    running.terminate(self.stop_grace, KILL_WAIT).await,
                    Some(Exit::Unhealthy(reason)),
                )
            }
        };
        running.finish().await;
        let uptime = running.since.elapsed();
        let exit = match (exit, &status) {
            (Some(exit), _) => exit,
            (None, Some(status)) => {
                use std::os::unix::process::ExitStatusExt;
                match (status.code(), status.signal()) {
                    (Some(code), _) => Exit::Code(code),
                    (None, Some(signal)) => Exit::Signal(signal),
                    (None, None) => Exit::Unknown(describe_exit(status)),
                }
            }
            (None, None) => Exit::Unknown(String::from("no exit status")),
        };
        match &status {
            Some(status) => {
                use std::os::unix::process::ExitStatusExt;
                self.log.write(
                    Stream::Host,
                    format!("exited: {}", describe_exit(status)).as_bytes(),
                    false,
                );
                self.handle.inner.emit(ReplicaEvent::Exited {
                    agent_id: self.handle.agent_id.clone(),
                    code: status.code(),
                    signal: status.signal(),
                });
            }
            None => {
                tracing::warn!(agent_id = %self.handle.agent_id, pid, "an agent process did not exit after SIGKILL; no longer waiting for it");
            }
        }
        (exit, uptime)
    }

    /// An exit for people: `exit code 3; stderr: boom`.
    fn describe(&self, exit: &Exit) -> String {
        let with_stderr = |what: String| match self.tail.last() {
            Some(line) => format!("{what}; stderr: {line}"),
            None => what,
        };
        match exit {
            Exit::Code(code) => with_stderr(format!("exit code {code}")),
            Exit::Signal(signal) => {
                with_stderr(match nix::sys::signal::Signal::try_from(*signal) {
                    Ok(name) => format!("signal {signal} ({name})"),
                    Err(_) => format!("signal {signal}"),
                })
            }
            Exit::Unhealthy(reason) | Exit::SpawnFailed(reason) | Exit::Unknown(reason) => {
                reason.clone()
            }
            Exit::Stopped => String::from("stopped"),
        }
    }
}

#[cfg(test)]
#[path = "supervisor_tests.rs"]
mod tests;
