//! The MessagePack form of the envelope, written and read by hand: the hot path of every
//! message. The bytes are exactly those the serde derive on [`Envelope`] produces (a map of
//! field names, empty optional fields left out, in declaration order), which the tests check
//! on every field; reading takes the common shapes directly, borrows the payload from the
//! message instead of copying it, and hands anything unusual (a field of an unexpected type, a
//! repeated or missing field, an array for a map) to the serde decoder, so that what is
//! accepted, and every error, stays serde's.

use bytes::Bytes;
use rmp::encode as w;
use uuid::Uuid;

use crate::protocol::envelope::{
    DEFAULT_HOP_LIMIT, DeliveryClass, Envelope, ExpectedReply, Kind, PROTOCOL_VERSION,
    Performative, Priority, Progress, Signature, TraceContext, Version,
};
use crate::protocol::status::StatusCode;

/// Writes `env` as MessagePack onto `out`.
pub(crate) fn encode(env: &Envelope, out: &mut Vec<u8>) {
    // Every field by name, none skipped: a new Envelope field is a compile error here until
    // the encoder writes it (and an unused binding fails the lint).
    let Envelope {
        version,
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
        expect,
        progress,
        status,
        reason,
        trace,
        session_id,
        customer_id,
        headers,
        content_type,
        payload,
        token,
        signature,
        encryption,
    } = env;
    // Writes to a Vec cannot fail, so the io results below are ignored.
    let fields = 7
        + usize::from(correlation_id.is_some())
        + usize::from(in_reply_to.is_some())
        + usize::from(!to.is_empty())
        + usize::from(topic.is_some())
        + usize::from(capability.is_some())
        + usize::from(name.is_some())
        + usize::from(ttl_ms.is_some())
        + usize::from(deadline_ms.is_some())
        + usize::from(*hops != 0)
        + usize::from(*hop_limit != DEFAULT_HOP_LIMIT)
        + usize::from(*priority != Priority::Normal)
        + usize::from(*delivery != DeliveryClass::AtMostOnce)
        + usize::from(expect.is_some())
        + usize::from(progress.is_some())
        + usize::from(status.is_some())
        + usize::from(reason.is_some())
        + usize::from(trace.is_some())
        + usize::from(session_id.is_some())
        + usize::from(customer_id.is_some())
        + usize::from(!headers.is_empty())
        + usize::from(!payload.is_empty())
        + usize::from(token.is_some())
        + usize::from(signature.is_some())
        + usize::from(encryption.is_some());
    let _ = w::write_map_len(out, fields as u32);
    key(out, "version");
    if *version == PROTOCOL_VERSION {
        str(out, "1.0");
    } else {
        str(out, &version.to_string());
    }
    key(out, "id");
    bin(out, id.as_bytes());
    if let Some(id) = correlation_id {
        key(out, "correlation_id");
        bin(out, id.as_bytes());
    }
    if let Some(id) = in_reply_to {
        key(out, "in_reply_to");
        bin(out, id.as_bytes());
    }
    key(out, "from");
    str(out, from);
    if !to.is_empty() {
        key(out, "to");
        let _ = w::write_array_len(out, to.len() as u32);
        for to in to {
            str(out, to);
        }
    }
    opt_str(out, "topic", topic);
    opt_str(out, "capability", capability);
    opt_str(out, "name", name);
    key(out, "kind");
    str(out, kind.as_str());
    key(out, "performative");
    str(out, performative.as_str());
    key(out, "timestamp_ms");
    uint(out, *timestamp_ms);
    opt_uint(out, "ttl_ms", *ttl_ms);
    opt_uint(out, "deadline_ms", *deadline_ms);
    if *hops != 0 {
        key(out, "hops");
        uint(out, (*hops).into());
    }
    if *hop_limit != DEFAULT_HOP_LIMIT {
        key(out, "hop_limit");
        uint(out, (*hop_limit).into());
    }
    if *priority != Priority::Normal {
        key(out, "priority");
        str(out, priority.as_str());
    }
    if *delivery != DeliveryClass::AtMostOnce {
        key(out, "delivery");
        str(out, delivery.as_str());
    }
    if let Some(expect) = expect {
        key(out, "expect");
        let _ = w::write_map_len(out, 2);
        key(out, "performative");
        str(out, expect.performative.as_str());
        key(out, "timeout_ms");
        uint(out, expect.timeout_ms);
    }
    if let Some(progress) = progress {
        key(out, "progress");
        let _ = w::write_map_len(out, 1 + u32::from(progress.fraction.is_some()));
        key(out, "state");
        str(out, progress.state.as_str());
        if let Some(fraction) = progress.fraction {
            key(out, "fraction");
            let _ = w::write_f32(out, fraction);
        }
    }
    if let Some(status) = status {
        key(out, "status");
        uint(out, status.0.into());
    }
    opt_str(out, "reason", reason);
    if let Some(trace) = trace {
        key(out, "trace");
        let _ = w::write_map_len(out, 1 + u32::from(trace.tracestate.is_some()));
        key(out, "traceparent");
        str(out, &trace.traceparent);
        opt_str(out, "tracestate", &trace.tracestate);
    }
    opt_str(out, "session_id", session_id);
    opt_str(out, "customer_id", customer_id);
    if !headers.is_empty() {
        key(out, "headers");
        let _ = w::write_map_len(out, headers.len() as u32);
        for (k, v) in headers {
            str(out, k);
            str(out, v);
        }
    }
    key(out, "content_type");
    str(out, content_type);
    if !payload.is_empty() {
        key(out, "payload");
        bin(out, payload);
    }
    opt_str(out, "token", token);
    if let Some(sig) = signature {
        key(out, "signature");
        let _ = w::write_map_len(out, 3);
        key(out, "alg");
        str(out, &sig.alg);
        key(out, "key");
        str(out, &sig.key);
        key(out, "value");
        bin(out, &sig.value);
    }
    if let Some(enc) = encryption {
        key(out, "encryption");
        let _ = w::write_map_len(out, 3);
        key(out, "alg");
        str(out, &enc.alg);
        key(out, "inner_content_type");
        str(out, &enc.inner_content_type);
        key(out, "recipients");
        let _ = w::write_array_len(out, enc.recipients.len() as u32);
        for r in &enc.recipients {
            let _ = w::write_map_len(out, 2);
            key(out, "agent");
            str(out, &r.agent);
            key(out, "key");
            bin(out, &r.key);
        }
    }
}

