//! What an agent asks of others: events, calls and their typed shorthands, discovery,
//! broadcast, and one-way sends in a delivery class.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Agent;
use crate::durable::Receipt;
use crate::error::SdkError;
use crate::handler::endpoint::Description;
use crate::outbound::{Call, Collect, MulticastReport, Notify, NotifyReport, Publish, Reply};
use crate::protocol::codec::encode_payload;
use crate::protocol::envelope::{
    CONTENT_TYPE_MSGPACK, DeliveryClass, Envelope, ExpectedReply, Kind, Performative,
};
use crate::protocol::registry::{
    AgentRecord, Availability, BroadcastReport, BroadcastTarget, DiscoverQuery, Manifest,
};
use crate::subject::validate_token;
use crate::sync::lock;

/// What a broadcast waits beyond the recipients' own timeout: the coordinator's fan-out and
/// its report.
pub const BROADCAST_REPORT_MARGIN: Duration = Duration::from_secs(5);

impl Agent {
    /// Publishes an event on `topic`.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `topic` is not a valid topic; [`SdkError::Codec`] when `value`
    /// does not encode or is over the payload limit; [`SdkError::Broker`] when the connection is
    /// gone or a large payload cannot be stored.
    pub async fn publish<T: Serialize + ?Sized>(
        &self,
        topic: &str,
        value: &T,
    ) -> Result<(), SdkError> {
        self.inner.out.publish(topic, value, None).await
    }

    /// Publishes an event with more than a topic and a payload: a priority, application
    /// headers, a session or a customer ([`Publish`]).
    ///
    /// # Errors
    /// As [`publish`](Agent::publish), and [`SdkError::InvalidCall`] for headers past the
    /// limits ([`Call::header`]).
    pub async fn publish_with(&self, event: Publish) -> Result<(), SdkError> {
        self.inner.out.publish_with(event, None).await
    }

    /// Publishes an event whose payload is `payload` as it is, labelled `content_type` (for
    /// binary payloads, or payloads already encoded).
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `topic` is not a valid topic; [`SdkError::Codec`] when `payload`
    /// is over the payload limit; [`SdkError::Broker`] when the connection is gone or a large
    /// payload cannot be stored.
    pub async fn publish_raw(
        &self,
        topic: &str,
        payload: bytes::Bytes,
        content_type: &str,
    ) -> Result<(), SdkError> {
        self.inner
            .out
            .publish_raw(topic, payload, content_type)
            .await
    }

    /// Sends a call and waits for its reply. A reply with an error status is returned as
    /// [`SdkError::Remote`] with that status.
    ///
    /// # Errors
    /// [`SdkError::Timeout`] or [`SdkError::NoResponders`] when nobody answers;
    /// [`SdkError::Subject`], [`SdkError::Encryption`], [`SdkError::Codec`] or [`SdkError::Broker`]
    /// when it cannot be sent; [`SdkError::CircuitOpen`] when the destination's breaker is open.
    pub async fn call(&self, call: Call) -> Result<Reply, SdkError> {
        self.inner.out.call(call, None).await
    }

    /// Requests `command` from agent `agent` and decodes the result.
    ///
    /// # Errors
    /// As [`call`](Agent::call), and [`SdkError::Codec`] when `args` does not encode or the result
    /// does not decode as `R`.
    pub async fn request<T, R>(&self, agent: &str, command: &str, args: &T) -> Result<R, SdkError>
    where
        T: Serialize + ?Sized,
        R: DeserializeOwned,
    {
        self.call(Call::agent(agent, command).payload(args)?)
            .await?
            .payload_as()
    }

    /// Sends command `command` to agent `agent` and waits for its result.
    ///
    /// # Errors
    /// As [`call`](Agent::call), and [`SdkError::Codec`] when `args` does not encode or the result
    /// does not decode as `R`.
    pub async fn command<T, R>(&self, agent: &str, command: &str, args: &T) -> Result<R, SdkError>
    where
        T: Serialize + ?Sized,
        R: DeserializeOwned,
    {
        self.call(Call::agent(agent, command).command().payload(args)?)
            .await?
            .payload_as()
    }

