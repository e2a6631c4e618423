//! Usage counting (PROTOCOL.md section 7.13): the inbound pipeline [`Usage::record`]s every
//! message it handled under the message's endpoint, kind, customer and session; the agent's
//! reporter [`Usage::report`]s what was counted since the last report to the usage stream
//! every [`AgentOptions::usage_interval`](crate::AgentOptions::usage_interval), and once more
//! at shutdown. A report that cannot be stored (no stream yet, the server away) is kept and
//! merged into the next one: nothing is lost while the process lives, and memory stays bounded
//! ([`MAX_USAGE_ROWS`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::StreamSpec;

use crate::protocol::envelope::{Envelope, now_ms};
pub use crate::protocol::usage::*;
use crate::subject::Subjects;
use crate::sync::lock;

/// How often an agent reports its usage unless told otherwise.
pub const DEFAULT_USAGE_INTERVAL: Duration = Duration::from_secs(5);

/// The usage stream, as the coordinator makes it: every agent's reports, kept
/// [`USAGE_MAX_AGE`], a report published twice kept once.
pub fn usage_stream(subjects: &Subjects, replicas: usize) -> StreamSpec {
    let mut spec = StreamSpec::new(
        subjects.stream_name(USAGE_STREAM),
        vec![subjects.usage_all()],
    );
    spec.max_age = USAGE_MAX_AGE;
    spec.duplicate_window = USAGE_DEDUPE_WINDOW;
    spec.replicas = replicas;
    spec.description = "Chorus usage: what each agent handled, per customer and session".into();
    spec
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    endpoint: String,
    kind: UsageKind,
    customer: String,
    session: String,
}

#[derive(Debug, Clone, Copy, Default)]
struct Count {
    handled: u64,
    failed: u64,
    bytes_in: u64,
    bytes_out: u64,
    handling_us: u64,
}

impl Count {
    fn add(&mut self, other: Count) {
        self.handled += other.handled;
        self.failed += other.failed;
        self.bytes_in += other.bytes_in;
        self.bytes_out += other.bytes_out;
        self.handling_us = self.handling_us.saturating_add(other.handling_us);
    }
}

/// How one counted message went.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Handled {
    /// Its handler failed, or it was refused before it.
    pub(crate) failed: bool,
    /// The reply's payload size.
    pub(crate) bytes_out: usize,
    /// How long handling it took.
    pub(crate) took: Duration,
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// What one agent counted since its last report.
pub(crate) struct Usage {
    /// Off when the agent reports no usage (`usage_interval` zero): nothing is counted.
    enabled: bool,
    agent: String,
    instance: String,
    rows: Mutex<(u64, HashMap<Key, Count>)>,
    seq: AtomicU64,
}

impl Usage {
    pub(crate) fn new(agent: &str, instance: &str, enabled: bool) -> Usage {
        Usage {
            enabled,
            agent: agent.to_owned(),
            instance: instance.to_owned(),
            rows: Mutex::new((now_ms(), HashMap::new())),
            seq: AtomicU64::new(0),
        }
    }

    /// Whether it counts (a report interval was set).
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Counts one handled message: `endpoint` (a command, capability or topic), its kind,
    /// whether it `failed`, the reply's payload size and how long it took.
    pub(crate) fn record(&self, env: &Envelope, endpoint: &str, kind: UsageKind, outcome: Handled) {
        if !self.enabled {
            return;
        }
        let count = Count {
            handled: 1,
            failed: u64::from(outcome.failed),
            bytes_in: env.payload.len() as u64,
            bytes_out: outcome.bytes_out as u64,
            handling_us: micros(outcome.took),
        };
        Self::merge(
            &mut lock(&self.rows).1,
            Self::key(env, endpoint, kind),
            count,
        );
    }

    /// Adds the time a task of `endpoint`, submitted as `env`, ran (counted as handled when
    /// it was accepted).
    pub(crate) fn record_run(&self, env: &Envelope, endpoint: &str, took: Duration) {
        if !self.enabled {
            return;
        }
        let count = Count {
            handling_us: micros(took),
            ..Count::default()
        };
        let key = Self::key(env, endpoint, UsageKind::Task);
        Self::merge(&mut lock(&self.rows).1, key, count);
    }

    fn key(env: &Envelope, endpoint: &str, kind: UsageKind) -> Key {
        Key {
            endpoint: endpoint.to_owned(),
            kind,
            customer: env.customer_id.clone().unwrap_or_default(),
            session: env.session_id.clone().unwrap_or_default(),
        }
    }

    fn merge(rows: &mut HashMap<Key, Count>, key: Key, count: Count) {
        if rows.len() >= MAX_USAGE_ROWS && !rows.contains_key(&key) {
            let overflow = Key {
                endpoint: key.endpoint,
                kind: key.kind,
                customer: OVERFLOW.to_owned(),
                session: OVERFLOW.to_owned(),
            };
            rows.entry(overflow).or_default().add(count);
        } else {
            rows.entry(key).or_default().add(count);
        }
    }

