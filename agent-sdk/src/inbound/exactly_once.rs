//! Exactly-once in effect: before its handler runs, the receiver claims each exactly-once
//! message id in a key-value bucket (`<root>_idempotency`); once the handler succeeds, the
//! claim becomes the recorded result, and a copy that arrives later is answered with it
//! without running the handler again. A failed handler releases its claim, so a retry runs.
//!
//! A copy that finds a claim with no result cannot know whether the handler's effects took
//! place: the instance that claimed it died (or lost the bucket) mid-handler. It is never run
//! again: it fails with 5023 `uncertain`, and a durable one is dead-lettered as `uncertain` for
//! a person to decide. Records expire after the agent's idempotency TTL.

use crate::Report;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::{ErrorKind, Kv, KvSpec};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::outcome::{Failure, Outcome, Retry};
use crate::error::HandlerError;
use crate::handler::Output;
use crate::link::Link;
use crate::protocol::envelope::{ContentType, Envelope, bytes_field, now_ms};
use crate::protocol::status::StatusCode;
use crate::stats::AgentCounters;

/// Suffix of the exactly-once idempotency bucket.
pub const IDEMPOTENCY_BUCKET: &str = "idempotency";
/// Default lifetime of exactly-once idempotency records.
pub const DEFAULT_IDEMPOTENCY_TTL: Duration = Duration::from_secs(24 * 3600);
/// How long a durable delivery waits when the idempotency record cannot be read, or when
/// another copy of it is being handled here right now.
const STORE_UNAVAILABLE_RETRY_DELAY: Duration = Duration::from_secs(1);
/// Attempts at turning a claim into a result after the handler succeeded (the bucket may be
/// away for a moment, as in a server restart), with this pause between them.
const RECORD_ATTEMPTS: u32 = 10;
const RECORD_RETRY_DELAY: Duration = Duration::from_millis(500);
/// Unsettled message ids this instance remembers the local fate of (results it could not
/// record, claims it may hold without having run them): beyond this many, the oldest claims
/// that did not run are forgotten (never a run or a result).
const LOCAL_MEMORY: usize = 4096;

/// What the bucket holds for one message id.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
enum IdempotencyRecord {
    /// Claimed by `instance`: its handler runs or ran without recording a result.
    Claimed { instance: String, claimed_ms: u64 },
    /// Handled: the reply it gave.
    Done {
        status: StatusCode,
        content_type: ContentType,
        #[serde(with = "bytes_field")]
        payload: Bytes,
        handled_ms: u64,
    },
}

/// What this instance knows of a message id it claimed.
#[derive(Debug, Clone)]
enum Local {
    /// Its handler runs here now.
    Running,
    /// Its handler succeeded here (the result, in case the bucket did not take it).
    Finished(Output),
    /// Nothing ran here to completion that counts: its handler failed (and the retry may run
    /// it), or the claim's write had an unknown outcome and the handler never started.
    NotRun,
}

/// The go-ahead to run the handler: the claim's revision, to be turned into a result or
/// released.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Claim {
    revision: u64,
}

/// What to do with an exactly-once message before its handler.
#[derive(Debug)]
pub(crate) enum Before {
    Run(Claim),
    Settled(Outcome),
}

/// One agent's idempotency records, the bucket opened on first use.
pub(crate) struct ExactlyOnce {
    link: Arc<Link>,
    ttl: Duration,
    replicas: usize,
    instance: String,
    kv: tokio::sync::OnceCell<Kv>,
    local: Mutex<(HashMap<Uuid, Local>, std::collections::VecDeque<Uuid>)>,
}

impl ExactlyOnce {
    /// Records kept `ttl`, in a bucket of `replicas` copies (the inbox's: 3 on a cluster, so
    /// the records outlive a node as the messages do).
    pub(crate) fn new(link: Arc<Link>, ttl: Duration, replicas: usize, instance: String) -> Self {
        ExactlyOnce {
            link,
            ttl,
            replicas,
            instance,
            kv: tokio::sync::OnceCell::new(),
            local: Mutex::new(Default::default()),
        }
    }

