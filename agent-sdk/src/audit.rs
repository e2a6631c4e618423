//! The audit stream (docs/SECURITY.md, "The audit trail"): who asked for what, and what came of
//! it, for every action that changes the bus or runs code: the coordinator's hosting commands
//! (allowed or refused), the gateway's writes by edge identity, the web console's actions by
//! the person who clicked.
//!
//! Each record is JSON on `<root>.audit.<via>.<writer>`, kept in the stream `<ROOT>_AUDIT` for
//! [`AUDIT_MAX_AGE`] (at most [`AUDIT_MAX_BYTES`], the oldest dropped first). The subject names
//! the connection that wrote it: credentials let each agent write records only under its own
//! id, so a record says which part of the bus vouches for it.

use std::time::Duration;

use chorus_broker_adapter::{Broker, JetStream, StreamSpec};
use serde::{Deserialize, Serialize};

use crate::subject::{SubjectError, Subjects, validate_token};

/// The stream's name suffix: `<ROOT>_AUDIT`.
pub const AUDIT_STREAM: &str = "AUDIT";
/// How long records are kept.
pub const AUDIT_MAX_AGE: Duration = Duration::from_secs(90 * 24 * 3600);
/// The most bytes kept; past it the oldest records go.
pub const AUDIT_MAX_BYTES: i64 = 1 << 30;

/// One audited action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// When, ms since the epoch.
    pub ms: u64,
    /// Where it was asked: `coordinator`, `gateway`, `console`.
    pub via: String,
    /// Who asked: the verified sender, the edge identity, the console's person.
    pub actor: String,
    /// What: a command (`deploy`), an HTTP method and path (`POST /v1/requests`), a console
    /// action (`dlq.replay`).
    pub action: String,
    /// What it was aimed at, when there is one (a deployment, a dead letter, a task).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// `ok`, `refused` or `failed`.
    pub outcome: String,
    /// The status code it was answered with (a Chorus code, or HTTP's at the edge).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Why, for a refusal or a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl AuditRecord {
    /// A record of `actor` doing `action` through `via`, now, `outcome` (`ok`, `refused`,
    /// `failed`).
    pub fn new(
        via: impl Into<String>,
        actor: impl Into<String>,
        action: impl Into<String>,
        outcome: impl Into<String>,
    ) -> AuditRecord {
        AuditRecord {
            ms: crate::protocol::envelope::now_ms(),
            via: via.into(),
            actor: actor.into(),
            action: action.into(),
            target: None,
            outcome: outcome.into(),
            status: None,
            detail: None,
        }
    }

    /// Aimed at `target`.
    #[must_use]
    pub fn target(mut self, target: impl Into<String>) -> AuditRecord {
        self.target = Some(target.into());
        self
    }

    /// Answered with `status`.
    #[must_use]
    pub fn status(mut self, status: u16) -> AuditRecord {
        self.status = Some(status);
        self
    }

    /// Why (cut at 512 bytes).
    #[must_use]
    pub fn detail(mut self, detail: impl Into<String>) -> AuditRecord {
        let mut detail: String = detail.into();
        if detail.len() > 512 {
            let mut end = 512;
            while !detail.is_char_boundary(end) {
                end -= 1;
            }
            detail.truncate(end);
        }
        self.detail = Some(detail);
        self
    }
}

/// The audit stream, as the coordinator makes it.
pub fn audit_stream(subjects: &Subjects, replicas: usize) -> StreamSpec {
    let mut spec = StreamSpec::new(
        subjects.stream_name(AUDIT_STREAM),
        vec![audit_all(subjects)],
    );
    spec.max_age = AUDIT_MAX_AGE;
    spec.max_bytes = AUDIT_MAX_BYTES;
    spec.replicas = replicas;
    spec.description = "Chorus audit: who asked for what, and what came of it".into();
    spec
}

/// `<root>.audit.>`: every record.
pub fn audit_all(subjects: &Subjects) -> String {
    format!("{}.audit.>", subjects.root())
}

/// `<root>.audit.*.<writer>`: where `writer` may write.
///
/// # Errors
/// [`SubjectError`] for an invalid agent id.
pub fn audit_of(subjects: &Subjects, writer: &str) -> Result<String, SubjectError> {
    validate_token("agent id", writer)?;
    Ok(format!("{}.audit.*.{writer}", subjects.root()))
}

/// Writes and reads the audit stream of one bus.
#[derive(Debug, Clone)]
pub struct AuditLog {
    js: JetStream,
    subjects: Subjects,
    stream: String,
    writer: String,
}

impl AuditLog {
    /// The audit stream of the bus at `broker`, written as `writer` (the connection's agent id).
    pub fn new(broker: &Broker, subjects: Subjects, writer: impl Into<String>) -> AuditLog {
        AuditLog {
            js: broker.jetstream(crate::JETSTREAM_TIMEOUT),
            stream: subjects.stream_name(AUDIT_STREAM),
            subjects,
            writer: writer.into(),
        }
    }

