//! Tasks: long work with a life of its own. A requester submits a task to an agent or a
//! capability ([`Agent::submit`](crate::Agent::submit)) and gets a [`TaskHandle`]; the agent
//! that takes it runs a task handler ([`Agent::on_task`](crate::Agent::on_task)) that reports
//! progress, streams chunks, asks for input, and sees a cancel or its deadline through its
//! [`TaskContext`]. Every step is a message stored in the task stream, so a task outlives
//! the processes that touch it: a requester that restarts looks its task up by id and goes on
//! watching it from the last message it saw, with no gap and no repeat.
//!
//! The states and the moves between them are [`TaskState`] and the table of moves in the
//! protocol's `task` module; `docs/PROTOCOL.md` (tasks) specifies the messages.

pub(crate) mod handle;
pub(crate) mod store;
mod verify;
mod worker;

pub(crate) use handle::submit;
pub use handle::{CANCEL_CONFIRM, EXPIRY_GRACE, TaskHandle, TaskUpdates};
pub use store::{DEFAULT_TASK_RETENTION, TASK_STREAM, task_stream};
pub(crate) use verify::Check;
pub use verify::{CheckFn, DEFAULT_MAX_ATTEMPTS, Verification};
pub use worker::{CANCEL_GRACE, TaskContext, TaskHandler, TaskStop, TypedTask};
pub(crate) use worker::{TaskEndpoint, Tasks};

use bytes::Bytes;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::error::SdkError;
use crate::protocol::codec::decode_payload;
use crate::protocol::envelope::{ContentType, Envelope, Performative, TaskState};
use crate::protocol::status::StatusCode;
pub use crate::protocol::task::{IllegalTransition, TaskMessage, transition};

/// One message of a task, as a watcher sees it.
#[derive(Debug, Clone)]
pub struct TaskUpdate {
    /// Its sequence in the task stream: resume after it to see only what came later.
    pub seq: u64,
    /// When the stream stored it, ms since the epoch.
    pub stored_ms: u64,
    /// What kind of message it is.
    pub kind: TaskMessage,
    /// The message.
    pub envelope: Envelope,
}

impl TaskUpdate {
    /// Stored task messages as updates, each with its task's id, in order (a message on a
    /// subject that is not a task's is skipped).
    pub(crate) fn read_all(
        subjects: &crate::Subjects,
        stored: Vec<chorus_broker_adapter::StoredMessage>,
    ) -> Result<Vec<(Uuid, TaskUpdate)>, SdkError> {
        let mut out = Vec::with_capacity(stored.len());
        for stored in stored {
            let Some((id, kind)) = subjects.task_of(&stored.subject) else {
                continue;
            };
            out.push((
                id,
                TaskUpdate {
                    seq: stored.sequence,
                    stored_ms: stored.stored_ms,
                    kind,
                    envelope: store::decode(&stored)?,
                },
            ));
        }
        Ok(out)
    }

    /// The state a status message moves the task to.
    pub fn state(&self) -> Option<TaskState> {
        (self.kind == TaskMessage::Status).then(|| store::state_of(&self.envelope))
    }

    /// How long the worker expects the task to take, when this is its acceptance and the
    /// worker has run the task's kind before (its recent runs' moving average).
    pub fn eta(&self) -> Option<std::time::Duration> {
        if self.state() != Some(TaskState::Accepted) || self.envelope.payload.is_empty() {
            return None;
        }
        decode_payload::<worker::Acceptance>(&self.envelope.payload, &self.envelope.content_type)
            .ok()
            .map(|a| std::time::Duration::from_millis(a.eta_ms))
    }

    /// How much is done (0 to 1), when a progress message says.
    pub fn fraction(&self) -> Option<f32> {
        self.envelope.progress.as_ref().and_then(|p| p.fraction)
    }

    /// The text that goes with it: a progress message's message, a question, a reason.
    pub fn text(&self) -> Option<&str> {
        self.envelope.reason.as_deref()
    }

    /// A chunk's number, counting from 1 within its attempt.
    pub fn chunk(&self) -> Option<u64> {
        (self.kind == TaskMessage::Chunk)
            .then(|| self.envelope.seq.map(|s| s.n))
            .flatten()
    }

