//! MCP's methods, whatever carries them (Streamable HTTP in `mod.rs`; standard input and
//! output for `chorus mcp serve --stdio`): `initialize`, `ping`, `logging/setLevel`,
//! `tools/list` and `tools/call`, and the notifications `initialized` and `cancelled`.
//!
//! A call to a tool that runs as a task submits a Chorus task and follows it: its progress
//! becomes `notifications/progress` (when the call carries a `progressToken`) and its progress
//! text `notifications/message` (level `info`, the worker as logger); its chunks are gathered
//! into the result's text; `notifications/cancelled` cancels it. Any other tool is a Chorus
//! request with the gateway's request timeout. A Chorus refusal is a tool error
//! (`isError: true`) naming its code; an unknown tool, or params that are not MCP's, a
//! JSON-RPC error.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use chorus_sdk::task::{TaskHandle, TaskMessage, TaskUpdate};
use chorus_sdk::{DiscoverQuery, Envelope, SdkError, StatusCode, TaskState};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::tools::{self, Table, Tool};
use super::{InFlight, Mcp};
use crate::api::Credential;
use crate::{Edge, GatewayState};

/// The protocol versions spoken, newest first: `initialize` settles on one of them.
pub(crate) const VERSIONS: [&str; 2] = ["2025-11-25", "2025-06-18"];

/// The versions an `MCP-Protocol-Version` header may name: those spoken, and 2025-03-26, whose
/// clients (the first with this transport) send it with requests that read the same (a batch,
/// which only that version allowed, is still refused).
pub(crate) const RECOGNIZED: [&str; 3] = ["2025-11-25", "2025-06-18", "2025-03-26"];

/// How many tools one `tools/list` page holds.
const PAGE: usize = 500;

/// How often a client is asked to poll a task (`pollInterval`), in milliseconds.
const POLL_INTERVAL_MS: u64 = 1000;

/// How many of a task's messages `tasks/get` reads at most.
const MAX_TASK_MESSAGES: usize = 10_000;

/// A Chorus task state as MCP's task status.
fn mcp_status(state: TaskState) -> &'static str {
    match state {
        TaskState::InputRequired => "input_required",
        TaskState::Completed => "completed",
        TaskState::Cancelled => "cancelled",
        s if s.is_terminal() => "failed",
        _ => "working",
    }
}

/// How long a tool table is reused before the registry is asked again.
const TABLE_TTL: Duration = Duration::from_secs(2);

/// JSON-RPC and MCP error codes.
pub(crate) mod code {
    pub(crate) const PARSE: i64 = -32700;
    pub(crate) const INVALID_REQUEST: i64 = -32600;
    pub(crate) const METHOD_NOT_FOUND: i64 = -32601;
    pub(crate) const INVALID_PARAMS: i64 = -32602;
    pub(crate) const INTERNAL: i64 = -32603;
    /// The request was cancelled (`notifications/cancelled`): no response is owed.
    pub(crate) const CANCELLED: i64 = -32800;
}

/// A JSON-RPC error.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RpcError {
    pub(crate) code: i64,
    pub(crate) message: String,
}

impl RpcError {
    pub(crate) fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }
}

/// A response to request `id`.
pub(crate) fn response(id: &Value, answer: &Result<Value, RpcError>) -> Value {
    match answer {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err(e) => {
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": e.code, "message": e.message}})
        }
    }
}

/// One message as it came.
#[derive(Debug, PartialEq)]
pub(crate) enum Incoming {
    /// A request: it is owed a response.
    Request {
        id: Value,
        method: String,
        params: Value,
    },
    /// A notification: nothing is answered.
    Notification { method: String, params: Value },
    /// A response to a request of ours (this server sends none): ignored.
    Response,
}

