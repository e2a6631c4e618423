//! Unwrapped async-nats, for one purpose: the raw baseline `chorus bench` measures Chorus
//! against. Each call goes straight to the async-nats client, with no envelope, no subject
//! validation, no statistics and no reconnect policy, so the baseline costs what async-nats
//! costs. Chorus itself never uses this module; it lives here because no other crate of the
//! workspace imports `async_nats`.
//!
//! # Errors
//! Every fallible call here fails as async-nats does, its error kept as the source of an
//! [`ErrorKind::Broker`] error named after the call (`raw connect`, `raw publish`, ...).

// One `# Errors` for the module (above): each call only wraps async-nats's.
#![allow(clippy::missing_errors_doc)]

use std::pin::Pin;
use std::task::{Context, Poll};

use async_nats::jetstream;
use bytes::Bytes;
use futures::{Stream, StreamExt};

use crate::{Error, ErrorKind, Result};

fn err<E>(what: &'static str) -> impl FnOnce(E) -> Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    move |e| Error::with_source(ErrorKind::Broker, what, e)
}

/// The yardstick the raw baseline is checked against: the plainest async-nats program, with
/// nothing of the bench's own around it. Two connections with the library's default options,
/// a subscriber counting in a loop, a publisher sending `count` messages of `size` bytes to a
/// literal subject and flushing. Returns the messages received and the time from the first
/// send to the last receipt; the count ends at `limit` after the first send whatever arrived,
/// so a loss ends the count rather than the run.
pub async fn plain_pubsub(
    url: &str,
    subject: &str,
    count: u64,
    size: usize,
    limit: std::time::Duration,
) -> Result<(u64, std::time::Duration)> {
    let subscriber = async_nats::connect(url)
        .await
        .map_err(err("plain connect"))?;
    let mut sub = subscriber
        .subscribe(subject.to_owned())
        .await
        .map_err(err("plain subscribe"))?;
    subscriber.flush().await.map_err(err("plain flush"))?;
    let publisher = async_nats::connect(url)
        .await
        .map_err(err("plain connect"))?;
    publisher.flush().await.map_err(err("plain flush"))?;
    let started = std::time::Instant::now();
    let counter = tokio::spawn(async move {
        let _subscriber = subscriber;
        let deadline = tokio::time::sleep(limit);
        tokio::pin!(deadline);
        let mut n = 0u64;
        let mut last = started;
        while n < count {
            tokio::select! {
                biased;
                msg = sub.next() => match msg {
                    Some(_) => {
                        n += 1;
                        last = std::time::Instant::now();
                    }
                    None => break,
                },
                () = &mut deadline => break,
            }
        }
        (n, last)
    });
    let payload = Bytes::from(vec![0x5a; size]);
    for _ in 0..count {
        publisher
            .publish(subject.to_owned(), payload.clone())
            .await
            .map_err(err("plain publish"))?;
    }
    publisher.flush().await.map_err(err("plain flush"))?;
    let (n, last) = counter
        .await
        .map_err(|e| Error::with_source(ErrorKind::Broker, "plain subscriber", e))?;
    Ok((n, last.saturating_duration_since(started)))
}

/// A plain async-nats connection with the library's defaults.
#[derive(Debug, Clone)]
pub struct RawClient {
    client: async_nats::Client,
}

impl RawClient {
    /// Connects to `url` with connection name `name`, and the two client options Chorus's
    /// connections set that change the cost of a message: the same subscription buffer, and no
    /// subject validation in the client (Chorus validates its subjects itself, once).
    pub async fn connect(url: &str, name: &str) -> Result<RawClient> {
        let client = async_nats::ConnectOptions::new()
            .name(name)
            .subscription_capacity(crate::options::DEFAULT_SUBSCRIPTION_CAPACITY)
            .skip_subject_validation(true)
            .connect(url)
            .await
            .map_err(err("raw connect"))?;
        Ok(RawClient { client })
    }

    /// Subscribes to `subject`.
    pub async fn subscribe(&self, subject: &str) -> Result<RawSubscription> {
        let sub = self
            .client
            .subscribe(subject.to_owned())
            .await
            .map_err(err("raw subscribe"))?;
        Ok(RawSubscription { sub })
    }

    /// Publishes `payload` to a subject built once ([`async_nats::Subject`] clones share its
    /// bytes), as a program that sends many messages to one subject does.
    pub async fn publish_to(&self, subject: &async_nats::Subject, payload: Bytes) -> Result<()> {
        self.client
            .publish(subject.clone(), payload)
            .await
            .map_err(err("raw publish"))
    }

