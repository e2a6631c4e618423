//! Hosted agents' desired state (docs/HOSTING.md): the coordinator keeps one deployment per
//! manifest in the deployments bucket, places each replica on a host, and reconciles, every
//! `reconcile_interval_ms` and after every change, so that each live host runs exactly what is
//! placed on it and the replicas of a host gone for longer than `host_grace_ms` run elsewhere.
//!
//! The decision is `chorus_hosting::reconcile::plan`, pure and tested apart; this room decides
//! on the two buckets as its watches last showed them ([`seen`]), writes back the deployments
//! the plan changed (on the revision seen, so two coordinators never both win), sends the
//! hosts their commands and publishes the failures.
//! It answers `deploy`, `scale`, `terminate`, `deployments`, `hosts` and `logs` as commands
//! of the agent `coordinator`, in the coordinators' queue group.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::Kv;
use chorus_hosting::manifest::{Manifest, deployment_of};
use chorus_hosting::protocol::{
    self as hosting, DeployRequest, Deployment, DeploymentView, HostDeploy, HostReport,
    HostTerminate, LogLines, LogsRequest, PlacedReplica, ReportedReplica, ScaleRequest,
    TerminateRequest, coordinator_commands, host_agent, host_commands,
};
use chorus_hosting::reconcile::{HostCommand, Liveness, Plan, liveness, plan};
use chorus_sdk::{Agent, Call, Context, HandlerError, Report, SdkError, StatusCode, Typed};
use futures::StreamExt;

use super::Shared;
use super::guard::authorize;
use crate::authority::Action;

/// Lines `chorus logs` may ask for at most.
pub const MAX_LOG_LINES: usize = 10_000;

mod seen;

pub(super) use seen::follow;
use seen::{Change, Seen};

/// Commands a reconciliation sends to hosts at once.
pub const TELLS_IN_FLIGHT: usize = 16;

/// How long `terminate` waits for the deployments' watch to show its delete before it
/// reconciles anyway (the next round stops what this one could not).
const DELETE_SEEN_WITHIN: Duration = Duration::from_secs(5);

/// The hosting part of a coordinator: its two buckets, what it has seen of them, and a lock
/// that keeps its own reconciliations one at a time.
pub(crate) struct Hosting {
    deployments: Kv,
    hosts: Kv,
    /// The buckets as last seen ([`follow`] keeps it), behind a watch channel so that
    /// `terminate` can wait for its delete to show.
    seen: tokio::sync::watch::Sender<Seen>,
    round: tokio::sync::Mutex<()>,
}

impl Hosting {
    pub(crate) fn new(deployments: Kv, hosts: Kv) -> Hosting {
        Hosting {
            deployments,
            hosts,
            seen: tokio::sync::watch::Sender::new(Seen::default()),
            round: tokio::sync::Mutex::new(()),
        }
    }

    /// What was last seen of the buckets, or 5xxx unavailable once they are no longer
    /// followed. Not to be held across an await.
    fn seen(&self) -> Result<tokio::sync::watch::Ref<'_, Seen>, HandlerError> {
        let seen = self.seen.borrow();
        if seen.followed {
            Ok(seen)
        } else {
            Err(HandlerError::new(
                StatusCode::UNAVAILABLE,
                "this coordinator no longer follows the hosting buckets (see its log): ask \
                 another, or restart it",
            ))
        }
    }

    /// Counts a deployment this coordinator wrote at `revision`.
    fn written(&self, d: &Deployment, revision: u64) {
        let change = Change::written(&d.manifest.id, revision, d.clone());
        self.seen
            .send_if_modified(|seen| seen.deployments.apply(change));
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn unavailable(what: &str) -> impl FnOnce(chorus_broker_adapter::Error) -> HandlerError + '_ {
    move |err| HandlerError::new(StatusCode::UNAVAILABLE, format!("{what}: {}", Report(&err)))
}

