//! Agentify's messages at the edge (`docs/INTEROP.md`, "The seeds' own clients"): its base
//! message (`id`, `type`, `sender`, `to`, `intent`, `task`, `payload`, `context`,
//! `correlation`, `expected`) over HTTP (`POST /agent/message`: a `request` answered with an
//! `inform`) and over a WebSocket (`GET /agent/ws`: each text frame one message, both ways).
//!
//! One mapping serves both: a `request` to `agent.<id>.<command>` (or `agent.<id>`, the intent
//! then the command) is a request on the bus from the caller's identity, with `task` (the
//! natural-language description) in the application header `agentify-task`,
//! `context.customer_id` and `context.session_id` as the envelope's customer and session, and
//! `expected.timeout` (ms) as its timeout. Its reply is an `inform` (intent `result`); a refusal
//! is a `refuse` (intent `permission_denied`) when access was denied, else a `failure` whose
//! intent is the Chorus label (`timeout`, `no_responders`, ...), with
//! `payload: {error, code, label}`; over the WebSocket each carries `correlation.reply_to` =
//! the request's `id`.

use std::sync::Arc;

use axum::Json;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode as Http};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use chorus_sdk::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use uuid::Uuid;

use super::api::{self, ApiError, ApiResult, Credential, whole};
use super::inbox::{EdgeReply, PolledMessage};
use super::scopes::Route;
use super::ws::{self, Connection, Dialect};
use super::{Edge, GatewayState};

/// The application header that carries Agentify's `task` on the bus.
pub const TASK_HEADER: &str = "agentify-task";
/// The longest `task` taken, in characters (at most 8 KiB, within the SDK's bound on a
/// message's headers).
pub(crate) const MAX_TASK_CHARS: usize = 2048;
/// The longest id, customer or session taken, in characters.
pub(crate) const MAX_NAME_CHARS: usize = 256;

/// `context`: who the message is for.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct MessageContext {
    customer_id: Option<String>,
    session_id: Option<String>,
}

/// `correlation`: the conversation and the message answered.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Correlation {
    conversation_id: Option<String>,
    reply_to: Option<String>,
}

/// `expected`: the answer the sender waits for.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Expected {
    #[serde(default, deserialize_with = "whole::opt_u64")]
    timeout: Option<u64>,
}

/// An Agentify message as its seed writes it; fields this gateway does not use (`ts`,
/// `status`, `security`, ...) are ignored.
#[derive(Debug, Deserialize)]
pub(crate) struct Message {
    id: Option<String>,
    #[serde(rename = "type")]
    kind: String,
    sender: Option<String>,
    #[serde(default)]
    to: Vec<String>,
    intent: Option<String>,
    task: Option<String>,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    context: MessageContext,
    #[serde(default)]
    correlation: Correlation,
    #[serde(default)]
    expected: Expected,
}

/// The `inform` that answers a request.
#[derive(Debug, Serialize)]
pub(crate) struct Inform {
    id: String,
    ts: String,
    #[serde(rename = "type")]
    kind: &'static str,
    sender: String,
    to: Vec<String>,
    intent: &'static str,
    status: u16,
    payload: Box<serde_json::value::RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    correlation: Option<Value>,
}

/// Agentify's recipient `agent.<id>.<command>` (or `<id>.<command>`, or `<id>` with the
/// intent as the command).
pub(crate) fn target<'a>(to: &'a str, intent: Option<&'a str>) -> ApiResult<(&'a str, &'a str)> {
    let rest = to.strip_prefix("agent.").unwrap_or(to);
    let (agent, command) = match (rest.split_once('.'), intent) {
        (Some((agent, command)), _) => (agent, command),
        (None, Some(intent)) => (rest, intent),
        (None, None) => {
            return Err(ApiError::bad_request(
                "intent: the command, when to names only the agent",
            ));
        }
    };
    Ok((api::name("to", agent)?, api::name("command", command)?))
}

/// The identity an Agentify sender names: `agent.<id>` or `agent.<id>.<role>` (the role, as
/// in a recipient, is what the agent does, not who it is).
pub(crate) fn sender_identity(sender: &str) -> &str {
    let rest = sender.strip_prefix("agent.").unwrap_or(sender);
    rest.split_once('.').map_or(rest, |(id, _)| id)
}

