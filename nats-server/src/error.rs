//! Why a server did not start.

/// Why a server did not start, coarse enough to decide what to do next.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No `nats-server` binary was found, or it could not be run.
    #[error("{context}")]
    NotFound {
        /// What was tried.
        context: String,
        /// Why running it failed, when it was found.
        #[source]
        source: Option<std::io::Error>,
    },
    /// Its directory, log or config file could not be written.
    #[error("{context}")]
    Io {
        /// What was being written.
        context: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The process exited before it listened (the message quotes its log).
    #[error("{0}")]
    Exited(String),
    /// It did not write its ports file within the ready timeout (the message quotes its log).
    #[error("{0}")]
    TimedOut(String),
    /// It listens, but its ports file lacks what was asked of it (a cluster port).
    #[error("{0}")]
    Ports(String),
}

impl Error {
    /// An I/O failure while `context`.
    pub(crate) fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> Error {
        move |source| Error::Io { context, source }
    }
}

/// The result of starting a server.
pub type Result<T> = std::result::Result<T, Error>;