    /// Whether this chunk is the last of the stream.
    pub fn is_last_chunk(&self) -> bool {
        self.kind == TaskMessage::Chunk && self.envelope.performative == Performative::Done
    }

    /// Who wrote it.
    pub fn from(&self) -> &str {
        &self.envelope.from
    }

    /// The payload: the input, a result, partial data, a chunk, a question or an answer.
    pub fn payload(&self) -> &Bytes {
        &self.envelope.payload
    }

    /// The payload decoded as `T`.
    ///
    /// # Errors
    /// [`SdkError::Codec`] when the content type is not MessagePack or JSON, or the payload does
    /// not decode as `T`.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, SdkError> {
        Ok(decode_payload(
            &self.envelope.payload,
            &self.envelope.content_type,
        )?)
    }
}

/// One agent's turn at a task.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempt {
    /// The agent that took it.
    pub agent: String,
    /// When it took it, ms since the epoch.
    pub started_ms: u64,
    /// When its turn ended, if it has.
    pub ended_ms: Option<u64>,
    /// How its turn ended (the state it left the task in, or `completed` / `failed` for the
    /// result it reported), or where it is.
    pub state: TaskState,
    /// The code its turn ended with, if it has.
    pub status: Option<StatusCode>,
    /// Whether the requester's verification accepted its result (`None`: not verified).
    pub verified: Option<bool>,
    /// Why its turn ended as it did, when someone said (a verdict, a refusal, a reason).
    pub note: Option<String>,
}

/// What a task came to: the outcome, the data, the code, and every attempt with its agent and
/// timing. A task still running has a report too, with its state so far.
#[derive(Debug, Clone)]
pub struct TaskReport {
    /// The task.
    pub id: Uuid,
    /// Where it stands (terminal once finished).
    pub state: TaskState,
    /// The code of its last state (5002 completed, 5020 cancelled, 5011 expired, the
    /// failure's or the refusal's own).
    pub status: StatusCode,
    /// Why, for a state that is not success.
    pub reason: Option<String>,
    /// Who submitted it.
    pub requester: String,
    /// The command or capability it was submitted to.
    pub target: String,
    /// The result (completed) or the question (input required).
    pub output: Bytes,
    /// The content type of `output`.
    pub content_type: ContentType,
    /// Every agent that took it, in order.
    pub attempts: Vec<Attempt>,
    /// When it was submitted, ms since the epoch.
    pub submitted_ms: u64,
    /// When it reached its terminal state.
    pub finished_ms: Option<u64>,
    /// Its deadline, if it has one, ms since the epoch.
    pub deadline_ms: Option<u64>,
    /// The sequence of the last status message folded in.
    pub last_seq: u64,
}

impl Attempt {
    fn new(agent: &str, started_ms: u64) -> Self {
        Attempt {
            agent: agent.to_owned(),
            started_ms,
            ended_ms: None,
            state: TaskState::Accepted,
            status: None,
            verified: None,
            note: None,
        }
    }
}

impl TaskReport {
    /// Whether it completed.
    pub fn is_completed(&self) -> bool {
        self.state == TaskState::Completed
    }

    /// Whether it reached a terminal state.
    pub fn is_finished(&self) -> bool {
        self.state.is_terminal()
    }

    /// The result decoded as `T`; a task that did not complete is an error with its code.
    ///
    /// # Errors
    /// [`SdkError::Remote`] with the task's code and reason when it did not complete;
    /// [`SdkError::Codec`] when the result does not decode as `T`.
    pub fn output_as<T: DeserializeOwned>(&self) -> Result<T, SdkError> {
        if !self.is_completed() {
            return Err(SdkError::Remote {
                status: self.status,
                reason: format!(
                    "task {} is {}{}",
                    self.id,
                    self.state,
                    self.reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                ),
                from: None,
            });
        }
        Ok(decode_payload(&self.output, &self.content_type)?)
    }

