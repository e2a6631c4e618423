//! Key-value buckets: what one should look like, its entries and their changes.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};

use crate::Result;
use crate::classify::classified as js_err;
use crate::events::Link;

/// How many of a bucket's entries [`Kv::entries`] reads at once.
const ENTRIES_IN_FLIGHT: usize = 16;

/// What a key-value bucket should look like.
#[derive(Debug, Clone)]
pub struct KvSpec {
    /// Bucket name (`[A-Za-z0-9_-]`).
    pub bucket: String,
    /// Revisions kept per key.
    pub history: i64,
    /// Entries older than this disappear (zero: never).
    pub max_age: Duration,
    /// Replicas.
    pub replicas: usize,
    /// Description.
    pub description: String,
}

impl KvSpec {
    /// A bucket keeping one revision per key, forever.
    pub fn new(bucket: impl Into<String>) -> Self {
        KvSpec {
            bucket: bucket.into(),
            history: 1,
            max_age: Duration::ZERO,
            replicas: 1,
            description: String::new(),
        }
    }
}

/// What happened to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvOp {
    /// A value was written.
    Put,
    /// The key was deleted or purged.
    Delete,
}

/// One entry or change of a key-value bucket.
#[derive(Debug, Clone)]
pub struct KvEntry {
    /// The key.
    pub key: String,
    /// The value (empty for deletes).
    pub value: Bytes,
    /// Its revision.
    pub revision: u64,
    /// Put or delete.
    pub op: KvOp,
}

impl KvEntry {
    fn from_nats(e: kv::Entry) -> Self {
        KvEntry {
            op: match e.operation {
                kv::Operation::Put => KvOp::Put,
                kv::Operation::Delete | kv::Operation::Purge => KvOp::Delete,
            },
            key: e.key,
            value: e.value,
            revision: e.revision,
        }
    }
}

/// A key-value bucket.
#[derive(Debug, Clone)]
pub struct Kv {
    pub(super) store: kv::Store,
    /// The connection, so that a write in flight when it is lost ends soon after it is back.
    pub(super) link: Link,
}

impl Kv {
    /// The current entry for `key`, if it exists and is not deleted.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for an invalid key;
    /// [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) when JetStream does not answer in time.
    pub async fn get(&self, key: &str) -> Result<Option<KvEntry>> {
        let entry = self
            .link
            .answered(|| format!("kv get {key}"), async {
                self.store
                    .entry(key)
                    .await
                    .map_err(|e| js_err(format!("kv get {key}"), e))
            })
            .await?;
        Ok(entry.map(KvEntry::from_nats).filter(|e| e.op == KvOp::Put))
    }

    /// Writes `value`; returns the new revision.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for an invalid key;
    /// [`ErrorKind::TooLarge`](crate::ErrorKind::TooLarge) for a value over the server's limit;
    /// [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) when the ack does not come in time.
    pub async fn put(&self, key: &str, value: Bytes) -> Result<u64> {
        self.link
            .answered(|| format!("kv put {key}"), async {
                self.store
                    .put(key, value)
                    .await
                    .map_err(|e| js_err(format!("kv put {key}"), e))
            })
            .await
    }

    /// Writes only if the key does not exist; [`ErrorKind::Conflict`](crate::ErrorKind::Conflict) if it does.
    ///
    /// # Errors
    /// [`ErrorKind::Conflict`](crate::ErrorKind::Conflict) when the key exists;
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for an invalid key;
    /// [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) when the ack does not come in time.
    pub async fn create(&self, key: &str, value: Bytes) -> Result<u64> {
        self.link
            .answered(|| format!("kv create {key}"), async {
                self.store
                    .create(key, value)
                    .await
                    .map_err(|e| js_err(format!("kv create {key}"), e))
            })
            .await
    }

    /// Writes only if the key is still at `revision`; [`ErrorKind::Conflict`](crate::ErrorKind::Conflict) otherwise.
    ///
    /// # Errors
    /// [`ErrorKind::Conflict`](crate::ErrorKind::Conflict) when the key is no longer at `revision`;
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for an invalid key;
    /// [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) when JetStream does not answer in time.
    pub async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64> {
        self.link
            .answered(|| format!("kv update {key}"), async {
                self.store
                    .update(key, value, revision)
                    .await
                    .map_err(|e| js_err(format!("kv update {key}"), e))
            })
            .await
    }

    /// Deletes `key` only if it is still at `revision`; [`ErrorKind::Conflict`](crate::ErrorKind::Conflict) otherwise.
    ///
    /// # Errors
    /// [`ErrorKind::Conflict`](crate::ErrorKind::Conflict) when the key is no longer at `revision`;
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for an invalid key;
    /// [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) when JetStream does not answer in time.
    pub async fn delete_if(&self, key: &str, revision: u64) -> Result<()> {
        self.link
            .answered(|| format!("kv delete {key}"), async {
                self.store
                    .delete_expect_revision(key, Some(revision))
                    .await
                    .map_err(|e| js_err(format!("kv delete {key}"), e))
            })
            .await
    }

    /// Deletes `key`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for an invalid key;
    /// [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) when JetStream does not answer in time.
    pub async fn delete(&self, key: &str) -> Result<()> {
        self.link
            .answered(|| format!("kv delete {key}"), async {
                self.store
                    .delete(key)
                    .await
                    .map_err(|e| js_err(format!("kv delete {key}"), e))
            })
            .await
    }

    /// Every live entry.
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) when JetStream does not answer in time;
    /// [`ErrorKind::Broker`](crate::ErrorKind::Broker) when the listing's consumer cannot be
    /// created or read.
    pub async fn entries(&self) -> Result<Vec<KvEntry>> {
        let mut listed = self.store.keys().await.map_err(|e| js_err("kv keys", e))?;
        let mut keys = Vec::new();
        while let Some(key) = listed.next().await {
            keys.push(key.map_err(|e| js_err("kv keys", e))?);
        }
        // Read [`ENTRIES_IN_FLIGHT`] at a time, in the listing's order: a bucket of many keys
        // is read in a few round trips' time, not one per key.
        let reads: Vec<_> = keys.iter().map(|key| self.get(key)).collect();
        let read: Vec<Option<KvEntry>> = futures::stream::iter(reads)
            .buffered(ENTRIES_IN_FLIGHT)
            .try_collect()
            .await?;
        Ok(read.into_iter().flatten().collect())
    }

    /// Every change from now on, after the current value of every key.
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) when JetStream does not answer in time;
    /// [`ErrorKind::Broker`](crate::ErrorKind::Broker) when the watch's consumer cannot be created.
    /// Errors after that come as items of the [`KvWatch`].
    pub async fn watch(&self) -> Result<KvWatch> {
        let inner = self
            .store
            .watch_with_history(">")
            .await
            .map_err(|e| js_err("kv watch", e))?;
        Ok(KvWatch { inner })
    }
}

/// Changes of a bucket; see [`Kv::watch`].
pub struct KvWatch {
    inner: kv::Watch,
}

impl std::fmt::Debug for KvWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvWatch")
    }
}

impl Stream for KvWatch {
    type Item = Result<KvEntry>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.poll_next_unpin(cx).map(|next| {
            next.map(|item| {
                item.map(KvEntry::from_nats)
                    .map_err(|e| js_err("kv watch", e))
            })
        })
    }
}
