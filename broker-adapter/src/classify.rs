//! Which [`ErrorKind`] an async-nats error is, decided by the kinds async-nats gives its errors
//! and by the error codes of JetStream's API, never by their text.
//!
//! Every async-nats error type the adapter meets implements [`Classify`] in the one table
//! below, so a call site that meets a new type does not compile until it is classified. An
//! error's own kind often says enough (`TimedOut`, `WrongLastRevision`); when it is generic
//! (`Request`, `Other`, `Ack`) async-nats keeps the cause as its source, and the first typed
//! error down that chain decides: another async-nats error or a JetStream API error with its
//! code. An error no one classifies is [`ErrorKind::Broker`].
//!
//! The server's `-ERR` lines reach the client as text only (`ServerError::Other(String)`);
//! the two the adapter must recognise are read in [`server_text`], and nowhere else.

use std::error::Error as StdError;

use async_nats::jetstream::{self, ErrorCode};

use crate::{Error, ErrorKind};

/// What an error's own kind says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// This kind, whatever the source says.
    Kind(ErrorKind),
    /// The server answered a JetStream API call with this error code.
    Code(ErrorCode),
    /// Generic: the source, if any, decides.
    Source,
}

/// An async-nats error the adapter knows how to classify.
pub(crate) trait Classify: StdError + Send + Sync + 'static {
    /// What this error's own kind says.
    fn verdict(&self) -> Verdict;
}

/// The adapter's error for `err`, with its kind, `context`, and `err` as its source.
pub(crate) fn classified<E: Classify>(context: impl Into<String>, err: E) -> Error {
    Error::with_source(kind(&err), context, err)
}

/// The adapter's error for an untyped async-nats error (acks return a boxed error): classified
/// by the typed errors in its chain, if any.
pub(crate) fn classified_boxed(
    context: impl Into<String>,
    err: Box<dyn StdError + Send + Sync + 'static>,
) -> Error {
    let kind = walk(None, Some(&*err)).unwrap_or(ErrorKind::Broker);
    Error::with_source(kind, context, err)
}

/// The kind of `err`.
pub(crate) fn kind<E: Classify>(err: &E) -> ErrorKind {
    walk(Some(err.verdict()), err.source()).unwrap_or(ErrorKind::Broker)
}

/// The JetStream error code the server answered with, if `err` (or its chain) carries one.
pub(crate) fn jetstream_code<E: Classify>(err: &E) -> Option<ErrorCode> {
    let mut verdict = Some(err.verdict());
    let mut next = err.source();
    loop {
        match verdict {
            Some(Verdict::Code(code)) => return Some(code),
            Some(Verdict::Kind(_)) => return None,
            Some(Verdict::Source) | None => {}
        }
        let e = next?;
        verdict = verdict_of(e);
        next = e.source();
    }
}

