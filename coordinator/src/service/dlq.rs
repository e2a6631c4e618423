//! The dead-letter queue: the worker that turns the server's advisories into dead letters; the
//! operations behind `chorus dlq ls | show | replay | purge` are the SDK's
//! ([`DeadLetterQueue`], re-exported here).

use chorus_broker_adapter::{Delivery, ErrorKind, JetStream};
use chorus_sdk::Report;
use chorus_sdk::codec;
use chorus_sdk::durable::{
    DLQ_STREAM, DeadLetter, DeadLetterNote, DeadLetterReason, INBOX_STREAM, write_dead_letter,
};
use chorus_sdk::envelope::now_ms;
use chorus_sdk::{StatusCode, Subjects};
use serde::Deserialize;
use std::time::Duration;

use super::Shared;
use super::metrics::metrics;

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

pub use chorus_sdk::durable::{
    DeadLetterQueue, DlqEntry, DlqFilter, REPLAY_HEADER, describe_envelope,
};

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
