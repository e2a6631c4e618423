//! The compact form of the envelope (protocol 2, `docs/PROTOCOL.md` section 3.5): a
//! MessagePack map with small integer keys, closed vocabularies as integer codes, the trace
//! context as 25 bytes, the timestamp taken from the UUIDv7 id, and the fields the subject
//! already carries (topic, recipient, command, capability) left to the subject.

use bytes::Bytes;
use rmp::encode as w;
use uuid::Uuid;

use super::decode::Reader;
use crate::protocol::envelope::{
    COMPACT_VERSION, CONTENT_TYPE_ENCRYPTED, CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, ContentType,
    DEFAULT_HOP_LIMIT, DeliveryClass, EncryptedKey, Encryption, Envelope, ExpectedReply, Kind,
    Name, PROTOCOL_VERSION, Performative, Priority, Progress, Sequence, Signature, TaskState,
    TraceContext, TraceParent,
};
use crate::protocol::implied::Implied;
use crate::protocol::status::StatusCode;

/// The one signature algorithm the compact form carries.
const SIGNATURE_ALG: &str = "ed25519";

/// The integer key of each field.
mod key {
    pub(super) const VERSION: u8 = 0;
    pub(super) const ID: u8 = 1;
    pub(super) const FROM: u8 = 2;
    pub(super) const KIND: u8 = 3;
    pub(super) const PERFORMATIVE: u8 = 4;
    pub(super) const TIMESTAMP_MS: u8 = 5;
    pub(super) const CORRELATION_ID: u8 = 6;
    pub(super) const IN_REPLY_TO: u8 = 7;
    pub(super) const TO: u8 = 8;
    pub(super) const TOPIC: u8 = 9;
    pub(super) const CAPABILITY: u8 = 10;
    pub(super) const NAME: u8 = 11;
    pub(super) const TTL_MS: u8 = 12;
    pub(super) const DEADLINE_MS: u8 = 13;
    pub(super) const HOPS: u8 = 14;
    pub(super) const HOP_LIMIT: u8 = 15;
    pub(super) const PRIORITY: u8 = 16;
    pub(super) const DELIVERY: u8 = 17;
    pub(super) const SEQ: u8 = 18;
    pub(super) const EXPECT: u8 = 19;
    pub(super) const PROGRESS: u8 = 20;
    pub(super) const STATUS: u8 = 21;
    pub(super) const REASON: u8 = 22;
    pub(super) const TRACE: u8 = 23;
    pub(super) const TRACESTATE: u8 = 24;
    pub(super) const TRACEPARENT: u8 = 25;
    pub(super) const SESSION_ID: u8 = 26;
    pub(super) const CUSTOMER_ID: u8 = 27;
    pub(super) const HEADERS: u8 = 28;
    pub(super) const CONTENT_TYPE: u8 = 29;
    pub(super) const PAYLOAD: u8 = 30;
    pub(super) const TOKEN: u8 = 31;
    pub(super) const SIGNATURE: u8 = 32;
    pub(super) const ENCRYPTION: u8 = 33;
    pub(super) const MINOR_VERSION: u8 = 34;
    pub(super) const CONTENT_ENCODING: u8 = 35;
}

/// Content type codes: `application/msgpack` is the default and never written.
const CT_JSON: u64 = 1;
const CT_ENCRYPTED: u64 = 2;

/// Whether `bytes` are in the compact form: a map whose first key is an integer (0 in a
/// well-formed one).
pub(crate) fn is_compact(bytes: &[u8]) -> bool {
    let key_at = match bytes.first() {
        Some(0x80..=0x8f) => 1,
        Some(0xde) => 3,
        Some(0xdf) => 5,
        _ => return false,
    };
    // The named form's keys are strings; a map keyed by an integer is the compact form, and
    // one whose first key is not 0 is a malformed compact envelope, not a named one.
    matches!(
        bytes.get(key_at),
        Some(0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff)
    )
}

/// The millisecond timestamp of a UUIDv7, if `id` is one.
fn v7_timestamp(id: &Uuid) -> Option<u64> {
    (id.get_version_num() == 7).then(|| (id.as_u128() >> 80) as u64)
}

