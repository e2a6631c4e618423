//! The requester's side: submitting a task, and the handle that watches it. A handle holds
//! nothing the task stream does not: dropped and made again from the id (in another process,
//! after a restart), it sees the same task.

use crate::Report;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use chorus_broker_adapter::StoredMessage;
use futures::StreamExt;
use serde::Serialize;
use uuid::Uuid;

use super::store::{TaskStore, decode, state_of};
use super::{Fold, TaskReport, TaskUpdate};
use crate::error::SdkError;
use crate::outbound::Call;
use crate::protocol::codec::encode_payload;
use crate::protocol::envelope::{ExpectedReply, Kind, Performative, Progress, TaskState, now_ms};
use crate::protocol::status::StatusCode;
use crate::protocol::task::TaskMessage;

/// After a task's deadline, how long the requester leaves the worker to record the expiry
/// itself before recording it in its place (a worker that died cannot).
pub const EXPIRY_GRACE: Duration = Duration::from_secs(2);
/// The registry's event for an agent that left (docs/PROTOCOL.md section 7.7).
const REGISTRY_LEFT: &str = "registry.left";

/// The agent a task is with while it works on it (accepted, working, input required).
fn working_agent(report: &TaskReport) -> Option<String> {
    matches!(
        report.state,
        TaskState::Accepted | TaskState::Working | TaskState::InputRequired
    )
    .then(|| report.attempts.last())
    .flatten()
    .filter(|a| a.ended_ms.is_none())
    .map(|a| a.agent.clone())
}

/// Whether a `registry.left` event says `agent` stopped without a goodbye (5009: its
/// heartbeats stopped). An agent that said goodbye ended its tasks itself. Only the
/// coordinator's word counts: from `coordinator`, and signed with its key where this agent
/// verifies signatures and knows that key; another is ignored and counted
/// (`AgentStats::security_refused`), so no one abandons a requester's task by forging a
/// departure.
fn gone_without_goodbye(
    out: &crate::outbound::Outbound,
    event: &chorus_broker_adapter::Message,
    agent: &str,
) -> bool {
    #[derive(serde::Deserialize)]
    struct Left {
        agent: String,
    }
    let Ok((env, _)) = crate::protocol::codec::decode_shared(event.payload()) else {
        return false;
    };
    if env.status != Some(StatusCode::UNEXPECTED_DISCONNECT)
        || !crate::protocol::codec::decode_payload::<Left>(&env.payload, &env.content_type)
            .is_ok_and(|left| left.agent == agent)
    {
        return false;
    }
    match out.coordinators_word(event.subject(), &env) {
        Ok(()) => true,
        Err(why) => {
            out.link.count_security_refusal();
            tracing::warn!(agent = %out.link.id, from = %env.from, %why, "a registry.left event ignored");
            false
        }
    }
}

/// The kinds of message a report is folded from, read through the task's one wildcard
/// subject (the server finds a task's messages by its subject index whatever the stream's
/// size; a consumer with several filters would scan the stream from its start instead).
pub(crate) const FOLDED: [TaskMessage; 0] = [];

/// How long [`TaskHandle::cancel`] waits for the worker to confirm before recording the
/// cancel itself.
pub const CANCEL_CONFIRM: Duration = Duration::from_secs(3);

