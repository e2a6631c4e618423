//! `/`: the overview: messages a second by kind, refusals by reason and by code, the
//! dead-letter queue's depth and tasks by state, each a small inline SVG chart drawn here.
//! The counters are this process's own (`chorus_sdk::metrics::registry()`: the agents of the
//! process, the coordinator's when it runs the gateway), sampled every [`EVERY`] into a ring
//! of [`KEEP`] samples: no Prometheus needed. Tasks by state come from the task index.
//! The page's script fetches `/overview` (the charts alone) again every few seconds.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::html::{self, esc};
use super::{Console, Wants};
use crate::scopes::Route;

/// How often the counters are sampled.
const EVERY: Duration = Duration::from_secs(2);
/// Samples kept (five minutes).
const KEEP: usize = 150;

/// One reading of the counters.
#[derive(Debug, Clone, Default)]
struct Sample {
    at_ms: u64,
    /// Messages handled so far, by kind.
    kinds: BTreeMap<String, f64>,
    /// Refusals so far, by reason (`chorus_agent_refusals_total`) and by status code of the
    /// answers that were not a success (`chorus_agent_messages_total`).
    refusals: BTreeMap<String, f64>,
    /// Dead letters in the queue (the coordinator's gauge; none without it).
    dlq: Option<f64>,
}

/// The ring of samples.
#[derive(Debug, Default)]
pub(crate) struct Samples {
    ring: Mutex<VecDeque<Sample>>,
}

impl Samples {
    fn push(&self, s: Sample) {
        let mut ring = self
            .ring
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if ring.len() >= KEEP {
            ring.pop_front();
        }
        ring.push_back(s);
    }

    fn all(&self) -> Vec<Sample> {
        self.ring
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }
}

fn label<'a>(m: &'a prometheus::proto::Metric, name: &str) -> &'a str {
    m.get_label()
        .iter()
        .find(|l| l.name() == name)
        .map_or("", |l| l.value())
}

/// Reads the counters once.
fn read() -> Sample {
    let mut s = Sample {
        at_ms: chorus_sdk::envelope::now_ms(),
        ..Sample::default()
    };
    for family in chorus_sdk::metrics::registry().gather() {
        let name = family.name();
        for m in family.get_metric() {
            match name {
                "chorus_agent_messages_total" => {
                    let value = m.get_counter().get_value();
                    *s.kinds.entry(label(m, "kind").to_owned()).or_default() += value;
                    let status = label(m, "status");
                    // The series' status is the code's label (`ok`, `invalid_argument`).
                    let ok = [
                        chorus_sdk::StatusCode::OK,
                        chorus_sdk::StatusCode::ACCEPTED,
                        chorus_sdk::StatusCode::CONNECTED,
                    ]
                    .iter()
                    .any(|c| c.label() == status);
                    if !ok && !status.is_empty() {
                        *s.refusals.entry(format!("code {status}")).or_default() += value;
                    }
                }
                "chorus_coordinator_messages_total" => {
                    *s.kinds.entry(label(m, "kind").to_owned()).or_default() +=
                        m.get_counter().get_value();
                }
                "chorus_agent_refusals_total" => {
                    *s.refusals.entry(label(m, "reason").to_owned()).or_default() +=
                        m.get_counter().get_value();
                }
                "chorus_dlq_messages" => {
                    *s.dlq.get_or_insert(0.0) += m.get_gauge().get_value();
                }
                _ => {}
            }
        }
    }
    s
}

/// Samples the counters every [`EVERY`] until the console stops.
pub(crate) async fn sample(c: Arc<Console>) {
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = c.stop.cancelled() => return,
            _ = tick.tick() => c.overview.push(read()),
        }
    }
}

/// Each kind's rate a second between consecutive samples.
fn rates(samples: &[Sample]) -> BTreeMap<String, Vec<f64>> {
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for pair in samples.windows(2) {
        let secs = (pair[1].at_ms.saturating_sub(pair[0].at_ms) as f64 / 1000.0).max(0.001);
        for (kind, now) in &pair[1].kinds {
            let before = pair[0].kinds.get(kind).copied().unwrap_or(0.0);
            out.entry(kind.clone())
                .or_default()
                .push(((now - before) / secs).max(0.0));
        }
    }
    out
}

/// A line chart of `values` (oldest first), 240×40, scaled to its own maximum.
fn sparkline(values: &[f64]) -> String {
    let max = values.iter().copied().fold(0.0_f64, f64::max);
    let scale = if max > 0.0 { 36.0 / max } else { 0.0 };
    let step = if values.len() > 1 {
        240.0 / (values.len() - 1) as f64
    } else {
        0.0
    };
    let points: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, v)| format!("{:.1},{:.1}", i as f64 * step, 38.0 - v * scale))
        .collect();
    format!(
        r#"<svg class="spark" viewBox="0 0 240 40" width="240" height="40" role="img"><polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{}"/></svg>"#,
        points.join(" ")
    )
}

