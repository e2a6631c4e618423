//! Events as a stream ([`EventStream`]), read straight off a subscription through the
//! pipeline's admission and layers (no handler: the stream's reader is the handler).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use chorus_broker_adapter::{Message, Subscription};
use futures::Stream;
use serde::de::DeserializeOwned;

use super::pipeline::Pipeline;
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
/// costs about half as much per signature as one by one.
pub struct EventStream {
    sub: Subscription,
    pipeline: Arc<Pipeline>,
    /// Checked events not yet handed out.
    ready: VecDeque<Event>,
    /// Sequence gaps, checked as events arrive.
    gaps: Gaps,
}

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

impl Stream for EventStream {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Option<Event>> {
        let this = &mut *self;
        if !this.pipeline.verifies() {
            // Nothing to batch: each event goes through the layers as it is admitted.
            loop {
                let Some((msg, envelope)) = std::task::ready!(this.poll_admitted(cx)) else {
                    return Poll::Ready(None);
                };
                if let Some(envelope) = this.pipeline.check(msg.subject(), envelope) {
                    return Poll::Ready(Some(Event { envelope }));
                }
            }
        }
        loop {
            if let Some(event) = this.ready.pop_front() {
                return Poll::Ready(Some(event));
            }
            // Take what has already arrived, never waiting for more: a burst is checked as a
            // batch, a lone event alone.
            let mut batch = Vec::new();
            let mut ended = false;
            while batch.len() < VERIFY_BATCH {
                match this.poll_admitted(cx) {
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
            let passed = this.pipeline.check_batch(items);
            this.ready
                .extend(passed.into_iter().map(|envelope| Event { envelope }));
            if ended && this.ready.is_empty() {
                return Poll::Ready(None);
            }
        }
    }
}
