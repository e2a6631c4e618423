//! Large payloads on the way out ([`Outbound::fit`]): compressed for a reader that reads zstd,
//! then stored by reference when still too large to travel inline. The reader's ability is
//! read from its manifest in the registry (a named agent) or from discovery (every holder of a
//! capability), kept for a few seconds; an event's readers are unknown, so events are not
//! compressed. See [`crate::payload`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Outbound;
use crate::error::SdkError;
use crate::payload::{self, ZSTD};
use crate::protocol::codec::CodecError;
use crate::protocol::envelope::Envelope;
use crate::protocol::registry::REGISTRY_BUCKET;
use crate::protocol::registry::{AgentRecord, DiscoverQuery};
use crate::protocol::status::StatusCode;
use crate::stats::AgentCounters;
use crate::sync::lock;

/// How long what is known of a reader is used before it is asked again.
const READER_TTL: Duration = Duration::from_secs(10);
/// Most readers remembered; past this the memory starts again.
const MAX_READERS: usize = 4096;
/// The longest the lookup of a reader's manifest may take before the payload goes plain.
const READER_LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);
/// Payloads this small always travel inline, unless the limits say less.
const ALWAYS_INLINE: usize = 16 * 1024;
/// Payloads at least this large are compressed and hashed off the async threads.
const BLOCKING_ABOVE: usize = 1024 * 1024;

/// Who reads a message.
#[derive(Debug, Clone)]
enum Reader {
    /// One named agent.
    Agent(String),
    /// Whichever holder of a capability the queue group picks.
    Holders(String),
    /// Anyone (an event's subscribers).
    Unknown,
}

impl Reader {
    /// The reader of `env`: its one recipient (a reply's is its requester), else its
    /// capability's holders.
    fn of(env: &Envelope) -> Self {
        match (env.to.as_slice(), env.capability.as_deref()) {
            ([agent], _) => Reader::Agent(agent.clone()),
            ([], Some(capability)) => Reader::Holders(capability.to_owned()),
            _ => Reader::Unknown,
        }
    }
}

/// Whether readers read zstd, as last looked up.
#[derive(Debug, Default)]
pub(crate) struct Readers(Mutex<HashMap<String, (Instant, bool)>>);

impl Readers {
    fn get(&self, key: &str) -> Option<bool> {
        lock(&self.0)
            .get(key)
            .filter(|(at, _)| at.elapsed() < READER_TTL)
            .map(|(_, reads)| *reads)
    }

    fn put(&self, key: String, reads: bool) {
        let mut readers = lock(&self.0);
        if readers.len() >= MAX_READERS {
            readers.clear();
        }
        readers.insert(key, (Instant::now(), reads));
    }
}

impl Outbound {
    /// Whether a payload of `len` bytes travels inline, as it is.
    pub(crate) fn fits_inline(&self, len: usize) -> bool {
        let limits = self.payload_limits;
        if len >= limits.compress_above.unwrap_or(usize::MAX) {
            return false;
        }
        // The server's limit is read only for a payload that could pass it (reading it copies
        // the server's info, which the hot paths do not pay for).
        len <= ALWAYS_INLINE && limits.inline_max.is_none_or(|max| len <= max)
            || len <= limits.inline_max_for(self.link.broker.max_payload())
    }

