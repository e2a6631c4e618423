//! The gateway's MCP server (the Model Context Protocol's Streamable HTTP transport,
//! JSON-RPC 2.0): every live agent's capabilities and commands are tools any MCP host can list
//! and call (`tools.rs`, `server.rs`).
//!
//! - `POST /mcp`: one JSON-RPC message. A request is answered with JSON, except `tools/call`
//!   from a client that takes `text/event-stream`: its progress and log notifications, then its
//!   response, come as server-sent events. A notification or a response is answered 202.
//! - `GET /mcp`: server-sent events of `notifications/tools/list_changed`, sent when agents come
//!   or go (the coordinator's `registry.joined` and `registry.left`) or change what they offer;
//!   with `Last-Event-ID`, a task's `tools/call` stream resumed after that event (a task's
//!   events carry its Chorus sequence in their ids, so a call survives a broken connection and
//!   a gateway restart).
//! - `DELETE /mcp`: ends the session its `Mcp-Session-Id` names.
//!
//! Stateless where the spec allows: `initialize` opens a session (`Mcp-Session-Id`), which
//! keeps the client's log level and matches its `notifications/cancelled` to its calls, but a
//! client without one is served all the same. Credentials, scopes and limits are the gateway's:
//! the `mcp` route group, and a token lists and calls only the agents and capabilities its
//! scopes grant; on a loopback listener, `[gateway.mcp] anonymous_identity` serves local MCP
//! hosts that bring none. `Origin` (and, on a loopback listener, `Host`) is checked against DNS
//! rebinding.

pub(crate) mod server;
pub(crate) mod stdio;
pub(crate) mod tools;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode as Http, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::GatewayState;
use super::api;
use super::scopes::Route;
use crate::config::McpConfig;
use server::{Caller, Incoming, Out, RpcError, Sent, Session, code, response};

/// The session header.
const SESSION: &str = "mcp-session-id";
/// The protocol version header.
const PROTOCOL_VERSION: &str = "mcp-protocol-version";
/// The most task calls remembered for a late cancel.
const TASK_CALLS: usize = 4096;
/// How often the tool list is compared when no registry event says it changed.
const LIST_RECHECK: Duration = Duration::from_secs(10);

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A call in flight, as `notifications/cancelled` names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct InFlight {
    identity: String,
    session: Option<String>,
    id: String,
}

/// What the MCP server keeps.
pub(crate) struct Mcp {
    pub(crate) config: McpConfig,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    in_flight: Mutex<HashMap<InFlight, CancellationToken>>,
    /// The tasks that calls in flight started, newest last (at most [`TASK_CALLS`]): a
    /// cancel for a call whose stream has gone still finds its task.
    task_calls: Mutex<std::collections::VecDeque<(InFlight, uuid::Uuid)>>,
    /// Each identity's tool table and when it was read.
    tables: Mutex<HashMap<String, (Instant, Arc<tools::Table>)>>,
    /// Each identity's tool list fingerprint, while a `GET /mcp` stream watches it.
    watchers: Mutex<HashMap<String, watch::Sender<u64>>>,
}

impl Mcp {
    pub(crate) fn new(config: &McpConfig) -> Mcp {
        Mcp {
            config: config.clone(),
            sessions: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(HashMap::new()),
            task_calls: Mutex::default(),
            tables: Mutex::new(HashMap::new()),
            watchers: Mutex::new(HashMap::new()),
        }
    }

    /// A new session for `identity`, unless the table is full of sessions in use (idle ones
    /// are dropped first).
    fn open(&self, identity: &str) -> Option<Arc<Session>> {
        let idle = Duration::from_secs(self.config.session_idle_secs);
        let mut sessions = lock(&self.sessions);
        if sessions.len() >= self.config.max_sessions {
            sessions.retain(|_, s| lock(&s.last_used).elapsed() < idle);
        }
        if sessions.len() >= self.config.max_sessions {
            return None;
        }
        let session = Arc::new(Session::new(identity));
        sessions.insert(session.id.clone(), Arc::clone(&session));
        Some(session)
    }

    /// Removes the sessions idle past `session_idle_secs`: `(identity, id)` of each.
    fn expire_idle(&self) -> Vec<(String, String)> {
        let idle = Duration::from_secs(self.config.session_idle_secs);
        let mut expired = Vec::new();
        lock(&self.sessions).retain(|id, s| {
            let live = lock(&s.last_used).elapsed() < idle;
            if !live {
                expired.push((s.identity.clone(), id.clone()));
            }
            live
        });
        expired
    }