    /// A report from the submission (the first status message).
    fn submitted(id: Uuid, seq: u64, env: &Envelope) -> Self {
        TaskReport {
            id,
            state: TaskState::Submitted,
            status: StatusCode::ACCEPTED,
            reason: None,
            requester: env.from.to_string(),
            target: env
                .capability
                .clone()
                .or_else(|| {
                    env.to
                        .first()
                        .map(|a| format!("{a}.{}", env.name.as_deref().unwrap_or_default()))
                })
                .unwrap_or_default(),
            output: Bytes::new(),
            content_type: ContentType::default(),
            attempts: Vec::new(),
            submitted_ms: env.timestamp_ms,
            finished_ms: None,
            deadline_ms: env.deadline_ms,
            last_seq: seq,
        }
    }

    /// Folds one status message in.
    fn apply(&mut self, seq: u64, env: &Envelope) {
        let state = store::state_of(env);
        self.last_seq = seq;
        self.state = state;
        self.status = env.status.unwrap_or(StatusCode::ACCEPTED);
        self.reason = env.reason.clone();
        if matches!(state, TaskState::Completed | TaskState::InputRequired) {
            self.output = env.payload.clone();
            self.content_type = env.content_type.clone();
        }
        match state {
            TaskState::Accepted => self
                .attempts
                .push(Attempt::new(&env.from, env.timestamp_ms)),
            // A new attempt: the last one ended, its result not accepted.
            TaskState::Submitted => {
                if let Some(last) = self.attempts.last_mut() {
                    if last.ended_ms.is_none() {
                        last.ended_ms = Some(env.timestamp_ms);
                        last.state = TaskState::Failed;
                    }
                    if last.verified == Some(true) || last.status.is_some_and(|s| s.is_success()) {
                        last.verified = Some(false);
                    }
                    last.note = env.reason.clone();
                }
            }
            // A working state from another agent: the task was handed to it.
            TaskState::Working
                if self
                    .attempts
                    .last()
                    .is_none_or(|a| a.agent != env.from || a.ended_ms.is_some()) =>
            {
                self.close_attempt(env.timestamp_ms, TaskState::Working);
                if let Some(last) = self.attempts.last_mut() {
                    last.note = env.reason.clone();
                }
                let mut attempt = Attempt::new(&env.from, env.timestamp_ms);
                attempt.state = state;
                self.attempts.push(attempt);
            }
            _ => {
                if let Some(last) = self.attempts.last_mut()
                    && last.ended_ms.is_none()
                {
                    last.state = state;
                }
            }
        }
        if state.is_terminal() {
            self.finished_ms = Some(env.timestamp_ms);
            // The requester accepting a reported result is the verdict on the last attempt.
            if let Some(last) = self.attempts.last_mut()
                && last.ended_ms.is_some()
            {
                if state == TaskState::Completed && last.agent != env.from {
                    last.verified = Some(true);
                } else if last.note.is_none() {
                    last.note = env.reason.clone();
                }
            }
            self.close_attempt(env.timestamp_ms, state);
            if let Some(last) = self.attempts.last_mut()
                && last.status.is_none()
            {
                last.status = env.status;
            }
        }
    }

    /// Folds in one attempt's reported result.
    fn reported(&mut self, seq: u64, env: &Envelope) {
        self.last_seq = self.last_seq.max(seq);
        let done = env.performative == Performative::Done;
        if let Some(last) = self.attempts.last_mut()
            && last.ended_ms.is_none()
        {
            last.ended_ms = Some(env.timestamp_ms);
            last.state = if done {
                TaskState::Completed
            } else {
                TaskState::Failed
            };
            last.status = env.status;
            last.note = env.reason.clone();
        }
    }

    fn close_attempt(&mut self, at_ms: u64, state: TaskState) {
        if let Some(last) = self.attempts.last_mut()
            && last.ended_ms.is_none()
        {
            last.ended_ms = Some(at_ms);
            last.state = state;
        }
    }
}

/// Folds a task's status and report messages, in order, into its report.
#[derive(Debug, Default)]
pub(crate) struct Fold {
    report: Option<TaskReport>,
    verified: bool,
}

