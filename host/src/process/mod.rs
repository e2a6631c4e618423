//! What `chorus host` does with agent processes on its machine (docs/HOSTING.md, "Running
//! agents").
//!
//! A [`Supervisor`] starts each replica of a [`Manifest`](crate::manifest::Manifest) as a
//! process and keeps one task per replica that:
//!
//! 1. starts it in a process group of its own, with the replica's environment (the
//!    `CHORUS_*` variables below), stdin empty and stdout/stderr written to a rotated log
//!    ([`logs`]), through the launcher ([`launch`]) when the host has one, which applies the
//!    memory and CPU limits ([`limits`]) and ties the agent's life to the host's;
//! 2. runs its health command, when its manifest checks health by command;
//! 3. on exit, applies the restart policy: a restart after a bounded exponential backoff
//!    ([`Backoff`]), or `Stopped`, or `Failed` when it crash-loops ([`CrashWindow`]);
//! 4. on [`Supervisor::stop`], sends SIGTERM to its group, waits the grace, then SIGKILL.
//!
//! Every change is also a [`ReplicaEvent`], which the host service turns into bus events.

pub mod allow;
pub mod backoff;
mod child;
mod health;
pub mod launch;
pub mod limits;
pub mod logs;
mod supervisor;
pub mod user;

use std::time::Duration;

pub use allow::AllowedPrograms;
pub use backoff::{Backoff, CrashWindow, Verdict};
pub use chorus_hosting::replica::{ReplicaState, ReplicaStatus};
pub use launch::{HOST_EXEC, LaunchSpec, LaunchSpecError};
pub use limits::Enforcement;
pub use logs::{DEFAULT_LOG_FILE_BYTES, DEFAULT_LOG_FILES, DEFAULT_LOG_LINE_BYTES, LogLimits};
pub use supervisor::{ReplicaEvent, Supervisor, SupervisorConfig};
pub use user::{AgentUser, DEFAULT_AGENT_USER, RunAs, UserError};

/// The replica's agent id (`<deployment>` for replica 1, `<deployment>-<n>` after).
pub const ENV_AGENT_ID: &str = "CHORUS_AGENT_ID";
/// The agent ids one process of a shared deployment (`run.shared`) serves, comma-separated.
pub const ENV_AGENT_IDS: &str = "CHORUS_AGENT_IDS";
/// The deployment (manifest id) the replica belongs to.
pub const ENV_DEPLOYMENT: &str = "CHORUS_DEPLOYMENT";
/// The replica's number, from 1.
pub const ENV_REPLICA: &str = "CHORUS_REPLICA";
/// The id of the host that runs it.
pub const ENV_HOST: &str = "CHORUS_HOST";
/// The agent's nkey seed file, when its manifest names one (`credentials.nkey_file`).
pub const ENV_NKEY_FILE: &str = "CHORUS_NKEY_FILE";
/// The customer it runs for, when its manifest names one.
pub const ENV_CUSTOMER: &str = "CHORUS_CUSTOMER";
/// The agent's pid, given to its health command only.
pub const ENV_AGENT_PID: &str = "CHORUS_AGENT_PID";
/// Variables of the host's own environment an agent inherits; nothing else is: a host's
/// credentials (its own `CHORUS_NKEY_FILE`, say) must not become an agent's.
pub const INHERITED_ENV: &[&str] = &[
    "PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "TMPDIR",
];

/// Time a replica has to exit after SIGTERM before it gets SIGKILL, by default.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);
/// Time a process has to be gone after SIGKILL; past it the host stops waiting (a process in
/// uninterruptible sleep) and says so.
pub const KILL_WAIT: Duration = Duration::from_secs(5);

/// Why a supervisor call failed, told apart by kind.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessError {
    /// The replica runs already (or is starting, or waiting to restart).
    #[error("agent {agent_id} is already running")]
    AlreadyRunning {
        /// The replica's agent id.
        agent_id: String,
    },
    /// No replica of that id is known here.
    #[error("no agent {agent_id} on this host")]
    NotFound {
        /// The agent id asked for.
        agent_id: String,
    },
    /// The replica has stopped or failed: there is nothing to restart.
    #[error("agent {agent_id} is not running")]
    NotRunning {
        /// The replica's agent id.
        agent_id: String,
    },
    /// Not an agent id (one subject token): it would not name a log file safely.
    #[error("{agent_id:?} is not an agent id: {reason}")]
    InvalidAgentId {
        /// What was given.
        agent_id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Replica numbers count from 1.
    #[error("replica {replica} of {deployment}: replicas are numbered from 1")]
    InvalidReplica {
        /// The deployment.
        deployment: String,
        /// The number given.
        replica: u32,
    },
    /// The process could not be started (at its first start: later ones count as crashes).
    #[error("cannot start {command}: {source}")]
    Spawn {
        /// The command, as the manifest names it.
        command: String,
        /// The operating system's error (not found, permission denied, ...).
        #[source]
        source: std::io::Error,
    },
    /// The replica's log could not be opened or read.
    #[error("log of agent {agent_id}: {source}")]
    Log {
        /// The replica's agent id.
        agent_id: String,
        /// The file system's error.
        #[source]
        source: std::io::Error,
    },
    /// The replica did not exit within the grace and the SIGKILL wait.
    #[error("agent {agent_id} did not exit within {waited:?} of being stopped")]
    StopTimedOut {
        /// The replica's agent id.
        agent_id: String,
        /// How long it was waited for.
        waited: Duration,
    },
    /// The supervisor is shutting down and starts nothing more.
    #[error("the host is shutting down")]
    ShuttingDown,
}

/// Checks that `agent_id` is one subject token, so it is safe as a file and cgroup name.
fn check_agent_id(agent_id: &str) -> Result<(), ProcessError> {
    chorus_sdk::subject::validate_token("agent id", agent_id).map_err(|err| {
        ProcessError::InvalidAgentId {
            agent_id: agent_id.to_owned(),
            reason: err.to_string(),
        }
    })
}
