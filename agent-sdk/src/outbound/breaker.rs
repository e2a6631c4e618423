//! Circuit breakers (the inter-agent protocols design's): per destination (an agent, or a
//! capability's queue group), an agent stops calling one that keeps failing, answers its own
//! callers at once instead of letting each wait out a timeout, and tries again after a while.
//!
//! - **Closed**: calls go through; `failures` failures in a row (no reply in time, no
//!   responders, 5019 unavailable, 5017 handler failed, 5009/5003 disconnects, 5022 internal)
//!   open it. Any other answer, success or refusal, resets the count: a refusal is the
//!   destination working as it should.
//! - **Open** for `open_for`: every call is refused at once with 5019, naming the destination
//!   and when it will be tried again.
//! - **Half-open** after that: one call goes through as a probe (the others are still refused
//!   until it is answered); its success closes the breaker, its failure opens it again.
//!
//! Each state change is logged, counted (`chorus_agent_circuit_state`,
//! `chorus_agent_circuits_opened_total`) and announced in the agent's next heartbeat
//! (`open_circuits`), so `chorus agents` shows which destinations each agent has cut off.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::SdkError;
use crate::metrics::sdk_metrics;
use crate::protocol::status::StatusCode;
use crate::sync::lock;

/// Failures in a row that open a breaker, by default.
pub const DEFAULT_BREAKER_FAILURES: u32 = 5;
/// How long an open breaker refuses calls before it lets one try, by default.
pub const DEFAULT_BREAKER_OPEN_FOR: Duration = Duration::from_secs(30);

/// When an agent's breakers open and for how long ([`AgentOptions::circuit_breaker`](crate::AgentOptions::circuit_breaker)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerPolicy {
    /// Failures in a row (at least 1) that open a destination's breaker.
    pub failures: u32,
    /// How long it stays open before one call may try again.
    pub open_for: Duration,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        BreakerPolicy {
            failures: DEFAULT_BREAKER_FAILURES,
            open_for: DEFAULT_BREAKER_OPEN_FOR,
        }
    }
}

impl BreakerPolicy {
    /// Opens after `failures` failures in a row, for `open_for`.
    pub fn new(failures: u32, open_for: Duration) -> Self {
        BreakerPolicy {
            failures: failures.max(1),
            open_for,
        }
    }
}

/// A breaker's state, as [`Agent::circuit`](crate::Agent::circuit) reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Calls go through.
    Closed,
    /// Calls are refused at once.
    Open,
    /// One call is trying; the others are refused until it is answered.
    HalfOpen,
}

impl CircuitState {
    /// The value of the `chorus_agent_circuit_state` gauge: 0 closed, 1 half-open, 2 open.
    fn gauge(self) -> i64 {
        match self {
            CircuitState::Closed => 0,
            CircuitState::HalfOpen => 1,
            CircuitState::Open => 2,
        }
    }
}

/// Whether an answer with `status` counts against its destination.
pub(crate) fn counts_as_failure(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::TIMEOUT
            | StatusCode::NO_RESPONDERS
            | StatusCode::UNAVAILABLE
            | StatusCode::HANDLER_FAILED
            | StatusCode::UNEXPECTED_DISCONNECT
            | StatusCode::DISCONNECTED
            | StatusCode::INTERNAL
    )
}

#[derive(Debug)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// A probe is out.
    HalfOpen,
}

/// An agent's breakers, one per destination that has failed.
pub(crate) struct Breakers {
    policy: Option<BreakerPolicy>,
    agent: String,
    circuits: Mutex<HashMap<String, State>>,
    /// Wakes the heartbeat loop when a breaker opens or closes.
    changed: Arc<tokio::sync::Notify>,
}

/// A call let through: report how it ended with [`Ticket::finish`]. Dropped unfinished (the
/// caller gave up waiting), it counts as neither success nor failure, and a probe lets the
/// next call try instead.
pub(crate) struct Ticket<'a> {
    breakers: &'a Breakers,
    destination: Option<String>,
}

