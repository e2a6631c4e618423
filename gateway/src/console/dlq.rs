//! `/dlq`: the dead-letter queue with `chorus dlq`'s filters (agent, reason, older/newer
//! than), one letter decoded, replay of one or of a filtered set, purge with a confirmation
//! page (console-admin).
//!
//! The queue's operations are the SDK's `DeadLetterQueue`, what `chorus dlq` uses: the same
//! stream, subjects, headers and replay rules (`Chorus-Replay-Of`, an uncertain exactly-once
//! claim cleared, the entry removed only once republished).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use chorus_broker_adapter::ErrorKind;
use chorus_sdk::durable::{DeadLetter, DeadLetterQueue, DeadLetterReason, DlqEntry, DlqFilter};
use chorus_sdk::envelope::now_ms;

use super::html::{self, esc, url_part};
use super::tasks::parse_age;
use super::{Console, Wants, Who, agent_filter, given, query};
use crate::scopes::Route;

/// Entries a page shows.
const PAGE: usize = 50;
/// The most one filtered replay or purge handles at once.
const MAX_SET: usize = 10_000;

type BrokerResult<T> = Result<T, chorus_broker_adapter::Error>;

/// Which dead letters.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Filter {
    agent: Option<String>,
    reason: Option<DeadLetterReason>,
    older_than: Option<Duration>,
    newer_than: Option<Duration>,
    /// List only those after this id (the next page).
    after: u64,
}

impl Filter {
    /// The filters of a query string or a form, or a message naming the one that does not
    /// parse.
    pub(crate) fn parse(q: &HashMap<String, String>) -> Result<Filter, String> {
        let given = |name: &str| given(q, name);
        let agent = agent_filter(q)?;
        let reason = match given("reason") {
            None => None,
            Some(r) => Some(r.parse::<DeadLetterReason>().map_err(|_| {
                let known: Vec<&str> = DeadLetterReason::ALL.iter().map(|r| r.as_str()).collect();
                format!("reason: {r:?} is not one of {}", known.join(", "))
            })?),
        };
        let age = |name: &str| -> Result<Option<Duration>, String> {
            given(name)
                .map(|a| {
                    parse_age(a).ok_or_else(|| {
                        format!("{name}: {a:?} is not a duration such as 90s, 15m, 2h or 7d")
                    })
                })
                .transpose()
        };
        let after = match given("after") {
            None => 0,
            Some(a) => a
                .parse()
                .map_err(|_| format!("after: {a:?} is not a dead letter id"))?,
        };
        Ok(Filter {
            agent,
            reason,
            older_than: age("older_than")?,
            newer_than: age("newer_than")?,
            after,
        })
    }

    /// The SDK's filter of the same conditions (without the page's `after`).
    fn query(&self) -> DlqFilter {
        DlqFilter {
            agent: self.agent.clone(),
            reason: self.reason,
            older_than: self.older_than,
            newer_than: self.newer_than,
        }
    }

    /// Its fields as hidden inputs (for the replay and purge forms).
    fn hidden(&self) -> String {
        self.pairs()
            .into_iter()
            .map(|(k, v)| format!(r#"<input type="hidden" name="{k}" value="{}">"#, esc(&v)))
            .collect()
    }

    fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(a) = &self.agent {
            out.push(("agent", a.clone()));
        }
        if let Some(r) = self.reason {
            out.push(("reason", r.as_str().to_owned()));
        }
        if let Some(d) = self.older_than {
            out.push(("older_than", format!("{}s", d.as_secs())));
        }
        if let Some(d) = self.newer_than {
            out.push(("newer_than", format!("{}s", d.as_secs())));
        }
        out
    }
}

/// The dead-letter queue of the console's bus: the SDK's, as `chorus dlq` uses it, with the
/// console's answers for what is not there.
struct Queue(DeadLetterQueue);

impl Queue {
    fn of(c: &Console) -> Queue {
        let queue = DeadLetterQueue::new(c.agent.broker().clone(), c.agent.subjects().clone());
        Queue(match &c.replayer {
            // Replays in the coordinator's name, signed with its key: an agent that verifies
            // and trusts that key handles them once (PROTOCOL.md 7.8).
            Some(key) => queue.signed_by(chorus_sdk::registry::COORDINATOR_ID, Arc::clone(key)),
            None => queue,
        })
    }

