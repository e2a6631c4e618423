//! Subject validation shared by every operation of the adapter.
//!
//! The rules are NATS's own, applied before anything reaches the wire so a bad subject is a
//! typed [`ErrorKind::InvalidSubject`](crate::ErrorKind::InvalidSubject) at the call site rather
//! than a protocol error that closes the connection.

use crate::{Error, ErrorKind, Result};

/// Largest subject accepted, in bytes. NATS has no hard limit; long subjects cost on every
/// message and in every server's interest graph.
pub const MAX_SUBJECT_LEN: usize = 512;

/// Whether wildcards (`*`, `>`) are allowed in the subject being checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wildcards {
    /// Publishing: wildcards are refused.
    Refuse,
    /// Subscribing: `*` as a whole token anywhere, `>` as the last token.
    Allow,
}

/// Checks `subject` against NATS's rules: non-empty tokens separated by `.`, no whitespace or
/// control characters, and wildcards only where `wildcards` allows them.
pub fn validate_subject(subject: &str, wildcards: Wildcards) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::new(
            ErrorKind::InvalidSubject,
            format!("subject {subject:?} {why}"),
        ))
    };
    if subject.is_empty() {
        return bad("is empty");
    }
    if subject.len() > MAX_SUBJECT_LEN {
        return bad("is too long");
    }
    let mut tokens = subject.split('.').peekable();
    while let Some(token) = tokens.next() {
        if token.is_empty() {
            return bad("has an empty token");
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return bad("contains whitespace or a control character");
        }
        let is_wild = token == "*" || token == ">";
        if token.contains(['*', '>']) && !is_wild {
            return bad("has a wildcard inside a token");
        }
        if is_wild {
            if wildcards == Wildcards::Refuse {
                return bad("has a wildcard, which is not allowed here");
            }
            if token == ">" && tokens.peek().is_some() {
                return bad("has '>' before its last token");
            }
        }
    }
    Ok(())
}

/// Checks a queue group name: non-empty, no whitespace.
pub fn validate_queue_group(group: &str) -> Result<()> {
    if group.is_empty() || group.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(Error::new(
            ErrorKind::InvalidSubject,
            format!("queue group {group:?} is empty or contains whitespace"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_and_wildcard_subjects_where_allowed() {
        assert!(validate_subject("chorus.evt.a", Wildcards::Refuse).is_ok());
        assert!(validate_subject("chorus.*.a.>", Wildcards::Allow).is_ok());
    }

    #[test]
    fn refuses_malformed_subjects() {
        for s in ["", "a..b", ".a", "a.", "a b", "a.\tb", "a.b*", "a.>.b"] {
            let err = validate_subject(s, Wildcards::Allow).expect_err(s);
            assert_eq!(err.kind(), ErrorKind::InvalidSubject, "{s:?}");
        }
        for s in ["a.*", "a.>"] {
            assert!(validate_subject(s, Wildcards::Refuse).is_err(), "{s:?}");
        }
        assert!(validate_subject(&"a".repeat(MAX_SUBJECT_LEN + 1), Wildcards::Refuse).is_err());
    }
}
