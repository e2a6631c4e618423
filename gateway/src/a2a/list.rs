//! `ListTasks`: every task a caller submitted to an endpoint, filtered on the server and paged
//! with a cursor.
//!
//! The gateway keeps an index of the bus's tasks (requester, endpoint, context, state, when it
//! last changed), read from the task stream's changes of state and brought up to date before
//! each listing from where the last read stopped: a listing costs the changes since the last
//! one, however many tasks the bus holds, and a gateway that restarts reads the stream again.
//! Tasks are sorted by their last change, newest first (ties by id); a page token names the
//! last task of a page, so a task that changes while a client pages is not shown twice on
//! the pages after it.

use std::collections::HashMap;

use chorus_sdk::{Agent, TaskState};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use uuid::Uuid;

use super::view::states_of;
use super::{RpcError, code};

/// Most tasks a page holds, and how many it holds unless asked.
pub(super) const MAX_PAGE: usize = 100;
const DEFAULT_PAGE: usize = 50;
/// Changes read from the task stream per fetch while catching up.
const CATCH_UP_BATCH: usize = 2_000;

/// One task as the index knows it.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) id: Uuid,
    requester: String,
    target: String,
    context: String,
    state: TaskState,
    updated_ms: u64,
}

#[derive(Debug, Default)]
struct Index {
    /// The stream sequence of the last change read.
    after: u64,
    tasks: HashMap<Uuid, Entry>,
}

/// The gateway's index of the bus's tasks, one per subject root (a tenant's tasks are in its
/// own root's stream).
#[derive(Debug, Default)]
pub(crate) struct TaskIndex {
    inner: Mutex<HashMap<String, Index>>,
}

/// What a `ListTasks` asks for, checked.
#[derive(Debug)]
pub(super) struct Query {
    context: Option<String>,
    states: Option<&'static [TaskState]>,
    pub(super) page_size: usize,
    after: Option<(u64, Uuid)>,
    since_ms: Option<u64>,
    pub(super) history: Option<usize>,
    pub(super) artifacts: bool,
}

fn invalid(what: impl Into<String>) -> RpcError {
    RpcError::new(code::INVALID_PARAMS, what)
}

/// The cursor after `entry`: its last change and id.
fn token_of(entry: &Entry) -> String {
    format!("{:x}-{}", entry.updated_ms, entry.id.simple())
}

fn parse_token(token: &str) -> Option<(u64, Uuid)> {
    let (ms, id) = token.split_once('-')?;
    Some((u64::from_str_radix(ms, 16).ok()?, Uuid::try_parse(id).ok()?))
}

fn parse_time(text: &str) -> Option<u64> {
    let at =
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    u64::try_from(at.unix_timestamp_nanos() / 1_000_000).ok()
}

impl Query {
    /// `params` of a `ListTasks`, or -32602 naming the parameter that is wrong.
    pub(super) fn parse(params: &Value) -> Result<Self, RpcError> {
        let text = |name: &str| -> Result<Option<&str>, RpcError> {
            match params.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if s.is_empty() => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.as_str())),
                Some(_) => Err(invalid(format!("{name}: a string"))),
            }
        };
        let states = match text("status")? {
            None | Some("TASK_STATE_UNSPECIFIED") => None,
            Some(s) => Some(states_of(s).ok_or_else(|| {
                invalid(format!("status: {s} is not a task state (TASK_STATE_...)"))
            })?),
        };
        let page_size = match params.get("pageSize") {
            None | Some(Value::Null) => DEFAULT_PAGE,
            Some(n) => n
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| (1..=MAX_PAGE).contains(n))
                .ok_or_else(|| invalid(format!("pageSize: a whole number from 1 to {MAX_PAGE}")))?,
        };
        let after = match text("pageToken")? {
            None => None,
            Some(t) => Some(parse_token(t).ok_or_else(|| {
                invalid("pageToken: not a token this server gave (use nextPageToken)")
            })?),
        };
        let since_ms = match text("statusTimestampAfter")? {
            None => None,
            Some(t) => Some(parse_time(t).ok_or_else(|| {
                invalid("statusTimestampAfter: an RFC 3339 timestamp, such as 2026-01-31T10:00:00Z")
            })?),
        };
        let history = match params.get("historyLength") {
            None | Some(Value::Null) => None,
            // check_params refused the rest.
            Some(n) => n.as_u64().and_then(|n| usize::try_from(n).ok()),
        };
        let artifacts = match params.get("includeArtifacts") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(invalid("includeArtifacts: true or false")),
        };
        Ok(Query {
            context: text("contextId")?.map(str::to_owned),
            states,
            page_size,
            after,
            since_ms,
            history,
            artifacts,
        })
    }
}

