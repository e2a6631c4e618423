//! Encoding and decoding envelopes, and payloads inside them.
//!
//! Envelopes travel as MessagePack maps with field names (the default), as JSON objects, or in
//! the compact form of protocol 2 (a MessagePack map with integer keys). A receiver tells them
//! apart by the first bytes: `{` opens JSON; a MessagePack map starts with `0x80..=0x8f`,
//! `0xde` or `0xdf`, and its first key is the integer 0 in the compact form, a string
//! otherwise; nothing else is an envelope.

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::implied::Implied;
use crate::protocol::envelope::{
    COMPACT_VERSION, CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, Envelope, PROTOCOL_VERSION,
};
use crate::protocol::wire::compact;

/// How an envelope is written on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Encoding {
    /// MessagePack, fields by name: compact, the default.
    #[default]
    MsgPack,
    /// JSON: for peers and tools that prefer text.
    Json,
    /// The compact form (protocol 2): MessagePack with integer keys, codes for the closed
    /// vocabularies, binary trace context, and nothing the subject already says.
    Compact,
}

impl Encoding {
    /// The MIME type of this encoding.
    pub fn content_type(self) -> &'static str {
        match self {
            Encoding::MsgPack | Encoding::Compact => CONTENT_TYPE_MSGPACK,
            Encoding::Json => CONTENT_TYPE_JSON,
        }
    }

    /// The encoding a MIME type names, if it is one Chorus speaks.
    pub fn from_content_type(content_type: &str) -> Option<Encoding> {
        let base = content_type.split(';').next().unwrap_or("").trim();
        match base {
            CONTENT_TYPE_MSGPACK | "application/x-msgpack" | "application/vnd.msgpack" => {
                Some(Encoding::MsgPack)
            }
            CONTENT_TYPE_JSON => Some(Encoding::Json),
            _ => None,
        }
    }

    /// Which encoding `bytes` is in, from the first byte.
    pub fn sniff(bytes: &[u8]) -> Option<Encoding> {
        match bytes.first()? {
            b'{' => Some(Encoding::Json),
            0x80..=0x8f | 0xde | 0xdf if compact::is_compact(bytes) => Some(Encoding::Compact),
            0x80..=0x8f | 0xde | 0xdf => Some(Encoding::MsgPack),
            // JSON may start with whitespace.
            b' ' | b'\t' | b'\r' | b'\n' => {
                let first = bytes.iter().find(|b| !b.is_ascii_whitespace())?;
                (*first == b'{').then_some(Encoding::Json)
            }
            _ => None,
        }
    }
}

/// Why bytes are not a usable envelope or payload. Each maps to the data-format code 5006.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// Neither MessagePack nor JSON.
    #[error("not an envelope: unrecognised encoding")]
    UnknownEncoding,
    /// The bytes do not form a valid envelope.
    #[error("malformed envelope: {0}")]
    Malformed(String),
    /// The envelope's major version is not one this SDK speaks.
    #[error("unsupported protocol version {found} (this side speaks {supported})")]
    UnsupportedVersion {
        /// The version in the message.
        found: String,
        /// The version this side speaks.
        supported: String,
    },
    /// Larger than the configured limit.
    #[error("message of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Size of the message.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The payload's content type cannot be read into a typed value.
    #[error("unsupported payload content type {0:?}")]
    UnsupportedContentType(String),
    /// The payload did not decode into the expected type, or a value did not encode.
    #[error("payload: {0}")]
    Payload(String),
}

/// Bytes an encoded envelope takes besides its payload, typically (a starting size).
const ENVELOPE_OVERHEAD: usize = 320;
/// The same for the compact form.
pub(crate) const COMPACT_OVERHEAD: usize = 160;

/// Encodes `envelope` in `encoding`, every field written (see [`encode_on`]).
///
/// # Errors
/// [`CodecError::Malformed`] when serde cannot write the envelope as JSON; the other encodings do
/// not fail.
pub fn encode(envelope: &Envelope, encoding: Encoding) -> Result<Bytes, CodecError> {
    encode_on(envelope, encoding, &Implied::default())
}

