//! Large payloads (`docs/PROTOCOL.md` section 7.11). Above one size a payload is compressed
//! with zstd, when its reader's manifest says it reads zstd; above a larger one (by default
//! the server's `max_payload`, less room for the envelope) it travels by reference: it is
//! stored in parts in the bus's payload bucket under the writer's own name, the message
//! carries an [`ObjectRef`] with its size and SHA-256 digest, and the server removes the parts
//! once the message's time to live has passed (their own TTL; the bucket's age limit for
//! messages that never expire).
//!
//! On the way out a payload is compressed (before encryption: ciphertext does not compress,
//! so an encrypted payload is not), then stored by reference, then signed: the signature
//! covers the reference and so the digest of what it points to. On the way in the signature
//! is checked, the object fetched and its digest compared, then the payload is decrypted and
//! decompressed. Both directions are transparent to handlers and callers.

mod compress;
mod objects;

use std::time::Duration;

pub use compress::{compress, decompress, open_encoding};
pub use objects::{ObjectRef, payload_bucket, payload_permissions};
pub(crate) use objects::{fetch, store};

/// Content type of a payload carried by reference: its bytes are an [`ObjectRef`] in
/// MessagePack, and the payload's own content type is in the reference.
pub const CONTENT_TYPE_OBJECT: &str = "application/chorus-object";
/// The one content encoding Chorus writes.
pub const ZSTD: &str = "zstd";
/// Suffix of the payload bucket's name (`<root>_payloads`, a key-value bucket).
pub const PAYLOAD_BUCKET: &str = "payloads";
/// Payloads at least this large are compressed for readers that read zstd, by default.
pub const DEFAULT_COMPRESS_ABOVE: usize = 64 * 1024;
/// The largest payload an agent sends or takes by reference, by default.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 64 * 1024 * 1024;
/// Room left for the envelope and headers under the server's `max_payload`: a payload larger
/// than `max_payload` less this goes by reference.
pub const INLINE_HEADROOM: usize = 64 * 1024;
/// How long an object is kept for a message that does not expire (the durable inbox's own
/// default age), and the bucket's age limit.
pub const DEFAULT_PAYLOAD_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long an object outlives its message's expiry by default: room for the clocks of the
/// sender and the reader to differ.
pub const PAYLOAD_GRACE: Duration = Duration::from_secs(60);

/// An agent's limits for large payloads ([`AgentOptions::payload_limits`](crate::AgentOptions::payload_limits)).
/// Start from the defaults and change what differs:
///
/// ```
/// use chorus_sdk::payload::PayloadLimits;
/// let strict = PayloadLimits::default().max_bytes(1024 * 1024).accept_compressed(false);
/// assert_eq!(strict.max_bytes, 1024 * 1024);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PayloadLimits {
    /// Compress payloads at least this large for readers that read zstd; `None`: never.
    pub compress_above: Option<usize>,
    /// Send payloads larger than this by reference; `None`: the server's `max_payload` less
    /// [`INLINE_HEADROOM`].
    pub inline_max: Option<usize>,
    /// The largest payload sent or taken by reference (larger is refused with 5006).
    pub max_bytes: usize,
    /// Say in the manifest that this agent reads zstd, so senders compress for it.
    pub accept_compressed: bool,
    /// How long an object outlives the expiry of the message that carries it (default 60 s).
    pub keep_after_expiry: Duration,
}

impl Default for PayloadLimits {
    fn default() -> Self {
        PayloadLimits {
            compress_above: Some(DEFAULT_COMPRESS_ABOVE),
            inline_max: None,
            max_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            accept_compressed: true,
            keep_after_expiry: PAYLOAD_GRACE,
        }
    }
}

impl PayloadLimits {
    /// Compresses payloads at least `bytes` large for readers that read zstd; `None`: never.
    pub fn compress_above(mut self, bytes: Option<usize>) -> Self {
        self.compress_above = bytes;
        self
    }

    /// Sends payloads larger than `bytes` by reference; `None`: the server's `max_payload`
    /// less [`INLINE_HEADROOM`].
    pub fn inline_max(mut self, bytes: Option<usize>) -> Self {
        self.inline_max = bytes;
        self
    }

    /// The largest payload sent or taken by reference.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// Whether the manifest says this agent reads zstd.
    pub fn accept_compressed(mut self, accept: bool) -> Self {
        self.accept_compressed = accept;
        self
    }

    /// How long an object outlives the expiry of the message that carries it.
    pub fn keep_after_expiry(mut self, keep: Duration) -> Self {
        self.keep_after_expiry = keep;
        self
    }

    /// The size above which a payload goes by reference on a server whose `max_payload` is
    /// `server_max`.
    pub fn inline_max_for(&self, server_max: usize) -> usize {
        self.inline_max
            .unwrap_or_else(|| server_max.saturating_sub(INLINE_HEADROOM).max(1024))
    }

    /// The chunks an object is stored in on a server whose `max_payload` is `server_max`:
    /// half of it, between 16 KiB and 1 MiB.
    pub fn chunk_for(server_max: usize) -> usize {
        (server_max / 2).clamp(16 * 1024, 1024 * 1024)
    }
}
