//! Outgoing calls: small builders for commands and requests and for events with more than a
//! topic and a payload, and the reply a call brings back.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::error::SdkError;
use crate::protocol::codec::{decode_payload, encode_payload};
use crate::protocol::envelope::{
    CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, ContentType, DeliveryClass, Envelope, Kind, Priority,
};
use crate::protocol::status::StatusCode;

/// The three payload setters of a builder with `payload` and `content_type` fields (a call
/// and an event set their payload alike); `$json_note` ends `json_payload`'s first line.
macro_rules! payload_setters {
    ($json_note:literal) => {
        /// The payload, as MessagePack.
        ///
        /// # Errors
        /// [`SdkError::Codec`] when `value` does not encode as MessagePack.
        pub fn payload<T: Serialize + ?Sized>(mut self, value: &T) -> Result<Self, SdkError> {
            self.payload = encode_payload(value, CONTENT_TYPE_MSGPACK)?;
            self.content_type = ContentType::default();
            Ok(self)
        }

        #[doc = concat!("The payload, as JSON", $json_note, ".")]
        ///
        /// # Errors
        /// [`SdkError::Codec`] when `value` does not encode as JSON.
        pub fn json_payload<T: Serialize + ?Sized>(mut self, value: &T) -> Result<Self, SdkError> {
            self.payload = encode_payload(value, CONTENT_TYPE_JSON)?;
            self.content_type = CONTENT_TYPE_JSON.into();
            Ok(self)
        }

        /// Payload bytes as they are, with their content type.
        pub fn raw_payload(mut self, payload: Bytes, content_type: impl Into<ContentType>) -> Self {
            self.payload = payload;
            self.content_type = content_type.into();
            self
        }
    };
}

/// The most application headers a message may carry ([`Call::header`]).
pub const MAX_HEADERS: usize = 64;
/// The longest application header name, in bytes.
pub const MAX_HEADER_NAME_BYTES: usize = 128;
/// The most bytes a message's application headers may take, names and values together.
pub const MAX_HEADERS_BYTES: usize = 16 * 1024;

/// Checks a message's application headers against the limits: at most [`MAX_HEADERS`], each
/// name 1 to [`MAX_HEADER_NAME_BYTES`] bytes without control characters, and at most
/// [`MAX_HEADERS_BYTES`] of names and values in all.
pub(crate) fn check_headers(headers: &BTreeMap<String, String>) -> Result<(), SdkError> {
    if headers.len() > MAX_HEADERS {
        return Err(SdkError::InvalidCall(format!(
            "{} application headers: at most {MAX_HEADERS} are allowed",
            headers.len()
        )));
    }
    let mut total = 0usize;
    for (name, value) in headers {
        if name.is_empty() || name.len() > MAX_HEADER_NAME_BYTES {
            return Err(SdkError::InvalidCall(format!(
                "application header name {name:?}: 1 to {MAX_HEADER_NAME_BYTES} bytes, not {}",
                name.len()
            )));
        }
        if name.chars().any(char::is_control) {
            return Err(SdkError::InvalidCall(format!(
                "application header name {name:?} holds a control character"
            )));
        }
        total += name.len() + value.len();
    }
    if total > MAX_HEADERS_BYTES {
        return Err(SdkError::InvalidCall(format!(
            "application headers of {total} bytes: at most {MAX_HEADERS_BYTES} are allowed"
        )));
    }
    Ok(())
}

/// Where a call goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One agent, by id.
    Agent(String),
    /// Any one agent serving a capability (the access point's queue group picks).
    Capability(String),
    /// A capability at one agent that serves it, and no other.
    CapabilityAt {
        /// The agent.
        agent: String,
        /// The capability.
        capability: String,
    },
}

/// A command or request to send with [`Agent::call`](crate::Agent::call).
///
/// ```
/// use std::time::Duration;
/// use chorus_sdk::Call;
/// let call = Call::agent("calculator", "add")
///     .payload(&(2, 3))
///     .unwrap()
///     .timeout(Duration::from_secs(2));
/// ```
#[derive(Debug, Clone)]
pub struct Call {
    pub(crate) target: Target,
    pub(crate) name: Option<String>,
    pub(crate) kind: Kind,
    pub(crate) payload: Bytes,
    pub(crate) content_type: ContentType,
    pub(crate) timeout: Option<Duration>,
    pub(crate) priority: Priority,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) delivery: Option<DeliveryClass>,
    pub(crate) id: Option<Uuid>,
    pub(crate) ttl: Option<Duration>,
    pub(crate) deadline: Option<Duration>,
    pub(crate) encrypt_for: Vec<String>,
    pub(crate) token: Option<String>,
    pub(crate) routing: Option<super::Routing>,
    pub(crate) retry: Option<crate::retry::RetryPolicy>,
    pub(crate) dead_letter: bool,
    pub(crate) session: Option<String>,
    pub(crate) customer: Option<String>,
    /// The conversation to file it under when it forwards nothing: a multicast's id, shared
    /// by its copies.
    pub(crate) correlation: Option<Uuid>,
}

