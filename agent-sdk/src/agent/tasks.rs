//! Tasks from the agent's side: serving task handlers, submitting tasks, looking them up.

use crate::Report;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use super::Agent;
use crate::error::{HandlerError, SdkError};
use crate::handler::endpoint::EndpointKind;
use crate::outbound::Call;
use crate::protocol::envelope::Performative;
use crate::protocol::envelope::TaskState;
use crate::protocol::status::StatusCode;
use crate::task::handle::FOLDED;
use crate::task::store::{decode, state_of};
use crate::task::{
    Check, Fold, TaskContext, TaskEndpoint, TaskHandle, TaskHandler, TaskMessage, TaskReport,
    TaskUpdate, TypedTask, Verification,
};

/// What a verification loop knows of the task's attempts so far.
#[derive(Debug, Default)]
struct Round {
    /// The first submission (the input, the target).
    submission: Option<crate::Envelope>,
    /// Attempts ended so far.
    attempts: u32,
    /// Attempts per agent.
    tries: HashMap<String, u32>,
    /// Agents whose result failed (never reassigned to again).
    failed: Vec<String>,
    /// What happened, attempt by attempt.
    chain: Vec<String>,
}

/// One line of [`Agent::tasks`]: a task and where it stands.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskSummary {
    /// The task.
    pub id: Uuid,
    /// Its state.
    pub state: TaskState,
    /// Who wrote that state (the requester, or the agent working on it).
    pub by: String,
    /// When, ms since the epoch.
    pub updated_ms: u64,
    /// The reason given with it, if any.
    pub reason: Option<String>,
}

impl Agent {
    /// Serves task `name` with a typed handler: a task submitted to this agent with
    /// [`Agent::submit`] and [`Call::agent`]`(id, name)` runs `f` with a [`TaskContext`] to
    /// report progress, stream chunks, ask for input and see a cancel or its deadline. `Ok`
    /// completes the task with the result, `Err` fails it with the error's code.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `name` is not a valid command name; [`SdkError::Broker`] when the
    /// task stream or the subscription cannot be made, or the server does not confirm it in time.
    pub async fn on_task<T, R, F, Fut>(&self, name: &str, f: F) -> Result<(), SdkError>
    where
        F: Fn(TaskContext, T) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<R, HandlerError>> + Send + 'static,
        T: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
    {
        self.handle_task(name, TypedTask::new(f)).await
    }

    /// Serves task `name` with an untyped [`TaskHandler`].
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `name` is not a valid command name; [`SdkError::Broker`] when the
    /// task stream or the subscription cannot be made, or the server does not confirm it in time.
    pub async fn handle_task(&self, name: &str, handler: impl TaskHandler) -> Result<(), SdkError> {
        let tasks = &self.inner.tasks;
        tasks.store.ensure().await?;
        let endpoint = TaskEndpoint::new(Arc::clone(tasks), Arc::new(handler));
        self.handle_command(name, endpoint).await?;
        self.inner.endpoints.mark_task(name, EndpointKind::Command);
        Ok(())
    }

    /// Serves tasks submitted to `capability` ([`Call::capability`]), shared among every
    /// agent serving it like its requests.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `capability` is not a valid capability name; [`SdkError::Broker`]
    /// when the task stream or the subscriptions cannot be made, or the server does not confirm
    /// them in time.
    pub async fn on_task_capability<T, R, F, Fut>(
        &self,
        capability: &str,
        f: F,
    ) -> Result<(), SdkError>
    where
        F: Fn(TaskContext, T) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<R, HandlerError>> + Send + 'static,
        T: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
    {
        let tasks = &self.inner.tasks;
        tasks.store.ensure().await?;
        let endpoint = TaskEndpoint::new(Arc::clone(tasks), Arc::new(TypedTask::new(f)));
        self.handle_capability(capability, endpoint).await?;
        self.inner
            .endpoints
            .mark_task(capability, EndpointKind::Capability);
        Ok(())
    }

