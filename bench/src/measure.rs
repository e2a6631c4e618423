//! Counting what arrives, the same way on both sides.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};

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
        // A message already waiting is taken without arming a timer: a timer per message
        // (registered in the runtime's wheel and cancelled) would cost the raw side more than
        // a plain reading loop pays, and flatter every ratio.
        let next = match stream.next().now_or_never() {
            Some(item) => Ok(item),
            None => tokio::time::timeout(wait, stream.next()).await,
        };
        match next {
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

/// CPU time this process has used, user and system, in seconds: `/proc/self/stat`'s `utime`
/// and `stime`, in clock ticks of 1/100 s (Linux's fixed `USER_HZ`). `None` off Linux.
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces: count from the `)` that closes it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // After the name: state (3), then ... utime (14) and stime (15).
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

/// Write calls this process has made: `/proc/self/io`'s `syscw`. The NATS clients write their
/// sockets with `writev`, which it counts (as it counts any `write`); `None` off Linux.
fn process_writes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|line| line.strip_prefix("syscw:"))?
        .trim()
        .parse()
        .ok()
}

/// The client CPU (and write calls) a measured run takes per message: read before the run,
/// and again after it. Both sides run in this process against a server in another, so it is
/// the clients' alone (the CPU's resolution is 10 ms, which is fine over the hundreds of
/// milliseconds a run takes).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Usage {
    cpu_seconds: Option<f64>,
    writes: Option<u64>,
}

impl Usage {
    pub(crate) fn start() -> Usage {
        Usage {
            cpu_seconds: process_cpu_seconds(),
            writes: process_writes(),
        }
    }

    /// Microseconds of CPU per message since the start, over `messages`.
    pub(crate) fn per_message_us(self, messages: u64) -> Option<f64> {
        let (start, end) = (self.cpu_seconds?, process_cpu_seconds()?);
        (messages > 0).then(|| (end - start) * 1e6 / messages as f64)
    }

    /// Write calls per message since the start, over `messages`: how many messages (acks
    /// included) each write to the server carries, inverted.
    pub(crate) fn writes_per_message(self, messages: u64) -> Option<f64> {
        let (start, end) = (self.writes?, process_writes()?);
        (messages > 0).then(|| end.saturating_sub(start) as f64 / messages as f64)
    }
}
