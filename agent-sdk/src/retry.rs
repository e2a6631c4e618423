//! Retry policy for durable deliveries: how many attempts, how long between them, and which
//! failures are worth retrying.
//!
//! The attempt count is never kept here: it is JetStream's delivery count for the message
//! (`Delivery::delivered`). A failed attempt is NAK'd with the delay this policy computes from
//! that count; the last allowed attempt, or a failure whose code is not retryable, is
//! terminated and dead-lettered by the coordinator.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::protocol::envelope::Kind;
use crate::protocol::status::StatusCode;

/// One retry policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (at least 1).
    pub max_attempts: u32,
    /// Delay before the second attempt, in milliseconds.
    pub initial_backoff_ms: u64,
    /// Factor applied per further attempt (at least 1).
    pub multiplier: f64,
    /// Cap on any one delay, in milliseconds.
    pub max_backoff_ms: u64,
    /// Random spread: each delay is scaled by a factor drawn from `1 - jitter ..= 1`
    /// (0 to 1), so retries of many messages do not arrive in lockstep.
    pub jitter: f64,
    /// Status codes that are retried; any other failure is terminated at once (poison).
    pub retry_on: Vec<StatusCode>,
}

impl Default for RetryPolicy {
    /// 5 attempts, 500 ms doubling to at most 30 s, 20% jitter; retries handler failures,
    /// timeouts, unavailable and internal errors, not bad input or refusals.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            initial_backoff_ms: 500,
            multiplier: 2.0,
            max_backoff_ms: 30_000,
            jitter: 0.2,
            retry_on: vec![
                StatusCode::HANDLER_FAILED,
                StatusCode::TIMEOUT,
                StatusCode::UNAVAILABLE,
                StatusCode::INTERNAL,
                StatusCode::NO_RESPONDERS,
                StatusCode::UNEXPECTED_DISCONNECT,
                StatusCode::RATE_LIMITED,
            ],
        }
    }
}

impl RetryPolicy {
    /// Checks the values; the error says which is wrong and why.
    ///
    /// # Errors
    /// [`PolicyError`] when `max_attempts` is 0, `multiplier` is below 1 or not finite, `jitter` is
    /// outside 0..=1, or `max_backoff_ms` is below `initial_backoff_ms`.
    pub fn validate(&self) -> Result<(), PolicyError> {
        self.check().map_err(PolicyError)
    }

    fn check(&self) -> Result<(), String> {
        if self.max_attempts == 0 {
            return Err("max_attempts must be at least 1".into());
        }
        if !(self.multiplier >= 1.0 && self.multiplier.is_finite()) {
            return Err(format!(
                "multiplier must be at least 1, not {}",
                self.multiplier
            ));
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(format!(
                "jitter must be between 0 and 1, not {}",
                self.jitter
            ));
        }
        if self.max_backoff_ms < self.initial_backoff_ms {
            return Err("max_backoff_ms must not be below initial_backoff_ms".into());
        }
        Ok(())
    }

    /// Whether a failure with `status` on delivery `delivered` (1-based) gets another attempt.
    pub fn should_retry(&self, status: StatusCode, delivered: u64) -> bool {
        delivered < u64::from(self.max_attempts) && self.retry_on.contains(&status)
    }

    /// The delay before the next attempt after delivery `delivered` failed, without jitter:
    /// `initial * multiplier^(delivered-1)`, capped.
    pub fn base_delay(&self, delivered: u64) -> Duration {
        let exp = i32::try_from(delivered.saturating_sub(1)).unwrap_or(i32::MAX);
        let ms = self.initial_backoff_ms as f64 * self.multiplier.powi(exp);
        Duration::from_millis(ms.min(self.max_backoff_ms as f64) as u64)
    }

    /// The delay with jitter applied, `random` being a number in `0..1`.
    pub fn delay(&self, delivered: u64, random: f64) -> Duration {
        let base = self.base_delay(delivered);
        base.mul_f64(1.0 - self.jitter * random.clamp(0.0, 1.0))
    }
}

/// A number in `0..1` for jitter: the random bits of a fresh UUIDv7.
pub(crate) fn random_fraction() -> f64 {
    let bits = uuid::Uuid::now_v7().as_u128() as u64 & 0xFFFF_FFFF;
    bits as f64 / f64::from(u32::MAX)
}

/// A retry policy that cannot be used: which value is wrong and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid retry policy: {0}")]
pub struct PolicyError(String);

/// Which messages a rule applies to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryRule {
    /// A NATS subject pattern (`*`, `>`), matched against the durable subject.
    #[serde(default)]
    pub subject: Option<String>,
    /// A message kind (`command`, `request`, `event`).
    #[serde(default)]
    pub kind: Option<Kind>,
    /// The policy for matching messages.
    pub policy: RetryPolicy,
}

/// Policies by subject pattern and kind; the first matching rule wins, else the default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryPolicies {
    /// The policy when no rule matches.
    pub default: RetryPolicy,
    /// Rules, in order.
    pub rules: Vec<RetryRule>,
}

