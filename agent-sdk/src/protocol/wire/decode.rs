//! Reading the envelope's MessagePack by hand: the common shapes directly, with the payload
//! borrowed from the message; anything unusual goes back to serde (`None`).

use bytes::Bytes;
use uuid::Uuid;

use crate::protocol::envelope::{
    Envelope, ExpectedReply, Kind, Name, PROTOCOL_VERSION, Performative, Progress, Sequence,
    Signature, TraceContext, Version,
};
use crate::protocol::status::StatusCode;

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
    pub(super) const SEQ: u32 = 30;
    // `encryption` is rare and read by serde (the slow path), so it has no bit.
}

/// Reads an envelope from `bytes`; with `shared` (the same bytes, reference-counted) the
/// payload is a slice of them rather than a copy. `None` when the bytes are not in a shape
/// this reader takes; the caller then asks serde, which decides.
pub(crate) fn decode(bytes: &[u8], shared: Option<&Bytes>) -> Option<Envelope> {
    let mut r = Reader {
        buf: bytes,
        shared,
        pos: 0,
    };
    let fields = r.map_len()?;
    // MessagePack unless a content type comes (static text: no allocation either way for
    // the common ones).
    let mut env = Envelope::blank(
        Kind::Unknown,
        Performative::Unknown,
        Name::default(),
        crate::protocol::envelope::ContentType::default(),
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
                env.from = Name::new(r.str()?);
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
                env.topic = r.opt_str()?.map(Name::new);
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
            b"seq" => {
                env.seq = r.opt(Reader::seq)?;
                bit::SEQ
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
                env.content_type = r.str()?.into();
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
            // Rare, and the slow path of their own: serde reads them.
            b"encryption" | b"content_encoding" => return None,
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
    Some(env)
}

/// The sender and sequence of a MessagePack envelope, read without decoding the rest (values
/// before them are skipped, and reading stops once both are found): what a subscription
/// checks for gaps as messages arrive, in order, before they are queued. `None` when either
/// is missing or the bytes are not an envelope map.
pub(crate) fn peek_sequence(bytes: &[u8]) -> Option<(&str, Sequence)> {
    let mut r = Reader {
        buf: bytes,
        shared: None,
        pos: 0,
    };
    let fields = r.map_len()?;
    let mut from = None;
    for _ in 0..fields {
        match r.str_bytes()? {
            b"from" => from = Some(r.str()?),
            b"seq" => return Some((from?, r.seq()?)),
            _ => r.skip(0)?,
        }
    }
    None
}

/// Deepest nesting of an unknown field this reader skips; deeper goes to serde.
const MAX_DEPTH: usize = 32;

/// A MessagePack reader over one buffer, shared by both envelope forms.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) shared: Option<&'a Bytes>,
    pub(super) pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn byte(&mut self) -> Option<u8> {
        let b = *self.buf.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    pub(super) fn peek(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    pub(super) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
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

    pub(super) fn map_len(&mut self) -> Option<usize> {
        match self.byte()? {
            m @ 0x80..=0x8f => Some(usize::from(m & 0x0f)),
            0xde => self.len(2),
            0xdf => self.len(4),
            _ => None,
        }
    }

    pub(super) fn array_len(&mut self) -> Option<usize> {
        match self.byte()? {
            m @ 0x90..=0x9f => Some(usize::from(m & 0x0f)),
            0xdc => self.len(2),
            0xdd => self.len(4),
            _ => None,
        }
    }

    /// A string's bytes without the UTF-8 check: what field names are read with, since they
    /// are only matched, never kept.
    pub(super) fn str_bytes(&mut self) -> Option<&'a [u8]> {
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => self.len(1)?,
            0xda => self.len(2)?,
            0xdb => self.len(4)?,
            _ => return None,
        };
        self.take(n)
    }

    pub(super) fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.str_bytes()?).ok()
    }

    pub(super) fn bin_range(&mut self) -> Option<(usize, usize)> {
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

    pub(super) fn bin(&mut self) -> Option<Bytes> {
        let (start, end) = self.bin_range()?;
        Some(match self.shared {
            Some(shared) => shared.slice(start..end),
            None => Bytes::copy_from_slice(&self.buf[start..end]),
        })
    }

    pub(super) fn uint(&mut self) -> Option<u64> {
        match self.byte()? {
            m @ 0x00..=0x7f => Some(u64::from(m)),
            0xcc => self.be(1),
            0xcd => self.be(2),
            0xce => self.be(4),
            0xcf => self.be(8),
            // A signed format holding a value that is not negative (section 3.2: a receiver
            // takes any format of the right family).
            0xd0 => u64::try_from(self.be(1)? as u8 as i8).ok(),
            0xd1 => u64::try_from(self.be(2)? as u16 as i16).ok(),
            0xd2 => u64::try_from(self.be(4)? as u32 as i32).ok(),
            0xd3 => u64::try_from(self.be(8)? as i64).ok(),
            _ => None,
        }
    }

    pub(super) fn uuid(&mut self) -> Option<Uuid> {
        let (start, end) = self.bin_range()?;
        Uuid::from_slice(self.buf.get(start..end)?).ok()
    }

    /// A nil reads as `None`; anything else as `read` reads it.
    pub(super) fn opt<T>(
        &mut self,
        read: impl FnOnce(&mut Self) -> Option<T>,
    ) -> Option<Option<T>> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Some(None);
        }
        read(self).map(Some)
    }

    fn opt_string(&mut self) -> Option<Option<String>> {
        self.opt(|r| r.str().map(str::to_owned))
    }

    fn opt_str(&mut self) -> Option<Option<&'a str>> {
        self.opt(Reader::str)
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

    pub(super) fn f32(&mut self) -> Option<f32> {
        match self.byte()? {
            0xca => Some(f32::from_bits(u32::try_from(self.be(4)?).ok()?)),
            _ => None,
        }
    }

    fn seq(&mut self) -> Option<Sequence> {
        let (mut epoch, mut n) = (None, None);
        self.fields(&["epoch", "n"], |r, i| {
            if i == 0 {
                epoch = Some(u32::try_from(r.uint()?).ok()?);
            } else {
                n = Some(r.uint()?);
            }
            Some(())
        })?;
        Some(Sequence {
            epoch: epoch?,
            n: n?,
        })
    }

    fn trace(&mut self) -> Option<TraceContext> {
        let mut traceparent = None;
        let mut tracestate = None;
        self.fields(&["traceparent", "tracestate"], |r, i| {
            if i == 0 {
                traceparent = Some(crate::protocol::envelope::TraceParent::parse(r.str()?));
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
    pub(super) fn skip(&mut self, depth: usize) -> Option<()> {
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
