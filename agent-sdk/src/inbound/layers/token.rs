//! Token authentication: an agent that requires a token ([`crate::AgentOptions::require_token`])
//! refuses a command or request without one its check accepts, with 5014, before the handler
//! runs. The token travels in the envelope's `token` field (a gateway puts the edge caller's
//! bearer JWT there); events are not checked.

use std::sync::Arc;

use super::{Inbound, Layer};
use crate::error::Rejection;
use crate::inbound::outcome::Failure;
use crate::protocol::envelope::Envelope;
use crate::protocol::status::StatusCode;

/// The function that judges a token, given it and its message: `Err` says why not.
type Judge = dyn Fn(&str, &Envelope) -> Result<(), Rejection> + Send + Sync;

/// Decides whether a message's token is good.
#[derive(Clone)]
pub(crate) struct TokenCheck(Arc<Judge>);

impl TokenCheck {
    /// A check made by `f`, given the token and the message it came with.
    pub(crate) fn new(
        f: impl Fn(&str, &Envelope) -> Result<(), Rejection> + Send + Sync + 'static,
    ) -> Self {
        TokenCheck(Arc::new(f))
    }
}

impl std::fmt::Debug for TokenCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenCheck")
    }
}

pub(crate) struct RequireToken {
    pub(crate) check: TokenCheck,
}

impl Layer for RequireToken {
    fn check(&self, msg: &mut Inbound<'_>) -> Result<(), Failure> {
        if msg.endpoint.is_none() {
            return Ok(());
        }
        let Some(token) = msg.env.token.as_deref() else {
            return Err(Failure::refused(
                StatusCode::UNAUTHORIZED,
                "this agent requires a token",
            ));
        };
        (self.check.0)(token, &msg.env).map_err(|why| {
            Failure::refused(
                StatusCode::UNAUTHORIZED,
                format!("the token is refused: {why}"),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::endpoint::{Endpoint, EndpointKind};
    use crate::protocol::envelope::{Kind, Performative};

    fn endpoint() -> Endpoint {
        struct Nothing;
        impl crate::Handler for Nothing {
            fn call(
                &self,
                _ctx: crate::Context,
            ) -> crate::BoxFuture<Result<crate::Output, crate::HandlerError>> {
                Box::pin(async { Ok(crate::Output::default()) })
            }
        }
        Endpoint::new(
            "pay".into(),
            "chorus.agent.bank.pay".into(),
            None,
            EndpointKind::Command,
            Arc::new(Nothing),
        )
    }

    fn check(token: Option<&str>, endpoint: Option<&Endpoint>) -> Result<(), Failure> {
        let layer = RequireToken {
            check: TokenCheck::new(|t, env| {
                if t == "good" && env.from == "alice" {
                    Ok(())
                } else {
                    Err("not good".into())
                }
            }),
        };
        let mut env = Envelope::new(Kind::Request, Performative::Request, "alice");
        env.token = token.map(str::to_owned);
        layer.check(&mut Inbound::new("chorus.agent.bank.pay", env, endpoint))
    }

    #[test]
    fn a_command_needs_a_token_the_check_accepts() {
        let e = endpoint();
        assert!(check(Some("good"), Some(&e)).is_ok());
        for token in [None, Some("bad")] {
            let refused = check(token, Some(&e)).expect_err("refused");
            assert_eq!(refused.status, StatusCode::UNAUTHORIZED, "{token:?}");
        }
        // Events (no endpoint) are not checked.
        assert!(check(None, None).is_ok());
    }
}