    /// Publishes `payload` to `subject`.
    pub async fn publish(&self, subject: &str, payload: Bytes) -> Result<()> {
        self.client
            .publish(subject.to_owned(), payload)
            .await
            .map_err(err("raw publish"))
    }

    /// Publishes `payload` to the reply subject of `request`, if it has one.
    pub async fn respond(&self, request: RawMessage, payload: Bytes) -> Result<()> {
        match request.msg.reply {
            Some(reply) => self
                .client
                .publish(reply, payload)
                .await
                .map_err(err("raw respond")),
            None => Ok(()),
        }
    }

    /// Sends a request and waits (async-nats's default timeout) for the reply's payload.
    pub async fn request(&self, subject: &str, payload: Bytes) -> Result<Bytes> {
        self.client
            .request(subject.to_owned(), payload)
            .await
            .map(|m| m.payload)
            .map_err(err("raw request"))
    }

    /// Sends what is buffered and waits for the server's answer to a ping.
    pub async fn flush(&self) -> Result<()> {
        self.client.flush().await.map_err(err("raw flush"))
    }

    /// A new unique inbox subject.
    pub fn new_inbox(&self) -> String {
        self.client.new_inbox()
    }

    /// JetStream over this connection.
    pub fn jetstream(&self) -> RawJetStream {
        RawJetStream {
            js: jetstream::new(self.client.clone()),
        }
    }
}

/// Messages of one subscription.
#[derive(Debug)]
pub struct RawSubscription {
    sub: async_nats::Subscriber,
}

impl Stream for RawSubscription {
    type Item = RawMessage;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<RawMessage>> {
        self.sub
            .poll_next_unpin(cx)
            .map(|m| m.map(|msg| RawMessage { msg }))
    }
}

/// One received message.
#[derive(Debug)]
pub struct RawMessage {
    msg: async_nats::Message,
}

impl RawMessage {
    /// Its payload.
    pub fn payload(&self) -> &Bytes {
        &self.msg.payload
    }
}

/// JetStream, unwrapped.
#[derive(Debug, Clone)]
pub struct RawJetStream {
    js: jetstream::Context,
}

impl RawJetStream {
    /// Creates a work-queue stream `name` capturing `subject`.
    pub async fn create_work_queue(&self, name: &str, subject: &str) -> Result<RawStream> {
        self.work_queue(name, subject, false).await
    }

    /// Creates a work-queue stream `name` capturing `subject` that takes atomic batches
    /// (`allow_atomic`, nats-server 2.12+): see [`RawJetStream::publish_atomic_batch`].
    pub async fn create_atomic_work_queue(&self, name: &str, subject: &str) -> Result<RawStream> {
        self.work_queue(name, subject, true).await
    }

    async fn work_queue(&self, name: &str, subject: &str, atomic: bool) -> Result<RawStream> {
        let stream = self
            .js
            .create_stream(jetstream::stream::Config {
                name: name.to_owned(),
                subjects: vec![subject.to_owned()],
                retention: jetstream::stream::RetentionPolicy::WorkQueue,
                allow_atomic_publish: atomic,
                ..Default::default()
            })
            .await
            .map_err(err("raw stream"))?;
        Ok(RawStream { stream })
    }

    /// Publishes `payloads` to `subject` as one atomic batch (`Nats-Batch-Id`, a sequence per
    /// message, `Nats-Batch-Commit` on the last): the messages before the last are plain
    /// publishes without a reply, the last waits for the one ack of the whole batch.
    pub async fn publish_atomic_batch(&self, subject: &str, payloads: &[Bytes]) -> Result<RawAck> {
        use async_nats::header::{
            NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL, NATS_BATCH_ID, NATS_BATCH_SEQUENCE,
        };
        static BATCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let client = self.js.client();
        let n = BATCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("bench-{}-{n}", std::process::id());
        let last = payloads.len().saturating_sub(1);
        for (i, payload) in payloads.iter().enumerate() {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(NATS_BATCH_ID, id.as_str());
            headers.insert(NATS_BATCH_SEQUENCE, (i + 1).to_string().as_str());
            if i == last {
                headers.insert(NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL);
                let ack = self
                    .js
                    .publish_with_headers(subject.to_owned(), headers, payload.clone())
                    .await
                    .map_err(err("raw js batch commit"))?;
                return Ok(RawAck { ack });
            }
            client
                .publish_with_headers(subject.to_owned(), headers, payload.clone())
                .await
                .map_err(err("raw js batch publish"))?;
        }
        Err(Error::new(ErrorKind::InvalidInput, "an empty batch"))
    }

