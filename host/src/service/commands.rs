//! The host's commands, as the coordinator sends them: create, run, deploy, scale,
//! terminate, logs and status.

use super::*;

impl State {
    pub(super) fn kept(&self, deployment: &str) -> Result<Manifest, HandlerError> {
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

    pub(super) async fn create(&self, req: CreateRequest) -> Result<HostChange, HandlerError> {
        req.manifest
            .validate()
            .map_err(|e| invalid(e.to_string()))?;
        lock(&self.manifests).insert(req.manifest.id.clone(), req.manifest);
        Ok(HostChange::default())
    }

    pub(super) async fn run(&self, req: RunRequest) -> Result<HostChange, HandlerError> {
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

    pub(super) async fn deploy(&self, req: HostDeploy) -> Result<HostChange, HandlerError> {
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

    pub(super) async fn scale(&self, req: HostScale) -> Result<HostChange, HandlerError> {
        let mut manifest = self.kept(&req.deployment)?;
        manifest.replicas = req.replicas;
        manifest.validate().map_err(|e| invalid(e.to_string()))?;
        lock(&self.manifests).insert(manifest.id.clone(), manifest.clone());
        self.converge(&manifest, (1..=req.replicas).collect()).await
    }

    pub(super) async fn terminate(&self, req: HostTerminate) -> Result<HostChange, HandlerError> {
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

    pub(super) async fn logs(&self, req: LogsRequest) -> Result<LogLines, HandlerError> {
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

    pub(super) async fn status(&self, _: serde_json::Value) -> Result<HostReport, HandlerError> {
        Ok(self.report_now())
    }
}