impl Shared {
    /// One reconciliation: read, decide, write, tell the hosts, report failures.
    pub(crate) async fn reconcile(&self) -> Result<Plan, HandlerError> {
        let hosting = &self.hosting;
        let _one_at_a_time = hosting.round.lock().await;
        let grace = Duration::from_millis(self.config.host_grace_ms);
        // Decided on what was seen, in memory, then written on the revisions seen.
        let (decided, revisions) = {
            let seen = hosting.seen()?;
            let decided = plan(&seen.deployments.live, &seen.hosts(), now_ms(), grace);
            let revisions: Vec<u64> = decided
                .changed
                .keys()
                .map(|id| seen.deployments.revision(id).unwrap_or(0))
                .collect();
            (decided, revisions)
        };
        let mut lost: Vec<String> = Vec::new();
        for ((id, next), revision) in decided.changed.iter().zip(revisions) {
            let body = Bytes::from(serde_json::to_vec(next).unwrap_or_default());
            match hosting.deployments.update(id, body, revision).await {
                Ok(written) => hosting.written(next, written),
                Err(err) => {
                    // Another coordinator, or a deploy, wrote it first: the next round reads it.
                    tracing::debug!(deployment = %id, error = %Report(&err), "deployment changed meanwhile");
                    lost.push(id.clone());
                }
            }
        }
        for (agent, from, to) in &decided.moved {
            tracing::info!(%agent, %from, %to, "host gone: replica placed elsewhere");
        }
        // Hosts are told at once (a busy one does not hold up the others), at most
        // [`TELLS_IN_FLIGHT`] at a time.
        let told: Vec<_> = decided
            .commands
            .iter()
            .filter(|command| !lost.iter().any(|id| id == command.deployment()))
            .map(|command| self.tell(command))
            .collect();
        futures::stream::iter(told)
            .buffer_unordered(TELLS_IN_FLIGHT)
            .collect::<()>()
            .await;
        for failure in &decided.failures {
            tracing::warn!(agent = %failure.agent, reason = %failure.reason, "replica not running");
            if let Err(err) = self.agent.publish(hosting::DEPLOY_FAILURE, failure).await {
                tracing::debug!(error = %Report(&err), "deploy_failure not published");
            }
        }
        Ok(decided)
    }

    /// Sends `command` to its host; a host that does not take it is said (the next round
    /// sends it again).
    async fn tell(&self, command: &HostCommand) {
        if let Err(err) = self.send(command).await {
            let host = match command {
                HostCommand::Deploy { host, .. } | HostCommand::Terminate { host, .. } => host,
            };
            let deployment = command.deployment();
            tracing::warn!(%host, %deployment, error = %Report(&err), "host did not take its command");
        }
    }

    async fn send(&self, command: &HostCommand) -> Result<(), SdkError> {
        let call = match command {
            HostCommand::Deploy {
                host,
                manifest,
                replicas,
            } => Call::agent(host_agent(host), host_commands::DEPLOY).payload(&HostDeploy {
                manifest: (**manifest).clone(),
                replicas: replicas.clone(),
            })?,
            HostCommand::Terminate { host, deployment } => {
                Call::agent(host_agent(host), host_commands::TERMINATE).payload(&HostTerminate {
                    target: deployment.clone(),
                })?
            }
        };
        self.agent.call(call).await.map(|_| ())
    }

    /// Where each replica of `id` is placed, and which failed.
    fn view(&self, id: &str) -> Result<DeploymentView, HandlerError> {
        let seen = self.hosting.seen()?;
        let d = seen
            .deployments
            .live
            .get(id)
            .ok_or_else(|| no_deployment(id))?;
        Ok(view_of(d, &Reported::new(&seen.hosts(), Some(id))))
    }
}

/// What the hosts report, indexed by deployment, host and replica: made once per answer, so
/// that showing a deployment looks each replica up rather than scanning every report for it
/// (which made `deploy` and `deployments` quadratic in the agents).
struct Reported<'a>(HashMap<(&'a str, &'a str, u32), ReportedReplica<'a>>);

