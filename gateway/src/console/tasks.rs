//! `/tasks`: the bus's tasks from the gateway's task index, filtered by state, agent (its
//! requester or its target agent) and age, 50 a page; `/tasks/{id}`: its state, progress and
//! chunks live (server-sent events from its task stream), its attempts with their
//! verification, its report; `POST /tasks/{id}/cancel` (console-admin).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use chorus_sdk::envelope::now_ms;
use chorus_sdk::{SdkError, TaskState};
use futures::StreamExt;
use uuid::Uuid;

use super::html::{self, esc, url_part};
use super::{Console, Wants, agent_filter, given, query};
use crate::scopes::Route;

/// Tasks a page shows.
pub(crate) const PAGE: usize = 50;

/// A task list's filters, checked.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Filter {
    pub(crate) state: Option<TaskState>,
    pub(crate) agent: Option<String>,
    pub(crate) age: Option<Duration>,
    /// From 1.
    pub(crate) page: usize,
}

/// A duration as `90s`, `15m`, `2h` or `7d`.
pub(crate) fn parse_age(text: &str) -> Option<Duration> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = text.split_at(split);
    let n: u64 = n.parse().ok()?;
    let secs = match unit {
        "s" => n,
        "m" => n.checked_mul(60)?,
        "h" => n.checked_mul(3600)?,
        "d" => n.checked_mul(86_400)?,
        _ => return None,
    };
    (secs > 0).then(|| Duration::from_secs(secs))
}

impl Filter {
    /// The filters of a query string, or a message naming the one that does not parse.
    pub(crate) fn parse(raw: Option<&str>) -> Result<Filter, String> {
        let q = query(raw)?;
        let given = |name: &str| given(&q, name);
        let state = match given("state") {
            None => None,
            Some(s) => match s.parse::<TaskState>() {
                Ok(TaskState::Unknown) | Err(_) => {
                    let known: Vec<&str> = TaskState::ALL.iter().map(|s| s.as_str()).collect();
                    return Err(format!(
                        "state: {s:?} is not a task state ({})",
                        known.join(", ")
                    ));
                }
                Ok(state) => Some(state),
            },
        };
        let agent = agent_filter(&q)?;
        let age = match given("age") {
            None => None,
            Some(a) => Some(parse_age(a).ok_or_else(|| {
                format!("age: {a:?} is not a duration such as 90s, 15m, 1h or 7d")
            })?),
        };
        let page = match given("page") {
            None => 1,
            Some(p) => p
                .parse::<usize>()
                .ok()
                .filter(|p| (1..=100_000).contains(p))
                .ok_or_else(|| format!("page: {p:?} is not a page number from 1"))?,
        };
        Ok(Filter {
            state,
            agent,
            age,
            page,
        })
    }

    /// The query string of page `page` with these filters.
    fn href(&self, page: usize) -> String {
        let mut parts = Vec::new();
        if let Some(s) = self.state {
            parts.push(format!("state={}", s.as_str()));
        }
        if let Some(a) = &self.agent {
            parts.push(format!("agent={}", url_part(a)));
        }
        if let Some(a) = self.age {
            parts.push(format!("age={}s", a.as_secs()));
        }
        parts.push(format!("page={page}"));
        format!("/tasks?{}", parts.join("&"))
    }
}

/// The agent a task's target names (`<agent>.<command>`), if it names one.
fn target_agent(target: &str) -> Option<&str> {
    if target.starts_with("cap.") {
        return None;
    }
    target.split('.').next()
}

