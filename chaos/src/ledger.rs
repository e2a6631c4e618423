//! What was sent and what became of it: the senders' [`Ledger`], the handlers' [`Probe`], the
//! dead letters read back, and the count that turns them into a [`Row`] per class.
//!
//! Every message's payload is one `u64`, its id: the class in the top 16 bits and a sequence
//! number below, so a handler or a dead letter names its message and class without a lookup,
//! and anything else (a forgery, a corruption) shows as `unexpected`.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chorus_sdk::durable::DeadLetterReason;
use chorus_sdk::{DeliveryClass, StatusCode};

use crate::report::{Check, Row};

/// What kind of traffic a message is, and so what must become of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Class {
    /// At least once: handled at least once; duplicates allowed.
    AtLeastOnce,
    /// Exactly once: handled at most once; an interrupted run is dead-lettered `uncertain`.
    ExactlyOnce,
    /// A command no handler takes (refused, or failing until its attempts run out, or never
    /// answered): dead-lettered exactly once, never handled.
    Poison,
    /// Signed with a timestamp beyond the receiver's tolerance: refused with 5015 and
    /// dead-lettered, never handled.
    Stale,
}

const CLASS_SHIFT: u32 = 48;

impl Class {
    const ALL: [Class; 4] = [
        Class::AtLeastOnce,
        Class::ExactlyOnce,
        Class::Poison,
        Class::Stale,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Class::AtLeastOnce => "at-least-once",
            Class::ExactlyOnce => "exactly-once",
            Class::Poison => "poison",
            Class::Stale => "stale",
        }
    }

    /// The delivery class it is sent with.
    pub(crate) fn delivery(self) -> DeliveryClass {
        match self {
            Class::ExactlyOnce => DeliveryClass::ExactlyOnce,
            _ => DeliveryClass::AtLeastOnce,
        }
    }

    fn tag(self) -> u64 {
        match self {
            Class::AtLeastOnce => 1,
            Class::ExactlyOnce => 2,
            Class::Poison => 3,
            Class::Stale => 4,
        }
    }

    /// The class an id says it is of.
    pub(crate) fn of(id: u64) -> Option<Class> {
        Class::ALL
            .into_iter()
            .find(|c| c.tag() == id >> CLASS_SHIFT)
    }
}

/// The message id of sequence number `seq` (below 2^48) in `class`.
pub(crate) fn id_of(class: Class, seq: u64) -> u64 {
    (class.tag() << CLASS_SHIFT) | seq
}

/// What became of one send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Not answered yet (or never: the sender was stopped mid-send).
    Pending,
    /// The server stored it.
    Acked,
    /// An error or a timeout: stored or not, nobody knows.
    Unknown,
}

/// Every message the senders tried, by id.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    seq: AtomicU64,
    sent: Mutex<HashMap<u64, Fate>>,
    /// When each ack came back, in order: tells a sender stalled after a fault (waiting out a
    /// lost ack) from a worker that is not taking its deliveries.
    acked_at: Mutex<Vec<Instant>>,
}

impl Ledger {
    fn sent(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Fate>> {
        self.sent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new message id of `class`, recorded as sent.
    pub(crate) fn issue(&self, class: Class) -> u64 {
        let id = id_of(class, self.seq.fetch_add(1, Ordering::Relaxed));
        self.sent().insert(id, Fate::Pending);
        id
    }

    /// Records the outcome of sending `id`: stored, or unknown.
    pub(crate) fn record(&self, id: u64, acked: bool) {
        self.sent()
            .insert(id, if acked { Fate::Acked } else { Fate::Unknown });
        if acked {
            self.acked_at
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Instant::now());
        }
    }

    /// From `end` to the first ack after it, if one came.
    pub(crate) fn acked_again(&self, end: Instant) -> Option<Duration> {
        self.acked_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|at| **at >= end)
            .map(|at| at.duration_since(end))
    }

    /// Acknowledged sends so far.
    pub(crate) fn acked(&self) -> usize {
        self.sent().values().filter(|f| **f == Fate::Acked).count()
    }
}

/// What the handlers saw, by message id, across every instance of the worker.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    inner: Mutex<ProbeInner>,
}

#[derive(Debug, Default)]
struct ProbeInner {
    started: HashMap<u64, u32>,
    completed: HashMap<u64, u32>,
    /// When each completion happened, in order.
    completions: Vec<(Instant, u64)>,
}