impl Call {
    /// A request to agent `agent` for command `command`.
    pub fn agent(agent: impl Into<String>, command: impl Into<String>) -> Self {
        Call::new(Target::Agent(agent.into()), Some(command.into()))
    }

    /// A request to whichever agent serves `capability`.
    pub fn capability(capability: impl Into<String>) -> Self {
        Call::new(Target::Capability(capability.into()), None)
    }

    /// A call to `capability` at agent `agent` only (its own access point, not the queue
    /// group): to retry on one holder, or to pick one from [`Agent::discover`](crate::Agent::discover).
    pub fn capability_at(agent: impl Into<String>, capability: impl Into<String>) -> Self {
        Call::new(
            Target::CapabilityAt {
                agent: agent.into(),
                capability: capability.into(),
            },
            None,
        )
    }

    fn new(target: Target, name: Option<String>) -> Self {
        Call {
            target,
            name,
            kind: Kind::Request,
            payload: Bytes::new(),
            content_type: ContentType::default(),
            timeout: None,
            priority: Priority::Normal,
            headers: BTreeMap::new(),
            delivery: None,
            id: None,
            ttl: None,
            deadline: None,
            encrypt_for: Vec::new(),
            token: None,
            routing: None,
            retry: None,
            dead_letter: false,
            session: None,
            customer: None,
            correlation: None,
        }
    }

    /// A request for command `command` to send to a list of agents with
    /// [`Agent::multicast`](crate::Agent::multicast), which names the recipients. (Sent with
    /// [`Agent::call`](crate::Agent::call) it names no agent, and fails with
    /// [`SdkError::Subject`].)
    pub fn multicast(command: impl Into<String>) -> Self {
        Call::new(Target::Agent(String::new()), Some(command.into()))
    }

    /// Encrypts the payload end to end for these agents (their public keys come from the
    /// registry or [`AgentOptions::trust_encryption`](crate::AgentOptions::trust_encryption)):
    /// nobody else, broker and coordinator included, can read it.
    pub fn encrypt_for<I, S>(mut self, recipients: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.encrypt_for = recipients.into_iter().map(Into::into).collect();
        self
    }

    /// Sends a capability call to the least-loaded live holder of the capability, by the
    /// registry's view and this agent's own calls in flight, rather than to whichever holder
    /// the queue group picks; to the queue group when the registry knows none. No effect on
    /// other targets. See [`Routing`](super::Routing).
    pub fn least_loaded(mut self) -> Self {
        self.routing = Some(super::Routing::LeastLoaded);
        self
    }

    /// Retries a request or command that fails with one of `policy.retry_on` (a timeout, no
    /// responders, 5019, 5017 by default), up to `policy.max_attempts` in all, after the
    /// policy's backoff, each time with the **same message id**: a handler the call reaches
    /// exactly once ([`DeliveryClass::ExactlyOnce`]) runs once however many copies arrive,
    /// and a late copy is answered with the recorded result. Another failure, or an open
    /// circuit breaker, ends it at once. (An agent that verifies signatures refuses a repeated
    /// id as a replay, 5015: retry durable commands there instead.)
    pub fn retry(mut self, policy: crate::retry::RetryPolicy) -> Self {
        self.retry = Some(policy);
        self
    }

    /// Writes the request to the dead-letter queue when it fails for good (its retries
    /// exhausted, `max_attempts`; or a failure not worth retrying, `refused`), as a durable
    /// command's would be: `chorus dlq` shows it and can send it again.
    pub fn dead_letter_on_failure(mut self) -> Self {
        self.dead_letter = true;
        self
    }

    /// How this call picks its agent, whatever the agent's default.
    pub fn routing(mut self, routing: super::Routing) -> Self {
        self.routing = Some(routing);
        self
    }

    /// The delivery guarantee for [`Agent::send`](crate::Agent::send) (default: the agent's).
    pub fn delivery(mut self, class: DeliveryClass) -> Self {
        self.delivery = Some(class);
        self
    }

    /// Uses `id` as the message id instead of a fresh UUIDv7. Sending the same id twice is
    /// how a sender retries safely with exactly-once delivery: the server's dedupe window and
    /// the receiver's idempotency record make the second copy a no-op. (At least once, the
    /// second copy is handled again.)
    pub fn id(mut self, id: Uuid) -> Self {
        self.id = Some(id);
        self
    }

    /// How long a durable message may wait for its recipient; after that it is dead-lettered
    /// as expired instead of handled.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// A deadline `after` from now: past it the message is refused as expired (5011), and a
    /// task submitted with it expires on both sides if it has not finished. Within a handler,
    /// the earlier of this and the inherited deadline applies.
    pub fn deadline(mut self, after: Duration) -> Self {
        self.deadline = Some(after);
        self
    }

    /// Marks it a command (an instruction) rather than a request (a question). Both get a
    /// result back; the kind tells the receiver and the logs what was meant.
    pub fn command(mut self) -> Self {
        self.kind = Kind::Command;
        self
    }

    /// A token for the receiver to check (the envelope's `token`), for agents that require
    /// one ([`AgentOptions::require_token`](crate::AgentOptions::require_token)).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    payload_setters!("; the handler's reply comes back as JSON too");