    /// Entries matching `filter` with ids above `filter.after`, oldest first, at most `limit`.
    async fn find(&self, filter: &Filter, limit: usize) -> BrokerResult<Vec<DlqEntry>> {
        self.0.find(&filter.query(), filter.after, limit).await
    }

    /// Entry `id`; `None` when there is none (or it is not a dead letter).
    async fn show(&self, id: u64) -> BrokerResult<Option<DlqEntry>> {
        match self.0.show(id).await {
            Ok(entry) => Ok(Some(entry)),
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::InvalidInput) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Publishes entry `id`'s original again and removes the entry (the SDK's replay).
    /// `Ok(false)` when there is no entry `id`.
    async fn replay(&self, id: u64) -> BrokerResult<bool> {
        if self.show(id).await?.is_none() {
            return Ok(false);
        }
        self.0.replay(id).await.map(|_| true)
    }

    /// How many entries there are.
    async fn depth(&self) -> BrokerResult<u64> {
        self.0.depth().await
    }

    /// Removes the entries `filter` selects (every one, at once, without filters); how many.
    async fn purge(&self, filter: &Filter) -> BrokerResult<u64> {
        if filter.query().is_empty() {
            return self.0.purge().await;
        }
        let mut removed = 0;
        for entry in self.find(filter, MAX_SET).await? {
            if self.0.remove(entry.id).await? {
                removed += 1;
            }
        }
        Ok(removed)
    }
}

/// The decoded original of `letter`, as JSON (null when it does not decode).
fn decoded(letter: &DeadLetter, subjects: &chorus_sdk::Subjects) -> serde_json::Value {
    let Ok((env, _)) =
        chorus_sdk::codec::decode_on(&letter.envelope, &subjects.implied(&letter.subject))
    else {
        return serde_json::Value::Null;
    };
    let payload = crate::tasks::json_of(&env.payload, &env.content_type);
    let mut value = serde_json::to_value(&env).unwrap_or_default();
    if let Some(obj) = value.as_object_mut() {
        obj.insert("payload".into(), payload);
    }
    value
}

fn reason_options(selected: Option<DeadLetterReason>) -> String {
    std::iter::once(None)
        .chain(DeadLetterReason::ALL.into_iter().map(Some))
        .map(|r| {
            let (value, label) = r.map_or(("", "any reason"), |r| (r.as_str(), r.as_str()));
            let sel = if r == selected { " selected" } else { "" };
            format!(r#"<option value="{value}"{sel}>{label}</option>"#)
        })
        .collect()
}

/// `GET /dlq?agent=&reason=&older_than=&newer_than=&after=`.
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
    let q = match query(raw.as_deref()) {
        Ok(q) => q,
        Err(e) => return html::error(StatusCode::BAD_REQUEST, Some(&who.chrome()), &e),
    };
    let filter = match Filter::parse(&q) {
        Ok(f) => f,
        Err(e) => return html::error(StatusCode::BAD_REQUEST, Some(&who.chrome()), &e),
    };
    let queue = Queue::of(&c);
    let (mut entries, depth) = match (queue.find(&filter, PAGE + 1).await, queue.depth().await) {
        (Ok(e), Ok(d)) => (e, d),
        (Err(e), _) | (_, Err(e)) => return c.bus_down(&who, "the dead-letter stream", &e),
    };
    let more = entries.len() > PAGE;
    entries.truncate(PAGE);
    let now = now_ms();
    let admin = who.admin();
    let mut rows = String::new();
    for e in &entries {
        let l = &e.letter;
        let replay = if admin {
            format!(
                r#"<form method="post" action="/dlq/{id}/replay" class="inline">{}<button type="submit" class="replay">Replay</button></form>"#,
                who.csrf_input(),
                id = e.id
            )
        } else {
            String::new()
        };
        rows.push_str(&format!(
            r#"<tr data-id="{id}"><td><a href="/dlq/{id}">{id}</a></td><td title="{at}">{ago} ago</td><td>{reason}</td><td>{code}</td><td>{agent}</td><td>{tries}</td><td>{subject}</td><td>{detail}</td><td>{replay}</td></tr>"#,
            id = e.id,
            at = esc(&html::utc(l.dead_lettered_ms)),
            ago = esc(&html::age(now, l.dead_lettered_ms)),
            reason = esc(l.reason.as_str()),
            code = l.status.0,
            agent = esc(&l.agent),
            tries = l.attempts,
            subject = esc(&l.subject),
            detail = esc(&l.detail),
        ));
    }
    let notice = match (q.get("replayed"), q.get("purged")) {
        (Some(n), _) => format!(r#"<p id="notice" class="notice">Replayed {}.</p>"#, esc(n)),
        (_, Some(n)) => format!(
            r#"<p id="notice" class="notice">Purged {} dead letter(s).</p>"#,
            esc(n)
        ),
        _ => String::new(),
    };
    let actions = if admin {
        format!(
            r#"<form method="post" action="/dlq/replay" class="inline">{csrf}{hidden}<button id="replay-all" type="submit">Replay every one these filters select</button></form> <form method="post" action="/dlq/purge" class="inline">{csrf}{hidden}<button id="purge" type="submit" class="danger">Purge…</button></form>"#,
            csrf = who.csrf_input(),
            hidden = filter.hidden()
        )
    } else {
        String::new()
    };
    let next = match (more, entries.last()) {
        (true, Some(last)) => {
            let mut pairs = filter.pairs();
            pairs.push(("after", last.id.to_string()));
            let q: Vec<String> = pairs
                .iter()
                .map(|(k, v)| format!("{k}={}", url_part(v)))
                .collect();
            format!(
                r#"<a id="next-page" href="/dlq?{}">next page</a>"#,
                esc(&q.join("&"))
            )
        }
        _ => String::new(),
    };
    let value = |name: &str| esc(q.get(name).map(String::as_str).unwrap_or_default());
    let body = format!(
        r#"{notice}<form id="dlq-filter" method="get" action="/dlq"><label>agent <input name="agent" value="{agent}" size="16"></label> <label>reason <select name="reason">{reasons}</select></label> <label>older than <input name="older_than" value="{older}" size="6" placeholder="1h"></label> <label>newer than <input name="newer_than" value="{newer}" size="6" placeholder="7d"></label> <button type="submit">Filter</button></form><p>{depth} dead letter(s) in the queue; {shown} shown.</p>{actions}<table id="dlq"><thead><tr><th>id</th><th>dead for</th><th>reason</th><th>code</th><th>agent</th><th>tries</th><th>subject</th><th>detail</th><th></th></tr></thead><tbody>{rows}</tbody></table><p class="pager">{next}</p>"#,
        agent = value("agent"),
        reasons = reason_options(filter.reason),
        older = value("older_than"),
        newer = value("newer_than"),
        shown = entries.len(),
    );
    html::html(
        StatusCode::OK,
        html::layout("Dead letters", Some(&who.chrome()), &body),
    )
}

/// The id in a path, or a 400 page.
fn id_of(who: &Who, id: &str) -> Result<u64, Response> {
    id.parse::<u64>().ok().filter(|id| *id >= 1).ok_or_else(|| {
        html::error(
            StatusCode::BAD_REQUEST,
            Some(&who.chrome()),
            &format!("{id:?} is not a dead letter id (a whole number from 1)"),
        )
    })
}

fn no_letter(who: &Who, id: u64) -> Response {
    html::error(
        StatusCode::NOT_FOUND,
        Some(&who.chrome()),
        &format!("no dead letter {id} in the queue (replayed or purged already?)"),
    )
}

/// `GET /dlq/{id}`: one dead letter, its original decoded.
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
    let id = match id_of(&who, &id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    let queue = Queue::of(&c);
    let entry = match queue.show(id).await {
        Ok(Some(e)) => e,
        Ok(None) => return no_letter(&who, id),
        Err(e) => return c.bus_down(&who, "the dead-letter stream", &e),
    };
    let l = &entry.letter;
    // The CLI's facts, with the times in UTC rather than milliseconds.
    let mut facts = entry.to_json();
    if let Some(map) = facts.as_object_mut() {
        map.remove("stored_ms");
        map.remove("dead_lettered_ms");
        map.insert("stored".into(), html::utc(l.stored_ms).into());
        map.insert("dead_lettered".into(), html::utc(l.dead_lettered_ms).into());
    }
    let replay = if who.admin() {
        format!(
            r#"<form method="post" action="/dlq/{id}/replay">{}<button id="replay" type="submit">Replay this message</button></form>"#,
            who.csrf_input()
        )
    } else {
        String::new()
    };
    let body = format!(
        "{}{replay}<h2>Original envelope</h2>{}",
        html::json_pre("dlq-letter", &facts),
        html::json_pre("dlq-envelope", &decoded(l, queue.0.subjects())),
    );
    html::html(
        StatusCode::OK,
        html::layout(&format!("Dead letter {id}"), Some(&who.chrome()), &body),
    )
}

/// `POST /dlq/{id}/replay` (console-admin).
pub(crate) async fn replay_one(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let who = match c.who_posts(&headers, &body, Route::ConsoleAdmin) {
        Ok((w, _)) => w,
        Err(r) => return r,
    };
    let id = match id_of(&who, &id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    let replayed = Queue::of(&c).replay(id).await;
    let (outcome, detail) = match &replayed {
        Ok(true) => ("ok", None),
        Ok(false) => ("failed", Some("no such dead letter".to_owned())),
        Err(e) => ("failed", Some(e.to_string())),
    };
    c.audit(&who, "dlq.replay", Some(id.to_string()), outcome, detail);
    match replayed {
        Ok(true) => {
            tracing::info!(identity = who.identity, id, "console: dead letter replayed");
            html::see_other(&format!("/dlq?replayed={id}"))
        }
        Ok(false) => no_letter(&who, id),
        Err(e) if e.kind() == ErrorKind::InvalidInput => {
            html::error(StatusCode::CONFLICT, Some(&who.chrome()), &e.to_string())
        }
        Err(e) => c.bus_down(&who, "replay", &e),
    }
}

/// The poster, the form and its filters (over the whole queue, not one page) of an admin action on a
/// set of dead letters, or the page refusing it (403, CSRF) or a filter (400).
fn admin_form(
    c: &Console,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<(Who, HashMap<String, String>, Filter), Response> {
    let (who, form) = c.who_posts(headers, body, Route::ConsoleAdmin)?;
    match Filter::parse(&form) {
        Ok(f) => Ok((who, form, Filter { after: 0, ..f })),
        Err(e) => Err(html::error(
            StatusCode::BAD_REQUEST,
            Some(&who.chrome()),
            &e,
        )),
    }
}

/// What a set of dead letters was chosen by, for the audit stream: its filters, or `all`.
fn described(filter: &Filter) -> String {
    let pairs: Vec<String> = filter
        .pairs()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if pairs.is_empty() {
        "all".to_owned()
    } else {
        pairs.join(" ")
    }
}

/// `POST /dlq/replay` (console-admin): every dead letter the form's filters select.
pub(crate) async fn replay_set(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (who, _, filter) = match admin_form(&c, &headers, &body) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let queue = Queue::of(&c);
    let entries = match queue.find(&filter, MAX_SET).await {
        Ok(e) => e,
        Err(e) => return c.bus_down(&who, "the dead-letter stream", &e),
    };
    let (mut replayed, mut failed) = (0usize, Vec::new());
    for e in &entries {
        match queue.replay(e.id).await {
            Ok(true) => replayed += 1,
            Ok(false) => {}
            Err(err) => failed.push(format!("{}: {err}", e.id)),
        }
    }
    tracing::info!(
        identity = who.identity,
        replayed,
        failed = failed.len(),
        "console: dead letters replayed"
    );
    c.audit(
        &who,
        "dlq.replay",
        Some(described(&filter)),
        if failed.is_empty() { "ok" } else { "failed" },
        Some(format!("{replayed} replayed, {} failed", failed.len())),
    );
    let failures: String = failed
        .iter()
        .map(|f| format!("<li>{}</li>", esc(f)))
        .collect();
    let body = format!(
        r#"<p id="notice" class="notice">Replayed {replayed} dead letter(s); {} failed.</p><ul id="failures">{failures}</ul><p><a href="/dlq">Back to the dead letters</a></p>"#,
        failed.len()
    );
    html::html(
        StatusCode::OK,
        html::layout("Replayed", Some(&who.chrome()), &body),
    )
}

/// `POST /dlq/purge` (console-admin): without `confirm=yes`, a page that says how many would
/// go and asks; with it, removes them.
pub(crate) async fn purge(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (who, form, filter) = match admin_form(&c, &headers, &body) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let queue = Queue::of(&c);
    if form.get("confirm").map(String::as_str) != Some("yes") {
        let count = if filter.query().is_empty() {
            queue.depth().await.map(|d| d.to_string())
        } else {
            queue
                .find(&filter, MAX_SET)
                .await
                .map(|e| e.len().to_string())
        };
        let count = match count {
            Ok(n) => n,
            Err(e) => return c.bus_down(&who, "the dead-letter stream", &e),
        };
        let what = if filter.query().is_empty() {
            "every dead letter".to_owned()
        } else {
            let pairs: Vec<String> = filter
                .pairs()
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            format!("the dead letters with {}", pairs.join(", "))
        };
        let body = format!(
            r#"<p id="purge-count">This removes {what}: {count} of them, for good.</p><form method="post" action="/dlq/purge">{}{}<input type="hidden" name="confirm" value="yes"><button id="purge-confirm" type="submit" class="danger">Purge them</button></form> <p><a href="/dlq">Keep them</a></p>"#,
            who.csrf_input(),
            filter.hidden(),
            what = esc(&what),
        );
        return html::html(
            StatusCode::OK,
            html::layout("Purge dead letters?", Some(&who.chrome()), &body),
        );
    }
    let purged = queue.purge(&filter).await;
    c.audit(
        &who,
        "dlq.purge",
        Some(described(&filter)),
        if purged.is_ok() { "ok" } else { "failed" },
        Some(match &purged {
            Ok(n) => format!("{n} removed"),
            Err(e) => e.to_string(),
        }),
    );
    match purged {
        Ok(n) => {
            tracing::info!(
                identity = who.identity,
                removed = n,
                "console: dead letters purged"
            );
            html::see_other(&format!("/dlq?purged={n}"))
        }
        Err(e) => c.bus_down(&who, "purge", &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn dead_letter_filters_parse_or_name_the_one_that_does_not() {
        assert_eq!(Filter::parse(&q(&[])), Ok(Filter::default()));
        let f = Filter::parse(&q(&[
            ("agent", "ledger"),
            ("reason", "max_attempts"),
            ("older_than", "1h"),
            ("newer_than", "7d"),
            ("after", "12"),
        ]))
        .expect("valid");
        assert_eq!(f.agent.as_deref(), Some("ledger"));
        assert_eq!(f.reason, Some(DeadLetterReason::MaxAttempts));
        assert_eq!(f.older_than, Some(Duration::from_secs(3600)));
        assert_eq!(f.after, 12);
        assert!(!f.query().is_empty());
        for (pairs, named) in [
            (q(&[("reason", "bored")]), "reason:"),
            (q(&[("agent", "a>b")]), "agent:"),
            (q(&[("older_than", "later")]), "older_than:"),
            (q(&[("after", "-1")]), "after:"),
        ] {
            let e = Filter::parse(&pairs).expect_err(named);
            assert!(e.starts_with(named), "{e}");
        }
        let hidden = Filter::parse(&q(&[("agent", "ledger")]))
            .expect("valid")
            .hidden();
        assert_eq!(
            hidden,
            r#"<input type="hidden" name="agent" value="ledger">"#
        );
    }
}
