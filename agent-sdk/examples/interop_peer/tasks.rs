//! The peer's part for the Python SDK's tasks tests: handoff and verified results.
//!
//! - the task `summarize` (any input): answers `{"summary": <PEER_SUMMARY>}` (default `a
//!   summary long enough to pass`; a short one fails the tests' schema and judge);
//! - the task `triage` (`{"to", "name", "context"}`): hands itself to that agent's task with
//!   the context as its payload; the task `ticket` (a string): answers `fixed by <id>: <it>`;
//! - the command `judge` (a supervisor's check): passes an object whose `summary` is a string
//!   of 10 characters or more, refuses anything else with 5018 and why;
//! - the command `verified` (`{"to", "name", "payload", "schema" | "judge": {"agent",
//!   "command"}, "max_attempts", "retries", "reassign", "candidates", "escalate_to"}`): submits
//!   a verified task, verifies it with that policy, and returns its report (as `report` does);
//! - the command `report` (a task id): that task's report, as JSON (`state`, `status`,
//!   `reason`, `requester`, `target`, `output`, `attempts`: `agent`, `state`, `status`,
//!   `verified`, `note`, `started_ms`, `ended_ms`);
//! - the command `schema_check` (`{"schema", "value"}`): whether the schema compiles (`error`:
//!   why not) and how the value breaks it (`errors`), as `chorus_sdk::schema::Schema` says.

use chorus_sdk::schema::Schema;
use chorus_sdk::task::Verification;
use chorus_sdk::{
    Agent, AgentOptions, Call, Context, HandlerError, StatusCode, TaskContext, TaskReport,
};
use serde::Deserialize;
use serde_json::{Value, json};

/// Settings of this part, from the environment.
pub fn options(options: AgentOptions) -> Result<AgentOptions, Box<dyn std::error::Error>> {
    Ok(options)
}

#[derive(Debug, Deserialize)]
struct Triage {
    to: String,
    name: String,
    #[serde(default)]
    context: Value,
}

#[derive(Debug, Deserialize)]
struct Judge {
    agent: String,
    command: String,
}

#[derive(Debug, Deserialize)]
struct Verified {
    to: String,
    name: String,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    schema: Option<Value>,
    #[serde(default)]
    judge: Option<Judge>,
    #[serde(default)]
    max_attempts: Option<u32>,
    #[serde(default)]
    retries: Option<u32>,
    #[serde(default)]
    reassign: Option<bool>,
    #[serde(default)]
    candidates: Vec<String>,
    #[serde(default)]
    escalate_to: Option<String>,
}

#[derive(Debug, Deserialize)]
struct SchemaCheck {
    schema: Value,
    #[serde(default)]
    value: Value,
}

/// A report as JSON, for the tests to compare with the Python SDK's.
fn report_json(report: &TaskReport) -> Value {
    let attempts: Vec<Value> = report
        .attempts
        .iter()
        .map(|a| {
            json!({
                "agent": a.agent,
                "state": a.state.to_string(),
                "status": a.status.map(|s| s.0),
                "verified": a.verified,
                "note": a.note,
                "started_ms": a.started_ms,
                "ended_ms": a.ended_ms,
            })
        })
        .collect();
    json!({
        "id": report.id.to_string(),
        "state": report.state.to_string(),
        "status": report.status.0,
        "reason": report.reason,
        "requester": report.requester,
        "target": report.target,
        "output": report.output_as::<Value>().unwrap_or(Value::Null),
        "attempts": attempts,
        "submitted_ms": report.submitted_ms,
        "finished_ms": report.finished_ms,
        "last_seq": report.last_seq,
    })
}

/// The handlers of this part.
pub async fn register(peer: &Agent) -> Result<(), Box<dyn std::error::Error>> {
    let summary =
        std::env::var("PEER_SUMMARY").unwrap_or_else(|_| "a summary long enough to pass".into());
    peer.on_task("summarize", move |_task: TaskContext, _doc: Value| {
        let summary = summary.clone();
        async move { Ok::<_, HandlerError>(json!({ "summary": summary })) }
    })
    .await?;
    peer.on_task("triage", |task: TaskContext, order: Triage| async move {
        task.progress(Some(0.5), "triaged").await?;
        task.handoff(Call::agent(&order.to, &order.name).payload(&order.context)?)
            .await?;
        Ok::<_, HandlerError>(Value::Null)
    })
    .await?;
    peer.on_task("ticket", |task: TaskContext, context: String| async move {
        Ok::<_, HandlerError>(format!("fixed by {}: {context}", task.agent_id()))
    })
    .await?;
    peer.on_command("judge", |_ctx: Context, output: Value| async move {
        match output["summary"].as_str() {
            Some(s) if s.chars().count() >= 10 => Ok(()),
            Some(s) => Err(HandlerError::invalid_argument(format!(
                "summary {s:?} is too short"
            ))),
            None => Err(HandlerError::invalid_argument("no summary")),
        }
    })
    .await?;
    let requester = peer.clone();
    peer.on_command("verified", move |_ctx: Context, order: Verified| {
        let requester = requester.clone();
        async move {
            let mut verification = match (&order.schema, &order.judge) {
                (Some(schema), _) => Verification::schema(schema)?,
                (None, Some(judge)) => Verification::agent(&judge.agent, &judge.command),
                (None, None) => {
                    return Err(HandlerError::invalid_argument("a schema or a judge"));
                }
            };
            if let Some(n) = order.max_attempts {
                verification = verification.max_attempts(n);
            }
            if let Some(n) = order.retries {
                verification = verification.retries(n);
            }
            if let Some(on) = order.reassign {
                verification = verification.reassign(on);
            }
            if !order.candidates.is_empty() {
                verification = verification.candidates(order.candidates.clone());
            }
            if let Some(supervisor) = &order.escalate_to {
                verification = verification.escalate_to(supervisor);
            }
            let task = requester
                .submit_verified(Call::agent(&order.to, &order.name).payload(&order.payload)?)
                .await?;
            let report = requester.verify(&task, &verification).await?;
            Ok::<_, HandlerError>(report_json(&report))
        }
    })
    .await?;
    let reader = peer.clone();
    peer.on_command("report", move |_ctx: Context, id: String| {
        let reader = reader.clone();
        async move {
            let id = uuid::Uuid::parse_str(&id).map_err(|e| {
                HandlerError::new(StatusCode::INVALID_ARGUMENT, format!("task id: {e}"))
            })?;
            let report = reader.task(id).await?.report().await?;
            Ok::<_, HandlerError>(report_json(&report))
        }
    })
    .await?;
    peer.on_command(
        "schema_check",
        |_ctx: Context, check: SchemaCheck| async move {
            Ok::<_, HandlerError>(match Schema::compile(&check.schema) {
                Ok(schema) => {
                    json!({ "compiles": true, "errors": schema.errors(&check.value, 10) })
                }
                Err(error) => json!({ "compiles": false, "error": error, "errors": [] }),
            })
        },
    )
    .await?;
    Ok(())
}
