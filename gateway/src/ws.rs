//! `GET /v1/ws`: an edge agent over one WebSocket, both ways at once (and `GET /agent/ws`,
//! the same connection speaking Agentify's messages: `agentify.rs`).
//!
//! The connection acts as the identity its credentials name (headers, or `?access_token=`
//! for a browser, which cannot set them). While it is open, messages sent to the identity
//! are pushed to it as they arrive (`{"type": "message", "message": {...}}`, the shape a poll
//! returns), and events of its subscriptions as `{"type": "event", ...}`. It sends JSON text
//! frames, each with a `type` and an optional `ref` echoed in the answer:
//!
//! - `send` (the body of `POST /v1/messages`), `request` (of `POST /v1/requests`), `reply`
//!   (of `POST /v1/replies`), `subscribe` (`{"topic": "orders.>"}`);
//! - answered `{"type": "ok", "ref", "result"}` or `{"type": "error", "ref", "status",
//!   "label", "reason"}`.
//!
//! Requests run side by side; every task of a connection is owned by it and ends with it.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{RawQuery, State};
use axum::http::HeaderMap;
use axum::response::Response;
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::GatewayState;
use super::api::{self, ApiError};
use super::inbox::EdgeInbox;
use super::scopes::Route;

/// Subscriptions one connection may hold.
pub(crate) const MAX_SUBSCRIPTIONS: usize = 64;
/// Frames waiting to be written to one connection.
const OUTGOING_FRAMES: usize = 256;
/// How long one wait of the inbox pump lasts before it looks again.
const PUMP_WAIT: Duration = Duration::from_secs(25);

#[derive(Debug, Default, Deserialize)]
struct WsQuery {
    access_token: Option<String>,
}

/// What a connection's frames are: Chorus's own (`/v1/ws`) or Agentify's messages
/// (`/agent/ws`, `agentify.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// The frames above.
    Chorus,
    /// Agentify's messages, as its seed writes them.
    Agentify,
}

/// The upgrade: credentials are checked before the socket opens.
pub(crate) async fn upgrade(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    open(state, &headers, raw, ws, Dialect::Chorus)
}

/// Opens a connection speaking `dialect` for the caller the headers (or `?access_token=`)
/// name, if its scopes grant the WebSocket (and, for Agentify, the `agentify` routes).
pub(crate) fn open(
    state: Arc<GatewayState>,
    headers: &HeaderMap,
    raw: Option<String>,
    ws: WebSocketUpgrade,
    dialect: Dialect,
) -> Result<Response, ApiError> {
    let q: WsQuery = match raw {
        Some(q) => serde_urlencoded::from_str(&q).unwrap_or_default(),
        None => WsQuery::default(),
    };
    let caller = match q.access_token {
        Some(token) => state.auth.bearer(&token)?,
        None => state.auth.authenticate(headers)?,
    };
    let identity = caller.identity.clone();
    // The scopes must grant the WebSocket; the identity must be served (admitted by its rate).
    let (_, token) = api::caller_edge(&state, caller, Route::Ws)?;
    if dialect == Dialect::Agentify {
        token.route(Route::Agentify)?;
    }
    let place = state.limits.websocket()?;
    let stop = state.stop.child_token();
    Ok(ws
        .max_message_size(state.config.max_body_bytes)
        .on_upgrade(move |socket| async move {
            // Its place is held while it is open.
            let _place = place;
            serve(socket, state, identity, token, stop, dialect).await;
        }))
}

pub(crate) fn error_frame(reference: &Value, e: &ApiError) -> String {
    let mut body = e.body();
    body["type"] = json!("error");
    body["ref"] = reference.clone();
    body.to_string()
}

fn ok_frame(reference: &Value, result: Value) -> String {
    json!({"type": "ok", "ref": reference, "result": result}).to_string()
}

/// Runs one connection until either side closes it or the gateway stops.
async fn serve(
    socket: WebSocket,
    state: Arc<GatewayState>,
    identity: String,
    token: api::Credential,
    stop: CancellationToken,
    dialect: Dialect,
) {
    let Some(edge) = state.edges.get(&identity) else {
        return;
    };
    let (mut sink, mut stream) = socket.split();
    let (out, mut outgoing) = mpsc::channel::<String>(OUTGOING_FRAMES);
    let mut tasks = JoinSet::new();
    tasks.spawn(pump(
        Arc::clone(&edge.inbox),
        identity.clone(),
        dialect,
        out.clone(),
        stop.clone(),
    ));
    // Agentify's exchange has no greeting: its first frame from the server is an answer.
    if dialect == Dialect::Chorus {
        let welcome = json!({"type": "welcome", "identity": identity}).to_string();
        if sink.send(Message::Text(welcome.into())).await.is_err() {
            stop.cancel();
            return;
        }
    }
    let mut subscriptions = 0usize;
    loop {
        tokio::select! {
            frame = stream.next() => match frame {
                Some(Ok(Message::Text(text))) => {
                    let conn = Connection { state: &state, identity: &identity, token: &token, out: &out, stop: &stop };
                    match dialect {
                        Dialect::Chorus => handle(&conn, text.as_str(), &mut tasks, &mut subscriptions).await,
                        Dialect::Agentify => crate::agentify::frame(&conn, text.as_str(), &mut tasks).await,
                    }
                }
                Some(Ok(Message::Binary(_))) => {
                    let refusal = malformed("frames are JSON text");
                    let frame = match dialect {
                        Dialect::Chorus => error_frame(&Value::Null, &refusal),
                        Dialect::Agentify => crate::agentify::failure(&identity, None, &refusal).to_string(),
                    };
                    let _ = out.send(frame).await;
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_)) | Err(_)) | None => break,
            },
            Some(frame) = outgoing.recv() => {
                if sink.send(Message::Text(frame.into())).await.is_err() {
                    break;
                }
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            () = stop.cancelled() => break,
        }
    }
    stop.cancel();
    tasks.shutdown().await;
    let _ = sink.close().await;
}

