//! The A2A 1.0 binding (JSON-RPC over HTTP, server-sent events for streams): any agent's
//! command, or any capability, answers as an A2A agent, and every A2A task is a Chorus task
//! in the bus's task stream.
//!
//! - `GET /a2a/agents/{agent}/{command}/.well-known/agent-card.json` and
//!   `GET /a2a/capabilities/{capability}/.well-known/agent-card.json`: the card, made from the
//!   registry's manifest; its one interface is the JSON-RPC endpoint beside it (`.../`).
//! - `SendMessage` submits a task with the message as its input (one data part: its value; text
//!   parts: the text) and answers when the task finishes or asks for input
//!   (`returnImmediately`: at once); a message with a `taskId` answers that task's question.
//!   `SendStreamingMessage` and `SubscribeToTask` stream the task's updates: progress as
//!   `statusUpdate` (working, with its text), chunks as one appended `artifactUpdate`
//!   (`stream`), the result as the `result` artifact, then the final state, and close.
//!   `GetTask` and `CancelTask` read and cancel the task; `ListTasks` pages through the
//!   gateway's index of the bus's tasks (`list.rs`).
//! - `GET /.well-known/agent-card.json`: the card of the agent `a2a_default` names.
//!
//! A task as A2A sees it is made from its messages in the task stream (`view.rs`): states,
//! history, artifacts, and the context (the submission's session). A caller sees only the
//! tasks its own identity submitted to the endpoint it calls.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use chorus_sdk::task::{TaskHandle, TaskMessage, TaskUpdate};
use chorus_sdk::{Envelope, StatusCode, TaskState};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use uuid::Uuid;

use super::api::{self, ApiError};
use super::scopes::Route;
use super::{Edge, GatewayState};
use crate::config::Target;
use view::{Folded, is_terminal, stops};

mod list;
pub(crate) mod push;
pub(crate) mod rest;
mod view;

pub(crate) use list::TaskIndex;

/// JSON-RPC and A2A error codes.
mod code {
    pub(super) const PARSE: i64 = -32700;
    pub(super) const INVALID_REQUEST: i64 = -32600;
    pub(super) const METHOD_NOT_FOUND: i64 = -32601;
    pub(super) const INVALID_PARAMS: i64 = -32602;
    pub(super) const INTERNAL: i64 = -32603;
    pub(super) const TASK_NOT_FOUND: i64 = -32001;
    pub(super) const TASK_NOT_CANCELABLE: i64 = -32002;
    pub(super) const PUSH_NOT_SUPPORTED: i64 = -32003;
    pub(super) const UNSUPPORTED: i64 = -32004;
    pub(super) const EXTENDED_CARD: i64 = -32007;
    pub(super) const VERSION: i64 = -32009;
}

impl Target {
    /// Whether the caller's scopes grant this endpoint (403 saying which if not).
    fn allowed(&self, credential: &api::Credential) -> Result<(), ApiError> {
        let (to, command, capability) = self.names();
        credential.target(to, command, capability)
    }

    /// The target a task submitted here records (`agent.command`, or the capability).
    fn chorus_target(&self) -> String {
        match self {
            Target::Command { agent, command } => format!("{agent}.{command}"),
            Target::Capability(c) => c.clone(),
        }
    }

    /// Whether `submission` was submitted to this endpoint.
    fn submitted_here(&self, submission: &Envelope) -> bool {
        match self {
            Target::Command { agent, command } => {
                submission.capability.is_none()
                    && submission.to.first().is_some_and(|to| to == agent)
                    && submission.name.as_deref() == Some(command.as_str())
            }
            Target::Capability(c) => submission.capability.as_deref() == Some(c.as_str()),
        }
    }

    fn path(&self) -> String {
        match self {
            Target::Command { agent, command } => format!("/a2a/agents/{agent}/{command}"),
            Target::Capability(c) => format!("/a2a/capabilities/{c}"),
        }
    }
}

/// A JSON-RPC error: always HTTP 200 (the client reads the code only then).
#[derive(Debug)]
pub(super) struct RpcError {
    pub(super) code: i64,
    pub(super) message: String,
    /// The HTTP status the gateway's other routes give for the Chorus refusal behind it, if
    /// one is (the REST binding answers with it).
    pub(super) http: Option<u16>,
}

impl RpcError {
    fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
            http: None,
        }
    }
}

impl From<ApiError> for RpcError {
    fn from(e: ApiError) -> Self {
        let body = e.body();
        let status = body["status"].as_u64().unwrap_or(0);
        let label = body["label"].as_str().unwrap_or("");
        let reason = body["reason"].as_str().unwrap_or("");
        let code = match u16::try_from(status).map(StatusCode) {
            Ok(StatusCode::INVALID_ARGUMENT | StatusCode::DATA_FORMAT) => code::INVALID_PARAMS,
            _ => code::INTERNAL,
        };
        let mut rpc = RpcError::new(code, format!("{status} {label}: {reason}"));
        rpc.http = Some(e.http().as_u16());
        rpc
    }
}

