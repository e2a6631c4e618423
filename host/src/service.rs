//! `chorus host` on the bus: an agent (`host-<name>`, in the `hosts` group) that takes
//! `create`, `run`, `deploy`, `scale`, `terminate`, `status` and `logs` commands from the
//! senders it allows, runs agent processes through its [`Supervisor`], watches their health
//! (their heartbeats, or the manifest's command), answers `deploy_confirm` or
//! `deploy_failure` events, and writes its [`HostReport`] to the hosts bucket every report
//! interval and on every change, so the coordinator can place and reconcile.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chorus_broker_adapter::Broker;
use chorus_broker_adapter::{Kv, KvSpec};
use chorus_sdk::subject::Subjects;
use chorus_sdk::{Agent, AgentOptions, Context, HandlerError, Report, SdkError, StatusCode};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::manifest::{HealthCheck, Manifest};
use crate::process::{ProcessError, ReplicaEvent, ReplicaState, Supervisor, SupervisorConfig};
use crate::protocol::{
    self as hosting, Capacity, CreateRequest, DeployConfirm, DeployFailure, HostChange, HostDeploy,
    HostReport, HostScale, HostTerminate, LogLines, LogsRequest, RunRequest, host_agent,
    host_commands,
};

/// How often a host writes its report (and the coordinator expects one).
pub const DEFAULT_REPORT_INTERVAL: Duration = Duration::from_secs(2);
/// Agents a host runs at most unless told otherwise.
pub const DEFAULT_MAX_AGENTS: u32 = 100;
/// How often a host looks at its agents' health.
pub const HEALTH_TICK: Duration = Duration::from_millis(500);
/// Lines `logs` answers with at most.
pub const MAX_LOG_LINES: usize = 10_000;
/// The permission a sender needs to command a host (granted to the ids in
/// [`HostOptions::allow`]).
pub const HOSTING_PERMISSION: &str = "hosting";
/// Heartbeats a hosted agent may miss before its host restarts it.
pub const MISSED_HEARTBEATS: u32 = 3;

/// How a host runs.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// The host's name (its agent id is `host-<name>`).
    pub name: String,
    /// What it can take.
    pub capacity: Capacity,
    /// How often it reports.
    pub report_interval: Duration,
    /// Replicas of the hosts bucket, if this host has to make it (1 on one server).
    pub bucket_replicas: usize,
    /// Where agents built from a repository are cloned and built (default: beside the
    /// supervisor's log folder, `<log_dir>.builds`).
    pub build_dir: Option<std::path::PathBuf>,
    /// The programs manifests may start here; any when empty. A manifest that names another
    /// is refused: its replicas are reported failed with the reason.
    pub allowed_programs: crate::process::AllowedPrograms,
}

impl HostOptions {
    /// A host named `name` with the defaults.
    pub fn new(name: impl Into<String>) -> HostOptions {
        HostOptions {
            name: name.into(),
            capacity: Capacity {
                agents: DEFAULT_MAX_AGENTS,
                memory_mb: 0,
                cpu: 0.0,
                ..Capacity::default()
            },
            report_interval: DEFAULT_REPORT_INTERVAL,
            bucket_replicas: 1,
            build_dir: None,
            allowed_programs: crate::process::AllowedPrograms::default(),
        }
    }
}