impl Fold {
    /// Takes one status message.
    pub(crate) fn status(&mut self, id: Uuid, seq: u64, env: &Envelope) {
        match &mut self.report {
            None => {
                self.verified = env
                    .expect
                    .as_ref()
                    .is_some_and(|e| e.performative == Performative::Confirm);
                self.report = Some(TaskReport::submitted(id, seq, env));
            }
            Some(report) => report.apply(seq, env),
        }
    }

    /// Takes one message of any kind (only states and reports change the report).
    pub(crate) fn message(&mut self, id: Uuid, kind: TaskMessage, seq: u64, env: &Envelope) {
        match kind {
            TaskMessage::Status => self.status(id, seq, env),
            TaskMessage::Report => {
                if let Some(report) = &mut self.report {
                    report.reported(seq, env);
                }
            }
            _ => {}
        }
    }

    /// Whether the task's results were verified by its requester (its attempts then ended in
    /// `report` messages, which only a full fold sees).
    pub(crate) fn verified(&self) -> bool {
        self.verified
    }

    /// The report so far.
    pub(crate) fn report(&self) -> Option<&TaskReport> {
        self.report.as_ref()
    }

    pub(crate) fn into_report(self) -> Option<TaskReport> {
        self.report
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::envelope::{Kind, Progress};

    fn status(from: &str, state: TaskState, at: u64) -> Envelope {
        let (kind, performative) = store::state_shape(state);
        let mut env = Envelope::new(kind, performative, from);
        env.progress = Some(Progress {
            state,
            fraction: None,
        });
        env.timestamp_ms = at;
        env
    }

    #[test]
    fn a_report_records_each_attempt_with_its_agent_and_timing() {
        let id = Uuid::now_v7();
        let mut submit = status("boss", TaskState::Submitted, 100);
        submit.to = vec!["a".into()];
        submit.name = Some("sum".into());
        let mut fold = Fold::default();
        fold.status(id, 1, &submit);
        fold.status(id, 2, &status("a", TaskState::Accepted, 110));
        fold.status(id, 3, &status("a", TaskState::Working, 111));
        // Handed to b.
        fold.status(id, 5, &status("b", TaskState::Working, 150));
        let mut done = status("b", TaskState::Completed, 190);
        done.payload = Bytes::from_static(b"42");
        done.status = Some(StatusCode::OK);
        fold.status(id, 9, &done);
        let report = fold.into_report().expect("a report");
        assert_eq!(report.requester, "boss");
        assert_eq!(report.target, "a.sum");
        assert_eq!(report.state, TaskState::Completed);
        assert_eq!(report.status, StatusCode::OK);
        assert_eq!(report.output, Bytes::from_static(b"42"));
        assert_eq!(report.last_seq, 9);
        assert_eq!(report.finished_ms, Some(190));
        let attempts: Vec<_> = report
            .attempts
            .iter()
            .map(|a| (a.agent.as_str(), a.started_ms, a.ended_ms, a.state))
            .collect();
        assert_eq!(
            attempts,
            [
                ("a", 110, Some(150), TaskState::Working),
                ("b", 150, Some(190), TaskState::Completed),
            ]
        );
        assert_eq!(report.attempts[1].status, Some(StatusCode::OK));
        assert_eq!(report.attempts[1].verified, None);
    }

    #[test]
    fn a_failed_report_keeps_its_code_and_refuses_to_decode_a_result() {
        let id = Uuid::now_v7();
        let mut fold = Fold::default();
        fold.status(id, 1, &status("boss", TaskState::Submitted, 1));
        let mut failed = status("a", TaskState::Failed, 2);
        failed.status = Some(StatusCode::HANDLER_FAILED);
        failed.reason = Some("disk full".into());
        fold.status(id, 2, &failed);
        let report = fold.into_report().expect("a report");
        assert!(report.is_finished());
        assert!(!report.is_completed());
        let err = report.output_as::<u32>().expect_err("not completed");
        assert_eq!(err.status(), StatusCode::HANDLER_FAILED);
        assert!(err.to_string().contains("disk full"), "{err}");
        assert_eq!(Kind::Error, store::state_shape(TaskState::Failed).0);
    }
}