/// Submits `call` as a task: records it, then asks its target to take it. With `confirm`, the
/// worker reports its result for the requester to verify instead of completing the task.
pub(crate) async fn submit(
    store: &Arc<TaskStore>,
    call: Call,
    confirm: bool,
) -> Result<TaskHandle, SdkError> {
    store.ensure().await?;
    let out = &store.out;
    let (subject, mut env, timeout) = out.prepare(call.command(), None)?;
    let id = env.id;
    env.performative = Performative::Assign;
    env.correlation_id = Some(id);
    // The submission's own life is the task's deadline, not the wait for an answer.
    env.ttl_ms = None;
    env.expect = Some(ExpectedReply {
        performative: if confirm {
            Performative::Confirm
        } else {
            Performative::Agree
        },
        timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    });
    env.progress = Some(Progress {
        state: TaskState::Submitted,
        fraction: None,
    });
    store.create(id, env.clone()).await?;
    let handle = TaskHandle::new(Arc::clone(store), id);
    let otel = opentelemetry::Context::current();
    let answered = out.exchange(&subject, env, timeout, &otel).await;
    if let Ok(reply) = &answered
        && !confirm
    {
        complete_if_plain(store, id, reply).await;
    }
    if let Err(err) = answered {
        // Nobody took it: record why, unless it was taken meanwhile (an answer lost on the
        // way back is no refusal).
        let mut rejected = store.state_message(id, TaskState::Rejected);
        rejected.status = Some(err.status());
        rejected.reason = Some(err.to_string());
        match store.transition(id, None, rejected).await {
            Ok(_) => return Err(err),
            Err(SdkError::TaskState { .. }) => {}
            Err(other) => {
                tracing::warn!(task = %id, error = %Report(&other), "task refusal not recorded");
                return Err(err);
            }
        }
    }
    Ok(handle)
}

/// A task worker records `accepted` before it answers a submission, so a submission answered
/// while its task is still `submitted` was answered by a plain command handler (PROTOCOL.md
/// section 7.4): its answer is the task's result, which the requester records (`accepted`,
/// `working`, then `completed` with the answer), so the task ends instead of waiting for a
/// worker that will never come.
async fn complete_if_plain(store: &Arc<TaskStore>, id: Uuid, reply: &crate::Reply) {
    let Ok(Some((seq, last))) = store.last_status(id).await else {
        return;
    };
    if state_of(&last) != TaskState::Submitted {
        return;
    }
    let mut completed = store.state_message(id, TaskState::Completed);
    completed.payload = reply.envelope.payload.clone();
    completed.content_type = reply.envelope.content_type.clone();
    completed.reason = Some(format!(
        "answered by {} as a command, not a task",
        reply.envelope.from
    ));
    let mut known = Some((seq, TaskState::Submitted));
    for env in [
        store.state_message(id, TaskState::Accepted),
        store.state_message(id, TaskState::Working),
        completed,
    ] {
        let state = state_of(&env);
        match store.transition(id, known, env).await {
            Ok(seq) => known = Some((seq, state)),
            Err(e) => {
                // A worker came after all (or the task moved on): its states stand.
                tracing::debug!(task = %id, error = %Report(&e), "a command's answer not recorded as the task's result");
                return;
            }
        }
    }
}

/// A task seen from the requester (or anyone allowed to read it): its updates as a stream,
/// its report, and the requester's moves (cancel, answer a question). Cheap to clone.
#[derive(Clone)]
pub struct TaskHandle {
    id: Uuid,
    store: Arc<TaskStore>,
    seen: Arc<AtomicU64>,
}

impl std::fmt::Debug for TaskHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskHandle")
            .field("id", &self.id)
            .field("seen", &self.last_seen())
            .finish()
    }
}