/// Why a host could not start.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The bus: connecting, the bucket, a subscription.
    #[error("host {name}: {what}")]
    Bus {
        /// The host.
        name: String,
        /// What failed.
        what: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// What the host watches of one replica's health since its last start.
#[derive(Debug, Clone)]
struct Watch {
    deployment: String,
    replica: u32,
    /// The supervised process that runs it: itself, or the one process of its shared
    /// deployment on this host.
    process: String,
    started: Instant,
    check: HealthCheck,
    grace: Duration,
    /// How long without a heartbeat counts as stopped: the manifest's health interval times
    /// its failures (at least three), or three of the intervals the agent's last heartbeat
    /// announced, whichever is longer (the bus may pace heartbeats slower than the manifest
    /// says: docs/COORDINATOR.md).
    silence: Duration,
    last_heartbeat: Option<Instant>,
    /// The interval the agent's last heartbeat announced.
    beat: Duration,
    confirmed: bool,
}

impl Watch {
    /// How long the agent may be silent before it is restarted.
    fn allowed_silence(&self) -> Duration {
        self.silence.max(self.beat * MISSED_HEARTBEATS)
    }
}

/// The heartbeat interval a heartbeat announces (its manifest's `heartbeat_ms`), if it reads.
fn announced_interval(heartbeat: &[u8]) -> Option<Duration> {
    #[derive(serde::Deserialize)]
    struct Interval {
        heartbeat_ms: u64,
    }
    let (env, _) = chorus_sdk::codec::decode(heartbeat).ok()?;
    let interval: Interval =
        chorus_sdk::codec::decode_payload(&env.payload, &env.content_type).ok()?;
    Some(Duration::from_millis(interval.heartbeat_ms))
}

/// How long a failed build is left failed: a deploy that comes later builds again (the
/// coordinator stops asking once the host reports the failure, so this bounds rebuilds to
/// what the operator asks for).
const BUILD_RETRY_AFTER: Duration = Duration::from_secs(30);

/// A deployment's build on this host (its manifest's `[build]`).
#[derive(Debug)]
struct Built {
    /// Which source ([`crate::build::key_of`]).
    key: String,
    state: BuildState,
    /// The replicas asked for while it builds, or when it failed: reported failed then.
    wanted: BTreeSet<u32>,
}

#[derive(Debug)]
enum BuildState {
    Building,
    Ready,
    Failed { reason: String, at: Instant },
}

/// The one process of a shared deployment on this host.
#[derive(Debug, Clone)]
struct Group {
    process: String,
    members: Vec<(String, u32)>,
}

/// What the host's tasks and handlers share.
struct State {
    name: String,
    agent_id: String,
    instance: String,
    capacity: Capacity,
    report_interval: Duration,
    supervisor: Supervisor,
    /// Manifests kept, by deployment id.
    manifests: Mutex<BTreeMap<String, Manifest>>,
    /// Replicas assigned to this host, by deployment: what it reports.
    assigned: Mutex<BTreeMap<String, BTreeSet<u32>>>,
    /// Shared with the tasks that hear each agent's heartbeats.
    watches: Arc<Mutex<HashMap<String, Watch>>>,
    /// The agents whose heartbeats the host hears, each with what ends its subscription.
    listening: Mutex<HashMap<String, CancellationToken>>,
    /// The host's connection and subjects, for those subscriptions.
    broker: Broker,
    subjects: Subjects,
    /// The host's tasks and what stops them (the [`Host`]'s own).
    tasks: TaskTracker,
    stop: CancellationToken,
    /// The processes of shared deployments (`run.shared`): per deployment, the process's agent
    /// id (its first replica's) and every agent it serves, with their replica numbers.
    groups: Mutex<HashMap<String, Group>>,
    hosts: Kv,
    changed: tokio::sync::Notify,
    /// Where builds go, one folder per deployment.
    build_dir: std::path::PathBuf,
    /// Builds, by deployment.
    builds: Arc<Mutex<HashMap<String, Built>>>,
    /// The programs manifests may start.
    allowed: crate::process::AllowedPrograms,
    /// Deployments this host refuses to run, each with why and the replicas asked for:
    /// reported failed.
    refused: Mutex<BTreeMap<String, (String, BTreeSet<u32>)>>,
    /// Who builds run as: the agents' user.
    run_as: crate::process::RunAs,
}

/// A running host. [`shutdown`](Host::shutdown) stops its agents and waits.
pub struct Host {
    agent: Agent,
    state: Arc<State>,
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("name", &self.state.name)
            .finish_non_exhaustive()
    }
}

/// A lock poisoned by a panicking holder is still used: every value behind the host's locks
/// stays valid between statements.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn invalid(reason: impl Into<String>) -> HandlerError {
    HandlerError::new(StatusCode::INVALID_ARGUMENT, reason)
}

fn process_error(err: ProcessError) -> HandlerError {
    HandlerError::new(StatusCode::HANDLER_FAILED, err.to_string())
}

impl Host {
    /// Connects the host's agent (`host-<name>`, in the `hosts` group, made by `configure`
    /// from those options: its servers and whatever security the caller wants, such as
    /// signing, verification and grants of [`HOSTING_PERMISSION`]), makes sure the hosts
    /// bucket exists, and serves the commands.
    ///
    /// # Errors
    /// [`HostError::Bus`] when NATS, the bucket or a subscription cannot be reached.
    pub async fn start(
        configure: impl FnOnce(AgentOptions) -> AgentOptions,
        options: HostOptions,
        supervisor: SupervisorConfig,
    ) -> Result<Host, HostError> {
        let name = options.name.clone();
        let bus = |what: &str| {
            let (name, what) = (name.clone(), what.to_owned());
            move |err: SdkError| HostError::Bus {
                name,
                what,
                source: Box::new(err),
            }
        };
        let agent_id = host_agent(&options.name);
        let agent = configure(AgentOptions::new(&agent_id).group(hosting::HOSTS_GROUP))
            .connect()
            .await
            .map_err(bus("cannot connect"))?;
        let mut spec = KvSpec::new(agent.subjects().bucket_name(hosting::HOSTS_BUCKET));
        spec.replicas = options.bucket_replicas;
        spec.description = "Chorus hosts: their latest reports".into();
        let hosts = agent
            .broker()
            .jetstream(chorus_sdk::JETSTREAM_TIMEOUT)
            .ensure_kv_exists(&spec)
            .await
            .map_err(|err| HostError::Bus {
                name: name.clone(),
                what: "cannot set up the hosts bucket".into(),
                source: Box::new(err),
            })?;
        let (tracker, stop) = (TaskTracker::new(), CancellationToken::new());
        let build_dir = options
            .build_dir
            .clone()
            .unwrap_or_else(|| supervisor.log_dir.with_extension("builds"));
        let run_as = supervisor.run_as.clone();
        let state = Arc::new(State {
            allowed: options.allowed_programs.clone(),
            refused: Mutex::default(),
            run_as,
            build_dir,
            builds: Arc::default(),
            name: options.name.clone(),
            agent_id,
            instance: uuid::Uuid::now_v7().simple().to_string(),
            capacity: options.capacity,
            report_interval: options.report_interval,
            supervisor: Supervisor::new(supervisor),
            manifests: Mutex::default(),
            assigned: Mutex::default(),
            watches: Arc::default(),
            listening: Mutex::default(),
            broker: agent.broker().clone(),
            subjects: agent.subjects().clone(),
            tasks: tracker.clone(),
            stop: stop.clone(),
            groups: Mutex::default(),
            hosts,
            changed: tokio::sync::Notify::new(),
        });
        let host = Host {
            agent,
            state,
            tracker,
            stop,
        };
        host.serve()
            .await
            .map_err(bus("cannot serve its commands"))?;
        host.spawn_tasks();
        host.state.report(&host.agent).await;
        tracing::info!(host = %host.state.name, "host started");
        Ok(host)
    }

