//! What became of one inbound message. The pipeline produces an [`Outcome`]; the core path
//! turns it into a reply (`reply`), the durable path into an ack, a nak or a dead letter
//! (`durable::inbox`).

use std::time::Duration;

use crate::error::HandlerError;
use crate::handler::Output;
use crate::protocol::status::StatusCode;

/// Whether a failed durable delivery is worth another attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Poison: another attempt cannot help (undecodable, a bad signature, no access, a loop,
    /// expired).
    Never,
    /// The retry policy decides by the status code (a handler's failure).
    Policy,
    /// Retried with the policy's delays until its attempts run out, whatever the status: a
    /// command this instance has no handler for, which another instance of the agent (a newer
    /// version in a rolling deploy) may know.
    Attempts,
    /// Retried after this delay (over the rate limit, the idempotency store unavailable);
    /// the consumer's `MaxDeliver` bounds how often.
    After(Duration),
}

/// Why a message was not handled, or how its handler failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    pub(crate) status: StatusCode,
    pub(crate) reason: String,
    pub(crate) retry: Retry,
}

impl Failure {
    /// A refusal that no retry can change.
    pub(crate) fn refused(status: StatusCode, reason: impl Into<String>) -> Self {
        Failure {
            status,
            reason: reason.into(),
            retry: Retry::Never,
        }
    }

    /// The error the caller is told.
    pub(crate) fn to_handler_error(&self) -> HandlerError {
        HandlerError::new(self.status, self.reason.clone())
    }
}

impl From<HandlerError> for Failure {
    /// A handler's own error: the retry policy decides.
    fn from(err: HandlerError) -> Self {
        Failure {
            status: err.status,
            reason: err.reason,
            retry: Retry::Policy,
        }
    }
}

/// What became of one inbound message.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// Handled; for a request, the reply's payload.
    Done(Output),
    /// An exactly-once message handled before: the result it had then, not run again.
    Repeated(Result<Output, HandlerError>),
    /// Refused before its handler ran, or its handler failed.
    Failed(Failure),
}

impl Outcome {
    /// The status code the outcome reports.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Outcome::Done(_) | Outcome::Repeated(Ok(_)) => StatusCode::OK,
            Outcome::Repeated(Err(e)) => e.status,
            Outcome::Failed(f) => f.status,
        }
    }

    /// The result a caller is answered with.
    pub(crate) fn into_result(self) -> Result<Output, HandlerError> {
        match self {
            Outcome::Done(output) => Ok(output),
            Outcome::Repeated(result) => result,
            Outcome::Failed(failure) => Err(HandlerError::new(failure.status, failure.reason)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handlers_own_code_reaches_the_caller_and_the_retry_policy_decides() {
        let failure = Failure::from(HandlerError::invalid_argument("division by zero"));
        assert_eq!(failure.status, StatusCode::INVALID_ARGUMENT);
        assert_eq!(failure.retry, Retry::Policy);
        let outcome = Outcome::Failed(failure);
        assert_eq!(outcome.status(), StatusCode::INVALID_ARGUMENT);
        let err = outcome.into_result().expect_err("a failure");
        assert_eq!(err.reason, "division by zero");
        let done = Outcome::Done(Output::default());
        assert_eq!(done.status(), StatusCode::OK);
        assert!(done.into_result().is_ok());
    }
}
