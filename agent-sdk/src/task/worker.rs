//! The side that does the work: a task handler is served like a command (or a capability), so
//! a submission passes the same inbound pipeline (signature, permissions, rate limit) as any
//! call. Taking it writes `accepted` (which only one agent can do), the reply tells the
//! requester so at once, and the work runs on as a task of the agent, reporting through the
//! task stream until it writes its terminal state.

use crate::Report;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::store::{TaskStore, state_of};
use crate::error::{HandlerError, SdkError};
use crate::handler::endpoint::{Endpoint, EndpointKind, Endpoints};
use crate::handler::{BoxFuture, Context, Handler, Output};
use crate::outbound::{Call, Outbound};
use crate::protocol::codec::{self, decode_payload, encode_payload};
use crate::protocol::envelope::{
    ContentType, Envelope, Kind, Performative, Progress, Sequence, TaskState, now_ms,
};
use crate::protocol::status::StatusCode;
use crate::protocol::task::TaskMessage;

/// How long a handler has to stop by itself once its task is cancelled or expires, before
/// its future is dropped.
pub const CANCEL_GRACE: Duration = Duration::from_secs(1);
/// How long registering a task's cancel and input subscriptions with the server may take.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a task's work was told to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TaskStop {
    /// The requester cancelled it.
    Cancelled,
    /// Its deadline passed.
    Expired,
    /// The agent is shutting down.
    ShuttingDown,
}

/// Runs a task: like a [`Handler`], with a [`TaskContext`] to report through.
pub trait TaskHandler: Send + Sync + 'static {
    /// Does the work; `Ok` completes the task with the output, `Err` fails it with the code.
    fn run(&self, task: TaskContext) -> BoxFuture<Result<Output, HandlerError>>;
}

/// A typed task handler: the input decoded into `T`, the result `R` encoded as the output.
pub struct TypedTask<F, T, R> {
    f: F,
    _types: std::marker::PhantomData<fn(T) -> R>,
}

impl<F, T, R> TypedTask<F, T, R> {
    /// Wraps `f`.
    pub fn new(f: F) -> Self {
        TypedTask {
            f,
            _types: std::marker::PhantomData,
        }
    }
}

impl<F, T, R> std::fmt::Debug for TypedTask<F, T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TypedTask")
    }
}

impl<F, Fut, T, R> TaskHandler for TypedTask<F, T, R>
where
    F: Fn(TaskContext, T) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<R, HandlerError>> + Send + 'static,
    T: DeserializeOwned + Send + 'static,
    R: Serialize + Send + 'static,
{
    fn run(&self, task: TaskContext) -> BoxFuture<Result<Output, HandlerError>> {
        let request = task.message();
        let content_type = request.content_type.clone();
        let args = decode_payload::<T>(&request.payload, &content_type);
        let fut = args.map(|args| (self.f)(task, args));
        Box::pin(async move {
            let result = fut?.await?;
            let payload = encode_payload(&result, &content_type)?;
            Ok(Output {
                payload,
                content_type,
            })
        })
    }
}

/// An agent's tasks: the store, and the owner of every task it runs.
pub(crate) struct Tasks {
    pub(crate) store: Arc<TaskStore>,
    tracker: TaskTracker,
    stop: CancellationToken,
    /// The agent's endpoints: a task's runs time its endpoint (its acceptance's ETA).
    endpoints: Arc<Endpoints>,
    /// Where a task's run time is counted.
    usage: Arc<crate::usage::Usage>,
}

/// What a task's acceptance carries (section 7.4): how long the worker expects it to take.
#[derive(Debug, Serialize, serde::Deserialize)]
pub(crate) struct Acceptance {
    /// Its recent runs' moving average, in ms.
    pub(crate) eta_ms: u64,
}

impl Tasks {
    pub(crate) fn new(
        store: TaskStore,
        tracker: TaskTracker,
        stop: CancellationToken,
        endpoints: Arc<Endpoints>,
        usage: Arc<crate::usage::Usage>,
    ) -> Self {
        Tasks {
            store: Arc::new(store),
            tracker,
            stop,
            endpoints,
            usage,
        }
    }

