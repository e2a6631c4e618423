//! Load-aware routing of capability calls ([`Routing::LeastLoaded`]): the call goes to the
//! live holder of the capability with the lowest load, as the registry last heard it plus the
//! share of its handler slots this agent's own calls to it are using now, instead of whichever
//! member of the access point's queue group the server picks.
//!
//! Each agent keeps, per capability, the holders discovery returned, for `refresh` (the
//! registry's view of load changes with each heartbeat, so asking it per call would double
//! every call's cost), and counts its own calls in flight to each holder, which moves the next
//! call away from a holder that is slow to answer long before a heartbeat says so. Holders of
//! equal load take turns. When discovery fails or finds no holder (no coordinator, no registry
//! yet), the call goes to the queue group, as without routing; so does a call whose chosen
//! holder has gone (no responders), once, after the view is dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::protocol::registry::{AgentRecord, Availability};
use crate::sync::lock;

/// How a capability call picks the agent that answers it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Routing {
    /// The access point's queue group: the server picks a member at random.
    #[default]
    QueueGroup,
    /// The least-loaded live holder by the registry's view and this agent's own calls in
    /// flight; the queue group when the registry knows none.
    LeastLoaded,
}

/// How long a capability's holders are used before discovery is asked again, by default.
pub const DEFAULT_ROUTING_REFRESH: Duration = Duration::from_secs(1);

/// The longest a routing lookup waits for discovery before the call goes to the queue group.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);

/// A holder of a capability, as the registry last described it.
#[derive(Debug, Clone)]
struct Holder {
    agent: String,
    load: f32,
    /// Handler slots (at least 1): one call of ours in flight adds `1 / slots` to its load.
    slots: u32,
}

struct View {
    at: Instant,
    holders: Arc<[Holder]>,
}

/// Each agent's routing state.
pub(crate) struct Router {
    refresh: Duration,
    views: Mutex<HashMap<String, View>>,
    in_flight: Arc<Mutex<HashMap<String, u32>>>,
    turn: AtomicUsize,
}

/// A call in flight to one holder: counted while it lives.
pub(crate) struct InFlight {
    agent: String,
    counts: Arc<Mutex<HashMap<String, u32>>>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut counts = lock(&self.counts);
        if let Some(n) = counts.get_mut(&self.agent) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.agent);
            }
        }
    }
}

impl Router {
    pub(crate) fn new(refresh: Duration) -> Self {
        Router {
            refresh,
            views: Mutex::new(HashMap::new()),
            in_flight: Arc::new(Mutex::new(HashMap::new())),
            turn: AtomicUsize::new(0),
        }
    }

    /// How long discovery may take before the call goes on without it.
    pub(crate) fn lookup_timeout(call_timeout: Duration) -> Duration {
        call_timeout.min(LOOKUP_TIMEOUT)
    }

    /// The holders of `capability` if a fresh view is kept, else `None` (look them up).
    pub(crate) fn cached(&self, capability: &str) -> Option<usize> {
        let views = lock(&self.views);
        views
            .get(capability)
            .filter(|v| v.at.elapsed() < self.refresh)
            .map(|v| v.holders.len())
    }

    /// Keeps what discovery returned for `capability` (nothing, when it failed: the queue
    /// group serves until the next refresh).
    pub(crate) fn learn(&self, capability: &str, records: &[AgentRecord]) {
        let holders: Arc<[Holder]> = records
            .iter()
            .filter(|r| r.manifest.availability != Availability::Away)
            .map(|r| Holder {
                agent: r.manifest.agent.clone(),
                load: r.manifest.load.clamp(0.0, 1.0),
                slots: r.manifest.slots.unwrap_or(1).max(1),
            })
            .collect();
        lock(&self.views).insert(
            capability.to_owned(),
            View {
                at: Instant::now(),
                holders,
            },
        );
    }

    /// Drops what is known of `capability` (its chosen holder was not there).
    pub(crate) fn forget(&self, capability: &str) {
        lock(&self.views).remove(capability);
    }

    /// The holder of `capability` to call now, counted in flight until the guard drops; `None`
    /// when none is known.
    pub(crate) fn choose(&self, capability: &str) -> Option<InFlight> {
        let holders = lock(&self.views).get(capability)?.holders.clone();
        let mut counts = lock(&self.in_flight);
        let score = |h: &Holder| {
            #[allow(clippy::cast_precision_loss)]
            let mine = f64::from(counts.get(&h.agent).copied().unwrap_or(0)) / f64::from(h.slots);
            f64::from(h.load) + mine
        };
        let best = holders.iter().map(score).min_by(f64::total_cmp)?;
        let tied: Vec<&Holder> = holders.iter().filter(|h| score(h) <= best + 1e-6).collect();
        let chosen = tied[self.turn.fetch_add(1, Ordering::Relaxed) % tied.len()];
        tracing::trace!(%capability, chosen = %chosen.agent, score = best, "routed by load");
        *counts.entry(chosen.agent.clone()).or_insert(0) += 1;
        Some(InFlight {
            agent: chosen.agent.clone(),
            counts: Arc::clone(&self.in_flight),
        })
    }
}

impl InFlight {
    /// The chosen holder.
    pub(crate) fn agent(&self) -> &str {
        &self.agent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::registry::Manifest;

    fn record(agent: &str, load: f32, slots: u32) -> AgentRecord {
        let manifest: Manifest = serde_json::from_value(serde_json::json!({
            "agent": agent, "instance": "0", "heartbeat_ms": 1000, "started_ms": 0,
            "load": load, "slots": slots,
        }))
        .expect("a manifest");
        AgentRecord {
            manifest,
            last_seen_ms: 0,
            eta_ms: None,
        }
    }

    #[test]
    fn the_least_loaded_holder_is_chosen_and_own_calls_count() {
        let router = Router::new(Duration::from_secs(60));
        assert!(
            router.choose("ocr").is_none(),
            "nothing known: the queue group"
        );
        router.learn(
            "ocr",
            &[
                record("busy", 0.9, 4),
                record("idle", 0.0, 2),
                record("half", 0.5, 4),
            ],
        );
        assert_eq!(router.cached("ocr"), Some(3));
        // idle takes calls until its own share passes half's load: 0, then 0.5 (tied with
        // half: they take turns), then 1.0.
        let first = router.choose("ocr").expect("a holder");
        assert_eq!(first.agent(), "idle");
        let second = router.choose("ocr").expect("a holder");
        let third = router.choose("ocr").expect("a holder");
        let mut pair = [second.agent().to_owned(), third.agent().to_owned()];
        pair.sort();
        assert_eq!(pair, ["half", "idle"]);
        // Calls that end give their share back: with none in flight, idle again.
        drop((first, second, third));
        assert_eq!(router.choose("ocr").expect("a holder").agent(), "idle");
        router.forget("ocr");
        assert!(router.choose("ocr").is_none());
    }

    #[test]
    fn an_empty_or_stale_view_sends_calls_to_the_queue_group() {
        let router = Router::new(Duration::ZERO);
        router.learn("ocr", &[]);
        assert!(router.choose("ocr").is_none());
        assert_eq!(router.cached("ocr"), None, "stale at once with refresh 0");
    }
}
