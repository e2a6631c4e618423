//! JetStream: streams, durable pull consumers with explicit acks, key-value buckets and object
//! store buckets.
//!
//! The rest of Chorus sees specs ([`StreamSpec`], [`ConsumerSpec`], [`KvSpec`]) and small
//! handles; every call returns the adapter's [`Error`] with a kind. Consumers and their
//! deliveries are in `consumer`, key-value buckets in `kv`.

mod consumer;
mod follow;
mod kv_bucket;
mod object_bucket;

use consumer::datetime_ms;
pub use consumer::{Consumer, ConsumerSpec, ConsumerState, Deliveries, Delivery};
pub use follow::Follow;
pub use kv_bucket::{Kv, KvEntry, KvOp, KvSpec, KvWatch};
pub use object_bucket::{ObjectEntry, ObjectSpec, Objects};

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, consumer::pull, kv, object_store, stream};
use bytes::Bytes;
use futures::StreamExt;

use crate::classify::{self, Classify};
use crate::events::Link;
use crate::{Broker, Error, ErrorKind, Headers, Result};

/// The adapter's error for a failed JetStream call: its kind read from the error's async-nats
/// kind or JetStream error code (see [`classify`]).
fn js_err<E: Classify>(context: &str, err: E) -> Error {
    classify::classified(context, err)
}

/// Why a stream could not be created, with what to do when the server has no room for it:
/// JetStream reserves a stream's `max_bytes` up front, so a nearly full disk refuses it even
/// while the stream is empty.
fn stream_err<E: Classify>(spec: &StreamSpec, err: E) -> Error {
    let no_room = matches!(
        classify::jetstream_code(&err),
        Some(jetstream::ErrorCode::STORAGE_RESOURCES_EXCEEDED)
            | Some(jetstream::ErrorCode::INSUFFICIENT_RESOURCES)
    );
    let context = if no_room && spec.max_bytes > 0 {
        format!(
            "cannot create stream {}: the server cannot reserve its max_bytes of {} MiB \
             (free disk space, raise the server's max_file_store, or lower the limit)",
            spec.name,
            spec.max_bytes >> 20
        )
    } else {
        format!("cannot create stream {}", spec.name)
    };
    js_err(&context, err)
}

/// NATS's default duplicate window of a stream.
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// NATS's default ack wait of a consumer.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// NATS's default most unacknowledged messages of a consumer.
pub const DEFAULT_MAX_ACK_PENDING: i64 = 1_000;
/// How often the server tells a waiting pull it is alive; a missed beat restarts the pull.
pub const PULL_HEARTBEAT: Duration = Duration::from_secs(5);
/// How long one pull request waits on the server before it is renewed.
pub const PULL_EXPIRES: Duration = Duration::from_secs(30);

/// What a stream should look like. [`JetStream::ensure_stream`] creates or updates it.
#[derive(Debug, Clone)]
pub struct StreamSpec {
    /// Stream name.
    pub name: String,
    /// Subjects it captures.
    pub subjects: Vec<String>,
    /// Oldest message kept (zero: no limit).
    pub max_age: Duration,
    /// Most bytes kept (-1: no limit).
    pub max_bytes: i64,
    /// Most messages kept per subject (-1: no limit).
    pub max_msgs_per_subject: i64,
    /// Window in which a repeated `Nats-Msg-Id` is dropped as a duplicate.
    pub duplicate_window: Duration,
    /// Replicas (1 on a single server, 3 on a cluster).
    pub replicas: usize,
    /// Whether messages may carry their own TTL (`Nats-TTL`).
    pub allow_msg_ttl: bool,
    /// Work-queue retention: a message is removed once acked.
    pub work_queue: bool,
    /// Most consumers on the stream (0: the server's default, which nats-server 2.15 sets to
    /// 1,000 per stream).
    pub max_consumers: i32,
    /// Republishes the headers of each stored message matching the first subject to the
    /// second (`<prefix>.>` to `<other prefix>.>`): a cheap signal, sent once the message is
    /// stored, that a consumer-less reader may listen to.
    pub republish_headers: Option<(String, String)>,
    /// Human description.
    pub description: String,
}

