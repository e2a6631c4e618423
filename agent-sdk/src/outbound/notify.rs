//! Notifications (`docs/PROTOCOL.md` section 7.14): a push to one agent, or through the
//! coordinator to each live member of a group, that expects no reply and needs no topic
//! subscription. Core by default (published; gone if the agent is away), durable when asked
//! (stored in the recipient's inbox until its notification handler takes it).

use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{Call, Outbound};
use crate::error::SdkError;
use crate::protocol::envelope::{
    ContentType, DeliveryClass, Envelope, ExpectedReply, Kind, Performative, Priority, now_ms,
};
use crate::protocol::registry::{BroadcastReport, BroadcastTarget, Outcome, RecipientReport};
use crate::stats::AgentCounters;
use crate::subject::validate_token;

/// Who a notification goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotifyTarget {
    /// One agent, directly (no coordinator).
    Agent(String),
    /// Every live agent of a group, a capability's holders, or all: through the coordinator,
    /// which sends each one its own copy and reports per recipient.
    Group(BroadcastTarget),
}

/// A notification to send with [`Agent::notify`](crate::Agent::notify): its name (what the
/// receiver's [`Agent::on_notification`](crate::Agent::on_notification) handlers are chosen
/// by), payload, priority, application headers, session and customer, and whether it is kept
/// until the recipient takes it ([`Notify::durable`]).
///
/// ```
/// use chorus_sdk::{Notify, Priority};
/// let alert = Notify::agent("ops-bot", "disk-full")
///     .payload(&"db-2 at 91%")
///     .unwrap()
///     .priority(Priority::High)
///     .header("x-host", "db-2")
///     .durable();
/// ```
#[derive(Debug, Clone)]
pub struct Notify {
    pub(crate) to: NotifyTarget,
    /// The notification as a call (kind `notification`): name, payload, priority, headers,
    /// session, customer, delivery class, ttl.
    pub(crate) call: Call,
    /// How long to wait for the coordinator's report of a group notification.
    pub(crate) report_timeout: Option<Duration>,
}

/// What became of a notification: one line per recipient (for one agent, one line), with the
/// notification's message id (a group notification's copies share it as their
/// `correlation_id`). A recipient's line says `delivered` (published on core NATS, whether
/// or not anyone was listening), `stored` (kept in its durable inbox) or `failed` (with the
/// code).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotifyReport {
    /// The notification's message id.
    pub id: Uuid,
    /// One line per recipient, sorted by agent id.
    pub recipients: Vec<RecipientReport>,
}

impl NotifyReport {
    /// How many recipients had `outcome`.
    pub fn count(&self, outcome: Outcome) -> usize {
        self.recipients
            .iter()
            .filter(|r| r.outcome == outcome)
            .count()
    }

    /// The line of `agent`, if it was a recipient.
    pub fn recipient(&self, agent: &str) -> Option<&RecipientReport> {
        self.recipients.iter().find(|r| r.agent == agent)
    }
}

impl Notify {
    /// A notification called `name` to agent `agent`.
    pub fn agent(agent: impl Into<String>, name: impl Into<String>) -> Self {
        Notify::new(NotifyTarget::Agent(agent.into()), name.into())
    }

    /// A notification called `name` to every live agent of `target`, through the coordinator.
    pub fn to(target: BroadcastTarget, name: impl Into<String>) -> Self {
        Notify::new(NotifyTarget::Group(target), name.into())
    }

    /// A notification called `name` to every live member of broadcast group `group`.
    pub fn group(group: impl Into<String>, name: impl Into<String>) -> Self {
        Notify::to(BroadcastTarget::Group(group.into()), name)
    }

    /// A notification called `name` to every live holder of `capability`.
    pub fn capability(capability: impl Into<String>, name: impl Into<String>) -> Self {
        Notify::to(BroadcastTarget::Capability(capability.into()), name)
    }

    /// A notification called `name` to every live agent.
    pub fn all(name: impl Into<String>) -> Self {
        Notify::to(BroadcastTarget::All, name)
    }

    fn new(to: NotifyTarget, name: String) -> Self {
        let agent = match &to {
            NotifyTarget::Agent(agent) => agent.clone(),
            NotifyTarget::Group(_) => String::new(),
        };
        let mut call = Call::agent(agent, name);
        call.kind = Kind::Notification;
        // Core unless asked, whatever the agent's default delivery class.
        call.delivery = Some(DeliveryClass::AtMostOnce);
        Notify {
            to,
            call,
            report_timeout: None,
        }
    }

