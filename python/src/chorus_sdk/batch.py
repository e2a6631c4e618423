"""Automatic batching: a publisher that gathers events and one-way commands into batches of up
to N messages or T seconds and sends each batch at once (``Batcher`` in the Rust SDK).

A batch's events are handed to the connection together and flushed once; its core commands
the same; its durable commands are stored with their acks awaited together. Each message is
still its own envelope to its receiver: a batch saves round trips, not envelopes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ._connection import settle
from .envelope import Delivery
from .status import ChorusError, StatusCode

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger("chorus_sdk")

#: The most messages one batch may be set to hold, and the longest it may wait (seconds).
MAX_BATCH_MESSAGES = 10_000
MAX_BATCH_DELAY = 60.0


class Batching(NamedTuple):
    """What a :class:`Batcher` batches by (the Rust SDK's ``Batching``): a batch is sent when it
    holds ``max_messages`` (1 to :data:`MAX_BATCH_MESSAGES`), or ``max_delay`` seconds after its
    first message (above zero, at most :data:`MAX_BATCH_DELAY`); by default 100 messages or
    5 ms. An agent's own (``Agent(batching=...)``, ``[batching]`` in its configuration file) is
    what :meth:`Agent.batcher <chorus_sdk.Agent.batcher>` uses when not told."""

    max_messages: int = 100
    max_delay: float = 0.005

    def problem(self) -> str | None:
        """What is out of bounds, said as the Rust SDK says it; ``None`` when both are in."""
        n, delay = self.max_messages, self.max_delay
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BATCH_MESSAGES:
            return f"batching: max_messages is between 1 and {MAX_BATCH_MESSAGES}, not {n!r}"
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 < delay <= MAX_BATCH_DELAY:
            return f"batching: max_delay is above zero and at most {MAX_BATCH_DELAY:g} s, not {delay!r}"
        return None


def _stopped() -> ChorusError:
    return ChorusError(StatusCode.UNAVAILABLE, "the batcher has stopped (closed, or its agent is shutting down)")


@dataclass
class _Item:
    kind: str  # "event", "command" or "flush"
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    done: asyncio.Future[Any] | None = None


class Batcher:
    """Gathers an agent's events and one-way commands into batches (:meth:`Agent.batcher`).

    A batch is sent when it holds ``max_messages``, ``max_delay`` seconds after its first
    message, on :meth:`flush`, on :meth:`close` and when the agent shuts down; after that,
    queuing raises :class:`ChorusError` (5019). :meth:`publish` and :meth:`send` return once
    the message is queued (waiting only while the queue is full), with a future that resolves
    when its batch was sent: ``None`` for an event, the stream sequence (0 for at most once)
    for a command, or the error sending it raised."""

    def __init__(self, agent: Agent, max_messages: int = 100, max_delay: float = 0.005) -> None:
        problem = Batching(max_messages, max_delay).problem()
        if problem is not None:
            raise ChorusError(StatusCode.INVALID_ARGUMENT, problem)
        if agent.stopping:
            raise _stopped()
        self._agent = agent
        self.max_messages = max_messages
        self.max_delay = max_delay
        self._queue: asyncio.Queue[_Item | None] = asyncio.Queue(maxsize=min(max(64, 2 * max_messages), 2 * MAX_BATCH_MESSAGES))
        self._closed = False
        # The agent's own task: shutting down waits until what was queued is sent.
        self._task = agent.spawn(self._run(), name="chorus-batcher")

    async def __aenter__(self) -> Batcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _put(self, item: _Item) -> None:
        if self._closed or self._agent.stopping or self._task.done():
            raise _stopped()
        await self._queue.put(item)

    async def publish(self, topic: str, payload: Any = None, **kwargs: Any) -> asyncio.Future[None]:
        """Queues an event (the arguments of :meth:`Agent.publish`)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._put(_Item("event", (topic, payload), kwargs, done))
        return done

    async def send(self, agent: str, command: str, payload: Any = None, **kwargs: Any) -> asyncio.Future[int]:
        """Queues a one-way command (the arguments of :meth:`Agent.send`)."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        await self._put(_Item("command", (agent, command, payload), kwargs, done))
        return done

    async def flush(self) -> None:
        """Sends what is gathered now, and returns once it is sent."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._put(_Item("flush", done=done))
        await done

    async def close(self) -> None:
        """Sends what is queued and stops."""
        if not self._closed:
            self._closed = True
            if not self._task.done():
                await self._queue.put(None)
        await asyncio.wait([self._task])

    async def _run(self) -> None:
        stopping = asyncio.ensure_future(self._agent.until_stopping())
        try:
            while True:
                first = await self._next(stopping, None)
                if first is None:
                    break
                batch = [first]
                deadline = asyncio.get_running_loop().time() + self.max_delay
                messages = 0 if first.kind == "flush" else 1
                while first.kind != "flush" and messages < self.max_messages:
                    item = await self._next(stopping, deadline)
                    if item is None:
                        break
                    batch.append(item)
                    if item.kind == "flush":
                        break
                    messages += 1
                await self._send(batch)
        finally:
            stopping.cancel()
            # Anything left (queued as it ended) is refused, not lost in silence.
            while not self._queue.empty():
                left = self._queue.get_nowait()
                if left is not None:
                    _settle(left, error=_stopped())

    async def _next(self, stopping: asyncio.Future[Any], deadline: float | None) -> _Item | None:
        """The next item; None at the deadline, once closed (the end of the queue), or once the
        agent is stopping and nothing is queued: then what is queued comes without waiting."""
        if stopping.done() or self._closed:
            if self._queue.empty():
                return None
            return self._queue.get_nowait()
        if not self._queue.empty():
            # Already waiting: no need to wait for it.
            return self._queue.get_nowait()
        getter: asyncio.Future[_Item | None] = asyncio.ensure_future(self._queue.get())
        timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            waits: list[asyncio.Future[Any]] = [getter, stopping]
            finished, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            getter.cancel()
            raise
        if getter in finished:
            return getter.result()
        getter.cancel()
        try:
            await getter
        except asyncio.CancelledError:
            pass
        else:
            # Taken just as it was cancelled: keep it.
            return getter.result()
        if stopping.done() and not self._queue.empty():
            return self._queue.get_nowait()
        return None

    async def _send(self, batch: list[_Item]) -> None:
        agent = self._agent
        events = [i for i in batch if i.kind == "event"]
        commands = [i for i in batch if i.kind == "command"]
        count = len(events) + len(commands)
        published: list[_Item] = []
        for item in events:
            try:
                await agent.publish(*item.args, **item.kwargs)
                published.append(item)
            except Exception as e:  # noqa: BLE001 - the message's own failure, given to its waiter
                _settle(item, error=e)
        core: list[_Item] = []
        durable: list[_Item] = []
        for item in commands:
            at_most_once = item.kwargs.get("delivery", agent.default_delivery) is Delivery.AT_MOST_ONCE
            (core if at_most_once else durable).append(item)
        for item in core:
            try:
                await agent.send(*item.args, **item.kwargs)
                published.append(item)
            except Exception as e:  # noqa: BLE001
                _settle(item, error=e)
        if published:
            # One flush for the batch's events and core commands: once it returns, the server
            # has them.
            try:
                await settle(agent.nc)
            except Exception as e:  # noqa: BLE001
                log.debug("agent %s: batch flush failed: %s", agent.id, e)
                for item in published:
                    _settle(item, error=ChorusError(StatusCode.UNAVAILABLE, f"batch flush failed: {e}"))
            for item in published:
                _settle(item, value=0 if item.kind == "command" else None)
        if durable:
            results = await asyncio.gather(*(agent.send(*i.args, **i.kwargs) for i in durable), return_exceptions=True)
            for item, result in zip(durable, results):
                if isinstance(result, BaseException):
                    _settle(item, error=result)
                else:
                    _settle(item, value=result)
        if count:
            agent.stats.batches_sent += 1
            agent.stats.batched_messages += count
        for item in batch:
            if item.kind == "flush":
                _settle(item, value=None)


def _settle(item: _Item, value: Any = None, error: BaseException | None = None) -> None:
    done = item.done
    if done is None or done.done():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(value)