impl From<chorus_sdk::SdkError> for RpcError {
    fn from(e: chorus_sdk::SdkError) -> Self {
        RpcError::from(ApiError::from(e))
    }
}

fn rpc_ok(id: &Value, result: Value) -> Response {
    Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response()
}

fn rpc_err(id: &Value, e: &RpcError) -> Response {
    Json(json!({"jsonrpc": "2.0", "id": id, "error": {"code": e.code, "message": e.message}}))
        .into_response()
}

/// The input a message carries: one data part's value, the text of text parts, else the
/// parts as they came.
fn input_of(message: &Value) -> Result<Value, RpcError> {
    let parts = message
        .get("parts")
        .and_then(Value::as_array)
        .filter(|p| !p.is_empty())
        .ok_or_else(|| RpcError::new(code::INVALID_PARAMS, "message.parts: at least one part"))?;
    if let [only] = parts.as_slice()
        && let Some(data) = only.get("data")
    {
        return Ok(data.clone());
    }
    let texts: Option<Vec<&str>> = parts
        .iter()
        .map(|p| p.get("text").and_then(Value::as_str))
        .collect();
    Ok(match texts {
        Some(t) => Value::String(t.join("\n")),
        None => Value::Array(parts.clone()),
    })
}

/// What the card says about authentication (A2A 1.0 `securitySchemes` and
/// `securityRequirements`): exactly the credentials the gateway takes. Any one of an API key
/// (`X-API-Key`) or a bearer JWT is enough; a client certificate, when the gateway requires one,
/// is needed beside it.
fn security(config: &crate::config::GatewayConfig) -> (Value, Value) {
    let mut schemes = serde_json::Map::new();
    let mut alternatives = Vec::new();
    if !config.api_keys.is_empty() {
        schemes.insert(
            "apiKey".into(),
            json!({"apiKeySecurityScheme": {
                "location": "header",
                "name": "X-API-Key",
                "description": "An API key of the gateway's (also taken as Authorization: Bearer <key>).",
            }}),
        );
        alternatives.push("apiKey");
    }
    if config.jwt.is_some() {
        schemes.insert(
            "bearer".into(),
            json!({"httpAuthSecurityScheme": {
                "scheme": "Bearer",
                "bearerFormat": "JWT",
                "description": "A JWT from the gateway's issuer, for its audience; the sub claim names the identity.",
            }}),
        );
        alternatives.push("bearer");
    }
    if let Some(jwt) = config
        .jwt
        .as_ref()
        .filter(|j| j.token_url.is_some() || j.metadata_url.is_some())
    {
        let mut scheme = json!({
            "description": "An OAuth 2 access token (a JWT from the gateway's issuer), sent as a bearer token.",
        });
        if let Some(token_url) = &jwt.token_url {
            scheme["flows"] = json!({"clientCredentials": {"tokenUrl": token_url, "scopes": {}}});
        }
        if let Some(metadata) = &jwt.metadata_url {
            scheme["oauth2MetadataUrl"] = json!(metadata);
        }
        schemes.insert("oauth2".into(), json!({ "oauth2SecurityScheme": scheme }));
        alternatives.push("oauth2");
    }
    let mtls = config
        .tls
        .as_ref()
        .is_some_and(|tls| tls.client_ca_file.is_some());
    if mtls {
        schemes.insert(
            "mtls".into(),
            json!({"mtlsSecurityScheme": {
                "description": "A client certificate from the CA the gateway trusts, in the TLS handshake.",
            }}),
        );
    }
    let requirements: Vec<Value> = alternatives
        .iter()
        .map(|name| {
            let mut needed = serde_json::Map::new();
            needed.insert((*name).into(), json!({"list": []}));
            if mtls {
                needed.insert("mtls".into(), json!({"list": []}));
            }
            json!({ "schemes": needed })
        })
        .collect();
    (Value::Object(schemes), Value::Array(requirements))
}