impl RetryPolicies {
    /// Checks every policy and pattern.
    ///
    /// # Errors
    /// [`PolicyError`] naming the first policy with a wrong value (see [`RetryPolicy::validate`]),
    /// or a rule whose subject is not a valid NATS subject pattern.
    pub fn validate(&self) -> Result<(), PolicyError> {
        self.check().map_err(PolicyError)
    }

    fn check(&self) -> Result<(), String> {
        self.default.check().map_err(|e| format!("default: {e}"))?;
        for (i, rule) in self.rules.iter().enumerate() {
            rule.policy
                .check()
                .map_err(|e| format!("rule {}: {e}", i + 1))?;
            if let Some(subject) = &rule.subject {
                chorus_broker_adapter::validate_subject(
                    subject,
                    chorus_broker_adapter::Wildcards::Allow,
                )
                .map_err(|e| format!("rule {}: {e}", i + 1))?;
            }
        }
        Ok(())
    }

    /// The policy for a message on `subject` of `kind`.
    pub fn for_message(&self, subject: &str, kind: Kind) -> &RetryPolicy {
        self.rules
            .iter()
            .find(|r| {
                r.kind.is_none_or(|k| k == kind)
                    && r.subject
                        .as_deref()
                        .is_none_or(|p| subject_matches(p, subject))
            })
            .map(|r| &r.policy)
            .unwrap_or(&self.default)
    }

    /// The most attempts any policy allows: the consumer's `MaxDeliver`, a backstop for
    /// messages whose handler never answers (crashes, ack timeouts).
    pub fn max_attempts(&self) -> u32 {
        self.rules
            .iter()
            .map(|r| r.policy.max_attempts)
            .chain([self.default.max_attempts])
            .max()
            .unwrap_or(1)
    }
}

/// Whether NATS subject `subject` matches `pattern` (`*` one token, `>` the rest).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_exponentially_with_a_cap_and_bounded_jitter() {
        let p = RetryPolicy {
            initial_backoff_ms: 100,
            multiplier: 2.0,
            max_backoff_ms: 1_000,
            jitter: 0.5,
            ..RetryPolicy::default()
        };
        let base: Vec<u64> = (1..=6)
            .map(|d| p.base_delay(d).as_millis() as u64)
            .collect();
        assert_eq!(base, [100, 200, 400, 800, 1_000, 1_000]);
        assert_eq!(p.delay(2, 0.0), Duration::from_millis(200));
        assert_eq!(p.delay(2, 1.0), Duration::from_millis(100));
    }

    #[test]
    fn retries_only_retryable_codes_and_only_below_the_limit() {
        let p = RetryPolicy::default();
        assert!(p.should_retry(StatusCode::HANDLER_FAILED, 1));
        assert!(p.should_retry(StatusCode::HANDLER_FAILED, 4));
        assert!(!p.should_retry(StatusCode::HANDLER_FAILED, 5));
        assert!(!p.should_retry(StatusCode::DATA_FORMAT, 1));
    }

    #[test]
    fn rules_match_by_subject_and_kind_in_order() {
        let fast = RetryPolicy {
            max_attempts: 2,
            ..RetryPolicy::default()
        };
        let slow = RetryPolicy {
            max_attempts: 9,
            ..RetryPolicy::default()
        };
        let policies = RetryPolicies {
            default: RetryPolicy::default(),
            rules: vec![
                RetryRule {
                    subject: Some("chorus.inbox.ocr-*.>".into()),
                    kind: None,
                    policy: fast.clone(),
                },
                RetryRule {
                    subject: Some("chorus.inbox.*.billing".into()),
                    kind: Some(Kind::Command),
                    policy: slow.clone(),
                },
            ],
        };
        assert!(
            policies.validate().is_err(),
            "ocr-* is not a valid token pattern"
        );
        let policies = RetryPolicies {
            rules: vec![
                RetryRule {
                    subject: Some("chorus.inbox.ocr.>".into()),
                    kind: None,
                    policy: fast.clone(),
                },
                RetryRule {
                    subject: Some("chorus.inbox.*.billing".into()),
                    kind: Some(Kind::Command),
                    policy: slow.clone(),
                },
            ],
            ..policies
        };
        policies.validate().expect("valid");
        assert_eq!(
            policies.for_message("chorus.inbox.ocr.scan", Kind::Command),
            &fast
        );
        assert_eq!(
            policies.for_message("chorus.inbox.a.billing", Kind::Command),
            &slow
        );
        assert_eq!(
            policies.for_message("chorus.inbox.a.billing", Kind::Request),
            &policies.default
        );
        assert_eq!(policies.max_attempts(), 9);
    }

    #[test]
    fn bad_values_are_refused_with_a_reason() {
        let bad = RetryPolicy {
            max_attempts: 0,
            ..RetryPolicy::default()
        };
        assert!(
            bad.validate()
                .expect_err("invalid")
                .to_string()
                .contains("max_attempts")
        );
        let bad = RetryPolicy {
            jitter: 2.0,
            ..RetryPolicy::default()
        };
        assert!(
            bad.validate()
                .expect_err("invalid")
                .to_string()
                .contains("jitter")
        );
    }
}