    /// The task endpoint `env` was sent to: its command, else its capability (a command and a
    /// capability of the same name are timed apart).
    fn endpoint_of(&self, env: &Envelope) -> Option<Arc<Endpoint>> {
        let (name, kind) = match (&env.name, &env.capability) {
            (Some(name), _) => (name.as_str(), EndpointKind::Command),
            (None, Some(capability)) => (capability.as_str(), EndpointKind::Capability),
            (None, None) => return None,
        };
        self.endpoints
            .all()
            .into_iter()
            .find(|e| e.name == name && e.kind == kind && e.is_task())
    }

    /// Takes the task `ctx` submits, or refuses it with a code.
    async fn accept(
        self: Arc<Self>,
        ctx: Context,
        handler: Arc<dyn TaskHandler>,
    ) -> Result<Output, HandlerError> {
        let env = ctx.message();
        let (id, handoff) = match (env.performative, env.correlation_id) {
            (Performative::Assign, Some(id)) => (id, false),
            (Performative::Handoff, Some(id)) => (id, true),
            _ => {
                return Err(HandlerError::invalid_argument(
                    "this command runs as a task: submit it as one (Agent::submit)",
                ));
            }
        };
        if self.stop.is_cancelled() {
            return Err(SdkError::ShuttingDown.into());
        }
        self.store.ensure().await?;
        let Some((seq, last)) = self.store.last_status(id).await? else {
            return Err(HandlerError::new(
                StatusCode::TASK_STATE,
                format!("task {id} is not recorded in the task stream"),
            ));
        };
        let (seq, state, record) = if handoff {
            // Only the agent working on it may hand it on.
            let working = matches!(
                state_of(&last),
                TaskState::Working | TaskState::InputRequired
            );
            if !working || last.from != env.from {
                return Err(HandlerError::new(
                    StatusCode::TASK_STATE,
                    format!(
                        "task {id} is {} by {}: {} cannot hand it on",
                        state_of(&last),
                        last.from,
                        env.from
                    ),
                ));
            }
            let mut taken = self.store.state_message(id, TaskState::Working);
            taken.reason = Some(format!("handed off by {}", env.from));
            let seq = self
                .store
                .transition(id, Some((seq, state_of(&last))), taken)
                .await?;
            (seq, TaskState::Working, self.store.submission(id).await?)
        } else {
            let mut accepted = self.store.state_message(id, TaskState::Accepted);
            // IACP: "Yes. ETA 120s." The ETA of its recent runs, once it has run.
            if let Some(eta_ms) = self.endpoint_of(env).and_then(|e| e.handling.ms())
                && let Ok(payload) = encode_payload(
                    &Acceptance { eta_ms },
                    crate::protocol::envelope::CONTENT_TYPE_MSGPACK,
                )
            {
                accepted.payload = payload;
                accepted.content_type = crate::protocol::envelope::CONTENT_TYPE_MSGPACK.into();
            }
            let seq = self
                .store
                .transition(id, Some((seq, state_of(&last))), accepted)
                .await?;
            (seq, TaskState::Accepted, last)
        };
        let (inputs, input_rx) = tokio::sync::mpsc::unbounded_channel();
        let run = Arc::new(Run {
            id,
            store: Arc::clone(&self.store),
            last: tokio::sync::Mutex::new((seq, state)),
            stop: CancellationToken::new(),
            why: OnceLock::new(),
            finished: CancellationToken::new(),
            chunks: AtomicU64::new(0),
            handed_off: std::sync::atomic::AtomicBool::new(false),
            // The low bits of a v7 id are random.
            epoch: Uuid::now_v7().as_u128() as u32,
            inputs: tokio::sync::Mutex::new(input_rx),
            // The submission is the record that was accepted: its deadline governs, and it
            // says whether the requester verifies the result before accepting it.
            deadline_ms: record.deadline_ms,
            confirm: record
                .expect
                .as_ref()
                .is_some_and(|e| e.performative == Performative::Confirm),
            requester: record.from.to_string(),
        });
        self.listen(&run, inputs).await?;
        let tasks = Arc::clone(&self);
        let endpoint = self.endpoint_of(env);
        self.tracker
            .spawn(async move { tasks.drive(run, ctx, handler, endpoint).await });
        Ok(Output::default())
    }

