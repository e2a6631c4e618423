//! The compact envelope form (PROTOCOL.md section 3.2) of the Chorus Python SDK, compiled.
//!
//! `chorus_sdk.codec` stays the definition: this module writes the bytes it writes and reads
//! the envelopes it reads, for the envelopes it is sure of. For anything else (a value of an
//! unexpected type, an unknown key holding a map, bytes that do not read) it returns `None`
//! and the Python codec does the work, with its own errors. `configure` is given the Python
//! classes and vocabularies once, at import.

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

/// Why a value is left to the Python codec: nothing to report, it decides.
struct Unsure;

type Sure<T> = Result<T, Unsure>;

impl From<PyErr> for Unsure {
    fn from(_: PyErr) -> Self {
        Unsure
    }
}

impl From<std::convert::Infallible> for Unsure {
    fn from(never: std::convert::Infallible) -> Self {
        match never {}
    }
}

/// A vocabulary: its members by code (index = code) and, to write one, each member's code.
struct Vocabulary {
    by_code: Vec<Py<PyAny>>,
    codes: Vec<(usize, u64)>,
}

impl Vocabulary {
    fn read(table: &Bound<'_, PyAny>) -> PyResult<Self> {
        // `table`: a list of (member, code) pairs, code 0 the member an unknown code reads as;
        // `by_code` answers codes 0..len.
        let mut by_code: Vec<Option<Py<PyAny>>> = Vec::new();
        let mut codes = Vec::new();
        for pair in table.try_iter()? {
            let pair = pair?;
            let member = pair.get_item(0)?;
            let code: u64 = pair.get_item(1)?.extract()?;
            let at = code as usize;
            while by_code.len() <= at {
                by_code.push(None);
            }
            by_code[at] = Some(member.clone().unbind());
            codes.push((member.as_ptr() as usize, code));
        }
        let by_code = by_code
            .into_iter()
            .map(|m| {
                m.ok_or_else(|| {
                    PyValueError::new_err("a vocabulary's codes must run from 0 without gaps")
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self { by_code, codes })
    }

    /// The member of `code` as `from_code` reads it: code 0, or one past the last, is unknown.
    fn member<'py>(&self, py: Python<'py>, code: u64) -> Bound<'py, PyAny> {
        let at = if code >= 1 && (code as usize) < self.by_code.len() {
            code as usize
        } else {
            0
        };
        self.by_code[at].bind(py).clone()
    }

    fn code_of(&self, member: &Bound<'_, PyAny>) -> Sure<u64> {
        let ptr = member.as_ptr() as usize;
        self.codes
            .iter()
            .find(|(p, _)| *p == ptr)
            .map(|(_, c)| *c)
            .ok_or(Unsure)
    }
}

/// What a new envelope's field starts as.
enum Initial {
    Value(Py<PyAny>),
    /// A list of its own (`to`).
    List,
    /// A dict of its own (`headers`).
    Dict,
}

/// What `configure` was given.
struct Codec {
    envelope: Py<PyAny>,
    new_object: Py<PyAny>,
    uuid: Py<PyAny>,
    uuid_set_int: Py<PyAny>,
    uuid_set_safety: Py<PyAny>,
    uuid_safety: Py<PyAny>,
    /// Every field of the envelope, in order, and what it starts as.
    defaults: Vec<(Py<PyString>, Initial)>,
    kinds: Vocabulary,
    performatives: Vocabulary,
    priorities: Vocabulary,
    deliveries: Vocabulary,
    task_states: Vocabulary,
    priority_normal: Py<PyAny>,
    at_most_once: Py<PyAny>,
    seq: Py<PyAny>,
    expect: Py<PyAny>,
    progress: Py<PyAny>,
    trace: Py<PyAny>,
    signature: Py<PyAny>,
    encryption: Py<PyAny>,
    recipient: Py<PyAny>,
    msgpack: String,
    json: String,
    encrypted: String,
    default_hop_limit: u64,
}

static CODEC: GILOnceCell<Codec> = GILOnceCell::new();

fn item<'py>(config: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    config
        .get_item(key)?
        .ok_or_else(|| PyValueError::new_err(format!("configure: no {key}")))
}

