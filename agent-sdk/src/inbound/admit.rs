//! The first step of every inbound message: decode within the size limit, then admit or refuse
//! by what the envelope says of itself (its kind, its expiry, its hop count). Pure: no I/O, so
//! every refusal here is unit-tested without a server.

use bytes::Bytes;

use super::outcome::Failure;
use crate::protocol::codec::{self, Encoding};
use crate::protocol::envelope::{Envelope, Kind};
use crate::protocol::status::StatusCode;
use crate::stats::AgentCounters;

/// An inbound message refused before any handler: why, the envelope when it decoded, and the
/// encoding to answer in.
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) failure: Failure,
    pub(crate) request: Option<Box<Envelope>>,
    pub(crate) encoding: Encoding,
}

/// What admission checks against.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Larger messages are refused (5006) without being decoded.
    pub(crate) max_message_bytes: usize,
    /// The most hops this agent accepts, whatever the message's own limit.
    pub(crate) hop_limit: u8,
    /// The encoding to answer bytes in that do not say which they are.
    pub(crate) encoding: Encoding,
}

/// Decodes `payload` within the size limit; bytes that are not an envelope are 5006.
pub(crate) fn decode(
    payload: &Bytes,
    limits: Limits,
    counters: &AgentCounters,
) -> Result<(Envelope, Encoding), Refused> {
    codec::decode_limited(payload, limits.max_message_bytes).map_err(|err| {
        AgentCounters::bump(&counters.bad_input);
        Refused {
            failure: Failure::refused(StatusCode::DATA_FORMAT, err.to_string()),
            request: None,
            // A request that starts like JSON is answered in JSON even when the rest does not
            // decode, so a JSON-only client can read why.
            encoding: reply_encoding(payload, limits.encoding),
        }
    })
}

/// Decodes `payload` and admits it, counting each refusal in `counters`.
#[cfg(test)]
pub(crate) fn admit(
    payload: &Bytes,
    limits: Limits,
    counters: &AgentCounters,
    now_ms: u64,
) -> Result<(Envelope, Encoding), Refused> {
    let (env, encoding) = decode(payload, limits, counters)?;
    admit_decoded(env, encoding, limits.hop_limit, counters, now_ms)
}

/// Admits a decoded envelope: [`check`], counting a refusal under its reason.
pub(crate) fn admit_decoded(
    env: Envelope,
    encoding: Encoding,
    hop_limit: u8,
    counters: &AgentCounters,
    now_ms: u64,
) -> Result<(Envelope, Encoding), Refused> {
    match check(&env, hop_limit, now_ms) {
        None => Ok((env, encoding)),
        Some(failure) => {
            count(counters, &failure);
            Err(Refused {
                failure,
                request: Some(Box::new(env)),
                encoding,
            })
        }
    }
}

/// The encoding to answer bytes in that may not decode: the form they start like (so their
/// sender can read why: JSON, named or compact MessagePack), and for bytes that start like none
/// of them, `default` unless that is the compact form, which a protocol-1 sender cannot read:
/// the named form then, which every reader reads.
pub(crate) fn reply_encoding(payload: &[u8], default: Encoding) -> Encoding {
    Encoding::sniff(payload).unwrap_or(match default {
        Encoding::Compact => Encoding::MsgPack,
        other => other,
    })
}

/// Counts a refusal by [`check`] under its reason.
fn count(counters: &AgentCounters, failure: &Failure) {
    let counter = match failure.status {
        StatusCode::EXPIRED => &counters.expired,
        StatusCode::LOOP_DETECTED => &counters.loop_refused,
        _ => &counters.bad_input,
    };
    AgentCounters::bump(counter);
}

