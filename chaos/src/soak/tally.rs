//! The soak's accounting, in memory that does not grow with the run: one byte per message,
//! in a buffer sized for the whole run and written through at the start, so that the tool's
//! own bookkeeping does not show as growth of the process it measures. (The fault scenarios'
//! [`Ledger`](crate::ledger::Ledger) keeps a map entry and a timestamp per message: fine for
//! seconds, a slope of its own over half an hour.)
//!
//! Message ids are the scenarios' (the class in the top bits, a sequence number below, see
//! [`Class`]); the sequence number indexes the buffer.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use chorus_sdk::durable::DeadLetterReason;

use crate::ledger::{Class, Letter, RecoveryLimit, recovery_check};
use crate::report::{Check, Row};

/// A byte never issued. Every byte of the buffer is set to it at the start (a write, so the
/// pages are resident from then on).
const UNUSED: u8 = 0x80;
const ISSUED: u8 = 1;
const ACKED: u8 = 2;
const STARTED: u8 = 4;
const COMPLETED: u8 = 8;
const DEAD: u8 = 16;
/// The message is exactly-once (else at-least-once).
const EXACT: u8 = 32;

/// The sequence number's bits in a message id.
const SEQ_MASK: u64 = (1 << 48) - 1;

/// One flag byte per sequence number, preallocated.
#[derive(Debug)]
pub(crate) struct Marks(Mutex<Vec<u8>>);

impl Marks {
    /// Room for `capacity` numbers, resident at once; more grow the buffer as a `Vec` does.
    pub(crate) fn new(capacity: usize) -> Marks {
        Marks(Mutex::new(vec![UNUSED; capacity]))
    }

    fn with<R>(&self, f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Applies `f` to number `n`'s byte (made `UNUSED` first if beyond the buffer).
    fn update<R>(&self, n: u64, f: impl FnOnce(&mut u8) -> R) -> R {
        let i = usize::try_from(n).unwrap_or(usize::MAX);
        self.with(|v| {
            if i >= v.len() {
                // Beyond the run's expected count (a faster rate than planned): grow, never
                // more than the number asks for.
                let want = i.saturating_add(1).min(isize::MAX as usize / 2);
                v.resize(want.max(v.len()), UNUSED);
            }
            match v.get_mut(i) {
                Some(b) => f(b),
                None => {
                    let mut scratch = UNUSED;
                    f(&mut scratch)
                }
            }
        })
    }

    fn get(&self, n: u64) -> u8 {
        let i = usize::try_from(n).unwrap_or(usize::MAX);
        self.with(|v| v.get(i).copied().unwrap_or(UNUSED))
    }
}

fn index(class: Class) -> usize {
    usize::from(class == Class::ExactlyOnce)
}

/// The durable commands: what was sent, acknowledged, run, completed and dead-lettered.
#[derive(Debug)]
pub(crate) struct Tally {
    marks: Marks,
    next: AtomicU64,
    /// Per class (at-least-once, exactly-once): handler runs beyond the first.
    duplicated: [AtomicU64; 2],
    /// Per class: handler runs or dead letters of messages never sent in that class.
    unexpected: [AtomicU64; 2],
    /// Per class: completions, every run counted (for progress and recovery).
    completions: [AtomicU64; 2],
    /// Handler runs of ids of no class of the soak.
    foreign: AtomicU64,
}

impl Tally {
    pub(crate) fn new(capacity: usize) -> Tally {
        Tally {
            marks: Marks::new(capacity),
            next: AtomicU64::new(0),
            duplicated: Default::default(),
            unexpected: Default::default(),
            completions: Default::default(),
            foreign: AtomicU64::new(0),
        }
    }

    /// A new message id of `class` (at-least-once or exactly-once), recorded as sent.
    pub(crate) fn issue(&self, class: Class) -> u64 {
        let seq = self.next.fetch_add(1, Ordering::Relaxed) & SEQ_MASK;
        let flags = ISSUED
            | if class == Class::ExactlyOnce {
                EXACT
            } else {
                0
            };
        self.marks.update(seq, |b| *b = flags);
        crate::ledger::id_of(class, seq)
    }

