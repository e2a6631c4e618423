//! Messages and headers as the rest of Chorus sees them, without exposing `async_nats` types.

use std::str::FromStr;

use bytes::Bytes;

use crate::{Error, ErrorKind, Result};

/// NATS message headers.
#[derive(Debug, Clone, Default)]
pub struct Headers(pub(crate) async_nats::HeaderMap);

impl Headers {
    /// An empty header map.
    pub fn new() -> Self {
        Headers::default()
    }

    /// Sets `name` to `value`, replacing earlier values. Names must be printable ASCII without
    /// `:`; values must not contain CR or LF.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for a name that is not printable ASCII without `:`, or a value
    /// with a CR or LF.
    pub fn insert(&mut self, name: &str, value: &str) -> Result<()> {
        let header = async_nats::header::HeaderName::from_str(name).map_err(|_| {
            Error::new(
                ErrorKind::InvalidInput,
                format!("header name {name:?} is not printable ASCII without ':'"),
            )
        })?;
        if value.contains(['\r', '\n']) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("header {name} has a line break in its value"),
            ));
        }
        self.0.insert(header, value);
        Ok(())
    }

    /// The last value of `name`, if any and if valid UTF-8.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get_last(name).map(|v| v.as_str())
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// All (name, value) pairs.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().flat_map(|(name, values)| {
            let name: &str = name.as_ref();
            values.iter().map(move |v| (name, v.as_str()))
        })
    }
}

/// A message received from NATS.
#[derive(Debug, Clone)]
pub struct Message {
    inner: async_nats::Message,
}

impl Message {
    pub(crate) fn from_nats(inner: async_nats::Message) -> Self {
        Message { inner }
    }

    /// The subject it was published to.
    pub fn subject(&self) -> &str {
        self.inner.subject.as_str()
    }

    /// The subject, shared with the message (no copy).
    pub fn shared_subject(&self) -> async_nats::Subject {
        self.inner.subject.clone()
    }

    /// Where a reply should go, if the sender expects one.
    pub fn reply(&self) -> Option<&str> {
        self.inner.reply.as_ref().map(|r| r.as_str())
    }

    /// The payload bytes.
    pub fn payload(&self) -> &Bytes {
        &self.inner.payload
    }

    /// Takes the payload out of the message.
    pub fn into_payload(self) -> Bytes {
        self.inner.payload
    }

    /// A header value, if the message has headers and this one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.inner
            .headers
            .as_ref()
            .and_then(|h| h.get_last(name))
            .map(|v| v.as_str())
    }

    /// Size of the message as received (subject, headers and payload).
    pub fn len(&self) -> usize {
        self.inner.length
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.payload.is_empty()
    }
}
