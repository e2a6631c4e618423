//! Prometheus HTTP service discovery of the agents' metrics (`GET /sd/agents`).
//!
//! Agents that serve metrics announce where in their manifest (`metrics_url`); the
//! coordinator answers Prometheus's `http_sd_configs` with one target per distinct address,
//! built from the registry's live agents, so the dashboard fills with no hand-kept target
//! list. Any coordinator answers for the whole bus: each one reads the registry bucket.

use std::collections::BTreeMap;

use chorus_sdk::AgentRecord;
use chorus_sdk::registry::MetricsTarget;
use serde::Serialize;

/// One target group in the format of Prometheus's HTTP service discovery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TargetGroup {
    /// `host:port`, one per group.
    pub targets: Vec<String>,
    /// `__scheme__` and `__metrics_path__` for the scrape, and `chorus_agents`: the ids of
    /// the live agents that announced this target, comma-separated.
    pub labels: BTreeMap<String, String>,
}

/// The target groups of `agents`: one per announced metrics address, agents sharing a
/// process (and so an address) under one target; announcements that are not an
/// `http[s]://host:port[/path]` URL are left out.
pub fn target_groups(agents: &[AgentRecord]) -> Vec<TargetGroup> {
    let mut by_target: BTreeMap<MetricsTarget, Vec<&str>> = BTreeMap::new();
    for record in agents {
        let Some(target) = record
            .manifest
            .metrics_url
            .as_deref()
            .and_then(MetricsTarget::parse)
        else {
            continue;
        };
        by_target
            .entry(target)
            .or_default()
            .push(&record.manifest.agent);
    }
    by_target
        .into_iter()
        .map(|(target, mut ids)| {
            ids.sort_unstable();
            ids.dedup();
            TargetGroup {
                targets: vec![target.address],
                labels: BTreeMap::from([
                    ("__scheme__".to_owned(), target.scheme),
                    ("__metrics_path__".to_owned(), target.path),
                    ("chorus_agents".to_owned(), ids.join(",")),
                ]),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_sdk::registry::Manifest;

    fn record(id: &str, url: Option<&str>) -> AgentRecord {
        let manifest: Manifest = serde_json::from_value(serde_json::json!({
            "agent": id,
            "instance": "i1",
            "heartbeat_ms": 5000,
            "started_ms": 0,
            "metrics_url": url,
        }))
        .expect("manifest");
        AgentRecord {
            manifest,
            last_seen_ms: 0,
            eta_ms: None,
        }
    }

    #[test]
    fn agents_of_one_process_share_a_target_and_bad_urls_are_left_out() {
        let groups = target_groups(&[
            record("b", Some("http://10.0.0.5:9465/metrics")),
            record("a", Some("http://10.0.0.5:9465/metrics")),
            record("c", Some("https://agents.example:443/custom/path")),
            record("d", None),
            record("e", Some("ftp://10.0.0.5:21/")),
            record("f", Some("http://no-port/metrics")),
            record("g", Some("http://10.0.0.5:99999/metrics")),
        ]);
        let json = serde_json::to_value(&groups).expect("json");
        assert_eq!(
            json,
            serde_json::json!([
                {"targets": ["10.0.0.5:9465"], "labels": {
                    "__scheme__": "http", "__metrics_path__": "/metrics", "chorus_agents": "a,b"}},
                {"targets": ["agents.example:443"], "labels": {
                    "__scheme__": "https", "__metrics_path__": "/custom/path", "chorus_agents": "c"}},
            ])
        );
    }

    #[test]
    fn a_url_without_a_path_is_scraped_at_metrics() {
        let groups = target_groups(&[record("a", Some("http://127.0.0.1:9465"))]);
        assert_eq!(groups[0].labels["__metrics_path__"], "/metrics");
    }
}