/// Takes the Python side's classes and vocabularies (see `chorus_sdk.codec`); once.
#[pyfunction]
fn configure(py: Python<'_>, config: &Bound<'_, PyDict>) -> PyResult<()> {
    let mut defaults = Vec::new();
    for field in item(config, "defaults")?.try_iter()? {
        let field = field?;
        let name = field.get_item(0)?.downcast_into::<PyString>()?;
        let fresh: bool = field.get_item(2)?.extract()?;
        let default = match (fresh, name.to_str()?) {
            (false, _) => Initial::Value(field.get_item(1)?.unbind()),
            (true, "to") => Initial::List,
            (true, "headers") => Initial::Dict,
            (true, other) => {
                return Err(PyValueError::new_err(format!(
                    "configure: no fresh default known for {other}"
                )))
            }
        };
        defaults.push((name.unbind(), default));
    }
    let text = |key: &str| -> PyResult<String> { item(config, key)?.extract() };
    let object = |key: &str| -> PyResult<Py<PyAny>> { Ok(item(config, key)?.unbind()) };
    let codec = Codec {
        envelope: object("envelope")?,
        new_object: object("new_object")?,
        uuid: object("uuid")?,
        uuid_set_int: object("uuid_set_int")?,
        uuid_set_safety: object("uuid_set_safety")?,
        uuid_safety: object("uuid_safety")?,
        defaults,
        kinds: Vocabulary::read(&item(config, "kinds")?)?,
        performatives: Vocabulary::read(&item(config, "performatives")?)?,
        priorities: Vocabulary::read(&item(config, "priorities")?)?,
        deliveries: Vocabulary::read(&item(config, "deliveries")?)?,
        task_states: Vocabulary::read(&item(config, "task_states")?)?,
        priority_normal: object("priority_normal")?,
        at_most_once: object("at_most_once")?,
        seq: object("seq")?,
        expect: object("expect")?,
        progress: object("progress")?,
        trace: object("trace")?,
        signature: object("signature")?,
        encryption: object("encryption")?,
        recipient: object("recipient")?,
        msgpack: text("msgpack")?,
        json: text("json")?,
        encrypted: text("encrypted")?,
        default_hop_limit: item(config, "default_hop_limit")?.extract()?,
    };
    CODEC
        .set(py, codec)
        .map_err(|_| PyValueError::new_err("configure: already configured"))
}

// ---------------------------------------------------------------------------------------------
// Writing

fn put_uint(b: &mut Vec<u8>, n: u64) {
    if n < 0x80 {
        b.push(n as u8);
    } else if n < 0x100 {
        b.extend_from_slice(&[0xcc, n as u8]);
    } else if n < 0x10000 {
        b.push(0xcd);
        b.extend_from_slice(&(n as u16).to_be_bytes());
    } else if n < 0x1_0000_0000 {
        b.push(0xce);
        b.extend_from_slice(&(n as u32).to_be_bytes());
    } else {
        b.push(0xcf);
        b.extend_from_slice(&n.to_be_bytes());
    }
}

fn put_len(b: &mut Vec<u8>, n: usize, fix: Option<(u8, usize)>, formats: [u8; 3]) {
    if let Some((small, limit)) = fix {
        if n < limit {
            b.push(small | n as u8);
            return;
        }
    }
    if formats[0] != 0 && n < 0x100 {
        b.extend_from_slice(&[formats[0], n as u8]);
    } else if n < 0x10000 {
        b.push(formats[1]);
        b.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        b.push(formats[2]);
        b.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    put_len(b, s.len(), Some((0xa0, 32)), [0xd9, 0xda, 0xdb]);
    b.extend_from_slice(s.as_bytes());
}

fn put_bin(b: &mut Vec<u8>, data: &[u8]) {
    put_len(b, data.len(), None, [0xc4, 0xc5, 0xc6]);
    b.extend_from_slice(data);
}

fn put_array(b: &mut Vec<u8>, n: usize) {
    put_len(b, n, Some((0x90, 16)), [0, 0xdc, 0xdd]);
}

fn put_map(b: &mut Vec<u8>, n: usize) {
    put_len(b, n, Some((0x80, 16)), [0, 0xde, 0xdf]);
}

/// A `str` (a subclass too), as UTF-8; anything else is the Python codec's.
fn text<'a>(v: &'a Bound<'_, PyAny>) -> Sure<std::borrow::Cow<'a, str>> {
    Ok(v.downcast::<PyString>().map_err(|_| Unsure)?.to_cow()?)
}

fn optional<'py>(v: Bound<'py, PyAny>) -> Option<Bound<'py, PyAny>> {
    if v.is_none() {
        None
    } else {
        Some(v)
    }
}

fn uuid_int(v: &Bound<'_, PyAny>) -> Sure<u128> {
    Ok(v.getattr(intern!(v.py(), "int"))?.extract::<u128>()?)
}

