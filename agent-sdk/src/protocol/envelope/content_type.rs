//! The content type of a payload, held without an allocation when it is a common one.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{CONTENT_TYPE_ENCRYPTED, CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK};

/// The content type of a payload. The common ones (MessagePack, JSON, bytes, text, an
/// encrypted payload) are held as static text, so reading one from the wire allocates nothing;
/// any other is kept as it came. It reads as a `&str` (`Deref`), compares with text, and is
/// made from text with `into()`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentType(std::borrow::Cow<'static, str>);

/// The content types held without an allocation.
pub(super) const KNOWN_CONTENT_TYPES: [&str; 5] = [
    CONTENT_TYPE_MSGPACK,
    CONTENT_TYPE_JSON,
    "application/octet-stream",
    "text/plain",
    CONTENT_TYPE_ENCRYPTED,
];

impl ContentType {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn known(text: &str) -> Option<&'static str> {
        KNOWN_CONTENT_TYPES.iter().copied().find(|k| *k == text)
    }
}

impl Default for ContentType {
    /// MessagePack, the default.
    fn default() -> Self {
        ContentType(std::borrow::Cow::Borrowed(CONTENT_TYPE_MSGPACK))
    }
}

impl std::ops::Deref for ContentType {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for ContentType {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<&str> for ContentType {
    fn from(text: &str) -> Self {
        match ContentType::known(text) {
            Some(known) => ContentType(std::borrow::Cow::Borrowed(known)),
            None => ContentType(std::borrow::Cow::Owned(text.to_owned())),
        }
    }
}

impl From<String> for ContentType {
    fn from(text: String) -> Self {
        match ContentType::known(&text) {
            Some(known) => ContentType(std::borrow::Cow::Borrowed(known)),
            None => ContentType(std::borrow::Cow::Owned(text)),
        }
    }
}

impl From<&String> for ContentType {
    fn from(text: &String) -> Self {
        ContentType::from(text.as_str())
    }
}

impl From<ContentType> for String {
    fn from(ct: ContentType) -> String {
        ct.0.into_owned()
    }
}

impl PartialEq<str> for ContentType {
    fn eq(&self, other: &str) -> bool {
        *self.0 == *other
    }
}

impl PartialEq<&str> for ContentType {
    fn eq(&self, other: &&str) -> bool {
        *self.0 == **other
    }
}

impl PartialEq<String> for ContentType {
    fn eq(&self, other: &String) -> bool {
        *self.0 == **other
    }
}

impl PartialEq<ContentType> for &str {
    fn eq(&self, other: &ContentType) -> bool {
        **self == *other.0
    }
}

impl PartialEq<ContentType> for String {
    fn eq(&self, other: &ContentType) -> bool {
        **self == *other.0
    }
}

impl fmt::Display for ContentType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ContentType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl Serialize for ContentType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ContentType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(TextVisitor::<ContentType>::new("a content type"))
    }
}

/// Reads a value made from text, borrowing the text where the format lends it (so a value
/// that keeps no copy, as a common content type or a canonical `traceparent`, allocates
/// nothing).
pub(super) struct TextVisitor<T> {
    expecting: &'static str,
    made: std::marker::PhantomData<T>,
}

impl<T> TextVisitor<T> {
    pub(super) fn new(expecting: &'static str) -> Self {
        TextVisitor {
            expecting,
            made: std::marker::PhantomData,
        }
    }
}

impl<T: for<'a> From<&'a str> + From<String>> serde::de::Visitor<'_> for TextVisitor<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
        Ok(T::from(v))
    }
    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<T, E> {
        Ok(T::from(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::envelope::Envelope;

    #[test]
    fn common_content_types_are_static_text_and_others_are_kept() {
        for known in KNOWN_CONTENT_TYPES {
            let ct = ContentType::from(known.to_owned());
            assert!(matches!(ct.0, std::borrow::Cow::Borrowed(_)), "{known}");
            assert_eq!(ct, known);
        }
        let other = ContentType::from("application/vnd.example+cbor");
        assert!(matches!(other.0, std::borrow::Cow::Owned(_)));
        assert_eq!(other.as_str(), "application/vnd.example+cbor");
        assert_eq!(ContentType::default(), CONTENT_TYPE_MSGPACK);
        let json = serde_json::to_string(&other).expect("json");
        assert_eq!(json, r#""application/vnd.example+cbor""#);
        assert_eq!(
            serde_json::from_str::<ContentType>(&json).expect("reads"),
            other
        );
        // An envelope without one reads as MessagePack.
        let env: Envelope = serde_json::from_str(
            r#"{"version":"1.0","id":"018f0000-0000-7000-8000-000000000000","from":"a","kind":"event","performative":"inform","timestamp_ms":1}"#,
        )
        .expect("an envelope");
        assert_eq!(env.content_type, CONTENT_TYPE_MSGPACK);
    }
}