    /// Records the outcome of sending `id`: stored, or unknown.
    pub(crate) fn record(&self, id: u64, acked: bool) {
        if acked {
            self.marks.update(id & SEQ_MASK, |b| {
                if *b != UNUSED {
                    *b |= ACKED;
                }
            });
        }
    }

    /// The class `id` was issued in, if it was issued as the class it names.
    fn issued(&self, id: u64) -> Option<Class> {
        let class = Class::of(id).filter(|c| matches!(c, Class::AtLeastOnce | Class::ExactlyOnce));
        let Some(class) = class else {
            self.foreign.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let b = self.marks.get(id & SEQ_MASK);
        let exact = class == Class::ExactlyOnce;
        if b == UNUSED || (b & EXACT != 0) != exact {
            self.unexpected[index(class)].fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(class)
    }

    /// A handler run for `id` begins.
    pub(crate) fn start(&self, id: u64) {
        let Some(class) = self.issued(id) else {
            return;
        };
        let again = self.marks.update(id & SEQ_MASK, |b| {
            let again = *b & STARTED != 0;
            *b |= STARTED;
            again
        });
        if again {
            self.duplicated[index(class)].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A handler run for `id` took effect.
    pub(crate) fn complete(&self, id: u64) {
        let Some(class) = self.issued(id) else {
            return;
        };
        self.marks.update(id & SEQ_MASK, |b| *b |= COMPLETED);
        self.completions[index(class)].fetch_add(1, Ordering::Relaxed);
    }

    /// Handler runs completed so far in `class`, repeats included.
    pub(crate) fn completions(&self, class: Class) -> u64 {
        self.completions[index(class)].load(Ordering::Relaxed)
    }

    /// Sends so far (both classes).
    pub(crate) fn sent(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }

    /// Handler runs of ids that are no message of the soak's classes.
    pub(crate) fn foreign(&self) -> u64 {
        self.foreign.load(Ordering::Relaxed)
    }

    /// The counters and checks of both classes, once the dead letters are read; `recovered`
    /// is, per class, the time from the end of each fault to its first completion after (none
    /// for a fault after which nothing of the class was handled within the wait), each held to
    /// `limit` when there is one.
    pub(crate) fn rows(
        &self,
        letters: &[Letter],
        recovered: [Vec<Option<u64>>; 2],
        limit: Option<RecoveryLimit>,
    ) -> Vec<Row> {
        let mut uncertain: [HashSet<u64>; 2] = Default::default();
        for letter in letters {
            let Some(id) = letter.id else { continue };
            let Some(class) = self.issued(id) else {
                continue;
            };
            self.marks.update(id & SEQ_MASK, |b| *b |= DEAD);
            if letter.reason == DeadLetterReason::Uncertain {
                uncertain[index(class)].insert(id);
            }
        }
        #[derive(Default)]
        struct Count {
            sent: u64,
            acked: u64,
            handled: u64,
            dead: u64,
            lost: u64,
        }
        let mut counts: [Count; 2] = Default::default();
        let issued = self.sent();
        self.marks.with(|v| {
            for &b in v.iter().take(usize::try_from(issued).unwrap_or(usize::MAX)) {
                if b == UNUSED {
                    continue;
                }
                let c = &mut counts[usize::from(b & EXACT != 0)];
                c.sent += 1;
                let handled = b & COMPLETED != 0;
                let dead = b & DEAD != 0;
                c.handled += u64::from(handled);
                c.dead += u64::from(dead);
                if b & ACKED != 0 {
                    c.acked += 1;
                    c.lost += u64::from(!handled && !dead);
                }
            }
        });
        [Class::AtLeastOnce, Class::ExactlyOnce]
            .into_iter()
            .map(|class| {
                let i = index(class);
                let c = &counts[i];
                let duplicated = self.duplicated[i].load(Ordering::Relaxed);
                let unexpected = self.unexpected[i].load(Ordering::Relaxed);
                let mut checks = vec![
                    Check::new(c.lost == 0, format!("lost {} of {} acked", c.lost, c.acked)),
                    Check::new(unexpected == 0, format!("unexpected {unexpected}")),
                    Check::new(c.acked > 0, format!("{} acked", c.acked)),
                ];
                if class == Class::ExactlyOnce {
                    checks.push(Check::new(
                        duplicated == 0,
                        format!("handler duplicates {duplicated}"),
                    ));
                }
                let per_fault = recovered[i].clone();
                let recovery_limit_ms = limit
                    .filter(|_| !per_fault.is_empty())
                    .map(|l| l.limit.as_millis() as u64);
                if let (Some(l), Some(ms)) = (limit, recovery_limit_ms) {
                    checks.push(recovery_check(&per_fault, ms, l.from));
                }
                Row {
                    scenario: "soak".to_owned(),
                    class: class.name().to_owned(),
                    sent: c.sent,
                    acked: c.acked,
                    unknown: c.sent - c.acked,
                    handled: c.handled,
                    duplicated,
                    lost: c.lost,
                    unexpected,
                    dead_lettered: c.dead,
                    uncertain: uncertain[i].len() as u64,
                    recovered_ms: per_fault.iter().flatten().copied().max(),
                    recovered_per_fault_ms: per_fault,
                    recovery_limit_ms,
                    ok: checks.iter().all(|c| c.passed),
                    checks,
                }
            })
            .collect()
    }
}

/// Numbered events: how many were published, and which arrived.
#[derive(Debug)]
pub(crate) struct Seen {
    marks: Marks,
    next: AtomicU64,
    received: AtomicU64,
}

impl Seen {
    pub(crate) fn new(capacity: usize) -> Seen {
        Seen {
            marks: Marks::new(capacity),
            next: AtomicU64::new(0),
            received: AtomicU64::new(0),
        }
    }

    /// The number of the next event to publish.
    pub(crate) fn issue(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Event `n` arrived.
    pub(crate) fn mark(&self, n: u64) {
        let new = self.marks.update(n, |b| {
            let new = *b == UNUSED;
            *b = ISSUED;
            new
        });
        if new {
            self.received.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn contains(&self, n: u64) -> bool {
        self.marks.get(n) != UNUSED
    }

    /// Events published (attempted) so far.
    pub(crate) fn sent(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }

    /// Distinct events received so far.
    pub(crate) fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acked_command_neither_handled_nor_dead_lettered_is_lost_and_a_second_run_counted() {
        let tally = Tally::new(2);
        let a = tally.issue(Class::AtLeastOnce);
        let b = tally.issue(Class::ExactlyOnce);
        let c = tally.issue(Class::ExactlyOnce);
        // Beyond the preallocated room.
        let d = tally.issue(Class::AtLeastOnce);
        for id in [a, b, c, d] {
            tally.record(id, true);
        }
        tally.start(a);
        tally.complete(a);
        tally.start(a);
        tally.start(b);
        let letters = [Letter {
            id: Some(b),
            reason: DeadLetterReason::Uncertain,
            status: chorus_sdk::StatusCode::UNCERTAIN,
        }];
        // Run under the wrong class: unexpected.
        tally.start(crate::ledger::id_of(Class::AtLeastOnce, c & SEQ_MASK));
        let rows = tally.rows(&letters, [Vec::new(), Vec::new()], None);
        let (alo, eo) = (&rows[0], &rows[1]);
        assert_eq!(
            (
                alo.sent,
                alo.acked,
                alo.handled,
                alo.duplicated,
                alo.lost,
                alo.unexpected
            ),
            (2, 2, 1, 1, 1, 1)
        );
        assert_eq!(
            (
                eo.sent,
                eo.dead_lettered,
                eo.uncertain,
                eo.lost,
                eo.duplicated
            ),
            (2, 1, 1, 1, 0)
        );
        assert!(!alo.ok && !eo.ok);
    }

    #[test]
    fn events_are_counted_once_each() {
        let seen = Seen::new(1);
        for _ in 0..3 {
            seen.issue();
        }
        seen.mark(0);
        seen.mark(2);
        seen.mark(2);
        assert_eq!((seen.sent(), seen.received()), (3, 2));
        assert!(seen.contains(2) && !seen.contains(1));
    }
}