/// One page of a listing: its tasks, the token of the next page (empty at the end) and how
/// many tasks match in all.
#[derive(Debug)]
pub(super) struct Page {
    pub(super) entries: Vec<Entry>,
    pub(super) next: String,
    pub(super) total: usize,
}

impl TaskIndex {
    /// Reads the changes of state stored since the last read.
    async fn catch_up(&self, agent: &Agent, index: &mut Index) -> Result<(), RpcError> {
        loop {
            let changes = agent.task_changes(index.after, CATCH_UP_BATCH).await?;
            let read = changes.len();
            for (id, change) in changes {
                index.after = index.after.max(change.seq);
                let state = change.state().unwrap_or(TaskState::Unknown);
                match index.tasks.get_mut(&id) {
                    Some(entry) => {
                        entry.state = state;
                        entry.updated_ms = change.stored_ms;
                    }
                    // The first change seen is the submission, unless the stream no longer
                    // holds it (its age passed): such a task is not listed.
                    None if state == TaskState::Submitted => {
                        let env = &change.envelope;
                        let target = env
                            .capability
                            .clone()
                            .or_else(|| {
                                env.to.first().map(|a| {
                                    format!("{a}.{}", env.name.as_deref().unwrap_or_default())
                                })
                            })
                            .unwrap_or_default();
                        index.tasks.insert(
                            id,
                            Entry {
                                id,
                                requester: env.from.to_string(),
                                target,
                                context: env.session_id.clone().unwrap_or_else(|| id.to_string()),
                                state,
                                updated_ms: change.stored_ms,
                            },
                        );
                    }
                    None => {}
                }
            }
            if read < CATCH_UP_BATCH {
                break;
            }
        }
        // The stream keeps tasks for its retention: older ones are gone from it.
        let horizon = chorus_sdk::envelope::now_ms().saturating_sub(
            u64::try_from(chorus_sdk::task::DEFAULT_TASK_RETENTION.as_millis()).unwrap_or(0),
        );
        index.tasks.retain(|_, e| e.updated_ms >= horizon);
        Ok(())
    }

    /// The page `query` asks for of the tasks `requester` submitted to `target`.
    pub(super) async fn page(
        &self,
        agent: &Agent,
        target: &str,
        query: &Query,
    ) -> Result<Page, RpcError> {
        let mut roots = self.inner.lock().await;
        let index = roots.entry(agent.subjects().root().to_owned()).or_default();
        self.catch_up(agent, index).await?;
        let requester = agent.id();
        let mut matching: Vec<&Entry> = index
            .tasks
            .values()
            .filter(|e| e.requester == requester && e.target == target)
            .filter(|e| query.context.as_ref().is_none_or(|c| &e.context == c))
            .filter(|e| query.states.is_none_or(|s| s.contains(&e.state)))
            .filter(|e| query.since_ms.is_none_or(|t| e.updated_ms >= t))
            .collect();
        matching.sort_unstable_by_key(|e| std::cmp::Reverse((e.updated_ms, e.id)));
        let total = matching.len();
        let start = query.after.map_or(0, |cursor| {
            matching.partition_point(|e| (e.updated_ms, e.id) >= cursor)
        });
        let end = (start + query.page_size).min(total);
        let entries: Vec<Entry> = matching[start..end].iter().map(|e| (*e).clone()).collect();
        let next = match entries.last() {
            Some(last) if end < total => token_of(last),
            _ => String::new(),
        };
        Ok(Page {
            entries,
            next,
            total,
        })
    }
}

