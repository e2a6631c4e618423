//! Requests: a call's envelope and subject, sent and its reply awaited.

use crate::Report;
use std::time::Duration;

use chorus_broker_adapter::ErrorKind;

use super::{Call, Outbound, Parent, Reply, Router, Routing, Target};
use crate::error::SdkError;
use crate::metrics::sdk_metrics;
use crate::protocol::codec;
use crate::protocol::envelope::{
    CONTENT_TYPE_MSGPACK, Envelope, ExpectedReply, Kind, Performative, now_ms,
};
use crate::protocol::registry::{AgentRecord, DiscoverQuery};
use crate::protocol::status::StatusCode;
use crate::stats::AgentCounters;
use uuid::Uuid;

impl Outbound {
    /// Builds the envelope of a call and the subject it goes to, with the time to wait for
    /// its reply (the call's timeout, within the inherited deadline).
    pub(crate) fn prepare(
        &self,
        call: Call,
        parent: Option<&Envelope>,
    ) -> Result<(String, Envelope, Duration), SdkError> {
        super::call::check_headers(&call.headers)?;
        let mut env = Envelope::new(call.kind, Performative::Request, self.link.id.as_str());
        let subject = match call.target {
            Target::Agent(agent) if call.kind == Kind::Notification => {
                let name = call.name.as_deref().unwrap_or_default();
                crate::subject::validate_token("notification name", name)?;
                let subject = self.link.subjects.notification(&agent)?;
                env.performative = Performative::Inform;
                env.to = vec![agent];
                subject
            }
            Target::Agent(agent) => {
                let name = call.name.as_deref().unwrap_or_default();
                let subject = self.link.subjects.command(&agent, name)?;
                env.to = vec![agent];
                subject
            }
            Target::Capability(capability) => {
                let subject = self.link.subjects.capability(&capability)?;
                env.capability = Some(capability);
                subject
            }
            Target::CapabilityAt { agent, capability } => {
                let subject = self.link.subjects.capability_at(&agent, &capability)?;
                env.to = vec![agent];
                env.capability = Some(capability);
                subject
            }
        };
        env.name = call.name;
        self.inherit(&mut env, parent)?;
        if parent.is_none() && call.correlation.is_some() {
            env.correlation_id = call.correlation;
        }
        if let Some(after) = call.deadline {
            let at = now_ms().saturating_add(u64::try_from(after.as_millis()).unwrap_or(u64::MAX));
            env.deadline_ms = Some(env.deadline_ms.map_or(at, |inherited| inherited.min(at)));
        }
        let mut timeout = call.timeout.unwrap_or(self.request_timeout);
        if let Some(left) = env.remaining_at(now_ms()) {
            timeout = timeout.min(left);
        }
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        env.ttl_ms = Some(timeout_ms);
        env.expect = Some(ExpectedReply {
            performative: Performative::Inform,
            timeout_ms,
        });
        env.priority = call.priority;
        env.headers = call.headers;
        env.content_type = call.content_type;
        env.payload = call.payload;
        env.delivery = call.delivery.unwrap_or_default();
        env.token = call.token;
        if call.session.is_some() {
            env.session_id = call.session;
        }
        if call.customer.is_some() {
            env.customer_id = call.customer;
        }
        if let Some(id) = call.id {
            env.id = id;
        }
        if !call.encrypt_for.is_empty() {
            self.encrypt_for(&mut env, &call.encrypt_for)?;
        }
        Ok((subject, env, timeout))
    }

    /// Sends a call (as a forward of `parent`, if given) and waits for its reply.
    pub(crate) async fn call(
        &self,
        mut call: Call,
        parent: Option<Parent<'_>>,
    ) -> Result<Reply, SdkError> {
        if call.retry.is_none() && !call.dead_letter {
            return self.attempt(call, parent).await;
        }
        // Every attempt carries the same id: the receiver's exactly-once record answers a
        // copy of one it already handled.
        let id = *call.id.get_or_insert_with(Uuid::now_v7);
        let first_ms = now_ms();
        let policy = call.retry.clone();
        let mut attempt: u64 = 1;
        loop {
            let result = self.attempt(call.clone(), parent).await;
            let err = match result {
                Ok(reply) => return Ok(reply),
                Err(err) => err,
            };
            let status = err.status();
            let again = !matches!(err, SdkError::CircuitOpen { .. })
                && policy
                    .as_ref()
                    .is_some_and(|p| p.should_retry(status, attempt));
            if again {
                let pause = policy.as_ref().map_or(Duration::ZERO, |p| {
                    p.delay(attempt, crate::retry::random_fraction())
                });
                AgentCounters::bump(&self.link.counters.retries);
                tracing::debug!(agent = %self.link.id, %id, attempt, %status, ?pause, "request failed: retrying with the same id");
                tokio::time::sleep(pause).await;
                attempt += 1;
                continue;
            }
            if call.dead_letter {
                let exhausted = policy
                    .as_ref()
                    .is_some_and(|p| p.retry_on.contains(&status));
                self.dead_letter_request(call, parent, id, attempt, first_ms, exhausted, &err)
                    .await;
            }
            return Err(err);
        }
    }

