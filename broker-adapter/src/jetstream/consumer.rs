//! Durable pull consumers: what one should look like, its counts, and its deliveries with
//! explicit acks.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use bytes::Bytes;
use futures::{Stream, StreamExt};

use super::{DEFAULT_ACK_WAIT, DEFAULT_MAX_ACK_PENDING, PULL_EXPIRES, PULL_HEARTBEAT};
use crate::classify::{self, classified as js_err};
use crate::{Error, ErrorKind, Headers, Result};

/// What a durable pull consumer should look like.
#[derive(Debug, Clone)]
pub struct ConsumerSpec {
    /// Durable name: the consumer survives restarts of its clients and the server.
    pub durable: String,
    /// Only messages on these subjects (empty: all of the stream).
    pub filter_subjects: Vec<String>,
    /// Redeliver a message not acked within this time.
    pub ack_wait: Duration,
    /// Deliveries before the server gives up on a message (-1: unlimited).
    pub max_deliver: i64,
    /// Unacknowledged messages outstanding at once.
    pub max_ack_pending: i64,
    /// The server removes the consumer once no client has pulled from it for this long
    /// (zero: never), so one whose clients are gone does not stay.
    pub inactive_threshold: Duration,
    /// Description.
    pub description: String,
}

impl ConsumerSpec {
    /// A consumer with NATS's usual defaults (30 s ack wait, unlimited deliveries).
    pub fn new(durable: impl Into<String>) -> Self {
        ConsumerSpec {
            durable: durable.into(),
            filter_subjects: Vec::new(),
            ack_wait: DEFAULT_ACK_WAIT,
            max_deliver: -1,
            max_ack_pending: DEFAULT_MAX_ACK_PENDING,
            inactive_threshold: Duration::ZERO,
            description: String::new(),
        }
    }
}

/// Counts of a consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerState {
    /// Messages not yet delivered.
    pub pending: u64,
    /// Delivered and not acked.
    pub ack_pending: usize,
    /// Redelivered at least once and not yet acked.
    pub redelivered: usize,
}

pub(super) fn datetime_ms(t: &time::OffsetDateTime) -> u64 {
    u64::try_from(t.unix_timestamp_nanos() / 1_000_000).unwrap_or(0)
}

/// A durable pull consumer.
#[derive(Debug, Clone)]
pub struct Consumer {
    pub(super) inner: jetstream::consumer::Consumer<pull::Config>,
}

impl Consumer {
    /// Messages as they become available, fetched in batches of up to `batch` (at most
    /// `batch` unacked messages are buffered here, which bounds memory).
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the pull cannot start (the connection is closed). Errors of the
    /// pulls after that come as items of the [`Deliveries`].
    pub async fn messages(&self, batch: usize) -> Result<Deliveries> {
        let batch = batch.max(1);
        let stream = open_pull(self.inner.clone(), batch)
            .await
            .map_err(|e| js_err("consumer messages", e))?;
        Ok(Deliveries {
            inner: Some(stream),
            consumer: self.inner.clone(),
            batch,
            renewing: None,
        })
    }
}

type PullStream = std::result::Result<pull::Stream, jetstream::consumer::StreamError>;

async fn open_pull(
    consumer: jetstream::consumer::Consumer<pull::Config>,
    batch: usize,
) -> PullStream {
    consumer
        .stream()
        .max_messages_per_batch(batch)
        .heartbeat(PULL_HEARTBEAT)
        .expires(PULL_EXPIRES)
        .messages()
        .await
}

/// How long a failed renewal of a pull waits before the next try (the server away).
const RENEW_RETRY_DELAY: Duration = Duration::from_secs(1);

/// The stream of deliveries of a [`Consumer`]. Errors of the pull protocol are yielded and the
/// stream goes on. A missed heartbeat (the consumer's leader moved, or the server went away
/// while the connection lived) renews the pull at once, rather than waiting for the old pull
/// request to expire: a failover stalls deliveries for about two heartbeats, not the pull's
/// expiry. Renewal is retried every second until it works or the stream is dropped.
pub struct Deliveries {
    inner: Option<pull::Stream>,
    consumer: jetstream::consumer::Consumer<pull::Config>,
    batch: usize,
    renewing: Option<Pin<Box<dyn std::future::Future<Output = PullStream> + Send>>>,
}

impl std::fmt::Debug for Deliveries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Deliveries")
    }
}