fn key(out: &mut Vec<u8>, name: &str) {
    str(out, name);
}

fn str(out: &mut Vec<u8>, s: &str) {
    let _ = w::write_str(out, s);
}

fn bin(out: &mut Vec<u8>, b: &[u8]) {
    let _ = w::write_bin(out, b);
}

fn uint(out: &mut Vec<u8>, v: u64) {
    let _ = w::write_uint(out, v);
}

fn opt_str(out: &mut Vec<u8>, name: &str, v: &Option<String>) {
    if let Some(v) = v {
        key(out, name);
        str(out, v);
    }
}

fn opt_uint(out: &mut Vec<u8>, name: &str, v: Option<u64>) {
    if let Some(v) = v {
        key(out, name);
        uint(out, v);
    }
}

/// Reads an envelope from `bytes`; with `shared` (the same bytes, reference-counted) the
/// payload is a slice of them rather than a copy. `None` when the bytes are not in a shape
/// this reader takes; the caller then asks serde, which decides.
/// The bit of each envelope field in the decoder's set of fields seen, in declaration order.
mod bit {
    pub(super) const VERSION: u32 = 0;
    pub(super) const ID: u32 = 1;
    pub(super) const CORRELATION_ID: u32 = 2;
    pub(super) const IN_REPLY_TO: u32 = 3;
    pub(super) const FROM: u32 = 4;
    pub(super) const TO: u32 = 5;
    pub(super) const TOPIC: u32 = 6;
    pub(super) const CAPABILITY: u32 = 7;
    pub(super) const NAME: u32 = 8;
    pub(super) const KIND: u32 = 9;
    pub(super) const PERFORMATIVE: u32 = 10;
    pub(super) const TIMESTAMP_MS: u32 = 11;
    pub(super) const TTL_MS: u32 = 12;
    pub(super) const DEADLINE_MS: u32 = 13;
    pub(super) const HOPS: u32 = 14;
    pub(super) const HOP_LIMIT: u32 = 15;
    pub(super) const PRIORITY: u32 = 16;
    pub(super) const DELIVERY: u32 = 17;
    pub(super) const EXPECT: u32 = 18;
    pub(super) const PROGRESS: u32 = 19;
    pub(super) const STATUS: u32 = 20;
    pub(super) const REASON: u32 = 21;
    pub(super) const TRACE: u32 = 22;
    pub(super) const SESSION_ID: u32 = 23;
    pub(super) const CUSTOMER_ID: u32 = 24;
    pub(super) const HEADERS: u32 = 25;
    pub(super) const CONTENT_TYPE: u32 = 26;
    pub(super) const PAYLOAD: u32 = 27;
    pub(super) const TOKEN: u32 = 28;
    pub(super) const SIGNATURE: u32 = 29;
    // `encryption` is rare and read by serde (the slow path), so it has no bit.
}

