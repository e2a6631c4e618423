//! The agent registry: heartbeats in, a JetStream key-value bucket as the record, discovery
//! out.
//!
//! Every coordinator hears every heartbeat (a plain subscription), so each knows who is live.
//! Writes to the bucket are conditional (create, delete at a revision), so when several
//! coordinators see the same join or departure exactly one write wins, and only the winner
//! announces it. Nothing here is lost when a coordinator restarts: the bucket is reloaded and
//! live agents heartbeat again within one interval.

use chorus_sdk::Report;
use futures::StreamExt;
use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use chorus_broker_adapter::{Broker, ErrorKind, Kv, KvEntry, KvOp};
use chorus_sdk::codec::{self, decode_payload, encode_payload};
use chorus_sdk::envelope::{CONTENT_TYPE_MSGPACK, now_ms};
use chorus_sdk::registry::{MAX_HEARTBEAT_FLOOR, WireLevel};
use chorus_sdk::{
    AgentRecord, DiscoverQuery, Envelope, HandlerError, Kind, Manifest, Output, Performative,
    StatusCode,
};
use serde::{Deserialize, Serialize};

use super::COORDINATOR_ID;
use super::metrics::metrics;

/// The reason of a `registry.left` event for an agent that said goodbye.
pub const GOODBYE: &str = "goodbye";

/// The payload of `registry.joined` and `registry.left` events (their status: 5001 joined,
/// 5003 left with a goodbye, 5009 left without one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryEvent {
    /// The agent.
    pub agent: String,
    /// Its instance.
    pub instance: String,
    /// Why it left (`goodbye`, `missed heartbeats`); empty for joins.
    #[serde(default)]
    pub reason: String,
}

struct Live {
    manifest: Manifest,
    last_seen_ms: u64,
    /// In the bucket.
    registered: bool,
    /// A write of it is queued or in flight.
    writing: bool,
    /// What the bucket holds of it is older than `manifest`.
    dirty: bool,
    /// The heartbeat floor this coordinator told it in a [`WIRE_NOTIFICATION`](chorus_sdk::registry::WIRE_NOTIFICATION), once per
    /// floor.
    told_floor: Option<u64>,
}

/// [`MAX_HEARTBEAT_FLOOR`] in milliseconds: agents take no longer floor.
const MAX_FLOOR_MS: u64 = MAX_HEARTBEAT_FLOOR.as_secs() * 1000;

/// Registry writes waiting for the writer at most. A heartbeat that finds the queue full
/// leaves its agent as it was (unregistered, or changed), and its next heartbeat asks again.
pub const REGISTRY_WRITES_QUEUED: usize = 16_384;
/// Registry writes (and their `registry.joined` events) in flight at once.
pub const REGISTRY_WRITES_IN_FLIGHT: usize = 64;

/// A write the registry's writer is to make: an agent's record, created when it joins or
/// put when it changed.
pub(crate) struct Write {
    manifest: Manifest,
    seen_ms: u64,
    create: bool,
}

/// The agents one coordinator knows, with the ids of those offering each capability and in
/// each group: discovery by capability and a broadcast to a group or capability look at those
/// only, not at every agent (at 100,000 agents a scan takes milliseconds). Reads go through
/// `Deref`; every change goes through the methods below, which keep the indexes in step.
#[derive(Default)]
struct Table {
    live: HashMap<String, Live>,
    /// What this coordinator last announced on `sys.wire`.
    said: Option<WireLevel>,
    by_capability: HashMap<String, BTreeSet<String>>,
    by_group: HashMap<String, BTreeSet<String>>,
}

impl std::ops::Deref for Table {
    type Target = HashMap<String, Live>;
    fn deref(&self) -> &Self::Target {
        &self.live
    }
}

impl Table {
    /// Adds `live` as `id`, or replaces what was known of it.
    fn put(&mut self, id: String, live: Live) {
        if let Some(old) = self.live.get(&id)
            && old.manifest.capabilities == live.manifest.capabilities
            && old.manifest.groups == live.manifest.groups
        {
            self.live.insert(id, live);
            return;
        }
        self.unindex(&id);
        for c in &live.manifest.capabilities {
            self.by_capability
                .entry(c.name.clone())
                .or_default()
                .insert(id.clone());
        }
        for g in &live.manifest.groups {
            self.by_group
                .entry(g.clone())
                .or_default()
                .insert(id.clone());
        }
        self.live.insert(id, live);
    }

