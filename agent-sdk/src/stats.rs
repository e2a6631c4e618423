//! Counters an agent keeps about what it received, refused and handled.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($( $(#[$doc:meta])* $name:ident, )*) => {
        /// Live counters of one agent.
        #[derive(Debug, Default)]
        pub(crate) struct AgentCounters { $( pub(crate) $name: AtomicU64, )* }

        /// A copy of an agent's counters at one moment.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct AgentStats { $( $(#[$doc])* pub $name: u64, )* }

        impl AgentStats {
            /// Adds `other`'s counts to these.
            pub fn add(&mut self, other: &AgentStats) {
                $( self.$name += other.$name; )*
            }
        }

        impl AgentCounters {
            pub(crate) fn snapshot(&self) -> AgentStats {
                AgentStats { $( $name: self.$name.load(Ordering::Relaxed), )* }
            }
        }
    };
}

counters! {
/// Messages taken off the wire (commands, requests, events).
received,
/// Handlers that returned success.
handled_ok,
/// Handlers that returned an error (answered with its code).
handler_errors,
/// Messages refused as bad input: undecodable, unsupported version, oversized (5006).
bad_input,
/// Messages not handled because their TTL or deadline had passed (5011).
expired,
/// Messages refused for passing the hop limit, received or about to be sent (5010).
loop_refused,
/// Commands for which no handler is registered (5016).
unknown_command,
/// Notifications that reached this agent (core or durable), handled or not.
notifications_received,
/// Notifications no handler took: counted and dropped, never answered.
notifications_unhandled,
/// Notifications sent to one agent (a group's are the coordinator's to count).
notifications_sent,
/// Replies sent.
replies_sent,
/// Replies that could not be sent (the caller's inbox gone, the connection down).
reply_failures,
/// Requests and commands sent.
requests_sent,
/// Events published.
events_published,
/// Durable deliveries that failed and were scheduled for another attempt (NAK).
retries,
/// Durable deliveries given up on and written to the dead-letter queue.
dead_lettered,
/// Events dropped because their queue was full (a slow subscriber); exact.
dropped,
/// Events this agent's subscriptions missed, whatever the cause: gaps in their publishers'
/// sequence numbers (a reset connection, the server cutting a slow consumer, a restart, the
/// client's full buffer) and drops on the subscription's own full queue. So `dropped` is
/// counted here too; received + `lost` is what was sent.
lost,
/// Requests refused with 5019 because their queue was full.
shed,
/// Durable deliveries that were redeliveries (delivery count above 1): the duplicates
/// at-least-once allows.
redelivered,
/// Exactly-once messages seen before and not handled again.
duplicates_suppressed,
/// Messages refused by the signature check (unsigned, forged, unknown key, stale, replayed).
    security_refused,
    /// Requests refused because the sender lacks a permission the handler requires (5007).
    access_refused,
    /// Requests refused because the sender exceeded its rate limit (5013).
    rate_limited,
    /// Batches of signatures the handler routes checked together (an agent that verifies).
    verify_batches,
    /// Signed messages checked in those batches: divided by `verify_batches`, the mean batch.
    verified_in_batches,
    /// Payloads this agent sent by reference through the object store.
    payloads_stored,
    /// Payloads it received by reference and fetched, their digest checked.
    payloads_fetched,
    /// Payloads it received compressed and decompressed.
    payloads_decompressed,
    /// Durable inbox consumers this agent created on the server because commands waited.
    inbox_consumers_opened,
    /// Durable inbox consumers it deleted once nothing waited for a while.
    inbox_consumers_released,
    /// Batches a [`Batcher`](crate::Batcher) sent.
    batches_sent,
    /// Messages (events and commands) sent in those batches: divided by `batches_sent`, the
    /// mean batch.
    batched_messages,}

impl AgentCounters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A moving average of durations, in µs, the most recent weighing most (each new sample
/// moves it a fifth of the way): how long an agent's handlers take lately, for its ETA.
/// Lock-free; two samples recorded at once may both count against the same old value, which
/// an estimate can bear.
#[derive(Debug, Default)]
pub(crate) struct Ewma {
    /// The average in µs, plus one; 0 before the first sample.
    micros: AtomicU64,
}

impl Ewma {
    /// Adds a sample.
    pub(crate) fn record(&self, took: std::time::Duration) {
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX / 2);
        let old = self.micros.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            let old = old - 1;
            // old + (sample - old) / 5, in integers and without going below zero.
            (old * 4 + sample) / 5
        };
        self.micros.store(new.saturating_add(1), Ordering::Relaxed);
    }

    /// The average in ms (rounded up: a handler that takes 200 µs is not free), once a
    /// sample was recorded.
    pub(crate) fn ms(&self) -> Option<u64> {
        match self.micros.load(Ordering::Relaxed) {
            0 => None,
            n => Some((n - 1).div_ceil(1000).max(1)),
        }
    }
}

#[cfg(test)]
mod ewma_tests {
    use super::Ewma;
    use std::time::Duration;

    #[test]
    fn the_average_starts_at_the_first_sample_and_follows_the_recent_ones() {
        let e = Ewma::default();
        assert_eq!(e.ms(), None, "nothing handled, nothing known");
        e.record(Duration::from_millis(100));
        assert_eq!(e.ms(), Some(100));
        e.record(Duration::from_millis(200));
        assert_eq!(e.ms(), Some(120), "a fifth of the way to the new sample");
        for _ in 0..60 {
            e.record(Duration::from_millis(10));
        }
        assert_eq!(e.ms(), Some(10), "old samples fade");
        e.record(Duration::from_micros(200));
        assert_eq!(e.ms(), Some(9));
        let quick = Ewma::default();
        quick.record(Duration::from_micros(20));
        assert_eq!(quick.ms(), Some(1), "under a ms reads as 1 ms, not free");
    }
}
