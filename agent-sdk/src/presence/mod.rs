//! An agent's presence: heartbeats carrying its manifest, a goodbye on shutdown, answers to
//! NATS's own service discovery (`service`), and the public keys other agents announce
//! (`keys`).

mod keys;
mod service;
mod wire;

use crate::Report;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::error::SdkError;
use crate::handler::endpoint::{EndpointKind, Endpoints};
use crate::inbound::reader::Dispatcher;
use crate::outbound::Outbound;
use crate::protocol::codec;
use crate::protocol::envelope::{
    CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, Envelope, Kind, Performative,
};
use crate::protocol::registry::{Availability, CapabilityInfo, Manifest};
use crate::sync::lock;

pub(crate) use keys::watch_registered_keys;
pub(crate) use wire::follow_wire;

/// Default time between heartbeats.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);
/// How long a heartbeat waits after a change of the manifest, for the changes that follow it.
pub(crate) const CHANGE_SETTLE: Duration = Duration::from_millis(50);
/// The capability version announced unless the agent sets one.
pub const DEFAULT_CAPABILITY_VERSION: &str = "1.0";

/// What an agent announces about itself.
pub(crate) struct Presence {
    /// The agent's identity, subjects, connection and counters.
    pub(crate) link: Arc<crate::link::Link>,
    pub(crate) out: Arc<Outbound>,
    pub(crate) endpoints: Arc<Endpoints>,
    pub(crate) dispatcher: Arc<Dispatcher>,
    pub(crate) capabilities: Mutex<Vec<String>>,
    pub(crate) instance: String,
    pub(crate) started_ms: u64,
    pub(crate) groups: Vec<String>,
    pub(crate) customer: Option<String>,
    pub(crate) capability_version: String,
    pub(crate) capability_details: Vec<(String, Vec<String>, Option<f64>)>,
    pub(crate) capability_max_tokens: Vec<(String, u64)>,
    pub(crate) heartbeat_interval: Duration,
    pub(crate) encryption_key: Option<String>,
    pub(crate) metrics_url: Option<String>,
    /// Wakes the heartbeat loop when the manifest changes.
    pub(crate) changed: Arc<tokio::sync::Notify>,
    pub(crate) load_override: Mutex<Option<(f32, Availability)>>,
    pub(crate) stop: CancellationToken,
}

impl Presence {
    /// Adds a capability to the manifest (once).
    pub(crate) fn add_capability(&self, capability: &str) {
        let mut caps = lock(&self.capabilities);
        if !caps.iter().any(|c| c == capability) {
            caps.push(capability.to_owned());
        }
    }

    /// The load and availability announced: set by the agent, or the share of handler slots
    /// in use.
    pub(crate) fn load_and_availability(&self) -> (f32, Availability) {
        if let Some(set) = *lock(&self.load_override) {
            return set;
        }
        let load = self.dispatcher.busy() as f32 / self.dispatcher.max_in_flight as f32;
        let availability = if self.stop.is_cancelled() {
            Availability::Away
        } else if load >= 1.0 {
            Availability::Busy
        } else {
            Availability::Available
        };
        (load, availability)
    }

    /// The time until the next heartbeat: the agent's interval, or the bus's floor when that
    /// is longer (section 3.5 of the protocol).
    pub(crate) fn interval(&self) -> Duration {
        self.heartbeat_interval.max(self.out.wire.heartbeat_floor())
    }

    /// The manifest as of now.
    pub(crate) fn manifest(&self) -> Manifest {
        self.manifest_beating(self.interval())
    }