/// Writes `env` in the compact form onto `out`, leaving out what `implied` (the subject it is
/// published to) carries.
pub(crate) fn encode(env: &Envelope, implied: &Implied<'_>, out: &mut Vec<u8>) {
    // Every field by name: a new Envelope field is a compile error here until it is written.
    let Envelope {
        version: _,
        id,
        correlation_id,
        in_reply_to,
        from,
        to,
        topic,
        capability,
        name,
        kind,
        performative,
        timestamp_ms,
        ttl_ms,
        deadline_ms,
        hops,
        hop_limit,
        priority,
        delivery,
        seq,
        expect,
        progress,
        status,
        reason,
        trace,
        session_id,
        customer_id,
        headers,
        content_type,
        content_encoding,
        payload,
        token,
        signature,
        encryption,
    } = env;
    let write_timestamp = v7_timestamp(id) != Some(*timestamp_ms);
    // A reply's conversation is most often the request it answers: then it is not repeated,
    // and a reply with no conversation of its own says so with nil.
    let write_correlation = match (correlation_id, in_reply_to) {
        (Some(c), Some(r)) => c != r,
        (Some(_), None) => true,
        (None, Some(_)) => true,
        (None, None) => false,
    };
    let to_implied = matches!(to.as_slice(), [only] if implied.agent == Some(only.as_str()));
    let write_to = !to.is_empty() && !to_implied;
    let write_topic = topic.is_some() && topic.as_deref() != implied.topic;
    let write_capability = capability.is_some() && capability.as_deref() != implied.capability;
    let write_name = name.is_some() && name.as_deref() != implied.name;
    let content_code = content_code(content_type);
    let fields = 5
        + usize::from(COMPACT_VERSION.minor != 0)
        + usize::from(write_timestamp)
        + usize::from(write_correlation)
        + usize::from(in_reply_to.is_some())
        + usize::from(write_to)
        + usize::from(write_topic)
        + usize::from(write_capability)
        + usize::from(write_name)
        + usize::from(ttl_ms.is_some())
        + usize::from(deadline_ms.is_some())
        + usize::from(*hops != 0)
        + usize::from(*hop_limit != DEFAULT_HOP_LIMIT)
        + usize::from(*priority != Priority::Normal)
        + usize::from(*delivery != DeliveryClass::AtMostOnce)
        + usize::from(seq.is_some())
        + usize::from(expect.is_some())
        + usize::from(progress.is_some())
        + usize::from(status.is_some())
        + usize::from(reason.is_some())
        + usize::from(trace.is_some())
        + usize::from(trace.as_ref().is_some_and(|t| t.tracestate.is_some()))
        + usize::from(session_id.is_some())
        + usize::from(customer_id.is_some())
        + usize::from(!headers.is_empty())
        + usize::from(content_code.is_some())
        + usize::from(!payload.is_empty())
        + usize::from(token.is_some())
        + usize::from(signature.is_some())
        + usize::from(encryption.is_some())
        + usize::from(content_encoding.is_some());
    // Writes to a Vec cannot fail, so the io results below are ignored.
    head(out, fields, id, from, *kind, *performative);
    if write_timestamp {
        uint(out, key::TIMESTAMP_MS, *timestamp_ms);
    }
    if write_correlation {
        k(out, key::CORRELATION_ID);
        match correlation_id {
            Some(id) => bin(out, id.as_bytes()),
            None => {
                let _ = w::write_nil(out);
            }
        }
    }
    if let Some(id) = in_reply_to {
        k(out, key::IN_REPLY_TO);
        bin(out, id.as_bytes());
    }
    if write_to {
        k(out, key::TO);
        let _ = w::write_array_len(out, to.len() as u32);
        for to in to {
            str(out, to);
        }
    }
    if write_topic {
        opt_str(out, key::TOPIC, topic);
    }
    if write_capability {
        opt_str(out, key::CAPABILITY, capability);
    }
    if write_name {
        opt_str(out, key::NAME, name);
    }
    if let Some(v) = ttl_ms {
        uint(out, key::TTL_MS, *v);
    }
    if let Some(v) = deadline_ms {
        uint(out, key::DEADLINE_MS, *v);
    }
    if *hops != 0 {
        uint(out, key::HOPS, (*hops).into());
    }
    if *hop_limit != DEFAULT_HOP_LIMIT {
        uint(out, key::HOP_LIMIT, (*hop_limit).into());
    }
    if *priority != Priority::Normal {
        uint(out, key::PRIORITY, priority.code().into());
    }
    if *delivery != DeliveryClass::AtMostOnce {
        uint(out, key::DELIVERY, delivery.code().into());
    }
    if let Some(seq) = seq {
        sequence(out, seq);
    }
    if let Some(expect) = expect {
        k(out, key::EXPECT);
        let _ = w::write_array_len(out, 2);
        let _ = w::write_uint(out, expect.performative.code().into());
        let _ = w::write_uint(out, expect.timeout_ms);
    }
    if let Some(progress) = progress {
        k(out, key::PROGRESS);
        let _ = w::write_array_len(out, 1 + u32::from(progress.fraction.is_some()));
        let _ = w::write_uint(out, progress.state.code().into());
        if let Some(fraction) = progress.fraction {
            let _ = w::write_f32(out, fraction);
        }
    }
    if let Some(status) = status {
        uint(out, key::STATUS, status.0.into());
    }
    opt_str(out, key::REASON, reason);
    if let Some(trace) = trace {
        match trace.traceparent.as_bytes() {
            Some(bytes) => {
                k(out, key::TRACE);
                bin(out, bytes);
            }
            None => {
                k(out, key::TRACEPARENT);
                trace.traceparent.with_text(|text| str(out, text));
            }
        }
        opt_str(out, key::TRACESTATE, &trace.tracestate);
    }
    opt_str(out, key::SESSION_ID, session_id);
    opt_str(out, key::CUSTOMER_ID, customer_id);
    if !headers.is_empty() {
        k(out, key::HEADERS);
        let _ = w::write_map_len(out, headers.len() as u32);
        for (hk, hv) in headers {
            str(out, hk);
            str(out, hv);
        }
    }
    content_and_payload(out, content_code, payload);
    opt_str(out, key::TOKEN, token);
    if let Some(sig) = signature {
        k(out, key::SIGNATURE);
        let _ = w::write_array_len(out, 2);
        str(out, &sig.key);
        bin(out, &sig.value);
    }
    if let Some(enc) = encryption {
        k(out, key::ENCRYPTION);
        let _ = w::write_array_len(out, 3);
        str(out, &enc.alg);
        str(out, &enc.inner_content_type);
        let _ = w::write_array_len(out, enc.recipients.len() as u32);
        for r in &enc.recipients {
            let _ = w::write_array_len(out, 2);
            str(out, &r.agent);
            bin(out, &r.key);
        }
    }
    minor(out);
    opt_str(out, key::CONTENT_ENCODING, content_encoding);
}

