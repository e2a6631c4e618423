//! The report: per scenario, one row per delivery class with Jepsen-style counters, the
//! checks that decide its verdict, and the table `chorus chaos` prints.

use serde::Serialize;

/// One guarantee checked, and whether it held.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What was checked, with the figures it was checked on.
    pub name: String,
    /// Whether it held.
    pub passed: bool,
}

impl Check {
    pub(crate) fn new(passed: bool, name: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            passed,
        }
    }
}

/// The counters of one delivery class in one scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The scenario (its `--only` key).
    pub scenario: String,
    /// The delivery class: `at-least-once`, `exactly-once`, `poison` (commands no handler can
    /// take) or `stale` (signed beyond the receiver's clock tolerance).
    pub class: String,
    /// Sends attempted.
    pub sent: u64,
    /// Sends the server acknowledged (stored).
    pub acked: u64,
    /// Sends whose outcome is unknown: an error or a timeout, stored or not.
    pub unknown: u64,
    /// Distinct messages whose handler ran to completion.
    pub handled: u64,
    /// Handler runs beyond the first for a message (started runs, interrupted ones included).
    pub duplicated: u64,
    /// Acknowledged, and neither handled nor dead-lettered.
    pub lost: u64,
    /// Handled or dead-lettered, and never sent (or sent in another class).
    pub unexpected: u64,
    /// Distinct messages in the dead-letter queue.
    pub dead_lettered: u64,
    /// Exactly-once messages dead-lettered as `uncertain` (5023): a run was interrupted, so
    /// whether it took effect is for a person to decide. Not lost.
    pub uncertain: u64,
    /// From the end of each fault to the first message of this class handled after it, the
    /// longest; none if nothing was handled after a fault.
    pub recovered_ms: Option<u64>,
    /// The same, fault by fault, in order (none for a fault after which nothing of this class
    /// was handled).
    pub recovered_per_fault_ms: Vec<Option<u64>>,
    /// The longest recovery the scenario allows (checked against every fault); none where no
    /// fault ends or the scenario does not hold one.
    pub recovery_limit_ms: Option<u64>,
    /// Whether every check of this class and of its scenario held.
    pub ok: bool,
    /// This class's checks.
    pub checks: Vec<Check>,
}

/// One scenario's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    /// The scenario (its `--only` key).
    pub scenario: String,
    /// The fault, in a few words.
    pub fault: String,
    /// How long the scenario took, setup and settling included.
    pub seconds: f64,
    /// The server version it ran against (empty if it never got that far).
    pub nats_server: String,
    /// Checks of the whole scenario (settled, no connection reset, ...).
    pub checks: Vec<Check>,
    /// Facts worth reading beside the counters.
    pub notes: Vec<String>,
    /// One row per delivery class.
    pub rows: Vec<Row>,
}

impl ScenarioReport {
    /// Whether every check held, the rows' and the scenario's.
    pub fn ok(&self) -> bool {
        self.checks.iter().all(|c| c.passed) && self.rows.iter().all(|r| r.ok)
    }

    /// The checks that did not hold, the scenario's then the rows', each once.
    pub fn failures(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| c.name.clone())
            .collect();
        for row in &self.rows {
            out.extend(
                row.checks
                    .iter()
                    .filter(|c| !c.passed)
                    .map(|c| format!("{}: {}", row.class, c.name)),
            );
        }
        out
    }

    /// A report for a scenario that could not run at all.
    pub(crate) fn failed(scenario: &str, fault: &str, seconds: f64, error: String) -> Self {
        ScenarioReport {
            scenario: scenario.to_owned(),
            fault: fault.to_owned(),
            seconds,
            nats_server: String::new(),
            checks: vec![Check::new(false, format!("ran to the end: {error}"))],
            notes: Vec::new(),
            rows: Vec::new(),
        }
    }

    /// Folds the scenario's checks into each row's verdict.
    pub(crate) fn finish(mut self) -> Self {
        let scenario_ok = self.checks.iter().all(|c| c.passed);
        for row in &mut self.rows {
            row.ok = scenario_ok && row.checks.iter().all(|c| c.passed);
        }
        self
    }
}

/// The header of the counters' table.
pub(crate) fn header() -> String {
    format!(
        "{:<16} {:<13} {:>6} {:>6} {:>7} {:>7} {:>5} {:>4} {:>5} {:>5} {:>6} {:>8} {:>8}  {}\n",
        "scenario",
        "class",
        "sent",
        "acked",
        "unknown",
        "handled",
        "dup",
        "lost",
        "unexp",
        "dlq",
        "uncert",
        "recov_ms",
        "limit_ms",
        "ok"
    )
}

/// One row of the counters' table.
pub(crate) fn line(r: &Row) -> String {
    format!(
        "{:<16} {:<13} {:>6} {:>6} {:>7} {:>7} {:>5} {:>4} {:>5} {:>5} {:>6} {:>8} {:>8}  {}\n",
        r.scenario,
        r.class,
        r.sent,
        r.acked,
        r.unknown,
        r.handled,
        r.duplicated,
        r.lost,
        r.unexpected,
        r.dead_lettered,
        r.uncertain,
        r.recovered_ms.map_or("-".into(), |ms| ms.to_string()),
        r.recovery_limit_ms.map_or("-".into(), |ms| ms.to_string()),
        if r.ok { "yes" } else { "NO" }
    )
}

/// The reports as a table: one line per scenario and class, then each scenario's fault,
/// notes and failed checks.
pub fn table(reports: &[ScenarioReport]) -> String {
    let mut out = header();
    for report in reports {
        if report.rows.is_empty() {
            out.push_str(&format!(
                "{:<16} {:<13} {:>6} {:>6} {:>7} {:>7} {:>5} {:>4} {:>5} {:>5} {:>6} {:>8} {:>8}  NO\n",
                report.scenario, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"
            ));
        }
        for r in &report.rows {
            out.push_str(&line(r));
        }
    }
    out.push('\n');
    for report in reports {
        out.push_str(&format!(
            "{} ({:.1} s): {}\n",
            report.scenario, report.seconds, report.fault
        ));
        for note in &report.notes {
            out.push_str(&format!("  {note}\n"));
        }
        for r in report
            .rows
            .iter()
            .filter(|r| r.recovered_per_fault_ms.len() > 1)
        {
            let each: Vec<String> = r
                .recovered_per_fault_ms
                .iter()
                .map(|ms| ms.map_or("-".into(), |ms| ms.to_string()))
                .collect();
            out.push_str(&format!(
                "  {} recovered after each fault (ms): {}\n",
                r.class,
                each.join(", ")
            ));
        }
        for check in report.checks.iter().filter(|c| c.passed) {
            out.push_str(&format!("  ok: {}\n", check.name));
        }
        for failure in report.failures() {
            out.push_str(&format!("  FAILED: {failure}\n"));
        }
    }
    out
}