    /// The host's name.
    pub fn name(&self) -> &str {
        &self.state.name
    }

    /// The supervisor running its agents.
    pub fn supervisor(&self) -> &Supervisor {
        &self.state.supervisor
    }

    /// Stops every hosted agent (each its stop grace), the host's tasks and its agent.
    pub async fn shutdown(self) {
        self.stop.cancel();
        self.tracker.close();
        self.state.supervisor.shutdown().await;
        self.tracker.wait().await;
        // The coordinator sees the host go at once rather than after the grace.
        if let Err(err) = self.state.hosts.delete(&self.state.name).await {
            tracing::debug!(error = %Report(&err), "host report not removed");
        }
        self.agent.shutdown().await;
    }

    async fn serve(&self) -> Result<(), SdkError> {
        let agent = &self.agent;
        macro_rules! command {
            ($name:expr, $req:ty, $f:ident) => {{
                let state = Arc::clone(&self.state);
                agent
                    .on_command($name, move |_ctx: Context, req: $req| {
                        let state = Arc::clone(&state);
                        async move {
                            let out = state.$f(req).await;
                            state.changed.notify_one();
                            out
                        }
                    })
                    .await?;
                agent.require($name, &[HOSTING_PERMISSION])?;
            }};
        }
        command!(host_commands::CREATE, CreateRequest, create);
        command!(host_commands::RUN, RunRequest, run);
        command!(host_commands::DEPLOY, HostDeploy, deploy);
        command!(host_commands::SCALE, HostScale, scale);
        command!(host_commands::TERMINATE, HostTerminate, terminate);
        command!(host_commands::LOGS, LogsRequest, logs);
        command!(host_commands::STATUS, serde_json::Value, status);
        Ok(())
    }

    fn spawn_tasks(&self) {
        // Supervisor events: new watches, failures published, reports refreshed.
        let (state, agent, stop) = (
            Arc::clone(&self.state),
            self.agent.clone(),
            self.stop.clone(),
        );
        let mut events = state.supervisor.events();
        self.tracker.spawn(async move {
            loop {
                let event = tokio::select! {
                    event = events.recv() => event,
                    _ = stop.cancelled() => break,
                };
                match event {
                    Ok(event) => state.on_event(&agent, event).await,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "host fell behind its supervisor's events");
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                }
            }
        });
        // Health.
        let (state, agent, stop) = (
            Arc::clone(&self.state),
            self.agent.clone(),
            self.stop.clone(),
        );
        self.tracker.spawn(async move {
            let mut tick = tokio::time::interval(HEALTH_TICK);
            loop {
                tokio::select! {
                    _ = tick.tick() => state.check_health(&agent).await,
                    _ = stop.cancelled() => break,
                }
            }
        });
        // Reports.
        let (state, agent, stop) = (
            Arc::clone(&self.state),
            self.agent.clone(),
            self.stop.clone(),
        );
        self.tracker.spawn(async move {
            let mut tick = tokio::time::interval(state.report_interval);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = state.changed.notified() => {}
                    _ = stop.cancelled() => break,
                }
                state.report(&agent).await;
            }
        });
    }
}

impl State {
    fn kept(&self, deployment: &str) -> Result<Manifest, HandlerError> {
        lock(&self.manifests)
            .get(deployment)
            .cloned()
            .ok_or_else(|| {
                invalid(format!(
                    "host {} keeps no manifest {deployment:?}",
                    self.name
                ))
            })
    }

    async fn create(&self, req: CreateRequest) -> Result<HostChange, HandlerError> {
        req.manifest
            .validate()
            .map_err(|e| invalid(e.to_string()))?;
        lock(&self.manifests).insert(req.manifest.id.clone(), req.manifest);
        Ok(HostChange::default())
    }