/// Encodes `envelope` in `encoding` for a subject that carries `implied`
/// ([`Subjects::implied`](crate::Subjects::implied)): the compact form leaves those fields
/// out; the other forms write everything.
///
/// # Errors
/// [`CodecError::Malformed`] when serde cannot write the envelope as JSON; the other encodings do
/// not fail.
pub fn encode_on(
    envelope: &Envelope,
    encoding: Encoding,
    implied: &Implied<'_>,
) -> Result<Bytes, CodecError> {
    let mut buf = Vec::new();
    encode_into(envelope, encoding, implied, &mut buf)?;
    Ok(Bytes::from(buf))
}

/// [`encode_on`], appending to `buf` (a sender that keeps a buffer saves an allocation per
/// message).
pub(crate) fn encode_into(
    envelope: &Envelope,
    encoding: Encoding,
    implied: &Implied<'_>,
    buf: &mut Vec<u8>,
) -> Result<(), CodecError> {
    // Sized once for the fixed fields plus the payload: no regrowth on the hot path.
    match encoding {
        Encoding::Compact => {
            buf.reserve(COMPACT_OVERHEAD + envelope.payload.len());
            compact::encode(envelope, implied, buf);
        }
        Encoding::MsgPack => {
            buf.reserve(ENVELOPE_OVERHEAD + envelope.payload.len());
            crate::protocol::wire::encode(envelope, buf);
        }
        Encoding::Json => {
            buf.reserve(ENVELOPE_OVERHEAD + envelope.payload.len() * 4 / 3);
            serde_json::to_writer(&mut *buf, envelope)
                .map_err(|e| CodecError::Malformed(e.to_string()))?;
        }
    }
    Ok(())
}

/// Decodes an envelope, telling which encoding it was in. Refuses an unknown major version
/// and ignores fields it does not know. The payload is copied out of `bytes`; see
/// [`decode_shared`] to borrow it.
///
/// # Errors
/// [`CodecError::UnknownEncoding`] when the bytes are neither JSON nor MessagePack;
/// [`CodecError::UnsupportedVersion`] for another major version; [`CodecError::Malformed`] when
/// they do not form an envelope.
pub fn decode(bytes: &[u8]) -> Result<(Envelope, Encoding), CodecError> {
    decode_from(bytes, None)
}

/// [`decode`] of a message that arrived on (or was published to) a subject carrying
/// `implied` ([`Subjects::implied`](crate::Subjects::implied)): a compact envelope gets the
/// fields it left to the subject back.
///
/// # Errors
/// [`CodecError::UnknownEncoding`] when the bytes are neither JSON nor MessagePack;
/// [`CodecError::UnsupportedVersion`] for another major version; [`CodecError::Malformed`] when
/// they do not form an envelope.
pub fn decode_on(bytes: &[u8], implied: &Implied<'_>) -> Result<(Envelope, Encoding), CodecError> {
    let (mut envelope, encoding) = decode_from(bytes, None)?;
    if encoding == Encoding::Compact {
        implied.restore(&mut envelope);
    }
    Ok((envelope, encoding))
}

/// [`decode`], with the payload a slice of `bytes` instead of a copy.
///
/// # Errors
/// [`CodecError::UnknownEncoding`] when the bytes are neither JSON nor MessagePack;
/// [`CodecError::UnsupportedVersion`] for another major version; [`CodecError::Malformed`] when
/// they do not form an envelope.
pub fn decode_shared(bytes: &Bytes) -> Result<(Envelope, Encoding), CodecError> {
    decode_from(bytes, Some(bytes))
}

