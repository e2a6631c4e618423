//! Payloads by reference: stored in the bus's object store bucket, fetched and checked by the
//! reader, and swept once expired.

use std::collections::HashMap;

use bytes::Bytes;
use chorus_broker_adapter::{ErrorKind, JetStream, ObjectSpec, Objects};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{CONTENT_TYPE_OBJECT, DEFAULT_PAYLOAD_RETENTION, EXPIRES_KEY, PAYLOAD_BUCKET};
use crate::error::SdkError;
use crate::protocol::codec;
use crate::protocol::envelope::{CONTENT_TYPE_MSGPACK, Envelope, now_ms};
use crate::protocol::status::StatusCode;
use crate::subject::Subjects;

/// What a message carried by reference holds in place of its payload (content type
/// [`CONTENT_TYPE_OBJECT`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRef {
    /// The object store bucket.
    pub bucket: String,
    /// The object's name in it.
    pub name: String,
    /// The payload's size in bytes.
    pub size: u64,
    /// The payload's SHA-256 digest, lowercase hex.
    pub sha256: String,
    /// The payload's own content type.
    pub content_type: String,
    /// When the object may be removed, ms since the epoch.
    pub expires_ms: u64,
}

/// The payload bucket's spec, with `replicas` (the coordinator creates it so; an agent that
/// finds none creates it with one): objects of messages that do not expire are kept
/// [`DEFAULT_PAYLOAD_RETENTION`].
pub fn payload_bucket(subjects: &Subjects, replicas: usize) -> ObjectSpec {
    let mut spec = ObjectSpec::new(subjects.bucket_name(PAYLOAD_BUCKET));
    spec.max_age = DEFAULT_PAYLOAD_RETENTION;
    spec.replicas = replicas;
    spec.description = "Chorus: payloads carried by reference".into();
    spec
}

/// The subjects an agent publishes to use the payload bucket (`chorus creds` grants them):
/// the bucket's chunks and metadata, the JetStream API calls that make the bucket when it is
/// missing and store, find and read an object, and the flow control of the consumer that
/// reads one. No purge and no consumer removal: only the coordinator, which sweeps expired
/// objects, removes one.
pub fn payload_permissions(subjects: &Subjects) -> Vec<String> {
    let bucket = subjects.bucket_name(PAYLOAD_BUCKET);
    let stream = format!("OBJ_{bucket}");
    vec![
        format!("$O.{bucket}.>"),
        format!("$JS.API.STREAM.INFO.{stream}"),
        format!("$JS.API.STREAM.CREATE.{stream}"),
        format!("$JS.API.STREAM.MSG.GET.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}.>"),
        format!("$JS.API.CONSUMER.CREATE.{stream}"),
        format!("$JS.API.CONSUMER.CREATE.{stream}.>"),
        format!("$JS.FC.{stream}.>"),
    ]
}

/// Stores `env`'s payload in the object store as the message's id and puts a reference to it
/// in its place, kept until `expires_ms`.
pub(crate) async fn store(
    js: &JetStream,
    subjects: &Subjects,
    env: &mut Envelope,
    expires_ms: Option<u64>,
    chunk: usize,
) -> Result<(), SdkError> {
    let objects = js.ensure_objects(&payload_bucket(subjects, 1)).await?;
    let expires_ms = expires_ms.unwrap_or_else(|| {
        now_ms().saturating_add(
            u64::try_from(DEFAULT_PAYLOAD_RETENTION.as_millis()).unwrap_or(u64::MAX),
        )
    });
    let name = env.id.hyphenated().to_string();
    let metadata = HashMap::from([(EXPIRES_KEY.to_owned(), expires_ms.to_string())]);
    // The store hashes what it stores: its digest is the reference's (hashed here only when
    // the store gives none).
    let digest = objects.put(&name, &env.payload, metadata, chunk).await?;
    let sha256 = match digest {
        Some(digest) => hex::encode(digest),
        None => hex::encode(Sha256::digest(&env.payload)),
    };
    let reference = ObjectRef {
        bucket: subjects.bucket_name(PAYLOAD_BUCKET),
        name,
        size: env.payload.len() as u64,
        sha256,
        content_type: env.content_type.as_str().to_owned(),
        expires_ms,
    };
    env.payload = codec::encode_payload(&reference, CONTENT_TYPE_MSGPACK)?;
    env.content_type = CONTENT_TYPE_OBJECT.into();
    Ok(())
}

