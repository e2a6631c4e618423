//! Events: published on core NATS under a producer span, at most once.

use serde::Serialize;

use super::call::{Publish, check_headers};
use super::{Outbound, Parent};
use crate::error::SdkError;
use crate::protocol::codec::{COMPACT_OVERHEAD, Encoding, encode_payload};
use crate::protocol::envelope::{Envelope, Kind, Performative, Priority};
use crate::protocol::wire::compact::{EventParts, encode_event};
use crate::stats::AgentCounters;

impl Outbound {
    /// Publishes `value` as an event on `topic` (as a forward of `parent`, if given).
    pub(crate) async fn publish<T: Serialize + ?Sized>(
        &self,
        topic: &str,
        value: &T,
        parent: Option<Parent<'_>>,
    ) -> Result<(), SdkError> {
        let content_type = self.wire.encoding().content_type();
        let payload = encode_payload(value, content_type)?;
        if parent.is_none() && self.direct() && self.fits_inline(payload.len()) {
            let subject = self.link.subjects.event(topic)?;
            return self.publish_direct(subject, content_type, &payload).await;
        }
        let (subject, mut env) = self.event(topic, content_type)?;
        self.inherit(&mut env, parent.map(|p| p.env))?;
        env.payload = payload;
        let otel = parent.map_or_else(opentelemetry::Context::current, |p| p.otel.clone());
        self.publish_envelope(subject, env, &otel).await
    }

    /// Publishes an event whose payload is `payload` as it is, labelled `content_type`.
    pub(crate) async fn publish_raw(
        &self,
        topic: &str,
        payload: bytes::Bytes,
        content_type: &str,
    ) -> Result<(), SdkError> {
        if self.direct() && self.fits_inline(payload.len()) {
            let subject = self.link.subjects.event(topic)?;
            return self.publish_direct(subject, content_type, &payload).await;
        }
        let (subject, mut env) = self.event(topic, content_type)?;
        env.payload = payload;
        self.publish_envelope(subject, env, &opentelemetry::Context::current())
            .await
    }

    /// Publishes a [`Publish`] (as a forward of `parent`, if given): its priority, headers,
    /// session and customer set on the envelope; one that sets none of them and has no parent
    /// goes the way [`publish_raw`](Self::publish_raw) does.
    pub(crate) async fn publish_with(
        &self,
        event: Publish,
        parent: Option<Parent<'_>>,
    ) -> Result<(), SdkError> {
        check_headers(&event.headers)?;
        let plain = event.priority == Priority::Normal
            && event.headers.is_empty()
            && event.session.is_none()
            && event.customer.is_none();
        if plain && parent.is_none() {
            return self
                .publish_raw(&event.topic, event.payload, event.content_type.as_str())
                .await;
        }
        let (subject, mut env) = self.event(&event.topic, event.content_type.as_str())?;
        self.inherit(&mut env, parent.as_ref().map(|p| p.env))?;
        env.payload = event.payload;
        env.priority = event.priority;
        env.headers = event.headers;
        if event.session.is_some() {
            env.session_id = event.session;
        }
        if event.customer.is_some() {
            env.customer_id = event.customer;
        }
        let otel = parent.map_or_else(opentelemetry::Context::current, |p| p.otel.clone());
        self.publish_envelope(subject, env, &otel).await
    }

    /// Whether an event without a parent is written straight from its parts: in the compact
    /// form, by an agent that neither signs nor makes spans (what is left to build is fixed:
    /// id, sender, sequence, trace context, payload).
    fn direct(&self) -> bool {
        self.identity.is_none()
            && !crate::trace::spans_enabled()
            && self.wire.encoding() == Encoding::Compact
    }

    /// Publishes an event from its parts, without an [`Envelope`]: the same bytes
    /// [`publish_envelope`](Self::publish_envelope) would send, for a fraction of the work.
    async fn publish_direct(
        &self,
        subject: String,
        content_type: &str,
        payload: &[u8],
    ) -> Result<(), SdkError> {
        let counter = self.sequencer.counter(&subject);
        let mut counter = counter.lock().await;
        let parts = EventParts {
            id: uuid::Uuid::now_v7(),
            from: &self.link.id,
            hop_limit: self.hop_limit,
            seq: counter.peek(),
            trace: crate::trace::fresh(),
            content_type,
            payload,
        };
        let bytes = self.write(|out| {
            out.reserve(COMPACT_OVERHEAD + payload.len());
            encode_event(&parts, out);
            Ok::<_, SdkError>(())
        })?;
        let sent = self.link.broker.publish_built(subject, bytes).await;
        if sent.is_ok() {
            counter.advance();
        }
        drop(counter);
        sent?;
        AgentCounters::bump(&self.link.counters.events_published);
        Ok(())
    }

    /// An event's subject and envelope, without its payload.
    fn event(&self, topic: &str, content_type: &str) -> Result<(String, Envelope), SdkError> {
        let subject = self.link.subjects.event(topic)?;
        let mut env = Envelope::new_typed(
            Kind::Event,
            Performative::Inform,
            self.link.id.as_str(),
            content_type.into(),
        );
        env.topic = Some(topic.into());
        Ok((subject, env))
    }

    /// Publishes an event envelope under a producer span.
    async fn publish_envelope(
        &self,
        subject: String,
        mut env: Envelope,
        parent: &opentelemetry::Context,
    ) -> Result<(), SdkError> {
        let (span, trace) = crate::trace::start(
            opentelemetry::trace::SpanKind::Producer,
            parent,
            env.trace.as_ref(),
            || {
                format!(
                    "chorus.publish {}",
                    env.topic.as_deref().unwrap_or(&subject)
                )
            },
            || crate::trace::attributes(&self.link.id, &env),
        );
        env.trace = Some(trace);
        // A large payload is stored first (an event's readers are unknown: never compressed).
        if let Err(err) = self.fit(&mut env).await {
            crate::trace::finish(span.as_ref(), Some(err.to_string()));
            return Err(err);
        }
        // Numbered and handed to the connection under the subject's count, so the numbers go
        // out in order whoever publishes.
        let counter = self.sequencer.counter(&subject);
        let mut counter = counter.lock().await;
        env.seq = Some(counter.peek());
        self.seal(&subject, &mut env);
        let bytes = self.encode(&subject, &env)?;
        let sent = self.link.broker.publish_built(subject, bytes).await;
        if sent.is_ok() {
            counter.advance();
        }
        drop(counter);
        crate::trace::finish(span.as_ref(), sent.as_ref().err().map(|e| e.to_string()));
        sent?;
        AgentCounters::bump(&self.link.counters.events_published);
        Ok(())
    }
}