    /// Remembers that the call `key` started task `task`.
    pub(crate) fn remember_task(&self, key: InFlight, task: uuid::Uuid) {
        let mut calls = lock(&self.task_calls);
        // A resumed call remembers its task again: one entry per call.
        calls.retain(|(k, _)| *k != key);
        if calls.len() >= TASK_CALLS {
            calls.pop_front();
        }
        calls.push_back((key, task));
    }

    /// The calls that started tasks still remembered.
    pub(crate) fn task_keys(&self) -> Vec<InFlight> {
        lock(&self.task_calls)
            .iter()
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The task the call `key` started, forgotten.
    pub(crate) fn forget_task(&self, key: &InFlight) -> Option<uuid::Uuid> {
        let mut calls = lock(&self.task_calls);
        let at = calls.iter().position(|(k, _)| k == key)?;
        calls.remove(at).map(|(_, task)| task)
    }

    /// Session `id`, if `identity` opened it and it has not ended. One idle past its time is
    /// gone for its client; [`sweep_sessions`] ends its calls and tasks.
    fn session(&self, id: &str, identity: &str) -> Option<Arc<Session>> {
        let idle = Duration::from_secs(self.config.session_idle_secs);
        let sessions = lock(&self.sessions);
        let session = sessions
            .get(id)
            .filter(|s| s.identity == identity)
            .cloned()?;
        let mut used = lock(&session.last_used);
        if used.elapsed() >= idle {
            return None;
        }
        *used = Instant::now();
        drop(used);
        Some(session)
    }
}

/// Ends the sessions that went idle, until `stop`: each one's calls end and the tasks they
/// started are cancelled on the bus, as when its client ends it (`DELETE /mcp`). Looks every
/// quarter of `session_idle_secs` (between 1 s and 30 s).
pub(crate) async fn sweep_sessions(state: Arc<GatewayState>, stop: CancellationToken) {
    let idle = Duration::from_secs(state.mcp.config.session_idle_secs);
    let every = (idle / 4).clamp(Duration::from_secs(1), Duration::from_secs(30));
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = stop.cancelled() => return,
        }
        for (identity, id) in state.mcp.expire_idle() {
            tracing::info!(%identity, session = %id, "mcp: session expired; its calls and tasks end");
            server::end_session(&state, &identity, &id);
        }
    }
}

/// A JSON-RPC error as an HTTP response with `http`'s status.
fn rpc_error(http: Http, id: &Value, e: RpcError) -> Response {
    (http, axum::Json(response(id, &Err(e)))).into_response()
}

/// A message refused by the transport before it was read (its body too large or too slow):
/// a JSON-RPC error, id null, with status `http`.
pub(crate) fn transport_refusal(http: Http, why: String) -> Response {
    rpc_error(
        http,
        &Value::Null,
        RpcError::new(code::INVALID_REQUEST, why),
    )
}

/// A request refused before it reached a method: at the door (credentials, scopes, limits:
/// the gateway's usual JSON body) or by the transport (a JSON-RPC error, id null).
enum Refused {
    Door(api::ApiError),
    Transport(Http, RpcError),
}

impl Refused {
    fn transport(http: Http, why: impl Into<String>) -> Refused {
        Refused::Transport(http, RpcError::new(code::INVALID_REQUEST, why))
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        match self {
            Refused::Door(e) => e.into_response(),
            Refused::Transport(http, e) => rpc_error(http, &Value::Null, e),
        }
    }
}

/// Whether `host` (a `Host` header, or an origin's host) names this machine.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or_default()
    } else {
        host.rsplit_once(':').map_or(host, |(name, _)| name)
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// DNS rebinding: an `Origin` must be a configured one or this machine's; on a loopback
/// listener, `Host` must name this machine too.
fn check_origin(state: &GatewayState, headers: &HeaderMap) -> Result<(), Refused> {
    let forbidden = |why: String| Err(Refused::transport(Http::FORBIDDEN, why));
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or_default();
        let host = origin.split_once("://").map_or("", |(_, rest)| rest);
        let allowed = state.mcp.config.allowed_origins.iter().any(|o| o == origin)
            || (!host.is_empty() && is_loopback_host(host));
        if !allowed {
            return forbidden(format!(
                "origin {origin:?} is not allowed ([gateway.mcp] allowed_origins)"
            ));
        }
    }
    let loopback_listener = state
        .config
        .listen
        .is_some_and(|addr| addr.ip().is_loopback());
    if loopback_listener {
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default();
        if !is_loopback_host(host) {
            return forbidden(format!(
                "host {host:?}: this gateway listens on loopback and answers only to this machine's names"
            ));
        }
    }
    Ok(())
}