    /// Hears the requester's cancel and input for `run` from now on, and a cancel sent before.
    async fn listen(
        &self,
        run: &Arc<Run>,
        inputs: tokio::sync::mpsc::UnboundedSender<Envelope>,
    ) -> Result<(), SdkError> {
        let out = &self.store.out;
        let mut cancels = out
            .link
            .broker
            .subscribe(&out.link.subjects.task(&run.id, TaskMessage::Cancel))
            .await?;
        let mut answers = out
            .link
            .broker
            .subscribe(&out.link.subjects.task(&run.id, TaskMessage::Input))
            .await?;
        out.link.broker.sync(LISTEN_TIMEOUT).await?;
        if let Some(stored) = self.store.last_of(run.id, TaskMessage::Cancel).await?
            && steered(out, run, &stored.subject, &stored.payload).is_some()
        {
            run.halt(TaskStop::Cancelled);
        }
        let run = Arc::clone(run);
        let out = Arc::clone(out);
        self.tracker.spawn(async move {
            loop {
                tokio::select! {
                    m = futures::StreamExt::next(&mut cancels) => match m {
                        Some(m) => {
                            if steered(&out, &run, m.subject(), m.payload()).is_some() {
                                run.halt(TaskStop::Cancelled);
                            }
                        }
                        None => break,
                    },
                    m = futures::StreamExt::next(&mut answers) => match m {
                        Some(m) => {
                            if let Some(env) = steered(&out, &run, m.subject(), m.payload()) {
                                let _ = inputs.send(env);
                            }
                        }
                        None => break,
                    },
                    () = run.finished.cancelled() => break,
                }
            }
            let _ = cancels.unsubscribe().await;
            let _ = answers.unsubscribe().await;
        });
        Ok(())
    }

    /// Runs the handler to its end, a cancel, the deadline or shutdown, and writes the task's
    /// terminal state.
    async fn drive(
        self: Arc<Self>,
        run: Arc<Run>,
        ctx: Context,
        handler: Arc<dyn TaskHandler>,
        endpoint: Option<Arc<Endpoint>>,
    ) {
        let id = run.id;
        let begun = std::time::Instant::now();
        let submission = Arc::clone(&ctx.request);
        let started = run.last.lock().await.1 == TaskState::Working;
        if !started {
            let working = self.store.state_message(id, TaskState::Working);
            if let Err(err) = run.set_state(working).await {
                tracing::debug!(task = %id, error = %Report(&err), "task not started");
                run.finished.cancel();
                return;
            }
        }
        let mut work = handler.run(TaskContext {
            ctx,
            run: Arc::clone(&run),
        });
        let deadline = run.deadline_ms.map(|at| {
            tokio::time::Instant::now() + Duration::from_millis(at.saturating_sub(now_ms()))
        });
        let expiry = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let result = tokio::select! {
            result = &mut work => Some(result),
            () = run.stop.cancelled() => None,
            () = expiry => { run.halt(TaskStop::Expired); None }
            () = self.stop.cancelled() => { run.halt(TaskStop::ShuttingDown); None }
        };
        // Told to stop: the handler may still finish by itself, within the grace.
        let result = match result {
            Some(result) => Some(result),
            None => tokio::time::timeout(CANCEL_GRACE, &mut work).await.ok(),
        };
        drop(work);
        let took = begun.elapsed();
        if let (None, Some(_), Some(endpoint)) = (run.why.get(), &result, &endpoint) {
            // A run that ended by itself: how long its kind takes.
            endpoint.handling.record(took);
            self.endpoints.handling.record(took);
        }
        if let Some(endpoint) = &endpoint {
            // Usage counted the task when it was accepted; its time is the run's, however it
            // ended.
            self.usage.record_run(&submission, &endpoint.name, took);
        }
        if run.handed_off.load(Ordering::Acquire) {
            // Another agent has it now and writes its end.
            run.finished.cancel();
            return;
        }
        let store = &self.store;
        let end = match (run.why.get(), result) {
            (Some(TaskStop::Cancelled), _) => {
                let mut env = store.state_message(id, TaskState::Cancelled);
                env.reason = Some("cancelled by the requester".into());
                env
            }
            (Some(TaskStop::Expired), _) => {
                let mut env = store.state_message(id, TaskState::Expired);
                env.reason = Some("the task's deadline passed before it finished".into());
                env
            }
            (Some(TaskStop::ShuttingDown), _) => failed(
                store,
                id,
                StatusCode::UNAVAILABLE,
                "the agent shut down before it finished",
            ),
            (None, Some(Ok(output))) => {
                let mut env = store.state_message(id, TaskState::Completed);
                env.payload = output.payload;
                env.content_type = output.content_type;
                env
            }
            (None, Some(Err(err))) => failed(store, id, err.status, &err.reason),
            (None, None) => failed(
                store,
                id,
                StatusCode::INTERNAL,
                "the task stopped without a cause",
            ),
        };
        let written = if run.confirm && run.why.get().is_none() {
            // The attempt's result, for the requester to assess.
            let report = as_report(store, id, end);
            store
                .append(id, TaskMessage::Report, report)
                .await
                .map(|_| ())
        } else {
            run.set_state(end).await
        };
        if let Err(err) = written {
            tracing::debug!(task = %id, error = %Report(&err), "task's end not written");
        }
        run.finished.cancel();
    }
}

