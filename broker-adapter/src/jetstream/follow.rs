//! Reading one subject's history and writing to it only when nobody else did: what a record
//! kept as a sequence of messages (a task) needs from a stream.
//!
//! - [`JetStream::publish_if_last`]: optimistic concurrency per subject. The write lands only if
//!   the subject's last stored sequence is still the one the writer read (0: nothing yet);
//!   otherwise it fails with [`ErrorKind::Conflict`] and the writer reads again.
//! - [`JetStream::last_on_subject`]: the newest message on one subject.
//! - [`JetStream::follow`]: every message on matching subjects after a sequence, in stream
//!   order, then each new one as it is stored (an ordered consumer: it recreates itself after a
//!   gap or a reconnect, so nothing is skipped and nothing repeats).
//! - [`JetStream::last_per_subject`]: the newest message of each matching subject, for
//!   listings.

use crate::Report;
use std::pin::Pin;
use std::task::{Context, Poll};

use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull};
use bytes::Bytes;

use super::consumer::datetime_ms;
use super::{JetStream, PubAck, StoredMessage, js_err};
use crate::{Error, ErrorKind, Headers, Result};

impl JetStream {
    /// Publishes `payload` to `subject` only if the newest message the stream holds on that
    /// subject has sequence `last_subject_seq` (0: the subject has none yet), and waits for the
    /// ack. A write that lost the race fails with [`ErrorKind::Conflict`]. `msg_id` goes in
    /// `Nats-Msg-Id` (a retried write is then stored once).
    ///
    /// # Errors
    /// [`ErrorKind::Conflict`] when another write came first: read the subject again. The others as
    /// [`publish`](JetStream::publish) says.
    pub async fn publish_if_last(
        &self,
        subject: &str,
        msg_id: Option<&str>,
        last_subject_seq: u64,
        payload: Bytes,
    ) -> Result<PubAck> {
        crate::subject::validate_subject(subject, crate::Wildcards::Refuse)?;
        let mut publish = jetstream::message::PublishMessage::build()
            .payload(payload)
            .expected_last_subject_sequence(last_subject_seq);
        if let Some(id) = msg_id {
            publish = publish.message_id(id);
        }
        self.send_and_ack(subject, publish).await
    }

    /// A handle on stream `name` without asking the server for its info (one round trip
    /// fewer per call; a stream that does not exist fails the call made with it).
    async fn handle(&self, name: &str) -> Result<async_nats::jetstream::stream::Stream<()>> {
        self.ctx
            .get_stream_no_info(name)
            .await
            .map_err(|e| js_err(&format!("stream {name}"), e))
    }

    /// The newest message stream `name` holds on `subject` (or `None`: none, or no such
    /// stream).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for an invalid stream name; [`ErrorKind::InvalidSubject`] for a
    /// malformed subject; [`ErrorKind::TimedOut`] when JetStream does not answer in time.
    pub async fn last_on_subject(
        &self,
        name: &str,
        subject: &str,
    ) -> Result<Option<StoredMessage>> {
        let stream = self.handle(name).await?;
        match stream.get_last_raw_message_by_subject(subject).await {
            Ok(raw) => Ok(Some(StoredMessage {
                subject: raw.subject.to_string(),
                sequence: raw.sequence,
                headers: Headers(raw.headers),
                payload: raw.payload,
                stored_ms: datetime_ms(&raw.time),
            })),
            Err(e) => {
                let err = js_err(&format!("last message on {subject} in {name}"), e);
                if err.kind() == ErrorKind::NotFound {
                    Ok(None)
                } else {
                    Err(err)
                }
            }
        }
    }

    /// Every message of stream `name` on subjects matching one of `filters` with a sequence
    /// above `after`, oldest first, then each new one as it is stored, until the returned
    /// stream is dropped. Backed by an ordered consumer that lives only in memory on the
    /// server and goes away with the reader.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist; [`ErrorKind::InvalidInput`] for an
    /// invalid stream name; [`ErrorKind::TimedOut`] when JetStream does not answer in time. Errors
    /// after that come as items of the [`Follow`].
    pub async fn follow(&self, name: &str, filters: &[String], after: u64) -> Result<Follow> {
        let what = || format!("follow {} in {name}", filters.join(", "));
        let stream = self.handle(name).await?;
        let consumer_name = format!("follow_{}", nuid::next());
        let (filter_subject, filter_subjects) = match filters {
            [one] => (one.clone(), Vec::new()),
            many => (String::new(), many.to_vec()),
        };
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                name: Some(consumer_name.clone()),
                filter_subject,
                filter_subjects,
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: after.saturating_add(1),
                },
                ..Default::default()
            })
            .await
            .map_err(|e| js_err(&what(), e))?;
        let messages = consumer.messages().await.map_err(|e| js_err(&what(), e))?;
        Ok(Follow {
            inner: Box::pin(messages),
            stream,
            name: consumer_name,
        })
    }

    /// The newest message of each subject matching `filter` in stream `name` (at most `max`),
    /// in stream order.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the stream does not exist; [`ErrorKind::TimedOut`] when
    /// JetStream does not answer in time; [`ErrorKind::Broker`] when the scan's consumer cannot be
    /// created or read.
    pub async fn last_per_subject(
        &self,
        name: &str,
        filter: &str,
        max: usize,
    ) -> Result<Vec<StoredMessage>> {
        self.scan_with(name, Some(filter), DeliverPolicy::LastPerSubject, max)
            .await
    }
}

/// What [`JetStream::follow`] returns: a stream of stored messages in stream order. Its
/// consumer lives on the server until [`Follow::close`], or for 30 s after the last read.
pub struct Follow {
    inner: Pin<Box<pull::Ordered>>,
    stream: async_nats::jetstream::stream::Stream<()>,
    name: String,
}

impl Follow {
    /// Stops reading and removes the consumer from the server at once (a reader that follows
    /// many short histories does not leave a consumer behind for each).
    pub async fn close(self) {
        drop(self.inner);
        if let Err(err) = self.stream.delete_consumer(&self.name).await {
            tracing::debug!(consumer = %self.name, error = %Report(&err), "follow consumer not removed");
        }
    }
}

impl std::fmt::Debug for Follow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Follow")
    }
}

impl futures::Stream for Follow {
    type Item = Result<StoredMessage>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(Ok(message))) => {
                let info = message
                    .info()
                    .map(|i| (i.stream_sequence, datetime_ms(&i.published)))
                    .map_err(|e| Error::new(ErrorKind::Broker, format!("follow: {e}")));
                let (sequence, stored_ms) = match info {
                    Ok(info) => info,
                    Err(e) => return Poll::Ready(Some(Err(e))),
                };
                let message = message.split().0;
                Poll::Ready(Some(Ok(StoredMessage {
                    subject: message.subject.to_string(),
                    sequence,
                    headers: Headers(message.headers.unwrap_or_default()),
                    payload: message.payload,
                    stored_ms,
                })))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(js_err("follow", e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}