    /// Removes `id`.
    fn remove(&mut self, id: &str) -> Option<Live> {
        self.unindex(id);
        self.live.remove(id)
    }

    /// Marks `id` as written to the bucket.
    fn mark_registered(&mut self, id: &str) {
        if let Some(live) = self.live.get_mut(id) {
            live.registered = true;
        }
    }

    /// Notes a heartbeat carrying `manifest` at `now`; whether its record is to be written
    /// (`Some(true)`: created, `Some(false)`: put), marking the write begun. One write per
    /// agent at a time: a change made meanwhile is written after it.
    fn heard(&mut self, manifest: &Manifest, now: u64) -> Option<bool> {
        let (registered, writing, dirty, told_floor) =
            self.live
                .get(&manifest.agent)
                .map_or((false, false, true, None), |l| {
                    (
                        l.registered,
                        l.writing,
                        l.dirty || !same_record(&l.manifest, manifest),
                        l.told_floor,
                    )
                });
        let due = (!registered || dirty) && !writing;
        self.put(
            manifest.agent.clone(),
            Live {
                manifest: manifest.clone(),
                last_seen_ms: now,
                registered,
                writing: writing || due,
                dirty: dirty && !due,
                told_floor,
            },
        );
        due.then_some(!registered)
    }

    /// What to tell `id`, whose heartbeats say they come every `heartbeat_ms`, in a
    /// notification: the last announcement, when they come faster than its floor (bounded,
    /// as agents bound it) and `id` has not been told this floor yet (a newcomer, or an
    /// agent that missed the announcement).
    fn tell_floor(&mut self, id: &str, heartbeat_ms: u64) -> Option<WireLevel> {
        let said = self.said?;
        let floor_ms = said.heartbeat_ms?.min(MAX_FLOOR_MS);
        let live = self.live.get_mut(id)?;
        if heartbeat_ms >= floor_ms || live.told_floor == Some(floor_ms) {
            return None;
        }
        live.told_floor = Some(floor_ms);
        Some(said)
    }

    /// Ends the write of `id`: stored, or not (its next heartbeat asks again).
    fn written(&mut self, id: &str, stored: bool) {
        if let Some(live) = self.live.get_mut(id) {
            live.writing = false;
            if stored {
                live.registered = true;
            } else {
                live.dirty = true;
            }
        }
    }

    fn unindex(&mut self, id: &str) {
        let Some(old) = self.live.get(id) else { return };
        for c in &old.manifest.capabilities {
            if let Some(ids) = self.by_capability.get_mut(&c.name) {
                ids.remove(id);
                if ids.is_empty() {
                    self.by_capability.remove(&c.name);
                }
            }
        }
        for g in &old.manifest.groups {
            if let Some(ids) = self.by_group.get_mut(g) {
                ids.remove(id);
                if ids.is_empty() {
                    self.by_group.remove(g);
                }
            }
        }
    }

    /// The agents `query` could match: those of its capability or group when it names one
    /// (the smaller set when it names both), every agent otherwise.
    fn candidates<'a>(&'a self, query: &DiscoverQuery) -> Box<dyn Iterator<Item = &'a Live> + 'a> {
        // One named capability narrows the candidates; `matches` checks the others.
        let named = query.capability.as_ref().or(query.capabilities.first());
        let by_capability = named.map(|c| self.by_capability.get(c));
        let by_group = query.group.as_ref().map(|g| self.by_group.get(g));
        let ids = match (by_capability, by_group) {
            (None, None) => return Box::new(self.live.values()),
            // Named, and nobody offers it or is in it.
            (Some(None), _) | (_, Some(None)) => return Box::new(std::iter::empty()),
            (Some(Some(ids)), None) | (None, Some(Some(ids))) => ids,
            (Some(Some(a)), Some(Some(b))) => {
                if a.len() <= b.len() {
                    a
                } else {
                    b
                }
            }
        };
        Box::new(ids.iter().filter_map(|id| self.live.get(id)))
    }
}