fn decode_from(bytes: &[u8], shared: Option<&Bytes>) -> Result<(Envelope, Encoding), CodecError> {
    let encoding = Encoding::sniff(bytes).ok_or(CodecError::UnknownEncoding)?;
    let result: Result<Envelope, String> = match encoding {
        // The compact reader judges its own version and says what is wrong.
        Encoding::Compact => {
            return match compact::decode(bytes, shared) {
                Ok(envelope) => Ok((envelope, encoding)),
                Err(Ok(found)) => Err(unsupported(found)),
                Err(Err(why)) => Err(CodecError::Malformed(why)),
            };
        }
        Encoding::MsgPack => match crate::protocol::wire::decode(bytes, shared) {
            Some(envelope) => Ok(envelope),
            None => rmp_serde::from_slice(bytes).map_err(|e| e.to_string()),
        },
        Encoding::Json => serde_json::from_slice(bytes).map_err(|e| e.to_string()),
    };
    match result {
        Ok(envelope) if envelope.version.major == PROTOCOL_VERSION.major => {
            Ok((envelope, encoding))
        }
        Ok(envelope) => Err(unsupported(envelope.version.to_string())),
        // A newer major may have changed other fields too: report the version, not the field.
        Err(err) => match probe_version(bytes, encoding) {
            Some(found) if !found.starts_with(&format!("{}.", PROTOCOL_VERSION.major)) => {
                Err(unsupported(found))
            }
            _ => Err(CodecError::Malformed(err)),
        },
    }
}

/// [`decode_shared`] with a size limit checked first.
///
/// # Errors
/// [`CodecError::TooLarge`] when `bytes` is over `limit`; otherwise as [`decode`].
pub fn decode_limited(bytes: &Bytes, limit: usize) -> Result<(Envelope, Encoding), CodecError> {
    if bytes.len() > limit {
        return Err(CodecError::TooLarge {
            size: bytes.len(),
            limit,
        });
    }
    decode_shared(bytes)
}

fn unsupported(found: String) -> CodecError {
    CodecError::UnsupportedVersion {
        found,
        supported: format!("{PROTOCOL_VERSION} and {COMPACT_VERSION}"),
    }
}

fn probe_version(bytes: &[u8], encoding: Encoding) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Probe {
        version: String,
    }
    let probe: Probe = match encoding {
        Encoding::MsgPack | Encoding::Compact => rmp_serde::from_slice(bytes).ok()?,
        Encoding::Json => serde_json::from_slice(bytes).ok()?,
    };
    Some(probe.version)
}

/// Encodes a typed payload for `content_type` (MessagePack or JSON).
///
/// # Errors
/// [`CodecError::UnsupportedContentType`] when `content_type` is not MessagePack or JSON;
/// [`CodecError::Payload`] when `value` does not serialize.
pub fn encode_payload<T: Serialize + ?Sized>(
    value: &T,
    content_type: &str,
) -> Result<Bytes, CodecError> {
    let out = match Encoding::from_content_type(content_type) {
        Some(Encoding::MsgPack | Encoding::Compact) => {
            rmp_serde::to_vec_named(value).map_err(|e| e.to_string())
        }
        Some(Encoding::Json) => serde_json::to_vec(value).map_err(|e| e.to_string()),
        None => return Err(CodecError::UnsupportedContentType(content_type.to_owned())),
    };
    out.map(Bytes::from).map_err(CodecError::Payload)
}

/// Decodes a typed payload written as `content_type`.
///
/// # Errors
/// [`CodecError::UnsupportedContentType`] when `content_type` is not MessagePack or JSON;
/// [`CodecError::Payload`] when `bytes` is not one whole `T`.
pub fn decode_payload<T: DeserializeOwned>(
    bytes: &[u8],
    content_type: &str,
) -> Result<T, CodecError> {
    let out = match Encoding::from_content_type(content_type) {
        Some(Encoding::MsgPack | Encoding::Compact) => msgpack_whole(bytes),
        Some(Encoding::Json) => serde_json::from_slice(bytes).map_err(|e| e.to_string()),
        None => return Err(CodecError::UnsupportedContentType(content_type.to_owned())),
    };
    out.map_err(CodecError::Payload)
}