impl<'a> Reported<'a> {
    /// Every replica the hosts report, or only those of deployment `only`.
    fn new(hosts: &[&'a HostReport], only: Option<&str>) -> Reported<'a> {
        Reported(
            hosts
                .iter()
                .flat_map(|h| {
                    h.reported()
                        .filter(move |r| only.is_none_or(|id| r.deployment == id))
                        .map(move |r| ((r.deployment, h.name.as_str(), r.replica), r))
                })
                .collect(),
        )
    }
}

/// A deployment as the CLI shows it: each placed replica with what its host last reported.
fn view_of(d: &Deployment, reported: &Reported<'_>) -> DeploymentView {
    let id = d.manifest.id.as_str();
    DeploymentView {
        deployment: d.manifest.id.clone(),
        replicas: d.manifest.replicas,
        placed: d
            .placement
            .iter()
            .filter(|(r, _)| !d.failed.contains_key(r))
            .map(|(r, host)| {
                let found = reported.0.get(&(id, host.as_str(), *r));
                PlacedReplica {
                    replica: *r,
                    host: host.clone(),
                    state: found.map(|a| a.status.state.clone()),
                    healthy: found.is_some_and(|a| a.healthy),
                    agent: d.manifest.replica_id(*r),
                }
            })
            .collect(),
        failed: d.failed.clone(),
    }
}

fn no_deployment(id: &str) -> HandlerError {
    HandlerError::new(
        StatusCode::INVALID_ARGUMENT,
        format!("no deployment {id:?} (chorus deployments lists them)"),
    )
}

fn upgrade(shared: &Weak<Shared>) -> Result<Arc<Shared>, HandlerError> {
    shared.upgrade().ok_or_else(|| {
        HandlerError::new(StatusCode::UNAVAILABLE, "the coordinator is shutting down")
    })
}

/// Whether `agent` is one a host runs or is to run (the only agents whose machine Chorus
/// knows, so the only ones another can be placed beside).
fn hosted(agent: &str, seen: &Seen) -> bool {
    let (deployment, replica) = deployment_of(agent);
    seen.deployments
        .live
        .get(deployment)
        .is_some_and(|d| replica <= d.manifest.replicas && d.manifest.replica_id(replica) == agent)
        || seen.hosts.live.values().any(|h| h.find(agent).is_some())
}

async fn deploy(shared: &Shared, manifest: Manifest) -> Result<DeploymentView, HandlerError> {
    manifest
        .validate()
        .map_err(|e| HandlerError::new(StatusCode::INVALID_ARGUMENT, e.to_string()))?;
    let hosting = &shared.hosting;
    if let Some(target) = &manifest.placement.co_locate_with
        && !hosted(target, &*hosting.seen()?)
    {
        return Err(HandlerError::new(
            StatusCode::INVALID_ARGUMENT,
            format!(
                "placement.co_locate_with: no host runs an agent {target:?} (only hosted \
                 agents can be placed beside: deploy it first)"
            ),
        ));
    }
    let (placement, revision) = {
        let seen = hosting.seen()?;
        // A redeploy keeps where replicas run (the hosts restart them with the new manifest)
        // and forgets past failures.
        let placement = seen
            .deployments
            .live
            .get(&manifest.id)
            .map(|d| {
                d.placement
                    .iter()
                    .filter(|(r, _)| **r <= manifest.replicas && !d.failed.contains_key(r))
                    .map(|(r, h)| (*r, h.clone()))
                    .collect()
            })
            .unwrap_or_default();
        (placement, seen.deployments.revision(&manifest.id))
    };
    let deployment = Deployment {
        placement,
        failed: BTreeMap::new(),
        manifest,
        updated_ms: now_ms(),
    };
    write(hosting, &deployment, revision).await?;
    shared.reconcile().await?;
    shared.view(&deployment.manifest.id)
}

async fn write(
    hosting: &Hosting,
    d: &Deployment,
    revision: Option<u64>,
) -> Result<(), HandlerError> {
    let body = Bytes::from(
        serde_json::to_vec(d)
            .map_err(|e| HandlerError::new(StatusCode::INTERNAL, e.to_string()))?,
    );
    let id = &d.manifest.id;
    let written = match revision {
        Some(revision) => hosting.deployments.update(id, body, revision).await,
        None => hosting.deployments.create(id, body).await,
    };
    let written = written.map_err(|err| {
        HandlerError::new(
            StatusCode::UNAVAILABLE,
            format!(
                "deployment {id} changed meanwhile or cannot be written, try again: {}",
                Report(&err)
            ),
        )
    })?;
    hosting.written(d, written);
    Ok(())
}

async fn scale(shared: &Shared, req: ScaleRequest) -> Result<DeploymentView, HandlerError> {
    let hosting = &shared.hosting;
    let (mut d, revision) = {
        let seen = hosting.seen()?;
        let d = seen
            .deployments
            .live
            .get(&req.deployment)
            .ok_or_else(|| no_deployment(&req.deployment))?;
        (d.clone(), seen.deployments.revision(&req.deployment))
    };
    d.manifest.replicas = req.replicas;
    d.manifest
        .validate()
        .map_err(|e| HandlerError::new(StatusCode::INVALID_ARGUMENT, e.to_string()))?;
    d.failed.clear();
    d.updated_ms = now_ms();
    write(hosting, &d, revision).await?;
    shared.reconcile().await?;
    shared.view(&req.deployment)
}

async fn terminate(shared: &Shared, req: TerminateRequest) -> Result<DeploymentView, HandlerError> {
    let view = shared.view(&req.deployment)?;
    let hosting = &shared.hosting;
    hosting
        .deployments
        .delete(&req.deployment)
        .await
        .map_err(unavailable("cannot remove the deployment"))?;
    // The delete's revision is not returned: its own watch shows when it is seen.
    let mut seen = hosting.seen.subscribe();
    let gone = seen.wait_for(|s| !s.deployments.live.contains_key(&req.deployment));
    if tokio::time::timeout(DELETE_SEEN_WITHIN, gone)
        .await
        .is_err()
    {
        tracing::debug!(deployment = %req.deployment, "delete not seen yet: the next round stops it");
    }
    shared.reconcile().await?;
    Ok(view)
}

async fn list(shared: &Shared) -> Result<Vec<DeploymentView>, HandlerError> {
    let seen = shared.hosting.seen()?;
    let reported = Reported::new(&seen.hosts(), None);
    Ok(seen
        .deployments
        .live
        .values()
        .map(|d| view_of(d, &reported))
        .collect())
}

/// The hosts, each with whether it is live and what it runs.
async fn hosts(shared: &Shared) -> Result<Vec<serde_json::Value>, HandlerError> {
    let grace = Duration::from_millis(shared.config.host_grace_ms);
    let now = now_ms();
    Ok(shared
        .hosting
        .seen()?
        .hosts
        .live
        .values()
        .map(|h| {
            let state = match liveness(h, now, grace) {
                Liveness::Live => "live",
                Liveness::Silent => "silent",
                Liveness::Gone => "gone",
            };
            serde_json::json!({ "state": state, "report": h })
        })
        .collect())
}

async fn logs(shared: &Shared, req: LogsRequest) -> Result<LogLines, HandlerError> {
    if req.lines == 0 || req.lines > MAX_LOG_LINES {
        return Err(HandlerError::new(
            StatusCode::INVALID_ARGUMENT,
            format!("lines: 1 to {MAX_LOG_LINES}, not {}", req.lines),
        ));
    }
    let grace = Duration::from_millis(shared.config.host_grace_ms);
    let now = now_ms();
    let host = shared
        .hosting
        .seen()?
        .hosts
        .live
        .values()
        .filter(|h| liveness(h, now, grace) != Liveness::Gone)
        .find(|h| h.find(&req.agent).is_some())
        .map(|h| h.agent.clone())
        .ok_or_else(|| {
            HandlerError::new(
                StatusCode::INVALID_ARGUMENT,
                format!("no live host runs or ran {:?}", req.agent),
            )
        })?;
    let reply = shared
        .agent
        .call(
            Call::agent(&host, host_commands::LOGS)
                .payload(&req)
                .map_err(HandlerError::from)?,
        )
        .await
        .map_err(HandlerError::from)?;
    reply.payload_as().map_err(HandlerError::from)
}

/// Serves the hosting subjects on the coordinator's agent.
pub(super) async fn serve(agent: &Agent, shared: &Arc<Shared>) -> Result<(), SdkError> {
    let subjects = &shared.subjects;
    let group = subjects.coordinator_group();
    // Each command is what its action says: the sender's role is checked before it runs.
    macro_rules! route {
        ($action:expr, $what:expr, $f:ident, $req:ty) => {{
            let weak = Arc::downgrade(shared);
            agent
                .handle_subject(
                    &subjects.command(super::COORDINATOR_ID, $what)?,
                    Some(&group),
                    Typed::new(move |ctx: Context, req: $req| {
                        let weak = weak.clone();
                        async move {
                            let shared = upgrade(&weak)?;
                            authorize(&shared, &ctx, $action)?;
                            $f(&shared, req).await
                        }
                    }),
                )
                .await?;
        }};
    }
    route!(
        Action::Deploy,
        coordinator_commands::DEPLOY,
        deploy_request,
        DeployRequest
    );
    route!(
        Action::Scale,
        coordinator_commands::SCALE,
        scale,
        ScaleRequest
    );
    route!(
        Action::Terminate,
        coordinator_commands::TERMINATE,
        terminate,
        TerminateRequest
    );
    route!(
        Action::Deployments,
        coordinator_commands::DEPLOYMENTS,
        list_request,
        serde_json::Value
    );
    route!(
        Action::Hosts,
        coordinator_commands::HOSTS,
        hosts_request,
        serde_json::Value
    );
    route!(Action::Logs, coordinator_commands::LOGS, logs, LogsRequest);
    Ok(())
}

async fn deploy_request(
    shared: &Shared,
    req: DeployRequest,
) -> Result<DeploymentView, HandlerError> {
    deploy(shared, req.manifest).await
}

async fn list_request(
    shared: &Shared,
    _: serde_json::Value,
) -> Result<Vec<DeploymentView>, HandlerError> {
    list(shared).await
}

async fn hosts_request(
    shared: &Shared,
    _: serde_json::Value,
) -> Result<Vec<serde_json::Value>, HandlerError> {
    hosts(shared).await
}

/// Reconciles every `reconcile_interval_ms` until the coordinator stops.
pub(super) fn spawn_reconciler(shared: &Arc<Shared>) {
    let s = Arc::clone(shared);
    shared.tracker.spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(s.config.reconcile_interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = s.stop.cancelled() => break,
            }
            if let Err(err) = s.reconcile().await {
                tracing::debug!(error = %err, "reconciliation skipped");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_hosting::protocol::{Capacity, SharedProcess};
    use chorus_hosting::replica::{ReplicaState, ReplicaStatus};

    fn report(name: &str, m: &Manifest, replicas: &[u32], healthy: &[u32]) -> HostReport {
        HostReport {
            name: name.to_owned(),
            agent: chorus_hosting::protocol::host_agent(name),
            instance: "i".into(),
            capacity: Capacity::default(),
            replicas: Vec::new(),
            shared: vec![SharedProcess {
                process: ReplicaStatus {
                    state: ReplicaState::Running,
                    ..ReplicaStatus::starting(m, replicas[0])
                },
                replicas: replicas.to_vec(),
                healthy: healthy.to_vec(),
            }],
            updated_ms: 0,
            report_ms: 2_000,
        }
    }

    #[test]
    fn a_view_shows_each_replica_as_the_host_it_is_placed_on_reports_it() {
        let mut m = Manifest::new("w", "chorus");
        m.replicas = 3;
        m.run.shared = true;
        let d = Deployment {
            placement: BTreeMap::from([(1, "a".into()), (2, "a".into()), (3, "b".into())]),
            failed: BTreeMap::new(),
            manifest: m.clone(),
            updated_ms: 0,
        };
        // b still reports replica 1, placed on a: what a says of it counts.
        let (a, b) = (
            report("a", &m, &[1, 2], &[1]),
            report("b", &m, &[1, 3], &[3]),
        );
        let hosts = [&a, &b];
        let seen = |view: &DeploymentView| -> Vec<(String, String, bool, bool)> {
            view.placed
                .iter()
                .map(|p| {
                    (
                        p.agent.clone(),
                        p.host.clone(),
                        p.state.is_some(),
                        p.healthy,
                    )
                })
                .collect()
        };
        let expected = vec![
            ("w".to_owned(), "a".to_owned(), true, true),
            ("w-2".to_owned(), "a".to_owned(), true, false),
            ("w-3".to_owned(), "b".to_owned(), true, true),
        ];
        assert_eq!(seen(&view_of(&d, &Reported::new(&hosts, None))), expected);
        assert_eq!(
            seen(&view_of(&d, &Reported::new(&hosts, Some("w")))),
            expected
        );
        // An index of another deployment's replicas knows nothing of these.
        let other = view_of(&d, &Reported::new(&hosts, Some("v")));
        assert!(other.placed.iter().all(|p| p.state.is_none() && !p.healthy));
    }
}
