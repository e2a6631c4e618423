//! One error type for every broker operation, with a [`ErrorKind`] a caller can match on; the
//! same [`Error`] type, over a [`Kind`] of their own, serves the crates above.

use std::fmt;

/// What went wrong, coarse enough to decide what to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Someone is listening but did not answer in time.
    TimedOut,
    /// Nobody is subscribed to the subject (the server said so at once).
    NoResponders,
    /// The server refused: authentication failed, or a permission forbids the subject.
    Refused,
    /// The message is larger than the server's `max_payload`.
    TooLarge,
    /// The server refused the connection: it has as many as its `max_connections` allows.
    ConnectionLimit,
    /// TLS could not be set up: the server's certificate is not trusted (or not for this
    /// name), the client's certificate was refused, a TLS file is unusable, or one side
    /// requires TLS and the other does not speak it.
    Tls,
    /// The subject (or queue group) is empty, has empty tokens, whitespace, or a wildcard where
    /// none is allowed.
    InvalidSubject,
    /// The input given to the adapter cannot work: a bad URL, unreadable credentials, a header
    /// name or value NATS cannot carry.
    InvalidInput,
    /// A conditional write lost: the key exists already, its revision or the stream's last
    /// sequence moved on, or a stream or consumer was created by someone else between a
    /// lookup and a create (a change an existing stream cannot take is `InvalidInput`).
    Conflict,
    /// The stream, consumer, key or message does not exist.
    NotFound,
    /// Anything else: I/O, a closed connection, the server unreachable.
    Broker,
}

impl ErrorKind {
    /// A short stable name, used in logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::TimedOut => "timed_out",
            ErrorKind::NoResponders => "no_responders",
            ErrorKind::Refused => "refused",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::ConnectionLimit => "connection_limit",
            ErrorKind::Tls => "tls",
            ErrorKind::InvalidSubject => "invalid_subject",
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::Conflict => "conflict",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Broker => "broker",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The kinds an [`Error`] can be of: a small `Copy` enum with a stable name per variant. The
/// adapter's is [`ErrorKind`]; the coordinator and the gateway have their own, and share this
/// one error type (as async-nats's `Error<Kind>` is shared by its operations).
pub trait Kind: Copy + fmt::Debug + fmt::Display + Send + Sync + 'static {
    /// Whether the kind's name belongs in the error's text, after the context: yes where the
    /// context alone ("request to x") would not say what went wrong.
    fn in_text(self) -> bool {
        false
    }
}

/// Declares an error kind for [`Error`]: the enum (`Copy`, `#[non_exhaustive]`), its stable
/// names (`as_str`, `Display`) and its [`Kind`] implementation, so a crate above the adapter
/// has its own kinds over the one error type without writing the boilerplate again.
///
/// ```
/// chorus_broker_adapter::error_kind! {
///     /// What went wrong in my service.
///     pub enum MyKind {
///         /// The configuration cannot work.
///         Config = "config",
///         /// A file could not be read.
///         Io = "io",
///     }
/// }
/// let err = chorus_broker_adapter::error::Error::new(MyKind::Io, "cannot read a.toml");
/// assert_eq!(err.kind().as_str(), "io");
/// ```
#[macro_export]
macro_rules! error_kind {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vdoc:meta])* $variant:ident = $text:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        $vis enum $name {
            $( $(#[$vdoc])* $variant, )*
        }

        impl $name {
            /// A short stable name, used in logs.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )*
                }
            }
        }

        impl ::core::fmt::Display for $name {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl $crate::error::Kind for $name {}
    };
}

impl Kind for ErrorKind {
    fn in_text(self) -> bool {
        true
    }
}

/// An error: its [`kind`](Error::kind), a message saying what was being done, and the
/// underlying cause as [`source`](std::error::Error::source).
///
/// Its text is the context, then the kind where [`Kind::in_text`] says so, then the cause's own
/// text; the cause is also its [`source`](std::error::Error::source), and [`Report`] prints the
/// chain with each cause once.
pub struct Error<K = ErrorKind> {
    kind: K,
    context: String,
    source: Option<Source>,
}

