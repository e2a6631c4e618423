//! A replica as its host reports it: what it is doing ([`ReplicaState`]), its process's
//! figures and which limits are enforced ([`ReplicaStatus`], JSON on the bus). The host's
//! supervisor makes these; the coordinator's reconciliation reads them.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::manifest::Manifest;

/// Which limits are enforced for a replica, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Enforcement {
    /// In a cgroup v2 of its own; each flag says whether that limit is set there.
    CgroupV2 {
        /// `memory.max` is set.
        memory: bool,
        /// `cpu.max` is set.
        cpu: bool,
    },
    /// By `setrlimit(RLIMIT_AS)` on the address space. CPU cannot be limited this way: a CPU
    /// limit asked for is not enforced.
    Rlimit {
        /// The memory limit is set.
        memory: bool,
    },
    /// No limit is enforced: none was asked for, or the replica was started without the
    /// launcher, or the machine allows neither mechanism.
    None,
}

/// What a replica is doing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ReplicaState {
    /// Being started.
    Starting,
    /// Its process runs.
    Running,
    /// Exited; waits `delay_ms` before start number `attempt` of a row of crashes.
    BackingOff {
        /// Consecutive crashes so far.
        attempt: u32,
        /// The wait, in milliseconds.
        delay_ms: u64,
    },
    /// Given up: it failed under policy `never`, or crash-looped.
    Failed {
        /// Why, with the last exit and stderr line.
        reason: String,
    },
    /// Stopped, by the supervisor's stop or by a clean exit its policy does not restart.
    Stopped,
}

impl ReplicaState {
    /// Stopped or failed: no process runs and none will be started.
    pub fn is_finished(&self) -> bool {
        matches!(self, ReplicaState::Stopped | ReplicaState::Failed { .. })
    }
}

/// A replica as its host sees it; JSON on the bus.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaStatus {
    /// Its agent id.
    pub agent_id: String,
    /// The deployment (manifest id) it belongs to.
    pub deployment: String,
    /// Its number, from 1.
    pub replica: u32,
    /// Its process, while one runs.
    pub pid: Option<u32>,
    /// What it is doing.
    pub state: ReplicaState,
    /// Times it was started again since the supervisor's start.
    pub restarts: u32,
    /// When its current (or last) process started; RFC 3339 in JSON.
    #[serde(default, with = "rfc3339")]
    pub started: Option<SystemTime>,
    /// Resident memory of its process, in bytes (from `/proc`; `None` elsewhere).
    pub rss_bytes: Option<u64>,
    /// CPU time its process used, user and system, in seconds (from `/proc`).
    pub cpu_seconds: Option<f64>,
    /// Which of its limits are enforced, and how.
    pub limits: Enforcement,
    /// How its last process ended (`exit code 3; stderr: boom`), or why it was restarted.
    pub last_exit: Option<String>,
    /// The last result of its health command; `None` before the first, and for health the
    /// host does not check itself (heartbeats are watched on the bus).
    pub healthy: Option<bool>,
}

impl ReplicaStatus {
    /// Replica `replica` of `manifest` about to start: nothing known of it yet.
    pub fn starting(manifest: &Manifest, replica: u32) -> ReplicaStatus {
        ReplicaStatus {
            agent_id: manifest.replica_id(replica),
            deployment: manifest.id.clone(),
            replica,
            pid: None,
            state: ReplicaState::Starting,
            restarts: 0,
            started: None,
            rss_bytes: None,
            cpu_seconds: None,
            limits: Enforcement::None,
            last_exit: None,
            healthy: None,
        }
    }
}

/// `Option<SystemTime>` as an RFC 3339 UTC string.
mod rfc3339 {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer};
    use time::OffsetDateTime;
    use time::format_description::well_known::Rfc3339;

    pub(super) fn serialize<S: Serializer>(
        value: &Option<SystemTime>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(time) => {
                let text = OffsetDateTime::from(*time)
                    .format(&Rfc3339)
                    .map_err(serde::ser::Error::custom)?;
                serializer.serialize_some(&text)
            }
            None => serializer.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<SystemTime>, D::Error> {
        Option::<String>::deserialize(deserializer)?
            .map(|text| {
                OffsetDateTime::parse(&text, &Rfc3339)
                    .map(SystemTime::from)
                    .map_err(serde::de::Error::custom)
            })
            .transpose()
    }
}