/// `GET /tasks?state=&agent=&age=&page=`.
pub(crate) async fn list(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    RawQuery(raw): RawQuery,
) -> Response {
    let who = match c.who(&headers, &uri.to_string(), Route::Console, Wants::Page) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let filter = match Filter::parse(raw.as_deref()) {
        Ok(f) => f,
        Err(e) => return html::error(StatusCode::BAD_REQUEST, Some(&who.chrome()), &e),
    };
    let all = match c.gateway.a2a_index.all(&c.agent).await {
        Ok(all) => all,
        Err(e) => return c.bus_down(&who, "the task stream", &e),
    };
    let now = now_ms();
    let since = filter
        .age
        .map(|a| now.saturating_sub(u64::try_from(a.as_millis()).unwrap_or(u64::MAX)));
    let matching: Vec<_> = all
        .iter()
        .filter(|t| filter.state.is_none_or(|s| t.state == s))
        .filter(|t| {
            filter
                .agent
                .as_deref()
                .is_none_or(|a| t.requester == a || target_agent(&t.target) == Some(a))
        })
        .filter(|t| since.is_none_or(|s| t.updated_ms >= s))
        .collect();
    let start = (filter.page - 1).saturating_mul(PAGE);
    let mut rows = String::new();
    for t in matching.iter().skip(start).take(PAGE) {
        rows.push_str(&format!(
            r#"<tr data-task="{id}"><td><a href="/tasks/{id}">{id}</a></td><td class="state">{state}</td><td>{target}</td><td>{requester}</td><td title="{at}">{ago} ago</td></tr>"#,
            id = t.id,
            state = esc(t.state.as_str()),
            target = esc(&t.target),
            requester = esc(&t.requester),
            at = esc(&html::utc(t.updated_ms)),
            ago = esc(&html::age(now, t.updated_ms)),
        ));
    }
    let options: String = std::iter::once(("", "any state"))
        .chain(TaskState::ALL.iter().map(|s| (s.as_str(), s.as_str())))
        .map(|(value, label)| {
            let selected = if filter.state.map(|s| s.as_str()) == Some(value)
                || (value.is_empty() && filter.state.is_none())
            {
                " selected"
            } else {
                ""
            };
            format!(r#"<option value="{value}"{selected}>{label}</option>"#)
        })
        .collect();
    let mut pager = String::new();
    if filter.page > 1 {
        pager.push_str(&format!(
            r#"<a id="prev-page" href="{}">newer</a> "#,
            esc(&filter.href(filter.page - 1))
        ));
    }
    if start + PAGE < matching.len() {
        pager.push_str(&format!(
            r#"<a id="next-page" href="{}">older</a>"#,
            esc(&filter.href(filter.page + 1))
        ));
    }
    let body = format!(
        r#"<form id="task-filter" method="get" action="/tasks"><label>state <select name="state">{options}</select></label> <label>agent <input name="agent" value="{agent}" size="16"></label> <label>changed within <input name="age" value="{age}" size="6" placeholder="1h"></label> <button type="submit">Filter</button></form><p>{n} task(s) match; page {page}.</p><table id="tasks"><thead><tr><th>task</th><th>state</th><th>target</th><th>requester</th><th>last change</th></tr></thead><tbody>{rows}</tbody></table><p class="pager">{pager}</p>"#,
        agent = esc(filter.agent.as_deref().unwrap_or_default()),
        age = filter
            .age
            .map(|a| format!("{}s", a.as_secs()))
            .unwrap_or_default(),
        n = matching.len(),
        page = filter.page,
    );
    html::html(
        StatusCode::OK,
        html::layout("Tasks", Some(&who.chrome()), &body),
    )
}

/// Task `id`'s handle; the page to answer with when there is none (404) or the bus fails.
async fn handle_of(
    c: &Console,
    who: &super::Who,
    id: &str,
) -> Result<chorus_sdk::task::TaskHandle, Response> {
    let not_found = || {
        html::error(
            StatusCode::NOT_FOUND,
            Some(&who.chrome()),
            &format!("no task {id} (it may be older than the task stream keeps)"),
        )
    };
    let Ok(uuid) = Uuid::parse_str(id) else {
        return Err(not_found());
    };
    match c.agent.task(uuid).await {
        Ok(h) => Ok(h),
        Err(SdkError::TaskNotFound(_)) => Err(not_found()),
        Err(e) => Err(c.bus_down(who, "the task stream", &e)),
    }
}

/// `GET /tasks/{id}`.
pub(crate) async fn one(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    Path(id): Path<String>,
) -> Response {
    let who = match c.who(&headers, &uri.to_string(), Route::Console, Wants::Page) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let handle = match handle_of(&c, &who, &id).await {
        Ok(h) => h,
        Err(r) => return r,
    };
    let report = match handle.report().await {
        Ok(r) => r,
        Err(e) => return c.bus_down(&who, "the task stream", &e),
    };
    let mut attempts = String::new();
    for a in &report.attempts {
        attempts.push_str(&format!(
            r#"<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            esc(&a.agent),
            esc(&html::utc(a.started_ms)),
            esc(a.state.as_str()),
            a.status
                .map(|s| format!("{} {}", s.0, s.label()))
                .unwrap_or_default(),
            match a.verified {
                Some(true) => "accepted",
                Some(false) => "rejected",
                None => "–",
            },
            esc(a.note.as_deref().unwrap_or_default()),
        ));
    }
    let view = crate::tasks::TaskView::from(&report);
    let report_json = serde_json::to_value(&view).unwrap_or_default();
    let cancel = if who.admin() && !report.is_finished() {
        format!(
            r#"<form method="post" action="/tasks/{id}/cancel" class="inline">{}<button id="cancel" type="submit" class="danger">Cancel the task</button></form>"#,
            who.csrf_input(),
            id = report.id
        )
    } else {
        String::new()
    };
    let body = format!(
        r#"<div id="task" data-events="/tasks/{id}/events"><p>Target <code>{target}</code>, submitted by <code>{requester}</code> at {at}.</p><p>State: <b id="task-state" data-state="{state}">{state}</b> <span id="task-status">{status} {label}</span> {reason}</p><p>Progress: <span id="task-progress">–</span></p>{cancel}<h2>Chunks</h2><pre id="task-chunks"></pre><h2>Events</h2><ol id="task-events"></ol><h2>Attempts and verification</h2><table id="task-attempts"><thead><tr><th>agent</th><th>started</th><th>state</th><th>code</th><th>verification</th><th>note</th></tr></thead><tbody>{attempts}</tbody></table><h2>Report</h2>{report}</div>"#,
        id = report.id,
        target = esc(&report.target),
        requester = esc(&report.requester),
        at = esc(&html::utc(report.submitted_ms)),
        state = esc(report.state.as_str()),
        status = report.status.0,
        label = esc(report.status.label()),
        reason = esc(report.reason.as_deref().unwrap_or_default()),
        report = html::json_pre("task-report", &report_json),
    );
    html::html(
        StatusCode::OK,
        html::layout(&format!("Task {}", report.id), Some(&who.chrome()), &body),
    )
}

/// `GET /tasks/{id}/events`: server-sent events, one per update (`id:` its sequence, `data:`
/// the update as JSON, its `kind` in it), then one `{"kind":"end"}` after the terminal state.
/// A reconnecting browser's `Last-Event-ID` resumes after the update it saw.
pub(crate) async fn events(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let who = match c.who(&headers, "/", Route::Console, Wants::Feed) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let handle = match handle_of(&c, &who, &id).await {
        Ok(h) => h,
        Err(r) => return r,
    };
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let updates = match crate::tasks::updates_of(&handle, after).await {
        Ok(u) => u,
        Err(_) => return c.bus_down(&who, "the task stream", &"updates not readable"),
    };
    let stop = c.stop.clone();
    let stream = updates
        .take_until(async move { stop.cancelled().await })
        .map(|update| {
            Ok::<_, Infallible>(match update {
                Ok(u) => Event::default()
                    .id(u.seq.to_string())
                    .json_data(crate::tasks::UpdateView::from(&u))
                    .unwrap_or_default(),
                Err(e) => Event::default()
                    .json_data(serde_json::json!({"kind": "error", "text": e.to_string()}))
                    .unwrap_or_default(),
            })
        })
        .chain(futures::stream::once(async {
            Ok(Event::default().data(r#"{"kind":"end"}"#))
        }));
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// `POST /tasks/{id}/cancel` (console-admin): cancels as the console's agent, then back to
/// the task's page.
pub(crate) async fn cancel(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let who = match c.who_posts(&headers, &body, Route::ConsoleAdmin) {
        Ok((w, _)) => w,
        Err(r) => return r,
    };
    let handle = match handle_of(&c, &who, &id).await {
        Ok(h) => h,
        Err(r) => return r,
    };
    let cancelled = handle.cancel().await;
    c.audit(
        &who,
        "task.cancel",
        Some(id.clone()),
        if cancelled.is_ok() { "ok" } else { "failed" },
        cancelled.as_ref().err().map(ToString::to_string),
    );
    match cancelled {
        Ok(report) => {
            tracing::info!(identity = who.identity, task = %report.id, state = report.state.as_str(), "console: task cancelled");
            html::see_other(&format!("/tasks/{}", report.id))
        }
        Err(e) => c.bus_down(&who, "cancel", &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_filters_parse_or_name_the_one_that_does_not() {
        assert_eq!(
            Filter::parse(None),
            Ok(Filter {
                page: 1,
                ..Filter::default()
            })
        );
        let f = Filter::parse(Some("state=working&agent=calc&age=1h&page=3")).expect("valid");
        assert_eq!(f.state, Some(TaskState::Working));
        assert_eq!(f.agent.as_deref(), Some("calc"));
        assert_eq!(f.age, Some(Duration::from_secs(3600)));
        assert_eq!(f.page, 3);
        assert_eq!(
            Filter::parse(Some("state=&agent=&age=")).map(|f| f.page),
            Ok(1)
        );
        for (q, named) in [
            ("state=sleeping", "state:"),
            ("agent=a.b", "agent:"),
            ("age=soon", "age:"),
            ("age=0s", "age:"),
            ("page=0", "page:"),
            ("page=x", "page:"),
        ] {
            let e = Filter::parse(Some(q)).expect_err(q);
            assert!(e.starts_with(named), "{q}: {e}");
        }
        assert_eq!(parse_age("7d"), Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_age("15m"), Some(Duration::from_secs(900)));
        assert_eq!(parse_age("15"), None);
        assert_eq!(parse_age("m"), None);
    }

    #[test]
    fn a_page_link_keeps_the_filters() {
        let f = Filter::parse(Some("state=failed&agent=calc&age=2h")).expect("valid");
        assert_eq!(f.href(2), "/tasks?state=failed&agent=calc&age=7200s&page=2");
        assert_eq!(target_agent("calc.add"), Some("calc"));
        assert_eq!(target_agent("cap.text.sum"), None);
    }
}
