//! What the CLI, the coordinator and the hosts say to each other about hosted agents: the
//! bodies of their commands and events (JSON), their names, and the buckets that hold the
//! desired state (deployments) and the hosts' reports (docs/HOSTING.md, "On the bus").
//!
//! - The coordinator keeps the **desired state**: one [`Deployment`] per manifest in the
//!   `<root>_deployments` bucket, with the host each replica is placed on. It answers
//!   the [`coordinator_commands`] as the agent [`COORDINATOR`].
//! - Each `chorus host` is an agent (`host-<name>`, in the [`HOSTS_GROUP`] group) that answers
//!   the commands of [`HostCommand`] on its own command subjects, writes a [`HostReport`] to
//!   the `<root>_hosts` bucket every report interval, and publishes [`DEPLOY_CONFIRM`] and
//!   [`DEPLOY_FAILURE`] events on the `hosting.*` topics.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::manifest::Manifest;
use crate::replica::ReplicaStatus;

/// Suffix of the bucket holding the desired state, one [`Deployment`] per key.
pub const DEPLOYMENTS_BUCKET: &str = "deployments";
/// Suffix of the bucket holding each host's latest [`HostReport`], one per host name.
pub const HOSTS_BUCKET: &str = "hosts";
/// The broadcast group every host's agent joins.
pub const HOSTS_GROUP: &str = "hosts";
/// A host's agent id is this prefix and its name.
pub use chorus_sdk::registry::HOST_AGENT_PREFIX;

/// The agent the hosting commands of the CLI go to: the coordinator (its id on the bus;
/// coordinators answer them in their queue group).
pub const COORDINATOR: &str = chorus_sdk::registry::COORDINATOR_ID;

/// The coordinator's hosting commands, by name (each on `<root>.agent.coordinator.<command>`).
pub mod coordinator_commands {
    /// A [`super::DeployRequest`]: deploy (or redeploy) a manifest; the answer is its
    /// [`super::DeploymentView`].
    pub const DEPLOY: &str = "deploy";
    /// A [`super::ScaleRequest`]; the answer is the [`super::DeploymentView`].
    pub const SCALE: &str = "scale";
    /// A [`super::TerminateRequest`]; the answer is the last [`super::DeploymentView`].
    pub const TERMINATE: &str = "terminate";
    /// Every deployment's [`super::DeploymentView`].
    pub const DEPLOYMENTS: &str = "deployments";
    /// The hosts, each with its last report and whether it is live, silent or gone.
    pub const HOSTS: &str = "hosts";
    /// A [`super::LogsRequest`], passed to the host that runs (or ran) the agent; the answer is
    /// its [`super::LogLines`].
    pub const LOGS: &str = "logs";
}

/// Topic of the event a host publishes when a replica it started is healthy
/// (Agentify's `deploy_confirm`): a [`DeployConfirm`].
pub const DEPLOY_CONFIRM: &str = "hosting.deploy_confirm";
/// Topic of the event a host (or the coordinator, when no host fits) publishes when a
/// replica cannot be run (Agentify's `deploy_failure`): a [`DeployFailure`].
pub const DEPLOY_FAILURE: &str = "hosting.deploy_failure";

/// The agent id of the host named `name`.
pub fn host_agent(name: &str) -> String {
    format!("{HOST_AGENT_PREFIX}{name}")
}

/// The commands a host answers, by name (each on `<root>.agent.host-<name>.<command>`).
pub mod host_commands {
    /// IAC's `create`: keep a manifest, start nothing ([`super::CreateRequest`]).
    pub const CREATE: &str = "create";
    /// IAC's `run`: start replicas of a kept manifest ([`super::RunRequest`]).
    pub const RUN: &str = "run";
    /// Agentify's `deploy`: keep a manifest and make the replicas of it running here exactly
    /// the given ones ([`super::HostDeploy`]); what the coordinator sends.
    pub const DEPLOY: &str = "deploy";
    /// Run replicas 1 to N of a kept deployment here, stop those above ([`super::HostScale`]).
    pub const SCALE: &str = "scale";
    /// IAC's `terminate`: stop a deployment's replicas, or one agent ([`super::HostTerminate`]).
    pub const TERMINATE: &str = "terminate";
    /// The host's [`super::HostReport`].
    pub const STATUS: &str = "status";
    /// The last lines of a hosted agent's output ([`super::LogsRequest`]).
    pub const LOGS: &str = "logs";
}

