//! W3C trace context: the `traceparent` held as its 25 bytes when canonical, and `tracestate`.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::content_type::TextVisitor;

/// W3C trace context, mirrored in the `traceparent`/`tracestate` NATS headers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceContext {
    /// `traceparent`: version-traceid-parentid-flags.
    pub traceparent: TraceParent,
    /// `tracestate`: vendor entries, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
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