/// The card of `target`, with its interface at `base` (this gateway, as the caller reached it).
async fn card(
    edge: &Edge,
    target: &Target,
    base: &str,
    config: &crate::config::GatewayConfig,
) -> Result<Value, ApiError> {
    let records = edge
        .agent
        .discover(&chorus_sdk::DiscoverQuery::default())
        .await?;
    let (name, description, skill) = match target {
        Target::Command { agent, command } => {
            let record = records
                .iter()
                .find(|r| &r.manifest.agent == agent)
                .ok_or_else(|| {
                    ApiError::new(StatusCode::NO_RESPONDERS, format!("no live agent {agent}"))
                })?;
            if !record.manifest.commands.iter().any(|c| c == command) {
                return Err(ApiError::new(
                    StatusCode::UNKNOWN_COMMAND,
                    format!("{agent} has no command {command}"),
                ));
            }
            (
                format!("{agent} {command}"),
                format!("The command {command} of the Chorus agent {agent}, run as a task."),
                command.clone(),
            )
        }
        Target::Capability(c) => {
            if !records.iter().any(|r| r.manifest.offers(c)) {
                return Err(ApiError::new(
                    StatusCode::NO_RESPONDERS,
                    format!("no live agent offers {c}"),
                ));
            }
            (
                c.clone(),
                format!(
                    "The capability {c} on a Chorus bus: any agent offering it takes the task."
                ),
                c.clone(),
            )
        }
    };
    let (schemes, requirements) = security(config);
    let mut card = json!({
        "name": name,
        "description": description,
        "version": env!("CARGO_PKG_VERSION"),
        "securitySchemes": schemes,
        "securityRequirements": requirements,
        "supportedInterfaces": [
            {
                "url": format!("{base}{}/", target.path()),
                "protocolBinding": "JSONRPC",
                "protocolVersion": "1.0",
            },
            {
                "url": format!("{base}{}", target.path()),
                "protocolBinding": "HTTP+JSON",
                "protocolVersion": "1.0",
            },
        ],
        "capabilities": {"streaming": true, "pushNotifications": config.push.is_some()},
        "defaultInputModes": ["text/plain", "application/json"],
        "defaultOutputModes": ["text/plain", "application/json"],
        "skills": [{"id": skill, "name": skill, "description": description, "tags": ["chorus"]}],
    });
    // A tenant's caller addresses its tenant in every call.
    if let (Some(tenant), Some(interfaces)) =
        (&edge.tenant, card["supportedInterfaces"].as_array_mut())
    {
        for interface in interfaces {
            interface["tenant"] = json!(tenant);
        }
    }
    Ok(card)
}

/// `http://<host>` (`https://` when the gateway serves TLS) as the caller reached the gateway.
fn base_url(headers: &HeaderMap, tls: bool) -> String {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| {
            !h.is_empty()
                && h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c))
        })
        .unwrap_or("127.0.0.1");
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{host}")
}

/// The edge identity a card is looked up as: the caller's, or with `public_cards` and no
/// credentials, the gateway's first identity (a card says nothing a caller could not learn
/// from the card itself; every call still needs credentials).
/// The edge a card of `target` is read through, if the caller may see it: only a card of what
/// its credentials may call (403 otherwise, as a call would be); anonymously, where
/// `public_cards` allows, any card but the coordinator's, which only an admin scope reaches.
fn card_edge<'a>(
    state: &'a GatewayState,
    headers: &HeaderMap,
    target: &Target,
) -> Result<&'a Edge, ApiError> {
    let (to, command, capability) = target.names();
    let anonymous =
        !headers.contains_key("x-api-key") && !headers.contains_key(header::AUTHORIZATION);
    if state.config.public_cards && anonymous {
        // No credentials: what a caller with no scopes could call.
        api::Credential::none().target(to, command, capability)?;
        return state
            .config
            .identities
            .first()
            .and_then(|i| state.edges.get(&i.id))
            .ok_or_else(|| ApiError::new(StatusCode::UNAVAILABLE, "the gateway has no identity"));
    }
    let (edge, credential) = api::edge(state, headers, Route::A2a)?;
    credential.target(to, command, capability)?;
    Ok(edge)
}

/// `GET /.well-known/agent-card.json`: the card of the agent `a2a_default` names (404 when
/// none is configured).
pub(crate) async fn default_card(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let Some(default) = &state.config.a2a_default else {
        return Err(ApiError::new(
            StatusCode::INVALID_ARGUMENT,
            "no default A2A agent here (a2a_default is unset): cards are under /a2a/",
        )
        .with_http(axum::http::StatusCode::NOT_FOUND));
    };
    let target = match crate::config::a2a_path(default) {
        Ok(target) => target,
        // Checked when the configuration was loaded.
        Err(e) => return Err(ApiError::new(StatusCode::INTERNAL, e)),
    };
    let edge = card_edge(&state, &headers, &target)?;
    let base = base_url(&headers, state.config.tls.is_some());
    Ok(Json(card(edge, &target, &base, &state.config).await?))
}

fn agent_target(agent: String, command: String) -> Result<Target, ApiError> {
    api::call_to(Some(&agent), Some(&command), None)?;
    Ok(Target::Command { agent, command })
}

fn capability_target(capability: String) -> Result<Target, ApiError> {
    api::call_to(None, None, Some(&capability))?;
    Ok(Target::Capability(capability))
}