/// What a host can take, as it reports it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    /// Agents it runs at most.
    pub agents: u32,
    /// Memory it may give its agents, in MiB (0: not limited).
    #[serde(default)]
    pub memory_mb: u64,
    /// CPU cores it may give its agents (0: not limited).
    #[serde(default)]
    pub cpu: f64,
    /// GPUs it has for its agents (0: none; a manifest that asks for one is not placed here).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gpus: u32,
    /// The region it is in, if it says (a manifest's `placement.preferred_region`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A host's report, written to the hosts bucket every report interval and on every change.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostReport {
    /// The host's name.
    pub name: String,
    /// Its agent id (`host-<name>`).
    pub agent: String,
    /// This run of the host: changes when it restarts.
    pub instance: String,
    /// What it can take.
    pub capacity: Capacity,
    /// Its replicas that run in a process each, running or not (failed ones stay until
    /// terminated).
    pub replicas: Vec<ReplicaStatus>,
    /// Its shared deployments' processes, each serving several replicas.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared: Vec<SharedProcess>,
    /// When this report was written, ms since the epoch.
    pub updated_ms: u64,
    /// The interval between reports, in ms: the coordinator counts a host gone after three
    /// missed.
    pub report_ms: u64,
}

impl HostReport {
    /// Every replica the host runs, each with its deployment, number and the status of the
    /// process that runs it, without making its agent id: a report lists thousands of
    /// replicas and the coordinator reads every report each round, so this is the form to
    /// scan or index; [`ReportedReplica::agent`] makes the id of one.
    pub fn reported(&self) -> impl Iterator<Item = ReportedReplica<'_>> {
        let own = self.replicas.iter().map(|status| ReportedReplica {
            deployment: &status.deployment,
            replica: status.replica,
            status,
            healthy: status.healthy == Some(true),
        });
        let shared = self.shared.iter().flat_map(|group| {
            // Hosts write the healthy list sorted: looking each replica up in it is then a
            // binary search, not a scan of up to a thousand (once per replica).
            let sorted = group.healthy.is_sorted();
            group.replicas.iter().map(move |replica| ReportedReplica {
                deployment: &group.process.deployment,
                replica: *replica,
                status: &group.process,
                healthy: if sorted {
                    group.healthy.binary_search(replica).is_ok()
                } else {
                    group.healthy.contains(replica)
                },
            })
        });
        own.chain(shared)
    }

    /// Every replica the host runs, each with its agent id (made for each: prefer
    /// [`reported`](HostReport::reported) to scan, [`find`](HostReport::find) to look one up).
    pub fn agents(&self) -> impl Iterator<Item = HostedAgent<'_>> {
        self.reported().map(|r| HostedAgent {
            deployment: r.deployment,
            replica: r.replica,
            agent: r.agent(),
            status: r.status,
            healthy: r.healthy,
        })
    }

    /// The replica `agent` if this host reports it.
    pub fn find(&self, agent: &str) -> Option<HostedAgent<'_>> {
        let (deployment, replica) = crate::manifest::deployment_of(agent);
        self.reported()
            .find(|r| r.deployment == deployment && r.replica == replica)
            .map(|r| HostedAgent {
                deployment: r.deployment,
                replica: r.replica,
                agent: agent.to_owned(),
                status: r.status,
                healthy: r.healthy,
            })
    }
}