    /// Requests from whichever agent serves `capability`, and decodes the result.
    ///
    /// # Errors
    /// As [`call`](Agent::call), and [`SdkError::Codec`] when `args` does not encode or the result
    /// does not decode as `R`.
    pub async fn request_capability<T, R>(&self, capability: &str, args: &T) -> Result<R, SdkError>
    where
        T: Serialize + ?Sized,
        R: DeserializeOwned,
    {
        self.call(Call::capability(capability).payload(args)?)
            .await?
            .payload_as()
    }

    /// Asks the coordinator which agents match `query`: live agents only, least loaded first.
    ///
    /// # Errors
    /// [`SdkError::Timeout`] or [`SdkError::NoResponders`] when no coordinator answers within the
    /// request timeout; [`SdkError::Remote`] when it refuses the query; [`SdkError::Codec`] when
    /// its answer does not decode.
    pub async fn discover(&self, query: &DiscoverQuery) -> Result<Vec<AgentRecord>, SdkError> {
        let out = &self.inner.out;
        out.discover(query, out.request_timeout).await
    }

    /// Agents offering `capability`, least loaded first.
    ///
    /// # Errors
    /// As [`discover`](Agent::discover): [`SdkError::Timeout`] or [`SdkError::NoResponders`] when
    /// no coordinator answers in time, [`SdkError::Remote`] when it refuses.
    pub async fn discover_capability(
        &self,
        capability: &str,
    ) -> Result<Vec<AgentRecord>, SdkError> {
        self.discover(&DiscoverQuery::capability(capability)).await
    }

    /// Sends command `command` to every live agent in `target` through the coordinator and
    /// returns its report: per recipient, delivered, failed (with the code) or timed out.
    /// `timeout` is how long each recipient has to answer.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `command`, the group or the capability is not a valid name;
    /// [`SdkError::Timeout`], [`SdkError::NoResponders`] or [`SdkError::Remote`] when no
    /// coordinator reports. A recipient's failure is in the report, not an error.
    pub async fn broadcast<T: Serialize + ?Sized>(
        &self,
        target: &BroadcastTarget,
        command: &str,
        args: &T,
        timeout: Duration,
    ) -> Result<BroadcastReport, SdkError> {
        validate_token("command name", command)?;
        let subject = self.inner.link.subjects.broadcast(target)?;
        let mut env = Envelope::new(
            Kind::Command,
            Performative::Request,
            self.inner.link.id.as_str(),
        );
        env.name = Some(command.to_owned());
        env.content_type = CONTENT_TYPE_MSGPACK.into();
        env.payload = encode_payload(args, CONTENT_TYPE_MSGPACK)?;
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        env.expect = Some(ExpectedReply {
            performative: Performative::Inform,
            timeout_ms,
        });
        // The coordinator needs the recipients' time plus its own fan-out and report.
        let overall = timeout + BROADCAST_REPORT_MARGIN;
        let reply = self
            .inner
            .out
            .exchange(&subject, env, overall, &opentelemetry::Context::current())
            .await?;
        reply.payload_as()
    }

