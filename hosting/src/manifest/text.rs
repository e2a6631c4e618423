//! How a manifest's durations and paths are written as text, so that a written manifest
//! reads back equal.

/// Durations as text (`"500ms"`, `"10m"`): read with [`crate::duration::parse_duration`],
/// written with [`format_duration`], so a written manifest reads back equal.
pub(super) mod duration_text {
    use std::borrow::Cow;
    use std::time::Duration;

    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::duration::{format_duration, parse_duration};

    pub(in crate::manifest) fn serialize<S: Serializer>(
        duration: &Duration,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&format_duration(*duration))
    }

    pub(in crate::manifest) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Duration, D::Error> {
        let text = Cow::<'de, str>::deserialize(deserializer)?;
        parse_duration(&text).map_err(|e| D::Error::custom(format!("not a duration: {e}")))
    }
}

/// Paths written as text, lossily: a manifest that validated holds only UTF-8 paths, so
/// nothing is lost, and serializing never fails.
pub(super) mod path_text {
    use std::path::PathBuf;

    use serde::Serializer;

    // serde's `serialize_with` hands the field by reference.
    pub(in crate::manifest) fn serialize<S: Serializer>(
        path: &Option<PathBuf>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match path {
            Some(path) => serializer.serialize_some(&path.to_string_lossy()),
            None => serializer.serialize_none(),
        }
    }
}
