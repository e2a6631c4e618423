//! The context a handler runs in: the message being handled and the agent, so a handler can
//! call other agents as part of the same conversation.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::SdkError;
use crate::outbound::{
    Call, Collect, MulticastReport, Notify, NotifyReport, Outbound, Parent, Reply,
};
use crate::protocol::envelope::Envelope;

/// Given to every handler. Calls made through it continue the conversation: the same
/// correlation id, the hop count plus one (refused past the hop limit), and a deadline no
/// later than the one of the message being handled.
#[derive(Clone)]
pub struct Context {
    pub(crate) out: Arc<Outbound>,
    pub(crate) request: Arc<Envelope>,
    /// The subject it arrived on.
    pub(crate) subject: chorus_broker_adapter::Subject,
    /// Which delivery of the message this is (1 the first time).
    pub(crate) attempt: u32,
    /// The handling span: the parent of everything this handler sends.
    pub(crate) otel: opentelemetry::Context,
    /// How its notifications go out.
    pub(crate) notifier: Arc<dyn Notifier>,
}

/// How a handler's notifications go out: the agent's sender (the durable room, which stores a
/// durable one), given to the pipeline when the agent connects.
pub(crate) trait Notifier: Send + Sync {
    /// Sends `notify` as a forward of `parent`.
    fn notify<'a>(
        &'a self,
        notify: Notify,
        parent: Parent<'a>,
    ) -> futures::future::BoxFuture<'a, Result<NotifyReport, SdkError>>;
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("agent", &self.out.link.id)
            .field("message", &self.request.id)
            .finish()
    }
}

impl Context {
    fn parent(&self) -> Parent<'_> {
        Parent {
            env: &self.request,
            otel: &self.otel,
        }
    }

    /// The OpenTelemetry context of the handling span (to start spans of your own under it).
    pub fn otel_context(&self) -> &opentelemetry::Context {
        &self.otel
    }

    /// The message being handled.
    pub fn message(&self) -> &Envelope {
        &self.request
    }

    /// Which delivery of the message this is: 1 the first time; for a durable command, the
    /// server's count, so 3 is its third attempt (after two failures, or a crash or lost
    /// connection mid-handler).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The subject the message arrived on (for a handler of a wildcard pattern, which one).
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The id of the agent handling it.
    pub fn agent_id(&self) -> &str {
        &self.out.link.id
    }

    /// The sender's agent id.
    pub fn from(&self) -> &str {
        &self.request.from
    }

    /// The message's application headers (the envelope's `headers`, set by the sender with
    /// [`Call::header`]): empty when it set none. They are this message's only: the reply and
    /// the calls made through this context do not carry them on.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.request.headers
    }

    /// The value of application header `name`, if the message carries it.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.request.headers.get(name).map(String::as_str)
    }

    /// Sends a call as a forward of the message being handled.
    ///
    /// # Errors
    /// As [`Agent::call`](crate::Agent::call), and [`SdkError::LoopDetected`] or
    /// [`SdkError::Expired`] when forwarding would pass the hop limit or the handled message's
    /// deadline has passed.
    pub async fn call(&self, call: Call) -> Result<Reply, SdkError> {
        self.out.call(call, Some(self.parent())).await
    }

    /// Sends a multicast as a forward of the message being handled
    /// ([`Agent::multicast`](crate::Agent::multicast)): every copy carries this message's
    /// conversation (the report's `multicast_id`), one more hop and its deadline.
    ///
    /// # Errors
    /// As [`Agent::multicast`](crate::Agent::multicast); a copy that cannot be forwarded
    /// (past the hop limit or the deadline) is reported failed.
    pub async fn multicast<S: AsRef<str>>(
        &self,
        call: Call,
        to: &[S],
        collect: Collect,
    ) -> Result<MulticastReport, SdkError> {
        self.out
            .multicast(call, to, collect, Some(self.parent()))
            .await
    }

    /// Requests `command` from agent `agent` as a forward, and decodes the result.
    ///
    /// # Errors
    /// As [`call`](Context::call), and [`SdkError::Codec`] when `args` does not encode or the
    /// result does not decode as `R`.
    pub async fn request<T, R>(&self, agent: &str, command: &str, args: &T) -> Result<R, SdkError>
    where
        T: Serialize + ?Sized,
        R: DeserializeOwned,
    {
        self.call(Call::agent(agent, command).payload(args)?)
            .await?
            .payload_as()
    }

    /// Requests from whichever agent serves `capability`, as a forward.
    ///
    /// # Errors
    /// As [`call`](Context::call), and [`SdkError::Codec`] when `args` does not encode or the
    /// result does not decode as `R`.
    pub async fn request_capability<T, R>(&self, capability: &str, args: &T) -> Result<R, SdkError>
    where
        T: Serialize + ?Sized,
        R: DeserializeOwned,
    {
        self.call(Call::capability(capability).payload(args)?)
            .await?
            .payload_as()
    }

    /// Sends a notification ([`Agent::notify`](crate::Agent::notify)) as a forward of the
    /// message being handled: its conversation, one more hop, its deadline.
    ///
    /// # Errors
    /// As [`Agent::notify`](crate::Agent::notify), and [`SdkError::LoopDetected`] or
    /// [`SdkError::Expired`] past the hop limit or the deadline.
    pub async fn notify(&self, notify: Notify) -> Result<NotifyReport, SdkError> {
        self.notifier.notify(notify, self.parent()).await
    }

    /// Publishes an event in the same conversation.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `topic` is not a valid topic; [`SdkError::Codec`] when `value`
    /// does not encode or is too large; [`SdkError::LoopDetected`] or [`SdkError::Expired`] past
    /// the hop limit or the deadline; [`SdkError::Broker`] when the connection is gone.
    pub async fn publish<T: Serialize + ?Sized>(
        &self,
        topic: &str,
        value: &T,
    ) -> Result<(), SdkError> {
        self.out.publish(topic, value, Some(self.parent())).await
    }

    /// Publishes a [`Publish`](crate::Publish) as a forward of the message being handled, as
    /// [`publish`](Context::publish) does; its own session or customer, if it names one,
    /// replaces the inherited one.
    ///
    /// # Errors
    /// As [`publish`](Context::publish), and [`SdkError::InvalidCall`] for headers past the
    /// limits.
    pub async fn publish_with(&self, event: crate::Publish) -> Result<(), SdkError> {
        self.out.publish_with(event, Some(self.parent())).await
    }
}
