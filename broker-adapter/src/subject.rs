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
///
/// # Errors
/// [`ErrorKind::InvalidSubject`] when the subject is empty, longer than [`MAX_SUBJECT_LEN`], has an
/// empty token, whitespace or a control character, or a wildcard where `wildcards` or NATS does not
/// allow one.
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
    let checked = if subject.bytes().all(|b| b.is_ascii_graphic()) {
        check_ascii(subject.as_bytes(), wildcards)
    } else {
        check_any(subject, wildcards)
    };
    checked.or_else(bad)
}

/// The tokens of any subject, character by character.
fn check_any(subject: &str, wildcards: Wildcards) -> std::result::Result<(), &'static str> {
    let mut tokens = subject.split('.').peekable();
    while let Some(token) = tokens.next() {
        if token.is_empty() {
            return Err("has an empty token");
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("contains whitespace or a control character");
        }
        let is_wild = token == "*" || token == ">";
        if token.contains(['*', '>']) && !is_wild {
            return Err("has a wildcard inside a token");
        }
        if is_wild {
            if wildcards == Wildcards::Refuse {
                return Err("has a wildcard, which is not allowed here");
            }
            if token == ">" && tokens.peek().is_some() {
                return Err("has '>' before its last token");
            }
        }
    }
    Ok(())
}

/// The common case, printable ASCII (no whitespace or control character possible): only the
/// structure needs checking, byte by byte, with the same rules and messages as [`check_any`].
fn check_ascii(subject: &[u8], wildcards: Wildcards) -> std::result::Result<(), &'static str> {
    let mut start = 0;
    for (i, _) in subject.iter().enumerate().filter(|(_, b)| **b == b'.') {
        ascii_token(&subject[start..i], false, wildcards)?;
        start = i + 1;
    }
    ascii_token(&subject[start..], true, wildcards)
}

/// One token of a printable-ASCII subject.
fn ascii_token(
    token: &[u8],
    last: bool,
    wildcards: Wildcards,
) -> std::result::Result<(), &'static str> {
    match token {
        [] => Err("has an empty token"),
        [b'*'] | [b'>'] if wildcards == Wildcards::Refuse => {
            Err("has a wildcard, which is not allowed here")
        }
        [b'>'] if !last => Err("has '>' before its last token"),
        [b'*'] | [b'>'] => Ok(()),
        _ if token.iter().any(|b| matches!(b, b'*' | b'>')) => Err("has a wildcard inside a token"),
        _ => Ok(()),
    }
}

/// Checks a queue group name: non-empty, no whitespace.
///
/// # Errors
/// [`ErrorKind::InvalidSubject`] when the group is empty or has whitespace or a control character.
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

    #[test]
    fn the_ascii_fast_path_agrees_with_the_general_one() {
        // Every string of up to six characters from the characters that matter.
        let alphabet = [b'a', b'.', b'*', b'>', b'Z'];
        let mut checked = 0;
        for len in 1..=6u32 {
            for mut n in 0..alphabet.len().pow(len) {
                let mut s = Vec::new();
                for _ in 0..len {
                    s.push(alphabet[n % alphabet.len()]);
                    n /= alphabet.len();
                }
                let text = std::str::from_utf8(&s).expect("ascii");
                for w in [Wildcards::Allow, Wildcards::Refuse] {
                    assert_eq!(check_ascii(&s, w), check_any(text, w), "{text:?} {w:?}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 30_000);
    }
}