impl StreamSpec {
    /// A file-backed stream with no limits but those set afterwards.
    pub fn new(name: impl Into<String>, subjects: Vec<String>) -> Self {
        StreamSpec {
            name: name.into(),
            subjects,
            max_age: Duration::ZERO,
            max_bytes: -1,
            max_msgs_per_subject: -1,
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
            replicas: 1,
            allow_msg_ttl: false,
            work_queue: false,
            max_consumers: 0,
            republish_headers: None,
            description: String::new(),
        }
    }

    fn to_config(&self) -> stream::Config {
        stream::Config {
            name: self.name.clone(),
            subjects: self.subjects.clone(),
            max_age: self.max_age,
            max_bytes: self.max_bytes,
            max_messages_per_subject: self.max_msgs_per_subject,
            duplicate_window: self.duplicate_window,
            num_replicas: self.replicas.max(1),
            allow_message_ttl: self.allow_msg_ttl,
            retention: if self.work_queue {
                stream::RetentionPolicy::WorkQueue
            } else {
                stream::RetentionPolicy::Limits
            },
            storage: stream::StorageType::File,
            description: (!self.description.is_empty()).then(|| self.description.clone()),
            max_consumers: if self.max_consumers > 0 {
                self.max_consumers
            } else {
                -1
            },
            republish: self
                .republish_headers
                .as_ref()
                .map(|(source, destination)| stream::Republish {
                    source: source.clone(),
                    destination: destination.clone(),
                    headers_only: true,
                }),
            ..Default::default()
        }
    }
}

/// One message of [`JetStream::publish_batch`].
#[derive(Debug, Clone)]
pub struct BatchMessage {
    /// Subject.
    pub subject: String,
    /// `Nats-Msg-Id`, for the server's dedupe window.
    pub msg_id: Option<String>,
    /// Payload.
    pub payload: Bytes,
}

/// The server's answer to a JetStream publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubAck {
    /// The stream that stored it.
    pub stream: String,
    /// Its sequence in the stream.
    pub sequence: u64,
    /// Whether the server recognised the message id and dropped this copy.
    pub duplicate: bool,
}

/// A message read from a stream by sequence.
#[derive(Debug, Clone)]
pub struct StoredMessage {
    /// Subject it was published to.
    pub subject: String,
    /// Sequence in the stream.
    pub sequence: u64,
    /// Headers.
    pub headers: Headers,
    /// Payload.
    pub payload: Bytes,
    /// When the stream stored it, ms since the epoch.
    pub stored_ms: u64,
}

/// Message counts of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamState {
    /// Messages in the stream.
    pub messages: u64,
    /// First sequence.
    pub first_seq: u64,
    /// Last sequence.
    pub last_seq: u64,
}

/// Messages fetched per request of a [`JetStream::scan`].
const SCAN_BATCH: usize = 512;
/// A scan's consumer is removed after the scan; if the scanner dies first, the server removes
/// it after this long idle.
const SCAN_CONSUMER_IDLE: Duration = Duration::from_secs(30);

/// A JetStream handle on one connection.
#[derive(Debug, Clone)]
pub struct JetStream {
    ctx: jetstream::Context,
    timeout: Duration,
    /// The connection's state: a publish or a write in flight when it is lost ends soon after
    /// it is back instead of waiting out `timeout` for an answer that went with it.
    link: Link,
}

impl Broker {
    /// A JetStream handle. `timeout` bounds every JetStream API call and publish ack.
    pub fn jetstream(&self, timeout: Duration) -> JetStream {
        let mut ctx = match self.jetstream_domain() {
            Some(domain) => jetstream::with_domain(self.client.clone(), domain),
            None => jetstream::new(self.client.clone()),
        };
        ctx.set_timeout(timeout);
        JetStream {
            ctx,
            timeout,
            link: self.link(),
        }
    }
}