    /// Takes what was counted since the last report, as the next report; `None` when nothing was.
    fn take(&self) -> Option<UsageReport> {
        let (from_ms, rows) = {
            let mut guard = lock(&self.rows);
            if guard.1.is_empty() {
                return None;
            }
            let now = now_ms();
            let from = std::mem::replace(&mut guard.0, now);
            (from, std::mem::take(&mut guard.1))
        };
        let mut rows: Vec<UsageRow> = rows
            .into_iter()
            .map(|(k, c)| UsageRow {
                endpoint: k.endpoint,
                kind: k.kind,
                customer: k.customer,
                session: k.session,
                handled: c.handled,
                failed: c.failed,
                bytes_in: c.bytes_in,
                bytes_out: c.bytes_out,
                handling_us: c.handling_us,
            })
            .collect();
        rows.sort_by(|a, b| {
            (&a.endpoint, &a.customer, &a.session).cmp(&(&b.endpoint, &b.customer, &b.session))
        });
        Some(UsageReport {
            agent: self.agent.clone(),
            instance: self.instance.clone(),
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
            from_ms,
            to_ms: now_ms(),
            rows,
        })
    }

    /// Puts back a report that could not be stored, to go with the next one.
    fn put_back(&self, report: UsageReport) {
        let mut guard = lock(&self.rows);
        guard.0 = guard.0.min(report.from_ms);
        for row in report.rows {
            let key = Key {
                endpoint: row.endpoint,
                kind: row.kind,
                customer: row.customer,
                session: row.session,
            };
            let count = Count {
                handled: row.handled,
                failed: row.failed,
                bytes_in: row.bytes_in,
                bytes_out: row.bytes_out,
                handling_us: row.handling_us,
            };
            Self::merge(&mut guard.1, key, count);
        }
    }

    /// Stores what was counted since the last report in the usage stream; what cannot be
    /// stored is kept for the next report. Returns whether nothing is left to report.
    pub(crate) async fn report(&self, link: &crate::link::Link) -> bool {
        let Some(report) = self.take() else {
            return true;
        };
        let stored = async {
            let subject = link.subjects.usage(&self.agent).ok()?;
            let body = Bytes::from(serde_json::to_vec(&report).ok()?);
            match link
                .js
                .publish(&subject, None, Some(&report.message_id()), None, body)
                .await
            {
                Ok(_) => Some(()),
                Err(err) => {
                    tracing::debug!(agent = %self.agent, error = %crate::Report(&err), "usage report kept for the next one");
                    None
                }
            }
        }
        .await;
        if stored.is_none() {
            self.put_back(report);
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::envelope::{Kind, Performative};

    fn message(customer: Option<&str>, session: Option<&str>, payload: &'static [u8]) -> Envelope {
        let mut env = Envelope::new(Kind::Request, Performative::Request, "caller");
        env.customer_id = customer.map(str::to_owned);
        env.session_id = session.map(str::to_owned);
        env.payload = Bytes::from_static(payload);
        env
    }

    #[test]
    fn messages_are_counted_by_endpoint_customer_and_session_and_taken_once() {
        let usage = Usage::new("calc", "run1", true);
        let acme = message(Some("acme"), Some("s1"), b"12345");
        usage.record(
            &acme,
            "add",
            UsageKind::Request,
            Handled {
                failed: false,
                bytes_out: 3,
                took: Duration::from_micros(250),
            },
        );
        usage.record(
            &acme,
            "add",
            UsageKind::Request,
            Handled {
                failed: true,
                bytes_out: 0,
                took: Duration::from_micros(250),
            },
        );
        usage.record(
            &message(None, None, b""),
            "add",
            UsageKind::Request,
            Handled {
                failed: false,
                bytes_out: 1,
                took: Duration::from_micros(250),
            },
        );
        let report = usage.take().expect("something counted");
        assert_eq!((report.agent.as_str(), report.seq), ("calc", 1));
        assert_eq!(report.rows.len(), 2);
        let row = report
            .rows
            .iter()
            .find(|r| r.customer == "acme")
            .expect("acme");
        assert_eq!(
            (
                row.session.as_str(),
                row.handled,
                row.failed,
                row.bytes_in,
                row.bytes_out
            ),
            ("s1", 2, 1, 10, 3)
        );
        assert!(usage.take().is_none(), "taken once");
    }

    #[test]
    fn a_report_put_back_goes_with_the_next_and_rows_stay_bounded() {
        let usage = Usage::new("calc", "run1", true);
        usage.record(
            &message(Some("acme"), None, b"x"),
            "add",
            UsageKind::Command,
            Handled {
                failed: false,
                bytes_out: 0,
                took: Duration::from_micros(250),
            },
        );
        let first = usage.take().expect("counted");
        usage.record(
            &message(Some("acme"), None, b"x"),
            "add",
            UsageKind::Command,
            Handled {
                failed: false,
                bytes_out: 0,
                took: Duration::from_micros(250),
            },
        );
        usage.put_back(first);
        let next = usage.take().expect("both");
        assert_eq!(next.rows.len(), 1);
        assert_eq!(next.rows[0].handled, 2);
        assert_eq!(next.seq, 2, "a new number: the first was never stored");

        for i in 0..MAX_USAGE_ROWS + 10 {
            let env = message(Some("acme"), Some(&format!("s{i}")), b"");
            usage.record(
                &env,
                "add",
                UsageKind::Event,
                Handled {
                    failed: false,
                    bytes_out: 0,
                    took: Duration::from_micros(250),
                },
            );
        }
        let report = usage.take().expect("counted");
        assert_eq!(report.rows.len(), MAX_USAGE_ROWS + 1);
        let overflow = report
            .rows
            .iter()
            .find(|r| r.session == OVERFLOW)
            .expect("overflow row");
        assert_eq!(overflow.handled, 10);
        assert_eq!(
            report.rows.iter().map(|r| r.handled).sum::<u64>(),
            (MAX_USAGE_ROWS + 10) as u64
        );
    }
}
