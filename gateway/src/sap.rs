//! The Synadia Agent Protocol 0.3 binding: a Chorus agent's command, or a capability, answers
//! as an SAP agent, so a NATS user's SAP client (`synadia-ai-agents`) discovers and prompts
//! it, and every prompt is a Chorus task in the bus's task stream.
//!
//! Each `[[gateway.sap]]` entry registers one `agents` micro service (ADR-32 answers on
//! `$SRV.PING|INFO|STATS`, metadata `agent`, `owner`, `session`, `protocol_version`) on the
//! connection of the edge identity it names, with two endpoints in the queue group `agents`:
//!
//! - `prompt` (`agents.prompt.<agent>.<owner>.<session>`): the body is `{"prompt": text}` or
//!   the text itself. The answer is a stream of plain messages to the request's reply subject:
//!   `{"type":"status","data":"ack"}` at once (again after 30 s without anything to say), the
//!   task's chunks as `{"type":"response","data":text}` (its result instead when it streamed
//!   none), a question as a `query` chunk whose reply continues the task, then the terminator,
//!   an empty message without headers. A task that fails, is refused, cancelled or runs out of
//!   time ends in one error message (headers `Nats-Service-Error-Code`, the HTTP status that
//!   says what its Chorus code says, or the nearest of SAP's codes, and `Nats-Service-Error`;
//!   the body `{"error": label, "message": reason, "chorus_status": code}` as SAP section 9.1
//!   writes it) before the terminator.
//! - `status` (`agents.status.<agent>.<owner>.<session>`): one heartbeat payload.
//!
//! Heartbeats go to `agents.hb.<agent>.<owner>.<session>` when it starts and every
//! `heartbeat_interval_s` after.

use chorus_sdk::Report;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chorus_broker_adapter::{Broker, Headers, Message, Subscription};
use chorus_sdk::task::{TaskHandle, TaskMessage, TaskUpdate};
use chorus_sdk::{Agent, StatusCode, TaskState};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::api::{self, ApiError};
use super::config::SapBinding;
use super::tasks::json_of;
use crate::error::{Error, ErrorKind, Result};

/// The micro service every SAP agent registers as.
const SERVICE: &str = "agents";
/// The queue group of both endpoints.
const QUEUE: &str = "agents";
/// The protocol version this binding speaks.
const PROTOCOL_VERSION: &str = "0.3";
/// Silence after which a prompt's stream is told `ack` again (the protocol allows 60 s).
const KEEPALIVE: Duration = Duration::from_secs(30);
/// Room left beside a prompt for the envelope that carries it on the bus.
const ENVELOPE_ROOM: usize = 4096;
/// How long starting waits for the server to confirm the subscriptions.
const SYNC_TIMEOUT: Duration = Duration::from_secs(5);

/// An endpoint's counters, for `$SRV.STATS`.
#[derive(Default)]
struct EndpointStats {
    requests: AtomicU64,
    errors: AtomicU64,
    processing_ns: AtomicU64,
    last_error: Mutex<String>,
}

impl EndpointStats {
    fn record(&self, started: Instant, error: Option<&str>) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.processing_ns.fetch_add(ns, Ordering::Relaxed);
        if let Some(e) = error {
            self.errors.fetch_add(1, Ordering::Relaxed);
            *self
                .last_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = e.to_owned();
        }
    }

    fn json(&self, name: &str, subject: &str) -> Value {
        let n = self.requests.load(Ordering::Relaxed);
        let ns = self.processing_ns.load(Ordering::Relaxed);
        json!({
            "name": name,
            "subject": subject,
            "queue_group": QUEUE,
            "num_requests": n,
            "num_errors": self.errors.load(Ordering::Relaxed),
            "last_error": self.last_error.lock().unwrap_or_else(PoisonError::into_inner).clone(),
            "processing_time": ns,
            "average_processing_time": ns.checked_div(n).unwrap_or(0),
        })
    }
}

/// One running SAP agent.
struct Binding {
    config: SapBinding,
    /// The edge identity's agent: it submits the tasks, its connection carries the service.
    agent: Agent,
    broker: Broker,
    /// The service instance's id (`instance_id` in heartbeats).
    id: String,
    prompt_subject: String,
    status_subject: String,
    heartbeat_subject: String,
    started_ms: u64,
    /// The longest prompt body, as the protocol writes sizes.
    max_payload: String,
    prompts: EndpointStats,
    status: EndpointStats,
    /// Prompts running at once; beyond them a prompt is answered 503 at once.
    slots: Arc<Semaphore>,
    stop: CancellationToken,
    tracker: TaskTracker,
}

