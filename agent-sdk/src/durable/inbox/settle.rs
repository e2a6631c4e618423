//! The one place a durable delivery's outcome becomes an ack, a nak with the retry policy's
//! delay, or a dead letter: `settle()` decides (pure, unit-tested), `apply()` acts.

use crate::Report;
use std::time::Duration;

use chorus_broker_adapter::Delivery;

use crate::durable::{
    DeadLetter, DeadLetterNote, DeadLetterReason, INBOX_STREAM, write_dead_letter,
};
use crate::inbound::{Outcome, Retry};
use crate::protocol::envelope::{Kind, now_ms};
use crate::protocol::status::StatusCode;
use crate::retry::RetryPolicies;
use crate::stats::AgentCounters;

use super::*;

/// What becomes of one durable delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Settle {
    Ack,
    /// An exactly-once message already handled: acked without running the handler again.
    AckRepeated,
    Nak(Duration),
    DeadLetter(DeadLetterNote),
}

impl DurableInbox {
    /// Acks, naks or dead-letters the delivery.
    pub(super) async fn apply(
        &self,
        delivery: &Delivery,
        settle: Settle,
        message_id: Option<uuid::Uuid>,
    ) {
        let link = &self.link;
        let counters = self.pipeline.counters();
        let sent = match settle {
            Settle::Ack if self.fault_skip_ack() => {
                tracing::debug!(agent = %link.id, seq = delivery.stream_seq(), "fault injection: ack withheld");
                Ok(())
            }
            Settle::Ack | Settle::AckRepeated => delivery.ack().await,
            Settle::Nak(delay) => {
                AgentCounters::bump(&counters.retries);
                delivery.nak(Some(delay)).await
            }
            Settle::DeadLetter(note) => {
                let letter = DeadLetter {
                    reason: note.reason,
                    status: note.status,
                    detail: note.detail.clone(),
                    agent: link.id.clone(),
                    subject: delivery.subject().to_owned(),
                    envelope: delivery.payload().clone(),
                    headers: delivery
                        .headers()
                        .iter()
                        .map(|(n, v)| (n.to_owned(), v.to_owned()))
                        .collect(),
                    message_id,
                    attempts: delivery.delivered(),
                    stored_ms: delivery.published_ms(),
                    dead_lettered_ms: now_ms(),
                    source: Some((
                        link.subjects.stream_name(INBOX_STREAM),
                        delivery.stream_seq(),
                    )),
                    omitted: None,
                };
                let max_payload = link.broker.max_payload();
                match write_dead_letter(&link.js, &link.subjects, &letter, max_payload).await {
                    Ok(_) => {
                        AgentCounters::bump(&counters.dead_lettered);
                        tracing::warn!(agent = %link.id, seq = delivery.stream_seq(), %note, "durable message dead-lettered");
                        delivery.term(&note.to_string()).await
                    }
                    // Not stored in the DLQ: keep the message and try again later.
                    Err(write_err) => {
                        tracing::error!(agent = %link.id, error = %Report(&write_err), "dead letter not written; will retry");
                        delivery.nak(Some(DEAD_LETTER_RETRY_DELAY)).await
                    }
                }
            }
        };
        if let Err(err) = sent {
            tracing::warn!(agent = %link.id, seq = delivery.stream_seq(), error = %Report(&err), "ack not sent; the server will redeliver");
        }
    }

    pub(super) fn fault_skip_ack(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        {
            use std::sync::atomic::Ordering;
            self.skip_acks
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            false
        }
    }
}

/// Stream sequences delivered to this instance lately, the oldest forgotten first.
#[derive(Debug, Default)]
pub(super) struct Recent {
    set: std::collections::HashSet<u64>,
    order: std::collections::VecDeque<u64>,
}

/// How many stream sequences an instance remembers having been delivered.
const RECENT_DELIVERIES: usize = 16_384;

impl Recent {
    /// Notes `seq`; whether it was delivered here before.
    pub(super) fn insert(&mut self, seq: u64) -> bool {
        if !self.set.insert(seq) {
            return true;
        }
        self.order.push_back(seq);
        if self.order.len() > RECENT_DELIVERIES
            && let Some(old) = self.order.pop_front()
        {
            self.set.remove(&old);
        }
        false
    }
}