/// The registry as one coordinator sees it.
pub(crate) struct Registry {
    subjects: chorus_sdk::Subjects,
    broker: Broker,
    /// The registry events' numbers (`seq`), per topic.
    numbers: chorus_sdk::EventNumbers,
    /// The key its events are signed with, as `coordinator`: a requester that verifies takes a
    /// `registry.left` only from it.
    identity: Option<std::sync::Arc<chorus_sdk::security::Identity>>,
    kv: Kv,
    missed: u32,
    agents: Mutex<Table>,
    /// Writes for the writer ([`Registry::writer`]): a heartbeat never waits for the bucket,
    /// so a burst of joins (100,000 agents starting within a minute) does not hold the
    /// heartbeat handlers and make the known agents' heartbeats drop on a full queue.
    writes: tokio::sync::mpsc::Sender<Write>,
    queued: Mutex<Option<tokio::sync::mpsc::Receiver<Write>>>,
}

impl Registry {
    pub(crate) fn new(
        subjects: chorus_sdk::Subjects,
        broker: Broker,
        kv: Kv,
        missed: u32,
        identity: Option<std::sync::Arc<chorus_sdk::security::Identity>>,
    ) -> Self {
        let (writes, queued) = tokio::sync::mpsc::channel(REGISTRY_WRITES_QUEUED);
        Registry {
            subjects,
            broker,
            numbers: chorus_sdk::EventNumbers::default(),
            identity,
            kv,
            missed,
            agents: Mutex::new(Table::default()),
            writes,
            queued: Mutex::new(Some(queued)),
        }
    }

    /// Notes what this coordinator announced on `sys.wire`.
    pub(crate) fn said(&self, level: WireLevel) {
        self.agents().said = Some(level);
    }

