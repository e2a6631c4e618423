//! Counting what arrives, the same way on both sides.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;

/// Silence that ends a count once messages have started arriving.
pub(crate) const IDLE: Duration = Duration::from_secs(2);
/// How long a count waits for the first message, while the sender sets up.
pub(crate) const FIRST_ARRIVAL: Duration = Duration::from_secs(30);

/// What a throughput run saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Throughput {
    /// Messages sent.
    pub(crate) sent: u64,
    /// Messages received.
    pub(crate) received: u64,
    /// From the first send to the last receipt.
    pub(crate) elapsed: Duration,
}

impl Throughput {
    /// Received messages per second.
    pub(crate) fn per_second(&self) -> f64 {
        self.received as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Counts items of `stream` until `count` have arrived, or `idle` passes without one (up to
/// [`FIRST_ARRIVAL`] for the first). Returns the count and when the last came. Both sides of
/// the stream benchmarks count with this (where Chorus hands messages to a handler instead of
/// a stream, the benchmark counts in the handler with [`Tally`], as the raw side counts in its
/// loop).
pub(crate) async fn count_arrivals<S: futures::Stream + Unpin>(
    stream: &mut S,
    count: u64,
    idle: Duration,
) -> (u64, Instant) {
    let mut n = 0u64;
    let mut last = Instant::now();
    let mut wait = FIRST_ARRIVAL.max(idle);
    while n < count {
        match tokio::time::timeout(wait, stream.next()).await {
            Ok(Some(_)) => {
                n += 1;
                last = Instant::now();
                wait = idle;
            }
            _ => break,
        }
    }
    (n, last)
}

/// Counts handled messages in the handler itself, with no task hop per message: the raw
/// side counts in its reading loop, so a channel to a counting task here would charge Chorus
/// a wake-up per message that the baseline does not pay.
pub(crate) struct Tally {
    target: u64,
    handled: AtomicU64,
    /// When the last one was handled, in nanoseconds after `base`.
    last_ns: AtomicU64,
    base: Instant,
    done: tokio::sync::Notify,
}

impl Tally {
    pub(crate) fn new(target: u64) -> Self {
        Tally {
            target,
            handled: AtomicU64::new(0),
            last_ns: AtomicU64::new(0),
            base: Instant::now(),
            done: tokio::sync::Notify::new(),
        }
    }

    pub(crate) fn hit(&self) {
        let ns = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last_ns.fetch_max(ns, Ordering::Relaxed);
        if self.handled.fetch_add(1, Ordering::Relaxed) + 1 == self.target {
            self.done.notify_one();
        }
    }

    /// Waits until all have been handled, or `idle` passes without one (up to
    /// [`FIRST_ARRIVAL`] for the first). Returns the count and when the last was handled.
    pub(crate) async fn wait(&self, idle: Duration) -> (u64, Instant) {
        let mut seen = 0;
        let mut wait = FIRST_ARRIVAL.max(idle);
        while tokio::time::timeout(wait, self.done.notified())
            .await
            .is_err()
        {
            let now = self.handled.load(Ordering::Relaxed);
            if now == seen {
                break;
            }
            seen = now;
            wait = idle;
        }
        let last = self.base + Duration::from_nanos(self.last_ns.load(Ordering::Relaxed));
        (self.handled.load(Ordering::Relaxed), last)
    }
}