    async fn kv(&self) -> Result<&Kv, chorus_broker_adapter::Error> {
        self.kv
            .get_or_try_init(|| async {
                let mut spec = KvSpec::new(self.link.subjects.bucket_name(IDEMPOTENCY_BUCKET));
                spec.max_age = self.ttl;
                spec.replicas = self.replicas;
                spec.description = "Chorus exactly-once records: handled message ids".into();
                self.link.js.ensure_kv_exists(&spec).await
            })
            .await
    }

    fn key(&self, env: &Envelope) -> String {
        format!("{}.{}", self.link.id, env.id)
    }

    fn local(&self, id: Uuid) -> Option<Local> {
        let guard = self.local.lock().unwrap_or_else(|p| p.into_inner());
        guard.0.get(&id).cloned()
    }

    fn remember(&self, id: Uuid, state: Option<Local>) {
        let mut guard = self.local.lock().unwrap_or_else(|p| p.into_inner());
        let (map, order) = &mut *guard;
        remember_in(map, order, id, state);
    }

    /// Before the handler: claims the id ([`Before::Run`]), or settles the message without
    /// running it: the recorded result of a copy handled before, 5019 when the bucket cannot
    /// be read or a copy runs here now (retried), 5023 when an earlier run's fate is unknown.
    pub(crate) async fn before(&self, env: &Envelope) -> Before {
        let kv = match self.kv().await {
            Ok(kv) => kv,
            Err(err) => return Before::Settled(unavailable(&self.link.id, &err)),
        };
        let key = self.key(env);
        let claim = IdempotencyRecord::Claimed {
            instance: self.instance.clone(),
            claimed_ms: now_ms(),
        };
        let Ok(value) = serde_json::to_vec(&claim) else {
            return Before::Settled(unavailable(&self.link.id, &"claim does not encode"));
        };
        let value = Bytes::from(value);
        match kv.create(&key, value.clone()).await {
            Ok(revision) => {
                self.remember(env.id, Some(Local::Running));
                return Before::Run(Claim { revision });
            }
            Err(e) if e.kind() == ErrorKind::Conflict => {}
            Err(err) => {
                // The claim may have been stored with its answer lost (a failover): nothing
                // ran here, so a copy finding this instance's claim may take it over.
                self.remember(env.id, Some(Local::NotRun));
                return Before::Settled(unavailable(&self.link.id, &err));
            }
        }
        let found = match kv.get(&key).await {
            Ok(found) => found,
            Err(err) => return Before::Settled(unavailable(&self.link.id, &err)),
        };
        let record = found
            .as_ref()
            .and_then(|e| decode_record(&e.value).map(|r| (r, e.revision)));
        let before = match (record, self.local(env.id)) {
            (
                Some((
                    IdempotencyRecord::Done {
                        status,
                        content_type,
                        payload,
                        ..
                    },
                    _,
                )),
                _,
            ) => Before::Settled(Outcome::Repeated(if status.is_success() {
                Ok(Output {
                    payload,
                    content_type,
                })
            } else {
                Err(HandlerError::new(status, "failed before"))
            })),
            // Handled here, its result not recorded (the bucket was away): answered from memory.
            (_, Some(Local::Finished(output))) => Before::Settled(Outcome::Repeated(Ok(output))),
            // Another copy runs here right now: try again when it is done.
            (_, Some(Local::Running)) => Before::Settled(Outcome::Failed(Failure {
                status: StatusCode::UNAVAILABLE,
                reason: "another copy of this exactly-once message is being handled".into(),
                retry: Retry::After(STORE_UNAVAILABLE_RETRY_DELAY),
            })),
            // A claim of this instance that did not run here to completion: it failed here
            // and the claim was not released, or the claim's write lost its answer (or was
            // retried) and the handler never started. Take it over and run it. (What ran here
            // is never forgotten, only claims that did not run are, so no memory is the
            // same.) Another instance's claim is never taken over.
            (
                Some((IdempotencyRecord::Claimed { instance, .. }, revision)),
                Some(Local::NotRun) | None,
            ) if instance == self.instance => match kv.update(&key, value, revision).await {
                Ok(revision) => {
                    self.remember(env.id, Some(Local::Running));
                    Before::Run(Claim { revision })
                }
                Err(err) => Before::Settled(unavailable(&self.link.id, &err)),
            },
            (
                Some((
                    IdempotencyRecord::Claimed {
                        instance,
                        claimed_ms,
                    },
                    _,
                )),
                _,
            ) => {
                tracing::error!(agent = %self.link.id, id = %env.id, claimed_by = %instance, claimed_ms, "exactly-once message claimed by a run that never finished; not run again");
                Before::Settled(Outcome::Failed(Failure {
                    status: StatusCode::UNCERTAIN,
                    reason: format!(
                        "an earlier run (instance {instance}) was interrupted; whether it took effect is unknown"
                    ),
                    retry: Retry::Never,
                }))
            }
            // Released (or unreadable) between the two calls: try again.
            (None, _) => Before::Settled(Outcome::Failed(Failure {
                status: StatusCode::UNAVAILABLE,
                reason: "idempotency record changed; retry".into(),
                retry: Retry::After(STORE_UNAVAILABLE_RETRY_DELAY),
            })),
        };
        if matches!(before, Before::Settled(Outcome::Repeated(_))) {
            AgentCounters::bump(&self.link.counters.duplicates_suppressed);
        }
        before
    }