    /// The payload, as MessagePack.
    ///
    /// # Errors
    /// [`SdkError::Codec`] when `value` does not encode as MessagePack.
    pub fn payload<T: Serialize + ?Sized>(mut self, value: &T) -> Result<Self, SdkError> {
        self.call = self.call.payload(value)?;
        Ok(self)
    }

    /// The payload, as JSON.
    ///
    /// # Errors
    /// [`SdkError::Codec`] when `value` does not encode as JSON.
    pub fn json_payload<T: Serialize + ?Sized>(mut self, value: &T) -> Result<Self, SdkError> {
        self.call = self.call.json_payload(value)?;
        Ok(self)
    }

    /// Payload bytes as they are, with their content type.
    pub fn raw_payload(mut self, payload: Bytes, content_type: impl Into<ContentType>) -> Self {
        self.call = self.call.raw_payload(payload, content_type);
        self
    }

    /// Priority: the receiver serves it before lower ones waiting for a handler slot, and a
    /// durable one (high or critical) goes to the inbox's high lane.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.call = self.call.priority(priority);
        self
    }

    /// An application header, read by the handler with
    /// [`Context::headers`](crate::Context::headers); the limits of [`Call::header`] apply.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.call = self.call.header(name, value);
        self
    }

    /// The session it belongs to (`session_id`).
    pub fn session(mut self, session: impl Into<String>) -> Self {
        self.call = self.call.session(session);
        self
    }

    /// The customer it is sent for (`customer_id`).
    pub fn customer(mut self, customer: impl Into<String>) -> Self {
        self.call = self.call.customer(customer);
        self
    }

    /// Keeps it in each recipient's durable inbox until the recipient's notification handler
    /// takes it (at least once): an agent that is away gets it when it is back, and a handler
    /// that fails is retried and then dead-lettered by the retry policy, as a durable
    /// command is.
    pub fn durable(mut self) -> Self {
        self.call = self.call.delivery(DeliveryClass::AtLeastOnce);
        self
    }

    /// How long a durable notification may wait for its recipient; after that it is
    /// dead-lettered as expired instead of handled (a group's copies expire together, at the
    /// same moment).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.call = self.call.ttl(ttl);
        self
    }

    /// How long to wait for the coordinator's report of a group notification (default: the
    /// agent's request timeout). No effect on a notification to one agent, which waits for
    /// nothing but its publish (or, durable, the stream's ack).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.report_timeout = Some(timeout);
        self
    }
}

impl Outbound {
    /// The envelope of a group notification, sent to the coordinator on `subject`: kind
    /// `notification`, its name, payload, priority, headers, session, customer, delivery
    /// class and (for a ttl) a deadline its copies share.
    pub(crate) fn group_notification(
        &self,
        notify: &Notify,
        report_wait: Duration,
        parent: Option<&Envelope>,
    ) -> Result<Envelope, SdkError> {
        let call = &notify.call;
        super::call::check_headers(&call.headers)?;
        let name = call.name.clone().unwrap_or_default();
        validate_token("notification name", &name)?;
        let mut env = Envelope::new(
            Kind::Notification,
            Performative::Inform,
            self.link.id.as_str(),
        );
        self.inherit(&mut env, parent)?;
        env.name = Some(name);
        env.priority = call.priority;
        env.headers = call.headers.clone();
        env.content_type = call.content_type.clone();
        env.payload = call.payload.clone();
        env.delivery = call.delivery.unwrap_or(DeliveryClass::AtMostOnce);
        if call.session.is_some() {
            env.session_id.clone_from(&call.session);
        }
        if call.customer.is_some() {
            env.customer_id.clone_from(&call.customer);
        }
        if let Some(ttl) = call.ttl {
            let at = now_ms().saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
            env.deadline_ms = Some(env.deadline_ms.map_or(at, |d| d.min(at)));
        }
        let wait_ms = u64::try_from(report_wait.as_millis()).unwrap_or(u64::MAX);
        env.ttl_ms = Some(wait_ms);
        env.expect = Some(ExpectedReply {
            performative: Performative::Inform,
            timeout_ms: wait_ms,
        });
        Ok(env)
    }

    /// Counts a notification sent to one agent.
    pub(crate) fn notification_sent(&self) {
        AgentCounters::bump(&self.link.counters.notifications_sent);
    }
}

/// The coordinator's broadcast report as a notification's.
impl From<BroadcastReport> for NotifyReport {
    fn from(report: BroadcastReport) -> Self {
        NotifyReport {
            id: report.broadcast_id,
            recipients: report.recipients,
        }
    }
}
