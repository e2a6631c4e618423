//! The report: one row per scenario, medians of the rounds, and the table `chorus bench`
//! prints.

use std::time::Duration;

use serde::Serialize;

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Scenario.
    pub scenario: String,
    /// Unit of `raw` and `chorus`.
    pub unit: String,
    /// Raw async-nats figure (median of the rounds), if the scenario has one.
    pub raw: Option<f64>,
    /// Chorus figure (median of the rounds).
    pub chorus: Option<f64>,
    /// `chorus / raw`.
    pub ratio: Option<f64>,
    /// The goal, as text.
    pub goal: String,
    /// Whether the goal is met, when the scenario has one.
    pub met: Option<bool>,
    /// Messages sent in all the Chorus rounds together (a loss in any round shows).
    pub sent: u64,
    /// Messages received in all the Chorus rounds together.
    pub received: u64,
    /// `sent - received`.
    pub lost: u64,
    /// Client CPU per message on the raw side, user and system, in microseconds (median).
    pub raw_cpu_us: Option<f64>,
    /// The same on the Chorus side.
    pub chorus_cpu_us: Option<f64>,
}

impl Row {
    /// A scenario with no raw counterpart.
    pub(crate) fn chorus_only(
        scenario: &str,
        unit: &str,
        value: f64,
        goal: &str,
        met: Option<bool>,
    ) -> Row {
        Row {
            scenario: scenario.to_owned(),
            unit: unit.to_owned(),
            raw: None,
            chorus: Some(value),
            ratio: None,
            goal: goal.to_owned(),
            met,
            sent: 0,
            received: 0,
            lost: 0,
            raw_cpu_us: None,
            chorus_cpu_us: None,
        }
    }

    /// Sets the message counts.
    pub(crate) fn counts(mut self, sent: u64, received: u64) -> Row {
        self.sent = sent;
        self.received = received;
        self.lost = sent.saturating_sub(received);
        self
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e6
}

pub(crate) struct Pair {
    pub(crate) raw: Vec<f64>,
    pub(crate) chorus: Vec<f64>,
    pub(crate) sent: u64,
    pub(crate) received: u64,
    /// Client CPU per message of each round, in microseconds.
    pub(crate) raw_cpu: Vec<f64>,
    pub(crate) chorus_cpu: Vec<f64>,
}

impl Pair {
    pub(crate) fn new() -> Self {
        Pair {
            raw: Vec::new(),
            chorus: Vec::new(),
            sent: 0,
            received: 0,
            raw_cpu: Vec::new(),
            chorus_cpu: Vec::new(),
        }
    }

    /// The medians of the recorded CPU per message: (raw, Chorus).
    pub(crate) fn cpu_medians(self) -> (Option<f64>, Option<f64>) {
        (median(self.raw_cpu), median(self.chorus_cpu))
    }

    /// Records the client CPU per message of a raw round.
    pub(crate) fn raw_cpu(&mut self, cpu: crate::measure::Usage, messages: u64) {
        self.raw_cpu.extend(cpu.per_message_us(messages));
    }

    /// Records the client CPU per message of a Chorus round.
    pub(crate) fn chorus_cpu(&mut self, cpu: crate::measure::Usage, messages: u64) {
        self.chorus_cpu.extend(cpu.per_message_us(messages));
    }

    pub(crate) fn row(
        self,
        scenario: &str,
        unit: &str,
        goal: &str,
        check: impl Fn(f64) -> bool,
    ) -> Row {
        let raw = median(self.raw);
        let chorus = median(self.chorus);
        let ratio = match (raw, chorus) {
            (Some(r), Some(c)) if r > 0.0 => Some(c / r),
            _ => None,
        };
        Row {
            scenario: scenario.to_owned(),
            unit: unit.to_owned(),
            raw,
            chorus,
            ratio,
            goal: goal.to_owned(),
            met: ratio.map(check),
            sent: self.sent,
            received: self.received,
            lost: self.sent.saturating_sub(self.received),
            raw_cpu_us: median(self.raw_cpu),
            chorus_cpu_us: median(self.chorus_cpu),
        }
    }
}

/// The report as a table.
pub fn table(rows: &[Row]) -> String {
    let fmt = |v: Option<f64>| match v {
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) => format!("{x:.2}"),
        None => "-".into(),
    };
    let mut out = format!(
        "{:<62} {:>6} {:>11} {:>11} {:>6} {:>7} {:>7}  {:<5} {:>8} {:>8} {:>5}  goal\n",
        "scenario",
        "unit",
        "raw",
        "chorus",
        "ratio",
        "raw us",
        "ch us",
        "met",
        "sent",
        "received",
        "lost"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<62} {:>6} {:>11} {:>11} {:>6} {:>7} {:>7}  {:<5} {:>8} {:>8} {:>5}  {}\n",
            r.scenario,
            r.unit,
            fmt(r.raw),
            fmt(r.chorus),
            r.ratio.map_or("-".into(), |x| format!("{x:.2}")),
            r.raw_cpu_us.map_or("-".into(), |x| format!("{x:.2}")),
            r.chorus_cpu_us.map_or("-".into(), |x| format!("{x:.2}")),
            r.met.map_or("-", |m| if m { "yes" } else { "NO" }),
            r.sent,
            r.received,
            r.lost,
            r.goal
        ));
    }
    out
}
