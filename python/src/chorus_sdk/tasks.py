"""Tasks (docs/PROTOCOL.md section 7.4): long work with states, progress, streamed chunks, a
question back to the requester, cancel and a deadline, all stored as messages of the task in
the stream ``<ROOT>_TASKS``, so a requester that restarts finds its task again.

A worker serves a task with ``@agent.task("draft")``; its handler gets a :class:`TaskContext`.
A requester submits with ``await agent.submit(...)`` and gets a :class:`TaskHandle`."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from ._connection import settle
from ._host import Host
from .codec import DecodeError, decode, decode_payload, encode_payload, typed
from .context import Context, Reply, check_headers
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
from .eta import Handling
from .schema import Schema, payload_json
from .status import ChorusError, Refused, StatusCode, Timeout, is_success, label
from .subjects import CONSOLE_ID, COORDINATOR_ID
from .usage import Usage


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

    async def submission(self, task: uuid.UUID) -> Envelope:
        """The task's first status message: its submission (the input, the deadline, whether the
        requester verifies results). Raises :class:`ChorusError` 5018 when it is not recorded."""
        try:
            raw = await self.js.get_msg(self.stream, seq=1, subject=self.subject(task, "status"), next=True)
        except nats.js.errors.NotFoundError:
            raise _not_found(task) from None
        env, _ = decode(raw.data or b"")
        return env

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


def _not_found(task: uuid.UUID) -> ChorusError:
    """No task ``task`` is recorded (5018, as the Rust SDK's ``TaskNotFound``)."""
    return ChorusError(StatusCode.INVALID_ARGUMENT, f"no task {task} is recorded")


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

    async def handoff(
        self,
        payload: Any = None,
        *,
        to: str | None = None,
        name: str | None = None,
        capability: str | None = None,
        timeout: float | None = None,
        content_type: str | None = None,
    ) -> None:
        """Hands the task to agent ``to``'s task ``name`` (or to a ``capability``: any holder,
        or ``to``'s own access point), with ``payload`` as the context the next agent needs
        (IACP's handoff, section 7.4): that agent takes it over where it stands, the
        requester's handle follows it, and its report lists both turns. Once this returns,
        the handler should return too: whatever it returns is not recorded. Raises
        :class:`ChorusError` with the code when the next agent does not take it (5024 when
        the task is not this agent's to hand on, 5012 when nobody serves the subject, 5005 on
        timeout), 5010 past the hop limit, 5011 past the task's deadline."""
        run = self._run
        agent = self.agent
        parent = self.envelope
        if capability is not None:
            subject = agent.subjects.capability_at(to, capability) if to else agent.subjects.capability(capability)
        elif to is not None and name is not None:
            subject = agent.subjects.command(to, name)
        else:
            raise ValueError("handoff needs to= and name=, or capability=")
        env = Envelope.new(Kind.COMMAND, Performative.HANDOFF, agent.id)
        env.to = [to] if to is not None else []
        env.name, env.capability = name, capability
        env.correlation_id = run.id
        # A forward of the message the task came with (section 7.3).
        env.hops, env.hop_limit = parent.hops + 1, parent.hop_limit
        if env.hops > env.hop_limit:
            raise ChorusError(StatusCode.LOOP_DETECTED, f"hop limit {env.hop_limit} reached")
        env.trace, env.session_id, env.customer_id = parent.trace, parent.session_id, parent.customer_id
        env.deadline_ms = run.deadline_ms
        wait = agent.request_timeout if timeout is None else timeout
        if run.deadline_ms is not None:
            left = run.deadline_ms - env.timestamp_ms
            if left <= 0:
                raise ChorusError(StatusCode.EXPIRED, "the task's deadline has passed")
            wait = min(wait, left / 1000)
        env.expect = Expect(Performative.INFORM, max(1, int(wait * 1000)))
        agent.set_payload(env, payload, content_type)
        await agent.exchange(subject, env, wait)
        run.handed_off = True


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
    #: Handed to another agent: this run writes nothing more.
    handed_off: bool = False
    #: Who submitted it: one of those whose cancel and answers it takes.
    requester: str = ""

    def halt(self, why: str) -> None:
        if self.why is None:
            self.why = why
        self.stop.set()

    async def set_state(self, env: Envelope) -> None:
        seq = await self.store.transition(self.id, self.last, env)
        self.last = (seq, state_of(env))


TaskHandler = Callable[[TaskContext], Awaitable[Any]]


class Tasks:
    """Serves task handlers for one agent. Each task endpoint is timed by its runs (from its
    acceptance to its handler's own end) in ``handling``, the agent's handling times: what a
    later acceptance says it expects (its ``eta_ms``). Each run's time, however it ends, is
    added to the agent's ``usage`` (which counted the task when it was accepted)."""

    def __init__(self, agent: Host, handling: Handling | None = None, usage: Usage | None = None) -> None:
        self.agent = agent
        self.store = TaskStore(agent)
        self.handling = handling if handling is not None else Handling()
        self.usage = usage

    def endpoint(self, handler: TaskHandler, kind: str = "command", name: str = "") -> Callable[[Context], Awaitable[Any]]:
        """The handler that takes the tasks submitted to endpoint ``name`` of ``kind``
        (``command`` or ``capability``), each run by ``handler``."""

        async def accept(ctx: Context) -> Any:
            return await self.accept(ctx, handler, (kind, name))

        return accept

    async def accept(self, ctx: Context, handler: TaskHandler, endpoint: tuple[str, str] = ("command", "")) -> None:
        """Takes the task ``ctx`` submits (answering 5002; its acceptance says how long the
        task is expected to take once ``endpoint`` has run one), or takes it over from the
        agent working on it (a handoff), or refuses it with a code."""
        env = ctx.envelope
        if env.performative not in (Performative.ASSIGN, Performative.HANDOFF) or env.correlation_id is None:
            raise ChorusError(StatusCode.INVALID_ARGUMENT, "this command runs as a task: submit it as one")
        handoff = env.performative is Performative.HANDOFF
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
        current = state_of(record)
        if handoff:
            # Only the agent working on it may hand it on.
            if current not in (TaskState.WORKING, TaskState.INPUT_REQUIRED) or record.from_ != env.from_:
                raise ChorusError(
                    StatusCode.TASK_STATE,
                    f"task {task} is {current.value} by {record.from_}: {env.from_} cannot hand it on",
                )
            taken = store.state_message(task, TaskState.WORKING)
            taken.reason = f"handed off by {env.from_}"
            seq = await store.transition(task, (seq, current), taken)
            state = TaskState.WORKING
            # The submission governs: its deadline, and whether the requester verifies.
            governs = await store.submission(task)
            context_env = env
        else:
            accepted = store.state_message(task, TaskState.ACCEPTED)
            # IACP: "Yes. ETA 120s." Its recent runs' moving average, once it has run.
            eta_ms = self.handling.ms(*endpoint)
            if eta_ms is not None:
                accepted.payload = encode_payload({"eta_ms": eta_ms}, CONTENT_TYPE_MSGPACK)
                accepted.content_type = CONTENT_TYPE_MSGPACK
            seq = await store.transition(task, (seq, current), accepted)
            state = TaskState.ACCEPTED
            governs = context_env = record
        run = _Run(
            id=task,
            store=store,
            last=(seq, state),
            deadline_ms=governs.deadline_ms,
            confirm=governs.expect is not None and governs.expect.performative is Performative.CONFIRM,
            stop=asyncio.Event(),
            inputs=asyncio.Queue(),
            epoch=random.getrandbits(32),
            content_type=context_env.content_type if context_env.content_type == CONTENT_TYPE_JSON else CONTENT_TYPE_MSGPACK,
            requester=governs.from_,
        )
        subs = await self._listen(run)
        context = TaskContext(agent, context_env, ctx.subject, run)
        agent.spawn(self._drive(run, context, handler, subs, endpoint, env), name="chorus-task")

    async def _listen(self, run: _Run) -> list[Any]:
        nc = self.agent.nc

        async def on_cancel(msg: Any) -> None:
            if self._steers(run, msg.subject, msg.data) is not None:
                run.halt("cancelled")

        async def on_input(msg: Any) -> None:
            env = self._steers(run, msg.subject, msg.data)
            if env is not None:
                run.inputs.put_nowait(env)

        subs = [
            await nc.subscribe(self.store.subject(run.id, "cancel"), cb=on_cancel),
            await nc.subscribe(self.store.subject(run.id, "input"), cb=on_input),
        ]
        await settle(nc)
        stored = await self.store.last(run.id, "cancel")
        if stored is not None and self._steered(run, self.store.subject(run.id, "cancel"), stored[1]):
            run.halt("cancelled")
        return subs

    def _steers(self, run: _Run, subject: str, data: bytes) -> Envelope | None:
        """A cancel or an answer for ``run``, if it decodes and may steer the task
        (:meth:`_steered`)."""
        try:
            env, _ = decode(data)
        except DecodeError:
            return None
        return env if self._steered(run, subject, env) else None

    def _steered(self, run: _Run, subject: str, env: Envelope) -> bool:
        """Whether ``env`` may steer ``run``: it comes from the task's requester, the agent
        working on it, or the bus's own agents (the coordinator, and the console acting for an
        operator it let in), and, where this agent verifies signatures, its signature verifies.
        Anything else is ignored, counted and logged (as the Rust SDK holds it)."""
        agent = self.agent
        why: str | None = None
        if env.from_ not in (run.requester, agent.id, COORDINATOR_ID, CONSOLE_ID):
            why = f"{env.from_} is neither its requester {run.requester} nor the agent working on it"
        elif agent.verifier is not None:
            try:
                agent.verifier.verify(subject, env)
            except ChorusError as e:
                why = f"{e.status}: {e.reason}"
        if why is None:
            return True
        agent.stats.security_refused += 1
        log.warning("agent %s: task %s: a cancel or input from %s ignored: %s", agent.id, run.id, env.from_, why)
        return False

    async def _drive(
        self, run: _Run, ctx: TaskContext, handler: TaskHandler, subs: list[Any], endpoint: tuple[str, str], submission: Envelope
    ) -> None:
        """Runs the handler to its end, a cancel, the deadline or shutdown, and writes the
        task's terminal state; ``submission`` is the message that was accepted (its usage
        row)."""
        store = self.store
        begun = time.perf_counter_ns()
        try:
            if run.last[1] is not TaskState.WORKING:
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
            took = time.perf_counter_ns() - begun
            if run.why is None and work.done() and not work.cancelled():
                # A run that ended by itself (done or failed): how long its kind takes.
                self.handling.record(*endpoint, took)
            if self.usage is not None and endpoint[1]:
                # Usage counted the task when it was accepted; its time is the run's, however
                # it ended.
                self.usage.record_run(submission, endpoint[1], took // 1000)
            if run.handed_off:
                # Another agent has it now and writes its end.
                if work.done() and not work.cancelled():
                    work.exception()  # what it returned or raised is not recorded
                return
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
    def eta(self) -> float | None:
        """How long the worker expects the task to take, in seconds, when this is its
        acceptance and the worker has run the task's kind before (its recent runs' moving
        average, the acceptance's ``eta_ms``); ``None`` otherwise, and for an acceptance
        whose payload does not say it."""
        env = self.envelope
        if self.state is not TaskState.ACCEPTED or not env.payload:
            return None
        try:
            said = decode_payload(env.payload, env.content_type)
        except DecodeError:
            return None
        eta_ms = said.get("eta_ms") if isinstance(said, dict) else None
        if isinstance(eta_ms, bool) or not isinstance(eta_ms, int) or eta_ms < 0:
            return None
        return eta_ms / 1000

    @property
    def chunk(self) -> int | None:
        s = self.envelope.seq
        return s.n if self.kind == "chunk" and s is not None else None

    def data(self, cls: type[Any] | None = None) -> Any:
        """The payload's value (as a ``cls`` when given, see :meth:`Context.data`)."""
        env = self.envelope
        return typed(decode_payload(env.payload, env.content_type) if env.payload else None, cls)


@dataclass
class Attempt:
    """One agent's turn at a task (``chorus_sdk::task::Attempt`` in the Rust SDK)."""

    #: The agent that took it.
    agent: str
    #: When it took it, ms since the epoch.
    started_ms: int
    #: When its turn ended, if it has.
    ended_ms: int | None = None
    #: How its turn ended (the state it left the task in, or ``completed`` / ``failed`` for
    #: the result it reported), or where it is.
    state: TaskState = TaskState.ACCEPTED
    #: The code its turn ended with, if it has.
    status: int | None = None
    #: Whether the requester's verification accepted its result (``None``: not verified).
    verified: bool | None = None
    #: Why its turn ended as it did, when someone said (a verdict, a refusal, a reason).
    note: str | None = None


@dataclass
class TaskReport:
    """What a task came to (``chorus_sdk::TaskReport`` in the Rust SDK): the outcome, the data,
    the code, and every attempt with its agent and timing. A task still running has a report
    too, with its state so far."""

    id: uuid.UUID
    #: Where it stands (terminal once finished).
    state: TaskState
    #: The code of its last state (5002 completed, 5020 cancelled, 5011 expired, the
    #: failure's or the refusal's own).
    status: int
    #: Why, for a state that is not success.
    reason: str | None
    #: Who submitted it.
    requester: str
    #: The command (``agent.name``) or capability it was submitted to.
    target: str
    #: The result (completed) or the question (input required), and its content type.
    output: bytes = b""
    content_type: str = CONTENT_TYPE_MSGPACK
    #: Every agent that took it, in order.
    attempts: list[Attempt] = field(default_factory=list)
    submitted_ms: int = 0
    finished_ms: int | None = None
    deadline_ms: int | None = None
    #: The stream sequence of the last message folded in.
    last_seq: int = 0
    #: The last status message folded in.
    envelope: Envelope | None = None

    @property
    def is_completed(self) -> bool:
        return self.state is TaskState.COMPLETED

    @property
    def is_finished(self) -> bool:
        return self.state in FINAL

    @property
    def worker(self) -> str | None:
        """The agent of the last attempt (the one that completed it, for a completed task)."""
        return self.attempts[-1].agent if self.attempts else None

    def data(self, cls: type[Any] | None = None) -> Any:
        """The result's value (as a ``cls`` when given, see :meth:`Context.data`). Raises
        :class:`ChorusError` with the task's code and reason when it did not complete."""
        if not self.is_completed:
            why = f": {self.reason}" if self.reason else ""
            raise ChorusError(self.status, f"task {self.id} is {self.state.value}{why}")
        return typed(decode_payload(self.output, self.content_type) if self.output else None, cls)

    @classmethod
    def _submitted(cls, task: uuid.UUID, seq: int, env: Envelope) -> TaskReport:
        target = env.capability or (f"{env.to[0]}.{env.name or ''}" if env.to else "")
        return cls(
            id=task,
            state=TaskState.SUBMITTED,
            status=StatusCode.ACCEPTED,
            reason=None,
            requester=env.from_,
            target=target,
            submitted_ms=env.timestamp_ms,
            deadline_ms=env.deadline_ms,
            last_seq=seq,
            envelope=env,
        )

    def _close_attempt(self, at_ms: int, state: TaskState) -> None:
        if self.attempts and self.attempts[-1].ended_ms is None:
            self.attempts[-1].ended_ms = at_ms
            self.attempts[-1].state = state

    def _apply(self, seq: int, env: Envelope) -> None:
        """Folds one status message in (as the Rust SDK's ``TaskReport::apply``)."""
        state = state_of(env)
        at = env.timestamp_ms
        self.last_seq, self.state, self.envelope = seq, state, env
        self.status = env.status if env.status is not None else StatusCode.ACCEPTED
        self.reason = env.reason
        if state in (TaskState.COMPLETED, TaskState.INPUT_REQUIRED):
            self.output, self.content_type = env.payload, env.content_type
        last = self.attempts[-1] if self.attempts else None
        if state is TaskState.ACCEPTED:
            self.attempts.append(Attempt(env.from_, at))
        elif state is TaskState.SUBMITTED:
            # A new attempt: the last one ended, its result not accepted.
            if last is not None:
                if last.ended_ms is None:
                    last.ended_ms, last.state = at, TaskState.FAILED
                if last.verified is True or (last.status is not None and is_success(last.status)):
                    last.verified = False
                last.note = env.reason
        elif state is TaskState.WORKING and (last is None or last.agent != env.from_ or last.ended_ms is not None):
            # A working state from another agent: the task was handed to it.
            self._close_attempt(at, TaskState.WORKING)
            if last is not None:
                last.note = env.reason
            self.attempts.append(Attempt(env.from_, at, state=TaskState.WORKING))
        elif last is not None and last.ended_ms is None:
            last.state = state
        if state in FINAL:
            self.finished_ms = at
            # The requester accepting a reported result is the verdict on the last attempt.
            last = self.attempts[-1] if self.attempts else None
            if last is not None and last.ended_ms is not None:
                if state is TaskState.COMPLETED and last.agent != env.from_:
                    last.verified = True
                elif last.note is None:
                    last.note = env.reason
            self._close_attempt(at, state)
            if last is not None and last.status is None:
                last.status = env.status

    def _reported(self, seq: int, env: Envelope) -> None:
        """Folds in one attempt's reported result."""
        self.last_seq = max(self.last_seq, seq)
        last = self.attempts[-1] if self.attempts else None
        if last is not None and last.ended_ms is None:
            last.ended_ms = env.timestamp_ms
            last.state = TaskState.COMPLETED if env.performative is Performative.DONE else TaskState.FAILED
            last.status = env.status
            last.note = env.reason


#: What :meth:`TaskHandle.result` returned before reports had attempts: the same class.
TaskResult = TaskReport


class _Fold:
    """Folds a task's status and report messages, in order, into its report."""

    def __init__(self, task: uuid.UUID) -> None:
        self.task = task
        self.report: TaskReport | None = None
        #: Whether the requester verifies results (its attempts then end in reports).
        self.verified = False

    def message(self, kind: str, seq: int, env: Envelope) -> None:
        if kind == "status":
            if self.report is None:
                self.verified = env.expect is not None and env.expect.performative is Performative.CONFIRM
                self.report = TaskReport._submitted(self.task, seq, env)
            else:
                self.report._apply(seq, env)
        elif kind == "report" and self.report is not None:
            self.report._reported(seq, env)


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
        """Where the task stands now. Raises :class:`ChorusError` 5018 when it is not
        recorded."""
        last = await self.store.last(self.id, "status")
        if last is None:
            raise _not_found(self.id)
        return state_of(last[1])

    async def _messages(self, after: int, kinds: str) -> AsyncGenerator[TaskUpdate, None]:
        """The task's messages after stream sequence ``after``, then each new one, without end."""
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
                yield TaskUpdate(seq=int(msg.metadata.sequence.stream), kind=msg.subject.rsplit(".", 1)[1], envelope=env)
        finally:
            await sub.unsubscribe()

    async def updates(self, after: int = 0, kinds: str = ">") -> AsyncIterator[TaskUpdate]:
        """Every message of the task after stream sequence ``after``, in the order stored,
        then each new one, until the terminal state (resume with the ``seq`` last seen: no
        gap, no duplicate)."""
        messages = self._messages(after, kinds)
        try:
            async for update in messages:
                self.last_seen = max(self.last_seen, update.seq)
                yield update
                if update.state in FINAL:
                    return
        finally:
            await messages.aclose()

    async def report(self) -> TaskReport:
        """The task's report as it stands now (terminal or not): its state, code, output and
        every attempt with its agent, timing and verdict. Raises :class:`ChorusError` 5018 when
        the task is not recorded."""
        last = await self.store.last(self.id, "status")
        if last is None:
            raise _not_found(self.id)
        upto = last[0]
        reported = await self.store.last(self.id, "report")
        if reported is not None:
            upto = max(upto, reported[0])
        fold = _Fold(self.id)
        messages = self._messages(0, ">")
        try:
            async for update in messages:
                fold.message(update.kind, update.seq, update.envelope)
                if update.seq >= upto:
                    break
        finally:
            await messages.aclose()
        if fold.report is None:
            raise _not_found(self.id)
        return fold.report

    async def result(self, timeout: float | None = None) -> TaskReport:
        """Waits for the task's end and returns its report. A task past its deadline (plus 2 s
        for its worker to say so) is recorded ``expired`` here. Raises :class:`ChorusError`
        5005 when ``timeout`` passes first."""

        async def follow() -> TaskReport:
            fold = _Fold(self.id)
            async for update in self.updates(kinds="status"):
                fold.message(update.kind, update.seq, update.envelope)
                if update.state in FINAL and fold.report is not None:
                    # A verified task's attempts end in reports, which only a full fold sees.
                    return await self.report() if fold.verified else fold.report
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

    async def _record(self, state: TaskState, reason: str) -> TaskReport:
        """Writes ``state`` as the requester (an expiry or an unconfirmed cancel), unless the
        task ended meanwhile; returns its report."""
        env = self.store.state_message(self.id, state)
        env.reason = reason
        try:
            await self.store.transition(self.id, None, env)
        except ChorusError as e:
            if e.status != StatusCode.TASK_STATE:
                raise
        return await self.report()

    async def cancel(self, reason: str = "cancelled by the requester") -> TaskReport:
        """Asks the worker to stop and waits for the end (recorded ``cancelled`` here when no
        worker confirms within 3 s); returns the task's report."""
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


# ---------------------------------------------------------------------------------------------
# Verified results

#: Attempts a verified task gets by default, the first included.
DEFAULT_MAX_ATTEMPTS = 3

#: A check of one result: ``True`` or ``None`` passes it, ``False`` or a string (why) fails it;
#: it may be async.
Check = Callable[[TaskUpdate], Any]


@dataclass(frozen=True)
class Supervisor:
    """A check that asks supervisor ``agent``'s ``command`` with the output as the payload: its
    success answer passes the result, a refusal fails it with the refusal's reason."""

    agent: str
    command: str


@dataclass(frozen=True)
class Verification:
    """How a requester verifies a task's result (``chorus_sdk::task::Verification`` in the Rust
    SDK), and what it does when one fails: ``retries`` more tries on the same agent, then
    (``reassign``) the first of ``candidates`` that has not failed (without candidates, for a
    task submitted to a capability, its other live holders from discovery), then
    ``escalate_to``, a supervisor agent serving the same task; at most ``max_attempts`` in all
    (at least 1), after which the task fails with 5025. Made with :meth:`function`,
    :meth:`schema` or :meth:`agent`::

        Verification.schema({"type": "object", "required": ["summary"]},
                            max_attempts=3, escalate_to="editor-in-chief")
    """

    check: Check | Schema | Supervisor
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retries: int = 0
    reassign: bool = True
    candidates: tuple[str, ...] = ()
    escalate_to: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.check, (Schema, Supervisor)) and not callable(self.check):
            raise TypeError("a verification's check is a function, a Schema or a Supervisor")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise TypeError("max_attempts is an int")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries is an int, 0 or more, not {self.retries!r}")
        if isinstance(self.candidates, str):
            raise TypeError("candidates is a list of agent ids, not a string")
        # As the Rust SDK: at least one attempt; candidates kept in order.
        object.__setattr__(self, "max_attempts", max(self.max_attempts, 1))
        object.__setattr__(self, "candidates", tuple(self.candidates))

    @classmethod
    def function(cls, check: Check, **policy: Any) -> Verification:
        """Checks each result with ``check`` (sync or async): given the report (a
        :class:`TaskUpdate`), ``True`` or ``None`` passes it, ``False`` or a string saying why
        fails it."""
        return cls(check, **policy)

    @classmethod
    def schema(cls, schema: Any, **policy: Any) -> Verification:
        """Checks that each result, read as JSON, meets JSON Schema ``schema`` (the draft its
        ``$schema`` names, 2020-12 by default). Raises :class:`~chorus_sdk.schema.SchemaError`
        when it does not compile."""
        return cls(schema if isinstance(schema, Schema) else Schema.compile(schema), **policy)

    @classmethod
    def agent(cls, agent: str, command: str, **policy: Any) -> Verification:
        """Asks supervisor ``agent`` to judge each result with ``command`` (the output is the
        payload): its success answer passes it, a refusal fails it with the reason."""
        return cls(Supervisor(agent, command), **policy)

    def with_policy(self, **policy: Any) -> Verification:
        """This verification with some of its policy changed (``max_attempts``, ``retries``,
        ``reassign``, ``candidates``, ``escalate_to``)."""
        return dataclasses.replace(self, **policy)

    async def verdict(self, agent: Host, report: TaskUpdate) -> str | None:
        """Why ``report``'s result fails (``None``: it passes). A supervisor that cannot be
        asked (not there, no answer) raises its :class:`ChorusError`."""
        env = report.envelope
        check = self.check
        if isinstance(check, Schema):
            try:
                value = payload_json(env.payload, env.content_type)
            except ValueError as e:
                return f"the output is not JSON: {e}"
            errors = check.errors(value)
            return f"does not meet the schema: {'; '.join(errors)}" if errors else None
        if isinstance(check, Supervisor):
            try:
                await agent.request(check.agent, check.command, Reply(env.payload, env.content_type), raw=True)
            except Refused as e:
                return e.reason
            return None
        verdict = check(report)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        if verdict is True or verdict is None:
            return None
        return verdict if isinstance(verdict, str) else "the check failed"


async def verify(
    agent: Host,
    handle: TaskHandle,
    verification: Verification,
    discover: Callable[..., Awaitable[list[dict[str, Any]]]] | None = None,
) -> TaskReport:
    """Sees a task submitted with ``verify=True`` through (section 7.4, verified results), as
    the Rust SDK's ``Agent::verify``: each attempt's report is judged by ``verification``; a
    result that passes is written as ``completed`` (with the report's output); one that fails
    (or a ``failure`` report) starts the next attempt as its policy says (a ``submitted``
    status with the verdict and ``; reassigned to <agent>`` as its reason, sent to that agent
    alone), until no attempt is left and the task fails with 5025 ``unverified`` and the chain
    of verdicts. ``discover`` finds a capability's holders to reassign to. Returns the final
    report, with every attempt, its agent, timing and verdict. Run it again after a restart:
    reports already judged are not judged twice."""
    store = handle.store
    task = handle.id
    last = await store.last(task, "status")
    judged_up_to = last[0] if last else 0
    fold = _Fold(task)
    submission: Envelope | None = None
    attempts = 0
    tries: dict[str, int] = {}
    failed: list[str] = []
    chain: list[str] = []
    policy = verification

    async def choose(previous: str) -> str | None:
        """Who gets the next attempt after ``previous``'s failed, if anyone."""
        if attempts >= policy.max_attempts:
            return None
        if tries.get(previous, 0) <= policy.retries:
            return previous

        def untried(candidate: str) -> bool:
            return candidate not in failed and candidate != policy.escalate_to

        if policy.reassign:
            for candidate in policy.candidates:
                if untried(candidate):
                    return candidate
            capability = submission.capability if submission is not None else None
            if not policy.candidates and capability is not None and discover is not None:
                try:
                    holders = await discover(capability=capability)
                except ChorusError as e:
                    log.warning("task %s: no holders to reassign to: discovery failed: %s", task, e)
                    holders = []
                for holder in holders:
                    holder_id = (holder.get("manifest") or {}).get("agent")
                    if isinstance(holder_id, str) and untried(holder_id) and holder_id != agent.id:
                        return holder_id
        if policy.escalate_to is not None and policy.escalate_to not in failed:
            return policy.escalate_to
        return None

    async def resubmit(to: str, why: str) -> None:
        """Starts a new attempt on ``to``: records it, then asks that agent alone."""
        if submission is None:
            raise _not_found(task)
        if submission.capability is not None:
            subject = agent.subjects.capability_at(to, submission.capability)
        elif submission.name is not None:
            subject = agent.subjects.command(to, submission.name)
        else:
            raise ChorusError(StatusCode.INVALID_ARGUMENT, "the submission names no command or capability")
        fresh = Envelope.new(submission.kind, submission.performative, agent.id)
        again = dataclasses.replace(
            submission,
            id=fresh.id,
            timestamp_ms=fresh.timestamp_ms,
            from_=agent.id,
            to=[to],
            signature=None,
            reason=f"{why}; reassigned to {to}",
        )
        await store.transition(task, None, again)
        wait = (again.expect.timeout_ms / 1000) if again.expect else agent.request_timeout
        await agent.exchange(subject, again, wait)

    async def end(env: Envelope) -> None:
        try:
            await store.transition(task, None, env)
        except ChorusError as e:
            if e.status != StatusCode.TASK_STATE:
                raise

    messages = handle._messages(0, ">")
    try:
        async for update in messages:
            env = update.envelope
            fold.message(update.kind, update.seq, env)
            if update.kind == "status":
                if submission is None:
                    submission = env
                if update.state in FINAL and fold.report is not None:
                    return fold.report
                continue
            if update.kind != "report":
                continue
            attempts += 1
            tries[env.from_] = tries.get(env.from_, 0) + 1
            if update.seq < judged_up_to:
                # Judged before, and the task went on: it failed.
                failed.append(env.from_)
                chain.append(f"attempt {attempts} by {env.from_}: failed (judged earlier)")
                continue
            if env.performative is Performative.DONE:
                why = await policy.verdict(agent, update)
            else:
                status = env.status or StatusCode.HANDLER_FAILED
                why = f"failed with {status} {label(status)}" + (f": {env.reason}" if env.reason else "")
            if why is None:
                done = store.state_message(task, TaskState.COMPLETED)
                done.in_reply_to = env.id
                done.payload, done.content_type = env.payload, env.content_type
                await end(done)
                continue
            log.info("task %s: the result of %s failed verification: %s", task, env.from_, why)
            failed.append(env.from_)
            chain.append(f"attempt {attempts} by {env.from_}: {why}")
            previous = env.from_
            while True:
                nxt = await choose(previous)
                if nxt is None:
                    unverified = store.state_message(task, TaskState.FAILED)
                    unverified.status = int(StatusCode.UNVERIFIED)
                    unverified.reason = f"no result passed verification in {attempts} attempts: " + "; ".join(chain)
                    await end(unverified)
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
    finally:
        await messages.aclose()
    raise _not_found(task)


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
    headers: dict[str, str] | None = None,
    session: str | None = None,
    customer: str | None = None,
    content_type: str | None = None,
) -> TaskHandle:
    """Records a task and hands it to a worker (section 7.4, the flow's steps 1-3); the
    submission carries ``headers`` and the ``session`` and ``customer`` it is for, which its
    worker's messages and handoffs carry on."""
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
    env.headers = check_headers(headers)
    env.session_id, env.customer_id = session, customer
    agent.set_payload(env, payload, content_type)
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


__all__ = [
    "Attempt",
    "Supervisor",
    "TaskContext",
    "TaskHandle",
    "TaskReport",
    "TaskResult",
    "TaskStopped",
    "TaskUpdate",
    "Tasks",
    "Verification",
    "can_become",
]