/// The `report` message of an attempt that ended as `end` says.
fn as_report(store: &TaskStore, id: Uuid, end: Envelope) -> Envelope {
    let performative = if state_of(&end) == TaskState::Completed {
        Performative::Done
    } else {
        Performative::Failure
    };
    let mut report = store.message(id, Kind::Response, performative);
    report.status = end.status;
    report.reason = end.reason;
    report.payload = end.payload;
    report.content_type = end.content_type;
    report
}

fn failed(store: &TaskStore, id: Uuid, status: StatusCode, reason: &str) -> Envelope {
    let mut env = store.state_message(id, TaskState::Failed);
    env.status = Some(status);
    env.reason = Some(reason.to_owned());
    env
}

/// Serves a [`TaskHandler`] as a command or capability handler.
pub(crate) struct TaskEndpoint {
    tasks: Arc<Tasks>,
    handler: Arc<dyn TaskHandler>,
}

impl TaskEndpoint {
    pub(crate) fn new(tasks: Arc<Tasks>, handler: Arc<dyn TaskHandler>) -> Self {
        TaskEndpoint { tasks, handler }
    }
}

impl Handler for TaskEndpoint {
    fn call(&self, ctx: Context) -> BoxFuture<Result<Output, HandlerError>> {
        let tasks = Arc::clone(&self.tasks);
        let handler = Arc::clone(&self.handler);
        Box::pin(tasks.accept(ctx, handler))
    }
}

/// One task being worked on here.
/// A cancel or an answer for `run` (`payload`, received on `subject`), if it may steer the
/// task: it decodes, comes from the task's requester, from the agent working on it, or from
/// the bus's own agents (the coordinator, and the console acting for an operator it let in),
/// and, where this agent verifies signatures, its signature verifies (an unsigned one passes
/// only where signatures are optional). Anything else is ignored, counted and logged.
fn steered(out: &Outbound, run: &Run, subject: &str, payload: &Bytes) -> Option<Envelope> {
    let env = match codec::decode_shared(payload) {
        Ok((env, _)) => env,
        Err(err) => {
            tracing::debug!(task = %run.id, error = %Report(&err), "a task's cancel or input does not decode");
            return None;
        }
    };
    let from = env.from.as_str();
    let allowed = from == run.requester
        || from == out.link.id
        || from == crate::protocol::registry::COORDINATOR_ID
        || from == crate::protocol::registry::CONSOLE_ID;
    let verdict = if allowed {
        out.verifier.as_ref().map_or(Ok(()), |v| {
            v.verify(subject, &env, now_ms())
                .map_err(|(status, reason)| format!("{status}: {reason}"))
        })
    } else {
        Err(format!(
            "{from} is neither its requester {} nor the agent working on it",
            run.requester
        ))
    };
    match verdict {
        Ok(()) => Some(env),
        Err(why) => {
            out.link.count_security_refusal();
            tracing::warn!(agent = %out.link.id, task = %run.id, %from, %why, "a task's cancel or input ignored");
            None
        }
    }
}

struct Run {
    id: Uuid,
    store: Arc<TaskStore>,
    /// The status sequence and state this run last wrote or read.
    last: tokio::sync::Mutex<(u64, TaskState)>,
    /// Tripped by a cancel, the deadline or shutdown (the reason in `why`).
    stop: CancellationToken,
    why: OnceLock<TaskStop>,
    /// Tripped once the terminal state is written: the listeners end.
    finished: CancellationToken,
    chunks: AtomicU64,
    /// Handed to another agent: this run writes nothing more.
    handed_off: std::sync::atomic::AtomicBool,
    epoch: u32,
    inputs: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<Envelope>>,
    deadline_ms: Option<u64>,
    /// The requester verifies the result: it is reported, not written as the task's end.
    confirm: bool,
    /// Who submitted it: one of those whose cancel and answers it takes ([`steers`]).
    requester: String,
}