impl Stream for Deliveries {
    type Item = Result<Delivery>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(renewing) = &mut this.renewing {
            match renewing.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(stream)) => {
                    this.inner = Some(stream);
                    this.renewing = None;
                }
                Poll::Ready(Err(e)) => {
                    let (consumer, batch) = (this.consumer.clone(), this.batch);
                    this.renewing = Some(Box::pin(async move {
                        tokio::time::sleep(RENEW_RETRY_DELAY).await;
                        open_pull(consumer, batch).await
                    }));
                    return Poll::Ready(Some(Err(js_err("consumer pull renewal", e))));
                }
            }
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match inner.poll_next_unpin(cx) {
            Poll::Ready(Some(Err(e))) => {
                if e.kind() == pull::MessagesErrorKind::MissingHeartbeat {
                    this.inner = None;
                    this.renewing = Some(Box::pin(open_pull(this.consumer.clone(), this.batch)));
                }
                Poll::Ready(Some(Err(js_err("consumer delivery", e))))
            }
            Poll::Ready(Some(Ok(message))) => Poll::Ready(Some(Ok(Delivery::new(message)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// One delivery of a stored message to a consumer.
#[derive(Debug)]
pub struct Delivery {
    message: jetstream::Message,
    stream_seq: u64,
    delivered: u64,
    published_ms: u64,
}

impl Delivery {
    fn new(message: jetstream::Message) -> Self {
        let (stream_seq, delivered, published_ms) = message
            .info()
            .map(|i| {
                (
                    i.stream_sequence,
                    u64::try_from(i.delivered).unwrap_or(1),
                    datetime_ms(&i.published),
                )
            })
            .unwrap_or((0, 1, 0));
        Delivery {
            message,
            stream_seq,
            delivered,
            published_ms,
        }
    }

    /// Subject it was published to.
    pub fn subject(&self) -> &str {
        self.message.subject.as_str()
    }

    /// The subject, shared with the delivery (no copy).
    pub fn shared_subject(&self) -> async_nats::Subject {
        self.message.subject.clone()
    }

    /// Payload.
    pub fn payload(&self) -> &Bytes {
        &self.message.payload
    }

    /// A header, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.message
            .headers
            .as_ref()
            .and_then(|h| h.get_last(name))
            .map(|v| v.as_str())
    }

    /// Every header it carries (empty if none).
    pub fn headers(&self) -> Headers {
        self.message
            .headers
            .clone()
            .map(Headers)
            .unwrap_or_default()
    }

    /// Sequence in the stream.
    pub fn stream_seq(&self) -> u64 {
        self.stream_seq
    }

    /// Which delivery this is: 1 the first time, 2 on the first redelivery, ...
    /// This count, kept by the server, is the only attempt counter in Chorus.
    pub fn delivered(&self) -> u64 {
        self.delivered
    }

    /// When the stream stored the message, ms since the epoch.
    pub fn published_ms(&self) -> u64 {
        self.published_ms
    }

    /// Done: the server forgets it for this consumer.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the ack cannot be sent (the connection is closed).
    pub async fn ack(&self) -> Result<()> {
        self.ack_with(jetstream::AckKind::Ack).await
    }

    /// Acks and waits for the server to confirm it recorded the ack.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the ack cannot be sent, or the server does not confirm it within
    /// the JetStream handle's timeout.
    pub async fn double_ack(&self) -> Result<()> {
        self.message
            .double_ack()
            .await
            .map_err(|e| classify::classified_boxed("double ack failed", e))
    }

    /// Not done: redeliver after `delay` (immediately if `None`).
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the nak cannot be sent (the connection is closed).
    pub async fn nak(&self, delay: Option<Duration>) -> Result<()> {
        self.ack_with(jetstream::AckKind::Nak(delay)).await
    }

    /// Still working: extend the ack deadline by another ack wait.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the progress cannot be sent (the connection is closed).
    pub async fn in_progress(&self) -> Result<()> {
        self.ack_with(jetstream::AckKind::Progress).await
    }

    /// Never redeliver. The server emits a terminated advisory carrying `reason`, which is
    /// how the dead-letter queue learns why.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the delivery has no ack subject or the connection is closed.
    pub async fn term(&self, reason: &str) -> Result<()> {
        let Some(reply) = self.message.reply.clone() else {
            return Err(Error::new(ErrorKind::Broker, "delivery has no ack subject"));
        };
        let reason: String = reason
            .chars()
            .filter(|c| !c.is_control())
            .take(200)
            .collect();
        // The message's own connection (the context every delivery carries), so that no
        // client handle is cloned per delivery for this rare case.
        self.message
            .context
            .client()
            .publish(reply, Bytes::from(format!("+TERM {reason}")))
            .await
            .map_err(|e| classify::classified("term failed", e))
    }

    async fn ack_with(&self, kind: jetstream::AckKind) -> Result<()> {
        self.message
            .ack_with(kind)
            .await
            .map_err(|e| classify::classified_boxed("ack failed", e))
    }
}