/// One replica a host reports, as [`HostReport::reported`] lists it.
#[derive(Debug, Clone, Copy)]
pub struct ReportedReplica<'a> {
    /// Its deployment.
    pub deployment: &'a str,
    /// Its number.
    pub replica: u32,
    /// The process that runs it.
    pub status: &'a ReplicaStatus,
    /// Whether it was found healthy since the process's last start.
    pub healthy: bool,
}

impl ReportedReplica<'_> {
    /// Its agent id.
    pub fn agent(&self) -> String {
        crate::manifest::replica_id(self.deployment, self.replica)
    }
}

/// One replica a host runs, as [`HostReport::agents`] lists it.
#[derive(Debug, Clone)]
pub struct HostedAgent<'a> {
    /// Its deployment.
    pub deployment: &'a str,
    /// Its number.
    pub replica: u32,
    /// Its agent id.
    pub agent: String,
    /// The process that runs it.
    pub status: &'a ReplicaStatus,
    /// Whether it was found healthy since the process's last start.
    pub healthy: bool,
}

/// The one process of a shared deployment (`run.shared`) on a host, and the replicas it serves.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SharedProcess {
    /// The process (its agent id and replica are its first replica's).
    pub process: ReplicaStatus,
    /// The replicas it serves.
    pub replicas: Vec<u32>,
    /// Those found healthy since the process's last start.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub healthy: Vec<u32>,
}

/// The desired state of one manifest, as the coordinator keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Deployment {
    /// The manifest (its `replicas` is the desired count).
    pub manifest: Manifest,
    /// Where each replica is placed: replica number to host name.
    #[serde(default)]
    pub placement: BTreeMap<u32, String>,
    /// Replicas that could not be placed or that their host gave up on, with the reason;
    /// they are not tried again until the deployment is deployed or scaled again.
    #[serde(default)]
    pub failed: BTreeMap<u32, String>,
    /// When it was last deployed or scaled, ms since the epoch.
    pub updated_ms: u64,
}

/// `chorus deploy`: deploy (or redeploy) a manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeployRequest {
    /// The manifest, validated again by the coordinator.
    pub manifest: Manifest,
}

/// `chorus scale`: the number of replicas a deployment should have.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScaleRequest {
    /// The deployment's id.
    pub deployment: String,
    /// Replicas wanted.
    pub replicas: u32,
}

/// `chorus terminate`: stop and forget a deployment.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TerminateRequest {
    /// The deployment's id.
    pub deployment: String,
}

/// The coordinator's answer to deploy and scale: where each replica goes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeploymentView {
    /// The deployment's id.
    pub deployment: String,
    /// Replicas wanted.
    pub replicas: u32,
    /// Each placed replica: its agent id and host.
    pub placed: Vec<PlacedReplica>,
    /// Replicas not running, with the reason.
    pub failed: BTreeMap<u32, String>,
}

/// A replica and where it is placed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedReplica {
    /// Replica number (1-based).
    pub replica: u32,
    /// Its agent id.
    pub agent: String,
    /// The host it is placed on.
    pub host: String,
    /// What that host last reported of it (none before it did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<crate::replica::ReplicaState>,
    /// Whether it was found healthy since its last start (its first heartbeat, a passing
    /// health command, or its start when the manifest checks nothing); what `chorus deploy`
    /// and `chorus scale` wait for.
    #[serde(default)]
    pub healthy: bool,
}

/// `create` on a host.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CreateRequest {
    /// The manifest to keep.
    pub manifest: Manifest,
}

/// `run` on a host.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRequest {
    /// A kept manifest's id.
    pub deployment: String,
    /// The replicas to start (default: 1 to the manifest's `replicas`).
    #[serde(default)]
    pub replicas: Option<Vec<u32>>,
}

/// `deploy` on a host: after it, exactly `replicas` of `manifest` run there.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostDeploy {
    /// The manifest.
    pub manifest: Manifest,
    /// The replicas that should run on this host.
    pub replicas: Vec<u32>,
}

