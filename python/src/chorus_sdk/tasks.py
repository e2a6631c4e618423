"""Tasks (docs/PROTOCOL.md section 7.4): long work with states, progress, streamed chunks, a
question back to the requester, cancel and a deadline, all stored as messages of the task in
the stream ``<ROOT>_TASKS``, so a requester that restarts finds its task again.

A worker serves a task with ``@agent.task("draft")``; its handler gets a :class:`TaskContext`.
A requester submits with ``await agent.submit(...)`` and gets a :class:`TaskHandle`."""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from ._host import Host
from .codec import DecodeError, decode, decode_payload, typed
from .context import Context, Reply
from .envelope import (
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_MSGPACK,
    Envelope,
    Expect,
    Kind,
    Performative,
    Progress,
    Seq,
    TaskState,
    now_ms,
)
from .status import ChorusError, StatusCode, Timeout


log = logging.getLogger("chorus_sdk")

TASK_STREAM = "TASKS"
TASK_RETENTION_SECS = 7 * 24 * 3600
STATE_WRITE_ATTEMPTS = 8
CANCEL_GRACE = 1.0
CANCEL_CONFIRM_WAIT = 3.0
EXPIRY_MARGIN_MS = 2000
WRONG_LAST_SEQUENCE = 10071

FINAL = frozenset({TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELLED, TaskState.REJECTED, TaskState.EXPIRED})

# The legal moves (the table of section 7.4); None is "no state yet".
_MOVES: dict[TaskState | None, frozenset[TaskState]] = {
    None: frozenset({TaskState.SUBMITTED}),
    TaskState.SUBMITTED: frozenset(
        {TaskState.SUBMITTED, TaskState.ACCEPTED, TaskState.REJECTED, TaskState.FAILED, TaskState.CANCELLED, TaskState.EXPIRED}
    ),
    TaskState.ACCEPTED: frozenset({TaskState.WORKING, TaskState.FAILED, TaskState.CANCELLED, TaskState.EXPIRED}),
    TaskState.WORKING: frozenset(
        {
            TaskState.WORKING,
            TaskState.SUBMITTED,
            TaskState.INPUT_REQUIRED,
            TaskState.COMPLETED,
            TaskState.FAILED,
            TaskState.CANCELLED,
            TaskState.EXPIRED,
        }
    ),
    TaskState.INPUT_REQUIRED: frozenset({TaskState.WORKING, TaskState.FAILED, TaskState.CANCELLED, TaskState.EXPIRED}),
}


def normalized(state: TaskState) -> TaskState:
    """A task reads protocol 1's ``queued`` as ``accepted`` and ``running`` as ``working``."""
    return {TaskState.QUEUED: TaskState.ACCEPTED, TaskState.RUNNING: TaskState.WORKING}.get(state, state)


def can_become(current: TaskState | None, to: TaskState) -> bool:
    current = normalized(current) if current is not None else None
    return normalized(to) in _MOVES.get(current, frozenset())


def state_of(env: Envelope) -> TaskState:
    return normalized(env.progress.state) if env.progress is not None else TaskState.UNKNOWN


_SHAPES = {
    TaskState.SUBMITTED: (Kind.COMMAND, Performative.ASSIGN),
    TaskState.ACCEPTED: (Kind.RESPONSE, Performative.AGREE),
    TaskState.INPUT_REQUIRED: (Kind.REQUEST, Performative.QUERY),
    TaskState.COMPLETED: (Kind.RESPONSE, Performative.DONE),
    TaskState.CANCELLED: (Kind.RESPONSE, Performative.CONFIRM),
    TaskState.REJECTED: (Kind.RESPONSE, Performative.REFUSE),
    TaskState.FAILED: (Kind.ERROR, Performative.FAILURE),
    TaskState.EXPIRED: (Kind.ERROR, Performative.FAILURE),
}