impl<K: Kind> Error<K> {
    /// An error of `kind` with a human-readable context.
    pub fn new(kind: K, context: impl Into<String>) -> Self {
        Error {
            kind,
            context: context.into(),
            source: None,
        }
    }

    /// An error of `kind` that keeps its cause.
    pub fn with_source(kind: K, context: impl Into<String>, source: impl Into<Source>) -> Self {
        Error {
            kind,
            context: context.into(),
            source: Some(source.into()),
        }
    }

    /// A closure for `map_err` that wraps any error as one of `kind` with `context`.
    pub fn wrap<E>(kind: K, context: impl Into<String>) -> impl FnOnce(E) -> Self
    where
        E: Into<Source>,
    {
        let context = context.into();
        move |source| Error::with_source(kind, context, source)
    }

    /// What went wrong.
    pub fn kind(&self) -> K {
        self.kind
    }

    /// What was being done, without the cause.
    pub fn context(&self) -> &str {
        &self.context
    }
}

impl<K: Kind> fmt::Debug for Error<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.kind)
            .field("context", &self.context)
            .field("source", &self.source)
            .finish()
    }
}

impl<K: Kind> fmt::Display for Error<K> {
    /// The context, the kind where [`Kind::in_text`] says so, and the cause's own text: a
    /// message complete on its own. [`Report`] prints the rest of the chain without repeating
    /// it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)?;
        match (&self.source, self.kind.in_text()) {
            (Some(source), true) => write!(f, ": {} ({source})", self.kind),
            (None, true) => write!(f, ": {}", self.kind),
            (Some(source), false) => write!(f, ": {source}"),
            (None, false) => Ok(()),
        }
    }
}

/// An error and its causes on one line, each once. An error's text may already hold its cause
/// (this crate's do, as async-nats's do, so a message read alone is complete) while the cause
/// is also its [`source`](std::error::Error::source), kept for matching on its type: a reporter
/// walking the chain would print it twice. This one prints a cause only when the line does not
/// hold its text yet. Logs and the `chorus` command print errors with it.
///
/// ```
/// use chorus_broker_adapter::error::{Error, ErrorKind, Report};
/// let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
/// let err: Error = Error::with_source(ErrorKind::Broker, "cannot connect to NATS", refused);
/// assert_eq!(err.to_string(), "cannot connect to NATS: broker (connection refused)");
/// assert!(std::error::Error::source(&err).is_some());
/// assert_eq!(Report(&err).to_string(), err.to_string());
///
/// // An error that names its cause only as its source: the cause is added, once.
/// #[derive(Debug)]
/// struct Unsent(Error);
/// impl std::fmt::Display for Unsent {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("the order was not sent")
///     }
/// }
/// impl std::error::Error for Unsent {
///     fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
///         Some(&self.0)
///     }
/// }
/// assert_eq!(
///     Report(&Unsent(err)).to_string(),
///     "the order was not sent: cannot connect to NATS: broker (connection refused)"
/// );
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Report<'a, E: ?Sized>(pub &'a E);

impl<E: std::error::Error + ?Sized> fmt::Display for Report<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = self.0.to_string();
        let mut next = self.0.source();
        while let Some(cause) = next {
            let text = cause.to_string();
            if !text.is_empty() && !line.contains(&text) {
                line.push_str(": ");
                line.push_str(&text);
            }
            next = cause.source();
        }
        f.write_str(&line)
    }
}

impl<K: Kind> std::error::Error for Error<K> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

/// The cause of a [`ErrorKind::Refused`] error when the server refused a subject for this
/// connection's user: the server's words, such as `Permissions Violation for Subscription to
/// "_INBOX.x.abc"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermissionViolation(pub String);

impl fmt::Display for PermissionViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PermissionViolation {}

/// Result of a broker operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;