    /// The queue of writes, for the one writer (none the second time).
    pub(crate) fn writes(&self) -> Option<tokio::sync::mpsc::Receiver<Write>> {
        self.queued.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn agents(&self) -> std::sync::MutexGuard<'_, Table> {
        self.agents.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn is_live(&self, live: &Live, now: u64) -> bool {
        let window = live.manifest.heartbeat_ms.max(1) * u64::from(self.missed);
        now.saturating_sub(live.last_seen_ms) <= window
    }

    /// Applies one bucket entry or change (from the watch).
    pub(crate) fn apply_kv(&self, entry: KvEntry) {
        let mut agents = self.agents();
        match entry.op {
            KvOp::Put => {
                let Ok(record) = serde_json::from_slice::<AgentRecord>(&entry.value) else {
                    tracing::warn!(key = %entry.key, "registry entry does not decode; ignored");
                    return;
                };
                if agents.contains_key(&entry.key) {
                    agents.mark_registered(&entry.key);
                } else {
                    agents.put(
                        entry.key,
                        Live {
                            // Known from the bucket only: give it a full window to heartbeat.
                            last_seen_ms: now_ms(),
                            manifest: record.manifest,
                            registered: true,
                            writing: false,
                            dirty: false,
                            told_floor: None,
                        },
                    );
                }
            }
            KvOp::Delete => {
                agents.remove(&entry.key);
            }
        }
    }

    /// Handles a heartbeat: refresh the agent, and register it if the bucket lacks it. Returns
    /// the agent and what to tell it in a [`WIRE_NOTIFICATION`](chorus_sdk::registry::WIRE_NOTIFICATION) when its heartbeats come
    /// faster than the floor last announced, once per floor (a newcomer hears the floor at
    /// its first heartbeat, not at the next announcement, which can be 100 s away at 100,000
    /// agents).
    pub(crate) async fn on_heartbeat(
        &self,
        env: &Envelope,
        subject: &str,
    ) -> Option<(String, WireLevel)> {
        let Some(manifest) = decode_presence(env, subject) else {
            metrics()
                .messages
                .with_label_values(&["heartbeat", StatusCode::DATA_FORMAT.label()])
                .inc();
            return None;
        };
        metrics()
            .messages
            .with_label_values(&["heartbeat", StatusCode::OK.label()])
            .inc();
        let now = now_ms();
        let (write, told) = {
            let mut agents = self.agents();
            let write = agents.heard(&manifest, now);
            let told = agents
                .tell_floor(&manifest.agent, manifest.heartbeat_ms)
                .map(|level| (manifest.agent.clone(), level));
            (write, told)
        };
        let Some(create) = write else {
            return told;
        };
        let id = manifest.agent.clone();
        let write = Write {
            manifest,
            seen_ms: now,
            create,
        };
        if self.writes.try_send(write).is_err() {
            tracing::debug!(agent = %id, "registry writes queued to the limit: its next heartbeat asks again");
            self.agents().written(&id, false);
        }
        told
    }

    /// Makes one write the heartbeats asked for, and announces a join.
    pub(crate) async fn store(&self, write: Write) {
        let Write {
            manifest,
            seen_ms,
            create,
        } = write;
        let key = manifest.agent.as_str();
        let record = AgentRecord {
            manifest: manifest.clone(),
            last_seen_ms: seen_ms,
            eta_ms: None,
        };
        let Ok(value) = serde_json::to_vec(&record) else {
            self.agents().written(key, false);
            return;
        };
        let result = if create {
            self.kv.create(key, value.into()).await
        } else {
            self.kv.put(key, value.into()).await
        };
        match result {
            Ok(_) => {
                self.agents().written(key, true);
                if create {
                    tracing::info!(agent = key, instance = %manifest.instance, "agent joined");
                    metrics()
                        .registry_events
                        .with_label_values(&["joined"])
                        .inc();
                    self.announce("registry.joined", &manifest, "").await;
                }
            }
            // Another coordinator registered it first.
            Err(e) if e.kind() == ErrorKind::Conflict => self.agents().written(key, true),
            Err(e) => {
                tracing::warn!(agent = key, error = %Report(&e), "registry write failed");
                self.agents().written(key, false);
            }
        }
    }

    /// Handles a goodbye: the agent leaves at once.
    pub(crate) async fn on_goodbye(&self, env: &Envelope, subject: &str) {
        let Some(manifest) = decode_presence(env, subject) else {
            return;
        };
        self.agents().remove(&manifest.agent);
        self.remove(&manifest, GOODBYE).await;
    }

    /// Declares gone every agent silent for more than the allowed heartbeats.
    pub(crate) async fn reap(&self) {
        let now = now_ms();
        let gone: Vec<Manifest> = {
            let mut agents = self.agents();
            let ids: Vec<String> = agents
                .iter()
                .filter(|(_, live)| !self.is_live(live, now))
                .map(|(id, _)| id.clone())
                .collect();
            ids.into_iter()
                .filter_map(|id| agents.remove(&id).map(|l| l.manifest))
                .collect()
        };
        // The gauges first: removing many agents from the bucket takes a while.
        let (registered, live) = {
            let agents = self.agents();
            (
                agents.values().filter(|l| l.registered).count(),
                agents.values().filter(|l| self.is_live(l, now)).count(),
            )
        };
        let m = metrics();
        m.agents
            .with_label_values(&["registered"])
            .set(i64::try_from(registered).unwrap_or(i64::MAX));
        m.agents
            .with_label_values(&["live"])
            .set(i64::try_from(live).unwrap_or(i64::MAX));
        let removals: Vec<_> = gone
            .iter()
            .map(|manifest| self.remove(manifest, "missed heartbeats"))
            .collect();
        futures::stream::iter(removals)
            .buffer_unordered(REGISTRY_WRITES_IN_FLIGHT)
            .collect::<()>()
            .await;
    }

    async fn remove(&self, manifest: &Manifest, reason: &str) {
        let key = manifest.agent.as_str();
        let entry = match self.kv.get(key).await {
            Ok(Some(entry)) => entry,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(agent = key, error = %Report(&e), "registry read failed");
                return;
            }
        };
        // A newer instance re-registered meanwhile: it is not gone.
        if let Ok(record) = serde_json::from_slice::<AgentRecord>(&entry.value)
            && record.manifest.instance != manifest.instance
            && reason != GOODBYE
        {
            return;
        }
        match self.kv.delete_if(key, entry.revision).await {
            Ok(()) => {
                tracing::info!(agent = key, reason, "agent left");
                metrics().registry_events.with_label_values(&["left"]).inc();
                self.announce("registry.left", manifest, reason).await;
            }
            Err(e) if e.kind() == ErrorKind::Conflict => {}
            Err(e) => tracing::warn!(agent = key, error = %Report(&e), "registry delete failed"),
        }
    }