/// What `message` is, or the error to answer it with (and the id to answer, null when it has
/// none that can be read). A batch (a JSON array) is refused: MCP 2025-06-18 removed them.
pub(crate) fn classify(message: Value) -> Result<Incoming, (Value, RpcError)> {
    let invalid = |id: Value, why: &str| Err((id, RpcError::new(code::INVALID_REQUEST, why)));
    let Value::Object(mut m) = message else {
        return invalid(
            Value::Null,
            if message.is_array() {
                "a batch: MCP takes one JSON-RPC message per request"
            } else {
                "a JSON-RPC 2.0 message is a JSON object"
            },
        );
    };
    let id = m.remove("id");
    let answer_id = match &id {
        Some(v @ (Value::String(_) | Value::Number(_))) => v.clone(),
        _ => Value::Null,
    };
    if m.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return invalid(answer_id, "jsonrpc: \"2.0\" is required");
    }
    let params = m.remove("params").unwrap_or_else(|| json!({}));
    match (m.remove("method"), id) {
        (Some(Value::String(method)), None) => Ok(Incoming::Notification { method, params }),
        (Some(Value::String(method)), Some(id @ (Value::String(_) | Value::Number(_)))) => {
            if !params.is_object() {
                return Err((
                    id,
                    RpcError::new(code::INVALID_PARAMS, "params: a JSON object"),
                ));
            }
            Ok(Incoming::Request { id, method, params })
        }
        (Some(Value::String(_)), Some(_)) => {
            invalid(Value::Null, "id: a string or a number (MCP: never null)")
        }
        (Some(_), _) => invalid(answer_id, "method: a string"),
        (None, Some(_)) if m.contains_key("result") || m.contains_key("error") => {
            Ok(Incoming::Response)
        }
        (None, _) => invalid(answer_id, "a request or notification has a method"),
    }
}

/// MCP's log levels, least severe first.
const LEVELS: [&str; 8] = [
    "debug",
    "info",
    "notice",
    "warning",
    "error",
    "critical",
    "alert",
    "emergency",
];

/// One client's session (`Mcp-Session-Id`; the one session of a standard-input server).
pub(crate) struct Session {
    pub(crate) id: String,
    /// The identity it was opened as: another caller's requests do not find it.
    pub(crate) identity: String,
    /// The least severe log level the client wants (an index in `LEVELS`).
    level: AtomicU8,
    pub(crate) last_used: std::sync::Mutex<Instant>,
}

impl Session {
    pub(crate) fn new(identity: &str) -> Session {
        Session {
            id: Uuid::now_v7().simple().to_string(),
            identity: identity.to_owned(),
            level: AtomicU8::new(1),
            last_used: std::sync::Mutex::new(Instant::now()),
        }
    }

    fn logs(&self, level: &str) -> bool {
        let wanted = usize::from(self.level.load(Ordering::Relaxed));
        LEVELS.iter().position(|l| *l == level).unwrap_or(0) >= wanted
    }
}

/// One message out, with the event id a client resumes after (a task's stream has them); no
/// message: a priming event (an id and empty data, SEP-1699).
#[derive(Debug)]
pub(crate) struct Sent {
    pub(crate) id: Option<String>,
    pub(crate) message: Option<Value>,
}

impl Sent {
    /// A message with no event id.
    pub(crate) fn message(message: Value) -> Sent {
        Sent {
            id: None,
            message: Some(message),
        }
    }
}

/// Where a request's notifications go: its SSE stream, or standard output. Lossy: a client
/// that does not read its notifications loses some rather than stalling the call.
#[derive(Clone)]
pub(crate) struct Out {
    tx: Option<mpsc::Sender<Sent>>,
    /// The request a resumable stream answers: a task's events then carry ids
    /// ([`Resume`]).
    request: Option<Value>,
}

impl Out {
    pub(crate) fn new(tx: mpsc::Sender<Sent>) -> Out {
        Out {
            tx: Some(tx),
            request: None,
        }
    }

    /// A stream that answers request `id`: resumable after any of a task's events.
    pub(crate) fn resumable(tx: mpsc::Sender<Sent>, id: Value) -> Out {
        Out {
            tx: Some(tx),
            request: Some(id),
        }
    }

    /// Nowhere: the response is plain JSON.
    pub(crate) fn none() -> Out {
        Out {
            tx: None,
            request: None,
        }
    }

    fn send(&self, id: Option<String>, message: Option<Value>) {
        if let Some(tx) = &self.tx {
            let _ = tx.try_send(Sent { id, message });
        }
    }

    fn notify(&self, method: &str, params: Value) {
        self.send(
            None,
            Some(json!({"jsonrpc": "2.0", "method": method, "params": params})),
        );
    }

