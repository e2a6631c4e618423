//! Events as a stream ([`EventStream`]), read straight off a subscription through the
//! pipeline's admission and layers (no handler: the stream's reader is the handler). An event
//! whose payload came by reference is fetched before it is handed out, as for a handler.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use chorus_broker_adapter::{Message, Subscription};
use futures::Stream;
use serde::de::DeserializeOwned;

use super::pipeline::{Checked, Pipeline};
use crate::protocol::codec::{CodecError, decode_payload};
use crate::protocol::envelope::Envelope;
use crate::sequence::Gaps;
use crate::stats::AgentCounters;

/// An event received by an [`EventStream`].
#[derive(Debug, Clone)]
pub struct Event {
    /// The event's envelope.
    pub envelope: Envelope,
}

impl Event {
    /// The topic it was published on.
    pub fn topic(&self) -> &str {
        self.envelope.topic.as_deref().unwrap_or_default()
    }

    /// The payload decoded by its content type.
    ///
    /// # Errors
    /// [`CodecError`] when the content type is not MessagePack or JSON, or the payload does not
    /// decode as `T`.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, CodecError> {
        decode_payload(&self.envelope.payload, &self.envelope.content_type)
    }
}

/// Most events an [`EventStream`] takes off its subscription at once, so that their
/// signatures are checked together.
const VERIFY_BATCH: usize = 64;

/// A stream of events from [`Agent::subscribe`](crate::Agent::subscribe), read straight off
/// its subscription. Events wait in the subscription's bounded buffer (64k by default); when
/// the reader of the stream falls that far behind, new events are dropped by the client and
/// counted exactly in [`AgentStats::dropped`](crate::AgentStats::dropped). Messages that are
/// not valid events, or have expired or looped, are counted and skipped. When the agent
/// verifies signatures, the events already waiting (up to 64) are verified together, which
/// costs about half as much per signature as one by one. An event whose payload came by
/// reference is fetched from the object store (its size and digest checked) before it is
/// handed out, the events after it waiting their turn; one whose object is gone, too large or
/// damaged is counted and skipped.
pub struct EventStream {
    sub: Subscription,
    pipeline: Arc<Pipeline>,
    /// Checked events not yet handed out, with their subject when their payload is still to
    /// be fetched.
    ready: VecDeque<Checked>,
    /// The fetch of the payload of the event to hand out next, when it came by reference.
    fetching: Option<Fetch>,
    /// Sequence gaps, checked as events arrive.
    gaps: Gaps,
}

/// The fetch of an event's payload: the event opened, or `None` when it was refused.
type Fetch = Pin<Box<dyn Future<Output = Option<Envelope>> + Send>>;

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventStream")
    }
}

impl EventStream {
    pub(crate) fn new(sub: Subscription, pipeline: Arc<Pipeline>) -> Self {
        EventStream {
            sub,
            pipeline,
            ready: VecDeque::new(),
            fetching: None,
            gaps: Gaps::default(),
        }
    }

    /// The next message off the subscription that is admitted, counting each received and
    /// skipping the refused.
    fn poll_admitted(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<(Message, Envelope)>> {
        loop {
            match Pin::new(&mut self.sub).poll_next(cx) {
                Poll::Ready(Some(msg)) => {
                    AgentCounters::bump(&self.pipeline.counters().received);
                    let missed = self.gaps.observe(msg.subject(), msg.payload());
                    if missed > 0 {
                        self.pipeline
                            .counters()
                            .lost
                            .fetch_add(missed, std::sync::atomic::Ordering::Relaxed);
                    }
                    if let Ok((envelope, _)) = self.pipeline.admit(msg.subject(), msg.payload()) {
                        return Poll::Ready(Some((msg, envelope)));
                    }
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl EventStream {
    /// The next event that passed the layers, opened unless its payload is still to be
    /// fetched (then with its subject).
    fn poll_checked(&mut self, cx: &mut std::task::Context<'_>) -> Poll<Option<Checked>> {
        if !self.pipeline.verifies() {
            // Nothing to batch: each event goes through the layers as it is admitted.
            loop {
                let Some((msg, envelope)) = std::task::ready!(self.poll_admitted(cx)) else {
                    return Poll::Ready(None);
                };
                if let Some(checked) = self.pipeline.check(msg.subject(), envelope) {
                    return Poll::Ready(Some(checked));
                }
            }
        }
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Poll::Ready(Some(event));
            }
            // Take what has already arrived, never waiting for more: a burst is checked as a
            // batch, a lone event alone.
            let mut batch = Vec::new();
            let mut ended = false;
            while batch.len() < VERIFY_BATCH {
                match self.poll_admitted(cx) {
                    Poll::Ready(Some(admitted)) => batch.push(admitted),
                    Poll::Ready(None) => {
                        ended = true;
                        break;
                    }
                    Poll::Pending => break,
                }
            }
            if batch.is_empty() {
                return if ended {
                    Poll::Ready(None)
                } else {
                    Poll::Pending
                };
            }
            let (messages, envelopes): (Vec<Message>, Vec<Envelope>) = batch.into_iter().unzip();
            let items = messages
                .iter()
                .map(Message::subject)
                .zip(envelopes)
                .collect();
            let passed = self.pipeline.check_batch(items);
            self.ready.extend(passed);
            if ended && self.ready.is_empty() {
                return Poll::Ready(None);
            }
        }
    }
}

impl Stream for EventStream {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Option<Event>> {
        let this = &mut *self;
        loop {
            if let Some(fetch) = this.fetching.as_mut() {
                let fetched = std::task::ready!(fetch.as_mut().poll(cx));
                this.fetching = None;
                match fetched {
                    Some(envelope) => return Poll::Ready(Some(Event { envelope })),
                    None => continue,
                }
            }
            let Some((envelope, fetch_from)) = std::task::ready!(this.poll_checked(cx)) else {
                return Poll::Ready(None);
            };
            let Some(subject) = fetch_from else {
                return Poll::Ready(Some(Event { envelope }));
            };
            let pipeline = Arc::clone(&this.pipeline);
            this.fetching = Some(Box::pin(async move {
                pipeline.open_fetched(&subject, envelope).await
            }));
        }
    }
}