pub(crate) fn decode(bytes: &[u8], shared: Option<&Bytes>) -> Option<Envelope> {
    let mut r = Reader {
        buf: bytes,
        shared,
        pos: 0,
    };
    let fields = r.map_len()?;
    // The content type is filled in at the end when absent, saving an allocation when present.
    let mut env = Envelope::blank(
        Kind::Unknown,
        Performative::Unknown,
        String::new(),
        String::new(),
    );
    // One bit per field seen: a repeated field, or a missing required one, goes to serde.
    let mut seen = 0u32;
    for _ in 0..fields {
        let name = r.str_bytes()?;
        let bit = match name {
            b"version" => {
                env.version = match r.str()? {
                    "1.0" => PROTOCOL_VERSION,
                    other => other.parse::<Version>().ok()?,
                };
                bit::VERSION
            }
            b"id" => {
                env.id = r.uuid()?;
                bit::ID
            }
            b"correlation_id" => {
                env.correlation_id = r.opt(Reader::uuid)?;
                bit::CORRELATION_ID
            }
            b"in_reply_to" => {
                env.in_reply_to = r.opt(Reader::uuid)?;
                bit::IN_REPLY_TO
            }
            b"from" => {
                env.from = r.str()?.to_owned();
                bit::FROM
            }
            b"to" => {
                let n = r.array_len()?;
                let mut to = Vec::with_capacity(n.min(64));
                for _ in 0..n {
                    to.push(r.str()?.to_owned());
                }
                env.to = to;
                bit::TO
            }
            b"topic" => {
                env.topic = r.opt_string()?;
                bit::TOPIC
            }
            b"capability" => {
                env.capability = r.opt_string()?;
                bit::CAPABILITY
            }
            b"name" => {
                env.name = r.opt_string()?;
                bit::NAME
            }
            b"kind" => {
                env.kind = r.str()?.parse().ok()?;
                bit::KIND
            }
            b"performative" => {
                env.performative = r.str()?.parse().ok()?;
                bit::PERFORMATIVE
            }
            b"timestamp_ms" => {
                env.timestamp_ms = r.uint()?;
                bit::TIMESTAMP_MS
            }
            b"ttl_ms" => {
                env.ttl_ms = r.opt(Reader::uint)?;
                bit::TTL_MS
            }
            b"deadline_ms" => {
                env.deadline_ms = r.opt(Reader::uint)?;
                bit::DEADLINE_MS
            }
            b"hops" => {
                env.hops = u8::try_from(r.uint()?).ok()?;
                bit::HOPS
            }
            b"hop_limit" => {
                env.hop_limit = u8::try_from(r.uint()?).ok()?;
                bit::HOP_LIMIT
            }
            b"priority" => {
                env.priority = r.str()?.parse().ok()?;
                bit::PRIORITY
            }
            b"delivery" => {
                env.delivery = r.str()?.parse().ok()?;
                bit::DELIVERY
            }
            b"expect" => {
                env.expect = r.opt(Reader::expect)?;
                bit::EXPECT
            }
            b"progress" => {
                env.progress = r.opt(Reader::progress)?;
                bit::PROGRESS
            }
            b"status" => {
                env.status = r.opt(|r| u16::try_from(r.uint()?).ok().map(StatusCode))?;
                bit::STATUS
            }
            b"reason" => {
                env.reason = r.opt_string()?;
                bit::REASON
            }
            b"trace" => {
                env.trace = r.opt(Reader::trace)?;
                bit::TRACE
            }
            b"session_id" => {
                env.session_id = r.opt_string()?;
                bit::SESSION_ID
            }
            b"customer_id" => {
                env.customer_id = r.opt_string()?;
                bit::CUSTOMER_ID
            }
            b"headers" => {
                let n = r.map_len()?;
                for _ in 0..n {
                    let k = r.str()?.to_owned();
                    let v = r.str()?.to_owned();
                    env.headers.insert(k, v);
                }
                bit::HEADERS
            }
            b"content_type" => {
                env.content_type = r.str()?.to_owned();
                bit::CONTENT_TYPE
            }
            b"payload" => {
                env.payload = r.bin()?;
                bit::PAYLOAD
            }
            b"token" => {
                env.token = r.opt_string()?;
                bit::TOKEN
            }
            b"signature" => {
                env.signature = r.opt(Reader::signature)?;
                bit::SIGNATURE
            }
            b"encryption" => {
                // Rare, and the slow path of its own: serde reads it.
                return None;
            }
            _ => {
                r.skip(0)?;
                continue;
            }
        };
        if seen & (1 << bit) != 0 {
            return None;
        }
        seen |= 1 << bit;
    }
    // version, id, from, kind, performative and timestamp_ms are required; nothing may follow.
    const REQUIRED: u32 = 1 << bit::VERSION
        | 1 << bit::ID
        | 1 << bit::FROM
        | 1 << bit::KIND
        | 1 << bit::PERFORMATIVE
        | 1 << bit::TIMESTAMP_MS;
    if seen & REQUIRED != REQUIRED || r.pos != bytes.len() {
        return None;
    }
    if seen & 1 << bit::CONTENT_TYPE == 0 {
        env.content_type = crate::protocol::envelope::CONTENT_TYPE_MSGPACK.to_owned();
    }
    Some(env)
}

