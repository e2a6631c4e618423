//! The dead-letter queue: the worker that turns the server's advisories into dead letters, and
//! the operations behind `chorus dlq ls | show | replay | purge`.

use bytes::Bytes;
use chorus_broker_adapter::{Broker, Delivery, ErrorKind, Headers, JetStream, PubAck};
use chorus_sdk::Report;
use chorus_sdk::codec;
use chorus_sdk::durable::{
    DLQ_STREAM, DeadLetter, DeadLetterNote, DeadLetterReason, IDEMPOTENCY_BUCKET, INBOX_STREAM,
    write_dead_letter,
};
use chorus_sdk::envelope::now_ms;
use chorus_sdk::{StatusCode, Subjects};
use serde::Deserialize;
use std::time::Duration;

use super::metrics::metrics;
use super::{JETSTREAM_TIMEOUT, Shared};

/// How long an advisory that could not be processed first waits before it is tried again;
/// the wait doubles with each attempt up to [`ADVISORY_MAX_RETRY_DELAY`].
pub const ADVISORY_RETRY_DELAY: Duration = Duration::from_secs(2);
/// The longest wait between two attempts at one advisory.
pub const ADVISORY_MAX_RETRY_DELAY: Duration = Duration::from_secs(60);
/// Attempts at one advisory (about 16 minutes with the delays above) before it is given up:
/// the original message then stays in the inbox stream, and the give-up is logged and counted
/// in `chorus_coordinator_advisories_abandoned_total`.
pub const ADVISORY_MAX_ATTEMPTS: u64 = 20;

/// The wait after failed attempt `attempt` (1-based) at an advisory.
pub fn advisory_retry_delay(attempt: u64) -> Duration {
    let doublings = u32::try_from(attempt.saturating_sub(1).min(16)).unwrap_or(16);
    ADVISORY_RETRY_DELAY
        .saturating_mul(1 << doublings)
        .min(ADVISORY_MAX_RETRY_DELAY)
}

/// The fields Chorus reads from JetStream's max-deliveries and terminated advisories.
#[derive(Debug, Deserialize)]
struct Advisory {
    #[serde(rename = "type")]
    kind: String,
    stream: String,
    consumer: String,
    stream_seq: u64,
    deliveries: u64,
    #[serde(default)]
    reason: String,
}

/// What a terminated delivery's note says: the agent's [`DeadLetterNote`], or, for a note
/// that is not one (a delivery terminated by some other client), the text as the detail.
fn read_term_note(note: &str) -> DeadLetterNote {
    note.parse().unwrap_or_else(|_| DeadLetterNote {
        status: StatusCode::HANDLER_FAILED,
        reason: DeadLetterReason::Refused,
        detail: note.to_owned(),
    })
}

/// Handles one captured advisory. Acks it only once the dead letter is stored and the
/// original removed, so a crash anywhere in between repeats the work (and the dead letter's
/// message id makes the repeat a no-op).
pub(crate) async fn on_advisory(shared: &Shared, delivery: &Delivery) {
    let outcome = handle_advisory(shared, delivery).await;
    let ack = match outcome {
        Ok(()) => delivery.ack().await,
        Err(err) if delivery.delivered() >= ADVISORY_MAX_ATTEMPTS => {
            metrics().advisories_abandoned.inc();
            tracing::error!(error = %Report(&err), attempts = delivery.delivered(), "advisory given up: the message it names stays in the inbox stream, not dead-lettered");
            delivery.term("given up after its attempts").await
        }
        Err(err) => {
            tracing::warn!(error = %Report(&err), attempt = delivery.delivered(), "advisory not processed; will retry");
            delivery
                .nak(Some(advisory_retry_delay(delivery.delivered())))
                .await
        }
    };
    if let Err(err) = ack {
        tracing::debug!(error = %Report(&err), "advisory ack not sent");
    }
}