/// An unsigned 64-bit integer (an `int`, a `bool`, an `IntEnum`), as `put_uint` takes it.
fn uint(v: &Bound<'_, PyAny>) -> Sure<u64> {
    Ok(v.extract::<u64>()?)
}

fn bytes_of<'a>(v: &'a Bound<'_, PyAny>) -> Sure<&'a [u8]> {
    Ok(v.downcast::<PyBytes>().map_err(|_| Unsure)?.as_bytes())
}

fn canonical_traceparent(tp: &str) -> Option<[u8; 25]> {
    let b = tp.as_bytes();
    if b.len() != 55 || &b[..3] != b"00-" || b[35] != b'-' || b[52] != b'-' {
        return None;
    }
    let hex = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; 25];
    let mut at = 0;
    for (start, end) in [(3, 35), (36, 52), (53, 55)] {
        let mut i = start;
        while i < end {
            out[at] = hex(b[i])? << 4 | hex(b[i + 1])?;
            at += 1;
            i += 2;
        }
    }
    Some(out)
}

/// The map's body, key 0 first, and how many keys it has.
struct Body {
    b: Vec<u8>,
    count: usize,
}

impl Body {
    /// Starts one more key: its byte, and an array's header if its value is one.
    fn key(&mut self, head: &[u8]) -> &mut Vec<u8> {
        self.b.extend_from_slice(head);
        self.count += 1;
        &mut self.b
    }
}

