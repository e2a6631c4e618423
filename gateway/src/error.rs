//! The gateway's errors: the broker adapter's error type over a kind of the gateway's own.

use std::fmt;

/// What went wrong, coarse enough to decide what to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The configuration cannot work: a bad value, an unknown identity, a missing file.
    Config,
    /// NATS did not answer, or refused an edge identity's connection.
    Connect,
    /// A NATS operation failed after connecting: a subscription or registration.
    Broker,
    /// The HTTP listener could not bind its address.
    Listen,
    /// A file could not be read.
    Io,
}

impl ErrorKind {
    /// A short stable name, used in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Config => "config",
            ErrorKind::Connect => "connect",
            ErrorKind::Broker => "broker",
            ErrorKind::Listen => "listen",
            ErrorKind::Io => "io",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl chorus_broker_adapter::error::Kind for ErrorKind {}

/// A gateway error: its [`kind`](Error::kind), what was being done, and the cause.
pub type Error = chorus_broker_adapter::error::Error<ErrorKind>;

/// Result of a gateway operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;
