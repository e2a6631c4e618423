//! An agent's presence: heartbeats carrying its manifest, a goodbye on shutdown, and answers
//! to NATS's own service discovery (`$SRV.PING`, `$SRV.INFO`, `$SRV.STATS`), so standard NATS
//! tooling (`nats micro ls`) lists Chorus agents.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use broker_adapter::Message;
use bytes::Bytes;
use serde_json::json;

use crate::agent::Inner;
use crate::codec;
use crate::envelope::{CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, Envelope, Kind, Performative};
use crate::handler::Handler;
use crate::registry::{CapabilityInfo, Manifest};
use crate::stats::AgentCounters;

/// A command or capability an agent serves, with the request counts `$SRV.STATS` reports.
pub(crate) struct Endpoint {
    pub(crate) name: String,
    pub(crate) subject: String,
    pub(crate) queue_group: Option<String>,
    pub(crate) is_capability: bool,
    pub(crate) handler: Arc<dyn Handler>,
    requests: AtomicU64,
    errors: AtomicU64,
    /// Permissions a sender must hold to be served here.
    pub(crate) required: std::sync::RwLock<Vec<String>>,
    processing_ns: AtomicU64,
    last_error: std::sync::Mutex<String>,
}

impl Endpoint {
    pub(crate) fn new(
        name: String,
        subject: String,
        queue_group: Option<String>,
        is_capability: bool,
        handler: Arc<dyn Handler>,
    ) -> Self {
        Endpoint {
            name,
            subject,
            queue_group,
            is_capability,
            handler,
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            required: std::sync::RwLock::new(Vec::new()),
            processing_ns: AtomicU64::new(0),
            last_error: std::sync::Mutex::new(String::new()),
        }
    }

    pub(crate) fn record(&self, took: Duration, error: Option<&str>) {
        AgentCounters::bump(&self.requests);
        self.processing_ns.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        if let Some(error) = error {
            AgentCounters::bump(&self.errors);
            if let Ok(mut last) = self.last_error.lock() {
                error.clone_into(&mut last);
            }
        }
    }
}

fn rfc3339(ms: u64) -> String {
    let nanos = i128::from(ms) * 1_000_000;
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

impl Inner {
    /// The manifest as of now.
    pub(crate) fn manifest(&self) -> Manifest {
        let endpoints = self.endpoints();
        let mut capabilities: Vec<CapabilityInfo> = crate::agent::lock(&self.capabilities)
            .iter()
            .map(|name| CapabilityInfo {
                name: name.clone(),
                version: self.capability_version.clone(),
            })
            .collect();
        capabilities.sort_by(|a, b| a.name.cmp(&b.name));
        let mut commands: Vec<String> = endpoints
            .iter()
            .filter(|e| !e.is_capability)
            .map(|e| e.name.clone())
            .collect();
        commands.sort();
        let (load, availability) = self.load_and_availability();
        Manifest {
            agent: self.id.clone(),
            instance: self.instance.clone(),
            capabilities,
            commands,
            groups: self.groups.clone(),
            content_types: vec![
                CONTENT_TYPE_MSGPACK.to_owned(),
                CONTENT_TYPE_JSON.to_owned(),
            ],
            load,
            availability,
            eta_ms: None,
            public_key: self.identity.as_ref().map(|i| i.public_key()),
            encryption_key: self.decryption.as_ref().map(|k| k.public_key()),
            heartbeat_ms: u64::try_from(self.heartbeat_interval.as_millis()).unwrap_or(u64::MAX),
            started_ms: self.started_ms,
            sdk_version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }

    async fn send_presence(&self, kind: Performative) -> Result<(), String> {
        let subject = match kind {
            Performative::Health => self.subjects.heartbeat(&self.id),
            _ => self.subjects.goodbye(&self.id),
        }
        .map_err(|e| e.to_string())?;
        let mut env = Envelope::new(Kind::Heartbeat, kind, self.id.as_str());
        env.content_type = CONTENT_TYPE_MSGPACK.to_owned();
        env.payload = codec::encode_payload(&self.manifest(), CONTENT_TYPE_MSGPACK)
            .map_err(|e| e.to_string())?;
        self.seal(&subject, &mut env);
        let bytes = codec::encode(&env, self.encoding).map_err(|e| e.to_string())?;
        self.broker
            .publish(&subject, bytes)
            .await
            .map_err(|e| e.to_string())
    }

    /// Heartbeats every interval (and at once when the manifest changes) until the agent
    /// stops; then a goodbye, so the registry drops it without waiting for missed beats.
    pub(crate) async fn presence_loop(self: Arc<Self>) {
        loop {
            if let Err(err) = self.send_presence(Performative::Health).await {
                tracing::debug!(agent = %self.id, error = %err, "heartbeat not sent");
            }
            tokio::select! {
                _ = tokio::time::sleep(self.heartbeat_interval) => {}
                _ = self.presence_changed.notified() => {}
                _ = self.stop.cancelled() => break,
            }
        }
        if let Err(err) = self.send_presence(Performative::Done).await {
            tracing::debug!(agent = %self.id, error = %err, "goodbye not sent");
        }
    }

    /// The `$SRV` subjects this agent answers on.
    pub(crate) fn service_subjects(&self) -> [String; 3] {
        [
            "$SRV.*".to_owned(),
            format!("$SRV.*.{}", self.id),
            format!("$SRV.*.{}.{}", self.id, self.instance),
        ]
    }

    /// Answers a `$SRV.PING|INFO|STATS` request with the micro-service JSON of ADR-32.
    pub(crate) async fn answer_service(&self, msg: &Message) {
        let Some(reply) = msg.reply() else { return };
        let verb = msg.subject().split('.').nth(1).unwrap_or_default();
        let mut body = json!({
            "name": self.id,
            "id": self.instance,
            "version": env!("CARGO_PKG_VERSION"),
            "metadata": {
                "chorus.root": self.subjects.root(),
                "chorus.capabilities": crate::agent::lock(&self.capabilities).join(","),
            },
        });
        let endpoints = self.endpoints();
        match verb {
            "PING" => body["type"] = json!("io.nats.micro.v1.ping_response"),
            "INFO" => {
                body["type"] = json!("io.nats.micro.v1.info_response");
                body["description"] = json!(format!("Chorus agent {}", self.id));
                body["endpoints"] = endpoints
                    .iter()
                    .map(|e| {
                        json!({
                            "name": e.name,
                            "subject": e.subject,
                            "queue_group": e.queue_group.clone().unwrap_or_default(),
                            "metadata": {},
                        })
                    })
                    .collect();
            }
            "STATS" => {
                body["type"] = json!("io.nats.micro.v1.stats_response");
                body["started"] = json!(rfc3339(self.started_ms));
                body["endpoints"] = endpoints
                    .iter()
                    .map(|e| {
                        let n = e.requests.load(Ordering::Relaxed);
                        let ns = e.processing_ns.load(Ordering::Relaxed);
                        json!({
                            "name": e.name,
                            "subject": e.subject,
                            "queue_group": e.queue_group.clone().unwrap_or_default(),
                            "num_requests": n,
                            "num_errors": e.errors.load(Ordering::Relaxed),
                            "last_error": e.last_error.lock().map(|l| l.clone()).unwrap_or_default(),
                            "processing_time": ns,
                            "average_processing_time": ns.checked_div(n).unwrap_or(0),
                        })
                    })
                    .collect();
            }
            _ => return,
        }
        let bytes = Bytes::from(body.to_string());
        if let Err(err) = self.broker.publish(reply, bytes).await {
            tracing::debug!(agent = %self.id, error = %err, "service discovery answer not sent");
        }
    }
}