fn encode<'py>(
    codec: &Codec,
    env: &Bound<'py, PyAny>,
    implied: &Bound<'py, PyAny>,
) -> Sure<Vec<u8>> {
    let py = env.py();
    let get = |name: &Bound<'py, PyString>| -> PyResult<Bound<'py, PyAny>> { env.getattr(name) };
    let id = uuid_int(&get(intern!(py, "id"))?)?;
    let mut body = Body {
        b: Vec::with_capacity(256),
        count: 0,
    };
    body.key(b"\x00\x02");
    body.key(b"\x01\xc4\x10")
        .extend_from_slice(&id.to_be_bytes());
    put_str(body.key(&[2]), &text(&get(intern!(py, "from_"))?)?);
    let kind = codec.kinds.code_of(&get(intern!(py, "kind"))?)?;
    put_uint(body.key(&[3]), kind);
    let performative = codec
        .performatives
        .code_of(&get(intern!(py, "performative"))?)?;
    put_uint(body.key(&[4]), performative);
    let timestamp = uint(&get(intern!(py, "timestamp_ms"))?)?;
    let from_id = if (id >> 76) & 0xf == 7 {
        Some((id >> 80) as u64)
    } else {
        None
    };
    if from_id != Some(timestamp) {
        put_uint(body.key(&[5]), timestamp);
    }
    let cid = optional(get(intern!(py, "correlation_id"))?)
        .map(|u| uuid_int(&u))
        .transpose()?;
    let irt = optional(get(intern!(py, "in_reply_to"))?)
        .map(|u| uuid_int(&u))
        .transpose()?;
    match (cid, irt) {
        (Some(c), _) if Some(c) != irt => {
            body.key(b"\x06\xc4\x10")
                .extend_from_slice(&c.to_be_bytes());
        }
        (None, Some(_)) => {
            body.key(b"\x06\xc0");
        }
        _ => {}
    }
    if let Some(irt) = irt {
        body.key(b"\x07\xc4\x10")
            .extend_from_slice(&irt.to_be_bytes());
    }
    let implied_text = |name: &Bound<'py, PyString>| -> Sure<Option<String>> {
        let v = implied.getattr(name)?;
        if v.is_none() {
            Ok(None)
        } else {
            Ok(Some(text(&v)?.into_owned()))
        }
    };
    let agent = implied_text(intern!(py, "agent"))?;
    let to = get(intern!(py, "to"))?;
    let to = to.downcast::<PyList>().map_err(|_| Unsure)?;
    if !to.is_empty() {
        let mut names = Vec::with_capacity(to.len());
        for t in to.iter() {
            names.push(text(&t)?.into_owned());
        }
        if !(names.len() == 1 && Some(&names[0]) == agent.as_ref()) {
            if names.len() >= 0x10000 {
                // The Python codec writes at most a 16-bit count here: it says so.
                return Err(Unsure);
            }
            let b = body.key(&[8]);
            put_array(b, names.len());
            for t in &names {
                put_str(b, t);
            }
        }
    }
    for (key, attr) in [
        (9u8, intern!(py, "topic")),
        (10, intern!(py, "capability")),
        (11, intern!(py, "name")),
    ] {
        if let Some(v) = optional(get(attr)?) {
            let v = text(&v)?;
            if implied_text(attr)?.as_deref() != Some(&*v) {
                put_str(body.key(&[key]), &v);
            }
        }
    }
    for (key, attr) in [
        (12u8, intern!(py, "ttl_ms")),
        (13, intern!(py, "deadline_ms")),
    ] {
        if let Some(v) = optional(get(attr)?) {
            put_uint(body.key(&[key]), uint(&v)?);
        }
    }
    // `!= 0` as Python compares it: anything but an integer is the Python codec's.
    let hops = uint(&get(intern!(py, "hops"))?)?;
    if hops != 0 {
        put_uint(body.key(&[14]), hops);
    }
    let hop_limit = uint(&get(intern!(py, "hop_limit"))?)?;
    if hop_limit != codec.default_hop_limit {
        put_uint(body.key(&[15]), hop_limit);
    }
    let priority = get(intern!(py, "priority"))?;
    if !priority.is(codec.priority_normal.bind(py)) {
        put_uint(body.key(&[16]), codec.priorities.code_of(&priority)?);
    }
    let delivery = get(intern!(py, "delivery"))?;
    if !delivery.is(codec.at_most_once.bind(py)) {
        put_uint(body.key(&[17]), codec.deliveries.code_of(&delivery)?);
    }
    if let Some(seq) = optional(get(intern!(py, "seq"))?) {
        let epoch = uint(&seq.getattr(intern!(py, "epoch"))?)?;
        let n = uint(&seq.getattr(intern!(py, "n"))?)?;
        let b = body.key(b"\x12\x92");
        put_uint(b, epoch);
        put_uint(b, n);
    }
    if let Some(expect) = optional(get(intern!(py, "expect"))?) {
        let performative = codec
            .performatives
            .code_of(&expect.getattr(intern!(py, "performative"))?)?;
        let timeout = uint(&expect.getattr(intern!(py, "timeout_ms"))?)?;
        let b = body.key(b"\x13\x92");
        put_uint(b, performative);
        put_uint(b, timeout);
    }
    if let Some(progress) = optional(get(intern!(py, "progress"))?) {
        let state = codec
            .task_states
            .code_of(&progress.getattr(intern!(py, "state"))?)?;
        let fraction = match optional(progress.getattr(intern!(py, "fraction"))?) {
            Some(f) => {
                let x: f64 = f.extract()?;
                let narrow = x as f32;
                if narrow.is_infinite() && x.is_finite() {
                    // struct.pack(">f") refuses it: the Python codec says so.
                    return Err(Unsure);
                }
                Some(narrow)
            }
            None => None,
        };
        let b = body.key(if fraction.is_none() {
            b"\x14\x91"
        } else {
            b"\x14\x92"
        });
        put_uint(b, state);
        if let Some(narrow) = fraction {
            b.push(0xca);
            b.extend_from_slice(&narrow.to_be_bytes());
        }
    }
    if let Some(status) = optional(get(intern!(py, "status"))?) {
        put_uint(body.key(&[21]), uint(&status)?);
    }
    if let Some(reason) = optional(get(intern!(py, "reason"))?) {
        put_str(body.key(&[22]), &text(&reason)?);
    }
    if let Some(trace) = optional(get(intern!(py, "trace"))?) {
        let tp = trace.getattr(intern!(py, "traceparent"))?;
        let tp = text(&tp)?;
        let canonical = canonical_traceparent(&tp);
        if let Some(raw) = canonical {
            body.key(b"\x17\xc4\x19").extend_from_slice(&raw);
        }
        if let Some(state) = optional(trace.getattr(intern!(py, "tracestate"))?) {
            put_str(body.key(&[24]), &text(&state)?);
        }
        if canonical.is_none() {
            put_str(body.key(&[25]), &tp);
        }
    }
    for (key, attr) in [
        (26u8, intern!(py, "session_id")),
        (27, intern!(py, "customer_id")),
    ] {
        if let Some(v) = optional(get(attr)?) {
            put_str(body.key(&[key]), &text(&v)?);
        }
    }
    let headers = get(intern!(py, "headers"))?;
    let headers = headers.downcast::<PyDict>().map_err(|_| Unsure)?;
    if !headers.is_empty() {
        let mut items = Vec::with_capacity(headers.len());
        for (k, v) in headers.iter() {
            items.push((text(&k)?.into_owned(), text(&v)?.into_owned()));
        }
        items.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let b = body.key(&[28]);
        put_map(b, items.len());
        for (k, v) in &items {
            put_str(b, k);
            put_str(b, v);
        }
    }
    let ct = get(intern!(py, "content_type"))?;
    let ct = text(&ct)?;
    if *ct != *codec.msgpack {
        if *ct == *codec.json {
            body.key(b"\x1d\x01");
        } else if *ct == *codec.encrypted {
            body.key(b"\x1d\x02");
        } else {
            put_str(body.key(&[29]), &ct);
        }
    }
    let payload = get(intern!(py, "payload"))?;
    let payload = bytes_of(&payload)?;
    if !payload.is_empty() {
        put_bin(body.key(&[30]), payload);
    }
    if let Some(token) = optional(get(intern!(py, "token"))?) {
        put_str(body.key(&[31]), &text(&token)?);
    }
    if let Some(signature) = optional(get(intern!(py, "signature"))?) {
        let key = signature.getattr(intern!(py, "key"))?;
        let value = signature.getattr(intern!(py, "value"))?;
        let (key, value) = (text(&key)?, bytes_of(&value)?);
        let b = body.key(b"\x20\x92");
        put_str(b, &key);
        put_bin(b, value);
    }
    if let Some(encryption) = optional(get(intern!(py, "encryption"))?) {
        // A value that does not write leaves the whole envelope to the Python codec: what
        // was written of it here is dropped with the rest.
        let b = body.key(b"\x21\x93");
        put_str(b, &text(&encryption.getattr(intern!(py, "alg"))?)?);
        let inner_type = encryption.getattr(intern!(py, "inner_content_type"))?;
        put_str(b, &text(&inner_type)?);
        let recipients = encryption.getattr(intern!(py, "recipients"))?;
        let recipients = recipients.downcast::<PyList>().map_err(|_| Unsure)?;
        put_array(b, recipients.len());
        for r in recipients.iter() {
            put_array(b, 2);
            put_str(b, &text(&r.getattr(intern!(py, "agent"))?)?);
            put_bin(b, bytes_of(&r.getattr(intern!(py, "key"))?)?);
        }
    }
    if let Some(ce) = optional(get(intern!(py, "content_encoding"))?) {
        put_str(body.key(&[35]), &text(&ce)?);
    }
    // The map's header in front.
    let mut out = Vec::with_capacity(body.b.len() + 3);
    put_map(&mut out, body.count);
    out.extend_from_slice(&body.b);
    Ok(out)
}

