//! When a replica that exited is started again, and when it is given up on: pure types, no
//! clock of their own (the supervisor passes the uptime and the instant), so each rule is tested
//! without waiting.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Bounded exponential backoff between the starts of a crashing replica.
///
/// The first delay is `initial`, each consecutive crash doubles it, and it never exceeds `max`.
/// A replica that stayed up longer than `max` before exiting is taken as healthy again: the
/// count of consecutive crashes starts over, so one crash a day waits `initial`, not `max`.
///
/// ```
/// use std::time::Duration;
/// use chorus_host::process::Backoff;
///
/// let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(300));
/// let short = Duration::from_millis(5);
/// assert_eq!(backoff.after_exit(short), Duration::from_millis(100));
/// assert_eq!(backoff.after_exit(short), Duration::from_millis(200));
/// assert_eq!(backoff.after_exit(short), Duration::from_millis(300));
/// assert_eq!(backoff.after_exit(Duration::from_secs(1)), Duration::from_millis(100));
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    consecutive: u32,
}

impl Backoff {
    /// A backoff starting at `initial` and capped at `max` (a `max` below `initial` caps every
    /// delay at `max`).
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max,
            consecutive: 0,
        }
    }

    /// Records an exit after `uptime` and returns how long to wait before the next start.
    pub fn after_exit(&mut self, uptime: Duration) -> Duration {
        if uptime > self.max {
            self.consecutive = 0;
        }
        let delay = self.delay(self.consecutive);
        self.consecutive = self.consecutive.saturating_add(1);
        delay
    }

    /// How many crashes in a row the last delay was for (1 after the first crash).
    pub fn attempt(&self) -> u32 {
        self.consecutive
    }

    /// Forgets the crashes so far.
    pub fn reset(&mut self) {
        self.consecutive = 0;
    }

    /// `initial * 2^n`, capped at `max`, without overflow for any `n`.
    fn delay(&self, n: u32) -> Duration {
        let factor = 2u32.checked_pow(n).unwrap_or(u32::MAX);
        self.initial
            .checked_mul(factor)
            .unwrap_or(Duration::MAX)
            .min(self.max)
    }
}

/// What [`CrashWindow::record`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Start the replica again; `exits` within the window so far.
    Restart {
        /// Exits within the window, this one included.
        exits: u32,
    },
    /// A crash loop: `exits` within the window is more than allowed.
    GiveUp {
        /// Exits within the window, this one included.
        exits: u32,
    },
}

/// The crash-loop rule: more than `max_restarts` exits within `window` and the replica is
/// given up on.
#[derive(Debug, Clone)]
pub struct CrashWindow {
    max_restarts: u32,
    window: Duration,
    exits: VecDeque<Instant>,
}

impl CrashWindow {
    /// A window allowing `max_restarts` restarts per `window`.
    pub fn new(max_restarts: u32, window: Duration) -> CrashWindow {
        CrashWindow {
            max_restarts,
            window,
            exits: VecDeque::new(),
        }
    }

    /// Records an exit at `now` that calls for a restart, and says whether to restart or give
    /// up (more than `max_restarts` exits within the window).
    pub fn record(&mut self, now: Instant) -> Verdict {
        while let Some(first) = self.exits.front() {
            if now.saturating_duration_since(*first) > self.window {
                self.exits.pop_front();
            } else {
                break;
            }
        }
        self.exits.push_back(now);
        let exits = u32::try_from(self.exits.len()).unwrap_or(u32::MAX);
        if exits > self.max_restarts {
            Verdict::GiveUp { exits }
        } else {
            Verdict::Restart { exits }
        }
    }

    /// The window, for the failure's message.
    pub fn window(&self) -> Duration {
        self.window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn delays_double_per_crash_up_to_the_cap() {
        let mut backoff = Backoff::new(20 * MS, 80 * MS);
        let delays: Vec<_> = (0..5).map(|_| backoff.after_exit(MS)).collect();
        assert_eq!(delays, vec![20 * MS, 40 * MS, 80 * MS, 80 * MS, 80 * MS]);
        assert_eq!(backoff.attempt(), 5);
    }

    #[test]
    fn a_long_run_starts_the_count_over() {
        let mut backoff = Backoff::new(20 * MS, 80 * MS);
        backoff.after_exit(MS);
        backoff.after_exit(MS);
        assert_eq!(
            backoff.after_exit(80 * MS),
            80 * MS,
            "exactly max is not longer than max"
        );
        assert_eq!(backoff.after_exit(81 * MS), 20 * MS);
        assert_eq!(backoff.attempt(), 1);
        backoff.reset();
        assert_eq!(backoff.attempt(), 0);
    }

    #[test]
    fn huge_counts_and_durations_do_not_overflow() {
        let mut backoff = Backoff::new(Duration::from_secs(u64::MAX / 2), Duration::MAX);
        for _ in 0..70 {
            backoff.after_exit(Duration::ZERO);
        }
        assert_eq!(backoff.after_exit(Duration::ZERO), Duration::MAX);
        let mut capped = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        for _ in 0..100 {
            assert!(capped.after_exit(Duration::ZERO) <= Duration::from_secs(60));
        }
    }

    #[test]
    fn a_max_below_initial_caps_every_delay() {
        let mut backoff = Backoff::new(100 * MS, 10 * MS);
        assert_eq!(backoff.after_exit(MS), 10 * MS);
    }

    #[test]
    fn the_window_gives_up_after_max_restarts() {
        let start = Instant::now();
        let mut window = CrashWindow::new(3, Duration::from_secs(60));
        assert_eq!(window.record(start), Verdict::Restart { exits: 1 });
        assert_eq!(
            window.record(start + Duration::from_secs(1)),
            Verdict::Restart { exits: 2 }
        );
        assert_eq!(
            window.record(start + Duration::from_secs(2)),
            Verdict::Restart { exits: 3 }
        );
        assert_eq!(
            window.record(start + Duration::from_secs(3)),
            Verdict::GiveUp { exits: 4 }
        );
    }

    #[test]
    fn exits_older_than_the_window_are_forgotten() {
        let start = Instant::now();
        let mut window = CrashWindow::new(2, Duration::from_secs(10));
        assert_eq!(window.record(start), Verdict::Restart { exits: 1 });
        assert_eq!(
            window.record(start + Duration::from_secs(5)),
            Verdict::Restart { exits: 2 }
        );
        // The first exit is 11 s old: out of the window.
        assert_eq!(
            window.record(start + Duration::from_secs(11)),
            Verdict::Restart { exits: 2 }
        );
        assert_eq!(
            window.record(start + Duration::from_secs(12)),
            Verdict::GiveUp { exits: 3 }
        );
    }

    #[test]
    fn no_restarts_allowed_fails_at_the_first_exit() {
        let mut window = CrashWindow::new(0, Duration::from_secs(10));
        assert_eq!(window.record(Instant::now()), Verdict::GiveUp { exits: 1 });
    }
}
