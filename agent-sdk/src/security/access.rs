//! The application's own access rules: permissions a handler requires of its senders, and a
//! per-sender rate limit (a token bucket). Both name the sender by its `from` field; a grant
//! applies only when that field is proven (the message's signature verified against the
//! sender's key), unless the agent explicitly trusts unverified senders.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use crate::protocol::status::StatusCode;
use crate::sync::{lock, read, write};

/// A per-sender request rate limit: a token bucket of `burst` requests refilled at
/// `per_second`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Sustained requests a second, per sender.
    pub per_second: f64,
    /// Requests a sender may make at once.
    pub burst: f64,
}

/// Why access was refused: 5007 (a permission missing) or 5013 (over the rate limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Denied {
    pub(crate) status: StatusCode,
    pub(crate) reason: String,
}

/// Grants and rate limits of one agent.
#[derive(Default)]
pub(crate) struct Access {
    grants: RwLock<HashMap<String, HashSet<String>>>,
    /// Whether grants apply to a self-declared `from` that no signature proves.
    trust_unverified: bool,
    rate_limit: Option<RateLimit>,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

impl Access {
    pub(crate) fn new(grants: Vec<(String, Vec<String>)>, rate_limit: Option<RateLimit>) -> Self {
        let access = Access {
            rate_limit,
            ..Access::default()
        };
        for (agent, permissions) in grants {
            access.grant(&agent, permissions);
        }
        access
    }

    /// Whether grants apply to senders whose `from` no signature proves
    /// ([`crate::AgentOptions::trust_unverified_senders`]).
    pub(crate) fn trusting_unverified_senders(mut self, on: bool) -> Self {
        self.trust_unverified = on;
        self
    }

    /// Grants `agent` more permissions.
    pub(crate) fn grant<I, S>(&self, agent: &str, permissions: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        write(&self.grants)
            .entry(agent.to_owned())
            .or_default()
            .extend(permissions.into_iter().map(Into::into));
    }

    /// Whether `sender` holds every permission in `required` (for `name`), then whether it
    /// is within its rate; a message that passes takes one token. `verified` says whether the
    /// message's signature proved `sender`; if not, its grants count only when the agent
    /// trusts unverified senders.
    pub(crate) fn check(
        &self,
        sender: &str,
        verified: bool,
        name: &str,
        required: &[String],
    ) -> Result<(), Denied> {
        if !required.is_empty() {
            let grants = read(&self.grants);
            let granted = grants.get(sender);
            if !verified && !self.trust_unverified && granted.is_some() {
                return Err(Denied {
                    status: StatusCode::ACCESS,
                    reason: format!(
                        "{sender} is not verified (the message is unsigned, or this agent does \
                         not verify signatures), so its grants do not apply to {name}"
                    ),
                });
            }
            let held = granted;
            let missing: Vec<&str> = required
                .iter()
                .filter(|p| !held.is_some_and(|h| h.contains(*p)))
                .map(String::as_str)
                .collect();
            if !missing.is_empty() {
                return Err(Denied {
                    status: StatusCode::ACCESS,
                    reason: format!(
                        "{sender} lacks permission {} for {name}",
                        missing.join(", ")
                    ),
                });
            }
        }
        self.take_token(sender, Instant::now())
    }

    fn take_token(&self, sender: &str, now: Instant) -> Result<(), Denied> {
        let Some(limit) = self.rate_limit else {
            return Ok(());
        };
        let mut buckets = lock(&self.buckets);
        let (tokens, last) = buckets
            .entry(sender.to_owned())
            .or_insert((limit.burst, now));
        *tokens =
            (*tokens + now.duration_since(*last).as_secs_f64() * limit.per_second).min(limit.burst);
        *last = now;
        if *tokens < 1.0 {
            return Err(Denied {
                status: StatusCode::RATE_LIMITED,
                reason: format!("{sender} exceeds {} requests a second", limit.per_second),
            });
        }
        *tokens -= 1.0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_missing_permission_is_named_and_refused_with_5007() {
        let access = Access::new(vec![("alice".into(), vec!["read".into()])], None);
        let required = vec!["read".to_owned(), "write".to_owned()];
        let denied = access
            .check("alice", true, "ledger", &required)
            .expect_err("refused");
        assert_eq!(denied.status, StatusCode::ACCESS);
        assert_eq!(denied.reason, "alice lacks permission write for ledger");
        access.grant("alice", ["write"]);
        assert!(access.check("alice", true, "ledger", &required).is_ok());
        assert_eq!(
            access
                .check("bob", true, "ledger", &required)
                .expect_err("refused")
                .status,
            StatusCode::ACCESS
        );
    }

    #[test]
    fn the_bucket_refuses_past_its_burst_with_5013_and_refills() {
        let access = Access::new(
            Vec::new(),
            Some(RateLimit {
                per_second: 1.0,
                burst: 2.0,
            }),
        );
        let start = Instant::now();
        assert!(access.take_token("a", start).is_ok());
        assert!(access.take_token("a", start).is_ok());
        let denied = access.take_token("a", start).expect_err("refused");
        assert_eq!(denied.status, StatusCode::RATE_LIMITED);
        // Another sender has its own bucket.
        assert!(access.take_token("b", start).is_ok());
        // A second later one token is back.
        assert!(
            access
                .take_token("a", start + Duration::from_secs(1))
                .is_ok()
        );
        assert!(
            access
                .take_token("a", start + Duration::from_secs(1))
                .is_err()
        );
    }
}