    /// Makes `env`'s payload fit the wire for its reader (its one recipient, or its
    /// capability's holders): compressed when it is large and the reader reads zstd, then stored by reference when larger than the inline limit (kept
    /// until the message expires, or the retention for one that does not). Refuses a payload
    /// over the agent's `max_bytes`. Call before signing.
    pub(crate) async fn fit(&self, env: &mut Envelope) -> Result<(), SdkError> {
        let len = env.payload.len();
        if self.fits_inline(len) {
            return Ok(());
        }
        let limits = self.payload_limits;
        let inline_max = limits.inline_max_for(self.link.broker.max_payload());
        let compress_above = limits.compress_above.unwrap_or(usize::MAX);
        if len > limits.max_bytes {
            return Err(SdkError::Codec(CodecError::TooLarge {
                size: len,
                limit: limits.max_bytes,
            }));
        }
        if len >= compress_above
            && env.encryption.is_none()
            && env.content_encoding.is_none()
            && self.reads_zstd(Reader::of(env)).await
        {
            let payload = env.payload.clone();
            let packed = if len >= BLOCKING_ABOVE {
                tokio::task::spawn_blocking(move || payload::compress(&payload))
                    .await
                    .ok()
                    .flatten()
            } else {
                payload::compress(&payload)
            };
            if let Some(packed) = packed {
                tracing::trace!(agent = %self.link.id, from = len, to = packed.len(), "payload compressed");
                env.payload = packed;
                env.content_encoding = Some(ZSTD.to_owned());
            }
        }
        if env.payload.len() > inline_max {
            let grace = u64::try_from(limits.keep_after_expiry.as_millis()).unwrap_or(u64::MAX);
            let expires = env.expires_at_ms().map(|t| t.saturating_add(grace));
            let chunk = payload::PayloadLimits::chunk_for(self.link.broker.max_payload());
            payload::store(
                &self.link.js,
                &self.link.subjects,
                &self.link.id,
                env,
                expires,
                chunk,
            )
            .await?;
            AgentCounters::bump(&self.link.counters.payloads_stored);
        }
        Ok(())
    }

    /// Puts back a reply's payload: fetched when it came by reference, decompressed when it
    /// came compressed.
    pub(crate) async fn open_reply(&self, env: &mut Envelope) -> Result<(), SdkError> {
        let by_reference =
            env.content_type == payload::CONTENT_TYPE_OBJECT && !env.payload.is_empty();
        if env.content_encoding.is_none() && !by_reference {
            return Ok(());
        }
        let counters = &self.link.counters;
        let opened = async {
            if by_reference {
                payload::fetch(&self.link.js, env, self.payload_limits.max_bytes).await?;
                AgentCounters::bump(&counters.payloads_fetched);
            }
            if env.content_encoding.is_some() {
                payload::open_encoding(env, self.payload_limits.max_bytes)?;
                AgentCounters::bump(&counters.payloads_decompressed);
            }
            Ok(())
        };
        opened
            .await
            .map_err(|(status, reason): (StatusCode, String)| SdkError::Remote {
                status,
                reason,
                from: None,
            })
    }

    /// Whether `reader` reads zstd, by its manifest; `false` when it cannot be known.
    async fn reads_zstd(&self, reader: Reader) -> bool {
        let key = match &reader {
            Reader::Agent(agent) => format!("agent:{agent}"),
            Reader::Holders(capability) => format!("cap:{capability}"),
            Reader::Unknown => return false,
        };
        if let Some(reads) = self.readers.get(&key) {
            return reads;
        }
        let reads = match &reader {
            Reader::Agent(agent) => self
                .registered(agent)
                .await
                .is_some_and(|r| r.manifest.reads_encoding(ZSTD)),
            // Boxed: discovery is itself a request, which goes through `fit`.
            Reader::Holders(capability) => Box::pin(self.discover(
                &DiscoverQuery::capability(capability),
                READER_LOOKUP_TIMEOUT,
            ))
            .await
            .is_ok_and(|holders| {
                !holders.is_empty() && holders.iter().all(|r| r.manifest.reads_encoding(ZSTD))
            }),
            Reader::Unknown => false,
        };
        self.readers.put(key, reads);
        reads
    }

    /// `agent`'s registry record, if the registry can be read and has one.
    async fn registered(&self, agent: &str) -> Option<AgentRecord> {
        let lookup = async {
            let kv = self
                .link
                .js
                .open_kv(&self.link.subjects.bucket_name(REGISTRY_BUCKET))
                .await
                .ok()?;
            let entry = kv.get(agent).await.ok()??;
            serde_json::from_slice::<AgentRecord>(&entry.value).ok()
        };
        tokio::time::timeout(READER_LOOKUP_TIMEOUT, lookup)
            .await
            .ok()
            .flatten()
    }
}
