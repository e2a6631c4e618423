//! The dead-letter queue, for operators: its entries listed by agent, reason and age, shown,
//! replayed to their original subjects, removed and purged. What `chorus dlq`, the
//! coordinator and the gateway's console use (docs/PROTOCOL.md section 7.5).

use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::{Broker, ErrorKind, Headers, JetStream, PubAck};

use super::{DLQ_STREAM, JETSTREAM_TIMEOUT};
use crate::dead_letter::{DeadLetter, DeadLetterReason};
use crate::inbound::exactly_once::IDEMPOTENCY_BUCKET;
use crate::protocol::codec;
use crate::protocol::envelope::now_ms;
use crate::subject::Subjects;

/// Entries read per scan of the dead-letter stream.
const SCAN_PAGE: usize = 1024;

/// Which dead letters an operation is about: all, or those of one agent, one reason, an age.
#[derive(Debug, Clone, Default)]
pub struct DlqFilter {
    /// Only this agent's.
    pub agent: Option<String>,
    /// Only those dead-lettered for this reason.
    pub reason: Option<DeadLetterReason>,
    /// Only those dead-lettered at least this long ago.
    pub older_than: Option<Duration>,
    /// Only those dead-lettered at most this long ago.
    pub newer_than: Option<Duration>,
}

impl DlqFilter {
    /// Whether no condition is set (every entry matches).
    pub fn is_empty(&self) -> bool {
        self.agent.is_none()
            && self.reason.is_none()
            && self.older_than.is_none()
            && self.newer_than.is_none()
    }

    /// Whether `letter` is of the age the filter asks, `now` (ms since the epoch); the agent
    /// and reason are selected by subject.
    pub fn admits(&self, letter: &DeadLetter, now: u64) -> bool {
        let age = Duration::from_millis(now.saturating_sub(letter.dead_lettered_ms));
        self.older_than.is_none_or(|d| age >= d) && self.newer_than.is_none_or(|d| age <= d)
    }
}

/// One entry of the dead-letter queue.
#[derive(Debug, Clone)]
pub struct DlqEntry {
    /// Its id: the sequence in the dead-letter stream.
    pub id: u64,
    /// The dead letter.
    pub letter: DeadLetter,
}

impl DlqEntry {
    /// Its facts as JSON, as `chorus dlq ls --json` prints them and the console shows them:
    /// `id`, `reason`, `status`, `label`, `detail`, `agent`, `subject`, `message_id`,
    /// `attempts`, `stored_ms`, `dead_lettered_ms`, `source`, `size` (the original's, kept
    /// or not) and `omitted`.
    pub fn to_json(&self) -> serde_json::Value {
        let l = &self.letter;
        serde_json::json!({
            "id": self.id,
            "reason": l.reason.as_str(),
            "status": l.status.0,
            "label": l.status.label(),
            "detail": l.detail,
            "agent": l.agent,
            "subject": l.subject,
            "message_id": l.message_id,
            "attempts": l.attempts,
            "stored_ms": l.stored_ms,
            "dead_lettered_ms": l.dead_lettered_ms,
            "source": l.source.as_ref().map(|(s, n)| format!("{s}:{n}")),
            "size": l.omitted.unwrap_or(l.envelope.len() as u64),
            "omitted": l.omitted.is_some(),
        })
    }
}

/// The dead-letter queue of one bus, for operators.
#[derive(Debug, Clone)]
pub struct DeadLetterQueue {
    broker: Broker,
    js: JetStream,
    subjects: Subjects,
    stream: String,
    /// Who signs its replays ([`DeadLetterQueue::signed_by`]).
    replayer: Option<(String, std::sync::Arc<crate::security::Identity>)>,
}

/// The header a replayed message carries: the dead letter it came from.
pub const REPLAY_HEADER: &str = crate::security::replay::REPLAY_OF_HEADER;

/// The headers of a replay, dropped from a dead letter's kept headers before it is replayed
/// again (a replay that was dead-lettered in turn).
const REPLAY_HEADERS: [&str; 4] = [
    crate::security::replay::REPLAY_OF_HEADER,
    crate::security::replay::REPLAY_BY_HEADER,
    crate::security::replay::REPLAY_MS_HEADER,
    crate::security::replay::REPLAY_SIGNATURE_HEADER,
];

impl DeadLetterQueue {
    /// The queue of the bus at `broker` under `subjects`' root.
    pub fn new(broker: Broker, subjects: Subjects) -> Self {
        let js = broker.jetstream(JETSTREAM_TIMEOUT);
        let stream = subjects.stream_name(DLQ_STREAM);
        DeadLetterQueue {
            broker,
            js,
            subjects,
            stream,
            replayer: None,
        }
    }