impl Breakers {
    pub(crate) fn new(
        policy: Option<BreakerPolicy>,
        agent: &str,
        changed: Arc<tokio::sync::Notify>,
    ) -> Self {
        Breakers {
            policy,
            agent: agent.to_owned(),
            circuits: Mutex::new(HashMap::new()),
            changed,
        }
    }

    /// Lets a call to `destination` through, or refuses it at once while its breaker is open.
    pub(crate) fn admit(&self, destination: &str) -> Result<Ticket<'_>, SdkError> {
        let pass = Ticket {
            breakers: self,
            destination: None,
        };
        if self.policy.is_none() {
            return Ok(pass);
        }
        let mut circuits = lock(&self.circuits);
        let Some(state) = circuits.get_mut(destination) else {
            return Ok(Ticket {
                destination: Some(destination.to_owned()),
                ..pass
            });
        };
        match *state {
            State::Closed { .. } => {}
            State::Open { until } => {
                let now = Instant::now();
                if now < until {
                    return Err(SdkError::CircuitOpen {
                        destination: destination.to_owned(),
                        retry_in: until - now,
                    });
                }
                *state = State::HalfOpen;
                drop(circuits);
                self.moved(destination, CircuitState::HalfOpen);
            }
            State::HalfOpen => {
                return Err(SdkError::CircuitOpen {
                    destination: destination.to_owned(),
                    retry_in: Duration::ZERO,
                });
            }
        }
        Ok(Ticket {
            destination: Some(destination.to_owned()),
            ..pass
        })
    }

    /// How `destination`'s breaker stands.
    pub(crate) fn state(&self, destination: &str) -> CircuitState {
        match lock(&self.circuits).get(destination) {
            None | Some(State::Closed { .. }) => CircuitState::Closed,
            Some(State::Open { .. }) => CircuitState::Open,
            Some(State::HalfOpen) => CircuitState::HalfOpen,
        }
    }

    /// The destinations whose breakers are open or half-open, sorted.
    pub(crate) fn open(&self) -> Vec<String> {
        let mut open: Vec<String> = lock(&self.circuits)
            .iter()
            .filter(|(_, s)| !matches!(s, State::Closed { .. }))
            .map(|(d, _)| d.clone())
            .collect();
        open.sort();
        open
    }

    fn finish(&self, destination: &str, failed: bool) {
        let Some(policy) = self.policy else { return };
        let mut circuits = lock(&self.circuits);
        let state = circuits
            .entry(destination.to_owned())
            .or_insert(State::Closed { failures: 0 });
        let moved = match (&*state, failed) {
            (State::Closed { failures }, true) => {
                let failures = failures + 1;
                if failures >= policy.failures {
                    *state = State::Open {
                        until: Instant::now() + policy.open_for,
                    };
                    Some(CircuitState::Open)
                } else {
                    *state = State::Closed { failures };
                    None
                }
            }
            (State::HalfOpen, true) => {
                *state = State::Open {
                    until: Instant::now() + policy.open_for,
                };
                Some(CircuitState::Open)
            }
            (State::HalfOpen, false) => {
                circuits.remove(destination);
                Some(CircuitState::Closed)
            }
            (State::Closed { .. }, false) => {
                circuits.remove(destination);
                None
            }
            // Answered after another call opened it: the open state stands.
            (State::Open { .. }, _) => None,
        };
        drop(circuits);
        if let Some(to) = moved {
            self.moved(destination, to);
        }
    }

    /// A probe dropped before its answer: the next call may try.
    fn abandon(&self, destination: &str) {
        let mut circuits = lock(&self.circuits);
        if let Some(state @ State::HalfOpen) = circuits.get_mut(destination) {
            *state = State::Open {
                until: Instant::now(),
            };
        }
    }

    fn moved(&self, destination: &str, to: CircuitState) {
        let metrics = sdk_metrics();
        metrics
            .circuit_state
            .with_label_values(&[self.agent.as_str(), destination])
            .set(to.gauge());
        match to {
            CircuitState::Open => {
                metrics
                    .circuits_opened
                    .with_label_values(&[self.agent.as_str(), destination])
                    .inc();
                tracing::warn!(agent = %self.agent, %destination, "circuit open: calls to it are refused at once for a while");
            }
            CircuitState::HalfOpen => {
                tracing::info!(agent = %self.agent, %destination, "circuit half-open: one call tries");
            }
            CircuitState::Closed => {
                tracing::info!(agent = %self.agent, %destination, "circuit closed");
            }
        }
        self.changed.notify_one();
    }
}