    /// After the handler: its success recorded over the claim, or the claim released after a
    /// failure (so a retry runs). When the bucket cannot be written, the outcome is kept in
    /// this instance's memory, and a copy that reaches another instance is reported
    /// `uncertain` rather than run twice.
    pub(crate) async fn after(&self, env: &Envelope, claim: Claim, outcome: &Outcome) {
        let output = match outcome {
            Outcome::Done(output) => Some(output),
            _ => None,
        };
        self.remember(
            env.id,
            Some(match output {
                Some(o) => Local::Finished(o.clone()),
                None => Local::NotRun,
            }),
        );
        let key = self.key(env);
        let done = output.map(|output| IdempotencyRecord::Done {
            status: StatusCode::OK,
            content_type: output.content_type.clone(),
            payload: output.payload.clone(),
            handled_ms: now_ms(),
        });
        let value = match done.as_ref().map(serde_json::to_vec).transpose() {
            Ok(v) => v.map(Bytes::from),
            Err(_) => return,
        };
        for attempt in 1..=RECORD_ATTEMPTS {
            let written = match self.kv().await {
                Ok(kv) => match &value {
                    Some(value) => kv
                        .update(&key, value.clone(), claim.revision)
                        .await
                        .map(|_| ()),
                    None => kv.delete_if(&key, claim.revision).await,
                },
                Err(e) => Err(e),
            };
            match written {
                Ok(()) => {
                    self.remember(env.id, None);
                    return;
                }
                Err(e) if e.kind() == ErrorKind::Conflict => {
                    tracing::warn!(agent = %self.link.id, id = %env.id, "idempotency claim taken over meanwhile; left as it is");
                    return;
                }
                Err(e) => {
                    tracing::debug!(agent = %self.link.id, id = %env.id, attempt, error = %Report(&e), "idempotency record not written yet");
                    tokio::time::sleep(RECORD_RETRY_DELAY).await;
                }
            }
        }
        tracing::warn!(agent = %self.link.id, id = %env.id, "idempotency record not written; a copy reaching another instance will be reported uncertain");
    }
}