    /// Replays signed by `id` with `identity` (docs/PROTOCOL.md, "Replaying a signed dead
    /// letter"): the original bytes unchanged, their sender's signature kept as provenance, and
    /// the replayer's own signature beside them, so a receiver that verifies signatures and
    /// trusts `id` handles the replay once instead of refusing it as a replay.
    #[must_use]
    pub fn signed_by(
        mut self,
        id: impl Into<String>,
        identity: std::sync::Arc<crate::security::Identity>,
    ) -> Self {
        self.replayer = Some((id.into(), identity));
        self
    }

    /// The subjects of its bus.
    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    /// Entries, oldest first, at most `limit`.
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`] when JetStream does not answer in time; [`ErrorKind::Broker`] when
    /// the dead-letter stream cannot be read. A bus without one has an empty queue.
    pub async fn list(&self, limit: usize) -> Result<Vec<DlqEntry>, chorus_broker_adapter::Error> {
        self.find(&DlqFilter::default(), 0, limit).await
    }

    /// Entries matching `filter` with ids above `after`, oldest first, at most `limit`. The
    /// agent and reason select by subject on the server; the age is checked here.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidSubject`] for an invalid agent id in `filter`; [`ErrorKind::TimedOut`]
    /// when JetStream does not answer in time; [`ErrorKind::Broker`] when the dead-letter stream
    /// cannot be read.
    pub async fn find(
        &self,
        filter: &DlqFilter,
        after: u64,
        limit: usize,
    ) -> Result<Vec<DlqEntry>, chorus_broker_adapter::Error> {
        let reason = filter.reason.map_or("*", DeadLetterReason::as_str);
        let agent = match filter.agent.as_deref() {
            None => "*",
            Some(agent) => {
                crate::subject::validate_token("agent id", agent).map_err(|e| {
                    chorus_broker_adapter::Error::new(ErrorKind::InvalidSubject, e.to_string())
                })?;
                agent
            }
        };
        // `<root>.dlq.<reason>.<agent>`, either token a wildcard when not filtered on.
        let all = self.subjects.dead_letters();
        let subject = format!("{}.{reason}.{agent}", all.trim_end_matches(".>"));
        let mut out = Vec::new();
        let mut start = after.saturating_add(1);
        let now = now_ms();
        // Pages of the scan, until `limit` entries pass the age filter or the stream ends.
        while out.len() < limit {
            let page = match self
                .js
                .scan(&self.stream, Some(&subject), start, SCAN_PAGE)
                .await
            {
                Ok(page) => page,
                Err(e) if e.kind() == ErrorKind::NotFound => break,
                Err(e) => return Err(e),
            };
            let Some(last) = page.last().map(|m| m.sequence) else {
                break;
            };
            for stored in page {
                let id = stored.sequence;
                let Ok(letter) = DeadLetter::from_stored(&stored.headers, stored.payload) else {
                    continue;
                };
                if filter.admits(&letter, now) && out.len() < limit {
                    out.push(DlqEntry { id, letter });
                }
            }
            start = last + 1;
        }
        Ok(out)
    }

    /// Entry `id`.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when there is no entry `id`; [`ErrorKind::InvalidInput`] when it
    /// does not decode; [`ErrorKind::TimedOut`] when JetStream does not answer in time.
    pub async fn show(&self, id: u64) -> Result<DlqEntry, chorus_broker_adapter::Error> {
        let stored = self.js.get_message(&self.stream, id).await?;
        let letter = DeadLetter::from_stored(&stored.headers, stored.payload).map_err(|e| {
            chorus_broker_adapter::Error::with_source(
                ErrorKind::InvalidInput,
                format!("entry {id} does not decode"),
                e,
            )
        })?;
        Ok(DlqEntry { id, letter })
    }

    /// Publishes entry `id`'s original message to its original subject again, as a new
    /// message (so its delivery count starts over) carrying `Chorus-Replay-Of`, then removes
    /// the entry. Durable subjects go through JetStream and return its ack.
    ///
    /// # Errors
    /// Those of [`show`](DeadLetterQueue::show); [`ErrorKind::InvalidInput`] when the original was
    /// too large to keep; the publish's ([`ErrorKind::NotFound`], [`ErrorKind::TooLarge`],
    /// [`ErrorKind::TimedOut`], [`ErrorKind::Broker`]), the entry then kept.
    pub async fn replay(&self, id: u64) -> Result<Option<PubAck>, chorus_broker_adapter::Error> {
        let entry = self.show(id).await?;
        if let Some(size) = entry.letter.omitted {
            return Err(chorus_broker_adapter::Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "dead letter {id} cannot be replayed: its original ({size} bytes) was too large to keep"
                ),
            ));
        }
        // A person replays an uncertain exactly-once message having decided it did not take
        // effect: its interrupted claim is cleared, or the copy would be refused again.
        if entry.letter.reason == DeadLetterReason::Uncertain
            && let Some(message_id) = entry.letter.message_id
        {
            let bucket = self.subjects.bucket_name(IDEMPOTENCY_BUCKET);
            let kv = self.js.open_kv(&bucket).await?;
            kv.delete(&format!("{}.{message_id}", entry.letter.agent))
                .await?;
        }
        let mut headers = Headers::new();
        for (name, value) in &entry.letter.headers {
            if !REPLAY_HEADERS.contains(&name.as_str()) {
                headers.insert(name, value)?;
            }
        }
        let of = format!("{}:{id}", self.stream);
        headers.insert(REPLAY_HEADER, &of)?;
        if let (Some((by, identity)), Some(message_id)) = (&self.replayer, entry.letter.message_id)
        {
            let proof = crate::security::replay::ReplayProof::sign(
                identity,
                by,
                &entry.letter.subject,
                message_id,
                &of,
                crate::protocol::envelope::now_ms(),
            );
            for (name, value) in proof.headers() {
                if name != REPLAY_HEADER {
                    headers.insert(name, &value)?;
                }
            }
        }
        let durable = self
            .subjects
            .durable_command(&entry.letter.subject)
            .is_some();
        let ack = if durable {
            let msg_id = format!("replay:{}:{id}", self.stream);
            Some(
                self.js
                    .publish(
                        &entry.letter.subject,
                        Some(headers),
                        Some(&msg_id),
                        None,
                        entry.letter.envelope.clone(),
                    )
                    .await?,
            )
        } else {
            self.broker
                .publish_with(
                    &entry.letter.subject,
                    None,
                    Some(headers),
                    entry.letter.envelope.clone(),
                )
                .await?;
            self.broker.flush().await?;
            None
        };
        self.js.delete_message(&self.stream, id).await?;
        Ok(ack)
    }

    /// Removes entry `id`; `false` if it was not there.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] when the bus has no dead-letter stream; [`ErrorKind::TimedOut`] when
    /// JetStream does not answer in time; [`ErrorKind::Broker`] when the server fails the delete.
    pub async fn remove(&self, id: u64) -> Result<bool, chorus_broker_adapter::Error> {
        self.js.delete_message(&self.stream, id).await
    }

    /// Removes every entry; returns how many.
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`] when JetStream does not answer in time; [`ErrorKind::Broker`] when
    /// the server fails the purge. A bus without a dead-letter stream purges 0.
    pub async fn purge(&self) -> Result<u64, chorus_broker_adapter::Error> {
        match self.js.purge_stream(&self.stream).await {
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(0),
            other => other,
        }
    }

    /// How many entries there are.
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`] when JetStream does not answer in time; [`ErrorKind::Broker`] when
    /// JetStream cannot be reached. A bus without a dead-letter stream has depth 0.
    pub async fn depth(&self) -> Result<u64, chorus_broker_adapter::Error> {
        match self.js.stream_state(&self.stream).await {
            Ok(s) => Ok(s.messages),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(0),
            Err(e) => Err(e),
        }
    }
}

/// Bytes of an entry's original envelope, decoded when possible, for display; `implied` is
/// what its subject carries.
pub fn describe_envelope(bytes: &Bytes, implied: &crate::subject::Implied<'_>) -> String {
    match codec::decode_on(bytes, implied) {
        Ok((env, _)) if env.encryption.is_some() => format!(
            "{} {} from {} (payload encrypted, {} bytes)",
            env.kind,
            env.name.unwrap_or_default(),
            env.from,
            env.payload.len()
        ),
        Ok((env, _)) => {
            let payload =
                codec::decode_payload::<serde_json::Value>(&env.payload, &env.content_type)
                    .map(|v| v.to_string())
                    .unwrap_or_else(|_| format!("<{} bytes>", env.payload.len()));
            format!(
                "{} {} from {}: {payload}",
                env.kind,
                env.name.unwrap_or_default(),
                env.from
            )
        }
        Err(e) => format!("<{} bytes, not an envelope: {e}>", bytes.len()),
    }
}