    async fn announce(&self, topic: &str, manifest: &Manifest, reason: &str) {
        let event = RegistryEvent {
            agent: manifest.agent.clone(),
            instance: manifest.instance.clone(),
            reason: reason.to_owned(),
        };
        let Ok(subject) = self.subjects.event(topic) else {
            return;
        };
        let mut env = Envelope::new(Kind::Event, Performative::Inform, COORDINATOR_ID);
        env.topic = Some(topic.into());
        // AIXP's codes for an agent's arrival and departure, orderly or not.
        env.status = Some(if topic.ends_with("joined") {
            StatusCode::CONNECTED
        } else if reason == GOODBYE {
            StatusCode::DISCONNECTED
        } else {
            StatusCode::UNEXPECTED_DISCONNECT
        });
        let Ok(payload) = encode_payload(&event, CONTENT_TYPE_MSGPACK) else {
            return;
        };
        env.payload = payload;
        let sent = self
            .numbers
            .publish(&subject, &mut env, |env| {
                let mut env = env.clone();
                if let Some(identity) = &self.identity {
                    identity.sign(&subject, &mut env);
                }
                let bytes = codec::encode(&env, codec::Encoding::MsgPack);
                async {
                    let bytes = bytes.map_err(|e| e.to_string())?;
                    self.broker
                        .publish(&subject, bytes)
                        .await
                        .map_err(|e| Report(&e).to_string())
                }
            })
            .await;
        if let Err(e) = sent {
            tracing::warn!(topic, error = %e, "registry event not published");
        }
    }

    /// The signing key `agent` announced in its manifest, while it is live.
    pub(crate) fn public_key_of(&self, agent: &str) -> Option<String> {
        let now = now_ms();
        let agents = self.agents();
        agents
            .get(agent)
            .filter(|l| self.is_live(l, now))
            .and_then(|l| l.manifest.public_key.clone())
    }

    /// The newest protocol major every live agent reads: 2 when each one's manifest says it
    /// reads the compact form (or no agent is live), 1 otherwise.
    /// Also how many agents are live, so a newcomer can be told soon.
    pub(crate) fn wire_level(&self) -> (u16, usize) {
        let now = now_ms();
        let agents = self.agents();
        let (mut live, mut all_compact) = (0, true);
        for l in agents.values().filter(|l| self.is_live(l, now)) {
            live += 1;
            all_compact &= l.manifest.reads(2);
        }
        (if all_compact { 2 } else { 1 }, live)
    }

    /// Live agents matching `query`, each with its ETA for the query's work: least loaded
    /// first, or soonest first (unknown last) when the query names a priority; ties by load,
    /// then id.
    pub(crate) fn discover(&self, query: &DiscoverQuery) -> Vec<AgentRecord> {
        let now = now_ms();
        let named = query.named();
        let priority = query.priority.unwrap_or_default();
        let agents = self.agents();
        let mut found: Vec<AgentRecord> = agents
            .candidates(query)
            .filter(|l| self.is_live(l, now) && query.matches(&l.manifest))
            .map(|l| AgentRecord {
                eta_ms: l.manifest.eta_at(priority, &named),
                manifest: l.manifest.clone(),
                last_seen_ms: l.last_seen_ms,
            })
            .collect();
        drop(agents);
        let by_load = |a: &AgentRecord, b: &AgentRecord| {
            a.manifest
                .load
                .total_cmp(&b.manifest.load)
                .then_with(|| a.manifest.agent.cmp(&b.manifest.agent))
        };
        if query.priority.is_some() {
            // `None` sorts first as an Option: unknown ETAs go last.
            found.sort_by(|a, b| {
                (a.eta_ms.is_none(), a.eta_ms)
                    .cmp(&(b.eta_ms.is_none(), b.eta_ms))
                    .then_with(|| by_load(a, b))
            });
        } else {
            found.sort_by(by_load);
        }
        found
    }

    /// Answers a discovery request (admitted by the inbound pipeline), in its content type.
    pub(crate) fn on_discover(&self, env: &Envelope) -> Result<Output, HandlerError> {
        let result = decode_payload::<DiscoverQuery>(&env.payload, &env.content_type)
            .map_err(HandlerError::from)
            .and_then(|query| {
                let found = self.discover(&query);
                Ok(Output {
                    payload: encode_payload(&found, &env.content_type)?,
                    content_type: env.content_type.clone(),
                })
            });
        let status = result
            .as_ref()
            .map_or_else(|e| e.status, |_| StatusCode::OK);
        metrics()
            .messages
            .with_label_values(&["request", status.label()])
            .inc();
        result
    }
}