/// The caller, from its credentials and session header (`Err`: the response refusing it).
fn caller(
    state: &Arc<GatewayState>,
    headers: &HeaderMap,
) -> Result<(Caller, Option<String>), Refused> {
    check_origin(state, headers)?;
    let anonymous = state.mcp.config.anonymous_identity.as_ref().filter(|_| {
        !headers.contains_key("x-api-key") && !headers.contains_key(header::AUTHORIZATION)
    });
    let (edge, credential) = match anonymous {
        Some(identity) => api::caller_edge(
            state,
            crate::auth::Caller {
                identity: identity.clone(),
                token: None,
                scopes: state.mcp.config.anonymous_scopes.clone(),
            },
            Route::Mcp,
        ),
        None => api::edge(state, headers, Route::Mcp),
    }
    .map_err(Refused::Door)?;
    let identity = edge.agent.id().to_owned();
    if let Some(version) = headers.get(PROTOCOL_VERSION) {
        let version = version.to_str().unwrap_or_default();
        if !server::RECOGNIZED.contains(&version) {
            return Err(Refused::transport(
                Http::BAD_REQUEST,
                format!(
                    "MCP-Protocol-Version {version:?}: this server knows {}",
                    server::RECOGNIZED.join(", ")
                ),
            ));
        }
    }
    let session_id = headers
        .get(SESSION)
        .and_then(|s| s.to_str().ok())
        .map(str::to_owned);
    Ok((
        Caller {
            state: Arc::clone(state),
            identity,
            credential,
            session: None,
        },
        session_id,
    ))
}

/// The session a request names, or 404 (the client starts a new one).
fn find_session(caller: &mut Caller, id: Option<&str>) -> Result<(), Refused> {
    if let Some(id) = id {
        match caller.state.mcp.session(id, &caller.identity) {
            Some(session) => caller.session = Some(session),
            None => {
                return Err(Refused::transport(
                    Http::NOT_FOUND,
                    format!("no session {id}: it ended; initialize again"),
                ));
            }
        }
    }
    Ok(())
}

fn takes_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/event-stream"))
}

/// `POST /mcp`.
pub(crate) async fn post(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (mut caller, session_id) = match caller(&state, &headers) {
        Ok(found) => found,
        Err(refused) => return refused.into_response(),
    };
    let bytes = match body {
        Ok(bytes) => bytes,
        Err(e) => {
            return rpc_error(
                e.status(),
                &Value::Null,
                RpcError::new(
                    code::INVALID_REQUEST,
                    format!(
                        "the message: {} (at most {} bytes)",
                        e.body_text(),
                        state.config.max_body_bytes
                    ),
                ),
            );
        }
    };
    let message: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => {
            return rpc_error(
                Http::BAD_REQUEST,
                &Value::Null,
                RpcError::new(code::PARSE, format!("not JSON: {e}")),
            );
        }
    };
    let (id, method, params) = match server::classify(message) {
        Ok(Incoming::Request { id, method, params }) => (id, method, params),
        Ok(Incoming::Notification { method, params }) => {
            if let Err(refused) = find_session(&mut caller, session_id.as_deref()) {
                return refused.into_response();
            }
            caller.notification(&method, &params);
            return Http::ACCEPTED.into_response();
        }
        Ok(Incoming::Response) => return Http::ACCEPTED.into_response(),
        Err((id, e)) => return rpc_error(Http::BAD_REQUEST, &id, e),
    };
    let mut opened = None;
    if method == "initialize" {
        match state.mcp.open(&caller.identity) {
            Some(session) => {
                opened = Some(session.id.clone());
                caller.session = Some(session);
            }
            None => {
                return rpc_error(
                    Http::SERVICE_UNAVAILABLE,
                    &id,
                    RpcError::new(
                        code::INTERNAL,
                        "too many MCP sessions open ([gateway.mcp] max_sessions)",
                    ),
                );
            }
        }
    } else if let Err(refused) = find_session(&mut caller, session_id.as_deref()) {
        return refused.into_response();
    }
    let mut answer = if method == "tools/call" && takes_event_stream(&headers) {
        stream_call(caller, id, params)
    } else {
        let answer = caller.request(&id, &method, &params, &Out::none()).await;
        axum::Json(response(&id, &answer)).into_response()
    };
    if let Some(session) = opened
        && let Ok(value) = HeaderValue::from_str(&session)
    {
        answer.headers_mut().insert(SESSION, value);
    }
    answer
}

