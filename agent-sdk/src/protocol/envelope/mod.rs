//! The envelope: one structure carries every Chorus message. See `docs/PROTOCOL.md`.
//!
//! The envelope and its fields are here; its parts have rooms of their own: the protocol
//! `version`, the `vocabulary` (kinds, performatives, delivery classes, priorities, task
//! states), the `content_type` of a payload, the `trace` context, and `bytes_field` (how
//! bytes are written in each encoding).

pub(crate) mod bytes_field;
mod content_type;
mod trace;
mod version;
mod vocabulary;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::protocol::status::StatusCode;

pub use content_type::ContentType;
pub use trace::{TraceContext, TraceParent};
pub use version::{Version, VersionError};
pub use vocabulary::*;

/// The protocol version this SDK speaks.
pub const PROTOCOL_VERSION: Version = Version { major: 1, minor: 0 };
/// The version the compact form (protocol 2, [`Encoding::Compact`](crate::codec::Encoding)) writes.
pub const COMPACT_VERSION: Version = Version { major: 2, minor: 0 };
/// Default hop limit: how many times a message chain may be forwarded.
pub const DEFAULT_HOP_LIMIT: u8 = 16;
/// Content type of MessagePack payloads (the default).
pub const CONTENT_TYPE_MSGPACK: &str = "application/msgpack";
/// Content type of JSON payloads.
pub const CONTENT_TYPE_JSON: &str = "application/json";
/// Content type of a payload encrypted end to end (`crate::encryption`).
pub const CONTENT_TYPE_ENCRYPTED: &str = "application/chorus-encrypted";

/// What reply the sender expects, and for how long it waits (Agentify's expected reply).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpectedReply {
    /// The performative the sender expects back (for example `inform`).
    pub performative: Performative,
    /// How long the sender waits, in milliseconds.
    pub timeout_ms: u64,
}

/// Progress of ongoing work (Agentify's progress status).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Where the work is.
    pub state: TaskState,
    /// How much is done, from 0 to 1, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f32>,
}

/// A publisher's sequence number on one subject: `n` counts 1, 2, 3, ... within `epoch`, a
/// number the publisher picks at random when it starts counting (a restart, or a counter it
/// had to forget), so a receiver tells a new count from a gap. A receiver that sees `n` jump
/// within one epoch lost the messages between, whatever the cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sequence {
    /// Which count: random per counter.
    pub epoch: u32,
    /// The position in it, from 1.
    pub n: u64,
}

/// An ed25519 signature over the canonical bytes (subject, id, timestamp, payload digest).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signature {
    /// Algorithm, `ed25519`.
    pub alg: String,
    /// The signer's public key (an nkey, `U...`), which must be the key registered for `from`.
    pub key: String,
    /// The signature bytes.
    #[serde(with = "bytes_field")]
    pub value: Bytes,
}

/// End-to-end encryption of the payload for named recipients.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Encryption {
    /// Scheme: `hpke-x25519-hkdfsha256-aes256gcm` (`crate::encryption::ENCRYPTION_ALG`).
    pub alg: String,
    /// The payload's content type before encryption.
    pub inner_content_type: String,
    /// One wrapped key per recipient.
    pub recipients: Vec<EncryptedKey>,
}

/// A content key wrapped for one recipient.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncryptedKey {
    /// The recipient agent id.
    pub agent: String,
    /// The encapsulated key for that recipient.
    #[serde(with = "bytes_field")]
    pub key: Bytes,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

fn is_default_hop_limit(v: &u8) -> bool {
    *v == DEFAULT_HOP_LIMIT
}

fn default_hop_limit() -> u8 {
    DEFAULT_HOP_LIMIT
}

/// A sender's id or an event's topic: a string held inline up to 24 bytes (longer ones on the
/// heap), so reading the names of most messages allocates nothing. It reads as a `&str`, and
/// `.into()` makes one from a `&str` or a `String`.
pub type Name = compact_str::CompactString;