    async fn run(&self, req: RunRequest) -> Result<HostChange, HandlerError> {
        let manifest = self.kept(&req.deployment)?;
        let mut wanted: BTreeSet<u32> = lock(&self.assigned)
            .get(&manifest.id)
            .cloned()
            .unwrap_or_default();
        wanted.extend(
            req.replicas
                .unwrap_or_else(|| (1..=manifest.replicas).collect()),
        );
        self.converge(&manifest, wanted).await
    }

    async fn deploy(&self, req: HostDeploy) -> Result<HostChange, HandlerError> {
        req.manifest
            .validate()
            .map_err(|e| invalid(e.to_string()))?;
        let previous = lock(&self.manifests).insert(req.manifest.id.clone(), req.manifest.clone());
        let mut change = HostChange::default();
        // A new manifest (other than its replica count, which scaling changes): its replicas
        // here start again from it.
        if previous.is_some_and(|p| {
            Manifest {
                replicas: req.manifest.replicas,
                ..p
            } != req.manifest
        }) {
            let running: Vec<u32> = lock(&self.assigned)
                .remove(&req.manifest.id)
                .unwrap_or_default()
                .into_iter()
                .collect();
            lock(&self.groups).remove(&req.manifest.id);
            for replica in running {
                let agent = req.manifest.replica_id(replica);
                self.stop_agent(&agent).await?;
                change.stopped.push(agent);
            }
        }
        let next = self
            .converge(&req.manifest, req.replicas.into_iter().collect())
            .await?;
        change.started.extend(next.started);
        change.stopped.extend(next.stopped);
        change.unchanged.extend(next.unchanged);
        Ok(change)
    }

    async fn scale(&self, req: HostScale) -> Result<HostChange, HandlerError> {
        let mut manifest = self.kept(&req.deployment)?;
        manifest.replicas = req.replicas;
        manifest.validate().map_err(|e| invalid(e.to_string()))?;
        lock(&self.manifests).insert(manifest.id.clone(), manifest.clone());
        self.converge(&manifest, (1..=req.replicas).collect()).await
    }

    async fn terminate(&self, req: HostTerminate) -> Result<HostChange, HandlerError> {
        let mut change = HostChange::default();
        let kept = lock(&self.manifests).remove(&req.target);
        if let Some(manifest) = kept {
            lock(&self.groups).remove(&req.target);
            lock(&self.builds).remove(&req.target);
            let replicas = lock(&self.assigned).remove(&req.target).unwrap_or_default();
            for replica in replicas {
                let agent = manifest.replica_id(replica);
                self.stop_agent(&agent).await?;
                change.stopped.push(agent);
            }
            return Ok(change);
        }
        let (deployment, replica) = crate::manifest::deployment_of(&req.target);
        let shared = lock(&self.manifests)
            .get(deployment)
            .filter(|m| m.run.shared)
            .cloned();
        if let Some(manifest) = shared {
            // One agent of a shared process: the process starts again without it.
            let mut wanted = lock(&self.assigned)
                .get(deployment)
                .cloned()
                .unwrap_or_default();
            if !wanted.remove(&replica) {
                return Err(invalid(format!(
                    "host {} runs no agent {:?}",
                    self.name, req.target
                )));
            }
            return self.converge(&manifest, wanted).await;
        }
        let removed = lock(&self.assigned)
            .get_mut(deployment)
            .is_some_and(|set| set.remove(&replica));
        if !removed {
            return Err(invalid(format!(
                "host {} runs no deployment or agent {:?}",
                self.name, req.target
            )));
        }
        self.stop_agent(&req.target).await?;
        change.stopped.push(req.target);
        Ok(change)
    }

    async fn logs(&self, req: LogsRequest) -> Result<LogLines, HandlerError> {
        let lines = self
            .supervisor
            .logs(
                &self.process_of(&req.agent),
                req.lines.clamp(1, MAX_LOG_LINES),
            )
            .map_err(|e| invalid(e.to_string()))?;
        Ok(LogLines {
            agent: req.agent,
            host: self.name.clone(),
            lines,
        })
    }

    async fn status(&self, _: serde_json::Value) -> Result<HostReport, HandlerError> {
        Ok(self.report_now())
    }

