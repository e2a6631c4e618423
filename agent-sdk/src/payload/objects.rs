//! Payloads by reference: stored in parts in the bus's payload bucket under the writer's own
//! name, fetched and checked by the reader, and removed by the server when they expire.
//!
//! The layout (docs/PROTOCOL.md section 7.11): the key-value bucket `<root>_payloads` (stream
//! `KV_<root>_payloads`, per-message TTLs allowed); a payload is the object
//! `<writer>.<message id>`, its parts the keys `<writer>.<message id>.<n>` from 0, each
//! [`PayloadLimits::chunk_for`](super::PayloadLimits::chunk_for) bytes but the last, each
//! written with `Nats-TTL` until the message's expiry. An agent's credentials let it write
//! keys under its own id only (`$KV.<root>_payloads.<id>.>`), so no agent replaces or removes
//! another's payload.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use chorus_broker_adapter::{ErrorKind, JetStream, KvSpec};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{CONTENT_TYPE_OBJECT, DEFAULT_PAYLOAD_RETENTION, PAYLOAD_BUCKET};
use crate::error::SdkError;
use crate::protocol::codec;
use crate::protocol::envelope::{CONTENT_TYPE_MSGPACK, Envelope, now_ms};
use crate::protocol::status::StatusCode;
use crate::subject::{SubjectError, Subjects};

/// Parts written or read at once.
const PARTS_IN_FLIGHT: usize = 16;

/// What a message carried by reference holds in place of its payload (content type
/// [`CONTENT_TYPE_OBJECT`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRef {
    /// The payload bucket (`<root>_payloads`).
    pub bucket: String,
    /// The payload's name in it, `<writer>.<message id>`: its parts are the keys `<name>.<n>`.
    pub name: String,
    /// The payload's size in bytes.
    pub size: u64,
    /// The payload's SHA-256 digest, lowercase hex.
    pub sha256: String,
    /// The payload's own content type.
    pub content_type: String,
    /// When the payload may be removed, ms since the epoch.
    pub expires_ms: u64,
}

/// The payload bucket's spec, with `replicas` (the coordinator creates it so; an agent that
/// finds none creates it with one): one revision per key, per-key TTLs, and parts of messages
/// that do not expire kept [`DEFAULT_PAYLOAD_RETENTION`].
pub fn payload_bucket(subjects: &Subjects, replicas: usize) -> KvSpec {
    let mut spec = KvSpec::new(subjects.bucket_name(PAYLOAD_BUCKET));
    spec.max_age = DEFAULT_PAYLOAD_RETENTION;
    spec.replicas = replicas;
    spec.per_key_ttl = true;
    spec.description = "Chorus: payloads carried by reference".into();
    spec
}

/// The subjects agent `writer` publishes to use the payload bucket (`chorus creds` grants
/// them): its own parts, `$KV.<bucket>.<writer>.>`, the JetStream API calls that make the
/// bucket when it is missing, and the direct reads of any part (a payload carried by reference
/// is read by whoever knows its name: one that must stay private is encrypted end to end
/// first). No other writer's keys, no purge, no removal.
///
/// # Errors
/// [`SubjectError`] when `writer` is not an agent id.
pub fn payload_permissions(subjects: &Subjects, writer: &str) -> Result<Vec<String>, SubjectError> {
    let bucket = subjects.bucket_name(PAYLOAD_BUCKET);
    let stream = format!("KV_{bucket}");
    Ok(vec![
        subjects.bucket_keys(PAYLOAD_BUCKET, writer)?,
        format!("$JS.API.STREAM.INFO.{stream}"),
        format!("$JS.API.STREAM.CREATE.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}.>"),
    ])
}

/// Stores `env`'s payload in the payload bucket as `<writer>.<message id>`, in parts of
/// `chunk` bytes kept until `expires_ms`, and puts a reference to it in its place.
pub(crate) async fn store(
    js: &JetStream,
    subjects: &Subjects,
    writer: &str,
    env: &mut Envelope,
    expires_ms: Option<u64>,
    chunk: usize,
) -> Result<(), SdkError> {
    // On the heap: the bucket's calls make a large future, and every send that may carry a
    // payload by reference would hold its room on its caller's stack.
    Box::pin(store_parts(js, subjects, writer, env, expires_ms, chunk)).await
}

async fn store_parts(
    js: &JetStream,
    subjects: &Subjects,
    writer: &str,
    env: &mut Envelope,
    expires_ms: Option<u64>,
    chunk: usize,
) -> Result<(), SdkError> {
    js.ensure_kv_exists(&payload_bucket(subjects, 1)).await?;
    let now = now_ms();
    let expires_ms = expires_ms.unwrap_or_else(|| {
        now.saturating_add(u64::try_from(DEFAULT_PAYLOAD_RETENTION.as_millis()).unwrap_or(u64::MAX))
    });
    // The server counts TTLs in whole seconds, at least one.
    let ttl = Duration::from_secs(expires_ms.saturating_sub(now).div_ceil(1000).max(1));
    let name = format!("{writer}.{}", env.id.hyphenated());
    let payload = env.payload.clone();
    let chunk = chunk.max(1);
    let parts: Vec<Bytes> = if payload.is_empty() {
        vec![Bytes::new()]
    } else {
        (0..payload.len())
            .step_by(chunk)
            .map(|at| payload.slice(at..(at + chunk).min(payload.len())))
            .collect()
    };
    let bucket = subjects.bucket_name(PAYLOAD_BUCKET);
    futures::stream::iter(parts.into_iter().enumerate())
        .map(|(n, part)| {
            let subject = format!("$KV.{bucket}.{name}.{n}");
            async move { js.publish(&subject, None, None, Some(ttl), part).await }
        })
        .buffer_unordered(PARTS_IN_FLIGHT)
        .try_collect::<Vec<_>>()
        .await?;
    let reference = ObjectRef {
        bucket,
        name,
        size: payload.len() as u64,
        sha256: hex::encode(Sha256::digest(&payload)),
        content_type: env.content_type.as_str().to_owned(),
        expires_ms,
    };
    env.payload = codec::encode_payload(&reference, CONTENT_TYPE_MSGPACK)?;
    env.content_type = CONTENT_TYPE_OBJECT.into();
    Ok(())
}

