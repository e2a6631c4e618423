"""Priority for core messages (section 7.9, "Priority"): when messages wait for a handler slot,
the next slot goes to the most urgent (critical, high, normal, low; arrival order within one),
and a lower one is overtaken at most ``MAX_OVERTAKES`` times in a row. Against a Python agent
and the Rust peer (``agent-sdk/examples/interop_peer/priority.rs``), each handling one message
at a time behind a handler held until released. The pure queue is tested on its own first."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest

from chorus_sdk import ChorusError, Context, Delivery, StatusCode
from chorus_sdk._backlog import MAX_OVERTAKES, Backlog, Slots
from chorus_sdk.codec import decode, encode, encode_payload
from chorus_sdk.envelope import Envelope, Kind, Performative, Priority
from chorus_sdk.subjects import Subjects

from .conftest import eventually, py_agent

WAIT = 15.0
N, H, L, C = Priority.NORMAL, Priority.HIGH, Priority.LOW, Priority.CRITICAL


# ---------------------------------------------------------------------------------------------
# The queue on its own


def test_the_backlog_serves_by_priority_then_arrival() -> None:
    b: Backlog[str] = Backlog()
    for label, p in [("l0", L), ("n0", N), ("l1", L), ("n1", N), ("h0", H), ("c0", C), ("u0", Priority.UNKNOWN)]:
        assert b.push(p, label)
    assert [b.pop() for _ in range(len(b))] == ["c0", "h0", "n0", "n1", "u0", "l0", "l1"]
    assert b.pop() is None


def test_a_full_backlog_refuses_whatever_the_priority() -> None:
    b: Backlog[int] = Backlog(capacity=2)
    assert b.push(L, 1) and b.push(L, 2)
    assert not b.push(C, 3)
    assert len(b) == 2


def test_a_low_one_is_overtaken_at_most_max_overtakes_times_in_a_row() -> None:
    b: Backlog[str] = Backlog()
    b.push(L, "low")
    order = []
    for i in range(MAX_OVERTAKES + 1):
        # Two high ones arrive for every one taken: the stream never runs dry.
        b.push(H, f"h{2 * i}")
        b.push(H, f"h{2 * i + 1}")
        order.append(b.pop())
    assert order[-1] == "low" and "low" not in order[:-1]


async def test_slots_go_to_the_most_urgent_waiter_and_survive_cancellation() -> None:
    slots = Slots(1)
    await slots.acquire(N)  # taken at once: nothing waits
    got: list[str] = []

    async def wait(label: str, p: Priority) -> None:
        await slots.acquire(p)
        got.append(label)

    tasks = [asyncio.create_task(wait(label, p)) for label, p in [("low", L), ("normal", N), ("gone", C), ("high", H)]]
    await eventually("four waiting", _now(lambda: slots.waiting == 4))
    tasks[2].cancel()
    await eventually("the cancelled one left", _now(lambda: slots.waiting == 3))
    for expected in (1, 2, 3):
        slots.release()
        await eventually(f"{expected} served", _now(lambda: len(got) == expected))
    assert got == ["high", "normal", "low"]
    slots.release()
    await slots.acquire(L)  # the slot came back free


def _now(check: Any) -> Any:
    async def ask() -> Any:
        return check()

    return ask


# ---------------------------------------------------------------------------------------------
# A Python agent with a backlog


class Backlogged:
    """A Python agent handling one message at a time with ``capacity`` waiting at most: ``hold``
    takes the slot until :meth:`release`; ``work`` records its label in :attr:`handled`. A raw
    client sends requests in a known order and collects the replies."""

    def __init__(self, server: Any, agent_id: str, capacity: int) -> None:
        self.server = server
        self.agent = py_agent(server, agent_id, max_in_flight=1, queue_capacity=capacity)
        self.handled: list[str] = []
        self.started = asyncio.Event()
        self.gate = asyncio.Event()
        self.replies: dict[str, Envelope] = {}
        self.subjects = Subjects()

        @self.agent.command("hold")
        async def hold(ctx: Context) -> None:
            self.started.set()
            await self.gate.wait()

        @self.agent.command("work")
        async def work(ctx: Context) -> int:
            self.handled.append(ctx.data())
            return len(self.handled) - 1

    async def __aenter__(self) -> Backlogged:
        await self.agent.__aenter__()
        self.nc = await nats.connect(self.server.url)

        async def on_reply(msg: Any) -> None:
            self.replies[msg.subject.rsplit(".", 1)[1]] = decode(msg.data)[0]

        await self.nc.subscribe("_INBOX.prio.*", cb=on_reply)
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.nc.close()
        await self.agent.__aexit__(*exc)

    async def send(self, command: str, label: str, priority: Priority) -> None:
        """A request from the agent ``sender-<label>``, published now (after those before it
        on this connection)."""
        env = Envelope.new(Kind.REQUEST, Performative.REQUEST, f"sender-{label}")
        env.to, env.name, env.priority = [self.agent.id], command, priority
        env.payload = encode_payload(label)
        await self.nc.publish(self.subjects.command(self.agent.id, command), encode(env), reply=f"_INBOX.prio.{label}")

    async def backlog(self, waiting: list[tuple[str, Priority]]) -> None:
        """Holds the slot, queues ``waiting`` in that order, and returns once all of them wait:
        a probe sent after them is refused with 5019 (the queue is full)."""
        await self.send("hold", "hold", N)
        await asyncio.wait_for(self.started.wait(), WAIT)
        for label, p in waiting:
            await self.send("work", label, p)
        await self.send("work", "probe", N)
        await eventually("the probe refused", _now(lambda: "probe" in self.replies))
        assert self.replies["probe"].status == StatusCode.UNAVAILABLE, self.replies["probe"]

    async def release(self, count: int) -> list[str]:
        """Lets ``hold`` go and returns the labels in the order handled, once ``count`` are
        answered."""
        self.gate.set()
        await eventually("every request answered", _now(lambda: len(self.replies) >= count + 2))
        assert all(r.status == StatusCode.OK for k, r in self.replies.items() if k != "probe")
        return self.handled


async def test_a_python_agent_with_a_backlog_answers_critical_and_high_first(server: Any) -> None:
    waiting = [(f"n{i}", N) for i in range(5)] + [(f"l{i}", L) for i in range(5)]
    waiting = [x for pair in zip(waiting[:5], waiting[5:]) for x in pair]  # n0 l0 n1 l1 ...
    waiting += [("high", H), ("critical", C)]
    async with Backlogged(server, "py-prio", capacity=len(waiting)) as b:
        await b.backlog(waiting)
        order = await b.release(len(waiting))
    assert order == ["critical", "high", "n0", "n1", "n2", "n3", "n4", "l0", "l1", "l2", "l3", "l4"]


async def test_a_low_one_gets_through_a_stream_of_high_ones(server: Any) -> None:
    waiting = [("low", L)] + [(f"h{i}", H) for i in range(20)]
    async with Backlogged(server, "py-starve", capacity=len(waiting)) as b:
        await b.backlog(waiting)
        order = await b.release(len(waiting))
    # Overtaken MAX_OVERTAKES times in a row, then served.
    assert order.index("low") == MAX_OVERTAKES, order
    assert order[:MAX_OVERTAKES] == [f"h{i}" for i in range(MAX_OVERTAKES)]


# ---------------------------------------------------------------------------------------------
# Python sending priority to the Rust peer


async def test_a_rust_agent_serves_python_commands_by_priority(server: Any, rust_peer: Any) -> None:
    waiting = [("n0", N), ("l0", L), ("n1", N), ("l1", L), ("n2", N), ("high", H)]
    peer = rust_peer("rust-prio", PEER_PRIORITY_QUEUE=str(len(waiting)))
    async with py_agent(server, "py-prio-sender") as py:
        once = Delivery.AT_MOST_ONCE
        # Each send returns once published on this agent's one connection: they arrive in order.
        await py.send(peer.id, "prio_hold", None, delivery=once)
        for label, p in waiting:
            await py.send(peer.id, "prio_work", label, delivery=once, priority=p)
        # A request behind them finds the queue full: everything before it waits.
        with pytest.raises(ChorusError) as refused:
            await py.request(peer.id, "prio_work", "probe", timeout=WAIT)
        assert refused.value.status == StatusCode.UNAVAILABLE
        await py.publish("interop.priority.release")

        async def done() -> Any:
            try:
                order = await py.request(peer.id, "prio_order", None, timeout=WAIT)
            except ChorusError as e:
                # Asked while the queue is still full: refused at once, asked again.
                assert e.status == StatusCode.UNAVAILABLE, e
                return None
            return order if len(order) == len(waiting) else None

        order = await eventually("the backlog handled", done)
        assert order == ["high", "n0", "n1", "n2", "l0", "l1"]
        # A request with a priority (Python's request(priority=...)) is answered as any other.
        assert await py.request(peer.id, "prio_work", "after", priority=C, timeout=WAIT) == len(waiting)