impl Probe {
    fn inner(&self) -> std::sync::MutexGuard<'_, ProbeInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A handler run for `id` begins.
    pub(crate) fn start(&self, id: u64) {
        *self.inner().started.entry(id).or_default() += 1;
    }

    /// A handler run for `id` took effect.
    pub(crate) fn complete(&self, id: u64) {
        let mut inner = self.inner();
        *inner.completed.entry(id).or_default() += 1;
        inner.completions.push((Instant::now(), id));
    }

    /// Handler runs begun so far.
    pub(crate) fn runs(&self) -> usize {
        self.inner().started.values().map(|n| *n as usize).sum()
    }

    /// Distinct messages handled so far.
    pub(crate) fn handled(&self) -> usize {
        self.inner().completed.len()
    }
}

/// Exactly-once messages dead-lettered as `uncertain` though no handler run of them ever
/// began: the receiver could have known that it had not run them (a claim whose reply was
/// lost, for instance), so a person is asked about a message that simply was not handled.
pub(crate) fn uncertain_never_run(probe: &Probe, letters: &[Letter]) -> usize {
    let probe = probe.inner();
    letters
        .iter()
        .filter(|l| l.reason == DeadLetterReason::Uncertain)
        .filter_map(|l| l.id)
        .collect::<HashSet<u64>>()
        .into_iter()
        .filter(|id| !probe.started.contains_key(id))
        .count()
}

/// A dead letter, as far as the count needs it.
#[derive(Debug, Clone)]
pub(crate) struct Letter {
    /// The message id its payload decodes to, if it does.
    pub(crate) id: Option<u64>,
    pub(crate) reason: DeadLetterReason,
    pub(crate) status: StatusCode,
}

/// What a scenario holds its recovery to: the longest time from the end of a fault (as the
/// scenario defines it) to the first message of each class handled after it, and what that
/// end is, for the check's name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecoveryLimit {
    pub(crate) limit: Duration,
    pub(crate) from: &'static str,
}

