//! The sending half of an agent: what every outgoing message shares (identity, subjects,
//! encoding, hop limit, signing, recipients' encryption keys), and the three ways out: a
//! request that waits for its reply (`request`), an event (`publish`), and a call builder
//! ([`Call`]). Durable sends build on this in `durable::send`.

mod breaker;
pub(crate) mod call;
mod large;
mod multicast;
mod notify;
mod publish;
mod request;
mod route;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub(crate) use breaker::Breakers;
pub use breaker::{
    BreakerPolicy, CircuitState, DEFAULT_BREAKER_FAILURES, DEFAULT_BREAKER_OPEN_FOR,
};
pub use call::{
    Call, MAX_HEADER_NAME_BYTES, MAX_HEADERS, MAX_HEADERS_BYTES, Publish, Reply, Target,
};
pub(crate) use large::Readers;
pub use multicast::{
    Collect, MAX_MULTICAST_RECIPIENTS, MulticastCounts, MulticastOutcome, MulticastRecipient,
    MulticastReport,
};
pub use notify::{Notify, NotifyReport, NotifyTarget};
pub(crate) use route::Router;
pub use route::{DEFAULT_ROUTING_REFRESH, Routing};

use crate::error::SdkError;
use crate::link::Link;
use crate::protocol::codec::Encoding;
use crate::protocol::envelope::{DeliveryClass, Envelope};
use crate::security::Identity;
use crate::stats::AgentCounters;
use crate::sync::{read, write};

/// The message being handled when a handler sends: its envelope (for correlation, hops,
/// deadline) and its handling span (the parent of what it sends).
#[derive(Clone, Copy)]
pub(crate) struct Parent<'a> {
    pub(crate) env: &'a Envelope,
    pub(crate) otel: &'a opentelemetry::Context,
}

/// How an agent chooses the form of what it sends: fixed by its options, or the bus's, as the
/// coordinator announces it (`<root>.sys.wire`); and the least heartbeat interval the
/// coordinator asks for in the same announcement.
#[derive(Debug)]
pub(crate) struct Wire {
    fixed: Option<Encoding>,
    bus_compact: std::sync::atomic::AtomicBool,
    heartbeat_floor_ms: std::sync::atomic::AtomicU64,
}