    /// The id of task `task`'s event at `seq`, on a resumable stream.
    fn event_id(&self, task: Uuid, seq: u64, progress: Option<&Value>) -> Option<String> {
        let request = self.request.as_ref()?;
        Resume {
            task,
            seq,
            request: request.clone(),
            progress: progress.cloned(),
        }
        .token()
    }
}

/// Where a task's `tools/call` stream resumes (`Last-Event-ID`): the task, the sequence of
/// the last event the client has, the request the stream answers and its progress token.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Resume {
    pub(crate) task: Uuid,
    pub(crate) seq: u64,
    pub(crate) request: Value,
    pub(crate) progress: Option<Value>,
}

/// The longest event id made: a request id or progress token beyond it makes no resumable
/// stream.
const MAX_EVENT_ID: usize = 512;

impl Resume {
    /// `<task>.<seq>.<hex of [request id, progress token]>`.
    fn token(&self) -> Option<String> {
        let ids = serde_json::to_vec(&json!([self.request, self.progress])).ok()?;
        let token = format!("{}.{}.{}", self.task.simple(), self.seq, hex::encode(ids));
        (token.len() <= MAX_EVENT_ID).then_some(token)
    }

    /// An event id of ours, read back.
    pub(crate) fn parse(token: &str) -> Option<Resume> {
        if token.len() > MAX_EVENT_ID {
            return None;
        }
        let mut parts = token.splitn(3, '.');
        let task = parts.next()?.parse().ok()?;
        let seq = parts.next()?.parse().ok()?;
        let ids: Value = serde_json::from_slice(&hex::decode(parts.next()?).ok()?).ok()?;
        let [request, progress] = <[Value; 2]>::try_from(ids.as_array()?.clone()).ok()?;
        if !matches!(request, Value::String(_) | Value::Number(_)) {
            return None;
        }
        Some(Resume {
            task,
            seq,
            request,
            progress: Some(progress).filter(|p| !p.is_null()),
        })
    }
}

/// Ends every call of `identity`'s session `id` (ended by its client, or expired): no one can
/// take their answers now, so the tasks they started are cancelled on the bus.
pub(crate) fn end_session(state: &Arc<GatewayState>, identity: &str, id: &str) {
    let mcp = &state.mcp;
    let mine = |key: &InFlight| key.session.as_deref() == Some(id);
    let mut keys: Vec<InFlight> = super::lock(&mcp.in_flight)
        .keys()
        .filter(|k| mine(k))
        .cloned()
        .collect();
    keys.extend(mcp.task_keys().into_iter().filter(|k| mine(k)));
    for key in keys {
        cancel_call(state, identity, &key);
    }
}

/// Cancels call `key` of `identity`: the call ends, and the task it started is cancelled on
/// the bus.
fn cancel_call(state: &Arc<GatewayState>, identity: &str, key: &InFlight) {
    let call = super::lock(&state.mcp.in_flight).get(key).cloned();
    if let Some(call) = call {
        call.cancel();
    }
    // The task is cancelled here, by a task of the gateway's own, whether or not the call's
    // stream is still open: the client may close it at once, and the call that follows the
    // task goes with it.
    if let Some(task) = state.mcp.forget_task(key)
        && let Some(edge) = state.edges.get(identity)
    {
        let agent = edge.agent.clone();
        // Owned by the gateway's tracker; a cancel takes one write to the task stream.
        state.tracker.spawn(async move {
            if let Ok(handle) = agent.task(task).await
                && let Err(e) = handle.cancel().await
            {
                tracing::debug!(%task, error = %chorus_sdk::Report(&e), "cancel not recorded");
            }
        });
    }
}

/// A caller of the MCP server: its identity's edge, what its credentials grant, its session.
#[derive(Clone)]
pub(crate) struct Caller {
    pub(crate) state: Arc<GatewayState>,
    pub(crate) identity: String,
    pub(crate) credential: Credential,
    pub(crate) session: Option<Arc<Session>>,
}

impl Caller {
    fn edge(&self) -> &Edge {
        // Built from an identity the gateway has (`api::caller_edge`).
        &self.state.edges[&self.identity]
    }

    fn mcp(&self) -> &Mcp {
        &self.state.mcp
    }