    /// How long to wait for the reply (default: the agent's request timeout). The message's
    /// TTL is set to the same, so it is not handled after the caller gave up.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Priority.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// The session (a conversation: an A2A context, a chat) this call belongs to, as the
    /// envelope's `session_id` (a task keeps it in its submission). Replies carry it back,
    /// and a call made while handling a message inherits that message's session unless it
    /// names its own.
    pub fn session(mut self, session: impl Into<String>) -> Self {
        self.session = Some(session.into());
        self
    }

    /// The customer (or tenant) this call is made for, as the envelope's `customer_id`,
    /// carried along as [`Call::session`] is.
    pub fn customer(mut self, customer: impl Into<String>) -> Self {
        self.customer = Some(customer.into());
        self
    }

    /// An application header: a free key-value in the envelope's `headers`, which the
    /// receiving handler reads with [`Context::headers`](crate::Context::headers). Replies and
    /// the handler's own calls do not carry it on. Setting a name again replaces its value.
    /// Checked when the call is sent: at most [`MAX_HEADERS`] headers, names 1 to
    /// [`MAX_HEADER_NAME_BYTES`] bytes without control characters, [`MAX_HEADERS_BYTES`] in
    /// all; past that the call fails with [`SdkError::InvalidCall`].
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }
}

/// An event to publish with [`Agent::publish_with`](crate::Agent::publish_with) (or
/// [`Context::publish_with`](crate::Context::publish_with) while handling a message): what
/// [`Agent::publish`](crate::Agent::publish) sends, with a priority, application headers, a
/// session or a customer.
///
/// ```
/// use chorus_sdk::{Priority, Publish};
/// let alert = Publish::topic("alerts.disk")
///     .payload(&"disk 91% full")
///     .unwrap()
///     .priority(Priority::High)
///     .header("x-host", "db-2");
/// ```
#[derive(Debug, Clone)]
pub struct Publish {
    pub(crate) topic: String,
    pub(crate) payload: Bytes,
    pub(crate) content_type: ContentType,
    pub(crate) priority: Priority,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) session: Option<String>,
    pub(crate) customer: Option<String>,
}

impl Publish {
    /// An event on `topic`, without a payload yet.
    pub fn topic(topic: impl Into<String>) -> Self {
        Publish {
            topic: topic.into(),
            payload: Bytes::new(),
            content_type: ContentType::default(),
            priority: Priority::Normal,
            headers: BTreeMap::new(),
            session: None,
            customer: None,
        }
    }

    payload_setters!("");

    /// Priority: a subscriber with a backlog takes urgent events first (docs/PROTOCOL.md,
    /// section 7.9, "Priority").
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// The session this event belongs to (the envelope's `session_id`), as
    /// [`Call::session`].
    pub fn session(mut self, session: impl Into<String>) -> Self {
        self.session = Some(session.into());
        self
    }

    /// The customer this event is for (the envelope's `customer_id`), as [`Call::customer`].
    pub fn customer(mut self, customer: impl Into<String>) -> Self {
        self.customer = Some(customer.into());
        self
    }

    /// An application header, as [`Call::header`], with the same limits, checked when the
    /// event is published.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }
}

/// A successful reply.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The reply envelope.
    pub envelope: Envelope,
}

impl Reply {
    /// The reply's status (a success code).
    pub fn status(&self) -> StatusCode {
        self.envelope.status.unwrap_or(StatusCode::OK)
    }

    /// The payload bytes.
    pub fn payload(&self) -> &Bytes {
        &self.envelope.payload
    }

    /// The payload decoded by its content type.
    ///
    /// # Errors
    /// [`SdkError::Codec`] when the content type is not MessagePack or JSON, or the payload does
    /// not decode as `R`.
    pub fn payload_as<R: DeserializeOwned>(&self) -> Result<R, SdkError> {
        Ok(decode_payload(
            &self.envelope.payload,
            &self.envelope.content_type,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn headers_within_the_limits_pass_and_others_are_refused_with_the_reason() {
        assert!(check_headers(&BTreeMap::new()).is_ok());
        assert!(check_headers(&headers(&[("x-request", "7"), ("empty", "")])).is_ok());
        let refused = |h: &BTreeMap<String, String>| match check_headers(h) {
            Err(SdkError::InvalidCall(why)) => why,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let many: BTreeMap<_, _> = (0..=MAX_HEADERS)
            .map(|i| (i.to_string(), String::new()))
            .collect();
        assert!(refused(&many).contains("at most 64"));
        assert!(refused(&headers(&[("", "v")])).contains("1 to 128 bytes"));
        let long = "n".repeat(MAX_HEADER_NAME_BYTES + 1);
        assert!(refused(&headers(&[(&long, "v")])).contains("not 129"));
        assert!(refused(&headers(&[("a\nb", "v")])).contains("control character"));
        let big = "v".repeat(MAX_HEADERS_BYTES);
        assert!(refused(&headers(&[("k", &big)])).contains("16385 bytes"));
        assert_eq!(
            check_headers(&headers(&[("k", &big[1..])])).map_err(|e| e.status()),
            Ok(())
        );
    }
}
