//! The coordinator's reconciliation, as a pure step: from the desired state (the deployments)
//! and the hosts' latest reports, what to change. The coordinator reads both buckets, calls
//! [`plan`], writes the deployments it changed, sends each host the commands for it and
//! publishes the failures; the decision is tested here without a bus.
//!
//! A replica waits unplaced while no host is live at all (a deployment made before the first
//! host starts is placed when it reports); it fails, with the reason, when hosts are live and
//! none can take it.
//!
//! A host is **live** while its last report is at most three report intervals old, **gone**
//! once it is older than the grace period (its replicas are placed elsewhere), and in between
//! left alone (its replicas stay placed on it, nothing is sent to it): a host that restarts
//! within the grace gets its agents back, one that does not has them moved.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::manifest::Manifest;
use crate::placement::{Candidate, Usage, place};
use crate::protocol::{DeployFailure, Deployment, HostReport};
use crate::replica::ReplicaState;

/// Missed reports after which a host is no longer live (nothing new is placed on it and
/// nothing sent to it).
pub const MISSED_REPORTS: u64 = 3;

/// What one reconciliation changes.
#[derive(Debug, Default)]
pub struct Plan {
    /// Deployments whose placement or failures changed: write them back.
    pub changed: BTreeMap<String, Deployment>,
    /// What to tell each host.
    pub commands: Vec<HostCommand>,
    /// Replicas no host can take, or that their host gave up on, newly so.
    pub failures: Vec<DeployFailure>,
    /// Replicas moved off a gone host: (agent, from host, to host).
    pub moved: Vec<(String, String, String)>,
}

/// A command for one host.
#[derive(Debug, Clone, PartialEq)]
pub enum HostCommand {
    /// Run exactly these replicas of the manifest there.
    Deploy {
        /// The host's name.
        host: String,
        /// The manifest.
        manifest: Box<Manifest>,
        /// Its replicas placed there.
        replicas: Vec<u32>,
    },
    /// Stop every replica of a deployment there (it was terminated, or moved away).
    Terminate {
        /// The host's name.
        host: String,
        /// The deployment's id.
        deployment: String,
    },
}

impl HostCommand {
    /// The deployment it is about.
    pub fn deployment(&self) -> &str {
        match self {
            HostCommand::Deploy { manifest, .. } => &manifest.id,
            HostCommand::Terminate { deployment, .. } => deployment,
        }
    }
}

/// How a host's report reads at `now_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Reporting.
    Live,
    /// Silent, within the grace period.
    Silent,
    /// Silent for longer than the grace period.
    Gone,
}

/// Whether `report` is live, silent or gone at `now_ms`, given the grace period.
pub fn liveness(report: &HostReport, now_ms: u64, grace: Duration) -> Liveness {
    let age = now_ms.saturating_sub(report.updated_ms);
    let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
    if age > grace_ms.max(report.report_ms * MISSED_REPORTS) {
        Liveness::Gone
    } else if age > report.report_ms * MISSED_REPORTS {
        Liveness::Silent
    } else {
        Liveness::Live
    }
}