/// `GET /a2a/agents/{agent}/{command}/.well-known/agent-card.json`.
pub(crate) async fn agent_card(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    Path((agent, command)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let target = agent_target(agent, command)?;
    let edge = card_edge(&state, &headers, &target)?;
    let base = base_url(&headers, state.config.tls.is_some());
    Ok(Json(card(edge, &target, &base, &state.config).await?))
}

/// `GET /a2a/capabilities/{capability}/.well-known/agent-card.json`.
pub(crate) async fn capability_card(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    Path(capability): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let target = capability_target(capability)?;
    let edge = card_edge(&state, &headers, &target)?;
    let base = base_url(&headers, state.config.tls.is_some());
    Ok(Json(card(edge, &target, &base, &state.config).await?))
}

/// `POST /a2a/agents/{agent}/{command}/`.
pub(crate) async fn agent_rpc(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    Path((agent, command)): Path<(String, String)>,
    bytes: Bytes,
) -> Response {
    match agent_target(agent, command) {
        Ok(target) => rpc(state, headers, target, bytes).await,
        Err(e) => e.into_response(),
    }
}

/// `POST /a2a/capabilities/{capability}/`.
pub(crate) async fn capability_rpc(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    Path(capability): Path<String>,
    bytes: Bytes,
) -> Response {
    match capability_target(capability) {
        Ok(target) => rpc(state, headers, target, bytes).await,
        Err(e) => e.into_response(),
    }
}

/// What a method answers: one result, or a stream of them (each a `StreamResponse`).
pub(super) enum Answer {
    One(Value),
    Stream(Pin<Box<dyn Stream<Item = Result<Value, RpcError>> + Send>>),
}

/// The A2A version the caller speaks (A2A 1.0: a missing header means 0.3), refused unless 1.x.
fn check_version(headers: &HeaderMap) -> Result<(), RpcError> {
    let version = headers
        .get("a2a-version")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("0.3");
    if version.starts_with('1') {
        Ok(())
    } else {
        Err(RpcError::new(
            code::VERSION,
            format!("A2A version {version}: this server speaks 1.0"),
        ))
    }
}

async fn rpc(
    state: Arc<GatewayState>,
    headers: HeaderMap,
    target: Target,
    bytes: Bytes,
) -> Response {
    // Credentials first: an unknown caller gets HTTP 401, as at every other route.
    let (edge, credential) = match api::edge(&state, &headers, Route::A2a) {
        Ok(found) => found,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = target.allowed(&credential) {
        return e.into_response();
    }
    let request: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => return rpc_err(&Value::Null, &RpcError::new(code::PARSE, e.to_string())),
    };
    // JSON-RPC 2.0: a request without an id is a notification, which is never answered. A2A
    // defines none, so nothing is run for one: a message sent without an id cannot run an
    // agent's work that nobody would hear the end of.
    // (Only a well-formed one: a malformed message without an id is still -32600.)
    if request.get("id").is_none()
        && request.get("jsonrpc").and_then(Value::as_str) == Some("2.0")
        && request.get("method").is_some_and(Value::is_string)
    {
        tracing::debug!(identity = %edge.agent.id(), "A2A: a JSON-RPC notification ignored");
        return axum::http::StatusCode::NO_CONTENT.into_response();
    }
    let id = request.get("id").cloned().unwrap_or(Value::Null);
    // JSON-RPC 2.0: an id is a string, a number or null; with another, the request is
    // invalid and the error's id is null.
    if !matches!(id, Value::String(_) | Value::Number(_) | Value::Null) {
        return rpc_err(
            &Value::Null,
            &RpcError::new(
                code::INVALID_REQUEST,
                "id: a string, a number or null (JSON-RPC 2.0)",
            ),
        );
    }
    let (Some(method), Some("2.0")) = (
        request.get("method").and_then(Value::as_str),
        request.get("jsonrpc").and_then(Value::as_str),
    ) else {
        return rpc_err(
            &id,
            &RpcError::new(
                code::INVALID_REQUEST,
                "a JSON-RPC 2.0 request with a method",
            ),
        );
    };
    if let Err(e) = check_version(&headers) {
        return rpc_err(&id, &e);
    }
    let params = request.get("params").cloned().unwrap_or_else(|| json!({}));
    let call = Method {
        state: &state,
        edge,
        credential: &credential,
        target: &target,
    };
    match call.run(method, &params).await {
        Ok(Answer::One(result)) => rpc_ok(&id, result),
        Ok(Answer::Stream(events)) => {
            let events = events.map(move |item| {
                let body = match item {
                    Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
                    Err(e) => json!({"jsonrpc": "2.0", "id": id, "error": {"code": e.code, "message": e.message}}),
                };
                Ok::<_, Infallible>(Event::default().data(body.to_string()))
            });
            Sse::new(events)
                .keep_alive(KeepAlive::default())
                .into_response()
        }
        Err(e) => rpc_err(&id, &e),
    }
}

/// What every method's params must be: an object; a `historyLength`, where given, a whole
/// number not below 0; a message, where given, with its `messageId`, `role` and `parts` (a
/// message MUST have all three).
fn check_params(params: &Value) -> Result<(), RpcError> {
    let invalid = |what: &str| Err(RpcError::new(code::INVALID_PARAMS, what.to_owned()));
    if !params.is_object() {
        return invalid("params: an object");
    }
    for pointer in ["/historyLength", "/configuration/historyLength"] {
        if let Some(length) = params.pointer(pointer)
            && !length.is_null()
            && length.as_u64().is_none_or(|n| n > i32::MAX as u64)
        {
            return invalid("historyLength: a whole number, 0 or more");
        }
    }
    if let Some(message) = params.get("message") {
        if message
            .get("messageId")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            return invalid("message.messageId: a non-empty string is required");
        }
        if !matches!(
            message.get("role").and_then(Value::as_str),
            Some("ROLE_USER" | "ROLE_AGENT")
        ) {
            return invalid("message.role: ROLE_USER or ROLE_AGENT is required");
        }
        if message
            .get("parts")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty)
        {
            return invalid("message.parts: at least one part is required");
        }
    }
    Ok(())
}