class TaskStore:
    """Reads and writes the tasks of one agent."""

    def __init__(self, agent: Host) -> None:
        self.agent = agent
        self.stream = agent.subjects.stream_name(TASK_STREAM)
        self._ready = False

    @property
    def js(self) -> Any:
        return self.agent.nc.jetstream(timeout=self.agent.request_timeout)

    def subject(self, task: uuid.UUID, kind: str) -> str:
        return f"{self.agent.subjects.root}.task.{task}.{kind}"

    async def ensure(self) -> None:
        if self._ready:
            return
        js = self.js
        try:
            await js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            try:
                await js.add_stream(
                    StreamConfig(
                        name=self.stream,
                        subjects=[f"{self.agent.subjects.root}.task.*.*"],
                        storage=StorageType.FILE,
                        max_age=float(TASK_RETENTION_SECS),
                        num_replicas=1,
                        description="Chorus tasks: submissions, states, progress, chunks, input, cancels",
                    )
                )
            except nats.js.errors.BadRequestError:
                pass  # created by someone else meanwhile
        self._ready = True

    def message(self, task: uuid.UUID, kind: Kind, performative: Performative) -> Envelope:
        env = Envelope.new(kind, performative, self.agent.id)
        env.correlation_id = task
        return env

    def state_message(self, task: uuid.UUID, state: TaskState) -> Envelope:
        kind, performative = _SHAPES.get(state, (Kind.EVENT, Performative.PROGRESS))
        env = self.message(task, kind, performative)
        env.progress = Progress(state)
        env.status = {
            TaskState.COMPLETED: StatusCode.OK,
            TaskState.CANCELLED: StatusCode.CANCELLED,
            TaskState.EXPIRED: StatusCode.EXPIRED,
        }.get(state, StatusCode.ACCEPTED)
        return env

    def _seal(self, subject: str, env: Envelope) -> bytes:
        return self.agent.encode_for(subject, env)

    async def append(self, task: uuid.UUID, kind: str, env: Envelope) -> int:
        """Stores a message of the task that is not a change of state; its sequence."""
        subject = self.subject(task, kind)
        ack = await self.js.publish(subject, self._seal(subject, env), headers={"Nats-Msg-Id": str(env.id)})
        return int(ack.seq)

    async def last(self, task: uuid.UUID, kind: str) -> tuple[int, Envelope] | None:
        try:
            raw = await self.js.get_last_msg(self.stream, self.subject(task, kind))
        except nats.js.errors.NotFoundError:
            return None
        env, _ = decode(raw.data or b"")
        return int(raw.seq or 0), env

    async def transition(self, task: uuid.UUID, known: tuple[int, TaskState] | None, env: Envelope) -> int:
        """Moves the task to the state ``env`` records if the table allows it from the state
        it is in; written only if nobody wrote since (read again and judged anew if someone
        did, up to 8 times). Returns the new status sequence; raises 5024 for a refused move."""
        to = state_of(env)
        subject = self.subject(task, "status")
        data = self._seal(subject, env)
        for _ in range(STATE_WRITE_ATTEMPTS):
            if known is None:
                last = await self.last(task, "status")
                known = (last[0], state_of(last[1])) if last else (0, TaskState.UNKNOWN)
            seq, current = known
            if not can_become(None if seq == 0 else current, to):
                raise ChorusError(StatusCode.TASK_STATE, f"task {task}: {current.value} cannot become {to.value}")
            headers = {"Nats-Expected-Last-Subject-Sequence": str(seq), "Nats-Msg-Id": str(env.id)}
            try:
                ack = await self.js.publish(subject, data, headers=headers)
                return int(ack.seq)
            except nats.js.errors.APIError as e:
                if e.err_code != WRONG_LAST_SEQUENCE:
                    raise
                known = None
        raise ChorusError(StatusCode.TASK_STATE, f"task {task}: state kept changing under {STATE_WRITE_ATTEMPTS} writes")


# ---------------------------------------------------------------------------------------------
# The worker's side


class TaskStopped(Exception):
    """Raised inside a task handler's waits once the task is cancelled, expired or the agent
    stops."""


