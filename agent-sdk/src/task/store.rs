//! Where tasks live: one JetStream stream holding every message of every task, one subject
//! per task and kind (`<root>.task.<id>.<kind>`). A task's state is its last `status`
//! message; a state is written only on the status subject's expected last sequence, so two
//! writers (the worker finishing, the requester cancelling) cannot both move it, and a move
//! the table refuses is never stored.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::{ErrorKind, Follow, StoredMessage, StreamSpec};
use uuid::Uuid;

use crate::error::SdkError;
use crate::outbound::Outbound;
use crate::protocol::codec;
use crate::protocol::envelope::{Envelope, Kind, Performative, Progress, TaskState};
use crate::protocol::status::StatusCode;
use crate::protocol::task::{TaskMessage, transition};

/// Suffix of the task stream's name (`CHORUS_TASKS` under the default root).
pub const TASK_STREAM: &str = "TASKS";
/// How long a task's messages are kept by default: long enough to look a finished task up,
/// short enough that the stream does not grow without end.
pub const DEFAULT_TASK_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// How often a state write that lost a race is read back and tried again before giving up
/// (each retry follows a write by someone else, so this bounds contention, not time).
const STATE_WRITE_ATTEMPTS: usize = 8;

/// The task stream.
pub fn task_stream(subjects: &crate::Subjects, replicas: usize) -> StreamSpec {
    let mut spec = StreamSpec::new(
        subjects.stream_name(TASK_STREAM),
        vec![format!("{}.task.*.*", subjects.root())],
    );
    spec.max_age = DEFAULT_TASK_RETENTION;
    spec.replicas = replicas;
    spec.description = "Chorus tasks: submissions, states, progress, chunks, input, cancels".into();
    spec
}

/// The kind and speech act a status message carries for each state.
pub(crate) fn state_shape(state: TaskState) -> (Kind, Performative) {
    match state.normalized() {
        TaskState::Submitted => (Kind::Command, Performative::Assign),
        TaskState::Accepted => (Kind::Response, Performative::Agree),
        TaskState::InputRequired => (Kind::Request, Performative::Query),
        TaskState::Completed => (Kind::Response, Performative::Done),
        TaskState::Cancelled => (Kind::Response, Performative::Confirm),
        TaskState::Rejected => (Kind::Response, Performative::Refuse),
        TaskState::Failed | TaskState::Expired => (Kind::Error, Performative::Failure),
        _ => (Kind::Event, Performative::Progress),
    }
}

/// The state a status envelope records (`Unknown` if it records none).
pub(crate) fn state_of(env: &Envelope) -> TaskState {
    env.progress
        .as_ref()
        .map_or(TaskState::Unknown, |p| p.state.normalized())
}

/// Reads and writes tasks for one agent.
pub(crate) struct TaskStore {
    /// The agent's identity, subjects, connection and counters.
    pub(crate) link: Arc<crate::link::Link>,
    pub(crate) out: Arc<Outbound>,
    pub(crate) stream: String,
    replicas: usize,
    ready: tokio::sync::OnceCell<()>,
    /// The agent's tracker: consumers done with are removed on it, off the caller's path.
    tracker: tokio_util::task::TaskTracker,
}

impl TaskStore {
    pub(crate) fn new(
        out: Arc<Outbound>,
        replicas: usize,
        tracker: tokio_util::task::TaskTracker,
    ) -> Self {
        TaskStore {
            stream: out.link.subjects.stream_name(TASK_STREAM),
            link: Arc::clone(&out.link),
            out,
            replicas,
            ready: tokio::sync::OnceCell::new(),
            tracker,
        }
    }

    /// Removes a finished reader's consumer from the server in the background (the agent
    /// waits for it at shutdown).
    pub(crate) fn close(&self, follow: Follow) {
        self.tracker.spawn(follow.close());
    }

