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

/// How long [`Kv::entries_under`] waits for the next entry the server said it holds.
const LIST_WAIT: Duration = Duration::from_secs(10);

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
    /// Whether each key may carry a TTL of its own (`Nats-TTL`; the server removes the key when
    /// it passes, and marks the removal for a second).
    pub per_key_ttl: bool,
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
            per_key_ttl: false,
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
    /// Its JetStream context, for a listing's subscription and the messages it reads.
    pub(super) ctx: async_nats::jetstream::Context,
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

    /// Every live entry whose key is under `prefix` (`<prefix>.<rest>`), read through a
    /// consumer that sees only those keys: credentials that may read their own keys and no
    /// others' list them (the consumer's name and filter are in the subject of its creation,
    /// `$JS.API.CONSUMER.CREATE.<stream>.<name>.$KV.<bucket>.<prefix>.>`). The consumer is
    /// the server's to remove once unused.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for a prefix that is not
    /// one or more key tokens; [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) when the
    /// server does not answer or the entries stop coming; [`ErrorKind::Broker`](crate::ErrorKind::Broker)
    /// when the consumer cannot be created.
    pub async fn entries_under(&self, prefix: &str) -> Result<Vec<KvEntry>> {
        use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, ReplayPolicy, push};
        if prefix.is_empty()
            || prefix.split('.').any(|t| {
                t.is_empty()
                    || !t
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_=/".contains(c))
            })
        {
            return Err(crate::Error::new(
                crate::ErrorKind::InvalidInput,
                format!("kv entries under {prefix:?}: not a key prefix"),
            ));
        }
        let what = || format!("kv entries under {prefix}");
        let subject_prefix = self.store.prefix.clone();
        let client = self.ctx.client();
        let deliver = client.new_inbox();
        // Subscribed before the consumer exists: a push consumer delivers at once, and what
        // comes before a subscription is lost.
        let mut delivered = client
            .subscribe(deliver.clone())
            .await
            .map_err(|e| crate::Error::new(crate::ErrorKind::Broker, format!("{}: {e}", what())))?;
        let config = push::Config {
            name: Some(format!("list_{}", nuid::next())),
            deliver_subject: deliver,
            filter_subject: format!("{subject_prefix}{prefix}.>"),
            deliver_policy: DeliverPolicy::LastPerSubject,
            ack_policy: AckPolicy::None,
            replay_policy: ReplayPolicy::Instant,
            inactive_threshold: Duration::from_secs(10),
            memory_storage: true,
            ..Default::default()
        };
        let consumer = self
            .link
            .answered(what, async {
                self.store
                    .stream
                    .create_consumer(config)
                    .await
                    .map_err(|e| js_err(what(), e))
            })
            .await?;
        let mut pending = consumer.cached_info().num_pending;
        let mut entries = Vec::new();
        while pending > 0 {
            let message = tokio::time::timeout(LIST_WAIT, delivered.next())
                .await
                .map_err(|_| {
                    crate::Error::new(
                        crate::ErrorKind::TimedOut,
                        format!("{}: the entries stopped coming", what()),
                    )
                })?
                .ok_or_else(|| {
                    crate::Error::new(
                        crate::ErrorKind::Broker,
                        format!("{}: the subscription ended", what()),
                    )
                })?;
            let message = async_nats::jetstream::Message {
                message,
                context: self.ctx.clone(),
            };
            pending = message
                .info()
                .map_err(|e| {
                    crate::Error::new(crate::ErrorKind::Broker, format!("{}: {e}", what()))
                })?
                .pending;
            let Some(key) = message.subject.strip_prefix(subject_prefix.as_str()) else {
                continue;
            };
            let deleted = message
                .headers
                .as_ref()
                .and_then(|h| h.get("KV-Operation"))
                .is_some_and(|op| op.as_str() == "DEL" || op.as_str() == "PURGE");
            if !deleted {
                entries.push(KvEntry {
                    key: key.to_owned(),
                    value: message.payload.clone(),
                    revision: message
                        .info()
                        .map(|i| i.stream_sequence)
                        .unwrap_or_default(),
                    op: KvOp::Put,
                });
            }
        }
        let _ = delivered.unsubscribe().await;
        Ok(entries)
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