/// Starts the SAP agent `config` describes on `agent`'s connection: its subscriptions are in
/// place at the server when this returns, and its first heartbeat is sent. Its tasks run on
/// `tracker` until `stop`.
pub(crate) async fn start(
    config: &SapBinding,
    agent: Agent,
    max_concurrent: usize,
    stop: CancellationToken,
    tracker: TaskTracker,
) -> Result<()> {
    let name = format!("{}.{}.{}", config.agent, config.owner, config.session);
    let broker = agent.broker().clone();
    let room = broker.max_payload().saturating_sub(ENVELOPE_ROOM).max(1024);
    let binding = Arc::new(Binding {
        id: Uuid::now_v7().simple().to_string(),
        prompt_subject: format!("{SERVICE}.prompt.{name}"),
        status_subject: format!("{SERVICE}.status.{name}"),
        heartbeat_subject: format!("{SERVICE}.hb.{name}"),
        started_ms: chorus_sdk::envelope::now_ms(),
        max_payload: human_bytes(room),
        prompts: EndpointStats::default(),
        status: EndpointStats::default(),
        slots: Arc::new(Semaphore::new(max_concurrent)),
        config: config.clone(),
        agent,
        broker,
        stop,
        tracker,
    });
    let b = &binding;
    let cannot = |what: &str| {
        Error::wrap(
            ErrorKind::Broker,
            format!("gateway: SAP agent {name}: cannot subscribe to {what}"),
        )
    };
    let prompts = b
        .broker
        .queue_subscribe(&b.prompt_subject, QUEUE)
        .await
        .map_err(cannot(&b.prompt_subject))?;
    let status = b
        .broker
        .queue_subscribe(&b.status_subject, QUEUE)
        .await
        .map_err(cannot(&b.status_subject))?;
    let mut discovery = Vec::new();
    for subject in [
        "$SRV.*".to_owned(),
        format!("$SRV.*.{SERVICE}"),
        format!("$SRV.*.{SERVICE}.{}", b.id),
    ] {
        discovery.push(
            b.broker
                .subscribe(&subject)
                .await
                .map_err(cannot(&subject))?,
        );
    }
    b.broker.sync(SYNC_TIMEOUT).await.map_err(Error::wrap(
        ErrorKind::Broker,
        format!("gateway: SAP agent {name}: the server did not confirm its subscriptions"),
    ))?;
    b.tracker.spawn(Arc::clone(b).serve_prompts(prompts));
    b.tracker.spawn(Arc::clone(b).serve_status(status));
    for sub in discovery {
        b.tracker.spawn(Arc::clone(b).serve_discovery(sub));
    }
    b.heartbeat().await;
    b.tracker.spawn(Arc::clone(b).beat());
    tracing::info!(sap = %name, instance = %b.id, "SAP agent registered");
    Ok(())
}

/// `bytes` as the protocol writes sizes: a whole number of GB, MB or KB if it is one, else B.
fn human_bytes(bytes: usize) -> String {
    for (unit, size) in [("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)] {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{}{unit}", bytes / size);
        }
    }
    format!("{bytes}B")
}

/// What a prompt asks, or why it cannot be read.
fn prompt_text(body: &[u8]) -> std::result::Result<String, String> {
    let text = std::str::from_utf8(body).map_err(|_| "the prompt is not UTF-8".to_owned())?;
    let prompt = if text.trim_start().starts_with('{') {
        let envelope: Value =
            serde_json::from_str(text).map_err(|e| format!("the prompt is not JSON: {e}"))?;
        if envelope
            .get("attachments")
            .is_some_and(|a| !a.is_null() && a.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err("attachments are not accepted (attachments_ok is false)".into());
        }
        match envelope.get("prompt") {
            Some(Value::String(p)) => p.clone(),
            _ => return Err("the envelope has no prompt string".into()),
        }
    } else {
        text.to_owned()
    };
    if prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    Ok(prompt)
}

/// A payload as response text: a string as it is, other JSON as its text, nothing as "".
/// The SAP status code (its section 9.2 allows 400, 401, 403, 404, 409, 429 and 500 only) for
/// a Chorus code: the HTTP status the gateway's routes give, or the nearest the table has.
fn sap_code(status: StatusCode) -> u16 {
    match api::http_status(status).as_u16() {
        code @ (400 | 401 | 403 | 404 | 409 | 429) => code,
        410 => 404,
        413 | 415 | 422 => 400,
        _ => 500,
    }
}