/// The parts of an event written straight from them by [`encode_event`]: an event with no
/// parent, signature or span, published to `<root>.evt.<topic>` (which carries its topic).
#[derive(Debug, Clone, Copy)]
pub(crate) struct EventParts<'a> {
    pub(crate) id: Uuid,
    pub(crate) from: &'a str,
    pub(crate) hop_limit: u8,
    pub(crate) seq: Sequence,
    /// The trace context in its 25 bytes (trace id, parent id, flags).
    pub(crate) trace: [u8; 25],
    pub(crate) content_type: &'a str,
    pub(crate) payload: &'a [u8],
}

/// Writes an event from its parts: the same bytes [`encode`] writes for the envelope they
/// describe on its event subject, without building the envelope (no string is copied and
/// nothing is allocated but what `out` grows by).
pub(crate) fn encode_event(parts: &EventParts<'_>, out: &mut Vec<u8>) {
    let EventParts {
        id,
        from,
        hop_limit,
        seq,
        trace,
        content_type,
        payload,
    } = *parts;
    let content_code = content_code(content_type);
    let write_timestamp = v7_timestamp(&id).is_none();
    let fields = 7
        + usize::from(COMPACT_VERSION.minor != 0)
        + usize::from(write_timestamp)
        + usize::from(hop_limit != DEFAULT_HOP_LIMIT)
        + usize::from(content_code.is_some())
        + usize::from(!payload.is_empty());
    head(out, fields, &id, from, Kind::Event, Performative::Inform);
    if write_timestamp {
        uint(out, key::TIMESTAMP_MS, crate::protocol::envelope::now_ms());
    }
    if hop_limit != DEFAULT_HOP_LIMIT {
        uint(out, key::HOP_LIMIT, hop_limit.into());
    }
    sequence(out, &seq);
    k(out, key::TRACE);
    bin(out, &trace);
    content_and_payload(out, content_code, payload);
    minor(out);
}