    /// Submits `call` as a task and returns its handle once an agent has taken it. The task
    /// is recorded first, so even a refusal (no agent serving it, a permission, a full
    /// agent) is on record as `rejected`, and is this call's error. [`Call::deadline`] sets
    /// the task's deadline; [`Call::timeout`] how long to wait for an agent to take it.
    ///
    /// ```no_run
    /// # async fn run(agent: chorus_sdk::Agent) -> Result<(), chorus_sdk::SdkError> {
    /// use chorus_sdk::Call;
    /// use std::time::Duration;
    /// let task = agent
    ///     .submit(Call::agent("writer", "draft").payload(&"a haiku")?.deadline(Duration::from_secs(60)))
    ///     .await?;
    /// let report = task.result().await?;
    /// let text: String = report.output_as()?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`SdkError::Subject`] or [`SdkError::Encryption`] for a bad call; [`SdkError::Broker`] when
    /// the task cannot be recorded; [`SdkError::Remote`], [`SdkError::NoResponders`] or
    /// [`SdkError::Timeout`] when no agent takes it (the task is then `rejected`).
    pub async fn submit(&self, call: Call) -> Result<TaskHandle, SdkError> {
        crate::task::submit(&self.inner.tasks.store, call, false).await
    }

    /// Submits `call` as a task whose result this agent verifies before accepting it: the
    /// worker reports its result and the task stays `working` until [`Agent::verify`] judges
    /// it. Run [`Agent::verify`] on the handle (now, or after a restart) to see it through.
    ///
    /// # Errors
    /// [`SdkError::Subject`] or [`SdkError::Encryption`] for a bad call; [`SdkError::Broker`] when
    /// the task cannot be recorded; [`SdkError::Remote`], [`SdkError::NoResponders`] or
    /// [`SdkError::Timeout`] when no agent takes it (the task is then `rejected`).
    pub async fn submit_verified(&self, call: Call) -> Result<TaskHandle, SdkError> {
        crate::task::submit(&self.inner.tasks.store, call, true).await
    }

    /// Sees a task submitted with [`Agent::submit_verified`] through to its end: each
    /// attempt's result is checked by `verification`; a result that passes completes the
    /// task, one that fails (or a failure) starts the next attempt as the policy says, each a
    /// message of the task, until the attempts run out and the task fails with 5025. Returns
    /// the final report, which lists every attempt with its agent, timing and verdict.
    /// Resumable: run again on the same task after a restart, it judges only what was not
    /// judged yet.
    ///
    /// # Errors
    /// [`SdkError::Broker`] or [`SdkError::Codec`] when the task's messages cannot be read or the
    /// verdict written; [`SdkError::TaskNotFound`] when they end, or have lost the submission,
    /// before the task finishes; a supervisor's failure other than a refusal.
    pub async fn verify(
        &self,
        task: &TaskHandle,
        verification: &Verification,
    ) -> Result<TaskReport, SdkError> {
        let store = &self.inner.tasks.store;
        let id = task.id();
        // Reports older than the last state were judged before (by an earlier run of this).
        let judged_up_to = store.last_status(id).await?.map_or(0, |(seq, _)| seq);
        let mut messages = store.follow(id, &FOLDED, 0).await?;
        let mut fold = Fold::default();
        let mut round = Round::default();
        while let Some(stored) = messages.next().await {
            let stored = stored?;
            let Some((_, kind)) = self.inner.link.subjects.task_of(&stored.subject) else {
                continue;
            };
            let env = decode(&stored)?;
            fold.message(id, kind, stored.sequence, &env);
            match kind {
                TaskMessage::Status => {
                    if round.submission.is_none() {
                        round.submission = Some(env.clone());
                    }
                    if state_of(&env).is_terminal() {
                        store.close(messages);
                        return fold.into_report().ok_or(SdkError::TaskNotFound(id));
                    }
                }
                TaskMessage::Report => {
                    round.attempts += 1;
                    *round.tries.entry(env.from.to_string()).or_default() += 1;
                    if stored.sequence < judged_up_to {
                        // Judged before, and the task went on: it failed.
                        round.failed.push(env.from.to_string());
                        round.chain.push(format!(
                            "attempt {} by {}: failed (judged earlier)",
                            round.attempts, env.from
                        ));
                        continue;
                    }
                    let update = TaskUpdate {
                        seq: stored.sequence,
                        stored_ms: stored.stored_ms,
                        kind,
                        envelope: env,
                    };
                    self.judge(task, verification, &mut round, update).await?;
                }
                _ => {}
            }
        }
        Err(SdkError::TaskNotFound(id))
    }