    /// Sends `call` to every agent in `to` and collects their replies as `collect` asks,
    /// within the call's timeout (one deadline for all; the agent's request timeout by
    /// default). Each recipient gets a request of its own, sent at once: its own message id,
    /// `to` naming it alone, and one `correlation_id` shared by every copy (the report's
    /// `multicast_id`). Build the call with [`Call::multicast`]; its payload, timeout,
    /// priority, headers, session, retry policy and the rest apply to every copy.
    ///
    /// The report has one line per recipient, in the order of `to`: replied (the reply),
    /// refused (its status and reason), no responders, silent (nothing by the deadline), not
    /// awaited (the collection ended first: its request is dropped and a late reply ignored)
    /// or failed (on this side); and whether enough replies came ([`MulticastReport::met`]).
    ///
    /// ```no_run
    /// # async fn run(agent: chorus_sdk::Agent) -> Result<(), chorus_sdk::SdkError> {
    /// use std::time::Duration;
    /// use chorus_sdk::{Call, Collect};
    /// let call = Call::multicast("review").payload(&"draft 3")?.timeout(Duration::from_secs(5));
    /// let report = agent
    ///     .multicast(call, &["alice", "bob", "carol"], Collect::Quorum(2))
    ///     .await?;
    /// if report.met {
    ///     for (agent, reply) in report.replies() {
    ///         let verdict: String = reply.payload_as()?;
    ///         println!("{agent}: {verdict}");
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] (5018), before anything is sent, for no recipients, more than
    /// [`MAX_MULTICAST_RECIPIENTS`](crate::MAX_MULTICAST_RECIPIENTS), an invalid or repeated
    /// agent id, an invalid command name, a `First` or `Quorum` `n` of 0 or more than the
    /// recipients, a call to a capability or one with a fixed [`Call::id`]. A recipient's
    /// failure is in the report, not an error.
    pub async fn multicast<S: AsRef<str>>(
        &self,
        call: Call,
        to: &[S],
        collect: Collect,
    ) -> Result<MulticastReport, SdkError> {
        self.inner.out.multicast(call, to, collect, None).await
    }

    /// Sends a notification (`docs/PROTOCOL.md` section 7.14): a push that expects no reply
    /// and needs no topic subscription on the receiver's side, taken by its
    /// [`on_notification`](Agent::on_notification) handlers.
    ///
    /// - To one agent ([`Notify::agent`]): published on its notification subject, or stored
    ///   in its durable inbox when [`Notify::durable`]; returns once published (stored),
    ///   without waiting for the receiver. The report has its one line: `delivered`
    ///   (published, whether or not anyone listened) or `stored`.
    /// - To a group, a capability's holders or every agent ([`Notify::group`],
    ///   [`Notify::capability`], [`Notify::all`]): sent to the coordinator, which pushes one
    ///   copy to each live member (stored in each inbox when durable) and reports per
    ///   recipient: `delivered` (published), `stored` or `failed`.
    ///
    /// ```no_run
    /// # async fn run(agent: chorus_sdk::Agent) -> Result<(), chorus_sdk::SdkError> {
    /// use chorus_sdk::{Notify, Outcome};
    /// agent.notify(Notify::agent("ops-bot", "disk-full").payload(&"db-2 at 91%")?).await?;
    /// let report = agent
    ///     .notify(Notify::group("night-shift", "maintenance").payload(&"22:00")?.durable())
    ///     .await?;
    /// println!("stored for {} agents", report.count(Outcome::Stored));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`SdkError::Subject`] when the agent, group, capability or notification name is not
    /// valid; [`SdkError::InvalidCall`] when the headers break their limits;
    /// [`SdkError::Codec`] when it cannot be encoded; [`SdkError::Broker`] when the server
    /// does not take it (durable: no ack in three tries); for a group, [`SdkError::Timeout`],
    /// [`SdkError::NoResponders`] or [`SdkError::Remote`] when no coordinator reports. A
    /// group member's failure is in the report, not an error.
    pub async fn notify(&self, notify: Notify) -> Result<NotifyReport, SdkError> {
        self.inner.sender.notify(notify, None).await
    }

    /// Sends a one-way command in the call's delivery class (or the agent's default):
    ///
    /// - at most once: published on core NATS to the agent's command subject; no reply, no
    ///   storage; gone if nobody is listening;
    /// - at least once: stored in the recipient's durable inbox, redelivered until handled,
    ///   retried by the retry policy, dead-lettered when it cannot be handled;
    /// - exactly once: at least once, and the recipient records the message id so the handler
    ///   runs once however many copies arrive.
    ///
    /// Durable sends return once JetStream has stored the message; a publish whose ack is lost
    /// is sent again, stored once for exactly-once (the server dedupes its message id) and
    /// possibly twice for at least once (which allows a duplicate).
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] for a durable send to a capability; [`SdkError::Subject`],
    /// [`SdkError::Encryption`] or [`SdkError::Codec`] when it cannot be built;
    /// [`SdkError::Broker`] when the server does not take it (durable: no ack in three tries).
    pub async fn send(&self, call: Call) -> Result<Receipt, SdkError> {
        self.inner.sender.send(call).await
    }

    /// [`send`](Agent::send) with at least once (or exactly once, if the call asks for it).
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] for a durable send to a capability; [`SdkError::Subject`],
    /// [`SdkError::Encryption`] or [`SdkError::Codec`] when it cannot be built;
    /// [`SdkError::Broker`] when the server does not take it (durable: no ack in three tries).
    pub async fn send_durable(&self, call: Call) -> Result<Receipt, SdkError> {
        let class = match call.delivery {
            Some(DeliveryClass::ExactlyOnce) => DeliveryClass::ExactlyOnce,
            _ => DeliveryClass::AtLeastOnce,
        };
        self.send(call.delivery(class)).await
    }

    /// Sends many one-way commands at once. Durable ones are published with up to
    /// [`BATCH_ACKS_IN_FLIGHT`](crate::durable::BATCH_ACKS_IN_FLIGHT) acks outstanding and
    /// their acks awaited together; core ones are published and flushed once. Results come
    /// back in the order of `calls`; a publisher that outruns the server waits here instead of
    /// buffering without bound.
    pub async fn send_batch(&self, calls: Vec<Call>) -> Vec<Result<Receipt, SdkError>> {
        self.inner.sender.send_batch(calls).await
    }

    /// Overrides the load and availability announced in heartbeats (by default the load is
    /// the share of `max_in_flight` in use).
    pub fn set_load(&self, load: f32, availability: Availability) {
        let presence = &self.inner.presence;
        *lock(&presence.load_override) = Some((load.clamp(0.0, 1.0), availability));
        presence.changed.notify_one();
    }

    /// How this agent's circuit breaker for `destination` (`agent:<id>` or `cap:<capability>`)
    /// stands: always closed without [`AgentOptions::circuit_breaker`](crate::AgentOptions::circuit_breaker).
    pub fn circuit(&self, destination: &str) -> crate::outbound::CircuitState {
        self.inner.out.breakers.state(destination)
    }

    /// Describes command or capability `name` in the manifest, for callers that list tools
    /// (MCP hosts through the gateway): what it does, the JSON Schema its payload follows,
    /// how its reply reads. Register its handler first; announced at once.
    ///
    /// ```no_run
    /// # async fn run(agent: chorus_sdk::Agent) -> Result<(), chorus_sdk::SdkError> {
    /// use chorus_sdk::Description;
    /// agent.describe(
    ///     "calculation",
    ///     Description::new("Adds, subtracts, multiplies or divides two numbers.").input_schema(
    ///         serde_json::json!({"type": "object", "required": ["op", "a", "b"]}),
    ///     ),
    /// )?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] when the agent has no command or capability `name`, or the
    /// description is too long, the schema no JSON object, too large or not JSON Schema, or
    /// the reply format unknown.
    pub fn describe(&self, name: &str, description: Description) -> Result<(), SdkError> {
        description
            .check()
            .map_err(|e| SdkError::InvalidCall(format!("describe {name}: {e}")))?;
        if !self.inner.endpoints.describe(name, &description) {
            return Err(SdkError::InvalidCall(format!(
                "describe {name}: no command or capability {name} here (register its handler first)"
            )));
        }
        self.inner.presence.changed.notify_one();
        Ok(())
    }

    /// The agent's current capability manifest.
    pub fn manifest(&self) -> Manifest {
        self.inner.presence.manifest()
    }
}
