//! The envelope: one structure carries every Chorus message. See `docs/PROTOCOL.md`.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use uuid::Uuid;

use crate::protocol::status::StatusCode;

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

/// Protocol version `major.minor`, written as the string `"1.0"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Incompatible changes. A receiver refuses a major it does not know.
    pub major: u16,
    /// Compatible additions. A receiver accepts a newer minor and ignores unknown fields.
    pub minor: u16,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// A protocol version that is not `<major>.<minor>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad version {0:?}")]
pub struct VersionError(String);

impl FromStr for Version {
    type Err = VersionError;
    fn from_str(s: &str) -> Result<Self, VersionError> {
        let (major, minor) = s.split_once('.').unwrap_or((s, "0"));
        // Any run of digits is a number: one past u16 is kept as u16::MAX, so `1.99999` is a
        // (newer) minor of 1 and accepted, and `99999.0` an unknown major and refused as such.
        let parse = |p: &str| {
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                return Err(VersionError(s.to_owned()));
            }
            Ok(p.parse::<u16>().unwrap_or(u16::MAX))
        };
        Ok(Version {
            major: parse(major)?,
            minor: parse(minor)?,
        })
    }
}

impl Serialize for Version {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Version {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A closed vocabulary written as lowercase strings on the wire. A value this version does
/// not know decodes as `Unknown` instead of failing, so newer peers can add values.
macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $( $(#[$vdoc:meta])* $variant:ident = $text:literal, )* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum $name {
            $( $(#[$vdoc])* $variant, )*
            /// A value from a newer protocol version.
            Unknown,
        }

        impl $name {
            /// Every known value.
            pub const ALL: &'static [$name] = &[$($name::$variant),*];

            /// The wire form.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)* $name::Unknown => "unknown" }
            }

            /// The compact form's code (protocol 2): 1, 2, 3, ... in the order of
            /// `docs/PROTOCOL.md`'s table, new values only ever added at the end; 0 is
            /// `Unknown`.
            pub fn code(self) -> u8 {
                Self::ALL
                    .iter()
                    .position(|v| *v == self)
                    .and_then(|i| u8::try_from(i + 1).ok())
                    .unwrap_or(0)
            }

            /// The value of a compact code; a code this version does not know is `Unknown`.
            pub fn from_code(code: u64) -> Self {
                usize::try_from(code)
                    .ok()
                    .and_then(|c| c.checked_sub(1))
                    .and_then(|i| Self::ALL.get(i))
                    .copied()
                    .unwrap_or($name::Unknown)
            }
        }

        impl FromStr for $name {
            type Err = std::convert::Infallible;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Ok(match s { $($text => $name::$variant,)* _ => $name::Unknown })
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(self.as_str()) }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                Ok(s.parse().unwrap_or($name::Unknown))
            }
        }
    };
}

string_enum! {
    /// What the message is, structurally: it decides how the receiver routes and answers it.
    Kind {
        /// Asks for a reply (request-reply, to an agent or a capability).
        Request = "request",
        /// The reply to a request or command.
        Response = "response",
        /// A fact published to a topic; no reply.
        Event = "event",
        /// Tells one agent to do something; a result is returned when a reply subject is given.
        Command = "command",
        /// Liveness and load of an agent.
        Heartbeat = "heartbeat",
        /// An error report that is not a reply (for example, a dead letter notice).
        Error = "error",
    }
}

string_enum! {
    /// What the sender means by it (the speech act): Agentify's performatives with IACP's
    /// intents folded in.
    Performative {
        /// Please do this (Agentify request, IACP handoff/query requests).
        Request = "request",
        /// Here is information (results, events; IACP notify).
        Inform = "inform",
        /// A proposal in a negotiation.
        Propose = "propose",
        /// The receiver accepts and will do it.
        Agree = "agree",
        /// The receiver will not do it; the status code says why.
        Refuse = "refuse",
        /// Confirms something asserted earlier.
        Confirm = "confirm",
        /// The work was attempted and failed; the status code says why.
        Failure = "failure",
        /// The work is complete (task completion report).
        Done = "done",
        /// A question about state or capabilities (IACP query).
        Query = "query",
        /// Who can do X? (discovery).
        Discover = "discover",
        /// I can do X (answer to discover; capability manifest).
        Offer = "offer",
        /// Assigns a task to an agent.
        Assign = "assign",
        /// Cancels earlier work.
        Cancel = "cancel",
        /// Hands a task and its context to another agent (IACP handoff).
        Handoff = "handoff",
        /// A step in a negotiation (IACP negotiate).
        Negotiate = "negotiate",
        /// Progress of ongoing work.
        Progress = "progress",
        /// Liveness (IACP health).
        Health = "health",
    }
}

