//! `/tap`: live traffic, as `chorus tap` shows it: every envelope on a subject pattern under
//! the root (and the replies to the requests it showed; with `>` every reply), decoded, with
//! its kind, performative (negotiation's call for proposals, bids and award among them),
//! sender, receivers, ids, trace id, the task it states (Agentify's `task`) and a summary of
//! its payload, as server-sent events
//! (`/tap/events?pattern=&kind=`). A browser that reads too slowly loses the oldest messages,
//! counted (each event says how many so far); pausing is the page's own.

use std::collections::{HashSet, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use chorus_sdk::{Envelope, Kind};
use futures::StreamExt;
use serde::Serialize;
use tokio::sync::Notify;

use super::html::{self, esc};
use super::{Console, Wants, given, query};
use crate::scopes::Route;

/// Messages held for one browser; beyond it the oldest are dropped.
const BUFFER: usize = 512;
/// Request ids remembered to show their replies.
const ASKED: usize = 10_000;
/// Payload summaries are cut to this many characters.
const SUMMARY: usize = 240;

/// Counters across every tap of the console.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Messages dropped because a browser read too slowly.
    pub(crate) dropped: AtomicU64,
}

/// One message as the tap shows it.
#[derive(Debug, Serialize)]
struct Line {
    subject: String,
    kind: &'static str,
    performative: &'static str,
    from: String,
    to: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    id: String,
    correlation_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    trace_id: Option<String>,
    time: String,
    payload: String,
    /// What the sender asked for in words (Agentify's `task`, the header `agentify-task`).
    #[serde(skip_serializing_if = "Option::is_none")]
    task: Option<String>,
    /// Messages this browser lost so far.
    dropped: u64,
}

fn summary(env: &Envelope) -> String {
    if env.encryption.is_some() {
        return format!("(encrypted, {} bytes)", env.payload.len());
    }
    if env.payload.is_empty() {
        return String::new();
    }
    let text = match chorus_sdk::codec::decode_payload::<serde_json::Value>(
        &env.payload,
        &env.content_type,
    ) {
        Ok(v) => v.to_string(),
        Err(_) => format!("({} bytes)", env.payload.len()),
    };
    cut(&text, SUMMARY)
}

/// `text` cut to `max` characters, with an ellipsis if it was longer.
fn cut(text: &str, max: usize) -> String {
    if text.chars().count() > max {
        let cut: String = text.chars().take(max).collect();
        format!("{cut}…")
    } else {
        text.to_owned()
    }
}

impl Line {
    fn of(subject: &str, env: &Envelope) -> Line {
        Line {
            subject: subject.to_owned(),
            kind: env.kind.as_str(),
            performative: env.performative.as_str(),
            from: env.from.to_string(),
            to: env.to.iter().map(ToString::to_string).collect(),
            name: env.name.as_ref().map(ToString::to_string),
            id: env.id.to_string(),
            correlation_id: env.conversation().to_string(),
            status: env.status.map(|s| s.0),
            trace_id: env.trace.as_ref().and_then(|t| {
                t.traceparent
                    .with_text(|text| text.split('-').nth(1).map(str::to_owned))
            }),
            time: html::utc(env.timestamp_ms),
            payload: summary(env),
            task: env
                .headers
                .get(crate::agentify::TASK_HEADER)
                .map(|t| cut(t, SUMMARY)),
            dropped: 0,
        }
    }
}

/// A tap's filters, checked.
#[derive(Debug, PartialEq)]
pub(crate) struct Filter {
    pub(crate) pattern: String,
    pub(crate) kind: Option<Kind>,
}

impl Filter {
    /// The filters of a query string, or a message naming the one that does not parse.
    pub(crate) fn parse(raw: Option<&str>) -> Result<Filter, String> {
        let q = query(raw)?;
        let given = |name: &str| given(&q, name);
        let pattern = given("pattern").unwrap_or(">").to_owned();
        chorus_sdk::subject::validate_pattern(&pattern)
            .map_err(|e| format!("pattern: {pattern:?}: {e}"))?;
        let kind = match given("kind") {
            None => None,
            Some(k) => match k.parse::<Kind>() {
                Ok(Kind::Unknown) | Err(_) => {
                    let known: Vec<&str> = Kind::ALL.iter().map(|k| k.as_str()).collect();
                    return Err(format!("kind: {k:?} is not one of {}", known.join(", ")));
                }
                Ok(kind) => Some(kind),
            },
        };
        Ok(Filter { pattern, kind })
    }
}