/// Why a decoded envelope is refused, if it is: an unknown kind (5006), past its TTL or
/// deadline (5011), past the hop limit (5010).
pub(crate) fn check(env: &Envelope, hop_limit: u8, now_ms: u64) -> Option<Failure> {
    let limit = env.hop_limit.min(hop_limit);
    if env.kind == Kind::Unknown {
        Some(Failure::refused(
            StatusCode::DATA_FORMAT,
            "unsupported message kind",
        ))
    } else if env.is_expired_at(now_ms) {
        Some(Failure::refused(
            StatusCode::EXPIRED,
            "the message's TTL or deadline passed before it was handled",
        ))
    } else if env.hops > limit {
        Some(Failure::refused(
            StatusCode::LOOP_DETECTED,
            format!("hop {} is past the limit of {limit}", env.hops),
        ))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::envelope::Performative;

    /// Issue 32, item 14: a compact map whose first key is not 0 is a malformed compact
    /// envelope, answered compact with the compact reason; garbage is answered in a form every
    /// reader reads, whatever the bus level.
    #[test]
    fn bytes_are_answered_in_the_form_they_start_like() {
        // {1: ...}: an integer first key that is not the version.
        let bad_compact = [0x81, 0x01, 0xc0];
        assert_eq!(Encoding::sniff(&bad_compact), Some(Encoding::Compact));
        let err = crate::codec::decode(&bad_compact).expect_err("malformed");
        assert!(
            err.to_string()
                .contains("the first key is not 0 (the version)"),
            "{err}"
        );
        assert_eq!(
            reply_encoding(&bad_compact, Encoding::Json),
            Encoding::Compact
        );
        // A named map stays named.
        let named = [0x81, 0xa2, b'i', b'd', 0xc0];
        assert_eq!(Encoding::sniff(&named), Some(Encoding::MsgPack));
        assert_eq!(
            reply_encoding(b" {\"x\"", Encoding::Compact),
            Encoding::Json
        );
        // Garbage: never the compact form a protocol-1 sender cannot read.
        assert_eq!(
            reply_encoding(b"\x00garbage", Encoding::Compact),
            Encoding::MsgPack
        );
        assert_eq!(
            reply_encoding(b"\x00garbage", Encoding::Json),
            Encoding::Json
        );
    }

    const LIMITS: Limits = Limits {
        max_message_bytes: 1024,
        hop_limit: 4,
        encoding: Encoding::MsgPack,
    };

    fn request() -> Envelope {
        let mut env = Envelope::new(Kind::Request, Performative::Request, "alice");
        env.content_type = "application/msgpack".into();
        env
    }

    fn admit_env(env: &Envelope, encoding: Encoding) -> Result<(Envelope, Encoding), Refused> {
        let bytes = codec::encode(env, encoding).expect("encodes");
        admit(&bytes, LIMITS, &AgentCounters::default(), env.timestamp_ms)
    }

    #[test]
    fn a_good_request_is_admitted_in_its_own_encoding() {
        let (env, encoding) = admit_env(&request(), Encoding::Json).expect("admitted");
        assert_eq!(env.from, "alice");
        assert_eq!(encoding, Encoding::Json);
    }

    #[test]
    fn oversized_garbage_and_unknown_majors_are_5006_and_counted() {
        let counters = AgentCounters::default();
        let big = Bytes::from(vec![0x80; 2048]);
        let refused = admit(&big, LIMITS, &counters, 0).expect_err("too large");
        assert_eq!(refused.failure.status, StatusCode::DATA_FORMAT);
        assert!(refused.request.is_none());
        let garbage = Bytes::from_static(b"\x00\x01garbage");
        let refused = admit(&garbage, LIMITS, &counters, 0).expect_err("garbage");
        assert_eq!(refused.failure.status, StatusCode::DATA_FORMAT);
        assert_eq!(refused.encoding, Encoding::MsgPack);
        let major = Bytes::from_static(br#"{"version":"9.0"}"#);
        let refused = admit(&major, LIMITS, &counters, 0).expect_err("unknown major");
        assert_eq!(refused.failure.status, StatusCode::DATA_FORMAT);
        assert_eq!(refused.encoding, Encoding::Json, "JSON in, JSON out");
        assert_eq!(counters.snapshot().bad_input, 3);
    }

    #[test]
    fn an_unknown_kind_is_5006() {
        let mut env = request();
        env.kind = Kind::Unknown;
        let failure = check(&env, 4, env.timestamp_ms).expect("refused");
        assert_eq!(failure.status, StatusCode::DATA_FORMAT);
    }

    #[test]
    fn an_expired_message_is_5011_and_counted() {
        let mut env = request();
        env.ttl_ms = Some(10);
        let counters = AgentCounters::default();
        let bytes = codec::encode(&env, Encoding::MsgPack).expect("encodes");
        let refused = admit(&bytes, LIMITS, &counters, env.timestamp_ms + 11).expect_err("expired");
        assert_eq!(refused.failure.status, StatusCode::EXPIRED);
        assert_eq!(refused.request.map(|r| r.id), Some(env.id));
        assert_eq!(counters.snapshot().expired, 1);
        assert!(check(&env, 4, env.timestamp_ms + 10).is_none());
    }

    #[test]
    fn a_hop_past_either_limit_is_5010() {
        let mut env = request();
        env.hops = 5;
        env.hop_limit = 16;
        let failure = check(&env, 4, env.timestamp_ms).expect("past the agent's limit");
        assert_eq!(failure.status, StatusCode::LOOP_DETECTED);
        assert_eq!(failure.reason, "hop 5 is past the limit of 4");
        env.hop_limit = 2;
        env.hops = 3;
        let failure = check(&env, 16, env.timestamp_ms).expect("past the message's limit");
        assert_eq!(failure.status, StatusCode::LOOP_DETECTED);
        env.hops = 2;
        assert!(check(&env, 16, env.timestamp_ms).is_none());
    }
}