fn text_of(value: &Value) -> String {
    match value {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Why a prompt ended without its result: the Chorus code and the reason.
struct Failure {
    status: StatusCode,
    reason: String,
}

impl Failure {
    fn new(status: StatusCode, reason: impl Into<String>) -> Self {
        Failure {
            status,
            reason: reason.into(),
        }
    }
}

impl From<chorus_sdk::SdkError> for Failure {
    fn from(e: chorus_sdk::SdkError) -> Self {
        Failure::new(e.status(), e.to_string())
    }
}

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Self {
        let body = e.body();
        let status = body["status"]
            .as_u64()
            .and_then(|s| u16::try_from(s).ok())
            .map_or(StatusCode::INTERNAL, StatusCode);
        Failure::new(status, body["reason"].as_str().unwrap_or_default())
    }
}

/// What a prompt's stream is doing while its task runs.
struct Prompt<'a> {
    binding: &'a Binding,
    reply: &'a str,
    task: Uuid,
    /// Whether a chunk went out (then the result is not sent again as a response).
    chunked: bool,
    /// When the stream last carried something.
    last_sent: Instant,
    /// The subject an answer to the task's open question arrives on.
    question: Option<Subscription>,
}

impl Binding {
    fn name(&self) -> String {
        format!(
            "{}.{}.{}",
            self.config.agent, self.config.owner, self.config.session
        )
    }

    async fn publish(&self, subject: &str, headers: Option<Headers>, body: Bytes) {
        if let Err(err) = self.broker.publish_with(subject, None, headers, body).await {
            tracing::debug!(sap = %self.name(), %subject, error = %Report(&err), "SAP message not sent");
        }
    }

    fn heartbeat_payload(&self) -> Value {
        json!({
            "agent": self.config.agent,
            "owner": self.config.owner,
            "session": self.config.session,
            "instance_id": self.id,
            "ts": time_seconds(chorus_sdk::envelope::now_ms()),
            "interval_s": self.config.heartbeat_interval_s,
        })
    }

    async fn heartbeat(&self) {
        let body = Bytes::from(self.heartbeat_payload().to_string());
        self.publish(&self.heartbeat_subject, None, body).await;
    }