    /// Makes the replicas of `manifest` assigned here exactly `wanted`: starts the missing,
    /// stops the others.
    async fn converge(
        &self,
        manifest: &Manifest,
        wanted: BTreeSet<u32>,
    ) -> Result<HostChange, HandlerError> {
        // A program this host does not run: refused, its replicas reported failed with why.
        if let Err(reason) = self.allowed.check(manifest) {
            if wanted.is_empty() {
                lock(&self.refused).remove(&manifest.id);
            } else {
                tracing::warn!(host = %self.name, deployment = %manifest.id, %reason, "manifest refused");
                lock(&self.refused).insert(manifest.id.clone(), (reason, wanted));
            }
            return Ok(HostChange::default());
        }
        lock(&self.refused).remove(&manifest.id);
        // Built from a repository: from its clone, once the build is done; until then the
        // replicas are not started (the coordinator asks again) and not reported.
        let in_clone;
        let manifest = match &manifest.build {
            Some(build) if !wanted.is_empty() => match self.built(manifest, build, &wanted) {
                Some(dir) => {
                    in_clone = crate::build::in_clone(manifest, &dir);
                    &in_clone
                }
                None => return Ok(HostChange::default()),
            },
            _ => manifest,
        };
        let have = lock(&self.assigned)
            .get(&manifest.id)
            .cloned()
            .unwrap_or_default();
        let placed = lock(&self.assigned)
            .values()
            .map(BTreeSet::len)
            .sum::<usize>();
        let adding = wanted.difference(&have).count();
        let limit = usize::try_from(self.capacity.agents).unwrap_or(usize::MAX);
        if placed - have.difference(&wanted).count() + adding > limit {
            return Err(HandlerError::new(
                StatusCode::UNAVAILABLE,
                format!(
                    "host {} is full: {placed} of {} agents, {adding} more asked",
                    self.name, self.capacity.agents
                ),
            ));
        }
        if manifest.run.shared {
            return self.converge_shared(manifest, have, wanted).await;
        }
        let mut change = HostChange::default();
        for replica in have.difference(&wanted) {
            let agent = manifest.replica_id(*replica);
            self.stop_agent(&agent).await?;
            change.stopped.push(agent);
        }
        let mut assigned: BTreeSet<u32> = have.intersection(&wanted).copied().collect();
        change
            .unchanged
            .extend(assigned.iter().map(|r| manifest.replica_id(*r)));
        let starting: Vec<String> = wanted
            .difference(&have)
            .map(|r| manifest.replica_id(*r))
            .collect();
        self.listen(&starting).await?;
        let mut failure = None;
        for replica in wanted.difference(&have) {
            match self.supervisor.run(manifest, *replica).await {
                Ok(_) | Err(ProcessError::AlreadyRunning { .. }) => {
                    assigned.insert(*replica);
                    change.started.push(manifest.replica_id(*replica));
                }
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            }
        }
        lock(&self.assigned).insert(manifest.id.clone(), assigned);
        match failure {
            Some(err) => Err(process_error(err)),
            None => Ok(change),
        }
    }

    /// The clone `manifest` runs from once its build is done; `None` while it builds (started
    /// here if it is not yet), or when it failed (reported so, built again when asked
    /// [`BUILD_RETRY_AFTER`] after).
    fn built(
        &self,
        manifest: &Manifest,
        build: &crate::manifest::Build,
        wanted: &BTreeSet<u32>,
    ) -> Option<std::path::PathBuf> {
        let key = crate::build::key_of(build);
        let (dir, log) = crate::build::folder_of(&self.build_dir, manifest, build);
        let mut builds = lock(&self.builds);
        if let Some(b) = builds.get_mut(&manifest.id).filter(|b| b.key == key) {
            b.wanted.clone_from(wanted);
            match &b.state {
                BuildState::Ready => return Some(dir),
                BuildState::Building => return None,
                BuildState::Failed { at, .. } if at.elapsed() < BUILD_RETRY_AFTER => return None,
                BuildState::Failed { .. } => {}
            }
        }
        builds.insert(
            manifest.id.clone(),
            Built {
                key: key.clone(),
                state: BuildState::Building,
                wanted: wanted.clone(),
            },
        );
        drop(builds);
        tracing::info!(host = %self.name, deployment = %manifest.id, repository = %build.repository, "building");
        let (builds, spec, id, stop, run_as) = (
            Arc::clone(&self.builds),
            build.clone(),
            manifest.id.clone(),
            self.stop.clone(),
            self.run_as.clone(),
        );
        self.tasks.spawn(async move {
            let outcome = tokio::select! {
                outcome = crate::build::run(&spec, &dir, &log, &run_as) => outcome,
                () = stop.cancelled() => return,
            };
            match &outcome {
                Ok(()) => tracing::info!(deployment = %id, "built"),
                Err(reason) => tracing::warn!(deployment = %id, %reason, "build failed"),
            }
            if let Some(b) = lock(&builds).get_mut(&id).filter(|b| b.key == key) {
                b.state = match outcome {
                    Ok(()) => BuildState::Ready,
                    Err(reason) => BuildState::Failed {
                        reason,
                        at: Instant::now(),
                    },
                };
            }
        });
        None
    }

