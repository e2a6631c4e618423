//! One error type for the coordinator library, with an [`ErrorKind`] a caller can match on.
//!
//! The broker adapter's error type over a kind of the coordinator's own: a kind, a context
//! saying what was being done, and the cause kept as
//! [`source`](std::error::Error::source). The `chorus` binary turns it into an exit code.

chorus_broker_adapter::error_kind! {
    /// What went wrong, coarse enough to decide what to do next.
    pub enum ErrorKind {
        /// The configuration cannot work: a bad value, an unknown key, a missing file.
        Config = "config",
        /// NATS did not answer, or refused the connection.
        Connect = "connect",
        /// A NATS operation failed after connecting: a stream, bucket, consumer or subscription
        /// could not be set up, or a request to the server failed.
        Broker = "broker",
        /// A listener (the metrics endpoint) could not bind its address.
        Listen = "listen",
        /// A file could not be read or written.
        Io = "io",
        /// A certificate or key could not be generated.
        Certificate = "certificate",
        /// An argument cannot work: an invalid agent id, capability or topic, a malformed role.
        InvalidInput = "invalid_input",
        /// The local `nats-server` is not installed, or did not start.
        NatsServer = "nats_server",
        /// The span exporter could not be set up.
        Telemetry = "telemetry",
    }
}

/// A coordinator error: its [`kind`](Error::kind), what was being done, and the cause. The
/// same error type as the adapter's, over the coordinator's own [`ErrorKind`].
pub type Error = chorus_broker_adapter::error::Error<ErrorKind>;

/// Result of a coordinator operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_tells_context_then_cause_and_keeps_the_source() {
        let err = Error::with_source(
            ErrorKind::Io,
            "cannot write ca.pem",
            std::io::Error::other("disk full"),
        );
        assert_eq!(err.to_string(), "cannot write ca.pem: disk full");
        assert_eq!(err.kind(), ErrorKind::Io);
        assert!(std::error::Error::source(&err).is_some());
        let bare = Error::new(ErrorKind::Config, "replicas must be 1, 3 or 5");
        assert_eq!(bare.to_string(), "replicas must be 1, 3 or 5");
        assert!(std::error::Error::source(&bare).is_none());
    }
}
