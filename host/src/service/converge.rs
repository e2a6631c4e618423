//! Bringing what runs to what a deployment asks: starting and stopping replicas (each in a
//! process of its own, or many in one shared process), builds first, and the bus subjects
//! each replica's commands come on.

use super::*;

impl State {
    /// Makes the replicas of `manifest` assigned here exactly `wanted`: starts the missing,
    /// stops the others.
    pub(super) async fn converge(
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
    pub(super) fn built(
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
    pub(super) async fn converge_shared(
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
    pub(super) fn process_of(&self, agent: &str) -> String {
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
    pub(super) async fn listen(&self, agents: &[String]) -> Result<(), HandlerError> {
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
    pub(super) fn unlisten(&self, agent: &str) {
        if let Some(token) = lock(&self.listening).remove(agent) {
            token.cancel();
        }
    }

    pub(super) async fn stop_agent(&self, agent: &str) -> Result<(), HandlerError> {
        lock(&self.watches).remove(agent);
        self.unlisten(agent);
        match self.supervisor.stop(agent).await {
            Ok(()) | Err(ProcessError::NotFound { .. }) => Ok(()),
            Err(err) => Err(process_error(err)),
        }
    }
}