    /// Answers request `id`.
    pub(crate) async fn request(
        &self,
        id: &Value,
        method: &str,
        params: &Value,
        out: &Out,
    ) -> Result<Value, RpcError> {
        match method {
            "initialize" => Ok(initialize(params)),
            "ping" => Ok(json!({})),
            "logging/setLevel" => self.set_level(params),
            "tools/list" => self.list(params).await,
            "tools/call" => self.call(id, params, out).await,
            "tasks/get" => {
                let (handle, _) = self.owned(params).await?;
                self.task_view(&handle).await
            }
            "tasks/result" => self.task_result(params, out).await,
            "tasks/cancel" => self.cancel_task(params).await,
            other => Err(RpcError::new(
                code::METHOD_NOT_FOUND,
                format!("no method {other} (this server offers tools)"),
            )),
        }
    }

    /// Takes notification `method`.
    pub(crate) fn notification(&self, method: &str, params: &Value) {
        if method == "notifications/cancelled"
            && let Some(id) = params.get("requestId")
        {
            self.cancel_call(&self.in_flight_key(id));
        }
    }

    /// Ends every call of session `id`, which the client has ended: no one can take their
    /// answers now, so their tasks on the bus are cancelled.
    pub(crate) fn end_session_calls(&self, id: &str) {
        end_session(&self.state, &self.identity, id);
    }

    /// Cancels call `key`: the call ends, and the task it started is cancelled on the bus.
    fn cancel_call(&self, key: &InFlight) {
        cancel_call(&self.state, &self.identity, key);
    }

    fn in_flight_key(&self, id: &Value) -> InFlight {
        InFlight {
            identity: self.identity.clone(),
            session: self.session.as_ref().map(|s| s.id.clone()),
            id: id.to_string(),
        }
    }

    fn set_level(&self, params: &Value) -> Result<Value, RpcError> {
        let level = params
            .get("level")
            .and_then(Value::as_str)
            .and_then(|l| LEVELS.iter().position(|known| *known == l))
            .ok_or_else(|| {
                RpcError::new(
                    code::INVALID_PARAMS,
                    format!("level: one of {}", LEVELS.join(", ")),
                )
            })?;
        if let Some(session) = &self.session {
            session
                .level
                .store(u8::try_from(level).unwrap_or(0), Ordering::Relaxed);
        }
        Ok(json!({}))
    }

    /// The live agents' tools (reused for a moment; `fresh` asks the registry now).
    pub(crate) async fn table(&self, fresh: bool) -> Result<Arc<Table>, SdkError> {
        if !fresh
            && let Some((at, table)) = super::lock(&self.mcp().tables).get(&self.identity)
            && at.elapsed() < TABLE_TTL
        {
            return Ok(Arc::clone(table));
        }
        let records = self
            .edge()
            .agent
            .discover(&DiscoverQuery::default())
            .await?;
        let table = Arc::new(Table::new(&records));
        super::lock(&self.mcp().tables)
            .insert(self.identity.clone(), (Instant::now(), Arc::clone(&table)));
        Ok(table)
    }

    fn may_call(&self, tool: &Tool) -> bool {
        let (to, command, capability) = tool.target.names();
        self.credential.target(to, command, capability).is_ok()
    }

    async fn list(&self, params: &Value) -> Result<Value, RpcError> {
        let start = match params.get("cursor") {
            None | Some(Value::Null) => 0,
            Some(Value::String(c)) => c
                .parse::<usize>()
                .map_err(|_| RpcError::new(code::INVALID_PARAMS, "cursor: not one of ours"))?,
            Some(_) => return Err(RpcError::new(code::INVALID_PARAMS, "cursor: a string")),
        };
        let table = self.table(false).await.map_err(bus_error)?;
        let visible: Vec<Value> = table
            .visible(|t| self.may_call(t))
            .skip(start)
            .take(PAGE + 1)
            .map(Tool::listed)
            .collect();
        let mut page = json!({});
        if visible.len() > PAGE {
            page["nextCursor"] = json!((start + PAGE).to_string());
        }
        page["tools"] = Value::Array(visible.into_iter().take(PAGE).collect());
        Ok(page)
    }