async fn handle_advisory(
    shared: &Shared,
    delivery: &Delivery,
) -> Result<(), chorus_broker_adapter::Error> {
    let Ok(advisory) = serde_json::from_slice::<Advisory>(delivery.payload()) else {
        tracing::warn!(
            subject = delivery.subject(),
            "advisory does not decode; dropped"
        );
        return Ok(());
    };
    let inbox = shared.subjects.stream_name(INBOX_STREAM);
    if advisory.stream != inbox {
        return Ok(());
    }
    let original = match shared.js.get_message(&inbox, advisory.stream_seq).await {
        Ok(m) => m,
        // Already dead-lettered by the agent (or an earlier run of this) and removed.
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let DeadLetterNote {
        status,
        reason,
        detail,
    } = if advisory.kind.ends_with("terminated") {
        read_term_note(&advisory.reason)
    } else {
        DeadLetterNote {
            status: StatusCode::TIMEOUT,
            reason: DeadLetterReason::MaxDeliveries,
            detail: format!("delivered {} times without an answer", advisory.deliveries),
        }
    };
    let message_id = codec::decode(&original.payload).ok().map(|(e, _)| e.id);
    let letter = DeadLetter {
        reason,
        status,
        detail,
        agent: shared
            .subjects
            .durable_agent(&original.subject)
            .unwrap_or(&advisory.consumer)
            .to_owned(),
        subject: original.subject.clone(),
        envelope: original.payload.clone(),
        headers: original
            .headers
            .iter()
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
            .collect(),
        message_id,
        attempts: advisory.deliveries,
        stored_ms: original.stored_ms,
        dead_lettered_ms: now_ms(),
        source: Some((inbox.clone(), advisory.stream_seq)),
        omitted: None,
    };
    let max_payload = shared.broker.max_payload();
    let ack = write_dead_letter(&shared.js, &shared.subjects, &letter, max_payload).await?;
    if !ack.duplicate {
        metrics()
            .dead_letters
            .with_label_values(&[reason.as_str()])
            .inc();
        tracing::warn!(agent = %advisory.consumer, seq = advisory.stream_seq, reason = reason.as_str(), "message dead-lettered from advisory");
    }
    shared
        .js
        .delete_message(&inbox, advisory.stream_seq)
        .await?;
    Ok(())
}

/// Updates the DLQ depth gauge from the stream's per-subject counts.
pub(crate) async fn refresh_depth(js: &JetStream, subjects: &Subjects) {
    let stream = subjects.stream_name(DLQ_STREAM);
    let Ok(counts) = js.subject_counts(&stream, &subjects.dead_letters()).await else {
        return;
    };
    let depth = &metrics().dlq_depth;
    depth.reset();
    // Every reason has a series, zero included, so dashboards and alerts see an empty queue
    // rather than no data.
    for reason in DeadLetterReason::ALL {
        depth.with_label_values(&[reason.as_str()]).set(0);
    }
    for (subject, n) in counts {
        let reason = subjects.dead_letter_reason(&subject).unwrap_or("unknown");
        depth
            .with_label_values(&[reason])
            .add(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

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

    fn admits(&self, letter: &DeadLetter, now: u64) -> bool {
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

/// The dead-letter queue of one bus, for operators.
#[derive(Debug, Clone)]
pub struct DeadLetterQueue {
    broker: Broker,
    js: JetStream,
    subjects: Subjects,
    stream: String,
}

/// The header a replayed message carries: the dead letter it came from.
pub const REPLAY_HEADER: &str = "Chorus-Replay-Of";

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
        }
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
                chorus_sdk::subject::validate_token("agent id", agent).map_err(|e| {
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
            if name != REPLAY_HEADER {
                headers.insert(name, value)?;
            }
        }
        headers.insert(REPLAY_HEADER, &format!("{}:{id}", self.stream))?;
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
pub fn describe_envelope(bytes: &Bytes, implied: &chorus_sdk::subject::Implied<'_>) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advisory_retries_double_up_to_a_minute_and_end() {
        let delays: Vec<u64> = (1..=ADVISORY_MAX_ATTEMPTS)
            .map(|n| advisory_retry_delay(n).as_secs())
            .collect();
        assert_eq!(&delays[..7], &[2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(advisory_retry_delay(u64::MAX), ADVISORY_MAX_RETRY_DELAY);
        let total: u64 = delays[..delays.len() - 1].iter().sum();
        // The attempts end after about 16 minutes of waiting.
        assert_eq!(total, 2 + 4 + 8 + 16 + 32 + 60 * 14);
    }
}