string_enum! {
    /// Scheduling priority; higher is served first where the transport allows it.
    Priority {
        /// Background work.
        Low = "low",
        /// The default.
        Normal = "normal",
        /// Ahead of normal work.
        High = "high",
        /// Ahead of everything else.
        Critical = "critical",
    }
}

string_enum! {
    /// Where a task (or other work a progress report is about) stands. The first five are
    /// protocol 1's progress states; the rest were added with tasks. A task uses A2A's
    /// vocabulary: submitted, accepted, working, input-required, then one of the terminal
    /// states completed, failed, cancelled, rejected or expired. It reads `queued` as
    /// `accepted` and `running` as `working` ([`TaskState::normalized`]); the legal moves are
    /// [`TaskState::can_become`]'s table.
    TaskState {
        /// Accepted, not started (protocol 1; a task says `accepted`).
        Queued = "queued",
        /// Being worked on (protocol 1; a task says `working`).
        Running = "running",
        /// Finished successfully.
        Completed = "completed",
        /// Finished with a failure; the status code says why.
        Failed = "failed",
        /// Cancelled before it finished.
        Cancelled = "cancelled",
        /// Recorded by the requester; nobody has taken it yet.
        Submitted = "submitted",
        /// An agent took it and will work on it.
        Accepted = "accepted",
        /// Being worked on.
        Working = "working",
        /// Waiting for the requester's answer to a question.
        InputRequired = "input_required",
        /// The agent asked would not take it; the status code says why.
        Rejected = "rejected",
        /// Its deadline passed before it finished.
        Expired = "expired",
    }
}

/// The name protocol 1 gave [`TaskState`].
pub type ProgressState = TaskState;

string_enum! {
    /// The delivery guarantee a sender asked for (see `docs/PROTOCOL.md`, delivery classes).
    DeliveryClass {
        /// Core NATS: delivered zero or one time; nothing is stored.
        AtMostOnce = "at_most_once",
        /// JetStream: stored until handled; redelivered until acknowledged, so a handler may
        /// see it more than once.
        AtLeastOnce = "at_least_once",
        /// At least once, plus deduplication on both ends: the handler runs once per message id.
        ExactlyOnce = "exactly_once",
    }
}

// The enum comes from a macro, so `#[derive(Default)]` cannot mark the variant.
#[allow(clippy::derivable_impls)]
impl Default for DeliveryClass {
    fn default() -> Self {
        DeliveryClass::AtMostOnce
    }
}

// The enum comes from a macro, so `#[derive(Default)]` cannot mark the variant.
#[allow(clippy::derivable_impls)]
impl Default for Priority {
    fn default() -> Self {
        Priority::Normal
    }
}

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

/// W3C trace context, mirrored in the `traceparent`/`tracestate` NATS headers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceContext {
    /// `traceparent`: version-traceid-parentid-flags.
    pub traceparent: TraceParent,
    /// `tracestate`: vendor entries, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

/// The content type of a payload. The common ones (MessagePack, JSON, bytes, text, an
/// encrypted payload) are held as static text, so reading one from the wire allocates nothing;
/// any other is kept as it came. It reads as a `&str` (`Deref`), compares with text, and is
/// made from text with `into()`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentType(std::borrow::Cow<'static, str>);

/// The content types held without an allocation.
const KNOWN_CONTENT_TYPES: [&str; 5] = [
    CONTENT_TYPE_MSGPACK,
    CONTENT_TYPE_JSON,
    "application/octet-stream",
    "text/plain",
    CONTENT_TYPE_ENCRYPTED,
];

impl ContentType {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn known(text: &str) -> Option<&'static str> {
        KNOWN_CONTENT_TYPES.iter().copied().find(|k| *k == text)
    }
}

impl Default for ContentType {
    /// MessagePack, the default.
    fn default() -> Self {
        ContentType(std::borrow::Cow::Borrowed(CONTENT_TYPE_MSGPACK))
    }
}