    async fn call(&self, id: &Value, params: &Value, out: &Out) -> Result<Value, RpcError> {
        let name = params
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| RpcError::new(code::INVALID_PARAMS, "name: the tool's name"))?;
        let mut table = self.table(false).await.map_err(bus_error)?;
        if table.get(name).is_none() {
            // Perhaps it has just come.
            table = self.table(true).await.map_err(bus_error)?;
        }
        let tool = table
            .get(name)
            .filter(|t| self.may_call(t))
            .ok_or_else(|| RpcError::new(code::INVALID_PARAMS, format!("Unknown tool: {name}")))?;
        let payload = match tool.payload(params.get("arguments")) {
            Ok(p) => p,
            Err(why) => return Ok(tools::refusal(StatusCode::INVALID_ARGUMENT, &why)),
        };
        let (to, command, capability) = tool.target.names();
        let call = match self.credential.call(to, command, capability) {
            Ok(call) => call,
            Err(refused) => {
                let body = refused.body();
                let status = body["status"].as_u64().and_then(|s| u16::try_from(s).ok());
                return Ok(tools::refusal(
                    StatusCode(status.unwrap_or(StatusCode::ACCESS.0)),
                    body["reason"].as_str().unwrap_or_default(),
                ));
            }
        };
        if let Some(task) = params.get("task").filter(|t| !t.is_null()) {
            if !tool.task {
                return Err(RpcError::new(
                    code::METHOD_NOT_FOUND,
                    format!(
                        "the tool {name} does not run as a task (its execution.taskSupport is forbidden)"
                    ),
                ));
            }
            if !task.is_object() {
                return Err(RpcError::new(code::INVALID_PARAMS, "task: an object"));
            }
            return match self.submit(call, &payload).await? {
                Ok(handle) => Ok(json!({"task": self.task_view(&handle).await?})),
                Err(refusal) => Ok(refusal),
            };
        }
        let progress = params.pointer("/_meta/progressToken").cloned();
        // Registered until it ends: `notifications/cancelled` finds it here.
        let cancel = CancellationToken::new();
        let key = self.in_flight_key(id);
        super::lock(&self.mcp().in_flight).insert(key.clone(), cancel.clone());
        let _registered = Unregister {
            mcp: &self.state.mcp,
            key: key.clone(),
        };
        let stop = self.state.stop.clone();
        let work = async {
            if tool.task {
                self.run_task(tool, call, &payload, progress, out, (&key, &cancel))
                    .await
            } else {
                self.ask(tool, call, &payload).await
            }
        };
        tokio::select! {
            answer = work => answer,
            () = cancel.cancelled(), if !tool.task => {
                Err(RpcError::new(code::CANCELLED, "cancelled by the client"))
            }
            () = stop.cancelled() => Err(RpcError::new(code::INTERNAL, "the gateway is stopping")),
        }
    }

    /// A plain Chorus request.
    async fn ask(
        &self,
        tool: &Tool,
        call: chorus_sdk::Call,
        payload: &Value,
    ) -> Result<Value, RpcError> {
        let call = call
            .timeout(Duration::from_millis(self.state.config.request_timeout_ms))
            .json_payload(payload)
            .map_err(|e| RpcError::new(code::INVALID_PARAMS, e.to_string()))?;
        match self.edge().agent.call(call).await {
            Ok(reply) => Ok(
                match json_of(reply.payload(), &reply.envelope.content_type) {
                    Ok(value) => tools::result(value, tool.mcp_result),
                    Err(why) => tools::refusal(StatusCode::DATA_FORMAT, &why),
                },
            ),
            Err(e) => Ok(refused(&e)),
        }
    }

    /// The Chorus task `params.taskId` names, if this identity submitted it (any other is not
    /// found, as if it did not exist).
    async fn owned(&self, params: &Value) -> Result<(TaskHandle, Envelope), RpcError> {
        let named = params
            .get("taskId")
            .and_then(Value::as_str)
            .ok_or_else(|| RpcError::new(code::INVALID_PARAMS, "taskId: the task's id"))?;
        let not_found = || RpcError::new(code::INVALID_PARAMS, format!("no task {named}"));
        let id: Uuid = named.parse().map_err(|_| not_found())?;
        let handle = match self.edge().agent.task(id).await {
            Ok(handle) => handle,
            Err(SdkError::TaskNotFound(_)) => return Err(not_found()),
            Err(e) => return Err(bus_error(e)),
        };
        let submission = match handle.history(1).await {
            Ok(first) => first.into_iter().next().ok_or_else(not_found)?,
            Err(SdkError::TaskNotFound(_)) => return Err(not_found()),
            Err(e) => return Err(bus_error(e)),
        };
        if submission.envelope.from.as_str() != self.identity {
            return Err(not_found());
        }
        Ok((handle, submission.envelope))
    }

    /// A task as MCP shows it (`Task`): its state, its last word, when it was made and last
    /// moved.
    async fn task_view(&self, handle: &TaskHandle) -> Result<Value, RpcError> {
        let updates = handle.history(MAX_TASK_MESSAGES).await.map_err(bus_error)?;
        let state = updates
            .iter()
            .rev()
            .find_map(TaskUpdate::state)
            .unwrap_or(TaskState::Submitted);
        let created = updates.first().map_or(0, |u| u.stored_ms);
        let updated = updates.last().map_or(created, |u| u.stored_ms);
        let mut task = json!({
            "taskId": handle.id().to_string(),
            "status": mcp_status(state),
            "createdAt": chorus_sdk::envelope::rfc3339(created),
            "lastUpdatedAt": chorus_sdk::envelope::rfc3339(updated),
            "ttl": null,
            "pollInterval": POLL_INTERVAL_MS,
        });
        if let Some(text) = updates.iter().rev().find_map(|u| u.text()) {
            task["statusMessage"] = json!(text);
        }
        Ok(task)
    }

    /// `tasks/result`: the task's result as its `tools/call` would have answered, once it
    /// has ended (waiting for that, as a blocking call would).
    async fn task_result(&self, params: &Value, out: &Out) -> Result<Value, RpcError> {
        let (handle, submission) = self.owned(params).await?;
        let mcp_result = self.mcp_result_of(&submission).await?;
        let mut result = self
            .follow(&handle, mcp_result, None, out, &CancellationToken::new(), 0)
            .await?;
        result["_meta"] =
            json!({"io.modelcontextprotocol/related-task": {"taskId": handle.id().to_string()}});
        Ok(result)
    }

    /// Whether the tool a task was submitted to answers with MCP results (from the tool
    /// table, by the submission's target).
    async fn mcp_result_of(&self, submission: &Envelope) -> Result<bool, RpcError> {
        let name = match &submission.capability {
            Some(capability) => capability.clone(),
            None => format!(
                "{}.{}",
                submission
                    .to
                    .first()
                    .map(String::as_str)
                    .unwrap_or_default(),
                submission.name.as_deref().unwrap_or_default()
            ),
        };
        let table = self.table(false).await.map_err(bus_error)?;
        Ok(table.get(&name).is_some_and(|t| t.mcp_result))
    }

    /// `tasks/cancel`: cancels the task on the bus (a finished one cannot be, -32602).
    async fn cancel_task(&self, params: &Value) -> Result<Value, RpcError> {
        let (handle, _) = self.owned(params).await?;
        let state = handle.state().await.map_err(bus_error)?;
        if state.is_terminal() {
            return Err(RpcError::new(
                code::INVALID_PARAMS,
                format!(
                    "task {} is {} already: a finished task cannot be cancelled",
                    handle.id(),
                    mcp_status(state)
                ),
            ));
        }
        if let Err(e) = handle.cancel().await {
            return Err(RpcError::new(code::INTERNAL, format!("the cancel: {e}")));
        }
        self.task_view(&handle).await
    }

    /// Submits a Chorus task; its handle, or the refusal as a tool error.
    async fn submit(
        &self,
        call: chorus_sdk::Call,
        payload: &Value,
    ) -> Result<Result<TaskHandle, Value>, RpcError> {
        let call = call
            .id(Uuid::now_v7())
            .json_payload(payload)
            .map_err(|e| RpcError::new(code::INVALID_PARAMS, e.to_string()))?;
        Ok(self
            .edge()
            .agent
            .submit(call)
            .await
            .map_err(|e| refused(&e)))
    }

    /// A Chorus task, followed to its end (or cancelled).
    async fn run_task(
        &self,
        tool: &Tool,
        call: chorus_sdk::Call,
        payload: &Value,
        progress: Option<Value>,
        out: &Out,
        (key, cancel): (&InFlight, &CancellationToken),
    ) -> Result<Value, RpcError> {
        match self.submit(call, payload).await? {
            Ok(handle) => {
                self.mcp().remember_task(key.clone(), handle.id());
                let answer = self
                    .follow(&handle, tool.mcp_result, progress, out, cancel, 0)
                    .await;
                self.mcp().forget_task(key);
                answer
            }
            Err(refusal) => Ok(refusal),
        }
    }

    /// Follows task `handle` from its start to its end, a question, a cancel or
    /// `max_task_wait_ms`, and answers with its result as a tool's.
    ///
    /// Notifications go out for what came after sequence `after` (0: everything; a resumed
    /// stream's last event otherwise), each with the event id that resumes after it.
    async fn follow(
        &self,
        handle: &TaskHandle,
        mcp_result: bool,
        progress: Option<Value>,
        out: &Out,
        cancel: &CancellationToken,
        after: u64,
    ) -> Result<Value, RpcError> {
        let mut updates = match handle.updates().await {
            Ok(updates) => updates,
            Err(e) => return Ok(refused(&e)),
        };
        if after == 0 {
            // Primes the client: it can resume from here if the stream breaks.
            if let Some(id) = out.event_id(handle.id(), 0, progress.as_ref()) {
                out.send(Some(id), None);
            }
        }
        let wait = Duration::from_millis(self.state.mcp.config.max_task_wait_ms);
        let mut chunks = String::new();
        let mut reported: Option<i64> = None;
        let mut cancelled = false;
        let followed = tokio::time::timeout(wait, async {
            loop {
                let update = tokio::select! {
                    u = updates.next() => u,
                    () = cancel.cancelled(), if !cancelled => {
                        // `notification` has cancelled the task on the bus: followed until
                        // it says so.
                        cancelled = true;
                        continue;
                    }
                };
                let Some(Ok(update)) = update else { break };
                match update.kind {
                    TaskMessage::Progress if update.seq > after => {
                        let id = out.event_id(handle.id(), update.seq, progress.as_ref());
                        self.progressed(&update, progress.as_ref(), &mut reported, out, id);
                    }
                    TaskMessage::Chunk => {
                        if let Ok(Value::String(text)) =
                            json_of(update.payload(), &update.envelope.content_type)
                        {
                            if !chunks.is_empty() && !text.starts_with(char::is_whitespace) {
                                chunks.push(' ');
                            }
                            chunks.push_str(&text);
                        }
                    }
                    TaskMessage::Status
                        if update
                            .state()
                            .is_some_and(|s| s.is_terminal() || s == TaskState::InputRequired) =>
                    {
                        break;
                    }
                    _ => {}
                }
            }
        })
        .await;
        updates.close().await;
        if cancelled {
            return Err(RpcError::new(code::CANCELLED, "cancelled by the client"));
        }
        let report = match handle.report().await {
            Ok(report) => report,
            Err(e) => return Ok(refused(&e)),
        };
        if followed.is_err() && !report.is_finished() {
            return Ok(tools::refusal(
                StatusCode::TIMEOUT,
                &format!(
                    "task {} still runs after {} ms: follow it with chorus task watch {}",
                    report.id,
                    wait.as_millis(),
                    report.id
                ),
            ));
        }
        match report.state {
            TaskState::Completed => {
                let value = match json_of(&report.output, &report.content_type) {
                    Ok(v) => v,
                    Err(why) => return Ok(tools::refusal(StatusCode::DATA_FORMAT, &why)),
                };
                let mut result = tools::result(value, mcp_result);
                if !chunks.is_empty()
                    && let Some(content) = result["content"].as_array_mut()
                {
                    content.insert(0, json!({"type": "text", "text": chunks}));
                }
                Ok(result)
            }
            TaskState::InputRequired => Ok(tools::refusal(
                StatusCode::TASK_STATE,
                &format!(
                    "task {} asks for input ({}): answer it with chorus task respond {}",
                    report.id,
                    report.reason.as_deref().unwrap_or("no question given"),
                    report.id
                ),
            )),
            _ => Ok(tools::refusal(
                report.status,
                report.reason.as_deref().unwrap_or(report.state.as_str()),
            )),
        }
    }

    /// A task's progress as MCP notifications: `notifications/progress` for its fraction (when
    /// the call asked, and only as it grows), `notifications/message` for its text.
    fn progressed(
        &self,
        update: &TaskUpdate,
        token: Option<&Value>,
        reported: &mut Option<i64>,
        out: &Out,
        id: Option<String>,
    ) {
        let mut sent = Vec::new();
        if let (Some(token), Some(fraction)) = (token, update.fraction()) {
            #[allow(clippy::cast_possible_truncation)]
            let done = (f64::from(fraction.clamp(0.0, 1.0)) * 100.0).round() as i64;
            if reported.is_none_or(|last| done > last) {
                *reported = Some(done);
                let mut params = json!({"progressToken": token, "progress": done, "total": 100});
                if let Some(text) = update.text() {
                    params["message"] = json!(text);
                }
                sent.push(("notifications/progress", params));
            }
        }
        if let Some(text) = update.text()
            && self.session.as_ref().is_none_or(|s| s.logs("info"))
        {
            sent.push((
                "notifications/message",
                json!({"level": "info", "logger": update.from(), "data": text}),
            ));
        }
        // The update's event id goes on its last notification: a client that resumes after
        // it has them all.
        let last = sent.len().saturating_sub(1);
        for (i, (method, params)) in sent.into_iter().enumerate() {
            if i == last {
                out.send(
                    id.clone(),
                    Some(json!({"jsonrpc": "2.0", "method": method, "params": params})),
                );
            } else {
                out.notify(method, params);
            }
        }
    }

    /// A task's `tools/call` stream resumed after `resume`'s event: what came after it, then
    /// the call's result.
    pub(crate) async fn resume(&self, resume: &Resume, out: &Out) -> Result<Value, RpcError> {
        let (handle, submission) = self
            .owned(&json!({"taskId": resume.task.to_string()}))
            .await?;
        let mcp_result = self.mcp_result_of(&submission).await?;
        // The call goes on here: `notifications/cancelled` for it finds this stream.
        let cancel = CancellationToken::new();
        let key = self.in_flight_key(&resume.request);
        super::lock(&self.mcp().in_flight).insert(key.clone(), cancel.clone());
        self.mcp().remember_task(key.clone(), handle.id());
        let _registered = Unregister {
            mcp: &self.state.mcp,
            key: key.clone(),
        };
        let answer = self
            .follow(
                &handle,
                mcp_result,
                resume.progress.clone(),
                out,
                &cancel,
                resume.seq,
            )
            .await;
        self.mcp().forget_task(&key);
        answer
    }
}