    /// Appends `record`, stored before this returns.
    ///
    /// # Errors
    /// The publish's: the stream missing (no coordinator made it), JetStream out of reach, a
    /// permission the connection lacks, a `via` that is not a subject token.
    pub async fn record(&self, record: &AuditRecord) -> Result<(), chorus_broker_adapter::Error> {
        let via = if validate_token("via", &record.via).is_ok() {
            record.via.as_str()
        } else {
            "other"
        };
        let subject = format!("{}.audit.{via}.{}", self.subjects.root(), self.writer);
        let body = serde_json::to_vec(record).unwrap_or_default();
        self.js
            .publish(&subject, None, None, None, body.into())
            .await
            .map(|_| ())
    }

    /// Records since `since_ms`, oldest first, at most `limit`, those of `actor` only when
    /// given; each with its sequence and the writer its subject names.
    ///
    /// # Errors
    /// JetStream out of reach; a bus without the stream has no records.
    pub async fn list(
        &self,
        since_ms: u64,
        actor: Option<&str>,
        limit: usize,
    ) -> Result<Vec<AuditEntry>, chorus_broker_adapter::Error> {
        let stored = match self
            .js
            .scan_since(&self.stream, None, since_ms, usize::MAX)
            .await
        {
            Ok(stored) => stored,
            Err(e) if e.kind() == chorus_broker_adapter::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        let mut out: Vec<AuditEntry> = stored
            .into_iter()
            .filter_map(|m| {
                let record: AuditRecord = serde_json::from_slice(&m.payload).ok()?;
                if actor.is_some_and(|a| a != record.actor) {
                    return None;
                }
                let writer = m.subject.rsplit('.').next().unwrap_or_default().to_owned();
                Some(AuditEntry {
                    sequence: m.sequence,
                    writer,
                    record,
                })
            })
            .collect();
        if out.len() > limit {
            out.drain(..out.len() - limit);
        }
        Ok(out)
    }
}

/// A record as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AuditEntry {
    /// Its sequence in the stream.
    pub sequence: u64,
    /// The agent whose connection wrote it (the last token of its subject).
    pub writer: String,
    /// The record.
    #[serde(flatten)]
    pub record: AuditRecord,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_json_without_what_it_does_not_say_and_its_detail_is_bounded() {
        let r = AuditRecord::new("gateway", "web-ui", "POST /v1/requests", "ok").status(200);
        let json = serde_json::to_value(&r).expect("json");
        assert_eq!(json["actor"], "web-ui");
        assert!(json.get("target").is_none() && json.get("detail").is_none());
        let long =
            AuditRecord::new("console", "ops", "dlq.purge", "failed").detail("é".repeat(400));
        assert!(long.detail.as_ref().is_some_and(|d| d.len() <= 512));
        let subjects = Subjects::new("chorus").expect("root");
        assert_eq!(
            audit_stream(&subjects, 1).subjects,
            vec!["chorus.audit.>".to_owned()]
        );
        assert_eq!(
            audit_of(&subjects, "web-ui").expect("id"),
            "chorus.audit.*.web-ui"
        );
        assert!(audit_of(&subjects, "a.b").is_err());
    }
}

/// Records waiting to be written, at most; past it new ones are dropped and counted.
pub const AUDIT_QUEUE: usize = 4096;

/// Writes records in the background, in order, so an action is never held up by its record:
/// [`AuditSink::record`] queues (dropping, with a warning, past [`AUDIT_QUEUE`] waiting), one
/// task of the owner's tracker writes, and at stop writes what is queued within
/// [`crate::JETSTREAM_TIMEOUT`].
#[derive(Debug, Clone)]
pub struct AuditSink {
    queue: tokio::sync::mpsc::Sender<AuditRecord>,
    dropped: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl AuditSink {
    /// Starts the writer of `log` on `tracker`, stopped by `stop`.
    pub fn start(
        log: AuditLog,
        tracker: &tokio_util::task::TaskTracker,
        stop: tokio_util::sync::CancellationToken,
    ) -> AuditSink {
        let (queue, mut waiting) = tokio::sync::mpsc::channel::<AuditRecord>(AUDIT_QUEUE);
        tracker.spawn(async move {
            let write = |record: AuditRecord| {
                let log = log.clone();
                async move {
                    if let Err(e) = log.record(&record).await {
                        tracing::warn!(error = %crate::Report(&e), actor = %record.actor, action = %record.action, "audit record not written");
                    }
                }
            };
            loop {
                tokio::select! {
                    next = waiting.recv() => match next {
                        Some(record) => write(record).await,
                        None => return,
                    },
                    () = stop.cancelled() => break,
                }
            }
            waiting.close();
            let rest = async {
                while let Some(record) = waiting.recv().await {
                    write(record).await;
                }
            };
            let _ = tokio::time::timeout(crate::JETSTREAM_TIMEOUT, rest).await;
        });
        AuditSink {
            queue,
            dropped: std::sync::Arc::default(),
        }
    }

    /// Queues `record`; dropped with a warning when the queue is full or the writer stopped.
    pub fn record(&self, record: AuditRecord) {
        if let Err(e) = self.queue.try_send(record) {
            let dropped = self
                .dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            let record = match e {
                tokio::sync::mpsc::error::TrySendError::Full(r)
                | tokio::sync::mpsc::error::TrySendError::Closed(r) => r,
            };
            tracing::warn!(actor = %record.actor, action = %record.action, dropped, "audit queue full or closed: record dropped");
        }
    }

    /// Records dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }
}
