//! `/agents`: every live agent from the registry (capabilities, load, slots, wire versions,
//! last heartbeat, open circuits, metrics link); `/agents/{id}`: its manifest and the refusals
//! it answered recently, by code (seen by the console in the replies crossing the bus).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use chorus_sdk::envelope::now_ms;
use chorus_sdk::registry::{AgentRecord, DiscoverQuery, MetricsTarget};
use futures::StreamExt;

use super::html::{self, esc, url_part};
use super::{Console, Wants};
use crate::scopes::Route;

/// Refusals remembered (the oldest forgotten first).
const MAX_REFUSALS: usize = 2_000;

/// One refusal seen: who refused, with which code, when and why.
#[derive(Debug, Clone)]
struct Refusal {
    agent: String,
    status: u16,
    label: &'static str,
    at_ms: u64,
    reason: String,
}

/// The refusals the console saw in replies, newest last.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    seen: Mutex<VecDeque<Refusal>>,
}

impl Refusals {
    fn push(&self, r: Refusal) {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.len() >= MAX_REFUSALS {
            seen.pop_front();
        }
        seen.push_back(r);
    }

    fn of(&self, agent: &str) -> Vec<Refusal> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|r| r.agent == agent)
            .cloned()
            .collect()
    }
}

/// Reads every reply on the bus (`_INBOX.>`) until the console stops, remembering those that
/// refuse (a status that is not a success).
pub(crate) async fn watch_refusals(c: Arc<Console>) {
    let broker = c.agent.broker().clone();
    let mut replies = match broker.subscribe("_INBOX.>").await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "console: replies not watched; agents' refusals not shown");
            return;
        }
    };
    let subjects = c.agent.subjects().clone();
    loop {
        let msg = tokio::select! {
            () = c.stop.cancelled() => return,
            m = replies.next() => m,
        };
        let Some(msg) = msg else { return };
        let implied = subjects.implied(msg.subject());
        let Ok((env, _)) = chorus_sdk::codec::decode_on(msg.payload(), &implied) else {
            continue;
        };
        if let Some(status) = env.status.filter(|s| !s.is_success()) {
            c.refusals.push(Refusal {
                agent: env.from.to_string(),
                status: status.0,
                label: status.label(),
                at_ms: env.timestamp_ms,
                reason: env.reason.clone().unwrap_or_default(),
            });
        }
    }
}

/// The live agents, by id and instance.
async fn live(c: &Console) -> Result<Vec<AgentRecord>, chorus_sdk::SdkError> {
    let mut records = c.agent.discover(&DiscoverQuery::default()).await?;
    records.sort_by(|a, b| {
        (&a.manifest.agent, &a.manifest.instance).cmp(&(&b.manifest.agent, &b.manifest.instance))
    });
    Ok(records)
}

fn list_or_dash(items: &[String]) -> String {
    if items.is_empty() {
        "–".into()
    } else {
        esc(&items.join(", "))
    }
}