impl Ticket<'_> {
    /// Reports how the call ended.
    pub(crate) fn finish(mut self, status: StatusCode) {
        if let Some(destination) = self.destination.take() {
            self.breakers
                .finish(&destination, counts_as_failure(status));
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if let Some(destination) = self.destination.take() {
            self.breakers.abandon(&destination);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breakers(failures: u32, open_for: Duration) -> Breakers {
        Breakers::new(
            Some(BreakerPolicy::new(failures, open_for)),
            "test-agent",
            Arc::new(tokio::sync::Notify::new()),
        )
    }

    #[test]
    fn it_opens_after_the_failures_refuses_then_half_opens_and_closes_on_success() {
        let b = breakers(3, Duration::from_millis(40));
        for _ in 0..2 {
            b.admit("agent:x")
                .expect("closed")
                .finish(StatusCode::TIMEOUT);
        }
        // A refusal is an answer: it resets the count.
        b.admit("agent:x")
            .expect("closed")
            .finish(StatusCode::INVALID_ARGUMENT);
        for _ in 0..2 {
            b.admit("agent:x")
                .expect("closed")
                .finish(StatusCode::NO_RESPONDERS);
        }
        assert_eq!(b.state("agent:x"), CircuitState::Closed);
        b.admit("agent:x")
            .expect("closed")
            .finish(StatusCode::UNAVAILABLE);
        assert_eq!(b.state("agent:x"), CircuitState::Open);
        assert_eq!(b.open(), ["agent:x"]);
        let refused = b.admit("agent:x").err().expect("open refuses");
        assert_eq!(refused.status(), StatusCode::UNAVAILABLE);
        // Other destinations are not affected.
        b.admit("cap:ocr")
            .expect("another destination")
            .finish(StatusCode::OK);

        std::thread::sleep(Duration::from_millis(50));
        let probe = b.admit("agent:x").expect("half-open lets one through");
        assert_eq!(b.state("agent:x"), CircuitState::HalfOpen);
        assert!(b.admit("agent:x").is_err(), "only one probe at a time");
        probe.finish(StatusCode::OK);
        assert_eq!(b.state("agent:x"), CircuitState::Closed);
        assert!(b.open().is_empty());
    }

    #[test]
    fn a_failed_probe_opens_it_again_and_an_abandoned_one_lets_the_next_try() {
        let b = breakers(1, Duration::from_millis(20));
        b.admit("agent:y")
            .expect("closed")
            .finish(StatusCode::TIMEOUT);
        std::thread::sleep(Duration::from_millis(30));
        b.admit("agent:y")
            .expect("probe")
            .finish(StatusCode::TIMEOUT);
        assert_eq!(b.state("agent:y"), CircuitState::Open);
        std::thread::sleep(Duration::from_millis(30));
        drop(b.admit("agent:y").expect("probe"));
        assert!(
            b.admit("agent:y").is_ok(),
            "the abandoned probe's turn passes on"
        );
    }

    #[test]
    fn without_a_policy_nothing_is_ever_refused() {
        let b = Breakers::new(None, "a", Arc::new(tokio::sync::Notify::new()));
        for _ in 0..100 {
            b.admit("agent:z")
                .expect("no breaker")
                .finish(StatusCode::TIMEOUT);
        }
        assert!(b.open().is_empty());
    }
}
