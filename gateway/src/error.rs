//! The gateway's errors: the broker adapter's error type over a kind of the gateway's own.

chorus_broker_adapter::error_kind! {
    /// What went wrong, coarse enough to decide what to do next.
    pub enum ErrorKind {
        /// The configuration cannot work: a bad value, an unknown identity, a missing file.
        Config = "config",
        /// NATS did not answer, or refused an edge identity's connection.
        Connect = "connect",
        /// A NATS operation failed after connecting: a subscription or registration.
        Broker = "broker",
        /// The HTTP listener could not bind its address.
        Listen = "listen",
        /// A file could not be read.
        Io = "io",
    }
}

/// A gateway error: its [`kind`](Error::kind), what was being done, and the cause.
pub type Error = chorus_broker_adapter::error::Error<ErrorKind>;

/// Result of a gateway operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;
