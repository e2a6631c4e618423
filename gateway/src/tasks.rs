//! Tasks at the edge: an edge caller submits long work to an agent or a capability, follows
//! its progress and streamed chunks (server-sent events), answers its questions and cancels
//! it. Each route is one SDK call on the identity's agent, so the task lives in the bus's task
//! stream like any other; a caller sees only the tasks its identity submitted.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode as Http};
use axum::response::sse::{Event, KeepAlive, Sse};
use bytes::Bytes;
use chorus_sdk::StatusCode;
use chorus_sdk::task::{TaskHandle, TaskReport, TaskUpdate};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::api::{self, ApiError};
use super::scopes::Route;
use super::{Edge, GatewayState};

/// A task as the gateway shows it.
#[derive(Debug, Serialize)]
pub(crate) struct TaskView {
    pub(crate) id: Uuid,
    pub(crate) state: String,
    pub(crate) status: u16,
    pub(crate) label: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) reason: Option<String>,
    pub(crate) target: String,
    /// The result (completed) or the question (input required), as JSON; null if none.
    pub(crate) output: Value,
    pub(crate) agents: Vec<String>,
    pub(crate) submitted_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) finished_ms: Option<u64>,
}

/// JSON of a payload written as `content_type`; null if empty or not JSON-readable.
pub(crate) fn json_of(payload: &[u8], content_type: &str) -> Value {
    if payload.is_empty() {
        return Value::Null;
    }
    chorus_sdk::codec::decode_payload::<Value>(payload, content_type).unwrap_or(Value::Null)
}

impl From<&TaskReport> for TaskView {
    fn from(r: &TaskReport) -> Self {
        TaskView {
            id: r.id,
            state: r.state.as_str().to_owned(),
            status: r.status.0,
            label: r.status.label(),
            reason: r.reason.clone(),
            target: r.target.clone(),
            output: json_of(&r.output, &r.content_type),
            agents: r.attempts.iter().map(|a| a.agent.clone()).collect(),
            submitted_ms: r.submitted_ms,
            finished_ms: r.finished_ms,
        }
    }
}

/// One update as an event: its sequence (to resume after), kind and what it says.
#[derive(Debug, Serialize)]
pub(crate) struct UpdateView {
    pub(crate) seq: u64,
    pub(crate) kind: &'static str,
    pub(crate) from: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) state: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) fraction: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) chunk: Option<u64>,
    pub(crate) last_chunk: bool,
    pub(crate) payload: Value,
}

