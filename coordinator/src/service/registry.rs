//! The agent registry: heartbeats in, a JetStream key-value bucket as the record, discovery
//! out.
//!
//! Every coordinator hears every heartbeat (a plain subscription), so each knows who is live.
//! Writes to the bucket are conditional (create, delete at a revision), so when several
//! coordinators see the same join or departure exactly one write wins, and only the winner
//! announces it. Nothing here is lost when a coordinator restarts: the bucket is reloaded and
//! live agents heartbeat again within one interval.

use std::collections::HashMap;
use std::sync::Mutex;

use agent_sdk::codec::{self, decode_payload, encode_payload};
use agent_sdk::envelope::{CONTENT_TYPE_MSGPACK, now_ms};
use agent_sdk::{
    AgentRecord, DiscoverQuery, Envelope, HandlerError, Kind, Manifest, Output, Performative,
    StatusCode,
};
use broker_adapter::{Broker, ErrorKind, Kv, KvEntry, KvOp};
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
    registered: bool,
}

/// The registry as one coordinator sees it.
pub(crate) struct Registry {
    subjects: agent_sdk::Subjects,
    broker: Broker,
    kv: Kv,
    missed: u32,
    agents: Mutex<HashMap<String, Live>>,
}

impl Registry {
    pub(crate) fn new(subjects: agent_sdk::Subjects, broker: Broker, kv: Kv, missed: u32) -> Self {
        Registry {
            subjects,
            broker,
            kv,
            missed,
            agents: Mutex::new(HashMap::new()),
        }
    }

    fn agents(&self) -> std::sync::MutexGuard<'_, HashMap<String, Live>> {
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
                let live = agents.entry(entry.key).or_insert_with(|| Live {
                    // Known from the bucket only: give it a full window to heartbeat.
                    last_seen_ms: now_ms(),
                    manifest: record.manifest.clone(),
                    registered: true,
                });
                live.registered = true;
            }
            KvOp::Delete => {
                agents.remove(&entry.key);
            }
        }
    }

    /// Handles a heartbeat: refresh the agent, and register it if the bucket lacks it.
    pub(crate) async fn on_heartbeat(&self, env: &Envelope, subject: &str) {
        let Some(manifest) = decode_presence(env, subject) else {
            metrics()
                .messages
                .with_label_values(&["heartbeat", StatusCode::DATA_FORMAT.label()])
                .inc();
            return;
        };
        metrics()
            .messages
            .with_label_values(&["heartbeat", StatusCode::OK.label()])
            .inc();
        let now = now_ms();
        let write = {
            let mut agents = self.agents();
            let live = agents
                .entry(manifest.agent.clone())
                .or_insert_with(|| Live {
                    manifest: manifest.clone(),
                    last_seen_ms: now,
                    registered: false,
                });
            let changed = !same_record(&live.manifest, &manifest);
            live.manifest = manifest.clone();
            live.last_seen_ms = now;
            if !live.registered {
                Some(true)
            } else if changed {
                Some(false)
            } else {
                None
            }
        };
        let Some(create) = write else { return };
        let record = AgentRecord {
            manifest: manifest.clone(),
            last_seen_ms: now,
        };
        let Ok(value) = serde_json::to_vec(&record) else {
            return;
        };
        let key = manifest.agent.as_str();
        let result = if create {
            self.kv.create(key, value.into()).await
        } else {
            self.kv.put(key, value.into()).await
        };
        match result {
            Ok(_) => {
                if let Some(live) = self.agents().get_mut(key) {
                    live.registered = true;
                }
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
            Err(e) if e.kind() == ErrorKind::Conflict => {
                if let Some(live) = self.agents().get_mut(key) {
                    live.registered = true;
                }
            }
            Err(e) => tracing::warn!(agent = key, error = %e, "registry write failed"),
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
        for manifest in gone {
            self.remove(&manifest, "missed heartbeats").await;
        }
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
    }

    async fn remove(&self, manifest: &Manifest, reason: &str) {
        let key = manifest.agent.as_str();
        let entry = match self.kv.get(key).await {
            Ok(Some(entry)) => entry,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(agent = key, error = %e, "registry read failed");
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
            Err(e) => tracing::warn!(agent = key, error = %e, "registry delete failed"),
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
        env.topic = Some(topic.to_owned());
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
        if let Ok(bytes) = codec::encode(&env, codec::Encoding::MsgPack)
            && let Err(e) = self.broker.publish(&subject, bytes).await
        {
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

    /// Live agents matching `query`, least loaded first (ties by id).
    pub(crate) fn discover(&self, query: &DiscoverQuery) -> Vec<AgentRecord> {
        let now = now_ms();
        let agents = self.agents();
        let mut found: Vec<AgentRecord> = agents
            .values()
            .filter(|l| self.is_live(l, now) && query.matches(&l.manifest))
            .map(|l| AgentRecord {
                manifest: l.manifest.clone(),
                last_seen_ms: l.last_seen_ms,
            })
            .collect();
        found.sort_by(|a, b| {
            a.manifest
                .load
                .total_cmp(&b.manifest.load)
                .then_with(|| a.manifest.agent.cmp(&b.manifest.agent))
        });
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
    (manifest.agent == subject_agent && env.from == subject_agent).then_some(manifest)
}

/// Whether two manifests would be stored the same (load and availability change constantly
/// and are served from memory, so they do not cause writes).
fn same_record(a: &Manifest, b: &Manifest) -> bool {
    a.instance == b.instance
        && a.capabilities == b.capabilities
        && a.commands == b.commands
        && a.groups == b.groups
        && a.public_key == b.public_key
}