/// The counters and checks of each class in `classes`; with `recovery`, every fault's
/// recovery is checked against its limit.
pub(crate) fn count(
    scenario: &str,
    classes: &[Class],
    ledger: &Ledger,
    probe: &Probe,
    letters: &[Letter],
    fault_ends: &[Instant],
    recovery: Option<RecoveryLimit>,
) -> Vec<Row> {
    let sent = ledger.sent().clone();
    let probe = probe.inner();
    let mut letters_by_id: HashMap<u64, Vec<&Letter>> = HashMap::new();
    for letter in letters {
        if let Some(id) = letter.id {
            letters_by_id.entry(id).or_default().push(letter);
        }
    }
    classes
        .iter()
        .map(|&class| {
            let of_class = |id: &u64| Class::of(*id) == Some(class);
            let ids: Vec<u64> = sent.keys().copied().filter(of_class).collect();
            let acked: HashSet<u64> = ids
                .iter()
                .copied()
                .filter(|id| sent.get(id) == Some(&Fate::Acked))
                .collect();
            let handled: HashSet<u64> = probe.completed.keys().copied().filter(of_class).collect();
            let duplicated: u64 = probe
                .started
                .iter()
                .filter(|(id, _)| of_class(id))
                .map(|(_, n)| u64::from(n.saturating_sub(1)))
                .sum();
            let dead: HashSet<u64> = letters_by_id.keys().copied().filter(of_class).collect();
            let dlq_entries: usize = letters_by_id
                .iter()
                .filter(|(id, _)| of_class(id))
                .map(|(_, l)| l.len())
                .sum();
            let uncertain = letters_by_id
                .iter()
                .filter(|(id, l)| {
                    of_class(id) && l.iter().any(|l| l.reason == DeadLetterReason::Uncertain)
                })
                .count() as u64;
            let lost = acked
                .iter()
                .filter(|id| !handled.contains(id) && !dead.contains(id))
                .count() as u64;
            let started_ids = probe.started.keys().copied().filter(of_class);
            let unexpected = handled
                .iter()
                .copied()
                .chain(dead.iter().copied())
                .chain(started_ids)
                .collect::<HashSet<u64>>()
                .into_iter()
                .filter(|id| !sent.contains_key(id))
                .count() as u64;
            let recovered_per_fault_ms: Vec<Option<u64>> = fault_ends
                .iter()
                .map(|end| {
                    probe
                        .completions
                        .iter()
                        .find(|(at, id)| at >= end && of_class(id))
                        .map(|(at, _)| at.duration_since(*end).as_millis() as u64)
                })
                .collect();
            let recovered_ms = recovered_per_fault_ms.iter().flatten().copied().max();
            let unknown = ids.len() as u64 - acked.len() as u64;
            let mut checks = vec![
                Check::new(lost == 0, format!("lost {lost} of {} acked", acked.len())),
                Check::new(unexpected == 0, format!("unexpected {unexpected}")),
                Check::new(!acked.is_empty(), format!("{} acked", acked.len())),
            ];
            // Only classes that are meant to be handled recover; poison and stale never are.
            let recovery_limit_ms = recovery
                .filter(|_| {
                    !fault_ends.is_empty()
                        && matches!(class, Class::AtLeastOnce | Class::ExactlyOnce)
                })
                .map(|r| r.limit.as_millis() as u64);
            if let (Some(r), Some(limit)) = (recovery, recovery_limit_ms) {
                checks.push(recovery_check(&recovered_per_fault_ms, limit, r.from));
            }
            match class {
                Class::AtLeastOnce => {}
                Class::ExactlyOnce => {
                    checks.push(Check::new(
                        duplicated == 0,
                        format!("handler duplicates {duplicated}"),
                    ));
                }
                Class::Poison | Class::Stale => {
                    checks.push(Check::new(
                        handled.is_empty(),
                        format!("handled {}", handled.len()),
                    ));
                    checks.push(Check::new(
                        dlq_entries == dead.len(),
                        format!(
                            "each dead-lettered once ({dlq_entries} entries for {} messages)",
                            dead.len()
                        ),
                    ));
                }
            }
            if class == Class::Stale {
                let refused = dead
                    .iter()
                    .filter(|id| {
                        letters_by_id
                            .get(id)
                            .is_some_and(|l| l.iter().all(|l| l.status == StatusCode::REPLAY))
                    })
                    .count();
                checks.push(Check::new(
                    refused == acked.len(),
                    format!(
                        "refused with 5015: {refused} of {} acked dead-lettered with that status",
                        acked.len()
                    ),
                ));
            }
            Row {
                scenario: scenario.to_owned(),
                class: class.name().to_owned(),
                sent: ids.len() as u64,
                acked: acked.len() as u64,
                unknown,
                handled: handled.len() as u64,
                duplicated,
                lost,
                unexpected,
                dead_lettered: dead.len() as u64,
                uncertain,
                recovered_ms,
                recovered_per_fault_ms,
                recovery_limit_ms,
                ok: false,
                checks,
            }
        })
        .collect()
}