/// Notes `id`'s local state (`None`: settled, forgotten), keeping at most [`LOCAL_MEMORY`]
/// unsettled ones.
fn remember_in(
    map: &mut HashMap<Uuid, Local>,
    order: &mut std::collections::VecDeque<Uuid>,
    id: Uuid,
    state: Option<Local>,
) {
    match state {
        None => {
            map.remove(&id);
        }
        Some(state) => {
            if map.insert(id, state).is_none() {
                order.push_back(id);
            }
        }
    }
    // `order` also holds ids already settled and forgotten: those are dropped as they
    // come up, and only ids still unsettled count toward the limit. (Counting the stale
    // ones forgot a message waiting for its retry after a server restart, and it was then
    // taken for an interrupted run.)
    // Only claims that did not run are forgotten: forgetting one costs nothing (its claim is
    // this instance's and is taken over), while what runs or ran here must stay known.
    while map.len() > LOCAL_MEMORY {
        let Some(old) = order.pop_front() else { break };
        if matches!(map.get(&old), Some(Local::NotRun)) {
            map.remove(&old);
        }
    }
    if order.len() > 4 * LOCAL_MEMORY {
        order.retain(|id| map.contains_key(id));
    }
}

/// A record as written by an SDK without claims (a result only).
#[derive(Deserialize)]
struct ResultOnly {
    status: StatusCode,
    content_type: ContentType,
    #[serde(with = "bytes_field")]
    payload: Bytes,
    handled_ms: u64,
}

fn decode_record(value: &[u8]) -> Option<IdempotencyRecord> {
    serde_json::from_slice(value).ok().or_else(|| {
        let r = serde_json::from_slice::<ResultOnly>(value).ok()?;
        Some(IdempotencyRecord::Done {
            status: r.status,
            content_type: r.content_type,
            payload: r.payload,
            handled_ms: r.handled_ms,
        })
    })
}

fn unavailable(agent: &str, err: &dyn std::fmt::Display) -> Outcome {
    tracing::warn!(agent, error = %err, "idempotency record unavailable");
    Outcome::Failed(Failure {
        status: StatusCode::UNAVAILABLE,
        reason: "idempotency record unavailable; retry".into(),
        retry: Retry::After(STORE_UNAVAILABLE_RETRY_DELAY),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_say_their_state() {
        let claimed = IdempotencyRecord::Claimed {
            instance: "abc".into(),
            claimed_ms: 1,
        };
        let json = serde_json::to_string(&claimed).expect("encodes");
        assert_eq!(
            json,
            r#"{"state":"claimed","instance":"abc","claimed_ms":1}"#
        );
        let done: IdempotencyRecord = serde_json::from_str(
            r#"{"state":"done","status":5002,"content_type":"application/json","payload":"NDI=","handled_ms":2}"#,
        )
        .expect("decodes");
        assert!(matches!(done, IdempotencyRecord::Done { payload, .. } if &payload[..] == b"42"));
        let older = decode_record(
            br#"{"status":5002,"content_type":"application/json","payload":"NDI=","handled_ms":2}"#,
        );
        assert!(matches!(older, Some(IdempotencyRecord::Done { .. })));
        assert!(decode_record(b"not json").is_none());
    }

    #[test]
    fn settled_ids_do_not_push_an_unsettled_one_out() {
        let local = Mutex::new((HashMap::new(), std::collections::VecDeque::new()));
        let remember = |id: Uuid, state: Option<Local>| {
            let mut guard = local.lock().expect("lock");
            let (map, order) = &mut *guard;
            remember_in(map, order, id, state);
        };
        let waiting = Uuid::now_v7();
        remember(waiting, Some(Local::NotRun));
        for _ in 0..3 * LOCAL_MEMORY {
            let id = Uuid::now_v7();
            remember(id, Some(Local::Running));
            remember(id, None);
        }
        let guard = local.lock().expect("lock");
        assert!(matches!(guard.0.get(&waiting), Some(Local::NotRun)));
        assert!(guard.1.len() <= 4 * LOCAL_MEMORY + 1);
    }
}