impl Run {
    fn halt(&self, why: TaskStop) {
        let _ = self.why.set(why);
        self.stop.cancel();
    }

    async fn set_state(&self, env: Envelope) -> Result<(), SdkError> {
        let state = state_of(&env);
        let mut last = self.last.lock().await;
        let seq = self.store.transition(self.id, Some(*last), env).await?;
        *last = (seq, state);
        Ok(())
    }
}

/// What a task handler works with: the [`Context`] of the submission (it derefs to it, so
/// calls made through it continue the conversation), and the task's own reporting: progress,
/// chunks, questions, and whether it has been told to stop.
pub struct TaskContext {
    ctx: Context,
    run: Arc<Run>,
}

impl std::fmt::Debug for TaskContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskContext")
            .field("task", &self.run.id)
            .finish()
    }
}

impl std::ops::Deref for TaskContext {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.ctx
    }
}

impl TaskContext {
    /// The task's id.
    pub fn id(&self) -> Uuid {
        self.run.id
    }

    /// The task's deadline, ms since the epoch, if it has one.
    pub fn deadline_ms(&self) -> Option<u64> {
        self.run.deadline_ms
    }

    /// Whether the task has been told to stop (cancelled, expired, or the agent is stopping).
    pub fn is_cancelled(&self) -> bool {
        self.run.stop.is_cancelled()
    }

    /// Completes when the task is told to stop, with why. A handler selects on it beside its
    /// work, and returns soon after: past [`CANCEL_GRACE`] its future is dropped.
    pub async fn cancelled(&self) -> TaskStop {
        self.run.stop.cancelled().await;
        self.run.why.get().copied().unwrap_or(TaskStop::Cancelled)
    }