/// Removes a call from the in-flight table when it ends, however it ends.
struct Unregister<'a> {
    mcp: &'a Mcp,
    key: InFlight,
}

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        super::lock(&self.mcp.in_flight).remove(&self.key);
    }
}

/// `initialize`'s result: the client's version when it is one spoken here, else the newest.
pub(crate) fn initialize(params: &Value) -> Value {
    let asked = params.get("protocolVersion").and_then(Value::as_str);
    let version = asked
        .filter(|v| VERSIONS.contains(v))
        .unwrap_or(VERSIONS[0]);
    json!({
        "protocolVersion": version,
        "capabilities": {
            "tools": {"listChanged": true},
            "logging": {},
            "tasks": {"cancel": {}, "requests": {"tools": {"call": {}}}},
        },
        "serverInfo": {"name": "chorus-gateway", "title": "Chorus", "version": env!("CARGO_PKG_VERSION")},
        "instructions": "Each tool is an agent on a Chorus bus: a capability by its name (any live agent offering it answers), a command as <agent>.<command>. A refusal comes back as a tool error naming its Chorus status code.",
    })
}

/// A payload as JSON: empty is null; JSON and MessagePack are read.
fn json_of(
    payload: &bytes::Bytes,
    content_type: &chorus_sdk::ContentType,
) -> Result<Value, String> {
    if payload.is_empty() {
        return Ok(Value::Null);
    }
    chorus_sdk::codec::decode_payload::<Value>(payload, content_type)
        .map_err(|e| format!("the reply's payload does not read as JSON: {e}"))
}

/// A failed call as a tool error.
fn refused(e: &SdkError) -> Value {
    match e {
        SdkError::Remote { status, reason, .. } => tools::refusal(*status, reason),
        other => tools::refusal(other.status(), &other.to_string()),
    }
}

/// The registry could not be asked: an internal error, saying why.
fn bus_error(e: SdkError) -> RpcError {
    RpcError::new(code::INTERNAL, format!("the bus's registry: {e}"))
}

#[cfg(test)]
#[path = "server_tests.rs"]
mod tests;