fn bounded<'a>(what: &str, value: Option<&'a str>, max: usize) -> ApiResult<Option<&'a str>> {
    match value {
        Some(v) if v.chars().count() > max => Err(ApiError::bad_request(format!(
            "{what}: at most {max} characters"
        ))),
        other => Ok(other),
    }
}

/// The `correlation` of an answer to `m`: its `id` as `reply_to`, its conversation kept.
fn answering(m: &Message) -> Option<Value> {
    let mut c = serde_json::Map::new();
    if let Some(conversation) = &m.correlation.conversation_id {
        c.insert("conversation_id".into(), json!(conversation));
    }
    if let Some(id) = &m.id {
        c.insert("reply_to".into(), json!(id));
    }
    (!c.is_empty()).then_some(Value::Object(c))
}

/// Now as Agentify's `ts` (ISO 8601, UTC).
fn now() -> String {
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]Z");
    time::OffsetDateTime::now_utc()
        .format(&format)
        .unwrap_or_default()
}

/// Asks what request `m` names as `edge` and answers with the `inform` of its reply.
pub(crate) async fn request(
    state: &GatewayState,
    edge: &Edge,
    credential: &Credential,
    m: &Message,
) -> ApiResult<Inform> {
    let me = edge.agent.id();
    if let Some(sender) = &m.sender
        && sender_identity(sender) != me
    {
        return Err(ApiError::new(
            StatusCode::IDENTITY,
            format!("sender {sender:?} is not the caller's identity {me}"),
        )
        .with_http(Http::FORBIDDEN));
    }
    if m.kind != "request" {
        return Err(ApiError::bad_request(format!(
            "type {:?}: this takes requests; send events and commands to /v1/messages",
            m.kind
        )));
    }
    let [to] = m.to.as_slice() else {
        return Err(ApiError::bad_request("to: exactly one recipient"));
    };
    bounded("id", m.id.as_deref(), MAX_NAME_CHARS)?;
    let task = bounded("task", m.task.as_deref(), MAX_TASK_CHARS)?;
    let customer = bounded(
        "context.customer_id",
        m.context.customer_id.as_deref(),
        MAX_NAME_CHARS,
    )?;
    let session = bounded(
        "context.session_id",
        m.context.session_id.as_deref(),
        MAX_NAME_CHARS,
    )?;
    let (agent, command) = target(to, m.intent.as_deref())?;
    let mut call = credential
        .call(Some(agent), Some(command), None)?
        .timeout(api::timeout(state, m.expected.timeout)?);
    if let Some(task) = task {
        call = call.header(TASK_HEADER, task);
    }
    if let Some(customer) = customer {
        call = call.customer(customer);
    }
    if let Some(session) = session {
        call = call.session(session);
    }
    let reply = api::ask(edge, call, &m.payload).await?;
    Ok(Inform {
        id: Uuid::now_v7().to_string(),
        ts: now(),
        kind: "inform",
        sender: format!("agent.{}", reply.from),
        // Back to the sender as it named itself (checked above to be the caller).
        to: vec![m.sender.clone().unwrap_or_else(|| format!("agent.{me}"))],
        intent: "result",
        status: reply.status,
        payload: reply.payload,
        correlation: answering(m),
    })
}