    /// Reports progress: how much is done (0 to 1) if known, and a message.
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] when `fraction` is not between 0 and 1; [`SdkError::Broker`] when
    /// the task stream does not store it.
    pub async fn progress(
        &self,
        fraction: Option<f32>,
        message: impl Into<String>,
    ) -> Result<(), SdkError> {
        self.report(
            fraction,
            message.into(),
            Bytes::new(),
            ContentType::default(),
        )
        .await
    }

    /// Reports progress with partial data.
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] when `fraction` is not between 0 and 1; [`SdkError::Codec`] when
    /// `partial` does not encode; [`SdkError::Broker`] when the task stream does not store it.
    pub async fn progress_with<T: Serialize + ?Sized>(
        &self,
        fraction: Option<f32>,
        message: impl Into<String>,
        partial: &T,
    ) -> Result<(), SdkError> {
        let content_type = self.content_type();
        let payload = encode_payload(partial, &content_type)?;
        self.report(fraction, message.into(), payload, content_type)
            .await
    }

    async fn report(
        &self,
        fraction: Option<f32>,
        message: String,
        payload: Bytes,
        content_type: ContentType,
    ) -> Result<(), SdkError> {
        if let Some(f) = fraction
            && !(0.0..=1.0).contains(&f)
        {
            return Err(SdkError::InvalidCall(format!(
                "progress fraction {f} is not between 0 and 1"
            )));
        }
        let store = &self.run.store;
        let mut env = store.message(self.run.id, Kind::Event, Performative::Progress);
        env.progress = Some(Progress {
            state: TaskState::Working,
            fraction,
        });
        env.reason = (!message.is_empty()).then_some(message);
        env.payload = payload;
        env.content_type = content_type;
        store
            .append(self.run.id, TaskMessage::Progress, env)
            .await?;
        Ok(())
    }

    /// Sends the next chunk of a streamed result; returns its number (from 1).
    ///
    /// # Errors
    /// [`SdkError::Codec`] when `data` does not encode in the requester's content type;
    /// [`SdkError::Broker`] when the task stream does not store it.
    pub async fn chunk<T: Serialize + ?Sized>(&self, data: &T) -> Result<u64, SdkError> {
        let content_type = self.content_type();
        let payload = encode_payload(data, &content_type)?;
        self.chunk_bytes(payload, content_type, false).await
    }

    /// Sends the last chunk of a streamed result.
    ///
    /// # Errors
    /// [`SdkError::Codec`] when `data` does not encode in the requester's content type;
    /// [`SdkError::Broker`] when the task stream does not store it.
    pub async fn last_chunk<T: Serialize + ?Sized>(&self, data: &T) -> Result<u64, SdkError> {
        let content_type = self.content_type();
        let payload = encode_payload(data, &content_type)?;
        self.chunk_bytes(payload, content_type, true).await
    }

    /// Sends a chunk of raw bytes; `last` marks the end of the stream. Each is stored before
    /// this returns, so chunks are numbered and kept in the order they were sent.
    ///
    /// # Errors
    /// [`SdkError::Broker`] when the task stream does not store it.
    pub async fn chunk_bytes(
        &self,
        data: Bytes,
        content_type: impl Into<ContentType>,
        last: bool,
    ) -> Result<u64, SdkError> {
        let n = self.run.chunks.fetch_add(1, Ordering::Relaxed) + 1;
        let store = &self.run.store;
        let performative = if last {
            Performative::Done
        } else {
            Performative::Inform
        };
        let mut env = store.message(self.run.id, Kind::Event, performative);
        env.seq = Some(Sequence {
            epoch: self.run.epoch,
            n,
        });
        env.payload = data;
        env.content_type = content_type.into();
        store.append(self.run.id, TaskMessage::Chunk, env).await?;
        Ok(n)
    }

    /// Asks the requester a question and waits for the answer: the task is `input_required`
    /// until it comes, then `working` again. A cancel or the deadline while waiting is an
    /// error (5020 or 5011).
    ///
    /// # Errors
    /// [`SdkError::Remote`] with 5020 when the task is cancelled while waiting,
    /// [`SdkError::Expired`] past its deadline, [`SdkError::ShuttingDown`] when the agent stops;
    /// [`SdkError::Codec`] when the prompt does not encode or the answer does not decode as `R`.
    pub async fn ask<T, R>(&self, question: &str, prompt: &T) -> Result<R, SdkError>
    where
        T: Serialize + ?Sized,
        R: DeserializeOwned,
    {
        let store = &self.run.store;
        let mut env = store.state_message(self.run.id, TaskState::InputRequired);
        env.reason = Some(question.to_owned());
        env.content_type = self.content_type();
        env.payload = encode_payload(prompt, &env.content_type)?;
        self.run.set_state(env).await?;
        let answer = {
            let mut inputs = self.run.inputs.lock().await;
            tokio::select! {
                answer = inputs.recv() => answer,
                () = self.run.stop.cancelled() => None,
            }
        };
        let Some(answer) = answer else {
            return Err(match self.run.why.get() {
                Some(TaskStop::Expired) => SdkError::Expired,
                Some(TaskStop::ShuttingDown) => SdkError::ShuttingDown,
                _ => SdkError::Remote {
                    status: StatusCode::CANCELLED,
                    reason: "cancelled while waiting for input".into(),
                    from: None,
                },
            });
        };
        self.run
            .set_state(store.state_message(self.run.id, TaskState::Working))
            .await?;
        Ok(decode_payload(&answer.payload, &answer.content_type)?)
    }

    /// Hands the task to another agent with `call` (its target and payload: the context the
    /// next agent needs), as IACP's handoff: that agent takes it over where it stands, the
    /// requester's handle follows it, and the report lists both turns. Once this returns,
    /// this handler should return too: whatever it returns is not recorded.
    ///
    /// # Errors
    /// [`SdkError::Remote`], [`SdkError::NoResponders`] or [`SdkError::Timeout`] when the next
    /// agent does not take it; [`SdkError::LoopDetected`] or [`SdkError::Expired`] past the hop
    /// limit or deadline; [`SdkError::Subject`] or [`SdkError::Broker`] when it cannot be sent.
    pub async fn handoff(&self, call: Call) -> Result<(), SdkError> {
        let out = &self.ctx.out;
        let (subject, mut env, timeout) = out.prepare(call.command(), Some(self.ctx.message()))?;
        env.performative = Performative::Handoff;
        env.correlation_id = Some(self.run.id);
        env.ttl_ms = None;
        env.deadline_ms = self.run.deadline_ms;
        out.exchange(&subject, env, timeout, self.ctx.otel_context())
            .await?;
        self.run.handed_off.store(true, Ordering::Release);
        Ok(())
    }

    /// The content type the requester used, which the task answers in.
    fn content_type(&self) -> ContentType {
        self.ctx.message().content_type.clone()
    }
}