/// Whether every fault was recovered from within `limit_ms`, counted from `from`: a fault
/// after which nothing was handled fails it too.
pub(crate) fn recovery_check(per_fault_ms: &[Option<u64>], limit_ms: u64, from: &str) -> Check {
    let missing = per_fault_ms.iter().filter(|ms| ms.is_none()).count();
    let longest = per_fault_ms.iter().flatten().copied().max();
    let passed = missing == 0 && longest.is_none_or(|ms| ms <= limit_ms);
    let name = if missing > 0 {
        format!(
            "handled again within {limit_ms} ms of {from} after every fault ({missing} of {} faults with nothing handled after)",
            per_fault_ms.len()
        )
    } else {
        format!(
            "handled again within {limit_ms} ms of {from} after every fault (longest {} ms)",
            longest.unwrap_or(0)
        )
    };
    Check::new(passed, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acked_message_neither_handled_nor_dead_lettered_is_lost() {
        let ledger = Ledger::default();
        let probe = Probe::default();
        let a = ledger.issue(Class::AtLeastOnce);
        let b = ledger.issue(Class::AtLeastOnce);
        let c = ledger.issue(Class::AtLeastOnce);
        let d = ledger.issue(Class::AtLeastOnce);
        ledger.record(a, true);
        ledger.record(b, true);
        ledger.record(c, true);
        ledger.record(d, false);
        probe.start(a);
        probe.complete(a);
        probe.start(a);
        probe.complete(a);
        let letters = [Letter {
            id: Some(b),
            reason: DeadLetterReason::Refused,
            status: StatusCode::DATA_FORMAT,
        }];
        let rows = count(
            "t",
            &[Class::AtLeastOnce],
            &ledger,
            &probe,
            &letters,
            &[],
            None,
        );
        let r = &rows[0];
        assert_eq!(
            (r.sent, r.acked, r.unknown, r.handled, r.duplicated, r.lost),
            (4, 3, 1, 1, 1, 1)
        );
        assert_eq!(r.dead_lettered, 1);
        assert!(
            r.checks
                .iter()
                .any(|c| !c.passed && c.name.starts_with("lost 1"))
        );
    }

    #[test]
    fn an_exactly_once_run_twice_fails_and_an_interrupted_one_dead_lettered_uncertain_passes() {
        let ledger = Ledger::default();
        let probe = Probe::default();
        let twice = ledger.issue(Class::ExactlyOnce);
        let interrupted = ledger.issue(Class::ExactlyOnce);
        for id in [twice, interrupted] {
            ledger.record(id, true);
        }
        probe.start(twice);
        probe.start(twice);
        probe.complete(twice);
        probe.start(interrupted);
        let letters = [Letter {
            id: Some(interrupted),
            reason: DeadLetterReason::Uncertain,
            status: StatusCode::UNCERTAIN,
        }];
        let rows = count(
            "t",
            &[Class::ExactlyOnce],
            &ledger,
            &probe,
            &letters,
            &[],
            None,
        );
        let r = &rows[0];
        assert_eq!((r.lost, r.duplicated, r.uncertain), (0, 1, 1));
        let failed: Vec<&str> = r
            .checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(failed, ["handler duplicates 1"]);
    }

    #[test]
    fn recovery_is_checked_fault_by_fault_against_the_limit() {
        let ledger = Ledger::default();
        let probe = Probe::default();
        let first_end = Instant::now();
        let id = ledger.issue(Class::AtLeastOnce);
        ledger.record(id, true);
        probe.start(id);
        probe.complete(id);
        let second_end = Instant::now() + Duration::from_secs(3600);
        let limit = RecoveryLimit {
            limit: Duration::from_secs(2),
            from: "the fault's end",
        };
        // Handled after the first fault; nothing after the second.
        let rows = count(
            "t",
            &[Class::AtLeastOnce],
            &ledger,
            &probe,
            &[],
            &[first_end, second_end],
            Some(limit),
        );
        let r = &rows[0];
        assert_eq!(r.recovered_per_fault_ms.len(), 2);
        assert!(r.recovered_per_fault_ms[0].is_some_and(|ms| ms < 2_000));
        assert_eq!(r.recovered_per_fault_ms[1], None);
        assert_eq!(r.recovery_limit_ms, Some(2_000));
        assert!(
            r.checks
                .iter()
                .any(|c| !c.passed && c.name.contains("1 of 2 faults"))
        );

        assert!(recovery_check(&[Some(1_999), Some(2_000)], 2_000, "x").passed);
        assert!(!recovery_check(&[Some(150), Some(2_001)], 2_000, "x").passed);
        // No fault, no limit: no check.
        let rows = count(
            "t",
            &[Class::AtLeastOnce],
            &ledger,
            &probe,
            &[],
            &[],
            Some(limit),
        );
        assert_eq!(rows[0].recovery_limit_ms, None);
        assert!(
            !rows[0]
                .checks
                .iter()
                .any(|c| c.name.contains("handled again"))
        );
        // Poison is never handled: no recovery to hold it to.
        let rows = count(
            "t",
            &[Class::Poison],
            &ledger,
            &probe,
            &[],
            &[first_end],
            Some(limit),
        );
        assert_eq!(rows[0].recovery_limit_ms, None);
    }

    #[test]
    fn a_message_never_sent_or_of_another_class_is_unexpected() {
        let ledger = Ledger::default();
        let probe = Probe::default();
        let id = ledger.issue(Class::AtLeastOnce);
        ledger.record(id, true);
        probe.start(id);
        probe.complete(id);
        probe.start(id + 1);
        probe.complete(id + 1);
        let rows = count("t", &[Class::AtLeastOnce], &ledger, &probe, &[], &[], None);
        assert_eq!((rows[0].handled, rows[0].unexpected), (2, 1));
        assert_eq!(Class::of(id), Some(Class::AtLeastOnce));
        assert_eq!(Class::of(7), None);
    }
}