class TaskContext(Context):
    """What a task handler gets: the submission (``data()``), and ways to report progress,
    stream chunks, ask the requester, and see a cancel."""

    def __init__(self, agent: Host, envelope: Envelope, subject: str, run: _Run) -> None:
        super().__init__(agent, envelope, subject)
        self._run = run

    @property
    def task_id(self) -> uuid.UUID:
        return self._run.id

    @property
    def deadline_ms(self) -> int | None:
        return self._run.deadline_ms

    @property
    def is_cancelled(self) -> bool:
        """Whether the task was told to stop (a cancel, the deadline or shutdown)."""
        return self._run.stop.is_set()

    async def cancelled(self) -> str:
        """Waits until the task is told to stop; returns why (``cancelled``, ``expired`` or
        ``shutting_down``)."""
        await self._run.stop.wait()
        return self._run.why or "cancelled"

    async def progress(self, fraction: float | None = None, message: str | None = None, data: Any = None) -> int:
        """Reports how far the work is (0 to 1, when known), with a message and optional
        partial data."""
        store = self._run.store
        env = store.message(self._run.id, Kind.EVENT, Performative.PROGRESS)
        env.progress = Progress(TaskState.WORKING, None if fraction is None else min(max(fraction, 0.0), 1.0))
        env.reason = message
        if data is not None:
            self.agent.set_payload(env, data, None)
        return await store.append(self._run.id, "progress", env)

    async def chunk(self, data: Any, last: bool = False) -> int:
        """Sends one piece of a streamed result (numbered from 1); ``last`` marks the end."""
        run = self._run
        run.chunks += 1
        env = run.store.message(run.id, Kind.EVENT, Performative.DONE if last else Performative.INFORM)
        env.seq = Seq(run.epoch, run.chunks)
        self.agent.set_payload(env, data, None)
        return await run.store.append(run.id, "chunk", env)

    async def ask(self, question: str, prompt: Any = None) -> Any:
        """Asks the requester (the task goes ``input_required``) and returns its answer."""
        run = self._run
        env = run.store.state_message(run.id, TaskState.INPUT_REQUIRED)
        env.reason = question
        if prompt is not None:
            self.agent.set_payload(env, prompt, None)
        await run.set_state(env)
        stop = asyncio.ensure_future(run.stop.wait())
        answer = asyncio.ensure_future(run.inputs.get())
        done, _ = await asyncio.wait({stop, answer}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if answer not in done:
            answer.cancel()
            raise TaskStopped(run.why or "cancelled")
        reply: Envelope = answer.result()
        await run.set_state(run.store.state_message(run.id, TaskState.WORKING))
        if not reply.payload:
            return None
        return decode_payload(reply.payload, reply.content_type)


@dataclass
class _Run:
    id: uuid.UUID
    store: TaskStore
    last: tuple[int, TaskState]
    deadline_ms: int | None
    confirm: bool
    stop: asyncio.Event
    inputs: asyncio.Queue[Envelope]
    epoch: int
    why: str | None = None
    chunks: int = 0
    content_type: str = CONTENT_TYPE_MSGPACK

    def halt(self, why: str) -> None:
        if self.why is None:
            self.why = why
        self.stop.set()

    async def set_state(self, env: Envelope) -> None:
        seq = await self.store.transition(self.id, self.last, env)
        self.last = (seq, state_of(env))


TaskHandler = Callable[[TaskContext], Awaitable[Any]]


class Tasks:
    """Serves task handlers for one agent."""

    def __init__(self, agent: Host) -> None:
        self.agent = agent
        self.store = TaskStore(agent)

    def endpoint(self, handler: TaskHandler) -> Callable[[Context], Awaitable[Any]]:
        async def accept(ctx: Context) -> Any:
            return await self.accept(ctx, handler)

        return accept

    async def accept(self, ctx: Context, handler: TaskHandler) -> None:
        """Takes the task ``ctx`` submits (answering 5002), or refuses it with a code."""
        env = ctx.envelope
        if env.performative is not Performative.ASSIGN or env.correlation_id is None:
            raise ChorusError(StatusCode.INVALID_ARGUMENT, "this command runs as a task: submit it as one")
        agent = self.agent
        if agent.stopping:
            raise ChorusError(StatusCode.UNAVAILABLE, "the agent is shutting down")
        task = env.correlation_id
        store = self.store
        await store.ensure()
        last = await store.last(task, "status")
        if last is None:
            raise ChorusError(StatusCode.TASK_STATE, f"task {task} is not recorded in the task stream")
        seq, record = last
        seq = await store.transition(task, (seq, state_of(record)), store.state_message(task, TaskState.ACCEPTED))
        run = _Run(
            id=task,
            store=store,
            last=(seq, TaskState.ACCEPTED),
            deadline_ms=record.deadline_ms,
            confirm=record.expect is not None and record.expect.performative is Performative.CONFIRM,
            stop=asyncio.Event(),
            inputs=asyncio.Queue(),
            epoch=random.getrandbits(32),
            content_type=record.content_type if record.content_type == CONTENT_TYPE_JSON else CONTENT_TYPE_MSGPACK,
        )
        subs = await self._listen(run)
        context = TaskContext(agent, record, ctx.subject, run)
        agent.spawn(self._drive(run, context, handler, subs), name="chorus-task")

    async def _listen(self, run: _Run) -> list[Any]:
        nc = self.agent.nc

        async def on_cancel(msg: Any) -> None:
            run.halt("cancelled")

        async def on_input(msg: Any) -> None:
            try:
                env, _ = decode(msg.data)
            except DecodeError:
                return
            run.inputs.put_nowait(env)

        subs = [
            await nc.subscribe(self.store.subject(run.id, "cancel"), cb=on_cancel),
            await nc.subscribe(self.store.subject(run.id, "input"), cb=on_input),
        ]
        await nc.flush()
        if await self.store.last(run.id, "cancel") is not None:
            run.halt("cancelled")
        return subs

    async def _drive(self, run: _Run, ctx: TaskContext, handler: TaskHandler, subs: list[Any]) -> None:
        store = self.store
        try:
            try:
                await run.set_state(store.state_message(run.id, TaskState.WORKING))
            except Exception as e:  # noqa: BLE001 - cancelled meanwhile, or the stream is away
                log.debug("task %s not started: %s", run.id, e)
                return
            work = asyncio.ensure_future(handler(ctx))
            stop = asyncio.ensure_future(run.stop.wait())
            agent_stop = asyncio.ensure_future(self.agent.until_stopping())
            timeout = None if run.deadline_ms is None else max(run.deadline_ms - now_ms(), 0) / 1000
            done, _ = await asyncio.wait({work, stop, agent_stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            agent_stop.cancel()
            if work not in done:
                if not run.stop.is_set():
                    run.halt("shutting_down" if agent_stop in done else "expired")
                # Told to stop: the handler may still finish by itself within the grace.
                try:
                    await asyncio.wait_for(asyncio.shield(work), CANCEL_GRACE)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                    work.cancel()
            end = self._end(run, work)
            if run.confirm and run.why is None:
                report = store.message(run.id, Kind.RESPONSE, Performative.DONE if state_of(end) is TaskState.COMPLETED else Performative.FAILURE)
                report.status, report.reason = end.status, end.reason
                report.payload, report.content_type = end.payload, end.content_type
                await store.append(run.id, "report", report)
            else:
                await run.set_state(end)
        except Exception as e:  # noqa: BLE001
            log.warning("task %s: its end was not written: %s", run.id, e)
        finally:
            for sub in subs:
                try:
                    await sub.unsubscribe()
                except Exception:  # noqa: BLE001
                    pass

    def _end(self, run: _Run, work: asyncio.Future[Any]) -> Envelope:
        store = self.store
        if run.why == "cancelled":
            env = store.state_message(run.id, TaskState.CANCELLED)
            env.reason = "cancelled by the requester"
            return env
        if run.why == "expired":
            env = store.state_message(run.id, TaskState.EXPIRED)
            env.reason = "the task's deadline passed before it finished"
            return env
        if run.why == "shutting_down":
            return _failed(store, run.id, StatusCode.UNAVAILABLE, "the agent shut down before it finished")
        if work.cancelled():
            return _failed(store, run.id, StatusCode.INTERNAL, "the task stopped without a cause")
        error = work.exception()
        if isinstance(error, ChorusError):
            return _failed(store, run.id, error.status, error.reason)
        if error is not None:
            return _failed(store, run.id, StatusCode.HANDLER_FAILED, f"{type(error).__name__}: {error}")
        env = store.state_message(run.id, TaskState.COMPLETED)
        result = work.result()
        # A typed result is written in the submission's content type, as a reply would be.
        typed = not isinstance(result, (bytes, bytearray, Reply))
        self.agent.set_payload(env, result, run.content_type if typed else None)
        return env


def _failed(store: TaskStore, task: uuid.UUID, status: int, reason: str) -> Envelope:
    env = store.state_message(task, TaskState.FAILED)
    env.status = int(status)
    env.reason = reason
    return env


# ---------------------------------------------------------------------------------------------
# The requester's side


@dataclass
class TaskUpdate:
    """One message of a task as stored: a state, progress, a chunk, a question's answer, a
    cancel or a report."""

    seq: int
    kind: str
    envelope: Envelope

    @property
    def state(self) -> TaskState | None:
        return state_of(self.envelope) if self.kind == "status" else None

    @property
    def fraction(self) -> float | None:
        p = self.envelope.progress
        return p.fraction if self.kind == "progress" and p is not None else None

    @property
    def chunk(self) -> int | None:
        s = self.envelope.seq
        return s.n if self.kind == "chunk" and s is not None else None

    def data(self, cls: type[Any] | None = None) -> Any:
        """The payload's value (as a ``cls`` when given, see :meth:`Context.data`)."""
        env = self.envelope
        return typed(decode_payload(env.payload, env.content_type) if env.payload else None, cls)


@dataclass
class TaskResult:
    """How a task ended."""

    id: uuid.UUID
    state: TaskState
    status: int
    reason: str | None
    worker: str
    envelope: Envelope

    def data(self, cls: type[Any] | None = None) -> Any:
        """The payload's value (as a ``cls`` when given, see :meth:`Context.data`)."""
        env = self.envelope
        return typed(decode_payload(env.payload, env.content_type) if env.payload else None, cls)


class TaskHandle:
    """A submitted task: follow it, wait for its result, answer its questions, cancel it.
    ``agent.task(id)`` makes one for a task found again after a restart."""

    def __init__(self, agent: Host, store: TaskStore, task: uuid.UUID, deadline_ms: int | None = None) -> None:
        self.agent = agent
        self.store = store
        self.id = task
        self.deadline_ms = deadline_ms
        self.last_seen = 0

    async def state(self) -> TaskState:
        last = await self.store.last(self.id, "status")
        if last is None:
            raise ChorusError(StatusCode.TASK_STATE, f"task {self.id} is not recorded")
        return state_of(last[1])

    async def updates(self, after: int = 0, kinds: str = ">") -> AsyncIterator[TaskUpdate]:
        """Every message of the task after stream sequence ``after``, in the order stored,
        then each new one, until the terminal state (resume with the ``seq`` last seen: no
        gap, no duplicate)."""
        js = self.store.js
        subject = self.store.subject(self.id, kinds) if kinds != ">" else f"{self.agent.subjects.root}.task.{self.id}.>"
        if after > 0:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1)
            sub = await js.subscribe(subject, stream=self.store.stream, ordered_consumer=True, config=config)
        else:
            sub = await js.subscribe(subject, stream=self.store.stream, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except nats.errors.TimeoutError:
                    continue
                try:
                    env, _ = decode(msg.data)
                except DecodeError:
                    continue
                update = TaskUpdate(seq=int(msg.metadata.sequence.stream), kind=msg.subject.rsplit(".", 1)[1], envelope=env)
                self.last_seen = max(self.last_seen, update.seq)
                yield update
                if update.state in FINAL:
                    return
        finally:
            await sub.unsubscribe()

    async def result(self, timeout: float | None = None) -> TaskResult:
        """Waits for the task's end. A task past its deadline (plus 2 s for its worker to say
        so) is recorded ``expired`` here. Raises :class:`ChorusError` 5005 when ``timeout``
        passes first."""

        async def follow() -> TaskResult:
            async for update in self.updates(kinds="status"):
                if update.state in FINAL:
                    return self._result(update.envelope)
            raise ChorusError(StatusCode.INTERNAL, "the task's states ended without a final one")

        waits: list[float] = [t for t in (timeout, self._expiry_wait()) if t is not None]
        try:
            return await asyncio.wait_for(follow(), min(waits) if waits else None)
        except asyncio.TimeoutError as err:
            expiry = self._expiry_wait()
            if expiry is not None and (timeout is None or expiry <= timeout):
                return await self._record(TaskState.EXPIRED, "the task's deadline passed before it finished")
            raise Timeout(f"task {self.id} did not end within {timeout} s") from err

    def _expiry_wait(self) -> float | None:
        if self.deadline_ms is None:
            return None
        return max(self.deadline_ms + EXPIRY_MARGIN_MS - now_ms(), 0) / 1000

    def _result(self, env: Envelope) -> TaskResult:
        return TaskResult(self.id, state_of(env), env.status or StatusCode.OK, env.reason, env.from_, env)

    async def _record(self, state: TaskState, reason: str) -> TaskResult:
        """Writes ``state`` as the requester (an expiry or an unconfirmed cancel), unless the
        task ended meanwhile; returns how it ended."""
        env = self.store.state_message(self.id, state)
        env.reason = reason
        try:
            await self.store.transition(self.id, None, env)
            return self._result(env)
        except ChorusError:
            last = await self.store.last(self.id, "status")
            assert last is not None
            return self._result(last[1])

    async def cancel(self, reason: str = "cancelled by the requester") -> TaskResult:
        """Asks the worker to stop and waits for the end (recorded ``cancelled`` here when no
        worker confirms within 3 s)."""
        env = self.store.message(self.id, Kind.COMMAND, Performative.CANCEL)
        env.reason = reason
        await self.store.append(self.id, "cancel", env)
        try:
            return await self.result(timeout=CANCEL_CONFIRM_WAIT)
        except ChorusError as e:
            if e.status != StatusCode.TIMEOUT:
                raise
            return await self._record(TaskState.CANCELLED, reason)

    async def respond(self, answer: Any) -> None:
        """Answers the question the task is waiting on (its ``input_required`` state)."""
        last = await self.store.last(self.id, "status")
        if last is None or state_of(last[1]) is not TaskState.INPUT_REQUIRED:
            raise ChorusError(StatusCode.TASK_STATE, f"task {self.id} is not waiting for input")
        env = self.store.message(self.id, Kind.RESPONSE, Performative.INFORM)
        env.in_reply_to = last[1].id
        self.agent.set_payload(env, answer, None)
        await self.store.append(self.id, "input", env)


Check = Callable[[TaskUpdate], Any]


async def verify(
    agent: Host,
    handle: TaskHandle,
    check: Check,
    *,
    max_attempts: int = 3,
    retries: int = 0,
    candidates: tuple[str, ...] | list[str] = (),
    supervisor: str | None = None,
) -> TaskResult:
    """Sees a task submitted with ``verify=True`` through (section 7.4, verified results): each
    attempt's report is judged by ``check`` (sync or async; ``True`` or ``None`` passes it,
    ``False`` or a string fails it, the string saying why); a report that passes is written as
    ``completed``; one that fails starts the next attempt, on the same agent while ``retries``
    allow, then on the first of ``candidates`` that has not failed, then on ``supervisor``, up
    to ``max_attempts`` in all, after which the task fails with 5025 ``unverified``. Returns
    how the task ended. Run it again after a restart: reports already judged are not judged
    twice."""
    store = handle.store
    task = handle.id
    last = await store.last(task, "status")
    judged_up_to = last[0] if last else 0
    submission: Envelope | None = None
    attempts = 0
    tries: dict[str, int] = {}
    failed: list[str] = []
    chain: list[str] = []
    passed_by: str | None = None

    def choose(previous: str) -> str | None:
        if attempts >= max_attempts:
            return None
        if tries.get(previous, 0) <= retries:
            return previous
        for candidate in candidates:
            if candidate not in failed and candidate != supervisor:
                return candidate
        if supervisor is not None and supervisor not in failed:
            return supervisor
        return None

    async def resubmit(to: str, why: str) -> None:
        assert submission is not None
        again = Envelope.new(submission.kind, submission.performative, agent.id)
        for name in ("correlation_id", "name", "capability", "deadline_ms", "expect", "progress", "status", "content_type", "payload", "headers"):
            setattr(again, name, getattr(submission, name))
        again.to = [to]
        again.reason = f"{why}; reassigned to {to}"
        if submission.capability is not None:
            subject = agent.subjects.capability_at(to, submission.capability)
        elif submission.name is not None:
            subject = agent.subjects.command(to, submission.name)
        else:
            raise ChorusError(StatusCode.INVALID_ARGUMENT, "the submission names no command or capability")
        await store.transition(task, None, again)
        wait = (again.expect.timeout_ms / 1000) if again.expect else agent.request_timeout
        await agent.exchange(subject, again, wait)

    async def end(state: TaskState, status: int, reason: str | None, report: Envelope | None) -> None:
        env = store.state_message(task, state)
        env.status = int(status)
        env.reason = reason
        if report is not None:
            env.in_reply_to = report.id
            env.payload, env.content_type = report.payload, report.content_type
        try:
            await store.transition(task, None, env)
        except ChorusError as e:
            if e.status != StatusCode.TASK_STATE:
                raise

    async for update in handle.updates():
        env = update.envelope
        if update.kind == "status":
            if submission is None:
                submission = env
            if update.state in FINAL:
                result = handle._result(env)
                if passed_by is not None and result.state is TaskState.COMPLETED:
                    result.worker = passed_by
                return result
            continue
        if update.kind != "report":
            continue
        attempts += 1
        tries[env.from_] = tries.get(env.from_, 0) + 1
        if update.seq < judged_up_to:
            failed.append(env.from_)
            chain.append(f"attempt {attempts} by {env.from_}: failed (judged earlier)")
            continue
        if env.performative is Performative.DONE:
            verdict = check(update)
            if inspect.isawaitable(verdict):
                verdict = await verdict
            why = None if verdict is True or verdict is None else (verdict if isinstance(verdict, str) else "the check failed")
        else:
            why = f"failed with {env.status or StatusCode.HANDLER_FAILED}" + (f": {env.reason}" if env.reason else "")
        if why is None:
            passed_by = env.from_
            await end(TaskState.COMPLETED, StatusCode.OK, None, env)
            continue
        failed.append(env.from_)
        chain.append(f"attempt {attempts} by {env.from_}: {why}")
        previous = env.from_
        while True:
            nxt = choose(previous)
            if nxt is None:
                await end(
                    TaskState.FAILED,
                    StatusCode.UNVERIFIED,
                    f"no result passed verification in {attempts} attempts: " + "; ".join(chain),
                    None,
                )
                break
            try:
                await resubmit(nxt, why)
                break
            except ChorusError as e:
                if e.status == StatusCode.TASK_STATE:
                    break
                # It did not take it: that counts as its attempt.
                attempts += 1
                tries[nxt] = tries.get(nxt, 0) + 1
                failed.append(nxt)
                why = f"not taken ({e})"
                chain.append(f"attempt {attempts} by {nxt}: {why}")
                previous = nxt
    raise ChorusError(StatusCode.TASK_STATE, f"task {task}: its messages ended before a final state")


async def submit(
    agent: Host,
    store: TaskStore,
    payload: Any,
    *,
    to: str | None,
    name: str | None,
    capability: str | None,
    deadline: float | None,
    timeout: float,
    verify: bool = False,
) -> TaskHandle:
    """Records a task and hands it to a worker (section 7.4, the flow's steps 1-3)."""
    await store.ensure()
    env = store.state_message(uuid.UUID(int=0), TaskState.SUBMITTED)
    env.correlation_id = env.id
    task = env.id
    if capability is not None:
        env.capability = capability
        subject = agent.subjects.capability_at(to, capability) if to else agent.subjects.capability(capability)
        if to:
            env.to = [to]
    else:
        assert to is not None and name is not None
        env.to, env.name = [to], name
        subject = agent.subjects.command(to, name)
    if deadline is not None:
        env.deadline_ms = env.timestamp_ms + int(deadline * 1000)
    env.expect = Expect(Performative.CONFIRM if verify else Performative.AGREE, int(timeout * 1000))
    agent.set_payload(env, payload, None)
    await store.transition(task, (0, TaskState.UNKNOWN), env)
    handle = TaskHandle(agent, store, task, env.deadline_ms)
    try:
        await agent.exchange(subject, env, timeout)
    except ChorusError as e:
        # Nobody took it (no responders, a refusal, a timeout): recorded, unless it moved on.
        await _reject(store, task, e.status, e.reason)
        raise
    return handle


async def _reject(store: TaskStore, task: uuid.UUID, status: int, reason: str) -> None:
    """Records that nobody took the task, unless it moved on meanwhile."""
    env = store.state_message(task, TaskState.REJECTED)
    env.status, env.reason = int(status), reason
    try:
        await store.transition(task, None, env)
    except ChorusError:
        pass


__all__ = ["TaskContext", "TaskHandle", "TaskResult", "TaskStopped", "TaskUpdate", "Tasks", "can_become"]