    async fn beat(self: Arc<Self>) {
        let every = Duration::from_secs(self.config.heartbeat_interval_s);
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = self.stop.cancelled() => return,
                _ = ticks.tick() => self.heartbeat().await,
            }
        }
    }

    async fn serve_status(self: Arc<Self>, mut sub: Subscription) {
        while let Some(msg) = sub.next_until(self.stop.cancelled()).await {
            let started = Instant::now();
            if let Some(reply) = msg.reply() {
                let body = Bytes::from(self.heartbeat_payload().to_string());
                self.publish(reply, None, body).await;
            }
            self.status.record(started, None);
        }
    }

    async fn serve_discovery(self: Arc<Self>, mut sub: Subscription) {
        while let Some(msg) = sub.next_until(self.stop.cancelled()).await {
            if let (Some(reply), Some(body)) = (msg.reply(), self.service_answer(&msg)) {
                self.publish(reply, None, Bytes::from(body.to_string()))
                    .await;
            }
        }
    }

    /// The ADR-32 answer to a `$SRV.PING|INFO|STATS` request.
    fn service_answer(&self, msg: &Message) -> Option<Value> {
        let verb = msg.subject().split('.').nth(1)?;
        let mut body = json!({
            "name": SERVICE,
            "id": self.id,
            "version": env!("CARGO_PKG_VERSION"),
            "metadata": {
                "agent": self.config.agent,
                "owner": self.config.owner,
                "session": self.config.session,
                "protocol_version": PROTOCOL_VERSION,
            },
        });
        match verb {
            "PING" => body["type"] = json!("io.nats.micro.v1.ping_response"),
            "INFO" => {
                body["type"] = json!("io.nats.micro.v1.info_response");
                body["description"] = json!(self.description());
                body["endpoints"] = json!([
                    {
                        "name": "prompt",
                        "subject": self.prompt_subject,
                        "queue_group": QUEUE,
                        "metadata": {"max_payload": self.max_payload, "attachments_ok": "false"},
                    },
                    {
                        "name": "status",
                        "subject": self.status_subject,
                        "queue_group": QUEUE,
                        "metadata": {},
                    },
                ]);
            }
            "STATS" => {
                body["type"] = json!("io.nats.micro.v1.stats_response");
                body["started"] = json!(chorus_sdk::envelope::rfc3339(self.started_ms));
                body["endpoints"] = json!([
                    self.prompts.json("prompt", &self.prompt_subject),
                    self.status.json("status", &self.status_subject),
                ]);
            }
            _ => return None,
        }
        Some(body)
    }

    fn description(&self) -> String {
        if let Some(d) = &self.config.description {
            return d.clone();
        }
        match (
            &self.config.to,
            &self.config.command,
            &self.config.capability,
        ) {
            (Some(to), Some(command), _) => {
                format!("The command {command} of the Chorus agent {to}, run as a task.")
            }
            (_, _, Some(c)) => format!("The capability {c} on a Chorus bus, run as a task."),
            _ => "A Chorus agent.".to_owned(),
        }
    }

    async fn serve_prompts(self: Arc<Self>, mut sub: Subscription) {
        while let Some(msg) = sub.next_until(self.stop.cancelled()).await {
            let Some(reply) = msg.reply().map(str::to_owned) else {
                tracing::debug!(sap = %self.name(), "a prompt without a reply subject: dropped");
                continue;
            };
            let this = Arc::clone(&self);
            match Arc::clone(&self.slots).try_acquire_owned() {
                Ok(slot) => {
                    self.tracker.spawn(async move {
                        this.answer(&reply, msg.payload()).await;
                        drop(slot);
                    });
                }
                Err(_) => {
                    let busy = Failure::new(
                        StatusCode::UNAVAILABLE,
                        "too many prompts at once: try again later",
                    );
                    self.prompts.record(Instant::now(), Some(&busy.reason));
                    self.fail(&reply, &busy).await;
                }
            }
        }
    }

    /// Answers one prompt: ack, its task's stream, the terminator.
    async fn answer(&self, reply: &str, body: &[u8]) {
        let started = Instant::now();
        let outcome = match prompt_text(body) {
            Err(reason) => Err(Failure::new(StatusCode::INVALID_ARGUMENT, reason)),
            Ok(prompt) => {
                self.chunk(reply, "status", &json!("ack")).await;
                self.run(reply, &prompt).await
            }
        };
        if let Err(failure) = &outcome {
            self.fail(reply, failure).await;
        }
        self.prompts
            .record(started, outcome.as_ref().err().map(|f| f.reason.as_str()));
    }

    /// A `{"type", "data"}` chunk on `reply`.
    async fn chunk(&self, reply: &str, kind: &str, data: &Value) {
        let body = json!({"type": kind, "data": data}).to_string();
        self.publish(reply, None, Bytes::from(body)).await;
    }

    /// The error message, then the terminator.
    async fn fail(&self, reply: &str, failure: &Failure) {
        let http = sap_code(failure.status).to_string();
        let mut headers = Headers::new();
        let described = format!("{} {}", failure.status.0, failure.reason);
        // The reason is the caller's to read; a line break would end the header.
        let one_line: String = described
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let set = headers
            .insert("Nats-Service-Error-Code", &http)
            .and_then(|()| headers.insert("Nats-Service-Error", &one_line));
        if let Err(err) = set {
            tracing::debug!(error = %Report(&err), "SAP error headers not set");
        }
        let body = json!({
            "error": failure.status.label(),
            "message": failure.reason,
            "chorus_status": failure.status.0,
        });
        self.publish(reply, Some(headers), Bytes::from(body.to_string()))
            .await;
        self.terminate(reply).await;
    }

    /// The end of a stream: an empty message without headers.
    async fn terminate(&self, reply: &str) {
        self.publish(reply, None, Bytes::new()).await;
    }

    /// Submits the prompt's task and streams it to `reply`; `Ok` when it completed (its
    /// terminator sent), the failure otherwise.
    async fn run(&self, reply: &str, prompt: &str) -> std::result::Result<(), Failure> {
        let call = api::call_to(
            self.config.to.as_deref(),
            self.config.command.as_deref(),
            self.config.capability.as_deref(),
        )?;
        let handle = self
            .agent
            .submit(call.json_payload(&prompt)?)
            .await
            .map_err(Failure::from)?;
        let mut stream = Prompt {
            binding: self,
            reply,
            task: handle.id(),
            chunked: false,
            last_sent: Instant::now(),
            question: None,
        };
        let deadline = Duration::from_millis(self.config.max_prompt_ms);
        let followed = tokio::select! {
            done = stream.follow(&handle) => done,
            () = tokio::time::sleep(deadline) => Err(Failure::new(
                StatusCode::TIMEOUT,
                format!("the task did not finish within {} ms: cancelled", self.config.max_prompt_ms),
            )),
            () = self.stop.cancelled() => Err(Failure::new(
                StatusCode::UNAVAILABLE,
                format!("the gateway is stopping; the task {} goes on without this stream", handle.id()),
            )),
        };
        if let Some(mut question) = stream.question.take() {
            let _ = question.unsubscribe().await;
        }
        match followed {
            Ok(()) => {
                self.terminate(reply).await;
                Ok(())
            }
            Err(failure) => {
                if failure.status == StatusCode::TIMEOUT
                    && let Err(err) = handle.cancel().await
                {
                    tracing::debug!(task = %handle.id(), error = %Report(&err), "overdue SAP task not cancelled");
                }
                Err(failure)
            }
        }
    }
}

