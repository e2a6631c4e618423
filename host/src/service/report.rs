//! What the host tells the bus: its report, the events of its replicas (`deploy_confirm`,
//! `deploy_failure`), and the health it watches.

use super::*;

impl State {
    pub(super) fn report_now(&self) -> HostReport {
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

    pub(super) async fn report(&self, _agent: &Agent) {
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

    pub(super) async fn on_event(&self, agent: &Agent, event: ReplicaEvent) {
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

    pub(super) async fn confirm(
        &self,
        agent: &Agent,
        agent_id: &str,
        pid: Option<u32>,
        health: &str,
    ) {
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
    pub(super) async fn check_health(&self, agent: &Agent) {
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