    /// Judges one attempt's report and writes what follows: `completed`, the next attempt, or
    /// `failed` with 5025.
    async fn judge(
        &self,
        task: &TaskHandle,
        verification: &Verification,
        round: &mut Round,
        report: TaskUpdate,
    ) -> Result<(), SdkError> {
        let store = &self.inner.tasks.store;
        let id = task.id();
        let agent = report.from().to_owned();
        let verdict = if report.envelope.performative == Performative::Done {
            self.check(verification, &report).await?
        } else {
            let status = report.envelope.status.unwrap_or(StatusCode::HANDLER_FAILED);
            Err(format!(
                "failed with {status}{}",
                report.text().map(|r| format!(": {r}")).unwrap_or_default()
            ))
        };
        let why = match verdict {
            Ok(()) => {
                let mut done = store.state_message(id, TaskState::Completed);
                done.in_reply_to = Some(report.envelope.id);
                done.payload = report.envelope.payload.clone();
                done.content_type = report.envelope.content_type.clone();
                return match store.transition(id, None, done).await {
                    Ok(_) | Err(SdkError::TaskState { .. }) => Ok(()),
                    Err(err) => Err(err),
                };
            }
            Err(why) => why,
        };
        tracing::info!(task = %id, %agent, %why, "task result failed verification");
        round.failed.push(agent.clone());
        round
            .chain
            .push(format!("attempt {} by {agent}: {why}", round.attempts));
        let mut last = agent;
        let mut last_why = why;
        loop {
            let Some(next) = self.choose(verification, round, &last, task).await else {
                let mut failed = store.state_message(id, TaskState::Failed);
                failed.status = Some(StatusCode::UNVERIFIED);
                failed.reason = Some(format!(
                    "no result passed verification in {} attempts: {}",
                    round.attempts,
                    round.chain.join("; ")
                ));
                return match store.transition(id, None, failed).await {
                    Ok(_) | Err(SdkError::TaskState { .. }) => Ok(()),
                    Err(err) => Err(err),
                };
            };
            match self
                .resubmit(task, round, &next, Some(last_why.clone()))
                .await
            {
                Ok(()) => return Ok(()),
                Err(SdkError::TaskState { .. }) => return Ok(()),
                Err(err) => {
                    // It did not take it: that counts as its attempt.
                    round.attempts += 1;
                    *round.tries.entry(next.clone()).or_default() += 1;
                    round.failed.push(next.clone());
                    last_why = format!("not taken ({err})");
                    round
                        .chain
                        .push(format!("attempt {} by {next}: {last_why}", round.attempts));
                    last = next;
                }
            }
        }
    }

    /// The verdict of `verification` on one report.
    async fn check(
        &self,
        verification: &Verification,
        report: &TaskUpdate,
    ) -> Result<Result<(), String>, SdkError> {
        if let Some(verdict) = verification.check_locally(report) {
            return Ok(verdict);
        }
        let Check::Agent { agent, command } = &verification.check else {
            return Ok(Ok(()));
        };
        let call = Call::agent(agent.as_str(), command.as_str()).raw_payload(
            report.envelope.payload.clone(),
            report.envelope.content_type.clone(),
        );
        match self.call(call).await {
            Ok(_) => Ok(Ok(())),
            Err(SdkError::Remote { reason, .. }) => Ok(Err(reason)),
            Err(err) => Err(err),
        }
    }

    /// Who gets the next attempt after `last`'s failed, if anyone.
    async fn choose(
        &self,
        verification: &Verification,
        round: &Round,
        last: &str,
        task: &TaskHandle,
    ) -> Option<String> {
        if round.attempts >= verification.max_attempts {
            return None;
        }
        if round.tries.get(last).copied().unwrap_or(0) <= verification.same_agent_retries {
            return Some(last.to_owned());
        }
        let untried = |agent: &String| {
            !round.failed.contains(agent) && verification.supervisor.as_ref() != Some(agent)
        };
        if verification.reassign {
            if let Some(next) = verification.candidates.iter().find(|a| untried(a)) {
                return Some(next.clone());
            }
            let capability = round.submission.as_ref().and_then(|s| s.capability.clone());
            if verification.candidates.is_empty()
                && let Some(capability) = capability
            {
                match self.discover_capability(&capability).await {
                    Ok(holders) => {
                        if let Some(next) = holders
                            .into_iter()
                            .map(|r| r.manifest.agent)
                            .find(|a| untried(a) && *a != self.inner.link.id)
                        {
                            return Some(next);
                        }
                    }
                    Err(err) => {
                        tracing::warn!(task = %task.id(), error = %Report(&err), "no holders to reassign to: discovery failed");
                    }
                }
            }
        }
        verification
            .supervisor
            .clone()
            .filter(|s| !round.failed.contains(s))
    }