    /// Writes a request that failed for good to the dead-letter queue.
    #[allow(clippy::too_many_arguments)]
    async fn dead_letter_request(
        &self,
        call: Call,
        parent: Option<Parent<'_>>,
        id: Uuid,
        attempts: u64,
        first_ms: u64,
        exhausted: bool,
        err: &SdkError,
    ) {
        use crate::dead_letter::{DeadLetter, DeadLetterReason, write_dead_letter};
        let agent = match &call.target {
            Target::Agent(agent) | Target::CapabilityAt { agent, .. } => agent.clone(),
            Target::Capability(capability) => capability.replace('.', "-"),
        };
        let written = async {
            let (subject, mut env, _) = self.prepare(call, parent.map(|p| p.env))?;
            self.seal(&subject, &mut env);
            let envelope = self.encode(&subject, &env)?;
            let letter = DeadLetter {
                reason: if exhausted {
                    DeadLetterReason::MaxAttempts
                } else {
                    DeadLetterReason::Refused
                },
                status: err.status(),
                detail: err.to_string(),
                agent,
                subject,
                envelope,
                headers: Vec::new(),
                message_id: Some(id),
                attempts,
                stored_ms: first_ms,
                dead_lettered_ms: now_ms(),
                source: None,
                omitted: None,
            };
            write_dead_letter(
                &self.link.js,
                &self.link.subjects,
                &letter,
                self.link.broker.max_payload(),
            )
            .await?;
            Ok::<_, SdkError>(())
        };
        match written.await {
            Ok(()) => AgentCounters::bump(&self.link.counters.dead_lettered),
            Err(e) => {
                tracing::warn!(agent = %self.link.id, %id, error = %Report(&e), "a failed request could not be dead-lettered");
            }
        }
    }

    /// One attempt at a call: through its destination's circuit breaker, routed by load if
    /// asked.
    async fn attempt(&self, call: Call, parent: Option<Parent<'_>>) -> Result<Reply, SdkError> {
        let destination = match &call.target {
            Target::Agent(agent) | Target::CapabilityAt { agent, .. } => format!("agent:{agent}"),
            Target::Capability(capability) => format!("cap:{capability}"),
        };
        let ticket = self.breakers.admit(&destination)?;
        let result = self.send_call(call, parent).await;
        ticket.finish(match &result {
            Ok(reply) => reply.status(),
            Err(e) => e.status(),
        });
        result
    }

    /// A call's exchange: routed by load if asked, else to its target.
    async fn send_call(&self, call: Call, parent: Option<Parent<'_>>) -> Result<Reply, SdkError> {
        let otel = parent.map_or_else(opentelemetry::Context::current, |p| p.otel.clone());
        if call.routing.unwrap_or(self.routing) == Routing::LeastLoaded
            && let Target::Capability(capability) = &call.target
            && let Some(chosen) = self.route(capability, call.timeout).await
        {
            let mut direct = call.clone();
            direct.target = Target::CapabilityAt {
                agent: chosen.agent().to_owned(),
                capability: capability.clone(),
            };
            let (subject, env, timeout) = self.prepare(direct, parent.map(|p| p.env))?;
            let result = self.exchange(&subject, env, timeout, &otel).await;
            drop(chosen);
            match result {
                // The holder has gone since discovery said otherwise: the queue group serves.
                Err(e) if e.status() == StatusCode::NO_RESPONDERS => {
                    tracing::debug!(agent = %self.link.id, %capability, holder = %subject, "the chosen holder has gone: the queue group serves");
                    self.router.forget(capability);
                }
                done => return done,
            }
        }
        let (subject, env, timeout) = self.prepare(call, parent.map(|p| p.env))?;
        self.exchange(&subject, env, timeout, &otel).await
    }

