//! Dead letters: what the dead-letter stream keeps of a message that could not be handled, and
//! the note a terminated delivery carries so the coordinator can tell why from the server's
//! advisory alone.

use std::fmt;
use std::str::FromStr;

use bytes::Bytes;
use chorus_broker_adapter::{Headers, JetStream, PubAck};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

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
    /// Exactly-once: an earlier run was interrupted mid-handler, so whether it took effect is
    /// unknown; a person decides (replay it, or drop it).
    Uncertain,
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
            DeadLetterReason::Uncertain => "uncertain",
        }
    }

    /// Every reason.
    pub const ALL: [DeadLetterReason; 6] = [
        DeadLetterReason::MaxAttempts,
        DeadLetterReason::MaxDeliveries,
        DeadLetterReason::Refused,
        DeadLetterReason::Expired,
        DeadLetterReason::Undeliverable,
        DeadLetterReason::Uncertain,
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
/// use chorus_sdk::durable::{DeadLetterNote, DeadLetterReason};
/// use chorus_sdk::StatusCode;
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

/// The headers a stored dead letter carries; its body is the original message's bytes.
pub mod header {
    /// Why it is here ([`DeadLetterReason`](super::DeadLetterReason)).
    pub const REASON: &str = "Chorus-Dlq-Reason";
    /// The status code of the last failure.
    pub const STATUS: &str = "Chorus-Dlq-Status";
    /// The last failure's explanation (at most [`MAX_DETAIL_BYTES`](super::MAX_DETAIL_BYTES)).
    pub const DETAIL: &str = "Chorus-Dlq-Detail";
    /// The agent it was for.
    pub const AGENT: &str = "Chorus-Dlq-Agent";
    /// The subject it was published to.
    pub const SUBJECT: &str = "Chorus-Dlq-Subject";
    /// The original message id, when the envelope decoded.
    pub const MESSAGE_ID: &str = "Chorus-Dlq-Message-Id";
    /// Deliveries made.
    pub const ATTEMPTS: &str = "Chorus-Dlq-Attempts";
    /// When the original was stored, ms since the epoch.
    pub const STORED_MS: &str = "Chorus-Dlq-Stored-Ms";
    /// When it was dead-lettered, ms since the epoch.
    pub const DEAD_LETTERED_MS: &str = "Chorus-Dlq-Dead-Lettered-Ms";
    /// `<stream>:<sequence>` it came from, if any.
    pub const SOURCE: &str = "Chorus-Dlq-Source";
    /// Present when the original was too large to keep: its size in bytes.
    pub const OMITTED: &str = "Chorus-Dlq-Omitted";
    /// The prefix of every header above.
    pub const PREFIX: &str = "Chorus-Dlq-";
}

/// The longest failure explanation a dead letter keeps, in bytes; a longer one is cut.
pub const MAX_DETAIL_BYTES: usize = 512;

/// Bytes a durable message must leave free under the server's `max_payload` for its dead
/// letter's headers, so that every message the SDK stores can also be dead-lettered whole.
/// [`Agent::send`](crate::Agent::send) refuses a durable message larger than
/// `max_payload - DEAD_LETTER_HEADROOM`.
pub const DEAD_LETTER_HEADROOM: usize = 4096;

/// A dead letter: the original message, untouched, and what happened to it.
///
/// Stored as the original bytes with the facts in `Chorus-Dlq-*` headers (see [`header`]), so
/// a dead letter is barely larger than its message. A message stored in an inbox by some other
/// client that leaves no room for those headers is kept without its body ([`omitted`]).
///
/// [`omitted`]: DeadLetter::omitted
#[derive(Debug, Clone, PartialEq)]
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
    /// encrypted); empty when [`omitted`](DeadLetter::omitted).
    pub envelope: Bytes,
    /// The original message's own headers (JetStream's `Nats-*` ones left out).
    pub headers: Vec<(String, String)>,
    /// The original message id, when the envelope decoded.
    pub message_id: Option<Uuid>,
    /// Deliveries made.
    pub attempts: u64,
    /// When the original was stored, ms since the epoch.
    pub stored_ms: u64,
    /// When it was dead-lettered, ms since the epoch.
    pub dead_lettered_ms: u64,
    /// The stream and sequence it came from, if any.
    pub source: Option<(String, u64)>,
    /// The size of an original too large to keep beside the dead letter's headers; its
    /// bytes are then not in [`envelope`](DeadLetter::envelope).
    pub omitted: Option<u64>,
}