/// The manifest in a heartbeat or goodbye, if the message is one and names its own sender.
fn decode_presence(env: &Envelope, subject: &str) -> Option<Manifest> {
    let manifest: Manifest = decode_payload(&env.payload, &env.content_type).ok()?;
    let subject_agent = subject.rsplit('.').next()?;
    (manifest.agent == subject_agent
        && env.from == subject_agent
        && follows_the_naming_rules(&manifest))
    .then_some(manifest)
}

/// Whether the ids and names a manifest announces follow the naming rules (PROTOCOL.md
/// section 3): a server lets any token through a subject, so `<svg/onload=...>` would
/// otherwise be registered, listed and offered as a tool name.
fn follows_the_naming_rules(m: &Manifest) -> bool {
    use chorus_sdk::subject::{validate_dotted, validate_token};
    validate_token("agent id", &m.agent).is_ok()
        // The coordinator's id is its own: an agent registering it would give every agent
        // that learns keys from the registry a key for the coordinator's word.
        && m.agent != crate::service::COORDINATOR_ID
        && m.capabilities
            .iter()
            .all(|c| validate_dotted("capability", &c.name).is_ok())
        && m.commands
            .iter()
            .all(|c| validate_token("command", c).is_ok())
        && m.groups.iter().all(|g| validate_token("group", g).is_ok())
}