/// Follows `first` (the verdict of the error itself), then the source chain from `next`,
/// until a verdict decides.
fn walk(first: Option<Verdict>, mut next: Option<&(dyn StdError + 'static)>) -> Option<ErrorKind> {
    let mut verdict = first;
    loop {
        match verdict {
            Some(Verdict::Kind(kind)) => return Some(kind),
            Some(Verdict::Code(code)) => return Some(code_kind(code).unwrap_or(ErrorKind::Broker)),
            Some(Verdict::Source) | None => {}
        }
        let e = next?;
        verdict = verdict_of(e);
        next = e.source();
    }
}

/// What a JetStream API error code means to a caller; `None` for codes that are only a
/// broker failure.
pub(crate) fn code_kind(code: ErrorCode) -> Option<ErrorKind> {
    use ErrorKind::*;
    Some(match code {
        ErrorCode::STREAM_NOT_FOUND
        | ErrorCode::CONSUMER_NOT_FOUND
        | ErrorCode::CONSUMER_DOES_NOT_EXIST
        | ErrorCode::NO_MESSAGE_FOUND
        | ErrorCode::SEQUENCE_NOT_FOUND => NotFound,
        // A conditional write lost, or a name taken with another configuration.
        ErrorCode::STREAM_WRONG_LAST_SEQUENCE
        | ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID
        | ErrorCode::STREAM_NAME_EXIST
        | ErrorCode::CONSUMER_NAME_EXIST
        | ErrorCode::CONSUMER_ALREADY_EXISTS
        | ErrorCode::CONSUMER_EXISTING_ACTIVE => Conflict,
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM => {
            TooLarge
        }
        ErrorCode::BAD_REQUEST | ErrorCode::INVALID_JSON | ErrorCode::STREAM_INVALID_CONFIG => {
            InvalidInput
        }
        _ => return None,
    })
}

/// The server's `-ERR` texts the adapter must recognise. The NATS protocol gives these errors
/// as a line of text only, and async-nats 0.51 passes them on as `ServerError::Other(String)`
/// (it types only "authorization violation"), so here, and only here, text is read: each
/// function compares with the exact words nats-server sends.
pub(crate) mod server_text {
    /// nats-server's `ErrTooManyConnections`, sent when `max_connections` is reached.
    const MAX_CONNECTIONS: &str = "maximum connections exceeded";
    /// The start of nats-server's permission errors: `Permissions Violation for Publish to
    /// "x"`, `... for Subscription to "x"`, `... for Publish with Reply of "x"`.
    const PERMISSIONS_VIOLATION: &str = "permissions violation";

    /// Whether the server refused the connection for its `max_connections`.
    pub(crate) fn is_max_connections(text: &str) -> bool {
        text.trim().eq_ignore_ascii_case(MAX_CONNECTIONS)
    }

    /// Whether the server refused a publish or subscription for a permission.
    pub(crate) fn is_permissions_violation(text: &str) -> bool {
        text.get(..PERMISSIONS_VIOLATION.len())
            .is_some_and(|start| start.eq_ignore_ascii_case(PERMISSIONS_VIOLATION))
    }
}

/// A JetStream API error carried in a kind.
fn code(err: &jetstream::Error) -> Verdict {
    Verdict::Code(err.error_code())
}

/// One row per async-nats error type: how its kind is classified. The same list lets a source
/// chain be read (`verdict_of`), so a type added here is known in both places.
macro_rules! classify {
    ($($error:ty => |$this:ident| $verdict:expr;)*) => {
        $(impl Classify for $error {
            fn verdict(&self) -> Verdict {
                let $this = self;
                $verdict
            }
        })*

        /// The verdict of an error met in a source chain, if it is a type of the table or a
        /// JetStream API error.
        fn verdict_of(err: &(dyn StdError + 'static)) -> Option<Verdict> {
            $(if let Some(e) = err.downcast_ref::<$error>() {
                return Some(e.verdict());
            })*
            err.downcast_ref::<jetstream::Error>().map(code)
        }
    };
}

classify! {
    // A failed TLS handshake reaches async-nats as an I/O error wrapping rustls's.
    std::io::Error => |e| {
        if e.get_ref().is_some_and(|inner| inner.is::<async_nats::rustls::Error>()) {
            Verdict::Kind(ErrorKind::Tls)
        } else {
            Verdict::Source
        }
    };
    async_nats::rustls::Error => |_e| Verdict::Kind(ErrorKind::Tls);
    // Core NATS.
    async_nats::ConnectError => |e| {
        use async_nats::ConnectErrorKind as K;
        match e.kind() {
            K::Authentication | K::AuthorizationViolation => Verdict::Kind(ErrorKind::Refused),
            K::Tls => Verdict::Kind(ErrorKind::Tls),
            K::ServerParse => Verdict::Kind(ErrorKind::InvalidInput),
            K::Dns | K::TimedOut | K::MaxReconnects => Verdict::Kind(ErrorKind::Broker),
            // The server's -ERR during the handshake comes as the source.
            K::Io => Verdict::Source,
        }
    };
    async_nats::ServerError => |e| {
        use async_nats::ServerError as S;
        match e {
            S::AuthorizationViolation => Verdict::Kind(ErrorKind::Refused),
            S::Other(text) if server_text::is_max_connections(text) => {
                Verdict::Kind(ErrorKind::ConnectionLimit)
            }
            S::Other(text) if server_text::is_permissions_violation(text) => {
                Verdict::Kind(ErrorKind::Refused)
            }
            S::Other(_) | S::SlowConsumer(_) => Verdict::Source,
        }
    };
    async_nats::PublishError => |e| {
        use async_nats::PublishErrorKind as K;
        Verdict::Kind(match e.kind() {
            K::MaxPayloadExceeded => ErrorKind::TooLarge,
            K::InvalidSubject => ErrorKind::InvalidSubject,
            K::Send => ErrorKind::Broker,
        })
    };
    async_nats::RequestError => |e| {
        use async_nats::RequestErrorKind as K;
        Verdict::Kind(match e.kind() {
            K::TimedOut => ErrorKind::TimedOut,
            K::NoResponders => ErrorKind::NoResponders,
            K::InvalidSubject => ErrorKind::InvalidSubject,
            K::MaxPayloadExceeded => ErrorKind::TooLarge,
            K::Other => ErrorKind::Broker,
        })
    };
    async_nats::SubscribeError => |e| {
        use async_nats::SubscribeErrorKind as K;
        Verdict::Kind(match e.kind() {
            K::InvalidSubject | K::InvalidQueueName => ErrorKind::InvalidSubject,
            K::Other => ErrorKind::Broker,
        })
    };
    async_nats::client::FlushError => |e| {
        use async_nats::client::FlushErrorKind as K;
        match e.kind() {
            K::SendError | K::FlushError => Verdict::Kind(ErrorKind::Broker),
        }
    };
    async_nats::client::DrainError => |_e| Verdict::Source;
    async_nats::UnsubscribeError => |_e| Verdict::Kind(ErrorKind::Broker);

    // JetStream API requests.
    jetstream::context::RequestError => |e| {
        use jetstream::context::RequestErrorKind as K;
        match e.kind() {
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::InvalidSubject => Verdict::Kind(ErrorKind::InvalidSubject),
            // The JetStream API is not there (not enabled, or no permission to reach it).
            K::NoResponders => Verdict::Kind(ErrorKind::Broker),
            // The server's JetStream error, when there is one, is the source.
            K::Other => Verdict::Source,
        }
    };
    jetstream::context::PublishError => |e| {
        use jetstream::context::PublishErrorKind as K;
        match e.kind() {
            K::StreamNotFound => Verdict::Kind(ErrorKind::NotFound),
            K::WrongLastMessageId | K::WrongLastSequence => Verdict::Kind(ErrorKind::Conflict),
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::MaxPayloadExceeded => Verdict::Kind(ErrorKind::TooLarge),
            K::BrokenPipe | K::MaxAckPending => Verdict::Kind(ErrorKind::Broker),
            K::Other => Verdict::Source,
        }
    };
    jetstream::context::CreateStreamError => |e| {
        use jetstream::context::CreateStreamErrorKind as K;
        match e.kind() {
            K::EmptyStreamName | K::InvalidStreamName | K::DomainAndExternalSet => {
                Verdict::Kind(ErrorKind::InvalidInput)
            }
            K::NotFound => Verdict::Kind(ErrorKind::NotFound),
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::JetStream(err) => code(&err),
            K::JetStreamUnavailable => Verdict::Kind(ErrorKind::Broker),
            K::Response | K::ResponseParse => Verdict::Source,
        }
    };
    jetstream::context::GetStreamError => |e| {
        use jetstream::context::GetStreamErrorKind as K;
        match e.kind() {
            K::EmptyName | K::InvalidStreamName => Verdict::Kind(ErrorKind::InvalidInput),
            K::JetStream(err) => code(&err),
            K::Request => Verdict::Source,
        }
    };
    jetstream::context::ConsumerInfoError => |e| {
        use jetstream::context::ConsumerInfoErrorKind as K;
        match e.kind() {
            K::InvalidName => Verdict::Kind(ErrorKind::InvalidInput),
            K::NotFound | K::StreamNotFound => Verdict::Kind(ErrorKind::NotFound),
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::JetStream(err) => code(&err),
            K::Offline | K::NoResponders => Verdict::Kind(ErrorKind::Broker),
            K::Request => Verdict::Source,
        }
    };
    jetstream::context::KeyValueError => |e| {
        use jetstream::context::KeyValueErrorKind as K;
        match e.kind() {
            K::InvalidStoreName => Verdict::Kind(ErrorKind::InvalidInput),
            // The stream lookup's error (a missing bucket: STREAM_NOT_FOUND) is the source.
            K::GetBucket | K::JetStream => Verdict::Source,
        }
    };
    jetstream::context::CreateKeyValueError => |e| {
        use jetstream::context::CreateKeyValueErrorKind as K;
        match e.kind() {
            K::InvalidStoreName | K::TooLongHistory | K::LimitMarkersNotSupported => {
                Verdict::Kind(ErrorKind::InvalidInput)
            }
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::JetStream | K::BucketCreate => Verdict::Source,
        }
    };

    // Streams and consumers.
    jetstream::stream::DeleteMessageError => |e| {
        use jetstream::stream::DeleteMessageErrorKind as K;
        match e.kind() {
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::JetStream(err) => code(&err),
            K::Request => Verdict::Source,
        }
    };
    jetstream::stream::PurgeError => |e| {
        use jetstream::stream::PurgeErrorKind as K;
        match e.kind() {
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::JetStream(err) => code(&err),
            K::Request => Verdict::Source,
        }
    };
    jetstream::stream::RawMessageError => |e| {
        use jetstream::stream::RawMessageErrorKind as K;
        match e.kind() {
            K::NoMessageFound => Verdict::Kind(ErrorKind::NotFound),
            K::InvalidSubject => Verdict::Kind(ErrorKind::InvalidSubject),
            K::JetStream(err) => code(&err),
            K::Other => Verdict::Source,
        }
    };
    jetstream::stream::DirectGetError => |e| {
        use async_nats::StatusCode;
        use jetstream::stream::DirectGetErrorKind as K;
        match e.kind() {
            K::NotFound => Verdict::Kind(ErrorKind::NotFound),
            K::InvalidSubject => Verdict::Kind(ErrorKind::InvalidSubject),
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::ErrorResponse(StatusCode::NOT_FOUND, _) => Verdict::Kind(ErrorKind::NotFound),
            K::ErrorResponse(StatusCode::TIMEOUT, _) => Verdict::Kind(ErrorKind::TimedOut),
            K::ErrorResponse(..) => Verdict::Kind(ErrorKind::Broker),
            K::Request | K::Other => Verdict::Source,
        }
    };
    jetstream::stream::ConsumerError => |e| {
        use jetstream::stream::ConsumerErrorKind as K;
        match e.kind() {
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::InvalidConsumerType | K::InvalidName => Verdict::Kind(ErrorKind::InvalidInput),
            K::JetStream(err) => code(&err),
            K::Request | K::Other => Verdict::Source,
        }
    };
    jetstream::stream::ConsumerUpdateError => |e| {
        use jetstream::stream::ConsumerUpdateErrorKind as K;
        match e.kind() {
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::InvalidConsumerType | K::InvalidName => Verdict::Kind(ErrorKind::InvalidInput),
            K::DoesNotExist => Verdict::Kind(ErrorKind::NotFound),
            K::JetStream(err) => code(&err),
            K::Request | K::Other => Verdict::Source,
        }
    };
    jetstream::consumer::StreamError => |e| {
        use jetstream::consumer::StreamErrorKind as K;
        match e.kind() {
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::Other => Verdict::Source,
        }
    };
    jetstream::consumer::pull::MessagesError => |e| {
        use jetstream::consumer::pull::MessagesErrorKind as K;
        match e.kind() {
            K::ConsumerDeleted => Verdict::Kind(ErrorKind::NotFound),
            K::PushBasedConsumer => Verdict::Kind(ErrorKind::InvalidInput),
            // The server is away (missed heartbeats, nobody answering the pull), or the
            // consumer's limits refuse the pull's size.
            K::MissingHeartbeat | K::NoResponders | K::RequestLimitExceeded => {
                Verdict::Kind(ErrorKind::Broker)
            }
            K::Pull | K::Other => Verdict::Source,
        }
    };
    jetstream::consumer::pull::OrderedError => |e| {
        use jetstream::consumer::pull::OrderedErrorKind as K;
        match e.kind() {
            K::ConsumerDeleted => Verdict::Kind(ErrorKind::NotFound),
            K::PushBasedConsumer => Verdict::Kind(ErrorKind::InvalidInput),
            K::MissingHeartbeat | K::NoResponders | K::RequestLimitExceeded => {
                Verdict::Kind(ErrorKind::Broker)
            }
            K::Pull | K::Recreate | K::Other => Verdict::Source,
        }
    };

    // Key-value buckets.
    jetstream::kv::EntryError => |e| {
        use jetstream::kv::EntryErrorKind as K;
        match e.kind() {
            K::InvalidKey => Verdict::Kind(ErrorKind::InvalidInput),
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::Other => Verdict::Source,
        }
    };
    jetstream::kv::PutError => |e| {
        use jetstream::kv::PutErrorKind as K;
        match e.kind() {
            K::InvalidKey => Verdict::Kind(ErrorKind::InvalidInput),
            // The publish or its ack failed: that error is the source.
            K::Publish | K::Ack => Verdict::Source,
        }
    };
    jetstream::kv::CreateError => |e| {
        use jetstream::kv::CreateErrorKind as K;
        match e.kind() {
            K::AlreadyExists => Verdict::Kind(ErrorKind::Conflict),
            K::InvalidKey => Verdict::Kind(ErrorKind::InvalidInput),
            K::Publish | K::Ack | K::Other => Verdict::Source,
        }
    };
    // Also `kv::DeleteError` and `kv::PurgeError`.
    jetstream::kv::UpdateError => |e| {
        use jetstream::kv::UpdateErrorKind as K;
        match e.kind() {
            K::WrongLastRevision => Verdict::Kind(ErrorKind::Conflict),
            K::InvalidKey => Verdict::Kind(ErrorKind::InvalidInput),
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::Other => Verdict::Source,
        }
    };
    // Also `kv::HistoryError`.
    jetstream::kv::WatchError => |e| {
        use jetstream::kv::WatchErrorKind as K;
        match e.kind() {
            K::InvalidKey => Verdict::Kind(ErrorKind::InvalidInput),
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::ConsumerCreate | K::Other => Verdict::Source,
        }
    };
    jetstream::kv::WatcherError => |e| {
        use jetstream::kv::WatcherErrorKind as K;
        match e.kind() {
            K::Consumer | K::Other => Verdict::Source,
        }
    };

    // Object store buckets (a bucket's creation is a key-value creation error).
    jetstream::context::ObjectStoreError => |e| {
        use jetstream::context::ObjectStoreErrorKind as K;
        match e.kind() {
            K::InvalidBucketName => Verdict::Kind(ErrorKind::InvalidInput),
            K::GetStore => Verdict::Source,
        }
    };
    jetstream::object_store::GetError => |e| {
        use jetstream::object_store::GetErrorKind as K;
        match e.kind() {
            K::InvalidName => Verdict::Kind(ErrorKind::InvalidInput),
            K::NotFound => Verdict::Kind(ErrorKind::NotFound),
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::ConsumerCreate | K::BucketLink | K::Other => Verdict::Source,
        }
    };
    jetstream::object_store::PutError => |e| {
        use jetstream::object_store::PutErrorKind as K;
        match e.kind() {
            K::InvalidName => Verdict::Kind(ErrorKind::InvalidInput),
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::ReadChunks | K::PublishChunks | K::PublishMetadata | K::PurgeOldChunks | K::Other => {
                Verdict::Source
            }
        }
    };
    jetstream::object_store::DeleteError => |e| {
        use jetstream::object_store::DeleteErrorKind as K;
        match e.kind() {
            K::InvalidName => Verdict::Kind(ErrorKind::InvalidInput),
            K::NotFound => Verdict::Kind(ErrorKind::NotFound),
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::Metadata | K::Chunks | K::Other => Verdict::Source,
        }
    };
    jetstream::object_store::WatchError => |e| {
        use jetstream::object_store::WatchErrorKind as K;
        match e.kind() {
            K::TimedOut => Verdict::Kind(ErrorKind::TimedOut),
            K::ConsumerCreate | K::Other => Verdict::Source,
        }
    };
    jetstream::object_store::WatcherError => |e| {
        use jetstream::object_store::WatcherErrorKind as K;
        match e.kind() {
            K::ConsumerError | K::Other => Verdict::Source,
        }
    };
}

/// The mapping, on async-nats error values built here. What a real nats-server answers, and the
/// kind the adapter's calls then return, is tested in `tests/classify.rs` and end to end in
/// `tests/tests/e2e`.
#[cfg(test)]
mod tests {
    use async_nats::jetstream::context::{
        ConsumerInfoError, ConsumerInfoErrorKind, GetStreamError, GetStreamErrorKind,
        KeyValueError, KeyValueErrorKind, PublishError as JsPublishError,
        PublishErrorKind as JsPublishErrorKind, RequestError as JsRequestError,
        RequestErrorKind as JsRequestErrorKind,
    };
    use async_nats::jetstream::{consumer::pull, kv, stream};
    use async_nats::{ConnectError, ConnectErrorKind, ServerError};

    use super::*;

    fn kind_of<E: Classify>(err: E) -> ErrorKind {
        classified("test", err).kind()
    }

    #[test]
    fn connect_errors_by_kind() {
        use ConnectErrorKind as K;
        for (k, want) in [
            (K::Authentication, ErrorKind::Refused),
            (K::AuthorizationViolation, ErrorKind::Refused),
            (K::ServerParse, ErrorKind::InvalidInput),
            (K::Tls, ErrorKind::Tls),
            (K::Dns, ErrorKind::Broker),
            (K::TimedOut, ErrorKind::Broker),
            (K::MaxReconnects, ErrorKind::Broker),
            (K::Io, ErrorKind::Broker),
        ] {
            assert_eq!(kind_of(ConnectError::new(k)), want, "{k:?}");
        }
    }

    #[test]
    fn a_full_server_is_a_connection_limit_and_other_server_errors_are_not() {
        let full = ServerError::Other("maximum connections exceeded".into());
        assert_eq!(
            kind_of(ConnectError::with_source(ConnectErrorKind::Io, full)),
            ErrorKind::ConnectionLimit
        );
        let other = ServerError::Other("unknown protocol operation".into());
        assert_eq!(
            kind_of(ConnectError::with_source(ConnectErrorKind::Io, other)),
            ErrorKind::Broker
        );
        // An I/O timeout while connecting is the server unreachable, as before.
        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "slow");
        assert_eq!(
            kind_of(ConnectError::with_source(ConnectErrorKind::Io, io)),
            ErrorKind::Broker
        );
    }

    #[test]
    fn server_texts_are_the_servers_exact_words() {
        assert!(server_text::is_max_connections(
            "maximum connections exceeded"
        ));
        assert!(server_text::is_max_connections(
            "Maximum Connections Exceeded"
        ));
        assert!(!server_text::is_max_connections(
            "maximum payload violation"
        ));
        assert!(server_text::is_permissions_violation(
            "Permissions Violation for Publish to \"secret\""
        ));
        assert!(server_text::is_permissions_violation(
            "permissions violation for subscription to \"x\""
        ));
        assert!(!server_text::is_permissions_violation("Permissions"));
        assert!(!server_text::is_permissions_violation(
            "stale connection, no permissions violation"
        ));
    }

    #[test]
    fn core_errors_by_kind() {
        use async_nats::{PublishErrorKind as P, RequestErrorKind as R, SubscribeErrorKind as S};
        let publish = async_nats::PublishError::new;
        assert_eq!(kind_of(publish(P::MaxPayloadExceeded)), ErrorKind::TooLarge);
        assert_eq!(
            kind_of(publish(P::InvalidSubject)),
            ErrorKind::InvalidSubject
        );
        assert_eq!(kind_of(publish(P::Send)), ErrorKind::Broker);
        let request = async_nats::RequestError::new;
        assert_eq!(kind_of(request(R::TimedOut)), ErrorKind::TimedOut);
        assert_eq!(kind_of(request(R::NoResponders)), ErrorKind::NoResponders);
        assert_eq!(
            kind_of(request(R::InvalidSubject)),
            ErrorKind::InvalidSubject
        );
        assert_eq!(kind_of(request(R::MaxPayloadExceeded)), ErrorKind::TooLarge);
        assert_eq!(kind_of(request(R::Other)), ErrorKind::Broker);
        let subscribe = async_nats::SubscribeError::new;
        assert_eq!(
            kind_of(subscribe(S::InvalidSubject)),
            ErrorKind::InvalidSubject
        );
        assert_eq!(kind_of(subscribe(S::Other)), ErrorKind::Broker);
    }

    #[test]
    fn jetstream_publish_errors_by_kind() {
        use JsPublishErrorKind as K;
        for (k, want) in [
            (K::StreamNotFound, ErrorKind::NotFound),
            (K::WrongLastSequence, ErrorKind::Conflict),
            (K::WrongLastMessageId, ErrorKind::Conflict),
            (K::TimedOut, ErrorKind::TimedOut),
            (K::MaxPayloadExceeded, ErrorKind::TooLarge),
            (K::BrokenPipe, ErrorKind::Broker),
            (K::MaxAckPending, ErrorKind::Broker),
            (K::Other, ErrorKind::Broker),
        ] {
            assert_eq!(kind_of(JsPublishError::new(k)), want, "{k:?}");
        }
    }

    #[test]
    fn lookups_that_find_nothing_are_not_found() {
        assert_eq!(
            kind_of(ConsumerInfoError::new(ConsumerInfoErrorKind::NotFound)),
            ErrorKind::NotFound
        );
        assert_eq!(
            kind_of(ConsumerInfoError::new(
                ConsumerInfoErrorKind::StreamNotFound
            )),
            ErrorKind::NotFound
        );
        assert_eq!(
            kind_of(ConsumerInfoError::new(ConsumerInfoErrorKind::TimedOut)),
            ErrorKind::TimedOut
        );
        assert_eq!(
            kind_of(stream::RawMessageError::new(
                stream::RawMessageErrorKind::NoMessageFound
            )),
            ErrorKind::NotFound
        );
        assert_eq!(
            kind_of(stream::ConsumerUpdateError::new(
                stream::ConsumerUpdateErrorKind::DoesNotExist
            )),
            ErrorKind::NotFound
        );
        assert_eq!(
            kind_of(pull::MessagesError::new(
                pull::MessagesErrorKind::ConsumerDeleted
            )),
            ErrorKind::NotFound
        );
        assert_eq!(
            kind_of(pull::MessagesError::new(
                pull::MessagesErrorKind::MissingHeartbeat
            )),
            ErrorKind::Broker
        );
        assert_eq!(
            kind_of(GetStreamError::new(GetStreamErrorKind::InvalidStreamName)),
            ErrorKind::InvalidInput
        );
    }

    #[test]
    fn key_value_conditional_writes_that_lose_are_conflicts() {
        assert_eq!(
            kind_of(kv::CreateError::new(kv::CreateErrorKind::AlreadyExists)),
            ErrorKind::Conflict
        );
        assert_eq!(
            kind_of(kv::UpdateError::new(kv::UpdateErrorKind::WrongLastRevision)),
            ErrorKind::Conflict
        );
        // What `Kv::delete_if` meets: async-nats's own conversion of the publish's
        // wrong-last-sequence answer into a delete error.
        let lost =
            kv::DeleteError::from(JsPublishError::new(JsPublishErrorKind::WrongLastSequence));
        assert_eq!(kind_of(lost), ErrorKind::Conflict);
        let slow = kv::DeleteError::from(JsPublishError::new(JsPublishErrorKind::TimedOut));
        assert_eq!(kind_of(slow), ErrorKind::TimedOut);
        assert_eq!(
            kind_of(kv::EntryError::new(kv::EntryErrorKind::InvalidKey)),
            ErrorKind::InvalidInput
        );
    }

    #[test]
    fn a_generic_kind_is_decided_by_its_source() {
        // A put whose ack timed out.
        let put = kv::PutError::with_source(
            kv::PutErrorKind::Ack,
            JsPublishError::new(JsPublishErrorKind::TimedOut),
        );
        assert_eq!(kind_of(put), ErrorKind::TimedOut);
        // A bucket lookup whose stream lookup timed out, two levels down.
        let bucket = KeyValueError::with_source(
            KeyValueErrorKind::GetBucket,
            GetStreamError::with_source(
                GetStreamErrorKind::Request,
                JsRequestError::new(JsRequestErrorKind::TimedOut),
            ),
        );
        assert_eq!(kind_of(bucket), ErrorKind::TimedOut);
        // A generic kind with nothing typed below it.
        let other =
            kv::CreateError::with_source(kv::CreateErrorKind::Other, std::io::Error::other("disk"));
        assert_eq!(kind_of(other), ErrorKind::Broker);
        // A boxed error (what acks return) is read the same way.
        let boxed: Box<dyn StdError + Send + Sync> = Box::new(async_nats::PublishError::new(
            async_nats::PublishErrorKind::Send,
        ));
        assert_eq!(classified_boxed("ack", boxed).kind(), ErrorKind::Broker);
        let boxed: Box<dyn StdError + Send + Sync> =
            Box::new(JsRequestError::new(JsRequestErrorKind::TimedOut));
        assert_eq!(classified_boxed("ack", boxed).kind(), ErrorKind::TimedOut);
    }

    #[test]
    fn jetstream_codes_by_meaning() {
        for (code, want) in [
            (ErrorCode::STREAM_NOT_FOUND, Some(ErrorKind::NotFound)),
            (ErrorCode::CONSUMER_NOT_FOUND, Some(ErrorKind::NotFound)),
            (ErrorCode::NO_MESSAGE_FOUND, Some(ErrorKind::NotFound)),
            (ErrorCode::SEQUENCE_NOT_FOUND, Some(ErrorKind::NotFound)),
            (
                ErrorCode::STREAM_WRONG_LAST_SEQUENCE,
                Some(ErrorKind::Conflict),
            ),
            (ErrorCode::STREAM_NAME_EXIST, Some(ErrorKind::Conflict)),
            (
                ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM,
                Some(ErrorKind::TooLarge),
            ),
            (ErrorCode::BAD_REQUEST, Some(ErrorKind::InvalidInput)),
            (ErrorCode::STORAGE_RESOURCES_EXCEEDED, None),
            (ErrorCode::INSUFFICIENT_RESOURCES, None),
            (ErrorCode::STREAM_MESSAGE_DELETE_FAILED, None),
        ] {
            assert_eq!(code_kind(code), want, "{code:?}");
        }
    }
}
