//! Where messages to an edge identity wait for its polls.
//!
//! The identity's agent hands every command it receives, core or durable, to
//! [`EdgeHandler`], which holds it here until a poll takes it. A durable message is
//! acknowledged only when a poll has taken it; one nobody takes within the hold time is
//! answered 5019 and so stays stored, delivered again by its retry policy (and dead-lettered
//! when the policy gives up). A request waits on until the edge caller replies
//! (`POST /v1/replies`) or its deadline passes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_sdk::envelope::CONTENT_TYPE_JSON;
use chorus_sdk::{BoxFuture, Context, Handler, HandlerError, Output, StatusCode};
use serde::Serialize;
use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A message as a poll returns it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PolledMessage {
    pub(crate) id: Uuid,
    pub(crate) from: String,
    pub(crate) command: String,
    pub(crate) kind: String,
    pub(crate) delivery: String,
    /// Whether the sender waits for an answer through `POST /v1/replies`.
    pub(crate) reply_expected: bool,
    pub(crate) conversation: Uuid,
    pub(crate) timestamp_ms: u64,
    pub(crate) attempt: u32,
    pub(crate) payload: serde_json::Value,
    /// What the sender asked for in words, when it says (Agentify's `task`, carried in the
    /// application header `agentify-task`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) task: Option<String>,
    /// How long the sender waits for the reply, in ms, when it waits for one.
    #[serde(skip)]
    pub(crate) timeout_ms: Option<u64>,
}

/// An edge caller's answer to a request it polled.
#[derive(Debug, PartialEq)]
pub(crate) struct EdgeReply {
    pub(crate) status: StatusCode,
    pub(crate) reason: String,
    pub(crate) payload: serde_json::Value,
}

struct Held {
    message: PolledMessage,
    taken: oneshot::Sender<()>,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Held>,
    replies: HashMap<Uuid, oneshot::Sender<EdgeReply>>,
}

/// The messages held for one edge identity.
pub(crate) struct EdgeInbox {
    capacity: usize,
    hold: Duration,
    state: Mutex<State>,
    arrived: Notify,
    /// Cancelled when the gateway stops: held messages are answered 5019 at once.
    stop: CancellationToken,
}

impl std::fmt::Debug for EdgeInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeInbox")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl EdgeInbox {
    pub(crate) fn new(capacity: usize, hold: Duration, stop: CancellationToken) -> Self {
        EdgeInbox {
            capacity,
            hold,
            state: Mutex::new(State::default()),
            arrived: Notify::new(),
            stop,
        }
    }

    /// Holds `message` for a poll; the receiver hears when one takes it.
    fn hold(&self, message: PolledMessage) -> Result<oneshot::Receiver<()>, HandlerError> {
        let (taken, rx) = oneshot::channel();
        let mut state = lock(&self.state);
        if state.queue.len() >= self.capacity {
            return Err(HandlerError::new(
                StatusCode::UNAVAILABLE,
                "the edge identity's inbox at the gateway is full",
            ));
        }
        state.queue.push_back(Held { message, taken });
        drop(state);
        self.arrived.notify_waiters();
        Ok(rx)
    }

    /// Takes `id` back if no poll has taken it; false if one has.
    fn withdraw(&self, id: Uuid) -> bool {
        let mut state = lock(&self.state);
        let before = state.queue.len();
        state.queue.retain(|h| h.message.id != id);
        state.queue.len() != before
    }

    /// Up to `max` messages, waiting up to `wait` for the first.
    pub(crate) async fn take(&self, max: usize, wait: Duration) -> Vec<PolledMessage> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Registered before the queue is read, so an arrival in between still wakes it.
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let taken = self.take_now(max);
            if !taken.is_empty() {
                return taken;
            }
            tokio::select! {
                () = &mut arrived => {}
                () = tokio::time::sleep_until(deadline) => return Vec::new(),
                () = self.stop.cancelled() => return Vec::new(),
            }
        }
    }

    fn take_now(&self, max: usize) -> Vec<PolledMessage> {
        let mut state = lock(&self.state);
        let mut out = Vec::new();
        while out.len() < max {
            let Some(held) = state.queue.pop_front() else {
                break;
            };
            // A handler that gave up (its agent stopping) dropped its receiver: the message
            // was not acknowledged, so it is not handed out either.
            if held.taken.send(()).is_ok() {
                out.push(held.message);
            }
        }
        out
    }

    /// Delivers the edge caller's reply to request `id`; false if nobody waits for one.
    pub(crate) fn reply(&self, id: Uuid, reply: EdgeReply) -> bool {
        match lock(&self.state).replies.remove(&id) {
            Some(tx) => tx.send(reply).is_ok(),
            None => false,
        }
    }

    fn expect_reply(&self, id: Uuid) -> oneshot::Receiver<EdgeReply> {
        let (tx, rx) = oneshot::channel();
        lock(&self.state).replies.insert(id, tx);
        rx
    }

    fn forget_reply(&self, id: Uuid) {
        lock(&self.state).replies.remove(&id);
    }
}