/// Puts back the payload `env` carries by reference, after checking its size against
/// `limit` and its digest against the reference's: 5006 when the reference does not read,
/// the object is gone, too large or damaged.
pub(crate) async fn fetch(
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
    let objects = js
        .open_objects(&reference.bucket)
        .await
        .map_err(|e| refuse(format!("the payload's bucket cannot be opened: {e}")))?;
    let (payload, digest) =
        objects
            .get(&reference.name, limit)
            .await
            .map_err(|e| match e.kind() {
                ErrorKind::NotFound => refuse(format!(
                    "the payload {} is gone (expired or removed)",
                    reference.name
                )),
                ErrorKind::TooLarge => refuse(e.to_string()),
                _ => (
                    StatusCode::UNAVAILABLE,
                    format!("the payload {} could not be read: {e}", reference.name),
                ),
            })?;
    check(&reference, &payload, digest).map_err(refuse)?;
    env.payload = payload;
    env.content_type = reference.content_type.into();
    Ok(())
}

/// Whether `payload` is what `reference` describes. `stored` is the digest the object was
/// stored with, which the read checked the bytes against: compared with the reference's, it
/// saves hashing them again.
fn check(reference: &ObjectRef, payload: &Bytes, stored: Option<[u8; 32]>) -> Result<(), String> {
    if payload.len() as u64 != reference.size {
        return Err(format!(
            "the payload is {} bytes, its reference says {}",
            payload.len(),
            reference.size
        ));
    }
    let digest = match stored {
        Some(stored) => hex::encode(stored),
        None => hex::encode(Sha256::digest(payload)),
    };
    if !digest.eq_ignore_ascii_case(&reference.sha256) {
        return Err("the payload's SHA-256 digest does not match its reference".into());
    }
    Ok(())
}

/// Removes the objects whose messages have expired; how many. Run by the coordinator.
///
/// # Errors
/// [`SdkError::Broker`] when the bucket cannot be listed or an expired object cannot be deleted (a
/// missing bucket is nothing to remove).
pub async fn reap_expired(js: &JetStream, subjects: &Subjects) -> Result<usize, SdkError> {
    let objects: Objects = match js.open_objects(&subjects.bucket_name(PAYLOAD_BUCKET)).await {
        Ok(objects) => objects,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e.into()),
    };
    let now = now_ms();
    let mut removed = 0;
    for entry in objects.list().await? {
        let expired = entry
            .metadata
            .get(EXPIRES_KEY)
            .and_then(|t| t.parse::<u64>().ok())
            .is_some_and(|t| t <= now);
        if expired {
            match objects.delete(&entry.name).await {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(removed)
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
        assert_eq!(check(&r, &payload, None), Ok(()));
        let stored: [u8; 32] = Sha256::digest(&payload).into();
        assert_eq!(check(&r, &payload, Some(stored)), Ok(()));
        let short = payload.slice(1..);
        assert!(
            check(&r, &short, None)
                .expect_err("short")
                .contains("bytes")
        );
        let mut changed = payload.to_vec();
        changed[0] ^= 1;
        assert!(
            check(&r, &Bytes::from(changed.clone()), None)
                .expect_err("changed")
                .contains("SHA-256")
        );
        // An object stored under another digest than the reference's is not it.
        let other: [u8; 32] = Sha256::digest(&changed).into();
        assert!(
            check(&r, &payload, Some(other))
                .expect_err("another object")
                .contains("SHA-256")
        );
    }
}