/// `tools/call` answered as server-sent events: its notifications as they come, then its
/// response (none when the client cancelled it). A task's events carry ids a client resumes
/// after (`GET /mcp` with `Last-Event-ID`).
fn stream_call(caller: Caller, id: Value, params: Value) -> Response {
    stream_answer(id, move |request, out| async move {
        caller.request(&request, "tools/call", &params, &out).await
    })
}

/// How long a client waits before it reconnects to a broken stream (the priming event's
/// `retry`).
const RETRY: Duration = Duration::from_secs(1);

/// The answer to request `id` as server-sent events: what `run` sends, then its response.
fn stream_answer<F, Fut>(id: Value, run: F) -> Response
where
    F: FnOnce(Value, Out) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<Value, RpcError>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Sent>(64);
    let work = async move {
        let out = Out::resumable(tx.clone(), id.clone());
        let answer = run(id.clone(), out).await;
        if !matches!(&answer, Err(e) if e.code == code::CANCELLED) {
            let _ = tx.send(Sent::message(response(&id, &answer))).await;
        }
        None
    };
    let sent = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|v| (Some(v), rx))
    });
    let events = futures::stream::select(sent, futures::stream::once(work))
        .filter_map(futures::future::ready)
        .map(|sent: Sent| Frame::Event(sent.into()))
        .chain(futures::stream::once(futures::future::ready(Frame::End)));
    let ticks =
        futures::stream::unfold(tokio::time::interval(KEEP_ALIVE), |mut every| async move {
            every.tick().await;
            Some((Frame::Event(": keep-alive\n\n".into()), every))
        })
        .skip(1);
    let body = futures::stream::select(events, ticks)
        .take_while(|frame| futures::future::ready(!matches!(frame, Frame::End)))
        .map(|frame| match frame {
            Frame::Event(text) => Ok::<_, Infallible>(bytes::Bytes::from(text)),
            Frame::End => Ok(bytes::Bytes::new()),
        });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

/// How often an idle event stream carries a comment, so proxies keep it open.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// What an answer's event stream carries: events as written, then its end.
enum Frame {
    Event(String),
    End,
}

impl From<Sent> for String {
    /// One server-sent event, written out: its id, and its message as one `data` line (JSON
    /// has no raw line breaks); a priming event is its id, `retry` and an empty `data` line,
    /// as SEP-1699 has it (which axum's `Event` cannot write: it leaves empty data out).
    fn from(sent: Sent) -> String {
        let mut event = String::new();
        if let Some(id) = sent.id {
            event.push_str(&format!("id: {id}\n"));
        }
        match sent.message {
            Some(message) => event.push_str(&format!("event: message\ndata: {message}\n\n")),
            None => event.push_str(&format!("retry: {}\ndata: \n\n", RETRY.as_millis())),
        }
        event
    }
}