impl std::ops::Deref for ContentType {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for ContentType {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<&str> for ContentType {
    fn from(text: &str) -> Self {
        match ContentType::known(text) {
            Some(known) => ContentType(std::borrow::Cow::Borrowed(known)),
            None => ContentType(std::borrow::Cow::Owned(text.to_owned())),
        }
    }
}

impl From<String> for ContentType {
    fn from(text: String) -> Self {
        match ContentType::known(&text) {
            Some(known) => ContentType(std::borrow::Cow::Borrowed(known)),
            None => ContentType(std::borrow::Cow::Owned(text)),
        }
    }
}

impl From<&String> for ContentType {
    fn from(text: &String) -> Self {
        ContentType::from(text.as_str())
    }
}

impl From<ContentType> for String {
    fn from(ct: ContentType) -> String {
        ct.0.into_owned()
    }
}

impl PartialEq<str> for ContentType {
    fn eq(&self, other: &str) -> bool {
        *self.0 == *other
    }
}

impl PartialEq<&str> for ContentType {
    fn eq(&self, other: &&str) -> bool {
        *self.0 == **other
    }
}

impl PartialEq<String> for ContentType {
    fn eq(&self, other: &String) -> bool {
        *self.0 == **other
    }
}

impl PartialEq<ContentType> for &str {
    fn eq(&self, other: &ContentType) -> bool {
        **self == *other.0
    }
}

impl PartialEq<ContentType> for String {
    fn eq(&self, other: &ContentType) -> bool {
        **self == *other.0
    }
}

impl fmt::Display for ContentType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ContentType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl Serialize for ContentType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ContentType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(TextVisitor::<ContentType>::new("a content type"))
    }
}

/// Reads a value made from text, borrowing the text where the format lends it (so a value
/// that keeps no copy, as a common content type or a canonical `traceparent`, allocates
/// nothing).
struct TextVisitor<T> {
    expecting: &'static str,
    made: std::marker::PhantomData<T>,
}

impl<T> TextVisitor<T> {
    fn new(expecting: &'static str) -> Self {
        TextVisitor {
            expecting,
            made: std::marker::PhantomData,
        }
    }
}

impl<T: for<'a> From<&'a str> + From<String>> serde::de::Visitor<'_> for TextVisitor<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
        Ok(T::from(v))
    }
    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<T, E> {
        Ok(T::from(v))
    }
}

/// A W3C `traceparent`. One of version `00` in its canonical lowercase form is held as its 25
/// bytes (trace id, parent id, flags), what the compact envelope carries, so it is neither
/// allocated nor parsed on the way; any other text is kept as it came. Either way it reads and
/// writes as the text (`00-<32 hex>-<16 hex>-<2 hex>`).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TraceParent(TraceRepr);

#[derive(Clone, PartialEq, Eq, Hash)]
enum TraceRepr {
    W3c([u8; 25]),
    Text(String),
}

impl TraceParent {
    /// The `traceparent` of these 25 bytes (version 00).
    pub fn from_bytes(bytes: [u8; 25]) -> Self {
        TraceParent(TraceRepr::W3c(bytes))
    }

    /// Reads `text`: its bytes when it is a canonical version-00 `traceparent`, the text as it
    /// is otherwise (checked only where it is used, as before).
    pub fn parse(text: &str) -> Self {
        match w3c_bytes(text) {
            Some(bytes) => TraceParent(TraceRepr::W3c(bytes)),
            None => TraceParent(TraceRepr::Text(text.to_owned())),
        }
    }

    /// Its 25 bytes, when it is a canonical version-00 `traceparent`.
    pub fn as_bytes(&self) -> Option<&[u8; 25]> {
        match &self.0 {
            TraceRepr::W3c(bytes) => Some(bytes),
            TraceRepr::Text(_) => None,
        }
    }

    /// Whether it is empty text (nothing a trace can be followed by).
    pub fn is_empty(&self) -> bool {
        matches!(&self.0, TraceRepr::Text(t) if t.is_empty())
    }

    /// Calls `f` with the text, written on the stack when it is held as bytes.
    pub fn with_text<R>(&self, f: impl FnOnce(&str) -> R) -> R {
        match &self.0 {
            TraceRepr::W3c(bytes) => {
                let text = w3c_text(bytes);
                // Hex digits and dashes are ASCII.
                f(std::str::from_utf8(&text).unwrap_or_default())
            }
            TraceRepr::Text(text) => f(text),
        }
    }
}