/// Decides what to change so that every deployment's replicas are placed on live hosts and
/// every live host runs exactly what is placed on it.
pub fn plan<H: Borrow<HostReport>>(
    deployments: &BTreeMap<String, Deployment>,
    hosts: &[H],
    now_ms: u64,
    grace: Duration,
) -> Plan {
    let hosts: Vec<&HostReport> = hosts.iter().map(Borrow::borrow).collect();
    let state: BTreeMap<&str, Liveness> = hosts
        .iter()
        .map(|h| (h.name.as_str(), liveness(h, now_ms, grace)))
        .collect();
    let alive = |host: &str| state.get(host).is_some_and(|l| *l != Liveness::Gone);
    let mut candidates: BTreeMap<&str, Candidate> = hosts
        .iter()
        .filter(|h| state[h.name.as_str()] == Liveness::Live)
        .map(|h| {
            (
                h.name.as_str(),
                Candidate {
                    name: h.name.clone(),
                    capacity: h.capacity.clone(),
                    used: Usage::default(),
                },
            )
        })
        .collect();
    // What is already placed counts first, on hosts that are not gone.
    for d in deployments.values() {
        for (replica, host) in &d.placement {
            if *replica <= d.manifest.replicas
                && let Some(c) = candidates.get_mut(host.as_str())
            {
                c.used.add(&d.manifest, *replica);
            }
        }
    }
    // What each live host reports, indexed once (a report lists every replica; reading it
    // again for each deployment made a round quadratic in the agents).
    let live: Vec<&HostReport> = hosts
        .iter()
        .copied()
        .filter(|h| state[h.name.as_str()] == Liveness::Live)
        .collect();
    // Per deployment, the replicas live hosts gave up on: (host, replica, reason).
    let mut gave_up: BTreeMap<&str, Vec<(&str, u32, &str)>> = BTreeMap::new();
    // Per live host, what it runs: deployment to replicas.
    let mut actual: Vec<BTreeMap<&str, BTreeSet<u32>>> = Vec::with_capacity(live.len());
    for report in &live {
        let mut runs: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
        for r in report.reported() {
            runs.entry(r.deployment).or_default().insert(r.replica);
            if let ReplicaState::Failed { reason } = &r.status.state {
                gave_up.entry(r.deployment).or_default().push((
                    report.name.as_str(),
                    r.replica,
                    reason.as_str(),
                ));
            }
        }
        actual.push(runs);
    }
    let mut out = Plan::default();
    for (id, d) in deployments {
        let mut next = d.clone();
        next.placement.retain(|r, _| *r <= d.manifest.replicas);
        next.failed.retain(|r, _| *r <= d.manifest.replicas);
        // Replicas a live host gave up on are failed until deployed or scaled again.
        for (host, replica, reason) in gave_up.get(id.as_str()).into_iter().flatten() {
            if next.placement.get(replica).map(String::as_str) == Some(*host)
                && !next.failed.contains_key(replica)
            {
                next.failed.insert(*replica, format!("{host}: {reason}"));
            }
        }
        for replica in 1..=d.manifest.replicas {
            if next.failed.contains_key(&replica) {
                continue;
            }
            let from = match next.placement.get(&replica) {
                Some(host) if alive(host) => continue,
                Some(host) => Some(host.clone()),
                None => None,
            };
            if candidates.is_empty() {
                // No host at all yet (or none left): the replica waits, unplaced, for one to
                // report; that is not a failure.
                next.placement.remove(&replica);
                continue;
            }
            let agent = d.manifest.replica_id(replica);
            match place(&d.manifest, candidates.values()) {
                Ok(host) => {
                    if let Some(c) = candidates.get_mut(host.as_str()) {
                        c.used.add(&d.manifest, replica);
                    }
                    if let Some(from) = from {
                        out.moved.push((agent.clone(), from, host.clone()));
                    }
                    next.placement.insert(replica, host);
                }
                Err(reason) => {
                    next.placement.remove(&replica);
                    next.failed.insert(replica, reason.clone());
                    out.failures.push(DeployFailure {
                        deployment: id.clone(),
                        agent,
                        replica,
                        host: None,
                        reason,
                    });
                }
            }
        }
        // Host-reported failures found above are news too.
        for (replica, reason) in &next.failed {
            if !d.failed.contains_key(replica)
                && !out
                    .failures
                    .iter()
                    .any(|f| f.deployment == *id && f.replica == *replica)
            {
                out.failures.push(DeployFailure {
                    deployment: id.clone(),
                    agent: d.manifest.replica_id(*replica),
                    replica: *replica,
                    host: next.placement.get(replica).cloned(),
                    reason: reason.clone(),
                });
            }
        }
        if next.placement != d.placement || next.failed != d.failed {
            out.changed.insert(id.clone(), next);
        }
    }
    // Every live host runs exactly what is placed on it. What is wanted where, per
    // deployment, is worked out once (not once per host).
    let mut wanted: BTreeMap<&str, BTreeMap<&str, BTreeSet<u32>>> = BTreeMap::new();
    for id in deployments.keys() {
        let Some(d) = out.changed.get(id).or_else(|| deployments.get(id)) else {
            continue;
        };
        let per_host = wanted.entry(id.as_str()).or_default();
        for (r, host) in &d.placement {
            if *r <= d.manifest.replicas && !d.failed.contains_key(r) {
                per_host.entry(host.as_str()).or_default().insert(*r);
            }
        }
    }
    let none = BTreeSet::new();
    for (report, actual) in live.iter().zip(&actual) {
        // Everything it reports is what it runs, failed or stopped included: a failed
        // replica stays until it is no longer wanted there.
        let mut ids: BTreeSet<&str> = actual.keys().copied().collect();
        ids.extend(deployments.keys().map(String::as_str));
        for id in ids {
            let here = wanted
                .get(id)
                .and_then(|per_host| per_host.get(report.name.as_str()))
                .unwrap_or(&none);
            let have = actual.get(id).unwrap_or(&none);
            if here == have {
                continue;
            }
            // A deployment that still exists is deployed with what is wanted (none: its
            // replicas there stop, the host keeps the manifest); a terminated one is ended.
            match out.changed.get(id).or_else(|| deployments.get(id)) {
                Some(d) => out.commands.push(HostCommand::Deploy {
                    host: report.name.clone(),
                    manifest: Box::new(d.manifest.clone()),
                    replicas: here.iter().copied().collect(),
                }),
                None => out.commands.push(HostCommand::Terminate {
                    host: report.name.clone(),
                    deployment: id.to_owned(),
                }),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Capacity, SharedProcess};
    use crate::replica::ReplicaStatus;

    const GRACE: Duration = Duration::from_secs(30);
    const NOW: u64 = 1_000_000;

    fn manifest(id: &str, replicas: u32, extra: &str) -> Manifest {
        Manifest::from_toml(&format!(
            "id = \"{id}\"\nreplicas = {replicas}\n{extra}\n[run]\ncommand = \"x\"\n"
        ))
        .expect("a valid manifest")
    }

    fn deployment(m: Manifest, placement: &[(u32, &str)]) -> Deployment {
        Deployment {
            manifest: m,
            placement: placement
                .iter()
                .map(|(r, h)| (*r, (*h).to_owned()))
                .collect(),
            failed: BTreeMap::new(),
            updated_ms: 0,
        }
    }

    fn report(name: &str, age_ms: u64, running: &[(&Manifest, u32, ReplicaState)]) -> HostReport {
        HostReport {
            name: name.to_owned(),
            agent: format!("host-{name}"),
            instance: "i".to_owned(),
            capacity: Capacity {
                agents: 10,
                memory_mb: 0,
                cpu: 0.0,
                ..Capacity::default()
            },
            replicas: running
                .iter()
                .map(|(m, r, state)| ReplicaStatus {
                    pid: Some(1),
                    state: state.clone(),
                    ..ReplicaStatus::starting(m, *r)
                })
                .collect(),
            shared: Vec::new(),
            updated_ms: NOW - age_ms,
            report_ms: 2_000,
        }
    }

    fn one(d: Deployment) -> BTreeMap<String, Deployment> {
        BTreeMap::from([(d.manifest.id.clone(), d)])
    }

    #[test]
    fn a_new_deployment_is_spread_and_each_host_told_its_replicas() {
        let m = manifest("calc", 3, "");
        let p = plan(
            &one(deployment(m, &[])),
            &[report("a", 0, &[]), report("b", 0, &[])],
            NOW,
            GRACE,
        );
        let placed = &p.changed["calc"].placement;
        assert_eq!(placed.len(), 3);
        assert_eq!(
            placed.values().filter(|h| *h == "a").count(),
            2,
            "{placed:?}"
        );
        assert_eq!(p.commands.len(), 2);
        assert!(p.failures.is_empty());
    }

    #[test]
    fn a_host_that_runs_what_is_placed_gets_nothing_and_one_that_lost_it_gets_it_back() {
        let m = manifest("calc", 1, "");
        let d = one(deployment(m.clone(), &[(1, "a")]));
        let steady = plan(
            &d,
            &[report("a", 0, &[(&m, 1, ReplicaState::Running)])],
            NOW,
            GRACE,
        );
        assert!(steady.changed.is_empty() && steady.commands.is_empty());
        // Restarted within the grace: it reports nothing running, and is told again.
        let back = plan(&d, &[report("a", 0, &[])], NOW, GRACE);
        assert_eq!(
            back.commands,
            vec![HostCommand::Deploy {
                host: "a".into(),
                manifest: Box::new(m),
                replicas: vec![1]
            }]
        );
    }

    #[test]
    fn replicas_of_a_gone_host_move_and_a_silent_one_keeps_them() {
        let m = manifest("calc", 1, "");
        let d = one(deployment(m.clone(), &[(1, "a")]));
        let running = [(&m, 1, ReplicaState::Running)];
        let silent = plan(
            &d,
            &[report("a", 10_000, &running), report("b", 0, &[])],
            NOW,
            GRACE,
        );
        assert!(
            silent.changed.is_empty() && silent.commands.is_empty(),
            "{silent:?}"
        );
        let gone = plan(
            &d,
            &[report("a", 40_000, &running), report("b", 0, &[])],
            NOW,
            GRACE,
        );
        assert_eq!(gone.changed["calc"].placement[&1], "b");
        assert_eq!(gone.moved, vec![("calc".into(), "a".into(), "b".into())]);
        assert_eq!(gone.commands.len(), 1, "only b is told: a is gone");
    }

    #[test]
    fn scaling_down_and_terminating_stop_replicas() {
        let m = manifest("calc", 1, "");
        let d = one(deployment(m.clone(), &[(1, "a"), (2, "a")]));
        let two = [
            (&m, 1, ReplicaState::Running),
            (&m, 2, ReplicaState::Running),
        ];
        let p = plan(&d, &[report("a", 0, &two)], NOW, GRACE);
        assert_eq!(p.changed["calc"].placement.len(), 1);
        assert_eq!(
            p.commands,
            vec![HostCommand::Deploy {
                host: "a".into(),
                manifest: Box::new(m.clone()),
                replicas: vec![1]
            }]
        );
        let gone = plan(&BTreeMap::new(), &[report("a", 0, &two)], NOW, GRACE);
        assert_eq!(
            gone.commands,
            vec![HostCommand::Terminate {
                host: "a".into(),
                deployment: "calc".into()
            }]
        );
    }

    #[test]
    fn without_any_live_host_replicas_wait_and_are_placed_when_one_reports() {
        let m = manifest("calc", 2, "");
        let d = one(deployment(m.clone(), &[]));
        let waiting = plan(&d, &[] as &[HostReport], NOW, GRACE);
        assert!(
            waiting.failures.is_empty() && waiting.commands.is_empty(),
            "{waiting:?}"
        );
        assert!(waiting.changed.is_empty(), "nothing to write: {waiting:?}");
        let placed = plan(&d, &[report("a", 0, &[])], NOW, GRACE);
        assert_eq!(placed.changed["calc"].placement.len(), 2);
        // A host gone and none other live: its replicas wait again, unplaced, not failed.
        let gone = one(deployment(m, &[(1, "a"), (2, "a")]));
        let p = plan(&gone, &[report("a", 40_000, &[])], NOW, GRACE);
        assert!(p.failures.is_empty(), "{p:?}");
        assert!(p.changed["calc"].placement.is_empty());
    }

    #[test]
    fn no_room_and_a_host_giving_up_are_failures_reported_once() {
        let m = manifest("calc", 2, "[placement]\nco_locate_with = \"orchestrator\"");
        let p = plan(
            &one(deployment(m.clone(), &[])),
            &[report("a", 0, &[])],
            NOW,
            GRACE,
        );
        assert_eq!(p.failures.len(), 2);
        assert!(
            p.failures[0]
                .reason
                .contains("orchestrator runs on no live host")
        );
        // Written back as failed: the next round says nothing new.
        let again = plan(&p.changed, &[report("a", 0, &[])], NOW, GRACE);
        assert!(again.failures.is_empty() && again.changed.is_empty());

        let m = manifest("calc", 1, "");
        let d = one(deployment(m.clone(), &[(1, "a")]));
        let failed = ReplicaState::Failed {
            reason: "crashed 6 times".into(),
        };
        let p = plan(&d, &[report("a", 0, &[(&m, 1, failed)])], NOW, GRACE);
        assert_eq!(p.failures.len(), 1);
        assert_eq!(p.failures[0].host.as_deref(), Some("a"));
        assert_eq!(
            p.commands,
            vec![HostCommand::Deploy {
                host: "a".into(),
                manifest: Box::new(m),
                replicas: vec![]
            }],
            "a failed replica is not wanted: its host clears it"
        );
        let again = plan(&p.changed, &[report("a", 0, &[])], NOW, GRACE);
        assert!(
            again.failures.is_empty() && again.commands.is_empty(),
            "{again:?}"
        );
    }

    /// A fleet as the hosted scale run makes it: `deployments` shared deployments of
    /// `replicas` each, placed on `hosts` hosts in turn, each host reporting them running
    /// and healthy.
    fn fleet(
        deployments: usize,
        replicas: u32,
        hosts: usize,
    ) -> (BTreeMap<String, Deployment>, Vec<HostReport>) {
        let mut reports: Vec<HostReport> = (0..hosts)
            .map(|h| HostReport {
                capacity: Capacity {
                    agents: 1_000_000,
                    memory_mb: 0,
                    cpu: 0.0,
                    ..Capacity::default()
                },
                ..report(&format!("h{h}"), 0, &[])
            })
            .collect();
        let mut out = BTreeMap::new();
        for i in 0..deployments {
            let host = format!("h{}", i % hosts);
            let mut m = manifest(&format!("w{i}"), replicas, "");
            m.run.shared = true;
            reports[i % hosts].shared.push(SharedProcess {
                process: ReplicaStatus {
                    pid: Some(1),
                    state: ReplicaState::Running,
                    ..ReplicaStatus::starting(&m, 1)
                },
                replicas: (1..=replicas).collect(),
                healthy: (1..=replicas).collect(),
            });
            let placed: Vec<(u32, &str)> = (1..=replicas).map(|r| (r, host.as_str())).collect();
            out.insert(m.id.clone(), deployment(m, &placed));
        }
        (out, reports)
    }

    #[test]
    fn a_steady_fleet_of_shared_processes_needs_nothing_and_a_lost_process_is_sent_again() {
        // 30,000 agents: a round reads each report once (it read every report once per
        // deployment, and scanned each shared process's healthy list once per replica).
        let (deployments, mut reports) = fleet(30, 1_000, 4);
        let steady = plan(&deployments, &reports, NOW, GRACE);
        assert!(
            steady.changed.is_empty() && steady.commands.is_empty() && steady.failures.is_empty(),
            "{:?} {:?}",
            steady.commands.len(),
            steady.failures.first()
        );
        // h1 lost the process of w5 (a restart within the grace): it is told to run it again,
        // all its replicas, and nothing else moves.
        reports[1].shared.retain(|g| g.process.deployment != "w5");
        let again = plan(&deployments, &reports, NOW, GRACE);
        assert!(again.changed.is_empty(), "{:?}", again.changed.keys());
        match again.commands.as_slice() {
            [
                HostCommand::Deploy {
                    host,
                    manifest,
                    replicas,
                },
            ] => {
                assert_eq!((host.as_str(), manifest.id.as_str()), ("h1", "w5"));
                assert_eq!(*replicas, (1..=1_000).collect::<Vec<u32>>());
            }
            other => panic!("one deploy to h1 expected: {other:?}"),
        }
    }

    #[test]
    fn a_shared_process_given_up_fails_every_replica_it_served() {
        let (deployments, mut reports) = fleet(2, 3, 1);
        let w1 = reports[0]
            .shared
            .iter_mut()
            .find(|g| g.process.deployment == "w1")
            .expect("w1 runs on h0");
        w1.process.state = ReplicaState::Failed {
            reason: "crashed 6 times".into(),
        };
        let p = plan(&deployments, &reports, NOW, GRACE);
        let failed: Vec<(&str, u32)> = p
            .failures
            .iter()
            .map(|f| (f.deployment.as_str(), f.replica))
            .collect();
        assert_eq!(failed, vec![("w1", 1), ("w1", 2), ("w1", 3)]);
        assert_eq!(p.changed["w1"].failed[&2], "h0: crashed 6 times");
        assert!(!p.changed.contains_key("w0"));
    }
}
