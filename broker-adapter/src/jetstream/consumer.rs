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
use crate::events::Link;
use crate::{ConnectionEvent, Error, ErrorKind, Headers, Result};

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
    pub(super) link: Link,
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
            renew_failures: 0,
            reconnects: None,
            draining: false,
            link: self.link.clone(),
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

/// How long a failed renewal of a pull waits before the first try again (the server away, or
/// JetStream not answering yet: no responders); each further failure in a row waits twice as
/// long, up to [`RENEW_RETRY_MAX`].
const RENEW_RETRY_DELAY: Duration = Duration::from_millis(100);
/// The longest wait between two renewals of a pull that keep failing: one subscription and one
/// request a second per stream while JetStream is away.
const RENEW_RETRY_MAX: Duration = Duration::from_secs(1);

/// The wait before renewal number `failures` (1-based) of a pull that failed that many times
/// in a row.
fn renew_delay(failures: u32) -> Duration {
    RENEW_RETRY_DELAY
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(RENEW_RETRY_MAX)
}

/// The connection events that may have cost a pull its request: each reconnect (the server
/// that held the pull may be a new process, or another node), and events missed (a lagging
/// receiver cannot tell). Ends when the connection's events end.
type Reconnects = Pin<Box<dyn Stream<Item = ()> + Send>>;

fn reconnects(events: tokio::sync::broadcast::Receiver<ConnectionEvent>) -> Reconnects {
    use tokio::sync::broadcast::error::RecvError;
    Box::pin(futures::stream::unfold(events, |mut events| async move {
        loop {
            match events.recv().await {
                Ok(ConnectionEvent::Reconnected) | Err(RecvError::Lagged(_)) => {
                    return Some(((), events));
                }
                Ok(_) => {}
                Err(RecvError::Closed) => return None,
            }
        }
    }))
}

/// The stream of deliveries of a [`Consumer`]. Errors of the pull protocol are yielded and the
/// stream goes on. The pull is renewed (a new pull request on a new inbox) at once when it may
/// have been lost:
///
/// - a missed heartbeat (the consumer's leader moved, or the server went away while the
///   connection lived): a failover stalls deliveries for about two heartbeats, not the pull's
///   expiry;
/// - with [`renew_on_reconnect`](Deliveries::renew_on_reconnect), the connection coming back:
///   a restarted server has forgotten every pull request, and waiting for the heartbeats to be
///   missed would stall deliveries for up to two of them (10 s) after the server is back;
/// - no responders to the pull (JetStream not answering yet, a consumer without a leader).
///
/// A renewal that fails is tried again after 100 ms, then twice as long each time up to 1 s,
/// until it works or the stream is dropped.
pub struct Deliveries {
    inner: Option<pull::Stream>,
    consumer: jetstream::consumer::Consumer<pull::Config>,
    batch: usize,
    renewing: Option<Pin<Box<dyn std::future::Future<Output = PullStream> + Send>>>,
    /// Renewals that failed in a row (no responders counts as one): sets the next wait.
    renew_failures: u32,
    /// Reconnects of the connection, when the stream renews on them.
    reconnects: Option<Reconnects>,
    /// A reconnect was seen: what the old pull had already received is handed out first,
    /// then it is renewed.
    draining: bool,
    /// The connection, handed to each delivery for its confirmed ack.
    link: Link,
}

impl Deliveries {
    /// Renews the pull whenever the connection `events` come from reconnects (pass
    /// [`Broker::events`](crate::Broker::events) of the connection the consumer's JetStream
    /// handle uses). Deliveries the old pull had received before are handed out first; its
    /// request is then dropped and a new one sent, so deliveries resume as soon as the
    /// server answers again.
    pub fn renew_on_reconnect(
        mut self,
        events: tokio::sync::broadcast::Receiver<ConnectionEvent>,
    ) -> Self {
        self.reconnects = Some(reconnects(events));
        self
    }

    /// Drops the current pull and starts a new one after `delay` (none: at once).
    fn renew(&mut self, delay: Option<Duration>) {
        self.inner = None;
        self.draining = false;
        let (consumer, batch) = (self.consumer.clone(), self.batch);
        self.renewing = Some(match delay {
            None => Box::pin(open_pull(consumer, batch)),
            Some(delay) => Box::pin(async move {
                tokio::time::sleep(delay).await;
                open_pull(consumer, batch).await
            }),
        });
    }

    /// Whether a reconnect was seen since the last poll (all of them taken).
    fn poll_reconnected(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(events) = self.reconnects.as_mut() else {
            return false;
        };
        let mut seen = false;
        loop {
            match events.as_mut().poll_next(cx) {
                Poll::Ready(Some(())) => seen = true,
                Poll::Ready(None) => {
                    self.reconnects = None;
                    return seen;
                }
                Poll::Pending => return seen,
            }
        }
    }
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
        if this.poll_reconnected(cx) {
            if this.inner.is_some() {
                this.draining = true;
            } else {
                // Renewing already (perhaps waiting out a failure): start over at once.
                this.renew_failures = 0;
                this.renew(None);
            }
        }
        if let Some(renewing) = &mut this.renewing {
            match renewing.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(stream)) => {
                    this.inner = Some(stream);
                    this.renewing = None;
                }
                Poll::Ready(Err(e)) => {
                    this.renew_failures = this.renew_failures.saturating_add(1);
                    // The wait starts at the next poll, which follows the error.
                    this.renew(Some(renew_delay(this.renew_failures)));
                    return Poll::Ready(Some(Err(js_err("consumer pull renewal", e))));
                }
            }
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match inner.poll_next_unpin(cx) {
            Poll::Ready(Some(Err(e))) => {
                match e.kind() {
                    pull::MessagesErrorKind::MissingHeartbeat => {
                        this.renew_failures = 0;
                        this.renew(None);
                    }
                    pull::MessagesErrorKind::NoResponders => {
                        this.renew_failures = this.renew_failures.saturating_add(1);
                        this.renew(Some(renew_delay(this.renew_failures)));
                    }
                    _ => {}
                }
                // A renewal starts at the next poll, which follows the error.
                Poll::Ready(Some(Err(js_err("consumer delivery", e))))
            }
            Poll::Ready(Some(Ok(message))) => {
                this.renew_failures = 0;
                Poll::Ready(Some(Ok(Delivery::new(message, this.link.clone()))))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                if this.draining {
                    // Everything the old pull had received is handed out: renewed now, and
                    // polled again at once to start it.
                    this.renew(None);
                    cx.waker().wake_by_ref();
                }
                Poll::Pending
            }
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
    link: Link,
}

impl Delivery {
    fn new(message: jetstream::Message, link: Link) -> Self {
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
            link,
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
        self.link
            .answered(|| "double ack failed".to_owned(), async {
                self.message
                    .double_ack()
                    .await
                    .map_err(|e| classify::classified_boxed("double ack failed", e))
            })
            .await
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_renewal_waits_longer_each_time_up_to_a_second() {
        let waits: Vec<u128> = (1..=6).map(|n| renew_delay(n).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(renew_delay(u32::MAX), RENEW_RETRY_MAX);
        assert_eq!(renew_delay(0), RENEW_RETRY_DELAY);
    }
}