/// `POST /agent/message`: Agentify's request-reply. A refusal is answered as Agentify writes
/// one too, a `failure` (or `refuse` when access was denied) message, with the HTTP status the
/// gateway's other routes give it.
pub(crate) async fn message(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Response {
    let m = api::body::<Message>(&bytes);
    let (me, outcome) = match api::edge(&state, &headers, Route::Agentify) {
        // Unauthenticated or not allowed: the caller is who its message says, if anyone.
        Err(e) => {
            let named = m.as_ref().ok().and_then(|m| m.sender.as_deref());
            let me = named.map(|s| s.strip_prefix("agent.").unwrap_or(s).to_owned());
            (me, Err(e))
        }
        Ok((edge, credential)) => {
            let outcome = match &m {
                Ok(m) => request(&state, edge, &credential, m).await,
                Err(e) => Err(e.clone()),
            };
            (Some(edge.agent.id().to_owned()), outcome)
        }
    };
    match outcome {
        Ok(inform) => Json(inform).into_response(),
        Err(e) => api::refusal(e.http(), failure_to(me.as_deref(), m.as_ref().ok(), &e)),
    }
}

/// `GET /agent/ws`: a WebSocket whose frames are Agentify messages (`ws.rs` runs it).
pub(crate) async fn upgrade(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
    socket: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    ws::open(state, &headers, raw, socket, Dialect::Agentify)
}

/// The `failure` (or, for a denial, `refuse`) that answers `m` (if it read as a message) sent
/// by `me` with refusal `e`.
pub(crate) fn failure(me: &str, m: Option<&Message>, e: &ApiError) -> Value {
    failure_to(Some(me), m, e)
}

/// [`failure`], to `me` if known (an empty `to` otherwise).
fn failure_to(me: Option<&str>, m: Option<&Message>, e: &ApiError) -> Value {
    let body = e.body();
    let denied = matches!(e.http(), Http::FORBIDDEN | Http::UNAUTHORIZED);
    let (kind, intent) = if denied {
        ("refuse", json!("permission_denied"))
    } else {
        ("failure", body["label"].clone())
    };
    let sender = m
        .and_then(|m| m.to.first())
        .map_or_else(|| "agent.gateway".to_owned(), Clone::clone);
    let mut frame = json!({
        "id": Uuid::now_v7().to_string(),
        "ts": now(),
        "type": kind,
        "sender": sender,
        "to": me.map(|me| format!("agent.{me}")).into_iter().collect::<Vec<_>>(),
        "intent": intent,
        "payload": {"error": body["reason"], "code": body["status"], "label": body["label"]},
    });
    if let Some(c) = m.and_then(answering) {
        frame["correlation"] = c;
    }
    frame
}

/// A message sent to identity `me`, pushed as Agentify writes it: a `request` when its sender
/// waits for the answer (`expected.timeout` says how long), else an `inform`; its `task` when
/// it came with one.
pub(crate) fn pushed(m: &PolledMessage, me: &str) -> Value {
    let mut frame = json!({
        "id": m.id.to_string(),
        "ts": crate::iacp::timestamp_of(m.timestamp_ms),
        "type": if m.reply_expected { "request" } else { "inform" },
        "sender": format!("agent.{}", m.from),
        "to": [format!("agent.{me}")],
        "intent": m.command,
        "payload": m.payload,
        "correlation": {"conversation_id": m.conversation.to_string()},
    });
    if let Some(task) = &m.task {
        frame["task"] = json!(task);
    }
    if let (true, Some(ms)) = (m.reply_expected, m.timeout_ms) {
        frame["expected"] = json!({"type": "inform", "timeout": ms});
    }
    frame
}

/// The answer to a pushed request that message `m` (an `inform`, `done`, `failure` or
/// `refuse`) gives, and the request's id (its `correlation.reply_to`).
pub(crate) fn answer(m: &Message) -> ApiResult<(Uuid, EdgeReply)> {
    let id = m
        .correlation
        .reply_to
        .as_deref()
        .and_then(|r| r.parse::<Uuid>().ok())
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "a {} names the id of the request it answers in correlation.reply_to",
                m.kind
            ))
        })?;
    let reply = match m.kind.as_str() {
        "inform" | "done" | "confirm" => EdgeReply {
            status: StatusCode::OK,
            reason: String::new(),
            payload: m.payload.clone(),
        },
        "refuse" => {
            let mut reply = crate::iacp::reported_error(&m.payload);
            if reply.status == StatusCode::HANDLER_FAILED {
                reply.status = StatusCode::ACCESS;
            }
            reply
        }
        _ => crate::iacp::reported_error(&m.payload),
    };
    Ok((id, reply))
}