/// A stored dead letter whose headers do not say what a dead letter must.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a dead letter: {0}")]
pub struct NotADeadLetter(String);

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

    /// The headers this dead letter is stored with, the original's own first.
    ///
    /// # Errors
    /// A broker error of kind [`InvalidInput`](chorus_broker_adapter::ErrorKind::InvalidInput) when
    /// one of the original's headers has a name that is not printable ASCII without `:`, or a value
    /// with a line break.
    pub fn to_headers(&self) -> Result<Headers, chorus_broker_adapter::Error> {
        let mut h = Headers::new();
        for (name, value) in &self.headers {
            if is_kept_header(name) {
                h.insert(name, value)?;
            }
        }
        h.insert(header::REASON, self.reason.as_str())?;
        h.insert(header::STATUS, &self.status.0.to_string())?;
        h.insert(
            header::DETAIL,
            &header_value(&self.detail, MAX_DETAIL_BYTES),
        )?;
        h.insert(header::AGENT, &header_value(&self.agent, MAX_DETAIL_BYTES))?;
        h.insert(header::SUBJECT, &header_value(&self.subject, 1024))?;
        if let Some(id) = self.message_id {
            h.insert(header::MESSAGE_ID, &id.to_string())?;
        }
        h.insert(header::ATTEMPTS, &self.attempts.to_string())?;
        h.insert(header::STORED_MS, &self.stored_ms.to_string())?;
        h.insert(header::DEAD_LETTERED_MS, &self.dead_lettered_ms.to_string())?;
        if let Some((stream, seq)) = &self.source {
            h.insert(header::SOURCE, &format!("{stream}:{seq}"))?;
        }
        if let Some(n) = self.omitted {
            h.insert(header::OMITTED, &n.to_string())?;
        }
        Ok(h)
    }

    /// Reads a stored dead letter back from its headers and body.
    ///
    /// # Errors
    /// [`NotADeadLetter`] when a required header (reason, status, detail, agent, subject, attempts,
    /// times) is missing or does not read.
    pub fn from_stored(headers: &Headers, body: Bytes) -> Result<DeadLetter, NotADeadLetter> {
        let get = |name: &str| {
            headers
                .get(name)
                .ok_or_else(|| NotADeadLetter(format!("no {name} header")))
        };
        let number = |name: &str| -> Result<u64, NotADeadLetter> {
            get(name)?
                .parse()
                .map_err(|_| NotADeadLetter(format!("{name} is not a number")))
        };
        let optional = |name: &str| headers.get(name).filter(|v| !v.is_empty());
        let source = match optional(header::SOURCE) {
            None => None,
            Some(v) => {
                let (stream, seq) = v
                    .rsplit_once(':')
                    .and_then(|(s, n)| Some((s.to_owned(), n.parse().ok()?)))
                    .ok_or_else(|| NotADeadLetter(format!("{} is {v:?}", header::SOURCE)))?;
                Some((stream, seq))
            }
        };
        Ok(DeadLetter {
            reason: get(header::REASON)?
                .parse()
                .map_err(|e: ParseNoteError| NotADeadLetter(e.to_string()))?,
            status: StatusCode(
                u16::try_from(number(header::STATUS)?)
                    .map_err(|_| NotADeadLetter("status out of range".into()))?,
            ),
            detail: get(header::DETAIL)?.to_owned(),
            agent: get(header::AGENT)?.to_owned(),
            subject: get(header::SUBJECT)?.to_owned(),
            envelope: body,
            headers: headers
                .iter()
                .filter(|(name, _)| is_kept_header(name))
                .map(|(n, v)| (n.to_owned(), v.to_owned()))
                .collect(),
            message_id: optional(header::MESSAGE_ID).and_then(|v| v.parse().ok()),
            attempts: number(header::ATTEMPTS)?,
            stored_ms: number(header::STORED_MS)?,
            dead_lettered_ms: number(header::DEAD_LETTERED_MS)?,
            source,
            omitted: optional(header::OMITTED).and_then(|v| v.parse().ok()),
        })
    }
}

/// Whether an original message's header travels with its dead letter (and with a replay):
/// not JetStream's own (`Nats-*`), which would steer the dead-letter stream, and not a
/// dead letter's facts.
pub fn is_kept_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !lower.starts_with("nats-") && !lower.starts_with(&header::PREFIX.to_ascii_lowercase())
}

/// `text` as a header value: line breaks and other controls become spaces, cut at a char
/// boundary to at most `max` bytes.
fn header_value(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max));
    for c in text.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(c);
    }
    out
}

/// Bytes a message of `headers` and `body` takes against the server's `max_payload`, with
/// a `Nats-Msg-Id` of `msg_id` (the header block as written on the wire).
fn wire_size(headers: &Headers, msg_id: &str, body: usize) -> usize {
    let line = |n: &str, v: &str| n.len() + v.len() + 4;
    "NATS/1.0\r\n\r\n".len()
        + headers.iter().map(|(n, v)| line(n, v)).sum::<usize>()
        + line("Nats-Msg-Id", msg_id)
        + body
}