/// The map's length and the fields every envelope starts with: version, id, sender, kind,
/// performative.
fn head(
    out: &mut Vec<u8>,
    fields: usize,
    id: &Uuid,
    from: &str,
    kind: Kind,
    performative: Performative,
) {
    let _ = w::write_map_len(out, fields as u32);
    uint(out, key::VERSION, COMPACT_VERSION.major.into());
    k(out, key::ID);
    bin(out, id.as_bytes());
    k(out, key::FROM);
    str(out, from);
    uint(out, key::KIND, kind.code().into());
    uint(out, key::PERFORMATIVE, performative.code().into());
}

/// The publisher's sequence: `[epoch, n]`.
fn sequence(out: &mut Vec<u8>, seq: &Sequence) {
    k(out, key::SEQ);
    let _ = w::write_array_len(out, 2);
    let _ = w::write_uint(out, seq.epoch.into());
    let _ = w::write_uint(out, seq.n);
}

/// The minor version, last, when it is not 0.
fn minor(out: &mut Vec<u8>) {
    if COMPACT_VERSION.minor != 0 {
        uint(out, key::MINOR_VERSION, COMPACT_VERSION.minor.into());
    }
}

/// The code of a content type: none for the default (MessagePack), a number for the known
/// ones, the text for any other.
fn content_code(content_type: &str) -> Option<Result<u64, &str>> {
    match content_type {
        CONTENT_TYPE_MSGPACK => None,
        CONTENT_TYPE_JSON => Some(Ok(CT_JSON)),
        CONTENT_TYPE_ENCRYPTED => Some(Ok(CT_ENCRYPTED)),
        other => Some(Err(other)),
    }
}

/// The content type (unless the default) and the payload (unless empty).
fn content_and_payload(out: &mut Vec<u8>, code: Option<Result<u64, &str>>, payload: &[u8]) {
    match code {
        None => {}
        Some(Ok(code)) => uint(out, key::CONTENT_TYPE, code),
        Some(Err(other)) => {
            k(out, key::CONTENT_TYPE);
            str(out, other);
        }
    }
    if !payload.is_empty() {
        k(out, key::PAYLOAD);
        bin(out, payload);
    }
}

fn k(out: &mut Vec<u8>, key: u8) {
    let _ = w::write_pfix(out, key);
}

fn str(out: &mut Vec<u8>, s: &str) {
    let _ = w::write_str(out, s);
}

fn bin(out: &mut Vec<u8>, b: &[u8]) {
    let _ = w::write_bin(out, b);
}

fn uint(out: &mut Vec<u8>, key: u8, v: u64) {
    k(out, key);
    let _ = w::write_uint(out, v);
}

fn opt_str<S: AsRef<str>>(out: &mut Vec<u8>, key: u8, v: &Option<S>) {
    if let Some(v) = v {
        k(out, key);
        str(out, v.as_ref());
    }
}

/// Why compact bytes are not an envelope.
fn malformed(what: &str) -> String {
    format!("compact envelope: {what}")
}