/// The Chorus envelope. Field names here are the wire names; `docs/PROTOCOL.md` says what each
/// means. Optional fields are left out when empty, and unknown fields are ignored on decode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Protocol version.
    pub version: Version,
    /// Message id: a UUIDv7, unique and time-ordered.
    pub id: Uuid,
    /// The conversation or task chain this message belongs to; replies and forwards keep it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<Uuid>,
    /// The id of the message this one answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_reply_to: Option<Uuid>,
    /// The sending agent's id (held inline up to 24 bytes: no allocation per message).
    pub from: Name,
    /// Recipient agent ids, when addressed to agents.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub to: Vec<String>,
    /// The event topic, for events (held inline up to 24 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<Name>,
    /// The capability addressed, for requests to an access point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capability: Option<String>,
    /// The command or operation name, for commands and requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Structural kind.
    pub kind: Kind,
    /// Speech act.
    pub performative: Performative,
    /// When it was sent: milliseconds since the Unix epoch, UTC.
    pub timestamp_ms: u64,
    /// Time to live from `timestamp_ms`, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Absolute deadline, milliseconds since the epoch. The earlier of this and
    /// `timestamp_ms + ttl_ms` applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// How many times this message chain has been forwarded (0 when first sent).
    #[serde(default, skip_serializing_if = "is_default")]
    pub hops: u8,
    /// Forwarding past this many hops is refused with 5010.
    #[serde(
        default = "default_hop_limit",
        skip_serializing_if = "is_default_hop_limit"
    )]
    pub hop_limit: u8,
    /// Priority.
    #[serde(default, skip_serializing_if = "is_default")]
    pub priority: Priority,
    /// The delivery guarantee the sender asked for.
    #[serde(default, skip_serializing_if = "is_default")]
    pub delivery: DeliveryClass,
    /// The publisher's sequence on this subject, so a receiver can count what it missed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<Sequence>,
    /// What reply the sender expects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<ExpectedReply>,
    /// Progress of the work this message reports on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// Status code, on replies and error reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<StatusCode>,
    /// A human-readable reason that goes with a non-success status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// W3C trace context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceContext>,
    /// Session id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Customer or tenant id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub customer_id: Option<String>,
    /// Free key-values for the application.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// Content type of `payload`.
    #[serde(default)]
    pub content_type: ContentType,
    /// How `payload` is compressed (`zstd`), when it is: sent only to readers whose manifest
    /// lists it (`docs/PROTOCOL.md` section 7.11).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_encoding: Option<String>,
    /// The payload: bytes in MessagePack, base64 text in JSON.
    #[serde(default, with = "bytes_field", skip_serializing_if = "Bytes::is_empty")]
    pub payload: Bytes,
    /// An optional bearer token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Sender's signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
    /// Set when `payload` is encrypted end to end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<Encryption>,
}