/// Decides what becomes of delivery number `delivered` of a message on `subject` from its
/// outcome and the retry policy.
pub(super) fn settle(
    policies: &RetryPolicies,
    subject: &str,
    delivered: u64,
    kind: Kind,
    outcome: Outcome,
) -> Settle {
    let failure = match outcome {
        Outcome::Done(_) => return Settle::Ack,
        Outcome::Repeated(_) => return Settle::AckRepeated,
        Outcome::Failed(failure) => failure,
    };
    let policy = policies.for_message(subject, kind);
    let last_attempt = delivered >= u64::from(policy.max_attempts);
    // The consumer's own limit: past it the server delivers the message no more, so a pause
    // there is a dead letter written here, not a nak nothing would follow.
    let last_delivery = delivered >= u64::from(policies.max_attempts());
    let reason = match failure.retry {
        Retry::After(delay) if !last_delivery => return Settle::Nak(delay),
        Retry::After(_) => DeadLetterReason::MaxAttempts,
        Retry::Attempts if !last_attempt => {
            return Settle::Nak(policy.delay(delivered, crate::retry::random_fraction()));
        }
        Retry::Policy if policy.should_retry(failure.status, delivered) => {
            return Settle::Nak(policy.delay(delivered, crate::retry::random_fraction()));
        }
        Retry::Policy if policy.retry_on.contains(&failure.status) => DeadLetterReason::MaxAttempts,
        _ if failure.status == StatusCode::EXPIRED => DeadLetterReason::Expired,
        _ if failure.status == StatusCode::UNCERTAIN => DeadLetterReason::Uncertain,
        _ => DeadLetterReason::Refused,
    };
    Settle::DeadLetter(DeadLetterNote {
        status: failure.status,
        reason,
        detail: failure.reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::HandlerError;
    use crate::handler::Output;
    use crate::inbound::outcome::Failure;

    const SUBJECT: &str = "chorus.inbox.ledger.post";

    fn settle_nth(delivered: u64, outcome: Outcome) -> Settle {
        let policies = RetryPolicies::default();
        settle(&policies, SUBJECT, delivered, Kind::Command, outcome)
    }

    fn failed(status: StatusCode, retry: Retry) -> Outcome {
        Outcome::Failed(Failure {
            status,
            reason: "why".into(),
            retry,
        })
    }

    fn dead_letter_reason(settle: Settle) -> DeadLetterReason {
        match settle {
            Settle::DeadLetter(note) => note.reason,
            other => panic!("expected a dead letter, got {other:?}"),
        }
    }

    #[test]
    fn a_stream_sequence_seen_before_is_a_repeat_until_it_is_forgotten() {
        let mut recent = Recent::default();
        assert!(!recent.insert(7));
        assert!(recent.insert(7));
        for seq in 100..100 + RECENT_DELIVERIES as u64 {
            assert!(!recent.insert(seq));
        }
        assert!(
            !recent.insert(7),
            "forgotten after RECENT_DELIVERIES others"
        );
        assert_eq!(recent.set.len(), RECENT_DELIVERIES);
    }

    #[test]
    fn success_and_a_repeat_are_acked() {
        assert_eq!(settle_nth(1, Outcome::Done(Output::default())), Settle::Ack);
        assert_eq!(
            settle_nth(1, Outcome::Repeated(Ok(Output::default()))),
            Settle::AckRepeated
        );
    }

    #[test]
    fn a_retryable_failure_is_retried_until_the_attempts_run_out() {
        let max = u64::from(RetryPolicies::default().default.max_attempts);
        let status = RetryPolicies::default().default.retry_on[0];
        for delivered in 1..max {
            assert!(matches!(
                settle_nth(delivered, failed(status, Retry::Policy)),
                Settle::Nak(_)
            ));
        }
        let last = settle_nth(max, failed(status, Retry::Policy));
        assert_eq!(dead_letter_reason(last), DeadLetterReason::MaxAttempts);
    }

    #[test]
    fn poison_expiry_and_a_non_retryable_failure_are_dead_lettered_at_once() {
        let refused = settle_nth(1, failed(StatusCode::DATA_FORMAT, Retry::Never));
        assert_eq!(dead_letter_reason(refused), DeadLetterReason::Refused);
        let expired = settle_nth(1, failed(StatusCode::EXPIRED, Retry::Never));
        assert_eq!(dead_letter_reason(expired), DeadLetterReason::Expired);
        let invalid = Outcome::Failed(Failure::from(HandlerError::invalid_argument("no")));
        assert_eq!(
            dead_letter_reason(settle_nth(1, invalid)),
            DeadLetterReason::Refused
        );
    }

    #[test]
    fn an_unknown_command_waits_for_another_instance_then_is_refused() {
        let max = u64::from(RetryPolicies::default().default.max_attempts);
        let unknown = || failed(StatusCode::UNKNOWN_COMMAND, Retry::Attempts);
        assert!(matches!(settle_nth(1, unknown()), Settle::Nak(_)));
        assert_eq!(
            dead_letter_reason(settle_nth(max, unknown())),
            DeadLetterReason::Refused
        );
    }

    #[test]
    fn an_uncertain_exactly_once_message_is_dead_lettered_for_a_person() {
        let uncertain = settle_nth(2, failed(StatusCode::UNCERTAIN, Retry::Never));
        assert_eq!(dead_letter_reason(uncertain), DeadLetterReason::Uncertain);
    }

    #[test]
    fn a_pause_is_a_nak_with_that_delay_until_the_last_delivery_the_server_makes() {
        let pause = Duration::from_secs(1);
        let over = || failed(StatusCode::UNAVAILABLE, Retry::After(pause));
        let max = u64::from(RetryPolicies::default().max_attempts());
        for delivered in 1..max {
            assert_eq!(
                settle_nth(delivered, over()),
                Settle::Nak(pause),
                "{delivered}"
            );
        }
        // The server sends it no more after this one: a nak would leave it unhandled.
        let Settle::DeadLetter(note) = settle_nth(max, over()) else {
            panic!("expected a dead letter at delivery {max}");
        };
        assert_eq!(
            (note.reason, note.status),
            (DeadLetterReason::MaxAttempts, StatusCode::UNAVAILABLE)
        );
    }

    #[test]
    fn the_note_the_coordinator_reads_says_why() {
        let settle = settle_nth(1, failed(StatusCode::DATA_FORMAT, Retry::Never));
        let Settle::DeadLetter(note) = settle else {
            panic!("expected a dead letter");
        };
        assert_eq!(note.to_string(), "5006 refused: why");
    }
}