/// `scale` on a host.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostScale {
    /// A kept manifest's id.
    pub deployment: String,
    /// Replicas 1 to this run here.
    pub replicas: u32,
}

/// `terminate` on a host: a whole deployment, or one agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostTerminate {
    /// A deployment's id, or one replica's agent id.
    pub target: String,
}

/// What a host did for create, run, deploy, scale and terminate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostChange {
    /// Agents started.
    pub started: Vec<String>,
    /// Agents stopped.
    pub stopped: Vec<String>,
    /// Agents that were already as asked.
    pub unchanged: Vec<String>,
}

/// `logs` on a host.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogsRequest {
    /// The hosted agent.
    pub agent: String,
    /// Lines wanted, from the end (bounded by the host).
    pub lines: usize,
}

/// The lines a host answers `logs` with, oldest first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogLines {
    /// The hosted agent.
    pub agent: String,
    /// The host.
    pub host: String,
    /// The lines.
    pub lines: Vec<String>,
}

/// Agentify's `deploy_confirm`: a replica is running and healthy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeployConfirm {
    /// The deployment's id.
    pub deployment: String,
    /// The replica's agent id.
    pub agent: String,
    /// Its replica number.
    pub replica: u32,
    /// The host running it.
    pub host: String,
    /// Its process id.
    pub pid: Option<u32>,
    /// How it was found healthy: `heartbeat`, `command` or `started` (no check).
    pub health: String,
}

/// Agentify's `deploy_failure`: a replica cannot run, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeployFailure {
    /// The deployment's id.
    pub deployment: String,
    /// The replica's agent id.
    pub agent: String,
    /// Its replica number.
    pub replica: u32,
    /// The host that gave up on it, or none when no host could take it.
    pub host: Option<String>,
    /// Why.
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::ReplicaState;

    fn shared(m: &Manifest, replicas: &[u32], healthy: &[u32]) -> SharedProcess {
        SharedProcess {
            process: ReplicaStatus {
                state: ReplicaState::Running,
                ..ReplicaStatus::starting(m, replicas[0])
            },
            replicas: replicas.to_vec(),
            healthy: healthy.to_vec(),
        }
    }

    #[test]
    fn a_report_lists_and_finds_its_replicas_with_their_health() {
        let calc = Manifest::new("calc", "calc");
        let w = Manifest::new("w", "chorus");
        let v = Manifest::new("v", "chorus");
        let report = HostReport {
            name: "a".into(),
            agent: host_agent("a"),
            instance: "i".into(),
            capacity: Capacity::default(),
            replicas: vec![ReplicaStatus {
                healthy: Some(true),
                ..ReplicaStatus::starting(&calc, 2)
            }],
            // Sorted as hosts write it, and not (as another writer might).
            shared: vec![
                shared(&w, &[1, 2, 3], &[1, 3]),
                shared(&v, &[1, 2, 3], &[3, 1]),
            ],
            updated_ms: 0,
            report_ms: 2_000,
        };
        let agents: Vec<(String, bool)> = report.agents().map(|a| (a.agent, a.healthy)).collect();
        let expected = [
            ("calc-2", true),
            ("w", true),
            ("w-2", false),
            ("w-3", true),
            ("v", true),
            ("v-2", false),
            ("v-3", true),
        ];
        assert_eq!(
            agents,
            expected
                .iter()
                .map(|(a, h)| ((*a).to_owned(), *h))
                .collect::<Vec<_>>()
        );
        let found = report.find("w-3").expect("w-3 runs there");
        assert_eq!(
            (found.deployment, found.replica, found.healthy),
            ("w", 3, true)
        );
        assert_eq!(
            found.status.agent_id, "w",
            "the process serving it, its first replica's"
        );
        assert!(report.find("calc-2").is_some_and(|a| a.healthy));
        assert!(report.find("calc").is_none());
        assert!(report.find("w-4").is_none());
    }
}