    /// A shared deployment: one process serves every replica placed here, started again with
    /// the new list of agents when it changes.
    async fn converge_shared(
        &self,
        manifest: &Manifest,
        have: BTreeSet<u32>,
        wanted: BTreeSet<u32>,
    ) -> Result<HostChange, HandlerError> {
        let mut change = HostChange::default();
        let running = lock(&self.groups).get(&manifest.id).cloned();
        if have == wanted && running.is_some() {
            change
                .unchanged
                .extend(wanted.iter().map(|r| manifest.replica_id(*r)));
            return Ok(change);
        }
        let previous = lock(&self.groups).remove(&manifest.id);
        if let Some(group) = previous {
            for (agent, replica) in &group.members {
                lock(&self.watches).remove(agent);
                if !wanted.contains(replica) {
                    self.unlisten(agent);
                }
            }
            self.stop_agent(&group.process).await?;
            change
                .stopped
                .extend(group.members.into_iter().map(|(agent, _)| agent));
        }
        lock(&self.assigned).insert(manifest.id.clone(), wanted.clone());
        let Some(first) = wanted.first().copied() else {
            return Ok(change);
        };
        let members: Vec<(String, u32)> = wanted
            .iter()
            .map(|r| (manifest.replica_id(*r), *r))
            .collect();
        let mut process = manifest.clone();
        process.run.env.insert(
            crate::process::ENV_AGENT_IDS.to_owned(),
            members
                .iter()
                .map(|(agent, _)| agent.as_str())
                .collect::<Vec<_>>()
                .join(","),
        );
        // Heard from before the process starts, so no first heartbeat is missed.
        let ids: Vec<String> = members.iter().map(|(agent, _)| agent.clone()).collect();
        if let Err(err) = self.listen(&ids).await {
            lock(&self.assigned).remove(&manifest.id);
            return Err(err);
        }
        // Known before the process starts, so its start event finds its agents.
        lock(&self.groups).insert(
            manifest.id.clone(),
            Group {
                process: manifest.replica_id(first),
                members: members.clone(),
            },
        );
        if let Err(err) = self.supervisor.run(&process, first).await {
            lock(&self.groups).remove(&manifest.id);
            lock(&self.assigned).remove(&manifest.id);
            return Err(process_error(err));
        }
        change
            .started
            .extend(members.into_iter().map(|(agent, _)| agent));
        Ok(change)
    }

    /// The supervised process that runs `agent`: its shared deployment's, or its own.
    fn process_of(&self, agent: &str) -> String {
        let (deployment, _) = crate::manifest::deployment_of(agent);
        lock(&self.groups)
            .get(deployment)
            .filter(|g| g.members.iter().any(|(a, _)| a == agent))
            .map_or_else(|| agent.to_owned(), |g| g.process.clone())
    }

    /// Hears the heartbeats of `agents` (those not heard yet), each on a subscription to its
    /// own heartbeat subject: the server then sends this host only its own agents'
    /// heartbeats. (A subscription to every heartbeat, `sys.hb.*`, had every host decode
    /// every agent's: work that grew as the agents times the hosts, and, with ten hosts,
    /// took more CPU than the coordinator and the server together.) The subject names the
    /// agent; on a bus with credentials, only the agent may publish on it.
    async fn listen(&self, agents: &[String]) -> Result<(), HandlerError> {
        for agent in agents {
            let token = {
                let mut listening = lock(&self.listening);
                if listening.contains_key(agent) {
                    continue;
                }
                let token = self.stop.child_token();
                listening.insert(agent.clone(), token.clone());
                token
            };
            let subscribed = match self.subjects.heartbeat(agent) {
                Ok(subject) => self.broker.subscribe(&subject).await.map_err(|err| {
                    HandlerError::new(
                        StatusCode::UNAVAILABLE,
                        format!(
                            "host {}: cannot hear {agent}'s heartbeats: {}",
                            self.name,
                            Report(&err)
                        ),
                    )
                }),
                Err(err) => Err(invalid(err.to_string())),
            };
            let mut sub = match subscribed {
                Ok(sub) => sub,
                Err(err) => {
                    lock(&self.listening).remove(agent);
                    return Err(err);
                }
            };
            let (watches, agent) = (Arc::clone(&self.watches), agent.clone());
            self.tasks.spawn(async move {
                while let Some(msg) = sub.next_until(token.cancelled()).await {
                    let beat = announced_interval(msg.payload());
                    if let Some(watch) = lock(&watches).get_mut(&agent) {
                        watch.last_heartbeat = Some(Instant::now());
                        watch.beat = beat.unwrap_or(watch.beat);
                    }
                }
            });
        }
        Ok(())
    }

    /// No longer hears `agent`'s heartbeats.
    fn unlisten(&self, agent: &str) {
        if let Some(token) = lock(&self.listening).remove(agent) {
            token.cancel();
        }
    }

    async fn stop_agent(&self, agent: &str) -> Result<(), HandlerError> {
        lock(&self.watches).remove(agent);
        self.unlisten(agent);
        match self.supervisor.stop(agent).await {
            Ok(()) | Err(ProcessError::NotFound { .. }) => Ok(()),
            Err(err) => Err(process_error(err)),
        }
    }