/// Writes `letter` to the dead-letter stream (once, whatever the number of calls). A letter
/// whose original leaves no room for its headers under `max_payload` is written without the
/// original's bytes, marked [`omitted`](DeadLetter::omitted): a dead letter can always be
/// written while the stream takes writes.
///
/// # Errors
/// A broker error of kind [`InvalidInput`](chorus_broker_adapter::ErrorKind::InvalidInput) when an
/// original header cannot be written; the server's error when the dead-letter stream does not store
/// it (no stream, a timeout, no connection).
pub async fn write_dead_letter(
    js: &JetStream,
    subjects: &Subjects,
    letter: &DeadLetter,
    max_payload: usize,
) -> Result<PubAck, chorus_broker_adapter::Error> {
    let agent = if crate::subject::validate_token("agent id", &letter.agent).is_ok() {
        letter.agent.as_str()
    } else {
        "unknown"
    };
    let subject = subjects
        .dead_letter(&format!("{}.{agent}", letter.reason))
        .map_err(|e| {
            chorus_broker_adapter::Error::new(
                chorus_broker_adapter::ErrorKind::InvalidSubject,
                e.to_string(),
            )
        })?;
    let msg_id = letter.dedupe_id();
    let mut headers = letter.to_headers()?;
    let mut body = letter.envelope.clone();
    if wire_size(&headers, &msg_id, body.len()) > max_payload {
        let omitted = DeadLetter {
            envelope: Bytes::new(),
            omitted: Some(u64::try_from(letter.envelope.len()).unwrap_or(u64::MAX)),
            ..letter.clone()
        };
        tracing::warn!(
            agent,
            size = letter.envelope.len(),
            max_payload,
            "dead letter kept without its original: too large"
        );
        headers = omitted.to_headers()?;
        body = Bytes::new();
    }
    js.publish(&subject, Some(headers), Some(&msg_id), None, body)
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

    fn letter(envelope: &[u8]) -> DeadLetter {
        DeadLetter {
            reason: DeadLetterReason::MaxAttempts,
            status: StatusCode::HANDLER_FAILED,
            detail: "line one\r\nline two: ünïcode".into(),
            agent: "ledger".into(),
            subject: "chorus.inbox.ledger.n.post".into(),
            envelope: Bytes::copy_from_slice(envelope),
            headers: vec![("Chorus-Replay-Of".into(), "CHORUS_DLQ:3".into())],
            message_id: Some(Uuid::now_v7()),
            attempts: 4,
            stored_ms: 1_700_000_000_000,
            dead_lettered_ms: 1_700_000_000_500,
            source: Some(("CHORUS_INBOX".into(), 42)),
            omitted: None,
        }
    }

    #[test]
    fn a_dead_letter_is_its_original_bytes_with_its_facts_in_headers() {
        let original = letter(&[0x83, 0x00, 0xff, b'{']);
        let headers = original.to_headers().expect("headers");
        let back = DeadLetter::from_stored(&headers, original.envelope.clone()).expect("reads");
        assert_eq!(back.detail, "line one  line two: ünïcode");
        assert_eq!(
            back,
            DeadLetter {
                detail: back.detail.clone(),
                ..original
            }
        );
    }

    #[test]
    fn a_long_detail_is_cut_at_a_char_boundary() {
        let mut long = letter(b"x");
        long.detail = "é".repeat(MAX_DETAIL_BYTES);
        let headers = long.to_headers().expect("headers");
        let detail = headers.get(header::DETAIL).expect("detail");
        assert!(detail.len() <= MAX_DETAIL_BYTES && detail.len() >= MAX_DETAIL_BYTES - 1);
        assert!(detail.chars().all(|c| c == 'é'));
    }

    #[test]
    fn a_message_with_missing_facts_is_not_a_dead_letter() {
        let mut headers = letter(b"x").to_headers().expect("headers");
        headers.insert(header::ATTEMPTS, "many").expect("insert");
        assert!(DeadLetter::from_stored(&headers, Bytes::new()).is_err());
        assert!(DeadLetter::from_stored(&Headers::new(), Bytes::new()).is_err());
    }

    #[test]
    fn the_size_counted_against_max_payload_is_the_wire_size() {
        let l = letter(&[7; 100]);
        let headers = l.to_headers().expect("headers");
        let mut block = String::from("NATS/1.0\r\n");
        for (n, v) in headers.iter() {
            block.push_str(&format!("{n}: {v}\r\n"));
        }
        block.push_str(&format!("Nats-Msg-Id: {}\r\n\r\n", l.dedupe_id()));
        assert_eq!(wire_size(&headers, &l.dedupe_id(), 100), block.len() + 100);
        assert!(block.len() < DEAD_LETTER_HEADROOM);
    }
}