/// `GET /mcp`: `notifications/tools/list_changed` as server-sent events, until the gateway
/// stops or the client leaves.
pub(crate) async fn get(State(state): State<Arc<GatewayState>>, headers: HeaderMap) -> Response {
    let (mut caller, session_id) = match caller(&state, &headers) {
        Ok(found) => found,
        Err(refused) => return refused.into_response(),
    };
    if let Err(refused) = find_session(&mut caller, session_id.as_deref()) {
        return refused.into_response();
    }
    if let Some(last) = headers.get("last-event-id") {
        // A task's call stream, resumed after the event the client last had.
        let Some(resume) = last.to_str().ok().and_then(server::Resume::parse) else {
            return Refused::transport(
                Http::BAD_REQUEST,
                "Last-Event-ID: not an event of this server's",
            )
            .into_response();
        };
        let request = resume.request.clone();
        return stream_answer(request, move |_, out| async move {
            caller.resume(&resume, &out).await
        });
    }
    if !takes_event_stream(&headers) {
        return rpc_error(
            Http::NOT_ACCEPTABLE,
            &Value::Null,
            RpcError::new(
                code::INVALID_REQUEST,
                "GET /mcp is a text/event-stream: say so in Accept",
            ),
        );
    }
    let changes = match watch_tools(&caller).await {
        Ok(rx) => rx,
        Err(e) => {
            return rpc_error(
                Http::SERVICE_UNAVAILABLE,
                &Value::Null,
                RpcError::new(code::INTERNAL, format!("the bus's registry: {e}")),
            );
        }
    };
    let stop = state.stop.clone();
    let events = futures::stream::unfold(changes, |mut rx| async move {
        rx.changed().await.ok()?;
        rx.borrow_and_update();
        let note = json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"});
        Some((
            Ok::<_, Infallible>(Event::default().event("message").data(note.to_string())),
            rx,
        ))
    })
    .take_until(async move { stop.cancelled().await });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// A receiver of the caller's identity's tool list fingerprint, watched by one task per
/// identity for as long as any stream listens.
async fn watch_tools(caller: &Caller) -> Result<watch::Receiver<u64>, chorus_sdk::SdkError> {
    if let Some(tx) = lock(&caller.state.mcp.watchers).get(&caller.identity) {
        return Ok(tx.subscribe());
    }
    let first = caller.table(true).await?.fingerprint;
    let mut watchers = lock(&caller.state.mcp.watchers);
    if let Some(tx) = watchers.get(&caller.identity) {
        return Ok(tx.subscribe());
    }
    let (tx, rx) = watch::channel(first);
    watchers.insert(caller.identity.clone(), tx.clone());
    drop(watchers);
    let mut watcher = caller.clone();
    watcher.session = None;
    // Owned by the gateway's tracker: it ends with the last listener, or when the gateway stops.
    caller.state.tracker.spawn(follow_tools(watcher, tx));
    Ok(rx)
}

async fn follow_tools(caller: Caller, tx: watch::Sender<u64>) {
    let stop = caller.state.stop.clone();
    // The coordinator's registry events say when agents come and go.
    let mut events = match caller
        .state
        .edges
        .get(&caller.identity)
        .map(|edge| edge.agent.subscribe("registry.*"))
    {
        Some(subscribing) => subscribing.await.ok(),
        None => None,
    };
    loop {
        let event = async {
            match events.as_mut() {
                Some(events) => {
                    events.next().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = event => {}
            () = tokio::time::sleep(LIST_RECHECK) => {}
            () = tx.closed() => {
                // The last listener left; one that came meanwhile keeps it going.
                let mut watchers = lock(&caller.state.mcp.watchers);
                if tx.receiver_count() == 0 {
                    watchers.remove(&caller.identity);
                    return;
                }
                continue;
            }
            () = stop.cancelled() => return,
        }
        match caller.table(true).await {
            Ok(table) => {
                tx.send_if_modified(|seen| {
                    let changed = *seen != table.fingerprint;
                    *seen = table.fingerprint;
                    changed
                });
            }
            Err(e) => {
                tracing::debug!(error = %chorus_sdk::Report(&e), "MCP tool list not refreshed");
            }
        }
    }
}

/// `DELETE /mcp`: ends the session named.
pub(crate) async fn delete(State(state): State<Arc<GatewayState>>, headers: HeaderMap) -> Response {
    let (mut caller, session_id) = match caller(&state, &headers) {
        Ok(found) => found,
        Err(refused) => return refused.into_response(),
    };
    let Some(id) = session_id else {
        return rpc_error(
            Http::BAD_REQUEST,
            &Value::Null,
            RpcError::new(
                code::INVALID_REQUEST,
                "no Mcp-Session-Id: no session to end",
            ),
        );
    };
    if let Err(refused) = find_session(&mut caller, Some(&id)) {
        return refused.into_response();
    }
    lock(&state.mcp.sessions).remove(&id);
    caller.end_session_calls(&id);
    Http::NO_CONTENT.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_this_machines_names_with_any_port() {
        for host in [
            "localhost",
            "localhost:8480",
            "127.0.0.1:80",
            "[::1]:8480",
            "[::1]",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8480",
            "10.0.0.1:80",
            "localhost.evil.example",
            "",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }
}