    fn report_now(&self) -> HostReport {
        let assigned = lock(&self.assigned).clone();
        let groups = lock(&self.groups).clone();
        // Found healthy since their last start: what `deploy_confirm` said.
        let confirmed: BTreeSet<String> = lock(&self.watches)
            .iter()
            .filter(|(_, w)| w.confirmed)
            .map(|(agent, _)| agent.clone())
            .collect();
        let mut replicas = Vec::new();
        let mut shared = Vec::new();
        for mut status in self.supervisor.replicas() {
            match groups.get(&status.deployment) {
                Some(group) if group.process == status.agent_id => {
                    shared.push(crate::protocol::SharedProcess {
                        replicas: group.members.iter().map(|(_, r)| *r).collect(),
                        healthy: group
                            .members
                            .iter()
                            .filter(|(agent, _)| confirmed.contains(agent))
                            .map(|(_, r)| *r)
                            .collect(),
                        process: status,
                    });
                }
                Some(_) => {}
                None => {
                    if assigned
                        .get(&status.deployment)
                        .is_some_and(|set| set.contains(&status.replica))
                    {
                        status.healthy = Some(confirmed.contains(&status.agent_id));
                        replicas.push(status);
                    }
                }
            }
        }
        // Replicas whose build failed, or whose program this host refuses: failed, with the
        // reason, for the coordinator to record.
        let mut failed: Vec<(String, String, BTreeSet<u32>)> = lock(&self.builds)
            .iter()
            .filter_map(|(deployment, built)| match &built.state {
                BuildState::Failed { reason, .. } => Some((
                    deployment.clone(),
                    format!("build failed: {reason}"),
                    built.wanted.clone(),
                )),
                _ => None,
            })
            .collect();
        failed.extend(
            lock(&self.refused)
                .iter()
                .map(|(deployment, (reason, wanted))| {
                    (deployment.clone(), reason.clone(), wanted.clone())
                }),
        );
        for (deployment, reason, wanted) in &failed {
            for replica in wanted {
                replicas.push(crate::process::ReplicaStatus {
                    agent_id: crate::manifest::replica_id(deployment, *replica),
                    deployment: deployment.clone(),
                    replica: *replica,
                    pid: None,
                    state: ReplicaState::Failed {
                        reason: reason.clone(),
                    },
                    restarts: 0,
                    started: None,
                    rss_bytes: None,
                    cpu_seconds: None,
                    limits: crate::process::Enforcement::None,
                    last_exit: None,
                    healthy: None,
                });
            }
        }
        HostReport {
            name: self.name.clone(),
            agent: self.agent_id.clone(),
            instance: self.instance.clone(),
            capacity: self.capacity.clone(),
            replicas,
            shared,
            updated_ms: now_ms(),
            report_ms: u64::try_from(self.report_interval.as_millis()).unwrap_or(u64::MAX),
        }
    }

    async fn report(&self, _agent: &Agent) {
        let report = self.report_now();
        match serde_json::to_vec(&report) {
            Ok(body) => {
                if let Err(err) = self.hosts.put(&self.name, Bytes::from(body)).await {
                    tracing::warn!(error = %Report(&err), "host report not written");
                }
            }
            Err(err) => tracing::warn!(error = %err, "host report does not encode"),
        }
    }

    async fn on_event(&self, agent: &Agent, event: ReplicaEvent) {
        match event {
            ReplicaEvent::Started {
                agent_id,
                deployment,
                replica,
                pid,
            } => {
                let Some(manifest) = lock(&self.manifests).get(&deployment).cloned() else {
                    return;
                };
                let health = &manifest.health;
                let watch = Watch {
                    deployment: deployment.clone(),
                    replica,
                    process: agent_id.clone(),
                    started: Instant::now(),
                    check: health.check,
                    grace: health.start_grace,
                    silence: health.interval * health.failures.max(MISSED_HEARTBEATS),
                    last_heartbeat: None,
                    beat: Duration::ZERO,
                    confirmed: false,
                };
                let confirm_now = health.check == HealthCheck::None;
                // The agents this process serves: itself, or its shared deployment's.
                let members = lock(&self.groups)
                    .get(&deployment)
                    .filter(|g| g.process == agent_id)
                    .map_or_else(|| vec![(agent_id.clone(), replica)], |g| g.members.clone());
                for (member, replica) in &members {
                    let one = Watch {
                        replica: *replica,
                        ..watch.clone()
                    };
                    lock(&self.watches).insert(member.clone(), one);
                }
                if confirm_now {
                    for (member, _) in &members {
                        self.confirm(agent, member, Some(pid), "started").await;
                    }
                }
            }
            ReplicaEvent::Failed {
                agent_id,
                deployment,
                reason,
            } => {
                let members = lock(&self.groups)
                    .get(&deployment)
                    .filter(|g| g.process == agent_id)
                    .map_or_else(
                        || {
                            vec![(
                                agent_id.clone(),
                                crate::manifest::deployment_of(&agent_id).1,
                            )]
                        },
                        |g| g.members.clone(),
                    );
                for (member, replica) in members {
                    lock(&self.watches).remove(&member);
                    let failure = DeployFailure {
                        deployment: deployment.clone(),
                        agent: member,
                        replica,
                        host: Some(self.name.clone()),
                        reason: reason.clone(),
                    };
                    if let Err(err) = agent.publish(hosting::DEPLOY_FAILURE, &failure).await {
                        tracing::debug!(error = %Report(&err), "deploy_failure not published");
                    }
                }
            }
            _ => {}
        }
        self.changed.notify_one();
    }