/// Reads a compact envelope. With `shared` (the same bytes, reference-counted) the payload
/// is a slice of them rather than a copy. The fields the subject carries stay empty until
/// [`Implied::restore`] fills them in. The error says what is wrong; a major version other
/// than 2 is `Err(Ok(version))`.
pub(crate) fn decode(
    bytes: &[u8],
    shared: Option<&Bytes>,
) -> Result<Envelope, Result<String, String>> {
    let mut r = Reader {
        buf: bytes,
        shared,
        pos: 0,
    };
    let bad = |what: &str| Err(Err(malformed(what)));
    let Some(fields) = r.map_len() else {
        return bad("not a map");
    };
    let mut env = Envelope::blank(
        Kind::Unknown,
        Performative::Unknown,
        Name::default(),
        // MessagePack unless a content type comes (static text: no allocation).
        ContentType::default(),
    );
    env.version = PROTOCOL_VERSION;
    let mut seen = 0u64;
    let mut timestamp = None;
    for i in 0..fields {
        let Some(field) = r.uint() else {
            return bad("a key that is not a small unsigned integer");
        };
        if i == 0 && field != u64::from(key::VERSION) {
            return bad("the first key is not 0 (the version)");
        }
        if field < 64 {
            if seen & (1 << field) != 0 {
                return bad(&format!("key {field} repeated"));
            }
            seen |= 1 << field;
        }
        let read = read_field(&mut r, field, &mut env, &mut timestamp);
        match read {
            Some(Ok(())) => {}
            Some(Err(version)) => return Err(Ok(version)),
            None => return bad(&format!("key {field} does not read")),
        }
    }
    if r.pos != bytes.len() {
        return bad("bytes after the envelope");
    }
    for (required, name) in [
        (key::ID, "id"),
        (key::FROM, "from"),
        (key::KIND, "kind"),
        (key::PERFORMATIVE, "performative"),
    ] {
        if seen & (1 << required) == 0 {
            return bad(&format!("no {name} (key {required})"));
        }
    }
    // No key 6 on a reply: its conversation is the request it answers (nil: it has none).
    if seen & (1 << key::CORRELATION_ID) == 0 {
        env.correlation_id = env.in_reply_to;
    }
    if env.trace.as_ref().is_some_and(|t| t.traceparent.is_empty()) {
        return bad("tracestate (key 24) without a traceparent (key 23 or 25)");
    }
    env.timestamp_ms = match timestamp.or_else(|| v7_timestamp(&env.id)) {
        Some(t) => t,
        None => return bad("no timestamp_ms (key 5), and the id is not a UUIDv7"),
    };
    Ok(env)
}