/// The handler of every command an edge identity's agent receives.
pub(crate) struct EdgeHandler {
    pub(crate) inbox: Arc<EdgeInbox>,
}

fn unavailable(why: &str) -> HandlerError {
    HandlerError::new(StatusCode::UNAVAILABLE, why)
}

impl Handler for EdgeHandler {
    fn call(&self, ctx: Context) -> BoxFuture<Result<Output, HandlerError>> {
        let inbox = Arc::clone(&self.inbox);
        Box::pin(async move {
            let env = ctx.message();
            let payload = if env.payload.is_empty() {
                serde_json::Value::Null
            } else {
                chorus_sdk::codec::decode_payload::<serde_json::Value>(
                    &env.payload,
                    &env.content_type,
                )
                .map_err(|e| {
                    HandlerError::new(
                        StatusCode::DATA_FORMAT,
                        format!("the gateway passes JSON and MessagePack payloads only: {e}"),
                    )
                })?
            };
            // A call says how long it waits for the reply; a one-way send says nothing.
            let reply_expected = env.expect.is_some();
            let message = PolledMessage {
                id: env.id,
                from: env.from.to_string(),
                command: env.name.clone().unwrap_or_default(),
                kind: env.kind.as_str().to_owned(),
                delivery: env.delivery.as_str().to_owned(),
                reply_expected,
                conversation: env.correlation_id.unwrap_or(env.id),
                timestamp_ms: env.timestamp_ms,
                attempt: ctx.attempt(),
                payload,
                task: env.headers.get(crate::agentify::TASK_HEADER).cloned(),
                timeout_ms: env.expect.as_ref().map(|e| e.timeout_ms),
            };
            let id = message.id;
            // How long the sender waits: a request until its deadline, anything else the
            // gateway's hold time.
            let wait = match (&env.expect, reply_expected) {
                (Some(expect), true) => Duration::from_millis(expect.timeout_ms),
                _ => inbox.hold,
            };
            let replied = reply_expected.then(|| inbox.expect_reply(id));
            let taken = match inbox.hold(message) {
                Ok(taken) => taken,
                Err(e) => {
                    inbox.forget_reply(id);
                    return Err(e);
                }
            };
            let until = tokio::time::Instant::now() + wait;
            tokio::select! {
                _ = taken => {}
                () = tokio::time::sleep_until(until) => {
                    if inbox.withdraw(id) {
                        inbox.forget_reply(id);
                        return Err(unavailable("no poll took the message in time"));
                    }
                }
                () = inbox.stop.cancelled() => {
                    if inbox.withdraw(id) {
                        inbox.forget_reply(id);
                        return Err(unavailable("the gateway is stopping"));
                    }
                }
            }
            let Some(replied) = replied else {
                return Ok(Output::default());
            };
            let reply = tokio::select! {
                reply = replied => reply.map_err(|_| unavailable("the gateway is stopping"))?,
                () = tokio::time::sleep_until(until) => {
                    inbox.forget_reply(id);
                    return Err(HandlerError::new(
                        StatusCode::TIMEOUT,
                        "the edge caller did not reply in time",
                    ));
                }
            };
            if !reply.status.is_success() {
                return Err(HandlerError::new(reply.status, reply.reason));
            }
            let payload = serde_json::to_vec(&reply.payload)
                .map_err(|e| HandlerError::new(StatusCode::INTERNAL, e.to_string()))?;
            Ok(Output {
                payload: payload.into(),
                content_type: CONTENT_TYPE_JSON.into(),
            })
        })
    }
}
