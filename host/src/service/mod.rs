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

mod commands;
mod converge;
mod report;

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

#[cfg(test)]
mod tests;