/// A horizontal bar chart of `bars`.
fn bars(id: &str, bars: &[(String, f64)]) -> String {
    if bars.is_empty() {
        return format!(r#"<p id="{}" class="chart empty">none</p>"#, esc(id));
    }
    let max = bars
        .iter()
        .map(|(_, v)| *v)
        .fold(0.0_f64, f64::max)
        .max(1.0);
    let height = bars.len() * 18;
    let mut svg = format!(
        r#"<svg id="{}" class="chart" viewBox="0 0 360 {height}" width="360" height="{height}" role="img">"#,
        esc(id)
    );
    for (i, (name, value)) in bars.iter().enumerate() {
        let y = i * 18;
        let w = (value / max * 200.0).max(1.0);
        svg.push_str(&format!(
            r#"<text x="0" y="{ty}" class="label">{name}</text><rect x="120" y="{y}" width="{w:.1}" height="14"/><text x="{tx:.1}" y="{ty}" class="value">{value}</text>"#,
            ty = y + 12,
            name = esc(name),
            tx = 124.0 + w,
            value = value.round(),
        ));
    }
    svg.push_str("</svg>");
    svg
}

/// The charts, as the page shows them and `/overview` returns them.
async fn charts(c: &Console) -> String {
    let samples = c.overview.all();
    let mut kinds = String::new();
    for (kind, series) in rates(&samples) {
        let now = series.last().copied().unwrap_or(0.0);
        kinds.push_str(&format!(
            r#"<div class="series" data-kind="{k}"><span class="label">{k}</span> {} <span class="value">{now:.1}/s</span></div>"#,
            sparkline(&series),
            k = esc(&kind),
        ));
    }
    if kinds.is_empty() {
        kinds.push_str(r#"<p class="empty">no messages yet</p>"#);
    }
    let last = samples.last().cloned().unwrap_or_default();
    let refusals: Vec<(String, f64)> = last
        .refusals
        .into_iter()
        .filter(|(_, v)| *v > 0.0)
        .collect();
    let dlq_series: Vec<f64> = samples.iter().filter_map(|s| s.dlq).collect();
    let dlq = match last.dlq {
        Some(depth) => format!(
            r#"{} <span class="value" id="dlq-depth">{depth}</span>"#,
            sparkline(&dlq_series)
        ),
        None => {
            r#"<span class="empty">not counted in this process (the coordinator counts it)</span>"#
                .to_owned()
        }
    };
    let tasks = match c.gateway.a2a_index.all(&c.agent).await {
        Ok(all) => {
            let mut by: BTreeMap<&'static str, f64> = BTreeMap::new();
            for t in &all {
                *by.entry(t.state.as_str()).or_default() += 1.0;
            }
            bars(
                "chart-tasks",
                &by.into_iter()
                    .map(|(k, v)| (k.to_owned(), v))
                    .collect::<Vec<_>>(),
            )
        }
        Err(e) => {
            tracing::warn!(error = %e, "console: tasks not counted");
            r#"<p id="chart-tasks" class="chart empty">the bus did not answer</p>"#.to_owned()
        }
    };
    format!(
        r#"<section><h2>Messages a second by kind</h2><div id="chart-kinds" class="chart">{kinds}</div></section><section><h2>Refusals by reason and code</h2>{}</section><section><h2>Dead-letter queue depth</h2><div id="chart-dlq" class="chart">{dlq}</div></section><section><h2>Tasks by state</h2>{tasks}</section><p class="hint">Sampled every {}s from this process's counters; {} sample(s) kept.</p>"#,
        bars("chart-refusals", &refusals),
        EVERY.as_secs(),
        samples.len(),
    )
}

/// `GET /`.
pub(crate) async fn page(State(c): State<Arc<Console>>, headers: HeaderMap) -> Response {
    let who = match c.who(&headers, "/", Route::Console, Wants::Page) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let body = format!(
        r#"<div id="overview" data-refresh="/overview">{}</div>"#,
        charts(&c).await
    );
    html::html(
        StatusCode::OK,
        html::layout("Overview", Some(&who.chrome()), &body),
    )
}

/// `GET /overview`: the charts alone, for the page's script to swap in.
pub(crate) async fn fragment(State(c): State<Arc<Console>>, headers: HeaderMap) -> Response {
    if let Err(r) = c.who(&headers, "/", Route::Console, Wants::Feed) {
        return r;
    }
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        charts(&c).await,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_per_second_between_samples() {
        let at = |ms: u64, n: f64| Sample {
            at_ms: ms,
            kinds: [("request".to_owned(), n)].into_iter().collect(),
            ..Sample::default()
        };
        let r = rates(&[at(0, 0.0), at(2000, 10.0), at(4000, 10.0)]);
        assert_eq!(r["request"], vec![5.0, 0.0]);
        assert!(sparkline(&[0.0, 1.0]).starts_with("<svg"));
        assert!(bars("x", &[("<b>".into(), 1.0)]).contains("&lt;b&gt;"));
    }
}
