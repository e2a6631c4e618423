//! Where a replica goes: a pure choice among the live hosts, from what each can take and what
//! is already placed on it, tested without a bus. The coordinator calls [`place`] for every
//! replica it has to put somewhere and records the answer in the desired state.
//!
//! The rules, in order: only the manifest's `placement.hosts` if it names any; only the host
//! where `placement.co_locate_with` runs if it names an agent; only hosts with room (agent
//! slots, memory, CPU and GPUs the manifest asks for, against what is already placed there);
//! then a host in the manifest's preferred region, then the host with the fewest replicas of
//! the same deployment (replicas spread), then the least loaded (placed agents over slots),
//! then by name. When none is left the answer is a refusal
//! that says, host by host, why.

use std::collections::{BTreeMap, BTreeSet};

use crate::manifest::Manifest;
use crate::protocol::Capacity;

/// A live host as placement sees it: what it can take and what is placed on it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Candidate {
    /// The host's name.
    pub name: String,
    /// What it can take.
    pub capacity: Capacity,
    /// What is placed on it.
    pub used: Usage,
}

/// What is placed on a host: counted from the desired state and from what the host reports
/// running.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// Agents placed.
    pub agents: u32,
    /// Memory their manifests ask for, MiB.
    pub memory_mb: u64,
    /// CPU their manifests ask for, cores.
    pub cpu: f64,
    /// GPUs their manifests ask for.
    pub gpus: u32,
    /// The replicas placed or running there, per deployment (numbers, not agent ids: a round
    /// counts every placed replica, and making 100,000 ids each time is what it would cost).
    pub replicas: BTreeMap<String, BTreeSet<u32>>,
}

impl Usage {
    /// Counts replica `replica` of `manifest`.
    pub fn add(&mut self, manifest: &Manifest, replica: u32) {
        self.agents += 1;
        self.memory_mb += manifest.resources.memory_mb.unwrap_or(0);
        self.cpu += manifest.resources.cpu.unwrap_or(0.0);
        self.gpus = self
            .gpus
            .saturating_add(manifest.resources.gpus.unwrap_or(0));
        match self.replicas.get_mut(&manifest.id) {
            Some(set) => {
                set.insert(replica);
            }
            None => {
                self.replicas
                    .insert(manifest.id.clone(), BTreeSet::from([replica]));
            }
        }
    }

    /// Replicas of `deployment` placed here.
    pub fn of(&self, deployment: &str) -> usize {
        self.replicas.get(deployment).map_or(0, BTreeSet::len)
    }

    /// Whether the agent `agent` (a replica's id) is placed or runs here.
    pub fn has_agent(&self, agent: &str) -> bool {
        let (deployment, replica) = crate::manifest::deployment_of(agent);
        self.replicas
            .get(deployment)
            .is_some_and(|set| set.contains(&replica))
    }
}

impl Candidate {
    /// Why `manifest` does not fit here, or `None` when it does.
    fn lacks(&self, manifest: &Manifest) -> Option<String> {
        let (cap, used) = (&self.capacity, &self.used);
        if used.agents >= cap.agents {
            return Some(format!("{} of {} agents placed", used.agents, cap.agents));
        }
        if let Some(need) = manifest.resources.memory_mb
            && cap.memory_mb > 0
            && used.memory_mb + need > cap.memory_mb
        {
            return Some(format!(
                "needs {need} MiB, {} MiB free",
                cap.memory_mb.saturating_sub(used.memory_mb)
            ));
        }
        if let Some(need) = manifest.resources.cpu
            && cap.cpu > 0.0
            && used.cpu + need > cap.cpu + 1e-9
        {
            return Some(format!(
                "needs {need} CPU, {:.2} free",
                (cap.cpu - used.cpu).max(0.0)
            ));
        }
        // GPUs are counted whatever the host says: one without any takes no GPU agent.
        if let Some(need) = manifest.resources.gpus
            && used.gpus.saturating_add(need) > cap.gpus
        {
            return Some(format!(
                "needs {need} GPU, {} free",
                cap.gpus.saturating_sub(used.gpus)
            ));
        }
        None
    }