impl JetStream {
    /// Creates the stream, or updates its config to `spec`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for a bad name or a configuration the server refuses (a change
    /// the stream cannot take); [`ErrorKind::TimedOut`] when JetStream does not answer in time;
    /// [`ErrorKind::Broker`] when JetStream is unavailable or cannot reserve room for the stream.
    pub async fn ensure_stream(&self, spec: &StreamSpec) -> Result<()> {
        self.ctx
            .create_or_update_stream(spec.to_config())
            .await
            .map(|_| ())
            .map_err(|e| stream_err(spec, e))
    }

    /// Creates the stream as `spec` says if it does not exist; an existing stream is left as
    /// it is (its owner configured it).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for a bad name or a configuration the server refuses;
    /// [`ErrorKind::TimedOut`] when JetStream does not answer in time; [`ErrorKind::Broker`] when
    /// JetStream is unavailable or cannot reserve room for the stream.
    pub async fn ensure_stream_exists(&self, spec: &StreamSpec) -> Result<()> {
        match self.ctx.get_stream(&spec.name).await {
            Ok(_) => Ok(()),
            Err(_) => match self.ctx.create_stream(spec.to_config()).await {
                Ok(_) => Ok(()),
                // Created by someone else in the meantime (with another configuration: an
                // identical one is no error).
                Err(e)
                    if classify::jetstream_code(&e)
                        == Some(jetstream::ErrorCode::STREAM_NAME_EXIST) =>
                {
                    Ok(())
                }
                Err(e) => Err(stream_err(spec, e)),
            },
        }
    }

    /// Publishes and waits for the stream's ack. `msg_id` goes in `Nats-Msg-Id` (the server
    /// drops a repeat within the duplicate window); `ttl` in `Nats-TTL`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidSubject`] for a malformed subject or one with a wildcard;
    /// [`ErrorKind::NotFound`] when no stream captures it; [`ErrorKind::TooLarge`] over a size
    /// limit; [`ErrorKind::TimedOut`] when no ack comes in time.
    pub async fn publish(
        &self,
        subject: &str,
        headers: Option<Headers>,
        msg_id: Option<&str>,
        ttl: Option<Duration>,
        payload: Bytes,
    ) -> Result<PubAck> {
        crate::subject::validate_subject(subject, crate::Wildcards::Refuse)?;
        let mut publish = jetstream::message::PublishMessage::build().payload(payload);
        if let Some(h) = headers {
            publish = publish.headers(h.0);
        }
        if let Some(id) = msg_id {
            publish = publish.message_id(id);
        }
        if let Some(ttl) = ttl {
            publish = publish.ttl(ttl);
        }
        self.send_and_ack(subject, publish).await
    }

    /// Sends one built publish and waits for the stream's ack.
    pub(super) async fn send_and_ack(
        &self,
        subject: &str,
        publish: jetstream::message::PublishMessage,
    ) -> Result<PubAck> {
        let sent = self.link.sent();
        let ack = self
            .ctx
            .send_publish(subject.to_owned(), publish)
            .await
            .map_err(|e| js_err(&format!("publish to {subject} failed"), e))?;
        let ack = sent
            .answered(|| format!("no ack for publish to {subject}"), async {
                ack.await
                    .map_err(|e| js_err(&format!("no ack for publish to {subject}"), e))
            })
            .await?;
        Ok(PubAck {
            stream: ack.stream,
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        })
    }