/// Whether `name` can be a payload's name: key tokens of letters, digits, `-` and `_`.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name.split('.').all(|t| {
            !t.is_empty()
                && t.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c))
        })
}

/// Puts back the payload `env` carries by reference, after checking its size against
/// `limit` and its digest against the reference's: 5006 when the reference does not read,
/// the payload is gone, too large or damaged.
pub(crate) async fn fetch(
    js: &JetStream,
    env: &mut Envelope,
    limit: usize,
) -> Result<(), (StatusCode, String)> {
    // On the heap, as [`store`]: every reply and delivery that may come by reference would
    // otherwise hold the reads' room on its reader's stack.
    Box::pin(fetch_parts(js, env, limit)).await
}

async fn fetch_parts(
    js: &JetStream,
    env: &mut Envelope,
    limit: usize,
) -> Result<(), (StatusCode, String)> {
    let refuse = |why: String| (StatusCode::DATA_FORMAT, why);
    let reference: ObjectRef = codec::decode_payload(&env.payload, CONTENT_TYPE_MSGPACK)
        .map_err(|e| refuse(format!("the payload reference does not read: {e}")))?;
    if reference.size > limit as u64 {
        return Err(refuse(format!(
            "the payload is {} bytes, over this agent's limit of {limit}",
            reference.size
        )));
    }
    if !valid_name(&reference.name) {
        return Err(refuse(format!(
            "the payload reference does not read: invalid name {:?}",
            reference.name
        )));
    }
    let kv = js
        .open_kv(&reference.bucket)
        .await
        .map_err(|e| refuse(format!("the payload's bucket cannot be opened: {e}")))?;
    let name = &reference.name;
    let part = |n: u64| {
        let kv = &kv;
        async move {
            match kv.get(&format!("{name}.{n}")).await {
                Ok(Some(entry)) => Ok(entry.value),
                Ok(None) => Err(refuse(format!(
                    "the payload {name} is gone (expired or removed)"
                ))),
                Err(e) if e.kind() == ErrorKind::InvalidInput => {
                    Err(refuse(format!("the payload {name} does not read: {e}")))
                }
                Err(e) => Err((
                    StatusCode::UNAVAILABLE,
                    format!("the payload {name} could not be read: {e}"),
                )),
            }
        }
    };
    let first = part(0).await?;
    let size = usize::try_from(reference.size).unwrap_or(usize::MAX);
    let payload = if first.len() >= size {
        first
    } else if first.is_empty() {
        return Err(refuse(format!(
            "the payload {name} is damaged: its first part is empty"
        )));
    } else {
        let count = size.div_ceil(first.len()) as u64;
        let rest: Vec<Bytes> = futures::stream::iter(1..count)
            .map(part)
            .buffered(PARTS_IN_FLIGHT)
            .try_collect()
            .await?;
        let mut whole = BytesMut::with_capacity(size);
        whole.extend_from_slice(&first);
        for p in rest {
            if whole.len() + p.len() > size {
                return Err(refuse(format!(
                    "the payload {name} is larger than its reference says"
                )));
            }
            whole.extend_from_slice(&p);
        }
        whole.freeze()
    };
    check(&reference, &payload).map_err(refuse)?;
    env.payload = payload;
    env.content_type = reference.content_type.into();
    Ok(())
}

/// Whether `payload` is what `reference` describes.
fn check(reference: &ObjectRef, payload: &Bytes) -> Result<(), String> {
    if payload.len() as u64 != reference.size {
        return Err(format!(
            "the payload is {} bytes, its reference says {}",
            payload.len(),
            reference.size
        ));
    }
    let digest = hex::encode(Sha256::digest(payload));
    if !digest.eq_ignore_ascii_case(&reference.sha256) {
        return Err("the payload's SHA-256 digest does not match its reference".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(payload: &[u8]) -> ObjectRef {
        ObjectRef {
            bucket: "chorus_payloads".into(),
            name: "x".into(),
            size: payload.len() as u64,
            sha256: hex::encode(Sha256::digest(payload)),
            content_type: "application/octet-stream".into(),
            expires_ms: 0,
        }
    }

    #[test]
    fn a_payload_matches_its_reference_only_whole_and_unchanged() {
        let payload = Bytes::from_static(b"fifty mebibytes, give or take");
        let r = reference(&payload);
        assert_eq!(check(&r, &payload), Ok(()));
        let short = payload.slice(1..);
        assert!(check(&r, &short).expect_err("short").contains("bytes"));
        let mut changed = payload.to_vec();
        changed[0] ^= 1;
        assert!(
            check(&r, &Bytes::from(changed))
                .expect_err("changed")
                .contains("SHA-256")
        );
    }

    #[test]
    fn a_payloads_name_is_key_tokens_and_nothing_that_reaches_elsewhere() {
        assert!(valid_name("web-ui.0190a7c4-0000-7000-8000-000000000000"));
        for bad in ["", "a..b", ".a", "a.", "a.>", "a.*", "a b", "a/b"] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