/// How many of a task's messages a view reads at most.
const MAX_TASK_MESSAGES: usize = 10_000;

/// A task this identity submitted to this endpoint, with its messages folded.
struct Owned {
    handle: TaskHandle,
    updates: Vec<TaskUpdate>,
    folded: Folded,
}

impl Owned {
    /// The task as it stood at sequence `seq`: where a stream that reports what came after
    /// begins.
    fn at(mut self, seq: u64) -> Self {
        self.updates.retain(|u| u.seq <= seq);
        self.folded = Folded::new(self.folded.id, &self.updates);
        self
    }
}

/// How a message started: the task, whether the caller asked to be answered at once, and,
/// when the message answered a question, the sequence of the state that asked it (the task
/// reads input-required until its worker moves on: that state is not where to stop, a later
/// one is).
struct Started {
    task: Owned,
    at_once: bool,
    answered: Option<u64>,
}

impl Folded {
    /// Whether this is where a send or a stream stops: a final state or a question, other
    /// than the question just answered.
    fn settled(&self, answered: Option<u64>) -> bool {
        stops(self.state) && answered.is_none_or(|asked| self.state_seq > asked)
    }
}

/// A message's task, submitted and not read back yet.
struct New<'p> {
    id: Uuid,
    handle: TaskHandle,
    push_config: Option<&'p Value>,
    at_once: bool,
}

/// What a message began: a new task, or an answer to a task's question.
enum Begun<'p> {
    New(New<'p>),
    Answered(Started),
}

/// How many times a blocking send follows its task again after the task stream's reader
/// failed (a consumer lost under load, a reconnect), before it answers with the task as it is.
const FOLLOW_TRIES: usize = 3;

/// Follows the task's changes after `seq` until `each` breaks (it is handed every change, in
/// order), the task's changes end, or `deadline` passes: `true`. A reader that fails is opened
/// again from the last change it gave, at most [`FOLLOW_TRIES`] times (a transient error does
/// not end the wait early with the task still working): `false` when none got there. The
/// reader's consumer is removed by a task `tracker` owns, so the caller need not wait for it.
async fn follow_task(
    handle: &TaskHandle,
    mut seq: u64,
    deadline: tokio::time::Instant,
    tracker: &tokio_util::task::TaskTracker,
    mut each: impl FnMut(TaskUpdate) -> std::ops::ControlFlow<()>,
) -> bool {
    for _ in 0..FOLLOW_TRIES {
        let mut updates = match tokio::time::timeout_at(deadline, handle.updates_after(seq)).await {
            Err(_) => return true,
            Ok(Ok(updates)) => updates,
            Ok(Err(e)) => {
                tracing::warn!(task = %handle.id(), error = %e, "following the task failed");
                continue;
            }
        };
        let done = loop {
            let Ok(next) = tokio::time::timeout_at(deadline, updates.next()).await else {
                break true;
            };
            match next {
                Some(Ok(u)) => {
                    seq = u.seq;
                    if each(u).is_break() {
                        break true;
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(task = %handle.id(), error = %e, "reading the task failed; following it again");
                    break false;
                }
                // The updates end after the task's final state.
                None => break true,
            }
        };
        // Left before its end (at a question, on time or on an error): its consumer goes, after
        // the answer rather than before it (bounded by the broker's request timeout; the server
        // drops an idle consumer by itself after 30 s in any case).
        tracker.spawn(updates.close());
        if done {
            return true;
        }
    }
    false
}

/// Waits until the task reaches a state where a blocking send stops (a final state or a
/// question) or `deadline` passes, reading its changes after `seq` ([`follow_task`]).
async fn until_stopped(
    handle: &TaskHandle,
    seq: u64,
    deadline: tokio::time::Instant,
    tracker: &tokio_util::task::TaskTracker,
) {
    follow_task(handle, seq, deadline, tracker, |u| {
        if u.state().is_some_and(stops) {
            std::ops::ControlFlow::Break(())
        } else {
            std::ops::ControlFlow::Continue(())
        }
    })
    .await;
}

/// One call of a method, by one caller, on one endpoint.
pub(super) struct Method<'a> {
    pub(super) state: &'a GatewayState,
    pub(super) edge: &'a Edge,
    pub(super) credential: &'a api::Credential,
    pub(super) target: &'a Target,
}