/// One task of the index as the web console lists it: its id, requester, target, state and
/// last change (ms since the epoch).
#[derive(Debug, Clone)]
pub(crate) struct Listed {
    pub(crate) id: Uuid,
    pub(crate) requester: String,
    pub(crate) target: String,
    pub(crate) state: TaskState,
    pub(crate) updated_ms: u64,
}

impl TaskIndex {
    /// Every task of `agent`'s root the index knows, brought up to date first, newest change
    /// first (for the web console, which filters and pages them itself).
    ///
    /// # Errors
    /// A message saying why when the task stream cannot be read.
    pub(crate) async fn all(&self, agent: &Agent) -> Result<Vec<Listed>, String> {
        let mut roots = self.inner.lock().await;
        let index = roots.entry(agent.subjects().root().to_owned()).or_default();
        self.catch_up(agent, index).await.map_err(|e| e.message)?;
        let mut out: Vec<Listed> = index
            .tasks
            .values()
            .map(|e| Listed {
                id: e.id,
                requester: e.requester.clone(),
                target: e.target.clone(),
                state: e.state,
                updated_ms: e.updated_ms,
            })
            .collect();
        out.sort_unstable_by_key(|e| std::cmp::Reverse((e.updated_ms, e.id)));
        Ok(out)
    }
}

/// The response to a `ListTasks`.
pub(super) fn response(tasks: Vec<Value>, page: &Page) -> Value {
    json!({
        "tasks": tasks,
        "nextPageToken": page.next,
        "pageSize": page.entries.len(),
        "totalSize": page.total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_parameters_are_refused_with_the_parameter_named() {
        for (params, named) in [
            (json!({"pageSize": 0}), "pageSize"),
            (json!({"pageSize": -1}), "pageSize"),
            (json!({"pageSize": 101}), "pageSize"),
            (json!({"pageSize": "10"}), "pageSize"),
            (json!({"pageToken": "nope"}), "pageToken"),
            (
                json!({"statusTimestampAfter": "yesterday"}),
                "statusTimestampAfter",
            ),
            (json!({"status": "DONE"}), "status"),
            (json!({"contextId": 7}), "contextId"),
            (json!({"includeArtifacts": "yes"}), "includeArtifacts"),
        ] {
            let err = Query::parse(&params).expect_err("refused");
            assert_eq!(err.code, code::INVALID_PARAMS, "{params}");
            assert!(err.message.contains(named), "{params}: {}", err.message);
        }
        let q = Query::parse(&json!({})).expect("as built");
        assert_eq!(q.page_size, 50);
        assert!(!q.artifacts);
        let q = Query::parse(
            &json!({"pageSize": 100, "statusTimestampAfter": "2026-01-31T10:00:00Z",
            "status": "TASK_STATE_COMPLETED", "includeArtifacts": true}),
        )
        .expect("as built");
        assert_eq!(q.page_size, 100);
        assert_eq!(q.since_ms, Some(1_769_853_600_000));
        assert!(q.artifacts);
    }

    #[test]
    fn a_token_names_the_last_task_of_its_page() {
        let entry = Entry {
            id: Uuid::now_v7(),
            requester: "a".into(),
            target: "b".into(),
            context: "c".into(),
            state: TaskState::Completed,
            updated_ms: 1_769_853_600_123,
        };
        assert_eq!(
            parse_token(&token_of(&entry)),
            Some((entry.updated_ms, entry.id))
        );
    }
}