/// One MessagePack value that takes every byte: bytes after it are an error, as JSON's
/// trailing characters are (`07 c1 ff` is not 7).
fn msgpack_whole<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let mut de = rmp_serde::Deserializer::new(std::io::Cursor::new(bytes));
    let value = T::deserialize(&mut de).map_err(|e| e.to_string())?;
    let used = usize::try_from(de.position()).unwrap_or(usize::MAX);
    if used != bytes.len() {
        return Err(format!(
            "{} bytes after the MessagePack value",
            bytes.len().saturating_sub(used)
        ));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::envelope::{Kind, Performative, Version};

    fn sample() -> Envelope {
        let mut e = Envelope::new(Kind::Request, Performative::Request, "orchestrator");
        e.name = Some("add".into());
        e.payload = encode_payload(&(2, 3), CONTENT_TYPE_MSGPACK).expect("encodes");
        e
    }

    #[test]
    fn round_trips_in_both_encodings() {
        let e = sample();
        for enc in [Encoding::MsgPack, Encoding::Json] {
            let bytes = encode(&e, enc).expect("encodes");
            let (back, got) = decode(&bytes).expect("decodes");
            assert_eq!(got, enc);
            assert_eq!(back, e);
        }
    }

    #[test]
    fn unknown_fields_are_ignored_and_newer_minor_accepted() {
        let mut v = serde_json::to_value(sample()).expect("to value");
        v["version"] = "1.7".into();
        v["a_field_from_the_future"] = serde_json::json!({"x": 1});
        let bytes = serde_json::to_vec(&v).expect("json");
        let (e, _) = decode(&bytes).expect("newer minor decodes");
        assert_eq!(e.version.minor, 7);
        #[derive(Serialize)]
        struct Newer<'a> {
            #[serde(flatten)]
            envelope: &'a Envelope,
            a_field_from_the_future: u32,
        }
        let mut newer = sample();
        newer.version.minor = 7;
        let mp = rmp_serde::to_vec_named(&Newer {
            envelope: &newer,
            a_field_from_the_future: 1,
        })
        .expect("msgpack");
        let (e, _) = decode(&mp).expect("newer minor decodes from MessagePack");
        assert_eq!(e, newer);
    }

    #[test]
    fn any_minor_is_accepted_however_large() {
        let mut v = serde_json::to_value(sample()).expect("to value");
        v["version"] = "1.99999".into();
        let (e, _) = decode(&serde_json::to_vec(&v).expect("json")).expect("a newer minor");
        assert_eq!(e.version.minor, u16::MAX);
        v["version"] = "99999.0".into();
        assert!(matches!(
            decode(&serde_json::to_vec(&v).expect("json")),
            Err(CodecError::UnsupportedVersion { .. })
        ));
        for bad in ["1.x", "1.", ".1", "1.-2", "1.+2"] {
            assert!(bad.parse::<Version>().is_err(), "{bad}");
        }
    }

    #[test]
    fn unknown_major_is_refused_even_when_the_rest_changed() {
        let mut v = serde_json::to_value(sample()).expect("to value");
        v["version"] = "2.0".into();
        let bytes = serde_json::to_vec(&v).expect("json");
        assert!(matches!(
            decode(&bytes),
            Err(CodecError::UnsupportedVersion { .. })
        ));
        let other = serde_json::json!({"version": "3.1", "totally": "different"});
        let bytes = serde_json::to_vec(&other).expect("json");
        assert!(matches!(
            decode(&bytes),
            Err(CodecError::UnsupportedVersion { .. })
        ));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bytes in [
            &b""[..],
            b"\x00",
            b"\xde\xff\xff",
            b"{",
            b"{\"version\":1}",
            b"\x81\xa1",
        ] {
            assert!(decode(bytes).is_err(), "{bytes:?}");
        }
    }

    #[test]
    fn bytes_after_a_payload_are_an_error_in_both_encodings() {
        assert_eq!(
            decode_payload::<u32>(&[0x07], CONTENT_TYPE_MSGPACK).expect("7"),
            7
        );
        assert!(decode_payload::<u32>(&[0x07, 0xc1, 0xff], CONTENT_TYPE_MSGPACK).is_err());
        assert!(decode_payload::<u32>(&[0x07, 0x07], CONTENT_TYPE_MSGPACK).is_err());
        assert_eq!(
            decode_payload::<u32>(b"7 ", "application/json").expect("7"),
            7
        );
        assert!(decode_payload::<u32>(b"7 8", "application/json").is_err());
    }

    #[test]
    fn size_limit_is_checked_before_decoding() {
        let bytes = encode(&sample(), Encoding::MsgPack).expect("encodes");
        assert!(matches!(
            decode_limited(&bytes, bytes.len() - 1),
            Err(CodecError::TooLarge { .. })
        ));
        assert!(decode_limited(&bytes, bytes.len()).is_ok());
    }
}