impl Wire {
    pub(crate) fn new(fixed: Option<Encoding>) -> Self {
        Wire {
            fixed,
            bus_compact: std::sync::atomic::AtomicBool::new(false),
            heartbeat_floor_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Takes the bus's heartbeat floor (none: 0), bounded by
    /// [`MAX_HEARTBEAT_FLOOR`](crate::registry::MAX_HEARTBEAT_FLOOR).
    pub(crate) fn set_heartbeat_floor(&self, floor_ms: Option<u64>) {
        let max =
            u64::try_from(crate::registry::MAX_HEARTBEAT_FLOOR.as_millis()).unwrap_or(u64::MAX);
        self.heartbeat_floor_ms.store(
            floor_ms.unwrap_or(0).min(max),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// The least time between two heartbeats the bus asks for (zero: none).
    pub(crate) fn heartbeat_floor(&self) -> Duration {
        Duration::from_millis(
            self.heartbeat_floor_ms
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Whether the agent follows the bus (no encoding was fixed).
    pub(crate) fn follows_bus(&self) -> bool {
        self.fixed.is_none()
    }

    /// Takes the bus's announcement: whether every live agent reads the compact form.
    pub(crate) fn set_bus_compact(&self, compact: bool) {
        self.bus_compact
            .store(compact, std::sync::atomic::Ordering::Relaxed);
    }

    /// The form to write now.
    pub(crate) fn encoding(&self) -> Encoding {
        self.fixed.unwrap_or_else(|| {
            if self.bus_compact.load(std::sync::atomic::Ordering::Relaxed) {
                Encoding::Compact
            } else {
                Encoding::MsgPack
            }
        })
    }
}

/// The size of the chunks encoded messages are sliced from.
const ENCODE_CHUNK: usize = 16 * 1024;

/// What only sending needs, beside the [`Link`] every part shares.
pub(crate) struct Outbound {
    /// Identity, subjects, connection and counters, shared with the parts that do not send.
    pub(crate) link: Arc<Link>,
    /// The form of what it sends: fixed, or the bus's.
    pub(crate) wire: Wire,
    pub(crate) hop_limit: u8,
    pub(crate) request_timeout: Duration,
    pub(crate) default_delivery: DeliveryClass,
    pub(crate) max_message_bytes: usize,
    pub(crate) identity: Option<Arc<Identity>>,
    /// Recipients' public encryption keys: configured ones, then the registry's.
    pub(crate) encryption_keys: RwLock<HashMap<String, String>>,
    /// This agent's encryption sessions, one per recipient key.
    pub(crate) sessions: crate::security::encryption::EncryptionSessions,
    /// The chunk encoded messages are sliced from ([`Outbound::encode`]).
    pub(crate) encode_chunk: std::sync::Mutex<bytes::BytesMut>,
    /// Each published subject's count, stamped in its events.
    pub(crate) sequencer: crate::sequence::Sequencer,
    /// How capability calls pick their agent unless the call says.
    pub(crate) routing: Routing,
    /// The holders of capabilities and this agent's calls in flight to them, for routing by load.
    pub(crate) router: Router,
    /// Its circuit breakers, per destination.
    pub(crate) breakers: Breakers,
    /// When payloads are compressed or go by reference.
    pub(crate) payload_limits: crate::payload::PayloadLimits,
    /// Which readers are known to read compressed payloads.
    pub(crate) readers: Readers,
    /// Checks the replies to its requests when the agent verifies signatures: a reply is a
    /// message from the agent that answered, held to the same policy as any other.
    pub(crate) verifier: Option<Arc<crate::security::Verifier>>,
}

impl Outbound {
    /// Whether `env`, received on `subject`, is the coordinator's own word (a `sys.wire`
    /// announcement, a `registry.left` event): from `coordinator`, and signed with its key
    /// where this agent verifies signatures and knows that key. Else why not.
    pub(crate) fn coordinators_word(
        &self,
        subject: &str,
        env: &crate::protocol::envelope::Envelope,
    ) -> Result<(), String> {
        use crate::protocol::registry::COORDINATOR_ID;
        if env.from.as_str() != COORDINATOR_ID {
            return Err(format!("{} is not the coordinator", env.from));
        }
        let Some(verifier) = &self.verifier else {
            return Ok(());
        };
        if verifier.key_of(COORDINATOR_ID).is_none() {
            return Ok(());
        }
        if env.signature.is_none() {
            return Err("unsigned, and the coordinator's key is known".to_owned());
        }
        verifier
            .verify(subject, env, crate::protocol::envelope::now_ms())
            .map_err(|(status, reason)| format!("{status}: {reason}"))
    }

    /// Takes what the coordinator announced, on `sys.wire` or in a
    /// [`WIRE_NOTIFICATION`](crate::registry::WIRE_NOTIFICATION) (PROTOCOL.md section 3.5):
    /// the form to write while following the bus, and the heartbeat floor.
    pub(crate) fn take_wire(&self, level: &crate::registry::WireLevel) {
        let compact = level.major >= 2;
        if compact != (self.wire.encoding() == Encoding::Compact) {
            tracing::debug!(agent = %self.link.id, major = level.major, "following the bus's protocol");
        }
        self.wire.set_bus_compact(compact);
        self.wire.set_heartbeat_floor(level.heartbeat_ms);
    }

    /// Encodes `env` in the agent's encoding for `subject` (the compact form leaves out what
    /// the subject carries).
    ///
    /// Messages are written into a thread's scratch buffer and copied into a shared chunk of
    /// [`ENCODE_CHUNK`] bytes, each a slice of it: one allocation per chunk instead of one per
    /// message (each freed on the connection's thread once written, which costs the
    /// allocator more than the copy).
    pub(crate) fn encode(
        &self,
        subject: &str,
        env: &Envelope,
    ) -> Result<bytes::Bytes, crate::protocol::codec::CodecError> {
        self.write(|scratch| {
            let encoding = self.wire.encoding();
            // Only the compact form leaves anything to the subject.
            let implied = if encoding == Encoding::Compact {
                self.link.subjects.implied(subject)
            } else {
                crate::subject::Implied::default()
            };
            crate::protocol::codec::encode_into(env, encoding, &implied, scratch)
        })
    }

    /// What `write` puts in a thread's scratch buffer, as a slice of the shared chunk.
    pub(crate) fn write<E>(
        &self,
        write: impl FnOnce(&mut Vec<u8>) -> Result<(), E>,
    ) -> Result<bytes::Bytes, E> {
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            scratch.clear();
            write(&mut scratch)?;
            let mut chunk = self
                .encode_chunk
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if chunk.capacity() < scratch.len() {
                *chunk = bytes::BytesMut::with_capacity(ENCODE_CHUNK.max(scratch.len()));
            }
            chunk.extend_from_slice(&scratch);
            let bytes = chunk.split().freeze();
            // A large message must not keep its scratch buffer large.
            if scratch.capacity() > ENCODE_CHUNK {
                *scratch = Vec::new();
            }
            Ok(bytes)
        })
    }

    /// Signs `env` for `subject` when the agent has an identity.
    pub(crate) fn seal(&self, subject: &str, env: &mut Envelope) {
        if let Some(identity) = &self.identity {
            identity.sign(subject, env);
        }
    }

    /// Remembers `agent`'s public encryption key (announced in the registry).
    pub(crate) fn learn_encryption_key(&self, agent: &str, key: String) {
        write(&self.encryption_keys).insert(agent.to_owned(), key);
    }

    /// Seals `env`'s payload for `recipients`, by their known keys.
    fn encrypt_for(&self, env: &mut Envelope, recipients: &[String]) -> Result<(), SdkError> {
        let keys = read(&self.encryption_keys);
        let recipients = recipients
            .iter()
            .map(|agent| {
                keys.get(agent)
                    .map(|k| (agent.clone(), k.clone()))
                    .ok_or_else(|| {
                        SdkError::Encryption(format!("no encryption key is known for {agent}"))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        drop(keys);
        crate::security::encryption::encrypt_in_sessions(env, &recipients, &self.sessions)
            .map_err(|e| SdkError::Encryption(e.to_string()))
    }

    /// Sets what a message inherits from the one being handled, and refuses a forward past
    /// the hop limit or the inherited deadline.
    pub(crate) fn inherit(
        &self,
        env: &mut Envelope,
        parent: Option<&Envelope>,
    ) -> Result<(), SdkError> {
        let Some(parent) = parent else {
            env.hop_limit = self.hop_limit;
            return Ok(());
        };
        env.correlation_id = Some(parent.conversation());
        env.hop_limit = parent.hop_limit.min(self.hop_limit);
        env.hops = parent.hops.saturating_add(1);
        if env.hops > env.hop_limit {
            AgentCounters::bump(&self.link.counters.loop_refused);
            return Err(SdkError::LoopDetected {
                hops: env.hops,
                limit: env.hop_limit,
            });
        }
        if parent.is_expired() {
            AgentCounters::bump(&self.link.counters.expired);
            return Err(SdkError::Expired);
        }
        env.deadline_ms = parent.expires_at_ms();
        env.trace = parent.trace.clone();
        env.session_id = parent.session_id.clone();
        env.customer_id = parent.customer_id.clone();
        Ok(())
    }
}