/// A time in ms since the epoch as RFC 3339 (UTC) with exactly three fractional digits
/// (`2025-11-26T17:45:07.600Z`, not `.6Z`), as the service, A2A and MCP wires write it: of
/// one width, so that two such times compare as strings as they do as times. Empty if out
/// of range.
pub fn rfc3339(ms: u64) -> String {
    let nanos = i128::from(ms) * 1_000_000;
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .map(|t| {
            format!(
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
                t.year(),
                u8::from(t.month()),
                t.day(),
                t.hour(),
                t.minute(),
                t.second(),
                t.millisecond()
            )
        })
        .unwrap_or_default()
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Envelope {
    /// A new envelope of `kind` from `from`, with a fresh UUIDv7 id, the current time and
    /// defaults elsewhere.
    pub fn new(kind: Kind, performative: Performative, from: impl Into<Name>) -> Self {
        Self::new_typed(kind, performative, from, ContentType::default())
    }

    /// [`Envelope::new`] with the payload's content type given (one allocation fewer than
    /// setting it afterwards).
    pub(crate) fn new_typed(
        kind: Kind,
        performative: Performative,
        from: impl Into<Name>,
        content_type: ContentType,
    ) -> Self {
        let id = Uuid::now_v7();
        Envelope {
            id,
            // The id's own millisecond timestamp: one clock read for both.
            timestamp_ms: (id.as_u128() >> 80) as u64,
            ..Self::blank(kind, performative, from.into(), content_type)
        }
    }

    /// Every field at its default, with a nil id and a zero timestamp: the start of a new
    /// envelope, and of one being decoded (which takes the id and time from the bytes).
    pub(crate) fn blank(
        kind: Kind,
        performative: Performative,
        from: Name,
        content_type: ContentType,
    ) -> Self {
        Envelope {
            version: PROTOCOL_VERSION,
            id: Uuid::nil(),
            correlation_id: None,
            in_reply_to: None,
            from,
            to: Vec::new(),
            topic: None,
            capability: None,
            name: None,
            kind,
            performative,
            timestamp_ms: 0,
            ttl_ms: None,
            deadline_ms: None,
            hops: 0,
            hop_limit: DEFAULT_HOP_LIMIT,
            priority: Priority::Normal,
            delivery: DeliveryClass::AtMostOnce,
            seq: None,
            expect: None,
            progress: None,
            status: None,
            reason: None,
            trace: None,
            session_id: None,
            customer_id: None,
            headers: BTreeMap::new(),
            content_type,
            content_encoding: None,
            payload: Bytes::new(),
            token: None,
            signature: None,
            encryption: None,
        }
    }

    /// The correlation id: the explicit one, or the message's own id when it starts a chain.
    pub fn conversation(&self) -> Uuid {
        self.correlation_id.unwrap_or(self.id)
    }

    /// The moment after which the message must not be handled, if any (ms since epoch).
    pub fn expires_at_ms(&self) -> Option<u64> {
        let by_ttl = self.ttl_ms.map(|ttl| self.timestamp_ms.saturating_add(ttl));
        match (by_ttl, self.deadline_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether the TTL or deadline has passed; the clock is read only for an envelope that
    /// expires (most do not, and this is checked on every received message).
    pub fn is_expired(&self) -> bool {
        self.expires_at_ms().is_some_and(|t| now_ms() > t)
    }

    /// Whether the TTL or deadline has passed at `now_ms`.
    pub fn is_expired_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms().is_some_and(|t| now_ms > t)
    }

    /// Time left before expiry at `now_ms`, if the message expires.
    pub fn remaining_at(&self, now_ms: u64) -> Option<Duration> {
        self.expires_at_ms()
            .map(|t| Duration::from_millis(t.saturating_sub(now_ms)))
    }

    /// A reply to this message, from `from`, with `status`: same correlation, `in_reply_to`
    /// set, same content type, session and customer, hop count carried over.
    pub fn reply(&self, from: impl Into<Name>, status: StatusCode) -> Envelope {
        let performative = if status.is_success() && self.performative == Performative::Discover {
            // Agentify: the answer to a `discover` is an `offer`.
            Performative::Offer
        } else if status.is_success() {
            Performative::Inform
        } else if status == StatusCode::LOOP_DETECTED
            || status == StatusCode::EXPIRED
            || status == StatusCode::ACCESS
            || status == StatusCode::UNAUTHORIZED
            || status == StatusCode::UNKNOWN_COMMAND
            || status == StatusCode::DATA_FORMAT
            || status == StatusCode::TASK_STATE
        {
            Performative::Refuse
        } else {
            Performative::Failure
        };
        let mut reply = Envelope::new(Kind::Response, performative, from);
        reply.correlation_id = Some(self.conversation());
        reply.in_reply_to = Some(self.id);
        reply.to = vec![self.from.to_string()];
        reply.name = self.name.clone();
        reply.capability = self.capability.clone();
        reply.hops = self.hops;
        reply.hop_limit = self.hop_limit;
        reply.trace = self.trace.clone();
        reply.session_id = self.session_id.clone();
        reply.customer_id = self.customer_id.clone();
        reply.content_type = self.content_type.clone();
        reply.status = Some(status);
        reply
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_written_with_three_fractional_digits_and_compare_as_strings() {
        assert_eq!(rfc3339(1_764_179_107_123), "2025-11-26T17:45:07.123Z");
        assert_eq!(rfc3339(1_764_179_107_600), "2025-11-26T17:45:07.600Z");
        assert_eq!(rfc3339(1_764_179_107_000), "2025-11-26T17:45:07.000Z");
        // `.6Z` against `.621Z` would order the later time first.
        assert!(rfc3339(1_764_179_107_600) < rfc3339(1_764_179_107_621));
        assert_eq!(rfc3339(u64::MAX), "");
    }

    #[test]
    fn the_timestamp_is_the_ids_own_and_the_clocks() {
        let before = now_ms();
        let env = Envelope::new(Kind::Event, Performative::Inform, "a");
        let after = now_ms();
        let (secs, nanos) = env.id.get_timestamp().expect("a v7 id").to_unix();
        let id_ms = secs * 1000 + u64::from(nanos / 1_000_000);
        assert_eq!(env.timestamp_ms, id_ms);
        assert!(
            (before..=after).contains(&env.timestamp_ms),
            "{before} {} {after}",
            env.timestamp_ms
        );
    }
}
