//! The protocol version, `major.minor`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Protocol version `major.minor`, written as the string `"1.0"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Incompatible changes. A receiver refuses a major it does not know.
    pub major: u16,
    /// Compatible additions. A receiver accepts a newer minor and ignores unknown fields.
    pub minor: u16,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// A protocol version that is not `<major>.<minor>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad version {0:?}")]
pub struct VersionError(String);

impl FromStr for Version {
    type Err = VersionError;
    fn from_str(s: &str) -> Result<Self, VersionError> {
        let (major, minor) = s.split_once('.').unwrap_or((s, "0"));
        // Any run of digits is a number: one past u16 is kept as u16::MAX, so `1.99999` is a
        // (newer) minor of 1 and accepted, and `99999.0` an unknown major and refused as such.
        let parse = |p: &str| {
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                return Err(VersionError(s.to_owned()));
            }
            Ok(p.parse::<u16>().unwrap_or(u16::MAX))
        };
        Ok(Version {
            major: parse(major)?,
            minor: parse(minor)?,
        })
    }
}

impl Serialize for Version {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Version {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
