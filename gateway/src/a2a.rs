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
//!   `GetTask`, `ListTasks` and `CancelTask` map to the task's report and cancel.
//!
//! States: submitted and accepted are `TASK_STATE_SUBMITTED`, working `..._WORKING`,
//! input required `..._INPUT_REQUIRED`, completed, failed, cancelled and rejected their own,
//! expired `..._FAILED` (its status message says so). A caller sees only the tasks its own
//! identity submitted. Each task is its own context (`contextId` is the task id).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use chorus_sdk::task::{TaskHandle, TaskReport, TaskUpdate};
use chorus_sdk::{Call, StatusCode, TaskState};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use uuid::Uuid;

use super::api::{self, ApiError};
use super::tasks::json_of;
use super::{Edge, GatewayState};

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
    pub(super) const VERSION: i64 = -32009;
}

/// Most tasks `ListTasks` returns.
const MAX_LIST: usize = 100;

/// What an A2A endpoint stands for: one agent's command, or a capability.
#[derive(Debug, Clone)]
enum Target {
    Command { agent: String, command: String },
    Capability(String),
}

impl Target {
    fn call(&self) -> Result<Call, ApiError> {
        match self {
            Target::Command { agent, command } => api::call_to(Some(agent), Some(command), None),
            Target::Capability(c) => api::call_to(None, None, Some(c)),
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
struct RpcError {
    code: i64,
    message: String,
}

impl RpcError {
    fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
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
        RpcError::new(code, format!("{status} {label}: {reason}"))
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

fn now_ms() -> u64 {
    chorus_sdk::envelope::now_ms()
}

fn a2a_state(state: TaskState) -> &'static str {
    match state {
        TaskState::Working | TaskState::Running => "TASK_STATE_WORKING",
        TaskState::InputRequired => "TASK_STATE_INPUT_REQUIRED",
        TaskState::Completed => "TASK_STATE_COMPLETED",
        TaskState::Failed | TaskState::Expired => "TASK_STATE_FAILED",
        TaskState::Cancelled => "TASK_STATE_CANCELED",
        TaskState::Rejected => "TASK_STATE_REJECTED",
        _ => "TASK_STATE_SUBMITTED",
    }
}

fn is_terminal(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Completed
            | TaskState::Failed
            | TaskState::Cancelled
            | TaskState::Rejected
            | TaskState::Expired
    )
}

/// Where a stream or a blocking send stops: a final state, or a question.
fn stops(state: TaskState) -> bool {
    is_terminal(state) || state == TaskState::InputRequired
}

/// A part holding `value`: text for a string, data otherwise.
fn part(value: &Value) -> Value {
    match value {
        Value::String(s) => json!({"text": s}),
        other => json!({"data": other, "mediaType": "application/json"}),
    }
}

fn agent_message(task: Uuid, parts: Vec<Value>) -> Value {
    json!({
        "messageId": Uuid::now_v7().to_string(),
        "role": "ROLE_AGENT",
        "parts": parts,
        "taskId": task.to_string(),
        "contextId": task.to_string(),
    })
}

/// The status of a task in `state`, with `text` and `data` as its message when there are any.
fn status(task: Uuid, state: TaskState, at_ms: u64, text: Option<&str>, data: &Value) -> Value {
    let mut s =
        json!({"state": a2a_state(state), "timestamp": chorus_sdk::envelope::rfc3339(at_ms)});
    let mut parts = Vec::new();
    if let Some(t) = text.filter(|t| !t.is_empty()) {
        parts.push(json!({"text": t}));
    }
    if !data.is_null() {
        parts.push(part(data));
    }
    if state == TaskState::Expired && parts.is_empty() {
        parts.push(json!({"text": "the task's deadline passed"}));
    }
    if !parts.is_empty() {
        s["message"] = agent_message(task, parts);
    }
    s
}

fn result_artifact(task: Uuid, output: &Value) -> Value {
    json!({"artifactId": format!("{task}-result"), "name": "result", "parts": [part(output)]})
}

/// A report as an A2A task.
fn task_json(r: &TaskReport) -> Value {
    let output = json_of(&r.output, &r.content_type);
    let (text, data) = match r.state {
        TaskState::InputRequired => (r.reason.as_deref(), output.clone()),
        s if is_terminal(s) && s != TaskState::Completed => (r.reason.as_deref(), Value::Null),
        _ => (None, Value::Null),
    };
    let at = r.finished_ms.unwrap_or_else(now_ms);
    let mut task = json!({
        "id": r.id.to_string(),
        "contextId": r.id.to_string(),
        "status": status(r.id, r.state, at, text, &data),
    });
    if r.state == TaskState::Completed && !output.is_null() {
        task["artifacts"] = json!([result_artifact(r.id, &output)]);
    }
    task
}

/// One task update as stream events (none for the kinds A2A has no word for).
fn update_events(task: Uuid, u: &TaskUpdate) -> Vec<Value> {
    let ids = || (task.to_string(), task.to_string());
    let payload = json_of(&u.envelope.payload, &u.envelope.content_type);
    if let Some(state) = u.state() {
        let (task_id, context_id) = ids();
        let mut out = Vec::new();
        if state == TaskState::Completed && !payload.is_null() {
            out.push(json!({"artifactUpdate": {
                "taskId": task_id, "contextId": context_id,
                "artifact": result_artifact(task, &payload), "lastChunk": true,
            }}));
        }
        let data = if state == TaskState::InputRequired {
            payload
        } else {
            Value::Null
        };
        let text = if state == TaskState::Completed {
            None
        } else {
            u.text()
        };
        out.push(json!({"statusUpdate": {
            "taskId": task.to_string(), "contextId": task.to_string(),
            "status": status(task, state, u.stored_ms, text, &data),
        }}));
        return out;
    }
    match u.kind {
        chorus_sdk::task::TaskMessage::Progress => {
            let (task_id, context_id) = ids();
            vec![json!({"statusUpdate": {
                "taskId": task_id, "contextId": context_id,
                "status": status(task, TaskState::Working, u.stored_ms, u.text(), &Value::Null),
            }})]
        }
        chorus_sdk::task::TaskMessage::Chunk => {
            let (task_id, context_id) = ids();
            let n = u.chunk().unwrap_or(1);
            vec![json!({"artifactUpdate": {
                "taskId": task_id, "contextId": context_id,
                "artifact": {"artifactId": format!("{task}-stream"), "name": "stream", "parts": [part(&payload)]},
                "append": n > 1,
                "lastChunk": u.is_last_chunk(),
            }})]
        }
        _ => Vec::new(),
    }
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
    Ok(json!({
        "name": name,
        "description": description,
        "version": env!("CARGO_PKG_VERSION"),
        "securitySchemes": schemes,
        "securityRequirements": requirements,
        "supportedInterfaces": [{
            "url": format!("{base}{}/", target.path()),
            "protocolBinding": "JSONRPC",
            "protocolVersion": "1.0",
        }],
        "capabilities": {"streaming": true, "pushNotifications": false},
        "defaultInputModes": ["text/plain", "application/json"],
        "defaultOutputModes": ["text/plain", "application/json"],
        "skills": [{"id": skill, "name": skill, "description": description, "tags": ["chorus"]}],
    }))
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
fn card_edge<'a>(state: &'a GatewayState, headers: &HeaderMap) -> Result<&'a Edge, ApiError> {
    let anonymous =
        !headers.contains_key("x-api-key") && !headers.contains_key(header::AUTHORIZATION);
    if state.config.public_cards && anonymous {
        return state
            .config
            .identities
            .first()
            .and_then(|i| state.edges.get(&i.id))
            .ok_or_else(|| ApiError::new(StatusCode::UNAVAILABLE, "the gateway has no identity"));
    }
    Ok(api::edge(state, headers)?.0)
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
    let edge = card_edge(&state, &headers)?;
    let target = agent_target(agent, command)?;
    let base = base_url(&headers, state.config.tls.is_some());
    Ok(Json(card(edge, &target, &base, &state.config).await?))
}

/// `GET /a2a/capabilities/{capability}/.well-known/agent-card.json`.
pub(crate) async fn capability_card(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    Path(capability): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let edge = card_edge(&state, &headers)?;
    let target = capability_target(capability)?;
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

async fn rpc(
    state: Arc<GatewayState>,
    headers: HeaderMap,
    target: Target,
    bytes: Bytes,
) -> Response {
    // Credentials first: an unknown caller gets HTTP 401, as at every other route.
    let (edge, token) = match api::edge(&state, &headers) {
        Ok(found) => found,
        Err(e) => return e.into_response(),
    };
    let request: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => return rpc_err(&Value::Null, &RpcError::new(code::PARSE, e.to_string())),
    };
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
    let version = headers
        .get("a2a-version")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("0.3");
    if !version.starts_with('1') {
        return rpc_err(
            &id,
            &RpcError::new(
                code::VERSION,
                format!("A2A version {version}: this server speaks 1.0"),
            ),
        );
    }
    let params = request.get("params").cloned().unwrap_or_else(|| json!({}));
    if let Err(e) = check_params(&params) {
        return rpc_err(&id, &e);
    }
    let token = token.as_deref();
    let done = match method {
        "SendMessage" => send_message(&state, edge, token, &target, &params)
            .await
            .map(|r| rpc_ok(&id, r)),
        "SendStreamingMessage" => match start(edge, token, &target, &params).await {
            Ok(started) => {
                return stream(&state, &id, started.handle, None, started.answered).await;
            }
            Err(e) => Err(e),
        },
        "SubscribeToTask" => match owned(edge, &params).await {
            Ok((_, report)) if is_terminal(report.state) => Err(RpcError::new(
                code::UNSUPPORTED,
                format!(
                    "task {} is {}: nothing more to stream",
                    report.id,
                    report.state.as_str()
                ),
            )),
            Ok((handle, report)) => return stream(&state, &id, handle, Some(report), None).await,
            Err(e) => Err(e),
        },
        "GetTask" => owned(edge, &params)
            .await
            .map(|(_, r)| rpc_ok(&id, task_json(&r))),
        "CancelTask" => match owned(edge, &params).await {
            Ok((_, report)) if is_terminal(report.state) => Err(RpcError::new(
                code::TASK_NOT_CANCELABLE,
                format!("task {} is {} already", report.id, report.state.as_str()),
            )),
            Ok((handle, _)) => handle
                .cancel()
                .await
                .map(|r| rpc_ok(&id, task_json(&r)))
                .map_err(RpcError::from),
            Err(e) => Err(e),
        },
        "ListTasks" => list(edge, &params).await.map(|r| rpc_ok(&id, r)),
        m if m.contains("PushNotificationConfig") => Err(RpcError::new(
            code::PUSH_NOT_SUPPORTED,
            "push notifications are not supported",
        )),
        other => Err(RpcError::new(
            code::METHOD_NOT_FOUND,
            format!("no method {other}"),
        )),
    };
    done.unwrap_or_else(|e| rpc_err(&id, &e))
}

/// What every method's params must be: an object; a `historyLength`, where given, a whole
/// number not below 0; a message, where given, with its `messageId`.
fn check_params(params: &Value) -> Result<(), RpcError> {
    let invalid = |what: &str| Err(RpcError::new(code::INVALID_PARAMS, what.to_owned()));
    if !params.is_object() {
        return invalid("params: an object");
    }
    for pointer in ["/historyLength", "/configuration/historyLength"] {
        if let Some(length) = params.pointer(pointer)
            && length.as_u64().is_none_or(|n| n > i32::MAX as u64)
        {
            return invalid("historyLength: a whole number, 0 or more");
        }
    }
    if let Some(message) = params.get("message")
        && message
            .get("messageId")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
    {
        return invalid("message.messageId: a non-empty string is required");
    }
    Ok(())
}

/// The task `params.id` names, if this identity submitted it.
async fn owned(edge: &Edge, params: &Value) -> Result<(TaskHandle, TaskReport), RpcError> {
    let id = match params.get("id") {
        Some(Value::String(id)) => id.as_str(),
        Some(_) => {
            return Err(RpcError::new(
                code::INVALID_PARAMS,
                "params.id: a task id, as a string",
            ));
        }
        None => {
            return Err(RpcError::new(code::INVALID_PARAMS, "params.id is required"));
        }
    };
    super::tasks::owned(edge, id)
        .await
        .map_err(|_| RpcError::new(code::TASK_NOT_FOUND, format!("no task {id}")))
}

/// How a message started: the task's handle, whether the caller asked to be answered at
/// once, and, when the message answered a question, the sequence of the state that asked it
/// (the task reads input-required until its worker moves on: that state is not where to
/// stop, a later one is).
struct Started {
    handle: TaskHandle,
    at_once: bool,
    answered: Option<u64>,
}

/// Whether `report` is where a send or a stream stops: a final state or a question, other
/// than the question just answered.
fn settled(report: &TaskReport, answered: Option<u64>) -> bool {
    stops(report.state) && answered.is_none_or(|asked| report.last_seq > asked)
}

/// Submits the message's task, or answers the question of the task it names.
async fn start(
    edge: &Edge,
    token: Option<&str>,
    target: &Target,
    params: &Value,
) -> Result<Started, RpcError> {
    let message = params
        .get("message")
        .filter(|m| m.is_object())
        .ok_or_else(|| RpcError::new(code::INVALID_PARAMS, "params.message is required"))?;
    let input = input_of(message)?;
    let at_once = params
        .pointer("/configuration/returnImmediately")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if let Some(task) = message.get("taskId").and_then(Value::as_str) {
        let (handle, report) = owned(edge, &json!({"id": task})).await?;
        if report.state != TaskState::InputRequired {
            return Err(RpcError::new(
                code::UNSUPPORTED,
                format!(
                    "task {task} is {}, not waiting for input",
                    report.state.as_str()
                ),
            ));
        }
        handle.respond(&input).await?;
        return Ok(Started {
            handle,
            at_once,
            answered: Some(report.last_seq),
        });
    }
    // The id is chosen here, so a task its target refused is still there to report.
    let id = Uuid::now_v7();
    let call = api::with_token(target.call().map_err(RpcError::from)?, token)
        .id(id)
        .json_payload(&input)
        .map_err(RpcError::from)?;
    let handle = match edge.agent.submit(call).await {
        Ok(handle) => handle,
        Err(refused) => edge
            .agent
            .task(id)
            .await
            .map_err(|_| RpcError::from(refused))?,
    };
    Ok(Started {
        handle,
        at_once,
        answered: None,
    })
}

async fn send_message(
    state: &GatewayState,
    edge: &Edge,
    token: Option<&str>,
    target: &Target,
    params: &Value,
) -> Result<Value, RpcError> {
    let Started {
        handle,
        at_once,
        answered,
    } = start(edge, token, target, params).await?;
    let mut report = handle.report().await?;
    if !at_once && !settled(&report, answered) {
        // Blocking: until it finishes or asks, within the longest request timeout.
        let wait = Duration::from_millis(state.config.max_request_timeout_ms);
        let mut updates = handle.updates_after(report.last_seq).await?;
        let _ = tokio::time::timeout(wait, async {
            while let Some(Ok(u)) = updates.next().await {
                if u.state().is_some_and(stops) {
                    break;
                }
            }
        })
        .await;
        // Left before its end (at a question, or on time): its consumer goes now.
        updates.close().await;
        report = handle.report().await?;
    }
    Ok(json!({"task": task_json(&report)}))
}

async fn list(edge: &Edge, params: &Value) -> Result<Value, RpcError> {
    let size = params
        .get("pageSize")
        .and_then(Value::as_u64)
        .map_or(MAX_LIST, |n| {
            usize::try_from(n).unwrap_or(MAX_LIST).clamp(1, MAX_LIST)
        });
    let mut tasks = Vec::new();
    // Newest first; only this identity's.
    for summary in edge.agent.tasks(MAX_LIST * 4).await?.into_iter().rev() {
        if tasks.len() >= size {
            break;
        }
        if let Ok((_, report)) = super::tasks::owned(edge, &summary.id.to_string()).await {
            tasks.push(task_json(&report));
        }
    }
    let n = tasks.len();
    Ok(json!({"tasks": tasks, "nextPageToken": "", "pageSize": n, "totalSize": n}))
}

/// The task's events as SSE: its snapshot first, then each update mapped, closed after a
/// final state or a question (not the one just `answered`).
async fn stream(
    state: &GatewayState,
    id: &Value,
    handle: TaskHandle,
    report: Option<TaskReport>,
    answered: Option<u64>,
) -> Response {
    let report = match report {
        Some(r) => r,
        None => match handle.report().await {
            Ok(r) => r,
            Err(e) => return rpc_err(id, &e.into()),
        },
    };
    let task = report.id;
    let first = json!({"task": task_json(&report)});
    let finished = settled(&report, answered);
    let updates = match handle.updates_after(report.last_seq).await {
        Ok(u) => u,
        Err(e) => return rpc_err(id, &e.into()),
    };
    let stop = state.stop.clone();
    let id_first = id.clone();
    let id_each = id.clone();
    let first = futures::stream::once(async move { event(&id_first, &first) });
    let rest = updates
        .take_until(async move { stop.cancelled().await })
        .scan(finished, move |done, update| {
            if *done {
                return futures::future::ready(None);
            }
            let events: Vec<Result<Event, Infallible>> = match update {
                Ok(u) => {
                    *done = u.state().is_some_and(stops);
                    update_events(task, &u).iter().map(|e| event(&id_each, e)).collect()
                }
                Err(e) => {
                    *done = true;
                    let e = RpcError::from(e);
                    let body = json!({"jsonrpc": "2.0", "id": id_each, "error": {"code": e.code, "message": e.message}});
                    vec![Ok(Event::default().event("error").data(body.to_string()))]
                }
            };
            futures::future::ready(Some(futures::stream::iter(events)))
        })
        .flatten();
    let all: std::pin::Pin<Box<dyn Stream<Item = Result<Event, Infallible>> + Send>> = if finished {
        Box::pin(first)
    } else {
        Box::pin(first.chain(rest))
    };
    Sse::new(all)
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn event(id: &Value, result: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string()))
}