    /// The holder of `capability` to call, by load, counted in flight; `None`: the queue group.
    async fn route(
        &self,
        capability: &str,
        timeout: Option<Duration>,
    ) -> Option<super::route::InFlight> {
        if self.router.cached(capability).is_none() {
            let wait = Router::lookup_timeout(timeout.unwrap_or(self.request_timeout));
            match self
                .discover(&DiscoverQuery::capability(capability), wait)
                .await
            {
                Ok(records) => self.router.learn(capability, &records),
                Err(err) => {
                    tracing::debug!(agent = %self.link.id, %capability, error = %Report(&err), "no registry to route by: the queue group serves");
                    self.router.learn(capability, &[]);
                }
            }
        }
        self.router.choose(capability)
    }

    /// The live agents matching `query`, least loaded first, from the registry.
    pub(crate) async fn discover(
        &self,
        query: &DiscoverQuery,
        timeout: Duration,
    ) -> Result<Vec<AgentRecord>, SdkError> {
        let mut env = Envelope::new(Kind::Request, Performative::Discover, self.link.id.as_str());
        env.content_type = CONTENT_TYPE_MSGPACK.into();
        env.payload = codec::encode_payload(query, CONTENT_TYPE_MSGPACK)?;
        let subject = self.link.subjects.discover();
        let reply = self
            .exchange(&subject, env, timeout, &opentelemetry::Context::current())
            .await?;
        reply.payload_as()
    }

    /// Sends `env` as a request on `subject` and waits up to `timeout` for the reply.
    pub(crate) async fn exchange(
        &self,
        subject: &str,
        mut env: Envelope,
        timeout: Duration,
        parent: &opentelemetry::Context,
    ) -> Result<Reply, SdkError> {
        let (span, trace) = crate::trace::start(
            opentelemetry::trace::SpanKind::Client,
            parent,
            env.trace.as_ref(),
            || {
                format!(
                    "chorus.request {}",
                    env.name
                        .as_deref()
                        .or(env.capability.as_deref())
                        .unwrap_or(subject)
                )
            },
            || crate::trace::attributes(&self.link.id, &env),
        );
        env.trace = Some(trace);
        self.fit(&mut env).await?;
        self.seal(subject, &mut env);
        let bytes = self.encode(subject, &env)?;
        AgentCounters::bump(&self.link.counters.requests_sent);
        let started = std::time::Instant::now();
        let result = self.request_reply(subject, bytes, timeout).await;
        let status = match &result {
            Ok(reply) => reply.status(),
            Err(err) => err.status(),
        };
        sdk_metrics()
            .request_seconds
            .with_label_values(&[self.link.id.as_str(), status.label()])
            .observe(started.elapsed().as_secs_f64());
        crate::trace::finish(span.as_ref(), result.as_ref().err().map(|e| e.to_string()));
        result
    }

    async fn request_reply(
        &self,
        subject: &str,
        bytes: bytes::Bytes,
        timeout: Duration,
    ) -> Result<Reply, SdkError> {
        let msg = self
            .link
            .broker
            .request(subject, None, bytes, timeout)
            .await
            .map_err(|e| match e.kind() {
                ErrorKind::TimedOut => SdkError::Timeout(timeout),
                ErrorKind::NoResponders => SdkError::NoResponders(subject.to_owned()),
                _ => SdkError::Broker(e),
            })?;
        let (mut reply, _) = codec::decode_limited(msg.payload(), self.max_message_bytes)?;
        if let Some(verifier) = &self.verifier
            && let Err((status, reason)) =
                verifier.verify(msg.subject(), &reply, crate::protocol::envelope::now_ms())
        {
            AgentCounters::bump(&self.link.counters.security_refused);
            tracing::warn!(agent = %self.link.id, from = %reply.from, id = %reply.id, %status, %reason, "reply refused by signature check");
            return Err(SdkError::Remote {
                status,
                reason: format!("the reply from {} was refused: {reason}", reply.from),
                from: Some(reply.from.to_string()),
            });
        }
        match reply.status {
            Some(status) if !status.is_success() => Err(SdkError::Remote {
                status,
                reason: reply.reason.unwrap_or_default(),
                from: Some(reply.from.to_string()),
            }),
            _ => {
                self.open_reply(&mut reply).await?;
                Ok(Reply { envelope: reply })
            }
        }
    }
}