/// `env` in the compact form, leaving out what `implied` (a `chorus_sdk.subjects.Implied`:
/// agent, topic, capability, name) carries; `None` when the Python codec is to write it.
#[pyfunction]
fn encode_compact<'py>(
    py: Python<'py>,
    env: &Bound<'py, PyAny>,
    implied: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let Some(codec) = CODEC.get(py) else {
        return Ok(None);
    };
    Ok(encode(codec, env, implied)
        .ok()
        .map(|b| PyBytes::new(py, &b)))
}

// ---------------------------------------------------------------------------------------------
// Reading

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

/// One MessagePack value, as far as the compact form uses them.
enum Value<'a> {
    Nil,
    Bool,
    Uint(u64),
    Negative,
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Sure<&'a [u8]> {
        let end = self.at.checked_add(n).ok_or(Unsure)?;
        let out = self.b.get(self.at..end).ok_or(Unsure)?;
        self.at = end;
        Ok(out)
    }

    fn byte(&mut self) -> Sure<u8> {
        Ok(self.take(1)?[0])
    }

    fn be(&mut self, n: usize) -> Sure<u64> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &x| acc << 8 | x as u64))
    }

    fn value(&mut self) -> Sure<Value<'a>> {
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => Value::Uint(m as u64),
            0x80..=0x8f => Value::Map((m & 0x0f) as usize),
            0x90..=0x9f => Value::Array((m & 0x0f) as usize),
            0xa0..=0xbf => self.str((m & 0x1f) as usize)?,
            0xc0 => Value::Nil,
            0xc2 | 0xc3 => Value::Bool,
            0xc4 => {
                let n = self.be(1)? as usize;
                Value::Bin(self.take(n)?)
            }
            0xc5 => {
                let n = self.be(2)? as usize;
                Value::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.be(4)? as usize;
                Value::Bin(self.take(n)?)
            }
            0xca => Value::Float(f32::from_bits(self.be(4)? as u32) as f64),
            0xcb => Value::Float(f64::from_bits(self.be(8)?)),
            0xcc => Value::Uint(self.be(1)?),
            0xcd => Value::Uint(self.be(2)?),
            0xce => Value::Uint(self.be(4)?),
            0xcf => Value::Uint(self.be(8)?),
            0xd0..=0xd3 => {
                let n = 1usize << (m - 0xd0);
                let raw = self.be(n)?;
                let shift = 64 - 8 * n as u32;
                let v = ((raw << shift) as i64) >> shift;
                if v >= 0 {
                    Value::Uint(v as u64)
                } else {
                    Value::Negative
                }
            }
            0xd9 => {
                let n = self.be(1)? as usize;
                self.str(n)?
            }
            0xda => {
                let n = self.be(2)? as usize;
                self.str(n)?
            }
            0xdb => {
                let n = self.be(4)? as usize;
                self.str(n)?
            }
            0xdc => Value::Array(self.be(2)? as usize),
            0xdd => Value::Array(self.be(4)? as usize),
            0xde => Value::Map(self.be(2)? as usize),
            0xdf => Value::Map(self.be(4)? as usize),
            0xe0..=0xff => Value::Negative,
            // Extension types and the reserved byte: the Python codec's.
            _ => return Err(Unsure),
        })
    }

    fn str(&mut self, n: usize) -> Sure<Value<'a>> {
        Ok(Value::Str(
            std::str::from_utf8(self.take(n)?).map_err(|_| Unsure)?,
        ))
    }

    /// Passes over a value of a key this version ignores: scalars and arrays of them (a map
    /// inside is the Python codec's, which checks its keys).
    fn skip(&mut self, first: Value<'a>, depth: usize) -> Sure<()> {
        match first {
            Value::Array(n) => {
                if depth > 32 {
                    return Err(Unsure);
                }
                for _ in 0..n {
                    let v = self.value()?;
                    self.skip(v, depth + 1)?;
                }
                Ok(())
            }
            Value::Map(_) => Err(Unsure),
            _ => Ok(()),
        }
    }
}