impl Method<'_> {
    /// Runs `method` with `params` (JSON-RPC's names; the REST binding maps its routes here).
    pub(super) async fn run(&self, method: &str, params: &Value) -> Result<Answer, RpcError> {
        check_params(params)?;
        self.check_tenant(params.get("tenant"))?;
        let history = params
            .get("historyLength")
            .or_else(|| params.pointer("/configuration/historyLength"))
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok());
        match method {
            "SendMessage" => self.send_message(params, history).await.map(Answer::One),
            "SendStreamingMessage" => {
                // From the message on: the submission, or the question it answered.
                let started = self.start(params).await?;
                let from = started
                    .answered
                    .or_else(|| started.task.updates.first().map(|u| u.seq))
                    .unwrap_or(0);
                Ok(self.stream(started.task.at(from), started.answered))
            }
            "SubscribeToTask" => {
                let task = self.owned(params).await?;
                if is_terminal(task.folded.state) {
                    return Err(RpcError::new(
                        code::UNSUPPORTED,
                        format!(
                            "task {} is {}: nothing more to stream",
                            task.folded.id,
                            task.folded.state.as_str()
                        ),
                    ));
                }
                Ok(self.stream(task, None))
            }
            "GetTask" => {
                let task = self.owned(params).await?;
                Ok(Answer::One(task.folded.task(history, true)))
            }
            "CancelTask" => {
                let task = self.owned(params).await?;
                if is_terminal(task.folded.state) {
                    return Err(RpcError::new(
                        code::TASK_NOT_CANCELABLE,
                        format!(
                            "task {} is {} already",
                            task.folded.id,
                            task.folded.state.as_str()
                        ),
                    ));
                }
                task.handle.cancel().await?;
                let task = self.load(task.handle).await?;
                Ok(Answer::One(task.folded.task(None, true)))
            }
            "ListTasks" => self.list(params).await.map(Answer::One),
            "GetExtendedAgentCard" => Err(RpcError::new(
                code::EXTENDED_CARD,
                "this agent has no extended card: its card is the same for every caller",
            )),
            m if m.contains("PushNotificationConfig") => self.push_method(m, params).await,
            other => Err(RpcError::new(
                code::METHOD_NOT_FOUND,
                format!("no method {other}"),
            )),
        }
    }

    /// A2A's `tenant`, where given, must be the caller's own: its identity's tenant (none:
    /// the bus's own root). Another is refused alike whether it exists or not.
    pub(super) fn check_tenant(&self, tenant: Option<&Value>) -> Result<(), RpcError> {
        let asked = match tenant {
            None | Some(Value::Null) => return Ok(()),
            Some(Value::String(t)) if t.is_empty() => return Ok(()),
            Some(Value::String(t)) => t.as_str(),
            Some(_) => return Err(RpcError::new(code::INVALID_PARAMS, "tenant: a string")),
        };
        if self.edge.tenant.as_deref() == Some(asked) {
            Ok(())
        } else {
            Err(RpcError::new(
                code::INVALID_PARAMS,
                format!("tenant {asked}: not one these credentials reach"),
            ))
        }
    }

    /// The push notification config methods.
    async fn push_method(&self, method: &str, params: &Value) -> Result<Answer, RpcError> {
        let Some(push) = &self.state.push else {
            return Err(RpcError::new(
                code::PUSH_NOT_SUPPORTED,
                "push notifications are not enabled on this gateway ([gateway.push])",
            ));
        };
        let task_id = match params.get("taskId") {
            Some(Value::String(id)) => id.as_str(),
            Some(_) => {
                return Err(RpcError::new(
                    code::INVALID_PARAMS,
                    "taskId: a task id, as a string",
                ));
            }
            None => return Err(RpcError::new(code::INVALID_PARAMS, "taskId is required")),
        };
        let task = self.owned_id(task_id).await?;
        let id = task.folded.id;
        let config_id = || match params.get("id") {
            Some(Value::String(c)) if !c.is_empty() => Ok(c.as_str()),
            _ => Err(RpcError::new(
                code::INVALID_PARAMS,
                "id: the config's id is required",
            )),
        };
        Ok(Answer::One(match method {
            "CreateTaskPushNotificationConfig" => {
                push.create(&self.edge.agent, task.handle, task.folded, params)
                    .await?
            }
            "GetTaskPushNotificationConfig" => push.get(id, config_id()?)?,
            "ListTaskPushNotificationConfigs" => push.list(id),
            "DeleteTaskPushNotificationConfig" => {
                push.delete(&self.edge.agent, id, config_id()?).await?;
                json!({})
            }
            other => {
                return Err(RpcError::new(
                    code::METHOD_NOT_FOUND,
                    format!("no method {other}"),
                ));
            }
        }))
    }

    /// Task `id`'s messages, if this identity submitted it to this endpoint (any other task
    /// is not found, as if it did not exist).
    async fn load(&self, handle: TaskHandle) -> Result<Owned, RpcError> {
        let id = handle.id();
        let not_found = || RpcError::new(code::TASK_NOT_FOUND, format!("no task {id}"));
        let updates = match handle.history(MAX_TASK_MESSAGES).await {
            Ok(u) => u,
            Err(chorus_sdk::SdkError::TaskNotFound(_)) => return Err(not_found()),
            Err(e) => return Err(e.into()),
        };
        let submission = &updates[0].envelope;
        if submission.from.as_str() != self.edge.agent.id()
            || !self.target.submitted_here(submission)
        {
            return Err(not_found());
        }
        Ok(Owned {
            handle,
            folded: Folded::new(id, &updates),
            updates,
        })
    }

    /// The task `params.id` names, if this identity submitted it here.
    async fn owned(&self, params: &Value) -> Result<Owned, RpcError> {
        match params.get("id") {
            Some(Value::String(id)) => self.owned_id(id).await,
            Some(_) => Err(RpcError::new(
                code::INVALID_PARAMS,
                "params.id: a task id, as a string",
            )),
            None => Err(RpcError::new(code::INVALID_PARAMS, "params.id is required")),
        }
    }

    async fn owned_id(&self, id: &str) -> Result<Owned, RpcError> {
        let not_found = || RpcError::new(code::TASK_NOT_FOUND, format!("no task {id}"));
        let id: Uuid = id.parse().map_err(|_| not_found())?;
        match self.edge.agent.task(id).await {
            Ok(handle) => self.load(handle).await,
            Err(chorus_sdk::SdkError::TaskNotFound(_)) => Err(not_found()),
            Err(e) => Err(e.into()),
        }
    }

    /// Submits the message's task, or answers the question of the task it names.
    async fn start(&self, params: &Value) -> Result<Started, RpcError> {
        match self.begin(params).await? {
            Begun::Answered(started) => Ok(started),
            Begun::New(new) => self.read_new(new).await,
        }
    }

    /// A task just submitted, read back (and its push config created, if the message gave
    /// one).
    async fn read_new(&self, new: New<'_>) -> Result<Started, RpcError> {
        let New {
            id,
            handle,
            push_config,
            at_once,
        } = new;
        let task = self.load(handle).await?;
        if let (Some(config), Some(push)) = (push_config, &self.state.push) {
            let handle = self.edge.agent.task(id).await?;
            push.create(
                &self.edge.agent,
                handle,
                Folded::new(id, &task.updates),
                config,
            )
            .await?;
        }
        Ok(Started {
            task,
            at_once,
            answered: None,
        })
    }

    /// Follows a task just submitted from its submission until it finishes or asks (or the
    /// longest request timeout passes), and folds what it read. A reader that fails is opened
    /// again after the last message it gave, at most [`FOLLOW_TRIES`] times; a task with more
    /// messages than a view reads, or one never read, is read back as any other.
    async fn follow_new(&self, handle: TaskHandle) -> Result<Folded, RpcError> {
        let wait = Duration::from_millis(self.state.config.max_request_timeout_ms);
        let deadline = tokio::time::Instant::now() + wait;
        let tracker = &self.state.tracker;
        let mut read: Vec<TaskUpdate> = Vec::new();
        let followed = follow_task(&handle, 0, deadline, tracker, |u| {
            let stopped = u.state().is_some_and(stops);
            read.push(u);
            if stopped || read.len() >= MAX_TASK_MESSAGES {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            }
        })
        .await;
        // Read to where a send stops (or to the deadline) within the view's reach: folded.
        if followed && !read.is_empty() && read.len() < MAX_TASK_MESSAGES {
            return Ok(Folded::new(handle.id(), &read));
        }
        // Not read, or more than a view reads: from the stream, as it stands after waiting
        // for the rest.
        let after = read.last().map_or(0, |u| u.seq);
        until_stopped(&handle, after, deadline, tracker).await;
        Ok(self.load(handle).await?.folded)
    }

    /// Submits the message's task, or answers the question of the task it names; a new task
    /// is not read back yet.
    async fn begin<'p>(&self, params: &'p Value) -> Result<Begun<'p>, RpcError> {
        let message = params
            .get("message")
            .filter(|m| m.is_object())
            .ok_or_else(|| RpcError::new(code::INVALID_PARAMS, "params.message is required"))?;
        let input = input_of(message)?;
        let text = |name: &str| match message.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.as_str())),
            Some(_) => Err(RpcError::new(
                code::INVALID_PARAMS,
                format!("message.{name}: a non-empty string"),
            )),
        };
        let context = text("contextId")?;
        let at_once = params
            .pointer("/configuration/returnImmediately")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if let Some(task) = text("taskId")? {
            let owned = self.owned_id(task).await?;
            if context.is_some_and(|c| c != owned.folded.context) {
                return Err(RpcError::new(
                    code::INVALID_PARAMS,
                    format!(
                        "message.contextId: task {task} is in context {}",
                        owned.folded.context
                    ),
                ));
            }
            if owned.folded.state != TaskState::InputRequired {
                return Err(RpcError::new(
                    code::UNSUPPORTED,
                    format!(
                        "task {task} is {}, not waiting for input",
                        owned.folded.state.as_str()
                    ),
                ));
            }
            let asked = owned.folded.state_seq;
            owned.handle.respond(&input).await?;
            let task = self.load(owned.handle).await?;
            return Ok(Begun::Answered(Started {
                task,
                at_once,
                answered: Some(asked),
            }));
        }
        // A push config given with the message is checked before anything is submitted.
        let push_config = params
            .pointer("/configuration/taskPushNotificationConfig")
            .filter(|c| !c.is_null());
        if let Some(config) = push_config {
            self.state
                .push
                .as_ref()
                .ok_or_else(|| {
                    RpcError::new(
                        code::PUSH_NOT_SUPPORTED,
                        "push notifications are not enabled on this gateway ([gateway.push])",
                    )
                })?
                .check(config)?;
        }
        // The id is chosen here, so a task its target refused is still there to report; a
        // message without a context starts one named after its task.
        let id = Uuid::now_v7();
        let message_id = text("messageId")?.unwrap_or_default();
        let (to, command, capability) = self.target.names();
        let call = self
            .credential
            .call(to, command, capability)
            .map_err(RpcError::from)?
            .id(id)
            .session(context.map_or_else(|| id.to_string(), str::to_owned))
            .header(view::MESSAGE_ID_HEADER, message_id)
            .json_payload(&input)
            .map_err(RpcError::from)?;
        let handle = match self.edge.agent.submit(call).await {
            Ok(handle) => handle,
            Err(refused) => self
                .edge
                .agent
                .task(id)
                .await
                .map_err(|_| RpcError::from(refused))?,
        };
        Ok(Begun::New(New {
            id,
            handle,
            push_config,
            at_once,
        }))
    }

    async fn send_message(
        &self,
        params: &Value,
        history: Option<usize>,
    ) -> Result<Value, RpcError> {
        // A new task the caller waits for: followed from its submission, one read of the
        // task stream (not one to read it back, one to follow it and one for its end).
        let started = match self.begin(params).await? {
            Begun::New(new) if !new.at_once && new.push_config.is_none() => {
                let folded = self.follow_new(new.handle).await?;
                return Ok(json!({"task": folded.task(history, true)}));
            }
            Begun::New(new) => self.read_new(new).await?,
            Begun::Answered(started) => started,
        };
        let Started {
            task,
            at_once,
            answered,
        } = started;
        if at_once || task.folded.settled(answered) {
            return Ok(json!({"task": task.folded.task(history, true)}));
        }
        // Blocking: until it finishes or asks, within the longest request timeout.
        let wait = Duration::from_millis(self.state.config.max_request_timeout_ms);
        let deadline = tokio::time::Instant::now() + wait;
        until_stopped(
            &task.handle,
            task.folded.last_seq,
            deadline,
            &self.state.tracker,
        )
        .await;
        let task = self.load(task.handle).await?;
        Ok(json!({"task": task.folded.task(history, true)}))
    }

    async fn list(&self, params: &Value) -> Result<Value, RpcError> {
        let query = list::Query::parse(params)?;
        let page = self
            .state
            .a2a_index
            .page(&self.edge.agent, &self.target.chorus_target(), &query)
            .await?;
        let mut tasks = Vec::with_capacity(page.entries.len());
        for entry in &page.entries {
            let handle = match self.edge.agent.task(entry.id).await {
                Ok(handle) => handle,
                // Gone from the stream since the index read it.
                Err(chorus_sdk::SdkError::TaskNotFound(_)) => continue,
                Err(e) => return Err(e.into()),
            };
            match self.load(handle).await {
                Ok(task) => tasks.push(task.folded.task(query.history, query.artifacts)),
                Err(e) if e.code == code::TASK_NOT_FOUND => {}
                Err(e) => return Err(e),
            }
        }
        Ok(list::response(tasks, &page))
    }

    /// The task's events: its snapshot first, then each new message's events, ending after a
    /// final state or a question (not the one just `answered`).
    fn stream(&self, task: Owned, answered: Option<u64>) -> Answer {
        let Owned {
            handle, mut folded, ..
        } = task;
        let first = json!({"task": folded.task(None, true)});
        if folded.settled(answered) {
            return Answer::Stream(Box::pin(futures::stream::once(async move { Ok(first) })));
        }
        let stop = self.state.stop.clone();
        let after = folded.last_seq;
        let rest = futures::stream::once(async move { handle.updates_after(after).await })
            .flat_map(move |opened| match opened {
                Ok(updates) => updates.left_stream(),
                Err(e) => futures::stream::once(async move { Err(e) }).right_stream(),
            })
            .take_until(async move { stop.cancelled().await })
            .scan(false, move |done, update| {
                if *done {
                    return futures::future::ready(None);
                }
                let events: Vec<Result<Value, RpcError>> = match update {
                    Ok(u) => {
                        let events = folded.apply(&u);
                        *done = folded.settled(answered) && u.kind == TaskMessage::Status;
                        events.into_iter().map(Ok).collect()
                    }
                    Err(e) => {
                        *done = true;
                        vec![Err(RpcError::from(e))]
                    }
                };
                futures::future::ready(Some(futures::stream::iter(events)))
            })
            .flatten();
        Answer::Stream(Box::pin(
            futures::stream::once(async move { Ok(first) }).chain(rest),
        ))
    }
}