    /// The manifest as of now, announcing heartbeats every `every`.
    fn manifest_beating(&self, every: Duration) -> Manifest {
        let endpoints = self.endpoints.all();
        let mut capabilities: Vec<CapabilityInfo> = lock(&self.capabilities)
            .iter()
            .map(|name| {
                let details = self.capability_details.iter().find(|(c, _, _)| c == name);
                CapabilityInfo {
                    name: name.clone(),
                    version: self.capability_version.clone(),
                    models: details.map(|(_, m, _)| m.clone()).unwrap_or_default(),
                    throughput: details.and_then(|(_, _, t)| *t),
                    max_tokens: self
                        .capability_max_tokens
                        .iter()
                        .find(|(c, _)| c == name)
                        .map(|(_, n)| *n),
                    handling_ms: endpoints
                        .iter()
                        .find(|e| e.kind == EndpointKind::Capability && e.name == *name)
                        .and_then(|e| e.handling.ms()),
                }
            })
            .collect();
        capabilities.sort_by(|a, b| a.name.cmp(&b.name));
        let mut commands: Vec<String> = endpoints
            .iter()
            .filter(|e| e.kind == EndpointKind::Command)
            .map(|e| e.name.clone())
            .collect();
        commands.sort();
        let (load, availability) = self.load_and_availability();
        let mut manifest = Manifest {
            agent: self.link.id.clone(),
            instance: self.instance.clone(),
            capabilities,
            commands,
            groups: self.groups.clone(),
            customer: self.customer.clone(),
            content_types: vec![
                CONTENT_TYPE_MSGPACK.to_owned(),
                CONTENT_TYPE_JSON.to_owned(),
            ],
            load,
            slots: u32::try_from(self.dispatcher.max_in_flight).ok(),
            availability,
            eta_ms: None,
            handling_ms: self.endpoints.handling.ms(),
            waiting: self.dispatcher.waiting(),
            public_key: self.out.identity.as_ref().map(|i| i.public_key()),
            encryption_key: self.encryption_key.clone(),
            heartbeat_ms: u64::try_from(every.as_millis()).unwrap_or(u64::MAX),
            started_ms: self.started_ms,
            sdk_version: env!("CARGO_PKG_VERSION").to_owned(),
            metrics_url: self.metrics_url.clone(),
            wire_versions: vec![1, 2],
            open_circuits: self.out.breakers.open(),
            content_encodings: if self.out.payload_limits.accept_compressed {
                vec![crate::payload::ZSTD.to_owned()]
            } else {
                Vec::new()
            },
            endpoints: self.endpoints.info(),
        };
        manifest.eta_ms = manifest.eta_at(crate::Priority::Normal, &[]);
        manifest
    }

    async fn send(&self, kind: Performative, every: Duration) -> Result<(), SdkError> {
        let out = &self.out;
        let subject = match kind {
            Performative::Health => out.link.subjects.heartbeat(&out.link.id),
            _ => out.link.subjects.goodbye(&out.link.id),
        }?;
        let mut env = Envelope::new(Kind::Heartbeat, kind, out.link.id.as_str());
        if kind == Performative::Done {
            // AIXP: an orderly disconnection.
            env.status = Some(crate::StatusCode::DISCONNECTED);
        }
        env.content_type = CONTENT_TYPE_MSGPACK.into();
        env.payload = codec::encode_payload(&self.manifest_beating(every), CONTENT_TYPE_MSGPACK)?;
        out.seal(&subject, &mut env);
        let bytes = out.encode(&subject, &env)?;
        Ok(out.link.broker.publish(&subject, bytes).await?)
    }

    /// Heartbeats every interval (and soon after the manifest changes) until the agent
    /// stops; then a goodbye, so the registry drops it without waiting for missed beats. Each
    /// beat announces the wait until the next one, which is what the registry and the host
    /// allow before calling the agent silent. Changes made within [`CHANGE_SETTLE`] of each
    /// other go out in one beat (an agent registering its handlers after it starts).
    pub(crate) async fn run(self: Arc<Self>) {
        loop {
            let every = self.interval();
            if let Err(err) = self.send(Performative::Health, every).await {
                tracing::debug!(agent = %self.link.id, error = %Report(&err), "heartbeat not sent");
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = self.changed.notified() => {
                    tokio::select! {
                        _ = tokio::time::sleep(CHANGE_SETTLE.min(every)) => {}
                        _ = self.stop.cancelled() => break,
                    }
                    // The changes made meanwhile are in this beat.
                    let _ = futures::FutureExt::now_or_never(self.changed.notified());
                }
                _ = self.stop.cancelled() => break,
            }
        }
        if let Err(err) = self.send(Performative::Done, self.interval()).await {
            tracing::debug!(agent = %self.link.id, error = %Report(&err), "goodbye not sent");
        }
    }
}