impl Prompt<'_> {
    /// Follows the task to its end, streaming what the caller should see.
    async fn follow(&mut self, handle: &TaskHandle) -> std::result::Result<(), Failure> {
        let mut updates = handle.updates_after(0).await?;
        let result = loop {
            let keepalive = tokio::time::sleep_until((self.last_sent + KEEPALIVE).into());
            tokio::select! {
                update = updates.next() => match update {
                    Some(Ok(u)) => {
                        if let Some(end) = self.on_update(handle, &u).await {
                            break end;
                        }
                    }
                    Some(Err(e)) => break Err(Failure::from(e)),
                    None => break self.ended(handle).await,
                },
                answer = next_answer(&mut self.question) => {
                    if let Some(answer) = answer {
                        self.on_answer(handle, &answer).await;
                    }
                }
                () = keepalive => {
                    self.binding.chunk(self.reply, "status", &json!("ack")).await;
                    self.last_sent = Instant::now();
                }
            }
        };
        updates.close().await;
        result
    }

    /// What one update means for the stream: `Some` when the task has ended.
    async fn on_update(
        &mut self,
        handle: &TaskHandle,
        u: &TaskUpdate,
    ) -> Option<std::result::Result<(), Failure>> {
        let payload = || json_of(&u.envelope.payload, &u.envelope.content_type);
        match (u.kind, u.state()) {
            (TaskMessage::Chunk, _) => {
                self.send("response", &json!(text_of(&payload()))).await;
                self.chunked = true;
                None
            }
            (_, Some(TaskState::InputRequired)) => {
                self.ask(u).await;
                None
            }
            (_, Some(TaskState::Completed)) => {
                let output = payload();
                if !self.chunked && !output.is_null() {
                    self.send("response", &json!(text_of(&output))).await;
                }
                Some(Ok(()))
            }
            (_, Some(state)) if state.is_terminal() => Some(Err(self.failure(handle, u).await)),
            _ => None,
        }
    }

    async fn send(&mut self, kind: &str, data: &Value) {
        self.binding.chunk(self.reply, kind, data).await;
        self.last_sent = Instant::now();
    }

    /// Passes the task's question on as a `query` chunk, whose reply subject is a fresh inbox
    /// this stream listens on.
    async fn ask(&mut self, u: &TaskUpdate) {
        let broker = &self.binding.broker;
        let inbox = broker.new_inbox();
        match broker.subscribe(&inbox).await {
            Ok(sub) => {
                if let Some(mut old) = self.question.replace(sub) {
                    let _ = old.unsubscribe().await;
                }
            }
            Err(err) => {
                tracing::debug!(task = %self.task, error = %Report(&err), "SAP question not asked");
                return;
            }
        }
        let detail = json_of(&u.envelope.payload, &u.envelope.content_type);
        let mut prompt = u.text().unwrap_or("the task asks for input").to_owned();
        if !detail.is_null() {
            prompt = format!("{prompt}\n{}", text_of(&detail));
        }
        let query = json!({"id": format!("{}-{}", self.task, u.seq), "reply_subject": inbox, "prompt": prompt});
        self.send("query", &query).await;
    }

    /// An answer to the open question: the task goes on with its text.
    async fn on_answer(&mut self, handle: &TaskHandle, answer: &Message) {
        let text = match prompt_text(answer.payload()) {
            Ok(text) => text,
            Err(reason) => {
                tracing::debug!(task = %self.task, %reason, "SAP answer not readable: the question stays open");
                return;
            }
        };
        if let Some(mut question) = self.question.take() {
            let _ = question.unsubscribe().await;
        }
        if let Err(err) = handle.respond(&text).await {
            tracing::debug!(task = %self.task, error = %Report(&err), "SAP answer not passed on");
        }
    }

    /// Why the task ended as it did, from its report.
    async fn failure(&self, handle: &TaskHandle, u: &TaskUpdate) -> Failure {
        let state = u.state().unwrap_or(TaskState::Failed);
        match handle.report().await {
            Ok(r) => Failure::new(
                r.status,
                r.reason
                    .unwrap_or_else(|| format!("the task is {}", state.as_str())),
            ),
            Err(_) => Failure::new(
                u.envelope.status.unwrap_or(StatusCode::INTERNAL),
                u.text()
                    .map_or_else(|| format!("the task is {}", state.as_str()), str::to_owned),
            ),
        }
    }

    /// The updates ended without a final state reaching this stream: the report says how.
    async fn ended(&mut self, handle: &TaskHandle) -> std::result::Result<(), Failure> {
        let report = handle.report().await?;
        match report.state {
            TaskState::Completed => {
                let output = json_of(&report.output, &report.content_type);
                if !self.chunked && !output.is_null() {
                    self.send("response", &json!(text_of(&output))).await;
                }
                Ok(())
            }
            state => Err(Failure::new(
                report.status,
                report.reason.unwrap_or_else(|| {
                    format!("the task's updates ended while it is {}", state.as_str())
                }),
            )),
        }
    }
}

