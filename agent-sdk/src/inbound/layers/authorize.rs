//! Authorization: the sender must hold every permission the endpoint requires (5007) and stay
//! within its rate limit (5013, which a durable delivery retries after a pause).

use std::sync::Arc;
use std::time::Duration;

use super::{Inbound, Layer};
use crate::inbound::outcome::{Failure, Retry};
use crate::protocol::status::StatusCode;
use crate::security::access::Access;
use crate::stats::AgentCounters;
use crate::sync::read;

/// How long a durable delivery over its sender's rate limit waits before it is tried again.
pub(crate) const RATE_LIMITED_RETRY_DELAY: Duration = Duration::from_secs(1);

pub(crate) struct Authorize {
    pub(crate) access: Arc<Access>,
    pub(crate) counters: Arc<AgentCounters>,
}

impl Layer for Authorize {
    fn check(&self, msg: &mut Inbound<'_>) -> Result<(), Failure> {
        let Some(endpoint) = msg.endpoint else {
            return Ok(());
        };
        let required = read(&endpoint.required);
        self.access
            .check(&msg.env.from, msg.verified, &endpoint.name, &required)
            .map_err(|denied| {
                let (counter, retry) = if denied.status == StatusCode::RATE_LIMITED {
                    (
                        &self.counters.rate_limited,
                        Retry::After(RATE_LIMITED_RETRY_DELAY),
                    )
                } else {
                    (&self.counters.access_refused, Retry::Never)
                };
                AgentCounters::bump(counter);
                Failure {
                    status: denied.status,
                    reason: denied.reason,
                    retry,
                }
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::HandlerError;
    use crate::handler::Context;
    use crate::handler::endpoint::{Endpoint, EndpointKind};
    use crate::handler::{BoxFuture, Handler, Output};
    use crate::protocol::envelope::{Envelope, Kind, Performative};
    use crate::security::access::RateLimit;

    struct Nothing;
    impl Handler for Nothing {
        fn call(&self, _ctx: Context) -> BoxFuture<Result<Output, HandlerError>> {
            Box::pin(async { Ok(Output::default()) })
        }
    }

    fn endpoint(required: &[&str]) -> Endpoint {
        let e = Endpoint::new(
            "pay".into(),
            "chorus.agent.bank.pay".into(),
            None,
            EndpointKind::Command,
            Arc::new(Nothing),
        );
        *crate::sync::write(&e.required) = required.iter().map(|p| (*p).to_owned()).collect();
        e
    }

    fn check(layer: &Authorize, endpoint: &Endpoint, from: &str) -> Result<(), Failure> {
        let mut msg = Inbound::new(
            "chorus.agent.bank.pay",
            Envelope::new(Kind::Request, Performative::Request, from),
            Some(endpoint),
        );
        // As the verify layer marks a message whose signature verified.
        msg.verified = true;
        layer.check(&mut msg)
    }

    #[test]
    fn a_granted_sender_that_is_not_verified_is_5007_unless_unverified_senders_are_trusted() {
        let grants = || vec![("alice".to_owned(), vec!["pay".to_owned()])];
        let pay = endpoint(&["pay"]);
        let unverified = || {
            Inbound::new(
                "chorus.agent.bank.pay",
                Envelope::new(Kind::Request, Performative::Request, "alice"),
                Some(&pay),
            )
        };
        let safe = Authorize {
            access: Arc::new(Access::new(grants(), None)),
            counters: Arc::default(),
        };
        let failure = safe
            .check(&mut unverified())
            .expect_err("from is not proven");
        assert_eq!(failure.status, StatusCode::ACCESS);
        assert!(
            failure.reason.contains("not verified"),
            "{}",
            failure.reason
        );
        assert_eq!(safe.counters.snapshot().access_refused, 1);
        let trusting = Authorize {
            access: Arc::new(Access::new(grants(), None).trusting_unverified_senders(true)),
            counters: Arc::default(),
        };
        assert!(trusting.check(&mut unverified()).is_ok());
    }

    #[test]
    fn a_sender_without_the_permission_is_5007_never_retried() {
        let layer = Authorize {
            access: Arc::new(Access::new(
                vec![("alice".into(), vec!["pay".into()])],
                None,
            )),
            counters: Arc::default(),
        };
        let pay = endpoint(&["pay"]);
        assert!(check(&layer, &pay, "alice").is_ok());
        let failure = check(&layer, &pay, "mallory").expect_err("no permission");
        assert_eq!(failure.status, StatusCode::ACCESS);
        assert_eq!(failure.retry, Retry::Never);
        assert_eq!(layer.counters.snapshot().access_refused, 1);
    }

    #[test]
    fn a_sender_over_its_rate_is_5013_retried_after_a_pause() {
        let layer = Authorize {
            access: Arc::new(Access::new(
                Vec::new(),
                Some(RateLimit {
                    per_second: 0.001,
                    burst: 1.0,
                }),
            )),
            counters: Arc::default(),
        };
        let open = endpoint(&[]);
        assert!(check(&layer, &open, "alice").is_ok());
        let failure = check(&layer, &open, "alice").expect_err("over the rate");
        assert_eq!(failure.status, StatusCode::RATE_LIMITED);
        assert_eq!(failure.retry, Retry::After(RATE_LIMITED_RETRY_DELAY));
        assert_eq!(layer.counters.snapshot().rate_limited, 1);
    }
}
