//! Why a server did not start.

use std::fmt;

/// What went wrong, coarse enough to decide what to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// No `nats-server` binary was found, or it could not be run.
    NotFound,
    /// Its directory, log or config file could not be written.
    Io,
    /// The process exited before it listened (the error quotes its log).
    Exited,
    /// It did not write its ports file within the ready timeout.
    TimedOut,
}

impl ErrorKind {
    /// A short stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::Io => "io",
            ErrorKind::Exited => "exited",
            ErrorKind::TimedOut => "timed_out",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A server that did not start: its [`kind`](Error::kind), what was being done, the cause.
#[derive(Debug, thiserror::Error)]
#[error("{context}: {kind}{}", .source.as_ref().map(|s| format!(" ({s})")).unwrap_or_default())]
pub struct Error {
    kind: ErrorKind,
    context: String,
    #[source]
    source: Option<Source>,
}

impl Error {
    /// An error of `kind` with a human-readable context.
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Self {
        Error {
            kind,
            context: context.into(),
            source: None,
        }
    }

    /// An error of `kind` that keeps its cause.
    pub fn with_source(
        kind: ErrorKind,
        context: impl Into<String>,
        source: impl Into<Source>,
    ) -> Self {
        Error {
            kind,
            context: context.into(),
            source: Some(source.into()),
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
}

/// Result of starting a server.
pub type Result<T, E = Error> = std::result::Result<T, E>;