/// Hands messages to the identity over the connection as they arrive, as `dialect` writes
/// them.
async fn pump(
    inbox: Arc<EdgeInbox>,
    identity: String,
    dialect: Dialect,
    out: mpsc::Sender<String>,
    stop: CancellationToken,
) {
    loop {
        let messages = tokio::select! {
            messages = inbox.take(16, PUMP_WAIT) => messages,
            () = stop.cancelled() => return,
        };
        for message in messages {
            let frame = match dialect {
                Dialect::Chorus => json!({"type": "message", "message": message}),
                Dialect::Agentify => crate::agentify::pushed(&message, &identity),
            }
            .to_string();
            if out.send(frame).await.is_err() {
                return;
            }
        }
    }
}

/// What the frames of one connection share.
pub(crate) struct Connection<'a> {
    pub(crate) state: &'a Arc<GatewayState>,
    pub(crate) identity: &'a str,
    /// The JWT the connection was opened with, relayed on what it sends.
    pub(crate) token: &'a api::Credential,
    pub(crate) out: &'a mpsc::Sender<String>,
    pub(crate) stop: &'a CancellationToken,
}

pub(crate) fn malformed(what: impl Into<String>) -> ApiError {
    ApiError::new(chorus_sdk::StatusCode::DATA_FORMAT, what)
}

/// One frame from the client.
async fn handle(
    conn: &Connection<'_>,
    text: &str,
    tasks: &mut JoinSet<()>,
    subscriptions: &mut usize,
) {
    let mut frame: Value = match serde_json::from_str(text) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            let _ = conn
                .out
                .send(error_frame(
                    &Value::Null,
                    &malformed("a frame is a JSON object"),
                ))
                .await;
            return;
        }
    };
    let reference = frame
        .as_object_mut()
        .and_then(|m| m.remove("ref"))
        .unwrap_or(Value::Null);
    let kind = frame
        .as_object_mut()
        .and_then(|m| m.remove("type"))
        .and_then(|t| t.as_str().map(str::to_owned))
        .unwrap_or_default();
    if let Err(e) = conn.state.limits.admit(conn.identity) {
        let _ = conn.out.send(error_frame(&reference, &e)).await;
        return;
    }
    let answer = match kind.as_str() {
        "reply" => serde_json::from_value(frame)
            .map_err(|e| malformed(format!("the reply frame: {e}")))
            .and_then(|body| api::reply_as(&conn.state.edges[conn.identity], body))
            .map(|()| json!({"delivered": true})),
        "send" | "request" => {
            // Run beside the connection: a slow reply must not hold up the other frames.
            let state = Arc::clone(conn.state);
            let (identity, token) = (conn.identity.to_owned(), conn.token.clone());
            let out = conn.out.clone();
            tasks.spawn(async move {
                let edge = &state.edges[&identity];
                let token = &token;
                let result = if kind == "send" {
                    match serde_json::from_value(frame) {
                        Ok(b) => api::send_as(edge, token, b).await.map(|r| json!(r)),
                        Err(e) => Err(malformed(format!("the send frame: {e}"))),
                    }
                } else {
                    match serde_json::from_value::<api::RequestBody>(frame) {
                        Ok(b) => api::request_as(&state, edge, token, b)
                            .await
                            .map(|r| json!(r)),
                        Err(e) => Err(malformed(format!("the request frame: {e}"))),
                    }
                };
                let frame = match result {
                    Ok(result) => ok_frame(&reference, result),
                    Err(e) => error_frame(&reference, &e),
                };
                let _ = out.send(frame).await;
            });
            return;
        }
        "subscribe" => subscribe(conn, frame, tasks, subscriptions).await,
        other => Err(ApiError::new(
            chorus_sdk::StatusCode::INVALID_ARGUMENT,
            format!("unknown frame type {other:?}: send, request, reply or subscribe"),
        )),
    };
    let frame = match answer {
        Ok(result) => ok_frame(&reference, result),
        Err(e) => error_frame(&reference, &e),
    };
    let _ = conn.out.send(frame).await;
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Subscribe {
    topic: String,
}

async fn subscribe(
    conn: &Connection<'_>,
    frame: Value,
    tasks: &mut JoinSet<()>,
    subscriptions: &mut usize,
) -> Result<Value, ApiError> {
    let s: Subscribe = serde_json::from_value(frame)
        .map_err(|e| malformed(format!("the subscribe frame: {e}")))?;
    if *subscriptions >= MAX_SUBSCRIPTIONS {
        return Err(ApiError::new(
            chorus_sdk::StatusCode::INVALID_ARGUMENT,
            format!("at most {MAX_SUBSCRIPTIONS} subscriptions per connection"),
        ));
    }
    let mut events = conn.state.edges[conn.identity]
        .agent
        .subscribe(&s.topic)
        .await?;
    *subscriptions += 1;
    let (out, stop) = (conn.out.clone(), conn.stop.clone());
    tasks.spawn(async move {
        loop {
            let event = tokio::select! {
                event = events.next() => event,
                () = stop.cancelled() => return,
            };
            let Some(event) = event else { return };
            let payload = event.payload_as::<Value>().unwrap_or(Value::Null);
            let frame = json!({
                "type": "event",
                "topic": event.topic(),
                "from": event.envelope.from,
                "id": event.envelope.id,
                "payload": payload,
            });
            if out.send(frame.to_string()).await.is_err() {
                return;
            }
        }
    });
    Ok(json!({"subscribed": s.topic}))
}
