//! Exactly-once in effect: the receiver records each exactly-once message id it has handled,
//! with its result, in a key-value bucket (`<root>_idempotency`); a copy that arrives later is
//! answered with the recorded result and its handler does not run again. Records expire after
//! the agent's idempotency TTL.

use std::sync::Arc;
use std::time::Duration;

use broker_adapter::{ErrorKind, Kv, KvSpec};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::outcome::{Failure, Outcome, Retry};
use crate::error::HandlerError;
use crate::handler::Output;
use crate::outbound::Outbound;
use crate::protocol::envelope::{Envelope, bytes_field, now_ms};
use crate::protocol::status::StatusCode;
use crate::stats::AgentCounters;

/// Suffix of the exactly-once idempotency bucket.
pub const IDEMPOTENCY_BUCKET: &str = "idempotency";
/// Default lifetime of exactly-once idempotency records.
pub const DEFAULT_IDEMPOTENCY_TTL: Duration = Duration::from_secs(24 * 3600);
/// How long a durable delivery waits when the idempotency record cannot be read.
const STORE_UNAVAILABLE_RETRY_DELAY: Duration = Duration::from_secs(1);

/// What an exactly-once receiver remembers of a handled message.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct IdempotencyRecord {
    status: StatusCode,
    content_type: String,
    #[serde(with = "bytes_field")]
    payload: Bytes,
    handled_ms: u64,
}

/// One agent's idempotency records, the bucket opened on first use.
pub(crate) struct ExactlyOnce {
    out: Arc<Outbound>,
    ttl: Duration,
    kv: tokio::sync::OnceCell<Kv>,
}

impl ExactlyOnce {
    pub(crate) fn new(out: Arc<Outbound>, ttl: Duration) -> Self {
        ExactlyOnce {
            out,
            ttl,
            kv: tokio::sync::OnceCell::new(),
        }
    }

    async fn kv(&self) -> Result<&Kv, broker_adapter::Error> {
        self.kv
            .get_or_try_init(|| async {
                let mut spec = KvSpec::new(self.out.subjects.bucket_name(IDEMPOTENCY_BUCKET));
                spec.max_age = self.ttl;
                spec.description = "Chorus exactly-once records: handled message ids".into();
                self.out.js.ensure_kv(&spec).await
            })
            .await
    }

    fn key(&self, env: &Envelope) -> String {
        format!("{}.{}", self.out.id, env.id)
    }

    /// Before the handler: the recorded result of a copy handled before (answered again, not
    /// run), 5019 when the record cannot be read (retried), or `None` to go on.
    pub(crate) async fn before(&self, env: &Envelope) -> Option<Outcome> {
        let found = match self.kv().await {
            Ok(kv) => kv.get(&self.key(env)).await.map(|e| e.map(|e| e.value)),
            Err(e) => Err(e),
        };
        if let Err(err) = &found {
            tracing::warn!(agent = %self.out.id, error = %err, "idempotency record unavailable");
        }
        let outcome = judge(found);
        if matches!(outcome, Some(Outcome::Repeated(_))) {
            AgentCounters::bump(&self.out.counters.duplicates_suppressed);
        }
        outcome
    }

    /// After the handler succeeded: records its reply.
    pub(crate) async fn after(&self, env: &Envelope, output: &Output) {
        let record = IdempotencyRecord {
            status: StatusCode::OK,
            content_type: output.content_type.clone(),
            payload: output.payload.clone(),
            handled_ms: now_ms(),
        };
        let Ok(value) = serde_json::to_vec(&record) else {
            return;
        };
        let stored = match self.kv().await {
            Ok(kv) => kv.create(&self.key(env), Bytes::from(value)).await,
            Err(e) => Err(e),
        };
        match stored {
            Ok(_) => {}
            // Another copy was handled at the same moment and recorded first.
            Err(e) if e.kind() == ErrorKind::Conflict => {}
            Err(e) => {
                tracing::warn!(agent = %self.out.id, id = %env.id, error = %e, "idempotency record not written; a redelivery would run the handler again");
            }
        }
    }
}

/// What a record lookup means for the message: `None` (not seen: handle it), the recorded
/// result again, or 5019 when the record could not be read.
fn judge(found: Result<Option<Bytes>, broker_adapter::Error>) -> Option<Outcome> {
    match found {
        Ok(None) => None,
        // A record this version cannot read is treated as absent: the handler runs.
        Ok(Some(value)) => {
            let record = serde_json::from_slice::<IdempotencyRecord>(&value).ok()?;
            Some(Outcome::Repeated(if record.status.is_success() {
                Ok(Output {
                    payload: record.payload,
                    content_type: record.content_type,
                })
            } else {
                Err(HandlerError::new(record.status, "failed before"))
            }))
        }
        Err(_) => Some(Outcome::Failed(Failure {
            status: StatusCode::UNAVAILABLE,
            reason: "idempotency record unavailable; retry".into(),
            retry: Retry::After(STORE_UNAVAILABLE_RETRY_DELAY),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unseen_message_is_handled_and_a_seen_one_gets_its_recorded_reply() {
        assert!(judge(Ok(None)).is_none());
        let record = IdempotencyRecord {
            status: StatusCode::OK,
            content_type: "application/json".into(),
            payload: Bytes::from_static(b"42"),
            handled_ms: 1,
        };
        let value = Bytes::from(serde_json::to_vec(&record).expect("encodes"));
        match judge(Ok(Some(value))) {
            Some(Outcome::Repeated(Ok(output))) => assert_eq!(&output.payload[..], b"42"),
            other => panic!("expected the recorded reply, got {other:?}"),
        }
        assert!(judge(Ok(Some(Bytes::from_static(b"not json")))).is_none());
    }

    #[test]
    fn an_unreadable_record_store_is_5019_retried_after_a_pause() {
        let err = broker_adapter::Error::new(broker_adapter::ErrorKind::TimedOut, "kv get");
        match judge(Err(err)) {
            Some(Outcome::Failed(failure)) => {
                assert_eq!(failure.status, StatusCode::UNAVAILABLE);
                assert_eq!(failure.retry, Retry::After(STORE_UNAVAILABLE_RETRY_DELAY));
            }
            other => panic!("expected 5019, got {other:?}"),
        }
    }
}
