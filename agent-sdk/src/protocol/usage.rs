//! Usage: what each agent handled, per endpoint, customer and session (PROTOCOL.md section 7.13).
//!
//! Every agent counts, in its inbound pipeline, each message it handles (requests, commands,
//! events, tasks), whether its handler succeeded, and the payload bytes in and out, under the
//! message's `customer_id` and `session_id`. Every few seconds it publishes what it counted
//! since the last report as one [`UsageReport`] to the usage stream (`<ROOT>_USAGE`, subject
//! `<root>.usage.<agent>`), with `Nats-Msg-Id` `<instance>-<seq>` so a report sent twice is kept
//! once. The stream outlives every process: a summary ([`summarize`]) is a fold over the reports
//! of a time window, the same after any restart.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The coordinator's command that answers a [`UsageQuery`] with a [`UsageSummary`].
pub const USAGE_COMMAND: &str = "usage";
/// Suffix of the usage stream's name (`CHORUS_USAGE`).
pub const USAGE_STREAM: &str = "USAGE";
/// How long usage reports are kept.
pub const USAGE_MAX_AGE: Duration = Duration::from_secs(90 * 24 * 3600);
/// The window in which a report published twice (a retried publish) is kept once.
pub const USAGE_DEDUPE_WINDOW: Duration = Duration::from_secs(10 * 60);
/// Rows an agent keeps between reports at most: beyond, what new keys count is folded into one
/// row whose customer and session are [`OVERFLOW`], so nothing is lost and memory stays bounded.
pub const MAX_USAGE_ROWS: usize = 10_000;
/// The customer and session of the overflow row.
pub const OVERFLOW: &str = "(overflow)";
/// Reports a summary reads at most.
pub const MAX_USAGE_REPORTS: usize = 1_000_000;

/// What a counted message was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UsageKind {
    /// A request (a reply was expected).
    Request,
    /// A command (no reply).
    Command,
    /// An event.
    Event,
    /// A task submitted to the agent.
    Task,
}

impl UsageKind {
    /// Its name on the wire and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            UsageKind::Request => "request",
            UsageKind::Command => "command",
            UsageKind::Event => "event",
            UsageKind::Task => "task",
        }
    }
}

/// One row of a report: what one agent handled of one kind at one endpoint (a command,
/// capability or topic) for one customer and session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageRow {
    /// The command, capability or event topic.
    pub endpoint: String,
    /// What the messages were.
    pub kind: UsageKind,
    /// The messages' `customer_id` (empty: none).
    #[serde(default)]
    pub customer: String,
    /// The messages' `session_id` (empty: none).
    #[serde(default)]
    pub session: String,
    /// Messages handled, successfully or not.
    pub handled: u64,
    /// Of those, the ones whose handler failed or that were refused before it.
    #[serde(default)]
    pub failed: u64,
    /// Payload bytes received.
    #[serde(default)]
    pub bytes_in: u64,
    /// Reply payload bytes sent.
    #[serde(default)]
    pub bytes_out: u64,
    /// Time spent handling them, in µs (Agentify's `duration`): each handler's run, a task's
    /// from its acceptance to its end.
    #[serde(default)]
    pub handling_us: u64,
}

/// What one agent counted between two reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageReport {
    /// The agent.
    pub agent: String,
    /// Its run (changes when it restarts).
    pub instance: String,
    /// The report's number in this run, from 1.
    pub seq: u64,
    /// Start and end of what it counts, ms since the epoch.
    pub from_ms: u64,
    /// End of what it counts.
    pub to_ms: u64,
    /// The rows.
    pub rows: Vec<UsageRow>,
}

impl UsageReport {
    /// The report's `Nats-Msg-Id`: one per agent run and number.
    pub fn message_id(&self) -> String {
        format!("{}-{}-{}", self.agent, self.instance, self.seq)
    }
}

/// What a summary groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UsageBy {
    /// The customer.
    Customer,
    /// The session.
    Session,
    /// The agent.
    Agent,
    /// The endpoint (command, capability or topic).
    Endpoint,
    /// The kind of message.
    Kind,
}

impl UsageBy {
    /// Every dimension, by name.
    pub const ALL: [(&'static str, UsageBy); 5] = [
        ("customer", UsageBy::Customer),
        ("session", UsageBy::Session),
        ("agent", UsageBy::Agent),
        ("endpoint", UsageBy::Endpoint),
        ("kind", UsageBy::Kind),
    ];

    /// The dimension named `name`.
    pub fn parse(name: &str) -> Option<UsageBy> {
        UsageBy::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, by)| *by)
    }

    /// Its name.
    pub fn as_str(self) -> &'static str {
        UsageBy::ALL
            .iter()
            .find(|(_, by)| *by == self)
            .map_or("?", |(n, _)| n)
    }
}

/// A query of usage: grouped by `by`, over the reports stored from `since_ms` to `until_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageQuery {
    /// The dimensions to group by (none: one total).
    #[serde(default)]
    pub by: Vec<UsageBy>,
    /// Reports stored from this time, ms since the epoch.
    pub since_ms: u64,
    /// Reports stored up to this time (none: now).
    #[serde(default)]
    pub until_ms: Option<u64>,
    /// Only this customer.
    #[serde(default)]
    pub customer: Option<String>,
}