    /// Starts a new attempt of `task` on `agent`: records it, then asks that agent alone.
    async fn resubmit(
        &self,
        task: &TaskHandle,
        round: &Round,
        agent: &str,
        why: Option<String>,
    ) -> Result<(), SdkError> {
        let store = &self.inner.tasks.store;
        let out = &self.inner.out;
        let Some(submission) = &round.submission else {
            return Err(SdkError::TaskNotFound(task.id()));
        };
        let subject = match (&submission.capability, &submission.name) {
            (Some(capability), _) => out.link.subjects.capability_at(agent, capability)?,
            (None, Some(name)) => out.link.subjects.command(agent, name)?,
            (None, None) => {
                return Err(SdkError::InvalidCall(
                    "the submission names no command or capability".into(),
                ));
            }
        };
        let mut again = submission.clone();
        let fresh = uuid::Uuid::now_v7();
        again.id = fresh;
        again.timestamp_ms = (fresh.as_u128() >> 80) as u64;
        again.from = out.link.id.as_str().into();
        again.to = vec![agent.to_owned()];
        again.signature = None;
        again.reason = why.map(|w| format!("{w}; reassigned to {agent}"));
        store.transition(task.id(), None, again.clone()).await?;
        let timeout = again
            .expect
            .as_ref()
            .map_or(out.request_timeout, |e| Duration::from_millis(e.timeout_ms));
        out.exchange(&subject, again, timeout, &opentelemetry::Context::current())
            .await
            .map(|_| ())
    }

    /// The handle of task `id`, recorded by this or any other agent (a requester that
    /// restarted finds its task here).
    ///
    /// # Errors
    /// [`SdkError::TaskNotFound`] when no task `id` is recorded; [`SdkError::Broker`] or
    /// [`SdkError::Codec`] when the task stream cannot be read.
    pub async fn task(&self, id: Uuid) -> Result<TaskHandle, SdkError> {
        TaskHandle::lookup(&self.inner.tasks.store, id).await
    }

    /// Every change of state of every task recorded after stream sequence `after` (0: from
    /// the start; at most `max`), oldest first, each with its task's id: what an index of
    /// tasks reads to stay current (read again after the last `seq` seen). A task's first
    /// change is its submission (`from` its requester, carrying its session).
    ///
    /// # Errors
    /// [`SdkError::Broker`] when the task stream cannot be read (a missing stream is no
    /// change); [`SdkError::Codec`] when a change does not decode.
    pub async fn task_changes(
        &self,
        after: u64,
        max: usize,
    ) -> Result<Vec<(Uuid, TaskUpdate)>, SdkError> {
        let store = &self.inner.tasks.store;
        TaskUpdate::read_all(
            &self.inner.link.subjects,
            store.states_after(after, max).await?,
        )
    }

    /// The latest state of each task recorded (at most `max`), oldest change first.
    ///
    /// # Errors
    /// [`SdkError::Broker`] when the task stream cannot be read (a missing stream is no tasks).
    pub async fn tasks(&self, max: usize) -> Result<Vec<TaskSummary>, SdkError> {
        let store = &self.inner.tasks.store;
        let subjects = &self.inner.link.subjects;
        let mut out = Vec::new();
        for stored in store.latest_states(max).await? {
            let Some((id, _)) = subjects.task_of(&stored.subject) else {
                continue;
            };
            match decode(&stored) {
                Ok(env) => out.push(TaskSummary {
                    id,
                    state: state_of(&env),
                    by: env.from.into(),
                    updated_ms: env.timestamp_ms,
                    reason: env.reason,
                }),
                Err(err) => {
                    tracing::debug!(task = %id, error = %Report(&err), "task state does not decode")
                }
            }
        }
        Ok(out)
    }
}