    /// Deletes stream `name`.
    pub async fn delete_stream(&self, name: &str) -> Result<()> {
        self.js
            .delete_stream(name)
            .await
            .map(drop)
            .map_err(err("raw delete stream"))
    }

    /// Stores `data` as object `name` in object store bucket `bucket` (created if missing)
    /// in chunks of `chunk` bytes, then reads it back whole: the object store's own round trip.
    pub async fn object_round_trip(
        &self,
        bucket: &str,
        name: &str,
        data: &[u8],
        chunk: usize,
    ) -> Result<Bytes> {
        use tokio::io::AsyncReadExt;
        let store = match self.js.get_object_store(bucket).await {
            Ok(store) => store,
            Err(_) => self
                .js
                .create_object_store(jetstream::object_store::Config {
                    bucket: bucket.to_owned(),
                    ..Default::default()
                })
                .await
                .map_err(err("raw object bucket"))?,
        };
        let meta = jetstream::object_store::ObjectMetadata {
            name: name.to_owned(),
            chunk_size: Some(chunk),
            ..Default::default()
        };
        let mut reader = data;
        store
            .put(meta, &mut reader)
            .await
            .map_err(err("raw object put"))?;
        let mut object = store.get(name).await.map_err(err("raw object get"))?;
        let mut out = Vec::with_capacity(data.len());
        object
            .read_to_end(&mut out)
            .await
            .map_err(err("raw object read"))?;
        Ok(Bytes::from(out))
    }

    /// Publishes `payload` to `subject`; the returned [`RawAck`] waits for the stream's ack.
    pub async fn publish(&self, subject: &str, payload: Bytes) -> Result<RawAck> {
        let ack = self
            .js
            .publish(subject.to_owned(), payload)
            .await
            .map_err(err("raw js publish"))?;
        Ok(RawAck { ack })
    }
}

/// An acknowledgement on its way from the stream.
#[derive(Debug)]
pub struct RawAck {
    ack: jetstream::context::PublishAckFuture,
}

impl RawAck {
    /// Waits for it.
    pub async fn wait(self) -> Result<()> {
        self.ack.await.map(drop).map_err(err("raw js ack"))
    }
}

/// A stream made by [`RawJetStream::create_work_queue`].
#[derive(Debug)]
pub struct RawStream {
    stream: jetstream::stream::Stream,
}

impl RawStream {
    /// A durable pull consumer `durable` with `max_ack_pending` outstanding, and its messages.
    pub async fn pull(&self, durable: &str, max_ack_pending: i64) -> Result<RawDeliveries> {
        let consumer = self
            .stream
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some(durable.to_owned()),
                max_ack_pending,
                ..Default::default()
            })
            .await
            .map_err(err("raw consumer"))?;
        let messages = consumer.messages().await.map_err(err("raw messages"))?;
        Ok(RawDeliveries { messages })
    }

    /// The same consumer in a priority group (`priority_policy` `prioritized`, nats-server
    /// 2.12+), pulled as the group's one member.
    pub async fn pull_in_group(
        &self,
        durable: &str,
        max_ack_pending: i64,
    ) -> Result<RawDeliveries> {
        let consumer = self
            .stream
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some(durable.to_owned()),
                max_ack_pending,
                priority_policy: jetstream::consumer::PriorityPolicy::Prioritized,
                priority_groups: vec!["bench".to_owned()],
                ..Default::default()
            })
            .await
            .map_err(err("raw consumer"))?;
        let messages = consumer
            .stream()
            .group("bench")
            .messages()
            .await
            .map_err(err("raw messages"))?;
        Ok(RawDeliveries { messages })
    }
}

/// Messages of a pull consumer.
pub struct RawDeliveries {
    messages: jetstream::consumer::pull::Stream,
}

impl std::fmt::Debug for RawDeliveries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RawDeliveries")
    }
}

impl Stream for RawDeliveries {
    type Item = Result<RawDelivery>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.messages.poll_next_unpin(cx).map(|m| {
            m.map(|r| {
                r.map(|msg| RawDelivery { msg })
                    .map_err(|e| Error::with_source(ErrorKind::Broker, "raw delivery", e))
            })
        })
    }
}

/// One JetStream delivery.
#[derive(Debug)]
pub struct RawDelivery {
    msg: jetstream::Message,
}

impl RawDelivery {
    /// Acknowledges it.
    pub async fn ack(&self) -> Result<()> {
        self.msg
            .ack()
            .await
            .map_err(|e| Error::with_source(ErrorKind::Broker, "raw ack", e))
    }
}