/// The metrics link of a manifest, if it names an http(s) address.
fn metrics_link(url: Option<&str>) -> String {
    match url.filter(|u| MetricsTarget::parse(u).is_some()) {
        Some(u) => format!(r#"<a href="{}" rel="noopener">metrics</a>"#, esc(u)),
        None => "–".into(),
    }
}

/// `GET /agents`.
pub(crate) async fn list(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Response {
    let who = match c.who(&headers, &uri.to_string(), Route::Console, Wants::Page) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let records = match live(&c).await {
        Ok(r) => r,
        Err(e) => return c.bus_down(&who, "discovery", &e),
    };
    let now = now_ms();
    let mut rows = String::new();
    for r in &records {
        let m = &r.manifest;
        let capabilities: Vec<String> = m
            .capabilities
            .iter()
            .map(|c| {
                if c.version.is_empty() {
                    c.name.clone()
                } else {
                    format!("{} {}", c.name, c.version)
                }
            })
            .collect();
        let wire: Vec<String> = if m.wire_versions.is_empty() {
            vec!["1".into()]
        } else {
            m.wire_versions.iter().map(u16::to_string).collect()
        };
        rows.push_str(&format!(
            r#"<tr data-agent="{id}"><td><a href="/agents/{link}">{id}</a></td><td>{caps}</td><td>{load:.2}</td><td>{slots}</td><td>{avail}</td><td>{wire}</td><td title="{seen}">{ago} ago</td><td>{circuits}</td><td>{metrics}</td></tr>"#,
            id = esc(&m.agent),
            link = esc(&url_part(&m.agent)),
            caps = list_or_dash(&capabilities),
            load = if m.load.is_finite() { m.load } else { 0.0 },
            slots = m.slots.map_or_else(|| "–".to_owned(), |s| s.to_string()),
            avail = esc(&format!("{:?}", m.availability).to_lowercase()),
            wire = esc(&wire.join(", ")),
            seen = esc(&html::utc(r.last_seen_ms)),
            ago = esc(&html::age(now, r.last_seen_ms)),
            circuits = list_or_dash(&m.open_circuits),
            metrics = metrics_link(m.metrics_url.as_deref()),
        ));
    }
    let body = format!(
        r#"<p>{n} live agent(s).</p><table id="agents"><thead><tr><th>agent</th><th>capabilities</th><th>load</th><th>slots</th><th>availability</th><th>wire</th><th>last heartbeat</th><th>open circuits</th><th>metrics</th></tr></thead><tbody>{rows}</tbody></table>"#,
        n = records.len()
    );
    html::html(
        StatusCode::OK,
        html::layout("Agents", Some(&who.chrome()), &body),
    )
}

/// `GET /agents/{id}`: 404 when no live agent has that id (it left, or never was).
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
    let records = match live(&c).await {
        Ok(r) => r,
        Err(e) => return c.bus_down(&who, "discovery", &e),
    };
    let mine: Vec<&AgentRecord> = records.iter().filter(|r| r.manifest.agent == id).collect();
    if mine.is_empty() {
        return html::error(
            StatusCode::NOT_FOUND,
            Some(&who.chrome()),
            &format!("no live agent {id}: it may have left (see the agents list)"),
        );
    }
    let now = now_ms();
    let mut body = String::new();
    for r in &mine {
        body.push_str(&format!(
            r#"<p>Instance <code>{}</code>, last heartbeat {} ago. {}</p>"#,
            esc(&r.manifest.instance),
            esc(&html::age(now, r.last_seen_ms)),
            metrics_link(r.manifest.metrics_url.as_deref())
        ));
        let manifest = serde_json::to_value(&r.manifest).unwrap_or_default();
        body.push_str(&html::json_pre("manifest", &manifest));
    }
    let refusals = c.refusals.of(&id);
    let mut by_code: BTreeMap<(u16, &str), usize> = BTreeMap::new();
    for r in &refusals {
        *by_code.entry((r.status, r.label)).or_default() += 1;
    }
    let mut rows = String::new();
    for ((code, label), n) in &by_code {
        let last = refusals
            .iter()
            .rev()
            .find(|r| r.status == *code)
            .map(|r| format!("{} ago: {}", html::age(now, r.at_ms), r.reason))
            .unwrap_or_default();
        rows.push_str(&format!(
            r#"<tr data-code="{code}"><td>{code}</td><td>{}</td><td>{n}</td><td>{}</td></tr>"#,
            esc(label),
            esc(&last)
        ));
    }
    body.push_str(&format!(
        r#"<h2>Recent refusals by code</h2><p class="hint">Replies from this agent that refused, as the console saw them since it started.</p><table id="refusals"><thead><tr><th>code</th><th>label</th><th>count</th><th>last</th></tr></thead><tbody>{rows}</tbody></table>"#
    ));
    html::html(
        StatusCode::OK,
        html::layout(&format!("Agent {id}"), Some(&who.chrome()), &body),
    )
}