fn as_uint(v: Value<'_>, bits: u32) -> Sure<u64> {
    match v {
        Value::Uint(n) if bits >= 64 || n < 1u64 << bits => Ok(n),
        _ => Err(Unsure),
    }
}

fn as_str<'a>(v: Value<'a>) -> Sure<&'a str> {
    match v {
        Value::Str(s) => Ok(s),
        _ => Err(Unsure),
    }
}

fn as_bin<'a>(v: Value<'a>) -> Sure<&'a [u8]> {
    match v {
        Value::Bin(b) => Ok(b),
        _ => Err(Unsure),
    }
}

fn as_uuid(v: Value<'_>) -> Sure<u128> {
    let b = as_bin(v)?;
    let b: [u8; 16] = b.try_into().map_err(|_| Unsure)?;
    Ok(u128::from_be_bytes(b))
}

fn as_array(v: Value<'_>, lengths: &[usize]) -> Sure<usize> {
    match v {
        Value::Array(n) if lengths.is_empty() || lengths.contains(&n) => Ok(n),
        _ => Err(Unsure),
    }
}

fn new_uuid<'py>(codec: &Codec, py: Python<'py>, value: u128) -> Sure<Bound<'py, PyAny>> {
    let u = codec.new_object.bind(py).call1((codec.uuid.bind(py),))?;
    codec.uuid_set_int.bind(py).call1((&u, value))?;
    codec
        .uuid_set_safety
        .bind(py)
        .call1((&u, codec.uuid_safety.bind(py)))?;
    Ok(u)
}

fn hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for &x in bytes {
        out.push(DIGITS[(x >> 4) as usize] as char);
        out.push(DIGITS[(x & 0xf) as usize] as char);
    }
}