    /// Records a new task: its submission, as the first state of its status subject (refused
    /// as [`SdkError::TaskState`] if the task exists already).
    pub(crate) async fn create(&self, id: Uuid, mut env: Envelope) -> Result<u64, SdkError> {
        let subject = self.link.subjects.task(&id, TaskMessage::Status);
        let bytes = self.seal(&subject, &mut env)?;
        match self
            .link
            .js
            .publish_if_last(&subject, Some(&env.id.to_string()), 0, bytes)
            .await
        {
            Ok(ack) => Ok(ack.sequence),
            Err(e) if e.kind() == ErrorKind::Conflict => Err(SdkError::TaskState {
                task: id,
                illegal: crate::protocol::task::IllegalTransition {
                    from: TaskState::Unknown,
                    to: TaskState::Submitted,
                },
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// Creates the task stream if nobody has (the coordinator normally has, with its replicas).
    pub(crate) async fn ensure(&self) -> Result<(), SdkError> {
        self.ready
            .get_or_try_init(|| async {
                self.link
                    .js
                    .ensure_stream_exists(&task_stream(&self.link.subjects, self.replicas))
                    .await
                    .map_err(SdkError::from)
            })
            .await
            .map(|_| ())
    }

    /// A new message of task `id` from this agent.
    pub(crate) fn message(&self, id: Uuid, kind: Kind, performative: Performative) -> Envelope {
        let mut env = Envelope::new(kind, performative, self.link.id.as_str());
        env.correlation_id = Some(id);
        env
    }

    /// A new status message moving task `id` to `state`.
    pub(crate) fn state_message(&self, id: Uuid, state: TaskState) -> Envelope {
        let (kind, performative) = state_shape(state);
        let mut env = self.message(id, kind, performative);
        env.progress = Some(Progress {
            state,
            fraction: None,
        });
        env.status = Some(match state {
            TaskState::Completed => StatusCode::OK,
            TaskState::Cancelled => StatusCode::CANCELLED,
            TaskState::Expired => StatusCode::EXPIRED,
            _ => StatusCode::ACCEPTED,
        });
        env
    }

    /// Signs and encodes `env` for `subject`.
    fn seal(&self, subject: &str, env: &mut Envelope) -> Result<Bytes, SdkError> {
        self.out.seal(subject, env);
        Ok(self.out.encode(subject, env)?)
    }

    /// Stores a message of task `id` that is not a change of state; returns its sequence.
    pub(crate) async fn append(
        &self,
        id: Uuid,
        kind: TaskMessage,
        mut env: Envelope,
    ) -> Result<u64, SdkError> {
        let subject = self.link.subjects.task(&id, kind);
        let bytes = self.seal(&subject, &mut env)?;
        let msg_id = env.id.to_string();
        let ack = self
            .link
            .js
            .publish(&subject, None, Some(&msg_id), None, bytes)
            .await?;
        Ok(ack.sequence)
    }

    /// The task's last status message and its sequence, if it has one.
    pub(crate) async fn last_status(&self, id: Uuid) -> Result<Option<(u64, Envelope)>, SdkError> {
        let subject = self.link.subjects.task(&id, TaskMessage::Status);
        match self.link.js.last_on_subject(&self.stream, &subject).await? {
            Some(stored) => Ok(Some((stored.sequence, decode(&stored)?))),
            None => Ok(None),
        }
    }

    /// Moves task `id` to the state `env` records, if the table allows it from the state it
    /// is in. `known` is the caller's last read of the task (its status sequence and state);
    /// without it, or when someone else wrote since, the task is read again. Returns the new
    /// status sequence; a move the table refuses is [`SdkError::TaskState`].
    pub(crate) async fn transition(
        &self,
        id: Uuid,
        known: Option<(u64, TaskState)>,
        mut env: Envelope,
    ) -> Result<u64, SdkError> {
        let to = state_of(&env);
        let subject = self.link.subjects.task(&id, TaskMessage::Status);
        let bytes = self.seal(&subject, &mut env)?;
        let msg_id = env.id.to_string();
        let mut known = known;
        for _ in 0..STATE_WRITE_ATTEMPTS {
            let (last_seq, from) = match known.take() {
                Some((seq, state)) => (seq, Some(state)),
                None => match self.last_status(id).await? {
                    Some((seq, last)) => (seq, Some(state_of(&last))),
                    None => (0, None),
                },
            };
            transition(from, to).map_err(|illegal| SdkError::TaskState { task: id, illegal })?;
            match self
                .link
                .js
                .publish_if_last(&subject, Some(&msg_id), last_seq, bytes.clone())
                .await
            {
                Ok(ack) => return Ok(ack.sequence),
                // Someone else moved it first: read it again and judge the move anew.
                Err(e) if e.kind() == ErrorKind::Conflict => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(SdkError::Remote {
            status: StatusCode::TASK_STATE,
            reason: format!("task {id}: state kept changing under {STATE_WRITE_ATTEMPTS} writes"),
            from: None,
        })
    }

    /// Every message of task `id` after sequence `after`, then each new one; `kinds` narrows
    /// it to those kinds of message (empty: every kind).
    pub(crate) async fn follow(
        &self,
        id: Uuid,
        kinds: &[TaskMessage],
        after: u64,
    ) -> Result<Follow, SdkError> {
        let filters: Vec<String> = if kinds.is_empty() {
            vec![self.link.subjects.task_all(&id)]
        } else {
            kinds
                .iter()
                .map(|kind| self.link.subjects.task(&id, *kind))
                .collect()
        };
        Ok(self.link.js.follow(&self.stream, &filters, after).await?)
    }

    /// The task's first status message: its submission (input, target, deadline).
    pub(crate) async fn submission(&self, id: Uuid) -> Result<Envelope, SdkError> {
        use futures::StreamExt;
        if self.last_status(id).await?.is_none() {
            return Err(SdkError::TaskNotFound(id));
        }
        let mut states = self.follow(id, &[TaskMessage::Status], 0).await?;
        let first = states.next().await;
        self.close(states);
        match first {
            Some(stored) => decode(&stored?),
            None => Err(SdkError::TaskNotFound(id)),
        }
    }

    /// The newest message stored on one of task `id`'s subjects, if any.
    pub(crate) async fn last_of(
        &self,
        id: Uuid,
        kind: TaskMessage,
    ) -> Result<Option<StoredMessage>, SdkError> {
        let subject = self.link.subjects.task(&id, kind);
        Ok(self.link.js.last_on_subject(&self.stream, &subject).await?)
    }

    /// Every message of task `id` stored so far (at most `max`), oldest first.
    pub(crate) async fn messages(
        &self,
        id: Uuid,
        max: usize,
    ) -> Result<Vec<StoredMessage>, SdkError> {
        let filter = self.link.subjects.task_all(&id);
        Ok(self
            .link
            .js
            .scan(&self.stream, Some(&filter), 1, max)
            .await?)
    }

    /// Every change of state of every task stored after sequence `after` (at most `max`),
    /// oldest first.
    pub(crate) async fn states_after(
        &self,
        after: u64,
        max: usize,
    ) -> Result<Vec<StoredMessage>, SdkError> {
        let filter = self.link.subjects.tasks_of_kind(TaskMessage::Status);
        match self
            .link
            .js
            .scan(&self.stream, Some(&filter), after.saturating_add(1), max)
            .await
        {
            Ok(list) => Ok(list),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }

    /// The last status message of every task (at most `max`), oldest first.
    pub(crate) async fn latest_states(&self, max: usize) -> Result<Vec<StoredMessage>, SdkError> {
        let filter = self.link.subjects.tasks_of_kind(TaskMessage::Status);
        match self
            .link
            .js
            .last_per_subject(&self.stream, &filter, max)
            .await
        {
            Ok(list) => Ok(list),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }
}

/// The envelope of a stored task message.
pub(crate) fn decode(stored: &StoredMessage) -> Result<Envelope, SdkError> {
    Ok(codec::decode_shared(&stored.payload)?.0)
}
