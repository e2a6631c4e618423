//! Dead letters: what the dead-letter stream keeps of a message that could not be handled, and
//! the note a terminated delivery carries so the coordinator can tell why from the server's
//! advisory alone.

use std::fmt;
use std::str::FromStr;

use broker_adapter::{JetStream, PubAck};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::protocol::envelope::bytes_field;
use crate::protocol::status::StatusCode;
use crate::subject::Subjects;

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterReason {
    /// Every attempt the retry policy allows failed.
    MaxAttempts,
    /// Delivered `MaxDeliver` times without an answer (crashes, ack timeouts).
    MaxDeliveries,
    /// The agent refused it as poison: undecodable, unknown command, a non-retryable failure.
    Refused,
    /// Its TTL or deadline passed before it was handled.
    Expired,
    /// A broadcast copy no agent could take.
    Undeliverable,
}

impl DeadLetterReason {
    /// The wire and subject form.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::MaxAttempts => "max_attempts",
            DeadLetterReason::MaxDeliveries => "max_deliveries",
            DeadLetterReason::Refused => "refused",
            DeadLetterReason::Expired => "expired",
            DeadLetterReason::Undeliverable => "undeliverable",
        }
    }

    const ALL: [DeadLetterReason; 5] = [
        DeadLetterReason::MaxAttempts,
        DeadLetterReason::MaxDeliveries,
        DeadLetterReason::Refused,
        DeadLetterReason::Expired,
        DeadLetterReason::Undeliverable,
    ];
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A text that names no [`DeadLetterReason`] or is not a [`DeadLetterNote`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a dead-letter {what}: {text:?}")]
pub struct ParseNoteError {
    what: &'static str,
    text: String,
}

impl FromStr for DeadLetterReason {
    type Err = ParseNoteError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DeadLetterReason::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| ParseNoteError {
                what: "reason",
                text: s.to_owned(),
            })
    }
}

/// The note an agent terminates a dead-lettered delivery with, which the server repeats in
/// its terminated advisory: `"<code> <reason>: <detail>"`, for example
/// `"5017 max_attempts: ledger offline"`.
///
/// ```
/// use agent_sdk::durable::{DeadLetterNote, DeadLetterReason};
/// use agent_sdk::StatusCode;
/// let note = DeadLetterNote {
///     status: StatusCode::HANDLER_FAILED,
///     reason: DeadLetterReason::MaxAttempts,
///     detail: "ledger offline".into(),
/// };
/// assert_eq!(note.to_string(), "5017 max_attempts: ledger offline");
/// assert_eq!(note.to_string().parse::<DeadLetterNote>(), Ok(note));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterNote {
    /// The status code of the last failure.
    pub status: StatusCode,
    /// Why it was given up on.
    pub reason: DeadLetterReason,
    /// The last failure's explanation.
    pub detail: String,
}

impl fmt::Display for DeadLetterNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status.0, self.reason, self.detail)
    }
}

impl FromStr for DeadLetterNote {
    type Err = ParseNoteError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let malformed = || ParseNoteError {
            what: "note",
            text: s.to_owned(),
        };
        let (code, rest) = s.split_once(' ').ok_or_else(malformed)?;
        let (reason, detail) = rest.split_once(": ").unwrap_or((rest, ""));
        Ok(DeadLetterNote {
            status: StatusCode(code.parse().map_err(|_| malformed())?),
            reason: reason.parse()?,
            detail: detail.to_owned(),
        })
    }
}

/// A dead letter: the original message, untouched, and what happened to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// Why it is here.
    pub reason: DeadLetterReason,
    /// The status code of the last failure.
    pub status: StatusCode,
    /// The last failure's explanation.
    pub detail: String,
    /// The agent it was for.
    pub agent: String,
    /// The subject it was published to; replay publishes there again.
    pub subject: String,
    /// The original envelope bytes, exactly as published (an encrypted payload stays
    /// encrypted).
    #[serde(with = "bytes_field")]
    pub envelope: Bytes,
    /// The original message id, when the envelope decoded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<Uuid>,
    /// Deliveries made.
    pub attempts: u64,
    /// When the original was stored, ms since the epoch.
    pub stored_ms: u64,
    /// When it was dead-lettered, ms since the epoch.
    pub dead_lettered_ms: u64,
    /// The stream and sequence it came from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<(String, u64)>,
}

impl DeadLetter {
    /// The message id that makes repeated reports of the same failure one entry.
    pub fn dedupe_id(&self) -> String {
        match &self.source {
            Some((stream, seq)) => format!("dlq:{stream}:{seq}"),
            None => format!(
                "dlq:{}:{}",
                self.message_id.map(|u| u.to_string()).unwrap_or_default(),
                self.agent
            ),
        }
    }
}

/// Writes `letter` to the dead-letter stream (once, whatever the number of calls).
pub async fn write_dead_letter(
    js: &JetStream,
    subjects: &Subjects,
    letter: &DeadLetter,
) -> Result<PubAck, broker_adapter::Error> {
    let agent = if crate::subject::validate_token("agent id", &letter.agent).is_ok() {
        letter.agent.as_str()
    } else {
        "unknown"
    };
    let subject = subjects
        .dead_letter(&format!("{}.{agent}", letter.reason))
        .map_err(|e| {
            broker_adapter::Error::new(broker_adapter::ErrorKind::InvalidSubject, e.to_string())
        })?;
    let body = serde_json::to_vec(letter).map_err(|e| {
        broker_adapter::Error::new(broker_adapter::ErrorKind::InvalidInput, e.to_string())
    })?;
    js.publish(
        &subject,
        None,
        Some(&letter.dedupe_id()),
        None,
        Bytes::from(body),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_round_trips_and_a_foreign_note_is_an_error() {
        for reason in DeadLetterReason::ALL {
            assert_eq!(reason.as_str().parse::<DeadLetterReason>(), Ok(reason));
            let note = DeadLetterNote {
                status: StatusCode::DATA_FORMAT,
                reason,
                detail: "a: b: c".into(),
            };
            assert_eq!(note.to_string().parse::<DeadLetterNote>(), Ok(note));
        }
        assert!("Message deleted".parse::<DeadLetterNote>().is_err());
        assert!("5017 lost: x".parse::<DeadLetterNote>().is_err());
        assert!("x refused: y".parse::<DeadLetterNote>().is_err());
    }
}