/// The next answer on the open question's subject; pending while none is open.
async fn next_answer(question: &mut Option<Subscription>) -> Option<Message> {
    match question {
        Some(sub) => sub.next().await,
        None => std::future::pending().await,
    }
}

/// `ms` since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (whole seconds, as heartbeats carry it).
fn time_seconds(ms: u64) -> String {
    let full = chorus_sdk::envelope::rfc3339(ms);
    // `rfc3339` writes milliseconds: `...:SS.mmmZ`.
    match full.split_once('.') {
        Some((seconds, _)) => format!("{seconds}Z"),
        None => full,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_is_text_or_an_envelope_with_a_prompt() {
        assert_eq!(prompt_text(b"hello").as_deref(), Ok("hello"));
        assert_eq!(
            prompt_text(br#" {"prompt": "hi", "extra": 1}"#).as_deref(),
            Ok("hi")
        );
        assert_eq!(
            prompt_text(br#"{"prompt": "hi", "attachments": []}"#).as_deref(),
            Ok("hi")
        );
        for bad in [
            &b""[..],
            br#"{"prompt": ""}"#,
            br#"{"text": "hi"}"#,
            br#"{"prompt": 3}"#,
            br#"{"prompt": "hi""#,
            br#"{"prompt": "hi", "attachments": [{"filename": "a", "content": ""}]}"#,
            b"\xff\xfe",
        ] {
            assert!(prompt_text(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn every_chorus_code_maps_to_one_sap_allows() {
        for code in 5000..5100 {
            let sap = sap_code(StatusCode(code));
            assert!(
                [400, 401, 403, 404, 409, 429, 500].contains(&sap),
                "{code} -> {sap}"
            );
        }
        assert_eq!(sap_code(StatusCode::RATE_LIMITED), 429);
        assert_eq!(sap_code(StatusCode::NO_RESPONDERS), 404);
        assert_eq!(sap_code(StatusCode::INVALID_ARGUMENT), 400);
    }

    #[test]
    fn sizes_are_written_in_the_largest_whole_unit() {
        assert_eq!(human_bytes(1 << 20), "1MB");
        assert_eq!(human_bytes((1 << 20) - 4096), "1020KB");
        assert_eq!(human_bytes(8 << 30), "8GB");
        assert_eq!(human_bytes(1500), "1500B");
    }

    #[test]
    fn heartbeat_times_are_whole_seconds_in_utc() {
        assert_eq!(time_seconds(1_700_000_000_123), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn response_text_is_the_string_or_the_json() {
        assert_eq!(text_of(&json!("words")), "words");
        assert_eq!(text_of(&json!({"a": 1})), r#"{"a":1}"#);
        assert_eq!(text_of(&Value::Null), "");
    }
}