impl From<&TaskUpdate> for UpdateView {
    fn from(u: &TaskUpdate) -> Self {
        UpdateView {
            seq: u.seq,
            kind: u.kind.as_str(),
            from: u.from().to_owned(),
            state: u.state().map(|s| s.as_str()),
            fraction: u.fraction().filter(|f| f.is_finite()),
            text: u.text().map(str::to_owned),
            chunk: u.chunk(),
            last_chunk: u.is_last_chunk(),
            payload: json_of(&u.envelope.payload, &u.envelope.content_type),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SubmitBody {
    pub(crate) to: Option<String>,
    pub(crate) command: Option<String>,
    pub(crate) capability: Option<String>,
    #[serde(default)]
    pub(crate) payload: Value,
    /// How long the task may run, in milliseconds.
    #[serde(default, deserialize_with = "api::whole::opt_u64")]
    pub(crate) deadline_ms: Option<u64>,
}

/// The task `id`, if the caller's identity submitted it (anyone else gets 404, as if it did
/// not exist).
pub(crate) async fn owned(edge: &Edge, id: &str) -> Result<(TaskHandle, TaskReport), ApiError> {
    let not_found = || {
        ApiError::new(StatusCode::INVALID_ARGUMENT, format!("no task {id}"))
            .with_http(Http::NOT_FOUND)
    };
    let id: Uuid = id.parse().map_err(|_| not_found())?;
    let handle = match edge.agent.task(id).await {
        Ok(h) => h,
        Err(chorus_sdk::SdkError::TaskNotFound(_)) => return Err(not_found()),
        Err(e) => return Err(e.into()),
    };
    let report = handle.report().await?;
    if report.requester != edge.agent.id() {
        return Err(not_found());
    }
    Ok((handle, report))
}

/// Submits a task as `edge`; returns its handle once its target took it (or refused it).
pub(crate) async fn submit_as(
    edge: &Edge,
    credential: &api::Credential,
    b: SubmitBody,
) -> Result<TaskHandle, ApiError> {
    let (to, command, capability) = (
        b.to.as_deref(),
        b.command.as_deref(),
        b.capability.as_deref(),
    );
    let mut call = credential
        .call(to, command, capability)?
        .json_payload(&b.payload)?;
    if let Some(ms) = b.deadline_ms {
        if ms == 0 {
            return Err(ApiError::new(
                StatusCode::INVALID_ARGUMENT,
                "deadline_ms must be positive",
            ));
        }
        call = call.deadline(Duration::from_millis(ms));
    }
    Ok(edge.agent.submit(call).await?)
}

/// `POST /v1/tasks`.
pub(crate) async fn submit(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Result<(Http, Json<TaskView>), ApiError> {
    let (edge, credential) = api::edge(&state, &headers, Route::Tasks)?;
    let b: SubmitBody = api::body(&bytes)?;
    let handle = submit_as(edge, &credential, b).await?;
    let report = handle.report().await?;
    Ok((Http::ACCEPTED, Json(TaskView::from(&report))))
}

/// `GET /v1/tasks/{id}`.
pub(crate) async fn get(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<TaskView>, ApiError> {
    let (edge, _) = api::edge(&state, &headers, Route::Tasks)?;
    let (_, report) = owned(edge, &id).await?;
    Ok(Json(TaskView::from(&report)))
}

/// `POST /v1/tasks/{id}/cancel`: the report once the cancel is recorded.
pub(crate) async fn cancel(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<TaskView>, ApiError> {
    let (edge, _) = api::edge(&state, &headers, Route::Tasks)?;
    let (handle, _) = owned(edge, &id).await?;
    let report = handle.cancel().await?;
    Ok(Json(TaskView::from(&report)))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InputBody {
    #[serde(default)]
    payload: Value,
}

/// `POST /v1/tasks/{id}/input`: answers the task's question.
pub(crate) async fn input(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Result<(Http, Json<Value>), ApiError> {
    let (edge, _) = api::edge(&state, &headers, Route::Tasks)?;
    let b: InputBody = api::body(&bytes)?;
    let (handle, _) = owned(edge, &id).await?;
    handle.respond(&b.payload).await?;
    Ok((Http::ACCEPTED, Json(serde_json::json!({"delivered": true}))))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    after: Option<u64>,
}

/// The updates of a task as they come, from after `after`; ends after its terminal state.
pub(crate) async fn updates_of(
    handle: &TaskHandle,
    after: Option<u64>,
) -> Result<impl Stream<Item = Result<TaskUpdate, chorus_sdk::SdkError>> + Send + use<>, ApiError> {
    Ok(match after {
        Some(seq) => handle.updates_after(seq).await?,
        None => handle.updates().await?,
    })
}

/// `GET /v1/tasks/{id}/events?after=`: server-sent events, one per update (`event:` its kind,
/// `id:` its sequence, `data:` the update as JSON), ending after the terminal state.
pub(crate) async fn events(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let (edge, _) = api::edge(&state, &headers, Route::Tasks)?;
    let q: EventsQuery = api::query(raw)?;
    let (handle, _) = owned(edge, &id).await?;
    let updates = updates_of(&handle, q.after).await?;
    let stop = state.stop.clone();
    let stream = updates
        .take_until(async move { stop.cancelled().await })
        .map(|update| {
            let event = match update {
                Ok(u) => Event::default()
                    .event(u.kind.as_str())
                    .id(u.seq.to_string())
                    .json_data(UpdateView::from(&u))
                    .unwrap_or_default(),
                Err(e) => Event::default()
                    .event("error")
                    .json_data(ApiError::from(e).body())
                    .unwrap_or_default(),
            };
            Ok(event)
        });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