fn decode<'py>(codec: &Codec, py: Python<'py>, data: &[u8]) -> Sure<Bound<'py, PyAny>> {
    let mut r = Reader { b: data, at: 0 };
    let Value::Map(n) = r.value()? else {
        return Err(Unsure);
    };
    // Key 0 first, the major version 2.
    if n == 0 || !matches!(r.value()?, Value::Uint(0)) || !matches!(r.value()?, Value::Uint(2)) {
        return Err(Unsure);
    }
    let env = codec
        .new_object
        .bind(py)
        .call1((codec.envelope.bind(py),))?;
    for (name, default) in &codec.defaults {
        let name = name.bind(py);
        match default {
            Initial::Value(v) => env.setattr(name, v.bind(py))?,
            Initial::List => env.setattr(name, PyList::empty(py))?,
            Initial::Dict => env.setattr(name, PyDict::new(py))?,
        }
    }
    let mut seen: u64 = 1; // key 0
    let mut others: Vec<u64> = Vec::new();
    let mut id: Option<u128> = None;
    let (mut sender, mut kind, mut performative) = (false, false, false);
    let mut timestamp: Option<u64> = None;
    let mut correlated = false;
    let mut in_reply_to: Option<Bound<'py, PyAny>> = None;
    let (mut traceparent, mut traceparent_text, mut tracestate) =
        (None::<String>, None::<String>, None::<String>);
    for _ in 1..n {
        let key = as_uint(r.value()?, 64)?;
        if key < 64 {
            if seen & 1 << key != 0 {
                return Err(Unsure);
            }
            seen |= 1 << key;
        } else {
            if others.contains(&key) {
                return Err(Unsure);
            }
            others.push(key);
        }
        let v = r.value()?;
        let set = |attr: &Bound<'py, PyString>, value: Bound<'py, PyAny>| -> Sure<()> {
            Ok(env.setattr(attr, value)?)
        };
        match key {
            0 => return Err(Unsure),
            1 => {
                let value = as_uuid(v)?;
                set(intern!(py, "id"), new_uuid(codec, py, value)?)?;
                id = Some(value);
            }
            2 => {
                set(
                    intern!(py, "from_"),
                    PyString::new(py, as_str(v)?).into_any(),
                )?;
                sender = true;
            }
            3 => {
                set(intern!(py, "kind"), codec.kinds.member(py, as_uint(v, 64)?))?;
                kind = true;
            }
            4 => {
                set(
                    intern!(py, "performative"),
                    codec.performatives.member(py, as_uint(v, 64)?),
                )?;
                performative = true;
            }
            5 => timestamp = Some(as_uint(v, 64)?),
            6 => {
                correlated = true;
                match v {
                    Value::Nil => set(intern!(py, "correlation_id"), py.None().into_bound(py))?,
                    v => set(
                        intern!(py, "correlation_id"),
                        new_uuid(codec, py, as_uuid(v)?)?,
                    )?,
                }
            }
            7 => {
                let u = new_uuid(codec, py, as_uuid(v)?)?;
                set(intern!(py, "in_reply_to"), u.clone())?;
                in_reply_to = Some(u);
            }
            8 => {
                let n = as_array(v, &[])?;
                let list = PyList::empty(py);
                for _ in 0..n {
                    list.append(as_str(r.value()?)?)?;
                }
                set(intern!(py, "to"), list.into_any())?;
            }
            9 | 10 | 11 | 22 | 26 | 27 | 31 | 35 => {
                let attr = match key {
                    9 => intern!(py, "topic"),
                    10 => intern!(py, "capability"),
                    11 => intern!(py, "name"),
                    22 => intern!(py, "reason"),
                    26 => intern!(py, "session_id"),
                    27 => intern!(py, "customer_id"),
                    31 => intern!(py, "token"),
                    _ => intern!(py, "content_encoding"),
                };
                set(attr, PyString::new(py, as_str(v)?).into_any())?;
            }
            12 | 13 => {
                let attr = if key == 12 {
                    intern!(py, "ttl_ms")
                } else {
                    intern!(py, "deadline_ms")
                };
                set(attr, as_uint(v, 64)?.into_pyobject(py)?.into_any())?;
            }
            14 | 15 => {
                let attr = if key == 14 {
                    intern!(py, "hops")
                } else {
                    intern!(py, "hop_limit")
                };
                set(attr, as_uint(v, 8)?.into_pyobject(py)?.into_any())?;
            }
            16 => set(
                intern!(py, "priority"),
                codec.priorities.member(py, as_uint(v, 64)?),
            )?,
            17 => set(
                intern!(py, "delivery"),
                codec.deliveries.member(py, as_uint(v, 64)?),
            )?,
            18 => {
                as_array(v, &[2])?;
                let epoch = as_uint(r.value()?, 32)?;
                let n = as_uint(r.value()?, 64)?;
                set(intern!(py, "seq"), codec.seq.bind(py).call1((epoch, n))?)?;
            }
            19 => {
                as_array(v, &[2])?;
                let perf = codec.performatives.member(py, as_uint(r.value()?, 64)?);
                let timeout = as_uint(r.value()?, 64)?;
                set(
                    intern!(py, "expect"),
                    codec.expect.bind(py).call1((perf, timeout))?,
                )?;
            }
            20 => {
                let n = as_array(v, &[1, 2])?;
                let state = codec.task_states.member(py, as_uint(r.value()?, 64)?);
                let fraction = if n == 2 {
                    let x = match r.value()? {
                        Value::Float(x) => x,
                        Value::Uint(u) => u as f64,
                        _ => return Err(Unsure),
                    };
                    let narrow = x as f32;
                    if narrow.is_infinite() && x.is_finite() {
                        // struct.pack(">f") refuses it: the Python codec says so.
                        return Err(Unsure);
                    }
                    Some(narrow as f64)
                } else {
                    None
                };
                set(
                    intern!(py, "progress"),
                    codec.progress.bind(py).call1((state, fraction))?,
                )?;
            }
            21 => set(
                intern!(py, "status"),
                as_uint(v, 16)?.into_pyobject(py)?.into_any(),
            )?,
            23 => {
                let raw = as_bin(v)?;
                if raw.len() != 25 {
                    return Err(Unsure);
                }
                let mut tp = String::with_capacity(55);
                tp.push_str("00-");
                hex(&mut tp, &raw[..16]);
                tp.push('-');
                hex(&mut tp, &raw[16..24]);
                tp.push('-');
                hex(&mut tp, &raw[24..]);
                traceparent = Some(tp);
            }
            24 => tracestate = Some(as_str(v)?.to_owned()),
            25 => traceparent_text = Some(as_str(v)?.to_owned()),
            28 => {
                let Value::Map(n) = v else {
                    return Err(Unsure);
                };
                let headers = PyDict::new(py);
                for _ in 0..n {
                    let k = as_str(r.value()?)?;
                    let x = as_str(r.value()?)?;
                    if headers.contains(k)? {
                        return Err(Unsure);
                    }
                    headers.set_item(k, x)?;
                }
                set(intern!(py, "headers"), headers.into_any())?;
            }
            29 => {
                let ct = match v {
                    Value::Uint(1) => codec.json.as_str(),
                    Value::Uint(2) => codec.encrypted.as_str(),
                    v => as_str(v)?,
                };
                set(
                    intern!(py, "content_type"),
                    PyString::new(py, ct).into_any(),
                )?;
            }
            30 => set(
                intern!(py, "payload"),
                PyBytes::new(py, as_bin(v)?).into_any(),
            )?,
            32 => {
                as_array(v, &[2])?;
                let key = as_str(r.value()?)?;
                let value = as_bin(r.value()?)?;
                let signature = codec
                    .signature
                    .bind(py)
                    .call1((key, PyBytes::new(py, value)))?;
                set(intern!(py, "signature"), signature)?;
            }
            33 => {
                as_array(v, &[3])?;
                let alg = as_str(r.value()?)?;
                let inner = as_str(r.value()?)?;
                let n = as_array(r.value()?, &[])?;
                let recipients = PyList::empty(py);
                for _ in 0..n {
                    as_array(r.value()?, &[2])?;
                    let agent = as_str(r.value()?)?;
                    let key = as_bin(r.value()?)?;
                    recipients.append(
                        codec
                            .recipient
                            .bind(py)
                            .call1((agent, PyBytes::new(py, key)))?,
                    )?;
                }
                set(
                    intern!(py, "encryption"),
                    codec.encryption.bind(py).call1((alg, inner, recipients))?,
                )?;
            }
            34 => {
                as_uint(v, 16)?;
            }
            _ => r.skip(v, 0)?,
        }
    }
    if r.at != data.len() || !(sender && kind && performative) {
        return Err(Unsure);
    }
    let id = id.ok_or(Unsure)?;
    if !correlated {
        let irt = match in_reply_to {
            Some(u) => u,
            None => py.None().into_bound(py),
        };
        env.setattr(intern!(py, "correlation_id"), irt)?;
    }
    if let Some(tp) = traceparent_text.or(traceparent) {
        env.setattr(
            intern!(py, "trace"),
            codec.trace.bind(py).call1((tp, tracestate))?,
        )?;
    } else if tracestate.is_some() {
        return Err(Unsure);
    }
    let timestamp = match timestamp {
        Some(t) => t,
        None if (id >> 76) & 0xf == 7 => (id >> 80) as u64,
        None => return Err(Unsure),
    };
    env.setattr(intern!(py, "timestamp_ms"), timestamp)?;
    Ok(env)
}

/// The envelope in compact `data` (fields left to the subject not restored); `None` when
/// the Python codec is to read it (and say what is wrong, if anything is).
#[pyfunction]
fn decode_compact<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyBytes>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(codec) = CODEC.get(py) else {
        return Ok(None);
    };
    Ok(decode(codec, py, data.as_bytes()).ok())
}

#[pymodule]
fn chorus_sdk_speedups(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(configure, m)?)?;
    m.add_function(wrap_pyfunction!(encode_compact, m)?)?;
    m.add_function(wrap_pyfunction!(decode_compact, m)?)?;
    Ok(())
}
