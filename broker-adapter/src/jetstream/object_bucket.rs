//! Object store buckets: large values kept in chunks on a stream, each with a SHA-256 digest
//! the server side checks on the way back, and free key-values (`metadata`) of its own.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::object_store;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use tokio::io::AsyncReadExt;

use crate::classify::classified as js_err;
use crate::{Error, ErrorKind, Result};

/// The digest an object store writes (`SHA-256=<base64url>`), as bytes.
fn sha256_of(digest: Option<&str>) -> Option<[u8; 32]> {
    use base64::Engine as _;
    let encoded = digest?.strip_prefix("SHA-256=")?;
    let bytes = base64::engine::general_purpose::URL_SAFE
        .decode(encoded)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(encoded))
        .ok()?;
    bytes.try_into().ok()
}

/// What an object store bucket should look like.
#[derive(Debug, Clone)]
pub struct ObjectSpec {
    /// Bucket name (`[A-Za-z0-9_-]`).
    pub bucket: String,
    /// Objects older than this disappear (zero: never).
    pub max_age: Duration,
    /// Most bytes the bucket holds (negative: no limit).
    pub max_bytes: i64,
    /// Replicas.
    pub replicas: usize,
    /// Description.
    pub description: String,
}

impl ObjectSpec {
    /// A bucket without limits.
    pub fn new(bucket: impl Into<String>) -> Self {
        ObjectSpec {
            bucket: bucket.into(),
            max_age: Duration::ZERO,
            max_bytes: -1,
            replicas: 1,
            description: String::new(),
        }
    }
}

/// What is known of a stored object without reading it.
#[derive(Debug, Clone)]
pub struct ObjectEntry {
    /// Its name.
    pub name: String,
    /// Its size in bytes.
    pub size: usize,
    /// Its free key-values.
    pub metadata: HashMap<String, String>,
}

/// An object store bucket.
#[derive(Clone)]
pub struct Objects {
    pub(super) store: object_store::ObjectStore,
}

impl std::fmt::Debug for Objects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Objects")
    }
}

impl Objects {
    /// Stores `data` as `name` (replacing an object of that name) with `metadata`, in chunks
    /// of `chunk` bytes (each one message: under the server's `max_payload`); returns the
    /// SHA-256 digest of `data` the store computed on the way.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for an invalid name; [`ErrorKind::Broker`] when a chunk or the
    /// metadata cannot be stored (a `chunk` over the server's `max_payload`, a full bucket, the
    /// connection closed).
    pub async fn put(
        &self,
        name: &str,
        data: &[u8],
        metadata: HashMap<String, String>,
        chunk: usize,
    ) -> Result<Option<[u8; 32]>> {
        let meta = object_store::ObjectMetadata {
            name: name.to_owned(),
            metadata,
            chunk_size: Some(chunk),
            ..Default::default()
        };
        let mut reader = data;
        self.store
            .put(meta, &mut reader)
            .await
            .map(|info| sha256_of(info.digest.as_deref()))
            .map_err(|e| js_err(format!("object put {name}"), e))
    }

    /// Reads the object `name` whole, refusing one larger than `limit` bytes before reading
    /// it ([`ErrorKind::TooLarge`]); [`ErrorKind::NotFound`] when there is none. Returns it
    /// with its SHA-256 digest as stored, which the read has checked the bytes against (a
    /// damaged object is an error), when the object has one.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when there is none; [`ErrorKind::TooLarge`] over `limit`;
    /// [`ErrorKind::InvalidInput`] for an invalid name; [`ErrorKind::Broker`] when a chunk cannot
    /// be read or the bytes do not match the digest.
    pub async fn get(&self, name: &str, limit: usize) -> Result<(Bytes, Option<[u8; 32]>)> {
        let mut object = self
            .store
            .get(name)
            .await
            .map_err(|e| js_err(format!("object get {name}"), e))?;
        let size = object.info().size;
        let digest = sha256_of(object.info().digest.as_deref());
        if size > limit {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!("object {name} is {size} bytes, over the limit of {limit}"),
            ));
        }
        let mut buf = BytesMut::with_capacity(size);
        // The reader checks the object's digest at its end: a damaged object is an error.
        loop {
            let n = object.read_buf(&mut buf).await.map_err(|e| {
                Error::with_source(ErrorKind::Broker, format!("object read {name}"), e)
            })?;
            if n == 0 {
                break;
            }
            if buf.len() > limit {
                return Err(Error::new(
                    ErrorKind::TooLarge,
                    format!("object {name} grew over the limit of {limit} bytes"),
                ));
            }
        }
        Ok((buf.freeze(), digest))
    }

    /// Deletes the object `name` (its chunks are purged).
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when there is none; [`ErrorKind::InvalidInput`] for an invalid name;
    /// [`ErrorKind::TimedOut`] when JetStream does not answer in time.
    pub async fn delete(&self, name: &str) -> Result<()> {
        self.store
            .delete(name)
            .await
            .map_err(|e| js_err(format!("object delete {name}"), e))
    }

    /// Every live object, without its content.
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`] when JetStream does not answer in time; [`ErrorKind::Broker`] when
    /// the listing's consumer cannot be created or read.
    pub async fn list(&self) -> Result<Vec<ObjectEntry>> {
        let mut list = self
            .store
            .list()
            .await
            .map_err(|e| js_err("object list", e))?;
        let mut out = Vec::new();
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| js_err("object list", e))?;
            if !info.deleted {
                out.push(ObjectEntry {
                    name: info.name,
                    size: info.size,
                    metadata: info.metadata,
                });
            }
        }
        Ok(out)
    }
}
