//! The checks a manifest's fields go through, each naming the field it refuses.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use chorus_sdk::subject::validate_token;

use super::{MAX_DURATION, MAX_MANIFEST_BYTES, ManifestError};
use crate::duration::format_duration;

pub(super) fn check_size(bytes: usize) -> Result<(), ManifestError> {
    if bytes > MAX_MANIFEST_BYTES {
        return Err(ManifestError::TooLarge {
            bytes: bytes as u64,
            limit: MAX_MANIFEST_BYTES,
        });
    }
    Ok(())
}

pub(super) fn check_token(
    field: &str,
    what: &'static str,
    value: &str,
) -> Result<(), ManifestError> {
    validate_token(what, value).map_err(|e| ManifestError::invalid(field, e.to_string()))
}

pub(super) fn check_count(field: &str, count: usize, max: usize) -> Result<(), ManifestError> {
    if count > max {
        return Err(ManifestError::invalid(
            field,
            format!("{count} entries, more than {max}"),
        ));
    }
    Ok(())
}

pub(super) fn check_unique(field: &str, values: &[String]) -> Result<(), ManifestError> {
    let mut seen = BTreeSet::new();
    for (i, value) in values.iter().enumerate() {
        if !seen.insert(value.as_str()) {
            return Err(ManifestError::invalid(
                format!("{field}[{i}]"),
                format!("{value:?} is listed twice"),
            ));
        }
    }
    Ok(())
}

pub(super) fn check_no_nul(field: &str, value: &str) -> Result<(), ManifestError> {
    if value.contains('\0') {
        return Err(ManifestError::invalid(
            field,
            "contains a NUL character, which no program argument or variable can hold",
        ));
    }
    Ok(())
}

pub(super) fn check_path(field: &str, path: &Path) -> Result<(), ManifestError> {
    let Some(text) = path.to_str() else {
        return Err(ManifestError::invalid(field, "is not valid UTF-8"));
    };
    if text.is_empty() {
        return Err(ManifestError::invalid(field, "is empty"));
    }
    check_no_nul(field, text)
}

pub(super) fn check_duration(field: &str, duration: Duration) -> Result<(), ManifestError> {
    if duration.is_zero() {
        return Err(ManifestError::invalid(
            field,
            "0s is no time: give a duration above zero",
        ));
    }
    if duration > MAX_DURATION {
        return Err(ManifestError::invalid(
            field,
            format!(
                "{} is longer than the longest allowed, {}",
                format_duration(duration),
                format_duration(MAX_DURATION)
            ),
        ));
    }
    Ok(())
}