    /// Publishes many messages with at most `max_in_flight` acks outstanding, and returns each
    /// one's ack (or error) in the order given. Memory stays bounded by `max_in_flight`: a
    /// publisher that outruns the server waits here.
    pub async fn publish_batch(
        &self,
        messages: Vec<BatchMessage>,
        max_in_flight: usize,
    ) -> Vec<Result<PubAck>> {
        use futures::stream::FuturesUnordered;
        let mut results: Vec<Option<Result<PubAck>>> = (0..messages.len()).map(|_| None).collect();
        let mut pending = FuturesUnordered::new();
        for (i, m) in messages.into_iter().enumerate() {
            while pending.len() >= max_in_flight.max(1) {
                if let Some((j, r)) = pending.next().await {
                    results[j] = Some(r);
                }
            }
            if let Err(e) = crate::subject::validate_subject(&m.subject, crate::Wildcards::Refuse) {
                results[i] = Some(Err(e));
                continue;
            }
            let mut publish = jetstream::message::PublishMessage::build().payload(m.payload);
            if let Some(id) = &m.msg_id {
                publish = publish.message_id(id);
            }
            let sent = self.link.sent();
            match self.ctx.send_publish(m.subject.clone(), publish).await {
                Ok(ack) => {
                    let subject = m.subject;
                    pending.push(async move {
                        let what = || format!("no ack for publish to {subject}");
                        let answer = async {
                            ack.await
                                .map(|a| PubAck {
                                    stream: a.stream,
                                    sequence: a.sequence,
                                    duplicate: a.duplicate,
                                })
                                .map_err(|e| js_err(&what(), e))
                        };
                        (i, sent.answered(what, answer).await)
                    });
                }
                Err(e) => {
                    results[i] = Some(Err(js_err(&format!("publish to {} failed", m.subject), e)))
                }
            }
        }
        while let Some((j, r)) = pending.next().await {
            results[j] = Some(r);
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(Error::new(ErrorKind::Broker, "publish not attempted")))
            })
            .collect()
    }

    async fn stream(&self, name: &str) -> Result<stream::Stream> {
        self.ctx
            .get_stream(name)
            .await
            .map_err(|e| js_err(&format!("stream {name}"), e))
    }

    /// Reads message `sequence` of stream `name`.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream or the message does not exist;
    /// [`ErrorKind::InvalidInput`] for an invalid stream name; [`ErrorKind::TimedOut`] when
    /// JetStream does not answer in time.
    pub async fn get_message(&self, name: &str, sequence: u64) -> Result<StoredMessage> {
        let stream = self.stream(name).await?;
        let raw = stream
            .get_raw_message(sequence)
            .await
            .map_err(|e| js_err(&format!("message {sequence} of {name}"), e))?;
        Ok(StoredMessage {
            subject: raw.subject.to_string(),
            sequence: raw.sequence,
            headers: Headers(raw.headers),
            payload: raw.payload,
            stored_ms: datetime_ms(&raw.time),
        })
    }

    /// Up to `max` messages of stream `name` on subjects matching `filter` (every subject when
    /// `None`), from sequence `start` on, oldest first: fetched in batches through one
    /// short-lived consumer (removed after), not a request per message, so listing a large
    /// stream stays quick.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist; [`ErrorKind::TimedOut`] when
    /// JetStream does not answer in time; [`ErrorKind::Broker`] when the scan's consumer cannot be
    /// created or read.
    pub async fn scan(
        &self,
        name: &str,
        filter: Option<&str>,
        start: u64,
        max: usize,
    ) -> Result<Vec<StoredMessage>> {
        let from = jetstream::consumer::DeliverPolicy::ByStartSequence {
            start_sequence: start.max(1),
        };
        self.scan_with(name, filter, from, max).await
    }

    /// As [`JetStream::scan`], from the first message stored at or after `since_ms` (ms since
    /// the epoch).
    ///
    /// # Errors
    /// As [`JetStream::scan`].
    pub async fn scan_since(
        &self,
        name: &str,
        filter: Option<&str>,
        since_ms: u64,
        max: usize,
    ) -> Result<Vec<StoredMessage>> {
        let nanos = i128::from(since_ms) * 1_000_000;
        let start_time = time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
        let from = jetstream::consumer::DeliverPolicy::ByStartTime { start_time };
        self.scan_with(name, filter, from, max).await
    }

    /// [`JetStream::scan`] from where `deliver_policy` says.
    async fn scan_with(
        &self,
        name: &str,
        filter: Option<&str>,
        deliver_policy: jetstream::consumer::DeliverPolicy,
        max: usize,
    ) -> Result<Vec<StoredMessage>> {
        use futures::StreamExt;
        let what = || format!("scan of {name}");
        let stream = self.stream(name).await?;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                filter_subject: filter.unwrap_or_default().to_owned(),
                deliver_policy,
                ack_policy: jetstream::consumer::AckPolicy::None,
                inactive_threshold: SCAN_CONSUMER_IDLE,
                memory_storage: true,
                ..Default::default()
            })
            .await
            .map_err(|e| js_err(&what(), e))?;
        let consumer_name = consumer.cached_info().name.clone();
        let result = async {
            let mut consumer = consumer;
            let matching = consumer
                .info()
                .await
                .map_err(|e| js_err(&what(), e))?
                .num_pending;
            let mut left = usize::try_from(matching).unwrap_or(usize::MAX).min(max);
            let mut out = Vec::with_capacity(left.min(4096));
            while left > 0 {
                let batch = left.min(SCAN_BATCH);
                let mut messages = consumer
                    .fetch()
                    .max_messages(batch)
                    .expires(self.timeout)
                    .messages()
                    .await
                    .map_err(|e| Error::with_source(ErrorKind::Broker, what(), e))?;
                let mut got = 0;
                while let Some(message) = messages.next().await {
                    let message = message.map_err(|e| classify::classified_boxed(what(), e))?;
                    let (sequence, stored_ms) = message
                        .info()
                        .map(|i| (i.stream_sequence, datetime_ms(&i.published)))
                        .map_err(|e| Error::new(ErrorKind::Broker, format!("{}: {e}", what())))?;
                    let message = message.split().0;
                    out.push(StoredMessage {
                        subject: message.subject.to_string(),
                        sequence,
                        headers: Headers(message.headers.unwrap_or_default()),
                        payload: message.payload,
                        stored_ms,
                    });
                    got += 1;
                }
                if got == 0 {
                    // Removed meanwhile (a purge, an age limit): the rest is gone too.
                    break;
                }
                left = left.saturating_sub(got);
            }
            Ok(out)
        }
        .await;
        let _ = stream.delete_consumer(&consumer_name).await;
        result
    }

    /// Deletes message `sequence` of stream `name`. Deleting one that is already gone is not
    /// an error (returns `false`).
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist (a message already gone is `false`);
    /// [`ErrorKind::TimedOut`] when JetStream does not answer in time; [`ErrorKind::Broker`] when
    /// the server fails the delete.
    pub async fn delete_message(&self, name: &str, sequence: u64) -> Result<bool> {
        let stream = self.stream(name).await?;
        let err = match stream.delete_message(sequence).await {
            Ok(deleted) => return Ok(deleted),
            Err(e) => e,
        };
        // The server reports a sequence it no longer holds as SEQUENCE_NOT_FOUND, but one whose
        // storage block is already gone as a failed delete (STREAM_MESSAGE_DELETE_FAILED, its
        // store error only in the text): then whether the message is still there decides.
        let delete_failed = classify::jetstream_code(&err)
            == Some(jetstream::ErrorCode::STREAM_MESSAGE_DELETE_FAILED);
        let err = js_err(&format!("delete {sequence} of {name}"), err);
        if err.kind() == ErrorKind::NotFound {
            return Ok(false);
        }
        if delete_failed
            && let Err(e) = stream.get_raw_message(sequence).await
            && classify::kind(&e) == ErrorKind::NotFound
        {
            return Ok(false);
        }
        Err(err)
    }

    /// Message counts of stream `name`.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist; [`ErrorKind::TimedOut`] when
    /// JetStream does not answer in time.
    pub async fn stream_state(&self, name: &str) -> Result<StreamState> {
        let mut stream = self.stream(name).await?;
        let info = stream
            .info()
            .await
            .map_err(|e| js_err(&format!("stream info {name}"), e))?;
        Ok(StreamState {
            messages: info.state.messages,
            first_seq: info.state.first_sequence,
            last_seq: info.state.last_sequence,
        })
    }

    /// Message counts per subject of stream `name`, for subjects matching `filter`.
    /// One request for a filter that matches few subjects.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist; [`ErrorKind::InvalidInput`] for an
    /// invalid stream name; [`ErrorKind::TimedOut`] when JetStream does not answer in time.
    pub async fn subject_counts(&self, name: &str, filter: &str) -> Result<Vec<(String, u64)>> {
        let mut subjects = self.subjects_matching(name, filter).await?;
        let mut out = Vec::new();
        while let Some(item) = subjects.next().await {
            let (subject, count) =
                item.map_err(|e| js_err(&format!("stream subjects {name}"), e))?;
            out.push((subject, count as u64));
        }
        Ok(out)
    }

    /// Whether stream `name` holds any message on a subject matching `filter`: one request
    /// (the stream's subject index answers it), where a consumer would take two and stay.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist; [`ErrorKind::InvalidInput`] for an
    /// invalid stream name; [`ErrorKind::TimedOut`] when JetStream does not answer in time.
    pub async fn has_messages(&self, name: &str, filter: &str) -> Result<bool> {
        match self.subjects_matching(name, filter).await?.next().await {
            Some(Ok((_, count))) => Ok(count > 0),
            Some(Err(e)) => Err(js_err(&format!("stream subjects {name}"), e)),
            None => Ok(false),
        }
    }

    /// The subjects of stream `name` matching `filter`, with their counts, as the server
    /// pages them (a stream info request, without the one a stream handle would make first).
    async fn subjects_matching(
        &self,
        name: &str,
        filter: &str,
    ) -> Result<stream::InfoWithSubjects> {
        let stream = self
            .ctx
            .get_stream_no_info(name)
            .await
            .map_err(|e| js_err(&format!("stream {name}"), e))?;
        stream
            .info_with_subjects(filter)
            .await
            .map_err(|e| js_err(&format!("stream subjects {name}"), e))
    }

    /// How many replicas stream `name` has, and on how many servers they are current (the leader
    /// included).
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist; [`ErrorKind::TimedOut`] when
    /// JetStream does not answer in time.
    pub async fn stream_replicas(&self, name: &str) -> Result<(usize, usize)> {
        let mut stream = self.stream(name).await?;
        let info = stream
            .info()
            .await
            .map_err(|e| js_err(&format!("stream info {name}"), e))?;
        let configured = info.config.num_replicas;
        let current = info.cluster.as_ref().map_or(1, |c| {
            usize::from(c.leader.is_some()) + c.replicas.iter().filter(|r| r.current).count()
        });
        Ok((configured, current))
    }

    /// The server name of stream `name`'s leader on a cluster: `None` on a single server, or
    /// while the replicas elect one.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist; [`ErrorKind::TimedOut`] when
    /// JetStream does not answer in time.
    pub async fn stream_leader(&self, name: &str) -> Result<Option<String>> {
        let mut stream = self.stream(name).await?;
        let info = stream
            .info()
            .await
            .map_err(|e| js_err(&format!("stream info {name}"), e))?;
        Ok(info.cluster.as_ref().and_then(|c| c.leader.clone()))
    }

    /// Asks stream `name`'s leader to step down, so that its replicas elect another (a
    /// different one is likely, not certain). Returns once the request is accepted, before the
    /// election.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the server refuses the step-down (for a missing stream too) or
    /// JetStream is unavailable; [`ErrorKind::TimedOut`] when JetStream does not answer in time.
    pub async fn stream_leader_stepdown(&self, name: &str) -> Result<()> {
        let subject = format!("STREAM.LEADER.STEPDOWN.{name}");
        let response: jetstream::response::Response<stream::DeleteStatus> = self
            .ctx
            .request(subject, &())
            .await
            .map_err(|e| js_err(&format!("leader stepdown of {name}"), e))?;
        match response {
            jetstream::response::Response::Ok(status) if status.success => Ok(()),
            jetstream::response::Response::Ok(_) => Err(Error::new(
                ErrorKind::Broker,
                format!("leader stepdown of {name} refused"),
            )),
            jetstream::response::Response::Err { error } => Err(Error::new(
                ErrorKind::Broker,
                format!("leader stepdown of {name} refused: {error}"),
            )),
        }
    }

    /// Removes every message of stream `name`; returns how many.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist; [`ErrorKind::TimedOut`] when
    /// JetStream does not answer in time; [`ErrorKind::Broker`] when the server fails the purge.
    pub async fn purge_stream(&self, name: &str) -> Result<u64> {
        let stream = self.stream(name).await?;
        stream
            .purge()
            .await
            .map(|r| r.purged)
            .map_err(|e| js_err(&format!("purge {name}"), e))
    }

    /// Creates the durable pull consumer on stream `name`, or updates it to `spec`.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist; [`ErrorKind::InvalidInput`] for an
    /// invalid name or configuration; [`ErrorKind::TimedOut`] when JetStream does not answer in
    /// time; [`ErrorKind::Broker`] when the stream has no room for another consumer.
    pub async fn ensure_consumer(&self, name: &str, spec: &ConsumerSpec) -> Result<Consumer> {
        let stream = self.stream(name).await?;
        let (filter_subject, filter_subjects) = match spec.filter_subjects.as_slice() {
            [one] => (one.clone(), Vec::new()),
            many => (String::new(), many.to_vec()),
        };
        let config = pull::Config {
            durable_name: Some(spec.durable.clone()),
            description: (!spec.description.is_empty()).then(|| spec.description.clone()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: spec.ack_wait,
            max_deliver: spec.max_deliver,
            max_ack_pending: spec.max_ack_pending,
            filter_subject,
            filter_subjects,
            inactive_threshold: spec.inactive_threshold,
            ..Default::default()
        };
        let consumer = match stream.create_consumer(config.clone()).await {
            Ok(c) => c,
            // It exists with another config: updated. It does not exist: the create's own
            // error is the one that says why.
            Err(created) => match stream.update_consumer(config).await {
                Ok(c) => c,
                Err(e) => {
                    let context = format!("consumer {} on {name}", spec.durable);
                    let updated = js_err(&context, e);
                    return Err(if updated.kind() == ErrorKind::NotFound {
                        js_err(&context, created)
                    } else {
                        updated
                    });
                }
            },
        };
        Ok(Consumer {
            inner: consumer,
            link: self.link.clone(),
        })
    }

    /// Counts of consumer `durable` on stream `name`.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream or the consumer does not exist;
    /// [`ErrorKind::TimedOut`] when JetStream does not answer in time.
    pub async fn consumer_state(&self, name: &str, durable: &str) -> Result<ConsumerState> {
        let stream = self.stream(name).await?;
        let info = stream
            .consumer_info(durable)
            .await
            .map_err(|e| js_err(&format!("consumer {durable} on {name}"), e))?;
        Ok(ConsumerState {
            pending: info.num_pending,
            ack_pending: info.num_ack_pending,
            redelivered: info.num_redelivered,
        })
    }

    /// Deletes consumer `durable` of stream `name`.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream or the consumer does not exist;
    /// [`ErrorKind::TimedOut`] when JetStream does not answer in time.
    pub async fn delete_consumer(&self, name: &str, durable: &str) -> Result<()> {
        let stream = self.stream(name).await?;
        stream
            .delete_consumer(durable)
            .await
            .map(|_| ())
            .map_err(|e| js_err(&format!("delete consumer {durable} on {name}"), e))
    }

    /// Opens an existing key-value bucket ([`ErrorKind::NotFound`] if there is none).
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when there is no such bucket; [`ErrorKind::InvalidInput`] for an
    /// invalid bucket name; [`ErrorKind::TimedOut`] when JetStream does not answer in time.
    pub async fn open_kv(&self, bucket: &str) -> Result<Kv> {
        let store = self
            .ctx
            .get_key_value(bucket)
            .await
            .map_err(|e| js_err(&format!("key-value bucket {bucket}"), e))?;
        Ok(Kv {
            store,
            ctx: self.ctx.clone(),
            link: self.link.clone(),
        })
    }

    /// Creates the key-value bucket or updates it to `spec`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for an invalid bucket name or a history over 64;
    /// [`ErrorKind::TimedOut`] when JetStream does not answer in time; [`ErrorKind::Broker`] when
    /// JetStream is unavailable or has no room for the bucket.
    pub async fn ensure_kv(&self, spec: &KvSpec) -> Result<Kv> {
        let store = self
            .ctx
            .create_or_update_key_value(kv_config(spec))
            .await
            .map_err(|e| js_err(&format!("key-value bucket {}", spec.bucket), e))?;
        Ok(Kv {
            store,
            ctx: self.ctx.clone(),
            link: self.link.clone(),
        })
    }

    /// Opens the key-value bucket `spec` names, creating it as `spec` says when it is missing,
    /// without reshaping one that exists: a bucket shared by many agents is its first maker's
    /// (or the operator's), and credentials that may create it need not update it. One that
    /// keeps entries for less than `spec.max_age` is kept as it is, with a warning naming
    /// both ages.
    ///
    /// # Errors
    /// As [`JetStream::ensure_kv`].
    pub async fn ensure_kv_exists(&self, spec: &KvSpec) -> Result<Kv> {
        let what = format!("key-value bucket {}", spec.bucket);
        let opened = match self.ctx.get_key_value(&spec.bucket).await {
            Ok(store) => store,
            Err(e) => {
                let err = js_err(&what, e);
                if err.kind() != ErrorKind::NotFound {
                    return Err(err);
                }
                // A create only (an update first would need the right to update); one made
                // by another client meanwhile is opened.
                match self.ctx.create_key_value(kv_config(spec)).await {
                    Ok(store) => store,
                    Err(created) => self
                        .ctx
                        .get_key_value(&spec.bucket)
                        .await
                        .map_err(|_| js_err(&what, created))?,
                }
            }
        };
        let kept = opened
            .status()
            .await
            .map(|s| s.max_age())
            .unwrap_or_default();
        if !kept.is_zero() && kept < spec.max_age {
            tracing::warn!(
                bucket = %spec.bucket,
                kept_secs = kept.as_secs_f64(),
                wanted_secs = spec.max_age.as_secs_f64(),
                "key-value bucket keeps entries for less than this client needs; it is left as it is (its maker's or the operator's to raise)"
            );
        }
        Ok(Kv {
            store: opened,
            ctx: self.ctx.clone(),
            link: self.link.clone(),
        })
    }

    /// Opens an existing object store bucket ([`ErrorKind::NotFound`] if there is none).
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when there is no such bucket; [`ErrorKind::InvalidInput`] for an
    /// invalid bucket name; [`ErrorKind::TimedOut`] when JetStream does not answer in time.
    pub async fn open_objects(&self, bucket: &str) -> Result<Objects> {
        let store = self
            .ctx
            .get_object_store(bucket)
            .await
            .map_err(|e| js_err(&format!("object store bucket {bucket}"), e))?;
        Ok(Objects { store })
    }

    /// Creates the object store bucket as `spec` says if it does not exist; an existing one
    /// is opened as it is.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for an invalid bucket name; [`ErrorKind::TimedOut`] when
    /// JetStream does not answer in time; [`ErrorKind::Broker`] when JetStream is unavailable or
    /// has no room for the bucket.
    pub async fn ensure_objects(&self, spec: &ObjectSpec) -> Result<Objects> {
        if let Ok(objects) = self.open_objects(&spec.bucket).await {
            return Ok(objects);
        }
        let config = object_store::Config {
            bucket: spec.bucket.clone(),
            description: Some(spec.description.clone()).filter(|d| !d.is_empty()),
            max_age: spec.max_age,
            max_bytes: spec.max_bytes,
            storage: stream::StorageType::File,
            num_replicas: spec.replicas.max(1),
            ..Default::default()
        };
        match self.ctx.create_object_store(config).await {
            Ok(store) => Ok(Objects { store }),
            // Created by someone else in the meantime.
            Err(e) => self
                .open_objects(&spec.bucket)
                .await
                .map_err(|_| js_err(&format!("object store bucket {}", spec.bucket), e)),
        }
    }
}

/// The configuration of the key-value bucket `spec` describes.
fn kv_config(spec: &KvSpec) -> kv::Config {
    kv::Config {
        bucket: spec.bucket.clone(),
        history: spec.history,
        max_age: spec.max_age,
        num_replicas: spec.replicas.max(1),
        description: spec.description.clone(),
        storage: stream::StorageType::File,
        limit_markers: spec.per_key_ttl.then_some(Duration::from_secs(1)),
        ..Default::default()
    }
}

/// Milliseconds since the epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
