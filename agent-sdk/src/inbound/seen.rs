//! Replay protection that survives a restart: the id of every verified (signed) command and
//! request an agent accepts is written to a key-value bucket (`<root>_seen`, key
//! `<agent>.<message id>`) whose entries expire after the signature tolerance, so a restarted
//! agent still refuses, with 5015, a copy it accepted before the restart. Past the tolerance
//! the timestamp check refuses it anyway.

use crate::Report;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::{ErrorKind, Kv, KvSpec};

use super::outcome::{Failure, Retry};
use crate::link::Link;
use crate::protocol::envelope::Envelope;
use crate::protocol::status::StatusCode;
use crate::security::SEEN_BUCKET;
use crate::stats::AgentCounters;

/// How long a message waits when the bucket cannot be written (a durable delivery retries).
const STORE_UNAVAILABLE_RETRY_DELAY: Duration = Duration::from_secs(1);

/// One agent's persistent seen-id records, the bucket opened on first use.
pub(crate) struct SeenIds {
    link: Arc<Link>,
    /// The signature tolerance: how long an id must be remembered.
    window: Duration,
    replicas: usize,
    kv: tokio::sync::OnceCell<Kv>,
}

impl SeenIds {
    /// With `replicas` copies of the bucket (the inbox's: 3 on a cluster).
    pub(crate) fn new(link: Arc<Link>, window: Duration, replicas: usize) -> Self {
        SeenIds {
            link,
            window,
            replicas,
            kv: tokio::sync::OnceCell::new(),
        }
    }

    async fn kv(&self) -> Result<&Kv, chorus_broker_adapter::Error> {
        self.kv
            .get_or_try_init(|| async {
                let mut spec = KvSpec::new(self.link.subjects.bucket_name(SEEN_BUCKET));
                // Expiry needs a positive age; a zero tolerance keeps ids a second.
                spec.max_age = self.window.max(Duration::from_secs(1));
                spec.replicas = self.replicas;
                spec.description = "Chorus replay protection: verified message ids".into();
                self.link.js.ensure_kv_exists(&spec).await
            })
            .await
    }

    /// Records `id` (`env`'s, or its replay's: [`crate::security::replay::replay_id`]), with
    /// the stream sequence of the stored copy it came from (`copy`)
    /// for a durable delivery; 5015 if it was recorded before from anywhere but that same copy
    /// (a replay, perhaps across a restart; a redelivery of the copy is not one), 5019
    /// (retried) if the bucket cannot be read or written: failing closed.
    pub(crate) async fn record(
        &self,
        env: &Envelope,
        id: uuid::Uuid,
        copy: Option<u64>,
    ) -> Result<(), Failure> {
        let key = format!("{}.{id}", self.link.id);
        let value = copy.map_or_else(Bytes::new, |seq| Bytes::from(seq.to_string()));
        let stored = match self.kv().await {
            Ok(kv) => match kv.create(&key, value.clone()).await {
                // Recorded before: from this very copy (a redelivery), or a replay.
                Err(e) if e.kind() == ErrorKind::Conflict && copy.is_some() => {
                    match kv.get(&key).await {
                        Ok(Some(entry)) if entry.value == value => Ok(0),
                        Ok(_) => Err(e),
                        Err(read) => Err(read),
                    }
                }
                other => other,
            },
            Err(e) => Err(e),
        };
        match stored {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::Conflict => {
                AgentCounters::bump(&self.link.counters.security_refused);
                tracing::warn!(agent = %self.link.id, from = %env.from, id = %env.id, "replay refused: id already seen");
                Err(Failure::refused(
                    StatusCode::REPLAY,
                    format!("message {} was already received", env.id),
                ))
            }
            Err(e) => {
                tracing::warn!(agent = %self.link.id, id = %env.id, error = %Report(&e), "seen-id record unavailable");
                Err(Failure {
                    status: StatusCode::UNAVAILABLE,
                    reason: "replay protection store unavailable".into(),
                    retry: Retry::After(STORE_UNAVAILABLE_RETRY_DELAY),
                })
            }
        }
    }
}