/// Reads the value of `field` into `env`: `None` when it does not read, `Some(Err(version))`
/// for a major version other than 2.
fn read_field(
    r: &mut Reader<'_>,
    field: u64,
    env: &mut Envelope,
    timestamp: &mut Option<u64>,
) -> Option<Result<(), String>> {
    let string = |r: &mut Reader<'_>| r.str().map(str::to_owned);
    match u8::try_from(field).ok()? {
        key::VERSION => {
            let major = r.uint()?;
            if major != u64::from(COMPACT_VERSION.major) {
                return Some(Err(format!("{major}")));
            }
        }
        // A newer minor is read like this one: its new keys are skipped.
        key::MINOR_VERSION => {
            r.uint()?;
        }
        key::ID => env.id = r.uuid()?,
        key::FROM => env.from = Name::new(r.str()?),
        key::KIND => env.kind = Kind::from_code(r.uint()?),
        key::PERFORMATIVE => env.performative = Performative::from_code(r.uint()?),
        key::TIMESTAMP_MS => *timestamp = Some(r.uint()?),
        key::CORRELATION_ID => env.correlation_id = r.opt(Reader::uuid)?,
        key::IN_REPLY_TO => env.in_reply_to = Some(r.uuid()?),
        key::TO => {
            let n = r.array_len()?;
            let mut to = Vec::with_capacity(n.min(64));
            for _ in 0..n {
                to.push(string(r)?);
            }
            env.to = to;
        }
        key::TOPIC => env.topic = Some(Name::new(r.str()?)),
        key::CAPABILITY => env.capability = Some(string(r)?),
        key::NAME => env.name = Some(string(r)?),
        key::TTL_MS => env.ttl_ms = Some(r.uint()?),
        key::DEADLINE_MS => env.deadline_ms = Some(r.uint()?),
        key::HOPS => env.hops = u8::try_from(r.uint()?).ok()?,
        key::HOP_LIMIT => env.hop_limit = u8::try_from(r.uint()?).ok()?,
        key::PRIORITY => env.priority = Priority::from_code(r.uint()?),
        key::DELIVERY => env.delivery = DeliveryClass::from_code(r.uint()?),
        key::SEQ => {
            let (epoch, n) = pair(r, Reader::uint, Reader::uint)?;
            env.seq = Some(Sequence {
                epoch: u32::try_from(epoch).ok()?,
                n,
            });
        }
        key::EXPECT => {
            let (performative, timeout_ms) = pair(r, Reader::uint, Reader::uint)?;
            env.expect = Some(ExpectedReply {
                performative: Performative::from_code(performative),
                timeout_ms,
            });
        }
        key::PROGRESS => {
            let n = r.array_len()?;
            if n == 0 || n > 2 {
                return None;
            }
            let state = TaskState::from_code(r.uint()?);
            let fraction = if n == 2 { Some(r.f32()?) } else { None };
            env.progress = Some(Progress { state, fraction });
        }
        key::STATUS => env.status = Some(StatusCode(u16::try_from(r.uint()?).ok()?)),
        key::REASON => env.reason = Some(string(r)?),
        key::TRACE => {
            let bytes: [u8; 25] = r.bin()?.as_ref().try_into().ok()?;
            trace_mut(env).traceparent = TraceParent::from_bytes(bytes);
        }
        key::TRACEPARENT => trace_mut(env).traceparent = TraceParent::from(string(r)?),
        key::TRACESTATE => trace_mut(env).tracestate = Some(string(r)?),
        key::SESSION_ID => env.session_id = Some(string(r)?),
        key::CUSTOMER_ID => env.customer_id = Some(string(r)?),
        key::HEADERS => {
            let n = r.map_len()?;
            for _ in 0..n {
                let hk = string(r)?;
                let hv = string(r)?;
                env.headers.insert(hk, hv);
            }
        }
        key::CONTENT_TYPE => {
            env.content_type = match r.peek()? {
                0x00..=0x7f | 0xcc..=0xd3 => match r.uint()? {
                    CT_JSON => CONTENT_TYPE_JSON.into(),
                    CT_ENCRYPTED => CONTENT_TYPE_ENCRYPTED.into(),
                    _ => return None,
                },
                _ => r.str()?.into(),
            };
        }
        key::PAYLOAD => env.payload = r.bin()?,
        key::TOKEN => env.token = Some(string(r)?),
        key::CONTENT_ENCODING => env.content_encoding = Some(string(r)?),
        key::SIGNATURE => {
            let (key, value) = pair(r, |r| r.str().map(str::to_owned), Reader::bin)?;
            env.signature = Some(Signature {
                alg: SIGNATURE_ALG.to_owned(),
                key,
                value,
            });
        }
        key::ENCRYPTION => {
            if r.array_len()? != 3 {
                return None;
            }
            let alg = string(r)?;
            let inner_content_type = string(r)?;
            let n = r.array_len()?;
            let mut recipients = Vec::with_capacity(n.min(64));
            for _ in 0..n {
                let (agent, key) = pair(r, |r| r.str().map(str::to_owned), Reader::bin)?;
                recipients.push(EncryptedKey { agent, key });
            }
            env.encryption = Some(Encryption {
                alg,
                inner_content_type,
                recipients,
            });
        }
        // A key from a newer minor version: skipped.
        _ => r.skip(0)?,
    }
    Some(Ok(()))
}

/// A two-element array.
fn pair<'a, A, B>(
    r: &mut Reader<'a>,
    first: impl FnOnce(&mut Reader<'a>) -> Option<A>,
    second: impl FnOnce(&mut Reader<'a>) -> Option<B>,
) -> Option<(A, B)> {
    if r.array_len()? != 2 {
        return None;
    }
    Some((first(r)?, second(r)?))
}

fn trace_mut(env: &mut Envelope) -> &mut TraceContext {
    env.trace.get_or_insert_with(|| TraceContext {
        traceparent: TraceParent::from(String::new()),
        tracestate: None,
    })
}

/// The sender and sequence of a compact envelope, read without decoding the rest.
pub(crate) fn peek_sequence(bytes: &[u8]) -> Option<(&str, Sequence)> {
    let mut r = Reader {
        buf: bytes,
        shared: None,
        pos: 0,
    };
    let fields = r.map_len()?;
    let mut from = None;
    for _ in 0..fields {
        match u8::try_from(r.uint()?).ok()? {
            key::FROM => from = Some(r.str()?),
            key::SEQ => {
                let (epoch, n) = pair(&mut r, Reader::uint, Reader::uint)?;
                return Some((
                    from?,
                    Sequence {
                        epoch: u32::try_from(epoch).ok()?,
                        n,
                    },
                ));
            }
            _ => r.skip(0)?,
        }
    }
    None
}
