//! Tasks from the agent's side: serving task handlers, submitting tasks, looking them up.

use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use super::Agent;
use crate::error::{HandlerError, SdkError};
use crate::outbound::Call;
use crate::protocol::envelope::TaskState;
use crate::task::store::{decode, state_of};
use crate::task::{TaskContext, TaskEndpoint, TaskHandle, TaskHandler, TypedTask};

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
    pub async fn handle_task(&self, name: &str, handler: impl TaskHandler) -> Result<(), SdkError> {
        let tasks = &self.inner.tasks;
        tasks.store.ensure().await?;
        let endpoint = TaskEndpoint::new(Arc::clone(tasks), Arc::new(handler));
        self.handle_command(name, endpoint).await
    }

    /// Serves tasks submitted to `capability` ([`Call::capability`]), shared among every
    /// agent serving it like its requests.
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
        self.handle_capability(capability, endpoint).await
    }

    /// Submits `call` as a task and returns its handle once an agent has taken it. The task
    /// is recorded first, so even a refusal (no agent serving it, a permission, a full
    /// agent) is on record as `rejected`, and is this call's error. [`Call::deadline`] sets
    /// the task's deadline; [`Call::timeout`] how long to wait for an agent to take it.
    ///
    /// ```no_run
    /// # async fn run(agent: agent_sdk::Agent) -> Result<(), agent_sdk::SdkError> {
    /// use agent_sdk::Call;
    /// use std::time::Duration;
    /// let task = agent
    ///     .submit(Call::agent("writer", "draft").payload(&"a haiku")?.deadline(Duration::from_secs(60)))
    ///     .await?;
    /// let report = task.result().await?;
    /// let text: String = report.output_as()?;
    /// # Ok(()) }
    /// ```
    pub async fn submit(&self, call: Call) -> Result<TaskHandle, SdkError> {
        crate::task::submit(&self.inner.tasks.store, call).await
    }

    /// The handle of task `id`, recorded by this or any other agent (a requester that
    /// restarted finds its task here).
    pub async fn task(&self, id: Uuid) -> Result<TaskHandle, SdkError> {
        TaskHandle::lookup(&self.inner.tasks.store, id).await
    }

    /// The latest state of each task recorded (at most `max`), oldest change first.
    pub async fn tasks(&self, max: usize) -> Result<Vec<TaskSummary>, SdkError> {
        let store = &self.inner.tasks.store;
        let subjects = &self.inner.out.subjects;
        let mut out = Vec::new();
        for stored in store.latest_states(max).await? {
            let Some((id, _)) = subjects.task_of(&stored.subject) else {
                continue;
            };
            match decode(&stored) {
                Ok(env) => out.push(TaskSummary {
                    id,
                    state: state_of(&env),
                    by: env.from,
                    updated_ms: env.timestamp_ms,
                    reason: env.reason,
                }),
                Err(err) => tracing::debug!(task = %id, error = %err, "task state does not decode"),
            }
        }
        Ok(out)
    }
}
