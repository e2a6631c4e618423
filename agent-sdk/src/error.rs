//! Errors of the SDK, and the error a handler returns.

use std::time::Duration;

use crate::protocol::codec::CodecError;
use crate::protocol::status::StatusCode;
use crate::subject::SubjectError;

/// Why an SDK call failed. [`SdkError::status`] gives the protocol code for it, so a handler
/// that fails because a downstream call failed can pass the code on unchanged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SdkError {
    /// No reply within the timeout.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// Nobody serves the subject.
    #[error("no agent is serving {0}")]
    NoResponders(String),
    /// The other side answered with a non-success status.
    #[error("refused with {status}: {reason}")]
    Remote {
        /// The status code of the reply.
        status: StatusCode,
        /// The reason given with it.
        reason: String,
        /// Who answered with it (the reply's `from`), when a reply did; `None` when this
        /// side found the failure (a task's state, a round without an award).
        from: Option<String>,
    },
    /// Forwarding would pass the hop limit; nothing was sent.
    #[error("loop detected: hop {hops} is past the limit of {limit}")]
    LoopDetected {
        /// The hop count the message would have had.
        hops: u8,
        /// The limit.
        limit: u8,
    },
    /// The deadline inherited from the message being handled has passed; nothing was sent.
    #[error("deadline passed before the message was sent")]
    Expired,
    /// An envelope or payload could not be encoded or decoded.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// A name cannot become part of a subject.
    #[error(transparent)]
    Subject(#[from] SubjectError),
    /// The broker failed; its [`kind`](chorus_broker_adapter::Error::kind) says how.
    #[error(transparent)]
    Broker(#[from] chorus_broker_adapter::Error),
    /// A payload could not be encrypted (a recipient's key unknown, a bad key).
    #[error("encryption: {0}")]
    Encryption(String),
    /// The call asks for something the SDK cannot do (a durable message to a capability, a
    /// permission on a handler that is not registered).
    #[error("invalid call: {0}")]
    InvalidCall(String),
    /// The agent is shutting down and takes no new work.
    #[error("the agent is shutting down")]
    ShuttingDown,
    /// The task cannot make this move from the state it is in (someone else moved it first,
    /// or it has finished).
    #[error("task {task}: {illegal}")]
    TaskState {
        /// The task.
        task: uuid::Uuid,
        /// The move refused.
        illegal: crate::protocol::task::IllegalTransition,
    },
    /// No task with this id is recorded (never submitted, or past the task stream's age limit).
    #[error("no task {0} is recorded")]
    TaskNotFound(uuid::Uuid),
    /// The destination's circuit breaker is open: it failed too often lately, and nothing was
    /// sent ([`BreakerPolicy`](crate::BreakerPolicy)).
    #[error("circuit open for {destination}: calls to it are refused for another {retry_in:?}")]
    CircuitOpen {
        /// `agent:<id>` or `cap:<capability>`.
        destination: String,
        /// How long until one call may try it again.
        retry_in: Duration,
    },
}

impl SdkError {
    /// The protocol status code that describes this error.
    pub fn status(&self) -> StatusCode {
        use chorus_broker_adapter::ErrorKind as K;
        match self {
            SdkError::Timeout(_) => StatusCode::TIMEOUT,
            SdkError::NoResponders(_) => StatusCode::NO_RESPONDERS,
            SdkError::Remote { status, .. } => *status,
            SdkError::LoopDetected { .. } => StatusCode::LOOP_DETECTED,
            SdkError::Expired => StatusCode::EXPIRED,
            SdkError::Codec(_) => StatusCode::DATA_FORMAT,
            SdkError::Subject(_) => StatusCode::INVALID_ARGUMENT,
            SdkError::ShuttingDown | SdkError::CircuitOpen { .. } => StatusCode::UNAVAILABLE,
            SdkError::TaskState { .. } => StatusCode::TASK_STATE,
            SdkError::TaskNotFound(_) => StatusCode::INVALID_ARGUMENT,
            SdkError::Encryption(_) | SdkError::InvalidCall(_) => StatusCode::INVALID_ARGUMENT,
            SdkError::Broker(e) => match e.kind() {
                K::TimedOut => StatusCode::TIMEOUT,
                K::NoResponders => StatusCode::NO_RESPONDERS,
                K::Refused => StatusCode::ACCESS,
                K::Tls => StatusCode::IDENTITY,
                K::TooLarge => StatusCode::DATA_FORMAT,
                K::ConnectionLimit => StatusCode::CONNECTION_LIMIT,
                K::InvalidSubject | K::InvalidInput => StatusCode::INVALID_ARGUMENT,
                _ => StatusCode::UNEXPECTED_DISCONNECT,
            },
        }
    }
}

/// What a handler returns when it cannot produce a result: a status code and a reason, sent
/// back to the caller as a coded error reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {reason}")]
pub struct HandlerError {
    /// The status code of the reply.
    pub status: StatusCode,
    /// Why, for the caller and the logs.
    pub reason: String,
}

impl HandlerError {
    /// An error with an explicit status code.
    pub fn new(status: StatusCode, reason: impl Into<String>) -> Self {
        HandlerError {
            status,
            reason: reason.into(),
        }
    }

    /// The handler failed (5017).
    pub fn failed(reason: impl Into<String>) -> Self {
        HandlerError::new(StatusCode::HANDLER_FAILED, reason)
    }

    /// The arguments are not valid for this command (5018).
    pub fn invalid_argument(reason: impl Into<String>) -> Self {
        HandlerError::new(StatusCode::INVALID_ARGUMENT, reason)
    }
}

impl From<SdkError> for HandlerError {
    fn from(err: SdkError) -> Self {
        let reason = match &err {
            SdkError::Remote { reason, .. } => reason.clone(),
            other => other.to_string(),
        };
        HandlerError::new(err.status(), reason)
    }
}

impl From<CodecError> for HandlerError {
    fn from(err: CodecError) -> Self {
        HandlerError::new(StatusCode::DATA_FORMAT, err.to_string())
    }
}

/// Why a check refused what it was given: a relayed token
/// ([`AgentOptions::require_token`](crate::AgentOptions::require_token)), a task's result
/// ([`Verification::function`](crate::task::Verification::function)). A check returns
/// `Err("reason".into())` or `Err(Rejection::new(reason))`, and `?` turns a `String` into one;
/// the reason travels with the refusal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct Rejection {
    reason: String,
}

impl Rejection {
    /// A rejection for `reason`.
    pub fn new(reason: impl Into<String>) -> Self {
        Rejection {
            reason: reason.into(),
        }
    }

    /// Why.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl From<String> for Rejection {
    fn from(reason: String) -> Self {
        Rejection { reason }
    }
}

impl From<&str> for Rejection {
    fn from(reason: &str) -> Self {
        Rejection::new(reason)
    }
}