/// One line of a summary: the group's values (by dimension name) and its totals.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageLine {
    /// The group: dimension name to value.
    pub group: BTreeMap<String, String>,
    /// Messages handled.
    pub handled: u64,
    /// Of those, failed.
    pub failed: u64,
    /// Payload bytes received.
    pub bytes_in: u64,
    /// Reply payload bytes sent.
    pub bytes_out: u64,
    /// Time spent handling them, in µs.
    #[serde(default)]
    pub handling_us: u64,
}

/// A summary: its lines, busiest first, and how many reports it read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageSummary {
    /// The lines.
    pub lines: Vec<UsageLine>,
    /// Reports read.
    pub reports: u64,
}

/// Folds `reports` into lines grouped by `query.by`, keeping only `query.customer`'s rows when
/// it names one; busiest first, then by group.
pub fn summarize<'a>(
    reports: impl IntoIterator<Item = &'a UsageReport>,
    query: &UsageQuery,
) -> UsageSummary {
    let mut groups: BTreeMap<Vec<String>, UsageLine> = BTreeMap::new();
    let mut count = 0u64;
    for report in reports {
        count += 1;
        for row in &report.rows {
            if query.customer.as_ref().is_some_and(|c| *c != row.customer) {
                continue;
            }
            let key: Vec<String> = query
                .by
                .iter()
                .map(|by| match by {
                    UsageBy::Customer => row.customer.clone(),
                    UsageBy::Session => row.session.clone(),
                    UsageBy::Agent => report.agent.clone(),
                    UsageBy::Endpoint => row.endpoint.clone(),
                    UsageBy::Kind => row.kind.as_str().to_owned(),
                })
                .collect();
            let line = groups.entry(key.clone()).or_insert_with(|| UsageLine {
                group: query
                    .by
                    .iter()
                    .zip(key)
                    .map(|(by, value)| (by.as_str().to_owned(), value))
                    .collect(),
                handled: 0,
                failed: 0,
                bytes_in: 0,
                bytes_out: 0,
                handling_us: 0,
            });
            line.handled += row.handled;
            line.failed += row.failed;
            line.bytes_in += row.bytes_in;
            line.bytes_out += row.bytes_out;
            line.handling_us = line.handling_us.saturating_add(row.handling_us);
        }
    }
    let mut lines: Vec<UsageLine> = groups.into_values().collect();
    lines.sort_by(|a, b| {
        b.handled
            .cmp(&a.handled)
            .then_with(|| a.group.cmp(&b.group))
    });
    UsageSummary {
        lines,
        reports: count,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(endpoint: &str, customer: &str, session: &str, handled: u64) -> UsageRow {
        UsageRow {
            endpoint: endpoint.into(),
            kind: UsageKind::Request,
            customer: customer.into(),
            session: session.into(),
            handled,
            failed: 1,
            bytes_in: 10 * handled,
            bytes_out: 20 * handled,
            handling_us: 100 * handled,
        }
    }

    fn report(agent: &str, seq: u64, rows: Vec<UsageRow>) -> UsageReport {
        UsageReport {
            agent: agent.into(),
            instance: "i".into(),
            seq,
            from_ms: 0,
            to_ms: 1,
            rows,
        }
    }

    #[test]
    fn a_summary_adds_every_report_by_the_dimensions_asked() {
        let reports = [
            report(
                "a",
                1,
                vec![row("add", "acme", "s1", 3), row("add", "globex", "s2", 1)],
            ),
            report("b", 1, vec![row("add", "acme", "s3", 2)]),
            report("a", 2, vec![row("mul", "acme", "s1", 4)]),
        ];
        let by_customer = summarize(
            &reports,
            &UsageQuery {
                by: vec![UsageBy::Customer],
                since_ms: 0,
                until_ms: None,
                customer: None,
            },
        );
        assert_eq!(by_customer.reports, 3);
        assert_eq!(by_customer.lines.len(), 2);
        let acme = &by_customer.lines[0];
        assert_eq!(acme.group["customer"], "acme");
        assert_eq!(
            (acme.handled, acme.failed, acme.bytes_in, acme.bytes_out),
            (9, 3, 90, 180)
        );
        let by_session = summarize(
            &reports,
            &UsageQuery {
                by: vec![UsageBy::Customer, UsageBy::Session],
                since_ms: 0,
                until_ms: None,
                customer: Some("acme".into()),
            },
        );
        let sessions: Vec<(&str, u64)> = by_session
            .lines
            .iter()
            .map(|l| (l.group["session"].as_str(), l.handled))
            .collect();
        assert_eq!(sessions, [("s1", 7), ("s3", 2)]);
        let total = summarize(
            &reports,
            &UsageQuery {
                by: vec![],
                since_ms: 0,
                until_ms: None,
                customer: None,
            },
        );
        assert_eq!(total.lines.len(), 1);
        assert_eq!(total.lines[0].handled, 10);
    }

    #[test]
    fn dimensions_parse_by_name_and_reports_have_one_id_per_run_and_number() {
        for (name, by) in UsageBy::ALL {
            assert_eq!(UsageBy::parse(name), Some(by));
            assert_eq!(by.as_str(), name);
        }
        assert_eq!(UsageBy::parse("colour"), None);
        assert_eq!(report("a", 7, vec![]).message_id(), "a-i-7");
    }
}