/// One frame from an Agentify client: a `request` runs beside the connection and is answered
/// with its `inform` (or `failure`/`refuse`); a `discover` is answered with an `offer` of the
/// live agents (`payload.capability` to filter); an `inform`, `done`, `confirm`, `failure` or
/// `refuse` with `correlation.reply_to` answers a pushed request (silently when delivered).
pub(crate) async fn frame(conn: &Connection<'_>, text: &str, tasks: &mut JoinSet<()>) {
    let me = conn.identity;
    let m: Message = match serde_json::from_str(text) {
        Ok(m) => m,
        Err(e) => {
            let refusal = ws::malformed(format!("an Agentify message: {e}"));
            let _ = conn.out.send(failure(me, None, &refusal).to_string()).await;
            return;
        }
    };
    if let Err(e) = conn.state.limits.admit(me) {
        let _ = conn.out.send(failure(me, Some(&m), &e).to_string()).await;
        return;
    }
    let edge = &conn.state.edges[me];
    let outcome = match m.kind.as_str() {
        "request" => {
            // Run beside the connection: a slow reply must not hold up the other frames.
            let (state, identity) = (Arc::clone(conn.state), me.to_owned());
            let (token, out) = (conn.token.clone(), conn.out.clone());
            tasks.spawn(async move {
                let edge = &state.edges[&identity];
                let frame = match request(&state, edge, &token, &m).await {
                    Ok(inform) => json!(inform),
                    Err(e) => failure(&identity, Some(&m), &e),
                };
                let _ = out.send(frame.to_string()).await;
            });
            return;
        }
        "discover" => discover(conn, edge, &m).await.map(Some),
        "inform" | "done" | "confirm" | "failure" | "refuse" => {
            answer(&m).and_then(|(id, reply)| {
                if edge.inbox.reply(id, reply) {
                    Ok(None)
                } else {
                    Err(ApiError::new(
                        StatusCode::INVALID_ARGUMENT,
                        format!("no request {id} waits for an answer"),
                    )
                    .with_http(Http::NOT_FOUND))
                }
            })
        }
        other => Err(ApiError::bad_request(format!(
            "type {other:?}: request, discover, or inform, done, confirm, failure or refuse \
             answering a request"
        ))),
    };
    let frame = match outcome {
        Ok(Some(frame)) => frame,
        Ok(None) => return,
        Err(e) => failure(me, Some(&m), &e),
    };
    let _ = conn.out.send(frame.to_string()).await;
}

