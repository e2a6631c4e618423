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