    /// Whether it is outside the manifest's preferred region (hosts inside go first).
    fn elsewhere(&self, manifest: &Manifest) -> bool {
        manifest
            .placement
            .preferred_region
            .as_ref()
            .is_some_and(|r| self.capacity.region.as_ref() != Some(r))
    }

    fn load(&self) -> f64 {
        f64::from(self.used.agents) / f64::from(self.capacity.agents.max(1))
    }
}

/// Picks the host for one more replica of `manifest` among `candidates` (the live hosts), or
/// says why none can take it.
///
/// # Errors
/// A refusal naming the reason: the named hosts are not live, the co-location target runs on
/// no live host or its host is full, or, host by host, what each lacks.
pub fn place<'a>(
    manifest: &Manifest,
    candidates: impl IntoIterator<Item = &'a Candidate>,
) -> Result<String, String> {
    let mut pool: Vec<&Candidate> = candidates
        .into_iter()
        .filter(|c| {
            manifest.placement.hosts.is_empty() || manifest.placement.hosts.contains(&c.name)
        })
        .collect();
    if pool.is_empty() {
        return Err(if manifest.placement.hosts.is_empty() {
            "no host is live".to_owned()
        } else {
            format!(
                "none of its hosts ({}) is live",
                manifest.placement.hosts.join(", ")
            )
        });
    }
    if let Some(target) = &manifest.placement.co_locate_with {
        pool.retain(|c| c.used.has_agent(target));
        let Some(host) = pool.first() else {
            return Err(format!(
                "co-location target {target} runs on no live host it may use"
            ));
        };
        return match host.lacks(manifest) {
            None => Ok(host.name.clone()),
            Some(lack) => Err(format!(
                "host {}, where {target} runs, is full: {lack}",
                host.name
            )),
        };
    }
    let mut refusals = Vec::new();
    pool.retain(|c| match c.lacks(manifest) {
        None => true,
        Some(lack) => {
            refusals.push(format!("{}: {lack}", c.name));
            false
        }
    });
    pool.into_iter()
        .min_by(|a, b| {
            let same = |c: &Candidate| c.used.of(&manifest.id);
            a.elsewhere(manifest)
                .cmp(&b.elsewhere(manifest))
                .then(same(a).cmp(&same(b)))
                .then(a.load().total_cmp(&b.load()))
                .then(a.name.cmp(&b.name))
        })
        .map(|c| c.name.clone())
        .ok_or_else(|| format!("no host has room ({})", refusals.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(text: &str) -> Manifest {
        Manifest::from_toml(&format!(
            "id = \"calc\"\n{text}\n[run]\ncommand = \"calc\"\n"
        ))
        .expect("a valid manifest")
    }

    fn host(name: &str, agents: u32, memory_mb: u64) -> Candidate {
        Candidate {
            name: name.to_owned(),
            capacity: Capacity {
                agents,
                memory_mb,
                ..Capacity::default()
            },
            used: Usage::default(),
        }
    }

    #[test]
    fn replicas_spread_then_go_to_the_least_loaded_host() {
        let m = manifest("");
        let mut a = host("a", 10, 0);
        let b = host("b", 10, 0);
        a.used.add(&m, 1);
        // b has none of calc's replicas yet.
        assert_eq!(place(&m, &[a.clone(), b.clone()]), Ok("b".to_owned()));
        // Another deployment: a is more loaded (1 of 10), b empty.
        let other = Manifest::from_toml("id = \"other\"\n[run]\ncommand = \"x\"\n").expect("valid");
        assert_eq!(place(&other, &[a, b]), Ok("b".to_owned()));
    }

    #[test]
    fn a_full_host_is_skipped_and_none_left_is_a_refusal_host_by_host() {
        let m = manifest("[resources]\nmemory_mb = 256");
        let mut a = host("a", 1, 0);
        a.used.agents = 1;
        let b = host("b", 10, 128);
        let err = place(&m, &[a.clone(), b.clone()]).expect_err("no room");
        assert!(err.contains("a: 1 of 1 agents placed"), "{err}");
        assert!(err.contains("b: needs 256 MiB, 128 MiB free"), "{err}");
        let c = host("c", 10, 1024);
        assert_eq!(place(&m, &[a, b, c]), Ok("c".to_owned()));
    }

    #[test]
    fn co_location_picks_the_targets_host_or_says_why_not() {
        let m =
            manifest("[placement]\nco_locate_with = \"orchestrator\"\n[resources]\nmemory_mb = 64");
        let a = host("a", 10, 0);
        let mut b = host("b", 10, 100);
        b.used.add(
            &Manifest::from_toml("id = \"orchestrator\"\n[run]\ncommand = \"x\"\n").expect("valid"),
            1,
        );
        assert_eq!(place(&m, &[a.clone(), b.clone()]), Ok("b".to_owned()));
        b.used.memory_mb = 80;
        let err = place(&m, &[a.clone(), b]).expect_err("b is full");
        assert_eq!(
            err,
            "host b, where orchestrator runs, is full: needs 64 MiB, 20 MiB free"
        );
        let err = place(&m, std::slice::from_ref(&a)).expect_err("nowhere");
        assert!(err.contains("orchestrator runs on no live host"), "{err}");
        // A target that is a later replica is found by its number.
        let beside_second = manifest("[placement]\nco_locate_with = \"orchestrator-2\"");
        let mut c = host("c", 10, 0);
        c.used.add(
            &Manifest::from_toml("id = \"orchestrator\"\n[run]\ncommand = \"x\"\n").expect("valid"),
            2,
        );
        assert_eq!(
            place(&beside_second, &[a.clone(), c.clone()]),
            Ok("c".to_owned())
        );
        let beside_first = manifest("[placement]\nco_locate_with = \"orchestrator\"");
        assert!(
            place(&beside_first, &[a, c]).is_err(),
            "replica 1 runs nowhere"
        );
    }

    #[test]
    fn named_hosts_limit_the_choice() {
        let m = manifest("[placement]\nhosts = [\"b\"]");
        assert_eq!(
            place(&m, &[host("a", 5, 0), host("b", 5, 0)]),
            Ok("b".to_owned())
        );
        let err = place(&m, &[host("a", 5, 0)]).expect_err("b is not live");
        assert_eq!(err, "none of its hosts (b) is live");
        assert_eq!(place(&manifest(""), &[]), Err("no host is live".to_owned()));
    }

    #[test]
    fn cpu_counts_against_the_hosts_cores() {
        let m = manifest("[resources]\ncpu = 1.5");
        let mut a = host("a", 10, 0);
        a.capacity.cpu = 2.0;
        a.used.cpu = 1.0;
        let err = place(&m, &[a]).expect_err("no cpu");
        assert!(err.contains("needs 1.5 CPU, 1.00 free"), "{err}");
    }

    #[test]
    fn gpus_go_only_to_hosts_that_have_them_free() {
        let m = manifest("[resources]\ngpus = 1");
        let plain = host("plain", 10, 0);
        let mut gpu = host("gpu", 10, 0);
        gpu.capacity.gpus = 1;
        assert_eq!(
            place(&m, &[plain.clone(), gpu.clone()]),
            Ok("gpu".to_owned())
        );
        gpu.used.add(&m, 1);
        assert_eq!(gpu.used.gpus, 1);
        let err = place(&m, &[plain, gpu]).expect_err("the GPU is taken");
        assert!(err.contains("plain: needs 1 GPU, 0 free"), "{err}");
        assert!(err.contains("gpu: needs 1 GPU, 0 free"), "{err}");
        // An agent that needs none still goes anywhere.
        assert!(place(&manifest(""), &[host("plain", 10, 0)]).is_ok());
    }

    #[test]
    fn a_preferred_region_goes_first_and_others_take_what_it_cannot() {
        let m = manifest("[placement]\npreferred_region = \"eu-west\"");
        let mut us = host("a-us", 10, 0);
        us.capacity.region = Some("us-east".into());
        let mut eu = host("b-eu", 1, 0);
        eu.capacity.region = Some("eu-west".into());
        // Though a-us comes first by name and is as empty.
        assert_eq!(place(&m, &[us.clone(), eu.clone()]), Ok("b-eu".to_owned()));
        // Full in the region: elsewhere, as a preference is not a requirement.
        eu.used.add(&m, 1);
        assert_eq!(place(&m, &[us.clone(), eu]), Ok("a-us".to_owned()));
        // No host says its region: as if none were preferred.
        assert_eq!(place(&m, &[host("x", 5, 0)]), Ok("x".to_owned()));
    }
}