/// Deepest nesting of an unknown field this reader skips; deeper goes to serde.
const MAX_DEPTH: usize = 32;

struct Reader<'a> {
    buf: &'a [u8],
    shared: Option<&'a Bytes>,
    pos: usize,
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> Option<u8> {
        let b = *self.buf.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    fn peek(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn be(&mut self, n: usize) -> Option<u64> {
        Some(
            self.take(n)?
                .iter()
                .fold(0u64, |acc, b| acc << 8 | u64::from(*b)),
        )
    }

    fn len(&mut self, n: usize) -> Option<usize> {
        usize::try_from(self.be(n)?).ok()
    }

    fn map_len(&mut self) -> Option<usize> {
        match self.byte()? {
            m @ 0x80..=0x8f => Some(usize::from(m & 0x0f)),
            0xde => self.len(2),
            0xdf => self.len(4),
            _ => None,
        }
    }

    fn array_len(&mut self) -> Option<usize> {
        match self.byte()? {
            m @ 0x90..=0x9f => Some(usize::from(m & 0x0f)),
            0xdc => self.len(2),
            0xdd => self.len(4),
            _ => None,
        }
    }

    /// A string's bytes without the UTF-8 check: what field names are read with, since they
    /// are only matched, never kept.
    fn str_bytes(&mut self) -> Option<&'a [u8]> {
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => self.len(1)?,
            0xda => self.len(2)?,
            0xdb => self.len(4)?,
            _ => return None,
        };
        self.take(n)
    }

    fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.str_bytes()?).ok()
    }

    fn bin_range(&mut self) -> Option<(usize, usize)> {
        let n = match self.byte()? {
            0xc4 => self.len(1)?,
            0xc5 => self.len(2)?,
            0xc6 => self.len(4)?,
            _ => return None,
        };
        let start = self.pos;
        self.take(n)?;
        Some((start, self.pos))
    }

    fn bin(&mut self) -> Option<Bytes> {
        let (start, end) = self.bin_range()?;
        Some(match self.shared {
            Some(shared) => shared.slice(start..end),
            None => Bytes::copy_from_slice(&self.buf[start..end]),
        })
    }

    fn uint(&mut self) -> Option<u64> {
        match self.byte()? {
            m @ 0x00..=0x7f => Some(u64::from(m)),
            0xcc => self.be(1),
            0xcd => self.be(2),
            0xce => self.be(4),
            0xcf => self.be(8),
            _ => None,
        }
    }

    fn uuid(&mut self) -> Option<Uuid> {
        let (start, end) = self.bin_range()?;
        Uuid::from_slice(self.buf.get(start..end)?).ok()
    }

    /// A nil reads as `None`; anything else as `read` reads it.
    fn opt<T>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Some(None);
        }
        read(self).map(Some)
    }

    fn opt_string(&mut self) -> Option<Option<String>> {
        self.opt(|r| r.str().map(str::to_owned))
    }

    /// Reads the fields of a nested struct: each known name to `field`, unknown ones skipped,
    /// each known one at most once.
    fn fields(
        &mut self,
        names: &[&str],
        mut field: impl FnMut(&mut Self, usize) -> Option<()>,
    ) -> Option<u32> {
        let n = self.map_len()?;
        let mut seen = 0u32;
        for _ in 0..n {
            let name = self.str_bytes()?;
            match names.iter().position(|k| k.as_bytes() == name) {
                Some(i) => {
                    if seen & (1 << i) != 0 {
                        return None;
                    }
                    seen |= 1 << i;
                    field(self, i)?;
                }
                None => self.skip(1)?,
            }
        }
        Some(seen)
    }

    fn expect(&mut self) -> Option<ExpectedReply> {
        let mut performative = None;
        let mut timeout_ms = None;
        self.fields(&["performative", "timeout_ms"], |r, i| {
            if i == 0 {
                performative = Some(r.str()?.parse().ok()?);
            } else {
                timeout_ms = Some(r.uint()?);
            }
            Some(())
        })?;
        Some(ExpectedReply {
            performative: performative?,
            timeout_ms: timeout_ms?,
        })
    }

    fn progress(&mut self) -> Option<Progress> {
        let mut state = None;
        let mut fraction = None;
        self.fields(&["state", "fraction"], |r, i| {
            if i == 0 {
                state = Some(r.str()?.parse().ok()?);
            } else {
                fraction = r.opt(Reader::f32)?;
            }
            Some(())
        })?;
        Some(Progress {
            state: state?,
            fraction,
        })
    }

    fn f32(&mut self) -> Option<f32> {
        match self.byte()? {
            0xca => Some(f32::from_bits(u32::try_from(self.be(4)?).ok()?)),
            _ => None,
        }
    }

    fn trace(&mut self) -> Option<TraceContext> {
        let mut traceparent = None;
        let mut tracestate = None;
        self.fields(&["traceparent", "tracestate"], |r, i| {
            if i == 0 {
                traceparent = Some(r.str()?.to_owned());
            } else {
                tracestate = r.opt_string()?;
            }
            Some(())
        })?;
        Some(TraceContext {
            traceparent: traceparent?,
            tracestate,
        })
    }

    fn signature(&mut self) -> Option<Signature> {
        let (mut alg, mut key, mut value) = (None, None, None);
        self.fields(&["alg", "key", "value"], |r, i| {
            match i {
                0 => alg = Some(r.str()?.to_owned()),
                1 => key = Some(r.str()?.to_owned()),
                _ => value = Some(r.bin()?),
            }
            Some(())
        })?;
        Some(Signature {
            alg: alg?,
            key: key?,
            value: value?,
        })
    }

    /// Skips one value of any type.
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        let m = self.byte()?;
        let (data, items) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * usize::from(m & 0x0f)),
            0x90..=0x9f => (0, usize::from(m & 0x0f)),
            0xa0..=0xbf => (usize::from(m & 0x1f), 0),
            0xc4 | 0xd9 => (self.len(1)?, 0),
            0xc5 | 0xda => (self.len(2)?, 0),
            0xc6 | 0xdb => (self.len(4)?, 0),
            0xc7 => (self.len(1)? + 1, 0),
            0xc8 => (self.len(2)? + 1, 0),
            0xc9 => (self.len(4)?.checked_add(1)?, 0),
            0xca | 0xce | 0xd2 => (4, 0),
            0xcb | 0xcf | 0xd3 => (8, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (0, self.len(2)?),
            0xdd => (0, self.len(4)?),
            0xde => (0, 2 * self.len(2)?),
            0xdf => (0, self.len(4)?.checked_mul(2)?),
            // 0xc1 is never used.
            _ => return None,
        };
        self.take(data)?;
        for _ in 0..items {
            self.skip(depth + 1)?;
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::envelope::{EncryptedKey, Encryption, Kind, Performative, ProgressState};

    fn serde_bytes(env: &Envelope) -> Vec<u8> {
        let mut out = Vec::new();
        serde::Serialize::serialize(
            env,
            &mut rmp_serde::Serializer::new(&mut out).with_struct_map(),
        )
        .expect("serde encodes");
        out
    }

    fn full() -> Envelope {
        let mut e = Envelope::new(Kind::Command, Performative::Assign, "orchestrator");
        e.version.minor = 3;
        e.correlation_id = Some(Uuid::now_v7());
        e.in_reply_to = Some(Uuid::now_v7());
        e.to = vec!["a".into(), "b".repeat(40)];
        e.topic = Some("doc.scanned".into());
        e.capability = Some("ocr".into());
        e.name = Some("scan".into());
        e.ttl_ms = Some(70_000);
        e.deadline_ms = Some(u64::MAX);
        e.hops = 3;
        e.hop_limit = 200;
        e.priority = Priority::Critical;
        e.delivery = DeliveryClass::ExactlyOnce;
        e.expect = Some(ExpectedReply {
            performative: Performative::Inform,
            timeout_ms: 300,
        });
        e.progress = Some(Progress {
            state: ProgressState::Running,
            fraction: Some(0.25),
        });
        e.status = Some(StatusCode(5002));
        e.reason = Some("é".repeat(300));
        e.trace = Some(TraceContext {
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
            tracestate: Some("congo=t61rcWkgMzE".into()),
        });
        e.session_id = Some("s".into());
        e.customer_id = Some("c".into());
        e.headers.insert("k1".into(), "v1".into());
        e.headers.insert("k2".into(), String::new());
        e.content_type = "application/json".into();
        e.payload = Bytes::from(vec![7u8; 70_000]);
        e.token = Some("t".into());
        e.signature = Some(Signature {
            alg: "ed25519".into(),
            key: "UABC".into(),
            value: Bytes::from(vec![1u8; 64]),
        });
        e
    }

    /// Every field, one at a time and together, at the size boundaries of each MessagePack
    /// form.
    fn variants() -> Vec<Envelope> {
        let base = Envelope::new(Kind::Event, Performative::Inform, "p");
        let mut out = vec![base.clone(), full()];
        let mut with_encryption = full();
        with_encryption.encryption = Some(Encryption {
            alg: "hpke".into(),
            inner_content_type: "application/msgpack".into(),
            recipients: vec![EncryptedKey {
                agent: "r".into(),
                key: Bytes::from(vec![9u8; 32]),
            }],
        });
        out.push(with_encryption);
        for len in [0usize, 1, 31, 32, 255, 256, 65_535, 65_536] {
            let mut e = base.clone();
            e.from = "x".repeat(len);
            e.payload = Bytes::from(vec![0x5a; len]);
            out.push(e);
        }
        for n in [
            0u64,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u32::MAX.into(),
            u64::MAX,
        ] {
            let mut e = base.clone();
            e.timestamp_ms = n;
            e.ttl_ms = Some(n);
            out.push(e);
        }
        for n in 0..40 {
            let mut e = base.clone();
            e.to = (0..n).map(|i| i.to_string()).collect();
            e.headers = (0..n).map(|i| (i.to_string(), i.to_string())).collect();
            out.push(e);
        }
        let mut no_fraction = full();
        no_fraction.progress = Some(Progress {
            state: ProgressState::Failed,
            fraction: None,
        });
        no_fraction.trace.as_mut().expect("trace").tracestate = None;
        out.push(no_fraction);
        out
    }

    #[test]
    fn writes_exactly_what_serde_writes() {
        for env in variants() {
            let mut ours = Vec::new();
            encode(&env, &mut ours);
            assert_eq!(ours, serde_bytes(&env), "{env:?}");
        }
    }

    #[test]
    fn reads_what_it_writes_with_the_payload_shared() {
        for env in variants() {
            let bytes = Bytes::from(serde_bytes(&env));
            let fast = decode(&bytes, Some(&bytes));
            if env.encryption.is_some() {
                assert!(fast.is_none(), "encryption goes to serde");
                continue;
            }
            let fast = fast.expect("the fast path takes what Chorus writes");
            assert_eq!(fast, env);
            if !fast.payload.is_empty() {
                let within = bytes.as_ptr_range();
                assert!(
                    within.contains(&fast.payload.as_ptr()),
                    "payload not copied"
                );
            }
            assert_eq!(decode(&bytes, None), Some(env));
        }
    }

    #[test]
    fn unusual_shapes_go_to_serde() {
        let env = Envelope::new(Kind::Event, Performative::Inform, "p");
        let good = serde_bytes(&env);
        // A repeated field.
        let mut repeated = good.clone();
        repeated[0] += 1;
        repeated.extend_from_slice(&[0xa4, b'f', b'r', b'o', b'm', 0xa1, b'q']);
        assert!(decode(&repeated, None).is_none());
        assert!(rmp_serde::from_slice::<Envelope>(&repeated).is_err());
        // A missing required field: a map of version alone.
        let version_only = [
            0x81, 0xa7, b'v', b'e', b'r', b's', b'i', b'o', b'n', 0xa3, b'1', b'.', b'0',
        ];
        assert!(decode(&version_only, None).is_none());
        // An unknown field of every kind is skipped.
        let mut unknown = good.clone();
        unknown[0] += 1;
        unknown.extend_from_slice(&[
            0xa1, b'z', 0x92, 0x81, 0xa1, b'a', 0xd6, 1, 0, 0, 0, 0, 0xcb,
        ]);
        unknown.extend_from_slice(&1.5f64.to_be_bytes());
        assert_eq!(decode(&unknown, None), Some(env.clone()));
        assert_eq!(rmp_serde::from_slice::<Envelope>(&unknown).ok(), Some(env));
    }

    /// Whatever the fast path accepts, serde accepts as the same envelope: random damage to
    /// real envelopes, compared.
    #[test]
    fn the_fast_path_never_disagrees_with_serde() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let samples: Vec<Vec<u8>> = variants()
            .iter()
            .filter(|e| e.payload.len() < 1024 && e.from.len() < 1024)
            .map(serde_bytes)
            .collect();
        let mut fast_taken = 0;
        for round in 0..200_000 {
            let mut bytes = samples[round % samples.len()].clone();
            for _ in 0..1 + next() % 3 {
                let i = (next() as usize) % bytes.len();
                bytes[i] = next() as u8;
            }
            if next() % 4 == 0 {
                bytes.truncate((next() as usize) % bytes.len());
            }
            if let Some(fast) = decode(&bytes, None) {
                fast_taken += 1;
                let slow = rmp_serde::from_slice::<Envelope>(&bytes);
                assert_eq!(slow.ok().as_ref(), Some(&fast), "{bytes:x?}");
            }
        }
        assert!(fast_taken > 10_000, "the fast path took {fast_taken}");
    }
}