/// The 25 bytes of a canonical (lowercase) version-00 `traceparent`.
fn w3c_bytes(text: &str) -> Option<[u8; 25]> {
    let b = text.as_bytes();
    if b.len() != 55 || &b[..3] != b"00-" || b[35] != b'-' || b[52] != b'-' {
        return None;
    }
    // Uppercase hex would not come back the same from the bytes.
    if b.iter().any(u8::is_ascii_uppercase) {
        return None;
    }
    let mut out = [0u8; 25];
    hex::decode_to_slice(&b[3..35], &mut out[..16]).ok()?;
    hex::decode_to_slice(&b[36..52], &mut out[16..24]).ok()?;
    hex::decode_to_slice(&b[53..55], &mut out[24..]).ok()?;
    Some(out)
}

/// The text of 25 `traceparent` bytes.
fn w3c_text(bytes: &[u8; 25]) -> [u8; 55] {
    let mut text = [0u8; 55];
    text[..3].copy_from_slice(b"00-");
    text[35] = b'-';
    text[52] = b'-';
    // The slices are exactly twice the bytes' length, so these cannot fail.
    let _ = hex::encode_to_slice(&bytes[..16], &mut text[3..35]);
    let _ = hex::encode_to_slice(&bytes[16..24], &mut text[36..52]);
    let _ = hex::encode_to_slice(&bytes[24..], &mut text[53..55]);
    text
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.with_text(|text| f.write_str(text))
    }
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.with_text(|text| fmt::Debug::fmt(text, f))
    }
}

impl From<&str> for TraceParent {
    fn from(text: &str) -> Self {
        TraceParent::parse(text)
    }
}

impl From<String> for TraceParent {
    fn from(text: String) -> Self {
        match w3c_bytes(&text) {
            Some(bytes) => TraceParent(TraceRepr::W3c(bytes)),
            None => TraceParent(TraceRepr::Text(text)),
        }
    }
}

impl PartialEq<str> for TraceParent {
    fn eq(&self, other: &str) -> bool {
        self.with_text(|text| text == other)
    }
}

impl PartialEq<&str> for TraceParent {
    fn eq(&self, other: &&str) -> bool {
        self == *other
    }
}

impl Serialize for TraceParent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.with_text(|text| s.serialize_str(text))
    }
}

impl<'de> Deserialize<'de> for TraceParent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(TextVisitor::<TraceParent>::new("a traceparent string"))
    }
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

/// A time in ms since the epoch as RFC 3339 (UTC), as the service and A2A wires write it;
/// empty if out of range.
pub fn rfc3339(ms: u64) -> String {
    let nanos = i128::from(ms) * 1_000_000;
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
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
    /// set, same content type, hop count carried over.
    pub fn reply(&self, from: impl Into<Name>, status: StatusCode) -> Envelope {
        let performative = if status.is_success() {
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
        reply.content_type = self.content_type.clone();
        reply.status = Some(status);
        reply
    }
}

/// Bytes as MessagePack `bin` in binary formats, and as base64 text in JSON.
pub(crate) mod bytes_field {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use bytes::Bytes;
    use serde::de::{self, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};
    use std::fmt;

    pub fn serialize<S: Serializer>(b: &Bytes, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&STANDARD.encode(b))
        } else {
            s.serialize_bytes(b)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Bytes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("bytes or base64 text")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Bytes, E> {
                Ok(Bytes::copy_from_slice(v))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
                Ok(Bytes::from(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Bytes, E> {
                STANDARD.decode(v).map(Bytes::from).map_err(E::custom)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Bytes, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(b) = seq.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(Bytes::from(out))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn common_content_types_are_static_text_and_others_are_kept() {
        for known in KNOWN_CONTENT_TYPES {
            let ct = ContentType::from(known.to_owned());
            assert!(matches!(ct.0, std::borrow::Cow::Borrowed(_)), "{known}");
            assert_eq!(ct, known);
        }
        let other = ContentType::from("application/vnd.example+cbor");
        assert!(matches!(other.0, std::borrow::Cow::Owned(_)));
        assert_eq!(other.as_str(), "application/vnd.example+cbor");
        assert_eq!(ContentType::default(), CONTENT_TYPE_MSGPACK);
        let json = serde_json::to_string(&other).expect("json");
        assert_eq!(json, r#""application/vnd.example+cbor""#);
        assert_eq!(
            serde_json::from_str::<ContentType>(&json).expect("reads"),
            other
        );
        // An envelope without one reads as MessagePack.
        let env: Envelope = serde_json::from_str(
            r#"{"version":"1.0","id":"018f0000-0000-7000-8000-000000000000","from":"a","kind":"event","performative":"inform","timestamp_ms":1}"#,
        )
        .expect("an envelope");
        assert_eq!(env.content_type, CONTENT_TYPE_MSGPACK);
    }
}