/// Whether two manifests would be stored the same (load, availability, handling times, what
/// waits and the ETA change constantly and are served from memory, so they do not cause
/// writes).
fn same_record(a: &Manifest, b: &Manifest) -> bool {
    fn offer(
        m: &Manifest,
    ) -> impl Iterator<Item = (&str, &str, &[String], Option<f64>, Option<u64>)> {
        m.capabilities.iter().map(|c| {
            (
                c.name.as_str(),
                c.version.as_str(),
                c.models.as_slice(),
                c.throughput,
                c.max_tokens,
            )
        })
    }
    a.instance == b.instance
        && offer(a).eq(offer(b))
        && a.customer == b.customer
        && a.commands == b.commands
        && a.groups == b.groups
        && a.public_key == b.public_key
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(id: &str, capabilities: &[&str], groups: &[&str]) -> Live {
        let manifest: Manifest = serde_json::from_value(serde_json::json!({
            "agent": id, "instance": "0", "heartbeat_ms": 1000, "started_ms": 0,
            "capabilities": capabilities.iter().map(|c| serde_json::json!({"name": c})).collect::<Vec<_>>(),
            "groups": groups,
        }))
        .expect("a manifest");
        Live {
            manifest,
            last_seen_ms: 0,
            registered: false,
            writing: false,
            dirty: false,
            told_floor: None,
        }
    }

    #[test]
    fn one_write_per_agent_at_a_time_and_a_change_made_meanwhile_is_written_after_it() {
        let mut table = Table::default();
        let first = live("a", &["ocr"], &[]).manifest;
        let mut changed = first.clone();
        changed.groups = vec!["night".into()];
        // A new agent is created; its heartbeats wait while the create is in flight, a change
        // among them.
        assert_eq!(table.heard(&first, 1), Some(true));
        assert_eq!(table.heard(&first, 2), None);
        assert_eq!(table.heard(&changed, 3), None);
        assert_eq!(
            table["a"].manifest.groups,
            ["night"],
            "served from memory at once"
        );
        // The create lands: the change is put at the next heartbeat, once.
        table.written("a", true);
        assert!(table["a"].registered);
        assert_eq!(table.heard(&changed, 4), Some(false));
        assert_eq!(table.heard(&changed, 5), None);
        table.written("a", true);
        assert_eq!(table.heard(&changed, 6), None, "nothing new: no write");
        // A write that fails (or finds the queue full) is asked for again by the next
        // heartbeat: a create for an agent not in the bucket yet.
        assert_eq!(table.heard(&first, 7), Some(false));
        table.written("a", false);
        assert_eq!(table.heard(&first, 8), Some(false));
        let other = live("b", &[], &[]).manifest;
        assert_eq!(table.heard(&other, 9), Some(true));
        table.written("b", false);
        assert!(!table["b"].registered);
        assert_eq!(table.heard(&other, 10), Some(true));
    }

    #[test]
    fn an_agent_beating_faster_than_the_floor_is_told_it_once_per_floor() {
        let floor = |ms: u64| {
            Some(WireLevel {
                major: 2,
                heartbeat_ms: Some(ms),
            })
        };
        let mut table = Table::default();
        let a = live("a", &[], &[]).manifest;
        table.heard(&a, 1);
        assert_eq!(table.tell_floor("a", 1_000), None, "nothing announced yet");
        table.said = floor(5_000);
        assert_eq!(table.tell_floor("b", 1_000), None, "not heard");
        assert_eq!(
            table.tell_floor("a", 1_000),
            floor(5_000),
            "a newcomer beating every second"
        );
        // Told: its next heartbeats, paced or not, do not ask again for the same floor.
        table.heard(&a, 2);
        assert_eq!(table.tell_floor("a", 1_000), None);
        assert_eq!(table.tell_floor("a", 5_000), None);
        // A new floor it beats faster than is told again; one it keeps to is not.
        table.said = floor(8_000);
        assert_eq!(table.tell_floor("a", 5_000), floor(8_000));
        table.said = floor(9_000);
        assert_eq!(table.tell_floor("a", 9_000), None);
        // A floor past the bound is told as agents take it: they beat every 120 s at most.
        table.said = floor(500_000);
        assert_eq!(table.tell_floor("a", 120_000), None);
        assert_eq!(table.tell_floor("a", 9_000), floor(500_000));
    }

    fn ids(table: &Table, query: &DiscoverQuery) -> Vec<String> {
        let mut ids: Vec<String> = table
            .candidates(query)
            .map(|l| l.manifest.agent.clone())
            .collect();
        ids.sort();
        ids
    }

    #[test]
    fn load_and_availability_change_no_stored_record_but_the_offer_does() {
        let before = live("a", &["ocr"], &["eu"]).manifest;
        let mut busier = before.clone();
        busier.load = 0.9;
        busier.availability = chorus_sdk::registry::Availability::Busy;
        busier.eta_ms = Some(5_000);
        busier.handling_ms = Some(40);
        busier.capabilities[0].handling_ms = Some(35);
        busier.waiting.high = 3;
        assert!(
            same_record(&before, &busier),
            "served from memory, not written"
        );
        let mut more = before.clone();
        more.capabilities = live("a", &["ocr", "tts"], &["eu"]).manifest.capabilities;
        assert!(!same_record(&before, &more));
        let mut restarted = before.clone();
        restarted.instance = "1".into();
        assert!(!same_record(&before, &restarted));
    }

    #[test]
    fn the_indexes_follow_every_change_of_a_manifest() {
        let mut table = Table::default();
        table.put("a".into(), live("a", &["ocr"], &["eu"]));
        table.put("b".into(), live("b", &["ocr", "tts"], &[]));
        table.put("c".into(), live("c", &["tts"], &["eu"]));
        let ocr = DiscoverQuery::capability("ocr");
        assert_eq!(ids(&table, &ocr), ["a", "b"]);
        let eu = DiscoverQuery {
            group: Some("eu".into()),
            ..DiscoverQuery::default()
        };
        assert_eq!(ids(&table, &eu), ["a", "c"]);
        // Both named: the smaller set, still filtered by the query afterwards.
        let both = DiscoverQuery {
            capability: Some("tts".into()),
            group: Some("eu".into()),
            ..DiscoverQuery::default()
        };
        assert!(ids(&table, &both).len() <= 2);
        assert_eq!(ids(&table, &DiscoverQuery::default()), ["a", "b", "c"]);

        // b stops offering ocr; a leaves; nobody offers what nobody registered.
        table.put("b".into(), live("b", &["tts"], &[]));
        assert_eq!(ids(&table, &ocr), ["a"]);
        table.remove("a");
        assert!(ids(&table, &ocr).is_empty());
        assert_eq!(ids(&table, &eu), ["c"]);
        assert!(
            !table.by_capability.contains_key("ocr"),
            "empty sets are dropped"
        );
        assert!(ids(&table, &DiscoverQuery::capability("nothing")).is_empty());
        // A heartbeat with the same offer keeps the indexes as they are.
        table.mark_registered("c");
        table.put("c".into(), live("c", &["tts"], &["eu"]));
        assert_eq!(ids(&table, &eu), ["c"]);
        assert_eq!(table.by_capability.get("tts").map(BTreeSet::len), Some(2));
    }
}