/// The `offer` answering a `discover`: the live agents with `payload.capability`, as peers.
async fn discover(conn: &Connection<'_>, edge: &Edge, m: &Message) -> ApiResult<Value> {
    conn.token.route(Route::Agents)?;
    // The same query as IACP's: `capability`, `capabilities`, `max_tokens`, `priority`, ...
    let query = crate::iacp::PeersQuery::from_payload(&m.payload)?;
    let peers = crate::iacp::peers_of(edge, query).await?;
    let mut frame = json!({
        "id": Uuid::now_v7().to_string(),
        "ts": now(),
        "type": "offer",
        "sender": "agent.gateway",
        "to": [format!("agent.{}", conn.identity)],
        "intent": "agents_found",
        "payload": {"agents": peers},
    });
    if let Some(c) = answering(m) {
        frame["correlation"] = c;
    }
    Ok(frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(value: Value) -> Message {
        serde_json::from_value(value).expect("a message")
    }

    #[test]
    fn recipients_name_an_agent_and_a_command() {
        assert_eq!(
            target("agent.calculator.calculation", Some("calculate")).ok(),
            Some(("calculator", "calculation"))
        );
        assert_eq!(
            target("calculator", Some("add")).ok(),
            Some(("calculator", "add"))
        );
        assert!(target("agent.a b.c", Some("x")).is_err());
        assert!(target("agent.calculator", None).is_err());
    }

    #[test]
    fn a_sender_names_its_identity_first() {
        assert_eq!(sender_identity("agent.app.orchestrator"), "app");
        assert_eq!(sender_identity("agent.ops"), "ops");
        assert_eq!(sender_identity("ops"), "ops");
    }

    #[test]
    fn the_seeds_websocket_request_reads_with_its_task_and_correlation() {
        let m = message(json!({
            "id": "msg-uuid-123",
            "ts": "2026-01-16T10:30:00Z",
            "type": "request",
            "sender": "agent.calculator.orchestrator",
            "to": ["agent.calculator.calculation"],
            "intent": "calculate",
            "task": "Calculate 5 + 3",
            "payload": {"a": 5, "b": 3, "op": "+"},
            "context": {"customer_id": "customer-123", "session_id": "session-456"},
            "correlation": {"conversation_id": "conv-789", "reply_to": "msg-uuid-000"},
            "expected": {"type": "inform", "timeout": 5000},
            "status": {"state": "pending", "progress": 0.0},
            "security": {"token": "jwt-token-here", "permissions": ["calculate"]}
        }));
        assert_eq!(m.task.as_deref(), Some("Calculate 5 + 3"));
        assert_eq!(m.expected.timeout, Some(5000));
        assert_eq!(m.context.customer_id.as_deref(), Some("customer-123"));
        assert_eq!(
            answering(&m),
            Some(json!({"conversation_id": "conv-789", "reply_to": "msg-uuid-123"}))
        );
    }

    #[test]
    fn refusals_are_failures_or_refuse_with_the_code() {
        let m = message(
            json!({"id": "q1", "type": "request", "to": ["agent.calc.add"], "intent": "x"}),
        );
        let f = failure(
            "app",
            Some(&m),
            &ApiError::new(StatusCode::NO_RESPONDERS, "nobody serves it"),
        );
        assert_eq!(
            (&f["type"], &f["intent"], &f["sender"]),
            (
                &json!("failure"),
                &json!("no_responders"),
                &json!("agent.calc.add")
            )
        );
        assert_eq!(
            f["payload"],
            json!({"error": "nobody serves it", "code": 5012, "label": "no_responders"})
        );
        assert_eq!(f["correlation"]["reply_to"], json!("q1"));
        let r = failure("app", None, &ApiError::new(StatusCode::ACCESS, "no"));
        assert_eq!(
            (&r["type"], &r["intent"]),
            (&json!("refuse"), &json!("permission_denied"))
        );
    }

    #[test]
    fn answers_to_pushed_requests_name_them_in_reply_to() {
        let id = Uuid::now_v7();
        let ok = message(
            json!({"type": "inform", "payload": {"result": 8}, "correlation": {"reply_to": id.to_string()}}),
        );
        assert_eq!(
            answer(&ok).ok(),
            Some((
                id,
                EdgeReply {
                    status: StatusCode::OK,
                    reason: String::new(),
                    payload: json!({"result": 8})
                }
            ))
        );
        let failed = message(
            json!({"type": "failure", "payload": {"error": "Division by zero", "code": "MATH_ERROR"}, "correlation": {"reply_to": id.to_string()}}),
        );
        let (_, reply) = answer(&failed).expect("an answer");
        assert_eq!(
            (reply.status, reply.reason.as_str()),
            (StatusCode::HANDLER_FAILED, "MATH_ERROR: Division by zero")
        );
        let refused = message(
            json!({"type": "refuse", "payload": {"error": "Insufficient permissions"}, "correlation": {"reply_to": id.to_string()}}),
        );
        assert_eq!(
            answer(&refused).map(|(_, r)| r.status).ok(),
            Some(StatusCode::ACCESS)
        );
        assert!(answer(&message(json!({"type": "inform"}))).is_err());
    }

    #[test]
    fn pushed_messages_read_as_agentify_requests_with_their_task() {
        let m = PolledMessage {
            id: Uuid::nil(),
            from: "orchestrator".into(),
            command: "calculate".into(),
            kind: "request".into(),
            delivery: "at_most_once".into(),
            reply_expected: true,
            conversation: Uuid::nil(),
            timestamp_ms: 0,
            attempt: 1,
            payload: json!({"a": 1}),
            task: Some("Add".into()),
            timeout_ms: Some(5000),
        };
        let f = pushed(&m, "calc");
        assert_eq!(
            (&f["type"], &f["sender"], &f["to"]),
            (
                &json!("request"),
                &json!("agent.orchestrator"),
                &json!(["agent.calc"])
            )
        );
        assert_eq!(
            (&f["task"], &f["expected"]["timeout"]),
            (&json!("Add"), &json!(5000))
        );
    }
}