impl TaskHandle {
    pub(crate) fn new(store: Arc<TaskStore>, id: Uuid) -> Self {
        TaskHandle {
            id,
            store,
            seen: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The handle of task `id`, if it is recorded.
    pub(crate) async fn lookup(store: &Arc<TaskStore>, id: Uuid) -> Result<TaskHandle, SdkError> {
        store.ensure().await?;
        match store.last_status(id).await? {
            Some(_) => Ok(TaskHandle::new(Arc::clone(store), id)),
            None => Err(SdkError::TaskNotFound(id)),
        }
    }

    /// The task's id: give it to [`Agent::task`](crate::Agent::task) to watch it again.
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// The sequence of the last update [`TaskHandle::updates`] yielded (0 before any): what
    /// a requester keeps to resume after a restart.
    pub fn last_seen(&self) -> u64 {
        self.seen.load(Ordering::Acquire)
    }

    /// Every message of the task after the last one this handle yielded, in order, then each
    /// new one, ending after the terminal state.
    ///
    /// # Errors
    /// [`SdkError::Broker`] when the task stream cannot be read.
    pub async fn updates(&self) -> Result<TaskUpdates, SdkError> {
        self.updates_after(self.last_seen()).await
    }

    /// Every message of the task after sequence `seq` (0: from the start), then each new
    /// one, ending after the terminal state: resuming from the last sequence seen gives no
    /// gap and no repeat.
    ///
    /// # Errors
    /// [`SdkError::Broker`] when the task stream cannot be read.
    pub async fn updates_after(&self, seq: u64) -> Result<TaskUpdates, SdkError> {
        let follow = self.store.follow(self.id, &[], seq).await?;
        Ok(TaskUpdates {
            follow: Some(follow),
            closing: None,
            subjects: self.store.out.link.subjects.clone(),
            seen: Arc::clone(&self.seen),
            done: false,
        })
    }

    /// Every message of the task stored so far (at most `max`), oldest first, without
    /// waiting for more: its submission (the input), states, progress, chunks, answers and
    /// cancels, what a view of its whole history (an A2A task's history and artifacts) is
    /// made from.
    ///
    /// # Errors
    /// [`SdkError::TaskNotFound`] when the task has no message; [`SdkError::Broker`] or
    /// [`SdkError::Codec`] when they cannot be read.
    pub async fn history(&self, max: usize) -> Result<Vec<TaskUpdate>, SdkError> {
        let subjects = &self.store.out.link.subjects;
        let out = TaskUpdate::read_all(subjects, self.store.messages(self.id, max).await?)?
            .into_iter()
            .map(|(_, update)| update)
            .collect::<Vec<_>>();
        if out.is_empty() {
            return Err(SdkError::TaskNotFound(self.id));
        }
        Ok(out)
    }

    /// Where the task stands now.
    ///
    /// # Errors
    /// [`SdkError::TaskNotFound`] when the task is not recorded; [`SdkError::Broker`] or
    /// [`SdkError::Codec`] when its state cannot be read.
    pub async fn state(&self) -> Result<TaskState, SdkError> {
        match self.store.last_status(self.id).await? {
            Some((_, env)) => Ok(state_of(&env)),
            None => Err(SdkError::TaskNotFound(self.id)),
        }
    }

    /// The task's report as it stands now (terminal or not).
    ///
    /// # Errors
    /// [`SdkError::TaskNotFound`] when the task is not recorded; [`SdkError::Broker`] or
    /// [`SdkError::Codec`] when its messages cannot be read.
    pub async fn report(&self) -> Result<TaskReport, SdkError> {
        let Some((mut last, _)) = self.store.last_status(self.id).await? else {
            return Err(SdkError::TaskNotFound(self.id));
        };
        if let Some(report) = self.store.last_of(self.id, TaskMessage::Report).await? {
            last = last.max(report.sequence);
        }
        let mut states = self.store.follow(self.id, &FOLDED, 0).await?;
        let mut fold = Fold::default();
        while let Some(stored) = states.next().await {
            let stored = stored?;
            self.fold_in(&mut fold, &stored)?;
            if stored.sequence >= last {
                break;
            }
        }
        self.store.close(states);
        fold.into_report().ok_or(SdkError::TaskNotFound(self.id))
    }

    fn fold_in(&self, fold: &mut Fold, stored: &StoredMessage) -> Result<(), SdkError> {
        let kind = self
            .store
            .out
            .link
            .subjects
            .task_of(&stored.subject)
            .map_or(TaskMessage::Status, |(_, kind)| kind);
        fold.message(self.id, kind, stored.sequence, &decode(stored)?);
        Ok(())
    }

    /// Waits for the task to finish and returns its report. Past the task's deadline (and
    /// [`EXPIRY_GRACE`] for its worker to say so), a task still unfinished is recorded as
    /// expired here: a worker that died cannot.
    ///
    /// # Errors
    /// [`SdkError::Broker`] or [`SdkError::Codec`] when the task's messages cannot be read, or an
    /// expiry cannot be recorded; [`SdkError::TaskNotFound`] when they end, or have lost the
    /// submission, before the task finishes.
    pub async fn result(&self) -> Result<TaskReport, SdkError> {
        // Agents the registry declares gone (their heartbeats stopped): a worker among them
        // will not finish.
        let out = &self.store.out;
        let mut departures = out
            .link
            .broker
            .subscribe(&out.link.subjects.event(REGISTRY_LEFT)?)
            .await?;
        // Its states alone (not its chunks); a verified task's reports are folded in at the end.
        let mut states = self
            .store
            .follow(self.id, &[TaskMessage::Status], 0)
            .await?;
        let mut fold = Fold::default();
        let mut expiry: Option<Pin<Box<tokio::time::Sleep>>> = None;
        loop {
            let expired = async {
                match expiry.as_mut() {
                    Some(sleep) => sleep.as_mut().await,
                    None => std::future::pending().await,
                }
            };
            let next = tokio::select! {
                next = states.next() => next,
                () = expired => {
                    expiry = None;
                    self.expire().await?;
                    continue;
                }
                Some(left) = departures.next() => {
                    if let Some(worker) = fold.report().and_then(working_agent)
                        && gone_without_goodbye(out, &left, &worker)
                    {
                        self.abandon(&worker).await?;
                    }
                    continue;
                }
            };
            let Some(stored) = next else {
                return Err(SdkError::TaskNotFound(self.id));
            };
            let stored = stored?;
            self.fold_in(&mut fold, &stored)?;
            let Some(report) = fold.report() else {
                continue;
            };
            if report.is_finished() {
                self.store.close(states);
                if fold.verified() {
                    return self.report().await;
                }
                return fold.into_report().ok_or(SdkError::TaskNotFound(self.id));
            }
            if expiry.is_none()
                && let Some(deadline) = report.deadline_ms
            {
                let left = Duration::from_millis(deadline.saturating_sub(now_ms()));
                expiry = Some(Box::pin(tokio::time::sleep(left + EXPIRY_GRACE)));
            }
        }
    }

    /// Records that `worker` left without finishing the task (its heartbeats stopped); a task
    /// that moved on meanwhile stays as it is.
    async fn abandon(&self, worker: &str) -> Result<(), SdkError> {
        let mut env = self.store.state_message(self.id, TaskState::Failed);
        env.status = Some(StatusCode::UNEXPECTED_DISCONNECT);
        env.reason = Some(format!("{worker} left without finishing the task"));
        match self.store.transition(self.id, None, env).await {
            Ok(_) | Err(SdkError::TaskState { .. }) => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// [`TaskHandle::result`], waiting at most `timeout` ([`SdkError::Timeout`] after).
    ///
    /// # Errors
    /// [`SdkError::Timeout`] when the task has not finished within `timeout`; otherwise as
    /// [`result`](TaskHandle::result).
    pub async fn result_within(&self, timeout: Duration) -> Result<TaskReport, SdkError> {
        tokio::time::timeout(timeout, self.result())
            .await
            .map_err(|_| SdkError::Timeout(timeout))?
    }

    /// Records the expiry in the worker's place; a task that finished meanwhile stays as it is.
    async fn expire(&self) -> Result<(), SdkError> {
        let mut env = self.store.state_message(self.id, TaskState::Expired);
        env.reason = Some("the task's deadline passed and its worker did not finish it".into());
        match self.store.transition(self.id, None, env).await {
            Ok(_) | Err(SdkError::TaskState { .. }) => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// Asks the worker to stop, and returns the task's report once it has. A worker that does
    /// not confirm within [`CANCEL_CONFIRM`] (gone, or stuck) is not waited for: the cancel is
    /// recorded here. A task already finished stays as it is.
    ///
    /// # Errors
    /// [`SdkError::Broker`] when the cancel cannot be stored or the task read; otherwise as
    /// [`result`](TaskHandle::result).
    pub async fn cancel(&self) -> Result<TaskReport, SdkError> {
        let mut env = self
            .store
            .message(self.id, Kind::Command, Performative::Cancel);
        env.reason = Some("cancelled by the requester".into());
        self.store.append(self.id, TaskMessage::Cancel, env).await?;
        match tokio::time::timeout(CANCEL_CONFIRM, self.result()).await {
            Ok(report) => report,
            Err(_) => {
                let mut env = self.store.state_message(self.id, TaskState::Cancelled);
                env.reason = Some("cancelled by the requester; the worker did not confirm".into());
                match self.store.transition(self.id, None, env).await {
                    Ok(_) | Err(SdkError::TaskState { .. }) => self.report().await,
                    Err(err) => Err(err),
                }
            }
        }
    }

    /// Answers the question of a task that is `input_required`.
    ///
    /// # Errors
    /// [`SdkError::TaskNotFound`] when the task is not recorded; [`SdkError::TaskState`] when it is
    /// not `input_required`; [`SdkError::Codec`] when `answer` does not encode;
    /// [`SdkError::Broker`] when it cannot be stored.
    pub async fn respond<T: Serialize + ?Sized>(&self, answer: &T) -> Result<(), SdkError> {
        let Some((_, last)) = self.store.last_status(self.id).await? else {
            return Err(SdkError::TaskNotFound(self.id));
        };
        let state = state_of(&last);
        if state != TaskState::InputRequired {
            return Err(SdkError::TaskState {
                task: self.id,
                illegal: crate::protocol::task::IllegalTransition {
                    from: state,
                    to: TaskState::Working,
                },
            });
        }
        let mut env = self
            .store
            .message(self.id, Kind::Response, Performative::Inform);
        env.in_reply_to = Some(last.id);
        env.content_type = last.content_type.clone();
        env.payload = encode_payload(answer, &env.content_type)?;
        self.store.append(self.id, TaskMessage::Input, env).await?;
        Ok(())
    }
}

/// A task's updates, in order; ends after the terminal state (and then removes its consumer
/// from the server). Each one yielded moves the handle's [`TaskHandle::last_seen`].
pub struct TaskUpdates {
    follow: Option<chorus_broker_adapter::Follow>,
    closing: Option<Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    subjects: crate::Subjects,
    seen: Arc<AtomicU64>,
    done: bool,
}

impl std::fmt::Debug for TaskUpdates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskUpdates")
            .field("seen", &self.seen.load(Ordering::Relaxed))
            .finish()
    }
}

impl TaskUpdates {
    /// Stops reading and removes its consumer from the server at once. A stream read to its
    /// end removes it by itself; one left early without this keeps it on the server until it
    /// has been idle for 30 s (a reader that leaves many streams early should close them).
    pub async fn close(mut self) {
        if let Some(follow) = self.follow.take() {
            follow.close().await;
        }
    }
}

impl futures::Stream for TaskUpdates {
    type Item = Result<TaskUpdate, SdkError>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Self::Item>> {
        if self.done {
            // Remove the consumer before saying the end.
            if let Some(follow) = self.follow.take() {
                self.closing = Some(Box::pin(follow.close()));
            }
            if let Some(closing) = self.closing.as_mut() {
                if closing.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.closing = None;
            }
            return Poll::Ready(None);
        }
        let Some(follow) = self.follow.as_mut() else {
            return Poll::Ready(None);
        };
        let stored = match follow.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(stored))) => stored,
            Poll::Ready(Some(Err(err))) => return Poll::Ready(Some(Err(err.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        let Some((_, kind)) = self.subjects.task_of(&stored.subject) else {
            return Poll::Ready(Some(Err(SdkError::InvalidCall(format!(
                "{} is not a task subject",
                stored.subject
            )))));
        };
        let envelope = match decode(&stored) {
            Ok(env) => env,
            Err(err) => return Poll::Ready(Some(Err(err))),
        };
        self.seen.fetch_max(stored.sequence, Ordering::AcqRel);
        let update = TaskUpdate {
            seq: stored.sequence,
            stored_ms: stored.stored_ms,
            kind,
            envelope,
        };
        if update.state().is_some_and(TaskState::is_terminal) {
            self.done = true;
        }
        Poll::Ready(Some(Ok(update)))
    }
}