/// `GET /tap?pattern=&kind=`: the page; its script follows `/tap/events` with the same query.
pub(crate) async fn page(
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
    let kinds: String = std::iter::once(None)
        .chain(Kind::ALL.iter().copied().map(Some))
        .map(|k| {
            let (value, label) = k.map_or(("", "any kind"), |k| (k.as_str(), k.as_str()));
            let sel = if k == filter.kind { " selected" } else { "" };
            format!(r#"<option value="{value}"{sel}>{label}</option>"#)
        })
        .collect();
    let feed = format!(
        "/tap/events?pattern={}{}",
        html::url_part(&filter.pattern),
        filter
            .kind
            .map(|k| format!("&kind={}", k.as_str()))
            .unwrap_or_default()
    );
    let body = format!(
        r#"<form id="tap-form" method="get" action="/tap"><label>subject pattern <input name="pattern" value="{pattern}" size="24"></label> <label>kind <select name="kind">{kinds}</select></label> <button type="submit">Tap</button></form><p><button id="tap-pause" type="button">Pause</button> <span id="tap-state">live</span>; dropped (browser too slow): <span id="tap-dropped">0</span></p><table id="tap" data-events="{feed}"><thead><tr><th>time</th><th>kind</th><th>performative</th><th>from → to</th><th>subject</th><th>status</th><th>trace</th><th>task</th><th>payload</th></tr></thead><tbody id="tap-log"></tbody></table>"#,
        pattern = esc(&filter.pattern),
        feed = esc(&feed),
    );
    html::html(
        StatusCode::OK,
        html::layout("Live traffic", Some(&who.chrome()), &body),
    )
}

/// What a tap's reader and its browser share: the messages waiting, oldest first.
struct Buffer {
    lines: Mutex<VecDeque<Line>>,
    dropped: AtomicU64,
    ready: Notify,
}

/// `GET /tap/events?pattern=&kind=`: server-sent events, one per message (`data:` a [`Line`]
/// as JSON); 400 for a filter that does not parse.
pub(crate) async fn events(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    let who = match c.who(&headers, "/tap", Route::Console, Wants::Feed) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let filter = match Filter::parse(raw.as_deref()) {
        Ok(f) => f,
        Err(e) => return html::error(StatusCode::BAD_REQUEST, Some(&who.chrome()), &e),
    };
    let broker = c.agent.broker().clone();
    let subjects = c.agent.subjects().clone();
    let everything = filter.pattern == ">";
    let (bus, replies) = match (
        broker
            .subscribe(&format!("{}.{}", subjects.root(), filter.pattern))
            .await,
        broker.subscribe("_INBOX.>").await,
    ) {
        (Ok(b), Ok(r)) => (b, r),
        (Err(e), _) | (_, Err(e)) => return c.bus_down(&who, "tap", &e),
    };
    let buffer = Arc::new(Buffer {
        lines: Mutex::default(),
        dropped: AtomicU64::new(0),
        ready: Notify::new(),
    });
    // Stops the reader when the browser goes (the stream below is dropped).
    let gone = c.stop.child_token();
    let guard = gone.clone().drop_guard();
    let reader = Arc::clone(&buffer);
    let console = Arc::clone(&c);
    let kind = filter.kind;
    tokio::spawn(async move {
        let (mut bus, mut replies) = (bus, replies);
        let mut asked: HashSet<uuid::Uuid> = HashSet::new();
        let mut order: VecDeque<uuid::Uuid> = VecDeque::new();
        loop {
            let (msg, reply) = tokio::select! {
                () = gone.cancelled() => return,
                m = bus.next() => (m, false),
                m = replies.next() => (m, true),
            };
            let Some(msg) = msg else { return };
            let implied = subjects.implied(msg.subject());
            let Ok((env, _)) = chorus_sdk::codec::decode_on(msg.payload(), &implied) else {
                continue;
            };
            if reply {
                if !everything && !env.in_reply_to.is_some_and(|id| asked.contains(&id)) {
                    continue;
                }
            } else if !everything && msg.reply().is_some() && asked.insert(env.id) {
                order.push_back(env.id);
                if order.len() > ASKED
                    && let Some(old) = order.pop_front()
                {
                    asked.remove(&old);
                }
            }
            if kind.is_some_and(|k| k != env.kind) {
                continue;
            }
            let line = Line::of(msg.subject(), &env);
            {
                let mut lines = reader
                    .lines
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if lines.len() >= BUFFER {
                    lines.pop_front();
                    reader.dropped.fetch_add(1, Ordering::Relaxed);
                    console.tap.dropped.fetch_add(1, Ordering::Relaxed);
                }
                lines.push_back(line);
            }
            reader.ready.notify_one();
        }
    });
    let stream = futures::stream::unfold((buffer, guard), |(buffer, guard)| async move {
        loop {
            let next = buffer
                .lines
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .pop_front();
            if let Some(mut line) = next {
                line.dropped = buffer.dropped.load(Ordering::Relaxed);
                let event = Event::default().json_data(&line).unwrap_or_default();
                return Some((Ok::<_, Infallible>(event), (buffer, guard)));
            }
            buffer.ready.notified().await;
        }
    });
    let stop = c.stop.clone();
    Sse::new(stream.take_until(async move { stop.cancelled().await }))
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_filters_parse_or_name_the_one_that_does_not() {
        assert_eq!(
            Filter::parse(None),
            Ok(Filter {
                pattern: ">".into(),
                kind: None
            })
        );
        let f = Filter::parse(Some("pattern=agent.calc.%3E&kind=request")).expect("valid");
        assert_eq!(
            (f.pattern.as_str(), f.kind),
            ("agent.calc.>", Some(Kind::Request))
        );
        assert!(
            Filter::parse(Some("pattern=a..b"))
                .expect_err("bad")
                .starts_with("pattern:")
        );
        assert!(
            Filter::parse(Some("kind=gossip"))
                .expect_err("bad")
                .starts_with("kind:")
        );
    }
}