    async fn confirm(&self, agent: &Agent, agent_id: &str, pid: Option<u32>, health: &str) {
        let (deployment, replica) = {
            let mut watches = lock(&self.watches);
            let Some(watch) = watches.get_mut(agent_id) else {
                return;
            };
            watch.confirmed = true;
            (watch.deployment.clone(), watch.replica)
        };
        let confirm = DeployConfirm {
            deployment,
            agent: agent_id.to_owned(),
            replica,
            host: self.name.clone(),
            pid,
            health: health.to_owned(),
        };
        tracing::info!(agent = agent_id, health, "hosted agent healthy");
        if let Err(err) = agent.publish(hosting::DEPLOY_CONFIRM, &confirm).await {
            tracing::debug!(error = %Report(&err), "deploy_confirm not published");
        }
    }

    /// Confirms replicas found healthy, restarts those that never became healthy within their
    /// grace or whose heartbeats stopped.
    async fn check_health(&self, agent: &Agent) {
        let statuses: HashMap<String, (Option<u32>, Option<bool>, bool)> = self
            .supervisor
            .replicas()
            .into_iter()
            .map(|r| {
                let running = matches!(r.state, ReplicaState::Running);
                (r.agent_id, (r.pid, r.healthy, running))
            })
            .collect();
        let now = Instant::now();
        let mut confirm = Vec::new();
        let mut restart = Vec::new();
        for (id, watch) in lock(&self.watches).iter() {
            let Some((pid, healthy, running)) = statuses.get(&watch.process).copied() else {
                continue;
            };
            if !running {
                continue;
            }
            let seen = watch.last_heartbeat.is_some_and(|t| t >= watch.started);
            match (watch.check, watch.confirmed) {
                (HealthCheck::Heartbeat, false) if seen => {
                    confirm.push((id.clone(), pid, "heartbeat"))
                }
                (HealthCheck::Command, false) if healthy == Some(true) => {
                    confirm.push((id.clone(), pid, "command"));
                }
                (HealthCheck::Heartbeat, false) if now - watch.started > watch.grace => {
                    restart.push((
                        watch.process.clone(),
                        format!("{id}: no heartbeat within {:?} of its start", watch.grace),
                    ));
                }
                (HealthCheck::Heartbeat, true)
                    if watch
                        .last_heartbeat
                        .is_some_and(|t| now - t > watch.allowed_silence()) =>
                {
                    restart.push((
                        watch.process.clone(),
                        format!("{id}: no heartbeat for {:?}", watch.allowed_silence()),
                    ));
                }
                _ => {}
            }
        }
        for (id, pid, how) in confirm {
            self.confirm(agent, &id, pid, how).await;
        }
        restart.sort();
        restart.dedup_by(|a, b| a.0 == b.0);
        for (id, reason) in restart {
            // Every agent of the process is watched again from its next start.
            lock(&self.watches).retain(|_, w| w.process != id);
            tracing::warn!(agent = %id, %reason, "hosted agent unhealthy: restarting it");
            if let Err(err) = self.supervisor.restart(&id, &reason).await {
                tracing::debug!(agent = %id, error = %err, "restart not done");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_sdk::codec::{self, Encoding};
    use chorus_sdk::envelope::CONTENT_TYPE_MSGPACK;
    use chorus_sdk::{Envelope, Kind, Performative};

    fn heartbeat(heartbeat_ms: u64, encoding: Encoding) -> Vec<u8> {
        let manifest: chorus_sdk::registry::Manifest = serde_json::from_value(serde_json::json!({
            "agent": "a1", "instance": "0", "heartbeat_ms": heartbeat_ms, "started_ms": 0,
        }))
        .expect("manifest");
        let mut env = Envelope::new(Kind::Heartbeat, Performative::Health, "a1");
        env.payload = codec::encode_payload(&manifest, CONTENT_TYPE_MSGPACK).expect("payload");
        codec::encode(&env, encoding).expect("encode").to_vec()
    }

    #[test]
    fn a_paced_agent_is_allowed_three_of_the_intervals_its_heartbeats_announce() {
        for encoding in [Encoding::MsgPack, Encoding::Compact, Encoding::Json] {
            assert_eq!(
                announced_interval(&heartbeat(50_000, encoding)),
                Some(Duration::from_secs(50)),
                "{encoding:?}"
            );
        }
        assert_eq!(announced_interval(b"not an envelope"), None);
        let mut watch = Watch {
            deployment: "d".into(),
            replica: 0,
            process: "d".into(),
            started: Instant::now(),
            check: HealthCheck::Heartbeat,
            grace: Duration::from_secs(30),
            silence: Duration::from_secs(30),
            last_heartbeat: None,
            beat: Duration::ZERO,
            confirmed: true,
        };
        // Before a heartbeat says otherwise, and while the agent beats faster than the
        // manifest's health interval: the manifest's silence.
        assert_eq!(watch.allowed_silence(), Duration::from_secs(30));
        watch.beat = Duration::from_secs(5);
        assert_eq!(watch.allowed_silence(), Duration::from_secs(30));
        // Paced by the bus to one beat in 50 s: three of those.
        watch.beat = Duration::from_secs(50);
        assert_eq!(watch.allowed_silence(), Duration::from_secs(150));
    }
}
