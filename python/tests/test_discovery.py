"""Capability queries, handling times and ETAs (IACP), as the Rust SDK writes and reads them: an
agent's manifest says how long its handlers take lately (``handling_ms``, agent-wide and per
capability), what waits for a handler slot per priority (``waiting``), the ETA both give
(``eta_ms``) and the most tokens a capability takes (``max_tokens``); a discovery names several
capabilities, a token count and a priority, and the Rust coordinator returns each record with
its ETA, soonest first; a discover is answered with ``offer``; a task's acceptance carries the
worker's ETA; an agent dedicated to a customer says so (``customer``), and a discovery for a
customer finds its agents and the shared ones, not another customer's. The pure parts first, then a Python agent, the Rust coordinator and the Rust peer
(``agent-sdk/examples/interop_peer``) on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import nats
import pytest

from chorus_sdk import Agent, Context, Performative, Priority, StatusCode, SubjectError, TaskContext, TaskState
from chorus_sdk._backlog import Slots
from chorus_sdk.codec import decode, decode_payload, encode, encode_payload
from chorus_sdk.envelope import CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, Envelope, Kind, Progress
from chorus_sdk.eta import U64_MAX, Ewma, estimate_eta_ms, eta_at, waiting_at_or_above
from chorus_sdk.status import ChorusError
from chorus_sdk.subjects import Subjects
from chorus_sdk.tasks import TaskUpdate

from .conftest import ChorusProcess, Coordinator, NatsServer, eventually, py_agent, rust_binary

WAIT = 20.0
MS = 1_000_000  # ns
N, H, L, C = Priority.NORMAL, Priority.HIGH, Priority.LOW, Priority.CRITICAL


# ---------------------------------------------------------------------------------------------
# The pure parts: the moving average, the estimate, what waits


def test_the_moving_average_starts_at_the_first_sample_and_follows_the_recent_ones() -> None:
    # Sample for sample the Rust SDK's `stats::Ewma` test.
    e = Ewma()
    assert e.ms is None, "nothing handled, nothing known"
    e.record(100 * MS)
    assert e.ms == 100
    e.record(200 * MS)
    assert e.ms == 120, "a fifth of the way to the new sample"
    for _ in range(60):
        e.record(10 * MS)
    assert e.ms == 10, "old samples fade"
    e.record(200_000)
    assert e.ms == 9
    quick = Ewma()
    quick.record(20_000)
    assert quick.ms == 1, "under a ms reads as 1 ms, not free"
    negative = Ewma()
    negative.record(-5)
    assert negative.ms == 1


def test_the_eta_counts_the_handlers_ahead_at_the_rate_the_slots_free_up() -> None:
    # The Rust SDK's `estimate_eta_ms` cases.
    assert estimate_eta_ms(100, 4, 2, 1) == 100, "a free slot: its own handling time"
    assert estimate_eta_ms(100, 4, 4, 0) == 125, "every slot busy: one of 4 finishes in 100/4 ms"
    assert estimate_eta_ms(100, 1, 1, 2) == 400, "one slot, 3 ahead: 3 runs, then its own"
    assert estimate_eta_ms(100, 0, 1, 0) == 200, "no slots read as one"
    assert estimate_eta_ms(U64_MAX, 1, 2**32 - 1, 2**32 - 1) == U64_MAX, "saturates"


def test_a_manifests_eta_is_at_a_priority_for_its_slowest_named_capability() -> None:
    # The Rust SDK's `Manifest::eta_at` cases, on a manifest as discovery decodes it.
    m: dict[str, Any] = {
        "capabilities": [
            {"name": "review", "handling_ms": 200},
            {"name": "testing", "handling_ms": 50},
            {"name": "new"},
        ],
        "handling_ms": 100,
        "slots": 1,
        "load": 1.0,
        "waiting": {"high": 1, "normal": 2, "low": 4},
    }
    assert eta_at(m, H, ["review"]) == 600, "the busy handler and the one high ahead"
    assert eta_at(m, N, ["testing"]) == 250, "normal waits behind high and normal too"
    assert eta_at(m, L) == 900, "low behind everything; the agent's own time"
    assert eta_at(m, C, ["review", "testing"]) == 400, "the slowest of those named"
    assert eta_at(m, C, ["new"]) == 200, "a capability not yet timed takes the agent's own"
    assert eta_at({}, N) is None, "untimed: unknown"
    assert waiting_at_or_above({}, L) == 0
    assert waiting_at_or_above(m["waiting"], Priority.UNKNOWN) == 3, "an unknown priority waits as normal"
    # Whatever a manifest holds, it never raises.
    odds: list[dict[str, Any]] = [
        {"handling_ms": "fast"},
        {"handling_ms": -1},
        {"handling_ms": True},
        {"handling_ms": 10, "slots": "many", "load": float("nan"), "waiting": [1, 2]},
        {"handling_ms": 10, "capabilities": [None, {"name": ["x"], "handling_ms": 5}, {"name": "x", "handling_ms": {}}]},
        {"handling_ms": 10, "waiting": {"normal": -3, "high": "2", "critical": 1.5}},
    ]
    for odd in odds:
        assert eta_at(odd, N, ["x"]) in (None, 10), odd
    assert eta_at([], N) is None  # type: ignore[arg-type]


async def test_handler_slots_count_what_waits_per_priority() -> None:
    slots = Slots(1)
    await slots.acquire(N)  # taken at once: nothing waits, nothing counted
    assert slots.waiting_by_class == (0, 0, 0, 0)
    waiters = {
        label: asyncio.create_task(slots.acquire(p))
        for label, p in [("low", L), ("normal", N), ("unknown", Priority.UNKNOWN), ("high", H), ("critical", C)]
    }

    async def counted(expected: tuple[int, int, int, int]) -> Any:
        async def now() -> bool:
            return slots.waiting_by_class == expected

        await eventually(f"waiting {expected}", now, 5.0, 0.01)

    await counted((1, 1, 2, 1))
    waiters["high"].cancel()
    await counted((1, 0, 2, 1))
    slots.release()  # to the critical one
    await counted((0, 0, 2, 1))
    for expected in [(0, 0, 1, 1), (0, 0, 0, 1), (0, 0, 0, 0)]:
        slots.release()
        await counted(expected)
    slots.release()
    await asyncio.gather(*(t for label, t in waiters.items() if label != "high"))
    assert slots.waiting == 0


def test_a_successful_reply_to_a_discover_is_an_offer() -> None:
    agent = Agent("py-replier", heartbeat_interval=0)
    discover = Envelope.new(Kind.REQUEST, Performative.DISCOVER, "asker")
    request = Envelope.new(Kind.REQUEST, Performative.REQUEST, "asker")
    assert agent.reply_envelope(discover, [1, 2]).performative is Performative.OFFER
    assert agent.reply_envelope(request, [1, 2]).performative is Performative.INFORM
    # A failure is a failure or a refusal, whatever was asked.
    failed = agent.reply_envelope(discover, ChorusError(StatusCode.UNAVAILABLE, "later"))
    refused = agent.reply_envelope(discover, ChorusError(StatusCode.ACCESS, "no"))
    assert (failed.performative, refused.performative) == (Performative.FAILURE, Performative.REFUSE)


async def test_discover_and_max_tokens_check_their_arguments_before_anything_is_sent() -> None:
    agent = Agent("py-asker", heartbeat_interval=0)
    with pytest.raises(TypeError):
        await agent.discover(capabilities="one.string")
    with pytest.raises(SubjectError):
        await agent.discover(capabilities=["fine", "not fine"])
    for tokens in (-1, 1.5, True, "4096"):
        with pytest.raises(ValueError):
            await agent.discover(max_tokens=tokens)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await agent.discover(priority="urgent")
    with pytest.raises(ValueError):
        await agent.discover(priority=Priority.UNKNOWN)
    with pytest.raises(ValueError):
        Agent("py-bad", capability_max_tokens={"llm": -1})
    with pytest.raises(ValueError):
        Agent("py-bad", capability_max_tokens={"llm": 2.5})  # type: ignore[dict-item]
    with pytest.raises(SubjectError):
        Agent("py-bad", capability_max_tokens={"not a name": 10})


async def test_a_dedicated_agents_manifest_names_its_customer_after_its_groups() -> None:
    """Section 7.7: ``customer`` right after ``groups``, as the Rust SDK's ``Manifest`` orders
    it; unsaid for an agent that serves every customer. A customer is one token, in the agent's
    options and in a discovery, checked before anything is sent."""
    dedicated = decode_payload(Agent("py-dedicated", heartbeat_interval=0, groups=["night"], customer="acme").manifest())
    keys = list(dedicated)
    assert dedicated["customer"] == "acme"
    assert keys[keys.index("groups") + 1] == "customer", keys
    shared = decode_payload(Agent("py-shared", heartbeat_interval=0).manifest())
    assert "customer" not in shared
    for bad in ("acme.eu", "", "a b", "x" * 65):
        with pytest.raises(SubjectError):
            Agent("py-bad", customer=bad)
        with pytest.raises(SubjectError):
            await Agent("py-asker", heartbeat_interval=0).discover(customer=bad)


async def test_a_python_manifest_says_its_handling_time_its_eta_and_its_token_limit() -> None:
    """Without a server: the pipeline (``agent.handle``, as the durable inbox calls it) times
    a capability's handler, and the manifest says so."""
    agent = Agent("py-offline", heartbeat_interval=0, max_in_flight=4, usage_interval=0, capability_max_tokens={"disc.think": 2048})

    @agent.capability("disc.think")
    async def think(ctx: Context) -> str:
        await asyncio.sleep(0.02)
        return "thought"

    @agent.command("plain")
    async def plain(ctx: Context) -> None:
        return None

    before = decode_payload(agent.manifest())
    assert before["capabilities"] == [{"name": "disc.think", "version": "", "max_tokens": 2048}]
    assert not {"handling_ms", "eta_ms", "waiting"} & set(before), "nothing handled, nothing said"
    subjects = Subjects()
    for _ in range(3):
        env = Envelope.new(Kind.REQUEST, Performative.REQUEST, "asker")
        env.capability = "disc.think"
        assert await agent.handle(env, subjects.capability("disc.think"), "capability", "disc.think") == "thought"
    after = decode_payload(agent.manifest())
    (think_info,) = after["capabilities"]
    assert think_info["max_tokens"] == 2048
    assert 20 <= think_info["handling_ms"] <= 1000
    # One endpoint timed: the agent's time is its time; nothing busy, nothing waits.
    assert after["handling_ms"] == think_info["handling_ms"]
    assert after["eta_ms"] == after["handling_ms"] == eta_at(after, N, ["disc.think"])
    assert "waiting" not in after


def test_a_task_update_reads_the_eta_of_an_acceptance_and_nothing_else() -> None:
    def status(state: TaskState, payload: bytes = b"", content_type: str = CONTENT_TYPE_MSGPACK) -> TaskUpdate:
        env = Envelope.new(Kind.RESPONSE, Performative.AGREE, "worker")
        env.progress = Progress(state)
        env.payload, env.content_type = payload, content_type
        return TaskUpdate(1, "status", env)

    assert status(TaskState.ACCEPTED, encode_payload({"eta_ms": 1500})).eta == 1.5
    assert status(TaskState.ACCEPTED, encode_payload({"eta_ms": 7}, CONTENT_TYPE_JSON), CONTENT_TYPE_JSON).eta == 0.007
    assert status(TaskState.ACCEPTED).eta is None, "a worker that has not run it yet says nothing"
    assert status(TaskState.WORKING, encode_payload({"eta_ms": 1500})).eta is None
    for odd in [b"\xc1", b"\x81\x81\x01\x02\x03", encode_payload({"eta_ms": -1}), encode_payload({"eta_ms": "soon"}), encode_payload([1])]:
        assert status(TaskState.ACCEPTED, odd).eta is None, odd
    assert status(TaskState.ACCEPTED, b"x", "text/plain").eta is None


# ---------------------------------------------------------------------------------------------
# On a bus, with the Rust coordinator


@pytest.fixture(scope="module")
def coordinator(server: NatsServer) -> Iterator[Coordinator]:
    """`chorus serve` for the module's tests (each waits until it answers)."""
    c = Coordinator(server.url)
    yield c
    c.stop()


async def coordinator_ready(agent: Agent) -> None:
    async def answers() -> bool:
        try:
            await agent.discover(timeout=1.0)
            return True
        except ChorusError:
            return False

    await eventually("the coordinator answers discovery", answers, WAIT)


async def records(agent: Agent, ids: set[str], quiet: bool = False, **query: Any) -> list[dict[str, Any]]:
    """The records of agents ``ids`` a discovery returns, in its order; ``quiet``: none when
    the discovery fails (asked again by :func:`eventually`)."""
    try:
        found = await agent.discover(timeout=5.0, **query)
    except ChorusError:
        if quiet:
            return []
        raise
    return [r for r in found if r["manifest"]["agent"] in ids]


async def test_a_python_agent_announces_its_handling_time_and_discovery_returns_its_eta(server: Any, coordinator: Any) -> None:
    async with py_agent(server, "py-asker-a") as asker:
        await coordinator_ready(asker)
        steady = py_agent(server, "py-steady", heartbeat_interval=0.2)

        @steady.capability("disc.steady")
        async def work(ctx: Context) -> str:
            await asyncio.sleep(0.05)
            return "done"

        async with steady:
            await steady.flush()
            for _ in range(5):
                assert await asker.request_capability("disc.steady", None, timeout=WAIT) == "done"

            async def timed() -> Any:
                found = await records(asker, {steady.id}, quiet=True, capability="disc.steady")
                return found if found and "handling_ms" in found[0]["manifest"] else None

            (record,) = await eventually("py-steady's handling time in discovery", timed)
            manifest = record["manifest"]
            (info,) = manifest["capabilities"]
            # Each run slept 50 ms: the average is no less, and not much more.
            assert 50 <= manifest["handling_ms"] <= 500, manifest
            assert 50 <= info["handling_ms"] <= 500, info
            assert "waiting" not in manifest
            # Idle (a free slot, nothing waiting): the ETA is its handling time, in the manifest
            # (agent-wide) and in the record (for the capability asked about).
            assert manifest["eta_ms"] == manifest["handling_ms"]
            assert record["eta_ms"] == info["handling_ms"] == eta_at(manifest, N, ["disc.steady"])


async def test_a_discovery_names_several_capabilities_and_a_token_count(server: Any, coordinator: Any) -> None:
    async with py_agent(server, "py-asker-b") as asker:
        await coordinator_ready(asker)

        async def serve(agent: Agent, *capabilities: str) -> Agent:
            for c in capabilities:
                agent.on_capability(c, _echo)
            await agent.connect()
            await agent.flush()
            return agent

        both = await serve(py_agent(server, "py-both", heartbeat_interval=0.2), "disc.review", "disc.testing")
        only = await serve(py_agent(server, "py-only-review", heartbeat_interval=0.2), "disc.review")
        small = await serve(py_agent(server, "py-small", heartbeat_interval=0.2, capability_max_tokens={"disc.llm": 1024}), "disc.llm")
        large = await serve(py_agent(server, "py-large", heartbeat_interval=0.2, capability_max_tokens={"disc.llm": 8192}), "disc.llm")
        unlimited = await serve(py_agent(server, "py-unlimited", heartbeat_interval=0.2), "disc.llm")
        mine = {a.id for a in (both, only, small, large, unlimited)}
        try:

            async def ids(**query: Any) -> set[str]:
                return {r["manifest"]["agent"] for r in await records(asker, mine, **query)}

            async def all_in() -> bool:
                return {r["manifest"]["agent"] for r in await records(asker, mine, quiet=True)} == mine

            await eventually("five agents in discovery", all_in)
            assert await ids(capabilities=["disc.review", "disc.testing"]) == {both.id}
            assert await ids(capability="disc.review", capabilities=["disc.testing"]) == {both.id}
            assert await ids(capabilities=["disc.review"]) == {both.id, only.id}
            assert await ids(capabilities=["disc.review", "disc.nobody"]) == set()
            # 4096 tokens: the one stating 1024 is passed by; 8192 and no limit take it.
            assert await ids(capability="disc.llm", max_tokens=4096) == {large.id, unlimited.id}
            assert await ids(capability="disc.llm", max_tokens=1024) == {small.id, large.id, unlimited.id}
            assert await ids(capability="disc.llm", max_tokens=10_000) == {unlimited.id}
            # Naming none: any one of an agent's capabilities will do.
            assert await ids(max_tokens=4096) == {both.id, only.id, large.id, unlimited.id}
            # The limit as the agent stated it, through the Rust coordinator.
            stated = {
                r["manifest"]["agent"]: r["manifest"]["capabilities"][0].get("max_tokens")
                for r in await records(asker, mine, capability="disc.llm")
            }
            assert stated == {small.id: 1024, large.id: 8192, unlimited.id: None}
        finally:
            for agent in (both, only, small, large, unlimited):
                await agent.shutdown()


async def test_with_a_priority_the_soonest_come_first_and_what_waits_counts(server: Any, coordinator: Any) -> None:
    async with py_agent(server, "py-asker-c") as asker:
        await coordinator_ready(asker)
        # Named so that by id (the order among equally loaded agents) the slow one is first.
        slow = py_agent(server, "py-a-slow", heartbeat_interval=0.2)
        fast = py_agent(server, "py-b-fast", heartbeat_interval=0.2)
        slow.on_capability("disc.rank", _sleeping(0.3))
        fast.on_capability("disc.rank", _sleeping(0.01))
        async with slow, fast:
            await slow.flush()
            await fast.flush()
            for _ in range(3):
                await asker.request_capability("disc.rank", None, at=slow.id, timeout=WAIT)
                await asker.request_capability("disc.rank", None, at=fast.id, timeout=WAIT)
            pair = {slow.id, fast.id}

            async def settled() -> Any:
                found = await records(asker, pair, quiet=True, capability="disc.rank")
                quiet = len(found) == 2 and all(r["manifest"]["load"] == 0 and "eta_ms" in r for r in found)
                return found if quiet else None

            by_load = await eventually("both timed and idle in discovery", settled)
            assert [r["manifest"]["agent"] for r in by_load] == [slow.id, fast.id], "least loaded, then by id"
            soonest = await records(asker, pair, capability="disc.rank", priority="high")
            assert [r["manifest"]["agent"] for r in soonest] == [fast.id, slow.id], soonest
            assert soonest[0]["eta_ms"] < soonest[1]["eta_ms"]
            low = await records(asker, pair, capability="disc.rank", priority=Priority.LOW)
            assert [(r["manifest"]["agent"], r["eta_ms"]) for r in low] == [(r["manifest"]["agent"], r["eta_ms"]) for r in soonest]

        # What waits for a slot, per priority, and the ETA at each priority the coordinator
        # computes from it: one slot, held; five requests behind it.
        queue = py_agent(server, "py-queue", heartbeat_interval=0.2, max_in_flight=1)
        gate = asyncio.Event()
        held = asyncio.Event()

        @queue.capability("disc.queue")
        async def work(ctx: Context) -> str:
            if ctx.data() == "hold":
                held.set()
                await gate.wait()
            else:
                await asyncio.sleep(0.02)
            return "done"

        async with queue:
            await queue.flush()
            assert await asker.request_capability("disc.queue", "timed", timeout=WAIT) == "done"
            calls = [asyncio.create_task(asker.request_capability("disc.queue", "hold", priority=N, timeout=WAIT))]
            await asyncio.wait_for(held.wait(), WAIT)
            for p in (H, N, N, L, C):
                calls.append(asyncio.create_task(asker.request_capability("disc.queue", "x", priority=p, timeout=WAIT)))
            try:

                async def waiting() -> Any:
                    found = await records(asker, {queue.id}, quiet=True, capability="disc.queue", priority="low")
                    full = found and found[0]["manifest"].get("waiting") == {"critical": 1, "high": 1, "normal": 2, "low": 1}
                    return found[0] if full and found[0]["manifest"]["load"] == 1.0 else None

                record = await eventually("five waiting in py-queue's manifest", waiting)
                manifest = record["manifest"]
                handling = manifest["capabilities"][0]["handling_ms"]
                assert manifest["handling_ms"] == handling
                # One slot, busy: at low, all five are ahead; at high, the critical and the high.
                assert record["eta_ms"] == estimate_eta_ms(handling, 1, 1, 5) == 7 * handling
                (high,) = await records(asker, {queue.id}, capability="disc.queue", priority="high")
                assert high["manifest"]["waiting"] == manifest["waiting"]
                assert high["eta_ms"] == estimate_eta_ms(handling, 1, 1, 2) == 4 * handling
                # The manifest's own: at normal, four ahead.
                assert manifest["eta_ms"] == estimate_eta_ms(handling, 1, 1, 4) == 6 * handling
            finally:
                gate.set()
                assert await asyncio.wait_for(asyncio.gather(*calls), WAIT) == ["done"] * 6


async def test_a_python_workers_acceptance_carries_its_eta_once_it_has_run_the_task(server: Any) -> None:
    async with py_agent(server, "py-brewer") as worker, py_agent(server, "py-customer") as customer:

        @worker.task("brew")
        async def brew(task: TaskContext) -> str:
            await asyncio.sleep(0.05)
            return f"{task.data()} brewed"

        @worker.task("spill")
        async def spill(task: TaskContext) -> str:
            raise ChorusError(StatusCode.HANDLER_FAILED, "spilt")

        await worker.flush()

        async def acceptance(payload: str, name: str = "brew") -> Any:
            handle = await customer.submit(payload, to=worker.id, name=name)
            updates = await asyncio.wait_for(_collect(handle), WAIT)
            (accepted,) = [u for u in updates if u.state is TaskState.ACCEPTED]
            return accepted, await handle.result(timeout=WAIT)

        first, result = await acceptance("tea")
        assert result.data() == "tea brewed"
        assert first.eta is None and first.envelope.payload == b"", "never run: no ETA"
        second, _ = await acceptance("coffee")
        assert second.envelope.content_type == CONTENT_TYPE_MSGPACK
        assert 0.05 <= second.eta <= 0.5, second.eta
        assert decode_payload(second.envelope.payload) == {"eta_ms": round(second.eta * 1000)}
        # The task's runs are the agent's handling time (the acceptance handler is not).
        manifest = decode_payload(worker.manifest())
        assert 50 <= manifest["handling_ms"] <= 500, manifest
        # A failed run counts; each kind has its own.
        spilt, failed = await acceptance("milk", "spill")
        assert spilt.eta is None and failed.state is TaskState.FAILED
        again, _ = await acceptance("milk", "spill")
        assert again.eta is not None and again.eta < second.eta


async def test_a_discovery_for_a_customer_finds_its_own_agents_and_the_shared_ones(server: Any, coordinator: Any) -> None:
    """Agentify's ``discover`` with a ``customer_id``, through the Rust coordinator: the agents
    dedicated to that customer and those dedicated to none, not another customer's."""
    async with py_agent(server, "py-asker-f") as asker:
        await coordinator_ready(asker)
        acme = py_agent(server, "py-calc-acme", heartbeat_interval=0.2, customer="acme")
        globex = py_agent(server, "py-calc-globex", heartbeat_interval=0.2, customer="globex")
        shared = py_agent(server, "py-calc-shared", heartbeat_interval=0.2)
        mine = {acme.id, globex.id, shared.id}
        for a in (acme, globex, shared):
            a.on_capability("disc.calculation", _echo)
        async with acme, globex, shared:

            async def ids(**query: Any) -> set[str]:
                return {r["manifest"]["agent"] for r in await records(asker, mine, **query)}

            async def all_in() -> bool:
                found = await records(asker, mine, quiet=True, capability="disc.calculation")
                return {r["manifest"]["agent"] for r in found} == mine

            await eventually("three agents in discovery", all_in)
            assert await ids(capability="disc.calculation", customer="acme") == {acme.id, shared.id}
            assert await ids(capability="disc.calculation", customer="globex") == {globex.id, shared.id}
            assert await ids(capability="disc.calculation", customer="initech") == {shared.id}, "a customer with none of its own"
            assert await ids(capability="disc.calculation") == mine, "no customer named: all of them"
            # Each manifest's customer as the agent said it, through the coordinator's registry.
            said = {
                r["manifest"]["agent"]: r["manifest"].get("customer")
                for r in await records(asker, mine, capability="disc.calculation")
            }
            assert said == {acme.id: "acme", globex.id: "globex", shared.id: None}


# ---------------------------------------------------------------------------------------------
# Across languages


async def test_a_hosted_rust_agents_customer_is_read_and_a_python_agents_reaches_chorus_agents(
        server: Any, coordinator: Any) -> None:
    """As ``chorus host`` starts a replica of a manifest with ``customer = "acme"``:
    ``chorus agent`` with ``CHORUS_AGENT_ID`` and ``CHORUS_CUSTOMER`` announces that customer,
    which a Python discovery reads; a Python agent's customer reaches the Rust SDK's discovery
    and decoding (``chorus agents --customer acme --json``)."""
    hosted = ChorusProcess(
        server.url, "agent", "--capability", "disc.hosted", CHORUS_AGENT_ID="rust-hosted-acme", CHORUS_CUSTOMER="acme")
    try:
        await asyncio.to_thread(hosted.wait_for, "rust-hosted-acme serving disc.hosted", WAIT)
        async with py_agent(server, "py-asker-g") as asker:
            await coordinator_ready(asker)

            async def hosted_for_acme() -> Any:
                return await records(asker, {"rust-hosted-acme"}, quiet=True, capability="disc.hosted", customer="acme")

            (record,) = await eventually("the hosted Rust agent found for acme", hosted_for_acme)
            assert record["manifest"]["customer"] == "acme"
            assert await records(asker, {"rust-hosted-acme"}, capability="disc.hosted", customer="globex") == []

            acme = py_agent(server, "py-hosted-acme", heartbeat_interval=0.2, customer="acme")
            globex = py_agent(server, "py-hosted-globex", heartbeat_interval=0.2, customer="globex")
            for a in (acme, globex):
                a.on_capability("disc.hosted", _echo)
            async with acme, globex:
                everyone = {"rust-hosted-acme", acme.id, globex.id}

                async def all_in() -> bool:
                    found = await records(asker, everyone, quiet=True, capability="disc.hosted")
                    return {r["manifest"]["agent"] for r in found} == everyone

                await eventually("the Rust and Python agents in discovery", all_in)
                proc = await asyncio.create_subprocess_exec(
                    rust_binary("chorus"), "--server", server.url, "agents", "--json",
                    "--capability", "disc.hosted", "--customer", "acme",
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                )
                out, err = await asyncio.wait_for(proc.communicate(), WAIT)
                assert proc.returncode == 0, err.decode()
                printed = {r["manifest"]["agent"]: r["manifest"].get("customer") for r in json.loads(out)}
                assert printed == {"rust-hosted-acme": "acme", acme.id: "acme"}, printed
    finally:
        await asyncio.to_thread(hosted.stop)


async def test_the_python_demo_agent_takes_its_customer_from_its_host(server: Any, coordinator: Any) -> None:
    """``python -m chorus_sdk.demo`` as a host starts it: its id, server and customer from
    ``CHORUS_AGENT_ID``, ``CHORUS_NATS_URL`` and ``CHORUS_CUSTOMER``, as the Rust demo agents."""
    env = {**os.environ, "CHORUS_AGENT_ID": "py-analyst-acme", "CHORUS_NATS_URL": server.url, "CHORUS_CUSTOMER": "acme"}
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "chorus_sdk.demo", env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        assert demo.stdout is not None
        line = await asyncio.wait_for(demo.stdout.readline(), WAIT)
        assert b"py-analyst-acme ready" in line, line
        async with py_agent(server, "py-asker-h") as asker:
            await coordinator_ready(asker)

            async def found(customer: str) -> Any:
                return await records(asker, {"py-analyst-acme"}, quiet=True, customer=customer)

            async def for_acme() -> Any:
                return await found("acme")

            (record,) = await eventually("the demo agent found for acme", for_acme)
            assert record["manifest"]["customer"] == "acme"
            assert await found("globex") == []
    finally:
        # The end of its standard input stops it.
        assert demo.stdin is not None
        demo.stdin.close()
        try:
            await asyncio.wait_for(demo.wait(), WAIT)
        except asyncio.TimeoutError:
            demo.kill()
            await demo.wait()


async def test_a_rust_agents_handling_time_and_eta_read_from_python(server: Any, coordinator: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-timed")
    async with py_agent(server, "py-asker-d") as asker:
        await coordinator_ready(asker)
        for i in range(3):
            assert await asker.request_capability("interop.upper", f"word {i}", at=peer.id, timeout=WAIT) == f"WORD {i}"

        async def timed() -> Any:
            found = await records(asker, {peer.id}, quiet=True, capability="interop.upper")
            if not found:
                return None
            caps = {c["name"]: c for c in found[0]["manifest"]["capabilities"]}
            return found[0] if "handling_ms" in caps.get("interop.upper", {}) else None

        # The peer beats every 5 s (the Rust default).
        record = await eventually("the Rust peer's handling time in discovery", timed, WAIT + 10)
        manifest = record["manifest"]
        info = next(c for c in manifest["capabilities"] if c["name"] == "interop.upper")
        assert isinstance(info["handling_ms"], int) and info["handling_ms"] >= 1
        assert isinstance(manifest["handling_ms"], int) and manifest["handling_ms"] >= 1
        # The Rust SDK's ETA and the coordinator's, as Python computes them from the manifest.
        assert manifest["eta_ms"] == eta_at(manifest, N)
        assert record["eta_ms"] == eta_at(manifest, N, ["interop.upper"])

        # A Rust worker's acceptance, read by a Python requester: an ETA once it has run one.
        first = await customer_acceptance(asker, peer.id, "spell", "abc")
        second = await customer_acceptance(asker, peer.id, "spell", "abcdef")
        assert first.eta is None
        assert second.eta is not None and second.eta >= 0.001, second.envelope


async def test_a_python_agents_fields_come_back_from_the_rust_coordinator_and_cli_unchanged(server: Any, coordinator: Any) -> None:
    async with py_agent(server, "py-asker-e") as asker:
        await coordinator_ready(asker)
        told = py_agent(server, "py-told", heartbeat_interval=0.2, capability_max_tokens={"disc.told": 4096, "disc.unserved": 1})
        told.on_capability("disc.told", _sleeping(0.02))
        async with told:
            await told.flush()
            for _ in range(3):
                await asker.request_capability("disc.told", None, timeout=WAIT)
            # What the Python agent says now (nothing runs any more: it stays so).
            said = decode_payload(told.manifest())
            fields = {k: said[k] for k in ("handling_ms", "eta_ms")}
            assert said["capabilities"] == [{"name": "disc.told", "version": "", "max_tokens": 4096, "handling_ms": fields["handling_ms"]}]

            async def current() -> Any:
                found = await records(asker, {told.id}, quiet=True, capability="disc.told")
                return found[0] if found and found[0]["manifest"].get("handling_ms") == fields["handling_ms"] else None

            # Through the Rust coordinator's typed registry: the same fields, the same values.
            record = await eventually("py-told's fields in discovery", current)
            assert {k: record["manifest"][k] for k in fields} == fields
            assert record["manifest"]["capabilities"] == said["capabilities"]
            assert record["eta_ms"] == fields["handling_ms"]

            # And through the Rust SDK's own decoding: `chorus agents --json` (its discover).
            proc = await asyncio.create_subprocess_exec(
                rust_binary("chorus"), "--server", server.url, "agents", "--json", "--capability", "disc.told",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), WAIT)
            assert proc.returncode == 0, err.decode()
            (printed,) = [r for r in json.loads(out) if r["manifest"]["agent"] == told.id]
            assert {k: printed["manifest"][k] for k in fields} == fields
            assert printed["manifest"]["capabilities"] == said["capabilities"]
            assert printed["eta_ms"] == fields["handling_ms"]


async def test_a_discover_is_answered_with_an_offer_by_the_coordinator_and_both_sdks(server: Any, coordinator: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-offers")
    subjects = Subjects()
    async with py_agent(server, "py-offers") as py:

        @py.command("catalogue")
        async def catalogue(ctx: Context) -> list[str]:
            return ["tea", "coffee"]

        await py.flush()
        await coordinator_ready(py)
        nc = await nats.connect(server.url)
        try:

            async def ask(subject: str, performative: Performative, payload: Any, name: str | None = None) -> Envelope:
                env = Envelope.new(Kind.REQUEST, performative, "raw-asker")
                env.name = name
                env.payload = encode_payload(payload)
                reply = await nc.request(subject, encode(env), timeout=WAIT)
                return decode(reply.data)[0]

            # The coordinator: a discovery query (with the new keys) answered with an offer.
            query = {"capabilities": ["disc.nobody"], "max_tokens": 10, "priority": "critical"}
            answer = await ask(subjects.discover, Performative.DISCOVER, query)
            assert (answer.kind, answer.performative, answer.status) == (Kind.RESPONSE, Performative.OFFER, StatusCode.OK)
            assert decode_payload(answer.payload, answer.content_type) == []
            # A query that does not read is refused, not offered.
            refused = await ask(subjects.discover, Performative.DISCOVER, {"priority": 5})
            assert refused.performative is not Performative.OFFER and refused.status != StatusCode.OK

            # A Python agent and the Rust SDK answer a discover to a command with an offer, and
            # a request with an inform.
            for agent, command, value in [(py.id, "catalogue", None), (peer.id, "echo", "menu")]:
                offer = await ask(subjects.command(agent, command), Performative.DISCOVER, value, command)
                assert (offer.performative, offer.status) == (Performative.OFFER, StatusCode.OK), agent
                inform = await ask(subjects.command(agent, command), Performative.REQUEST, value, command)
                assert (inform.performative, inform.status) == (Performative.INFORM, StatusCode.OK), agent
                failed = await ask(subjects.command(agent, "no-such-command"), Performative.DISCOVER, value, "no-such-command")
                assert (failed.performative, failed.status) == (Performative.REFUSE, StatusCode.UNKNOWN_COMMAND), agent
        finally:
            await nc.close()
        # And Python's own discover takes the offer.
        assert isinstance(await py.discover(capabilities=["disc.nobody"], priority=Priority.CRITICAL), list)


# ---------------------------------------------------------------------------------------------
# Helpers


async def _echo(ctx: Context) -> Any:
    return ctx.data()


def _sleeping(seconds: float) -> Any:
    async def handler(ctx: Context) -> str:
        await asyncio.sleep(seconds)
        return "done"

    return handler


async def customer_acceptance(agent: Agent, to: str, name: str, payload: Any) -> TaskUpdate:
    """The acceptance of a task submitted to ``to``'s ``name``, once the task has ended."""
    handle = await agent.submit(payload, to=to, name=name)
    updates = await asyncio.wait_for(_collect(handle), WAIT)
    (accepted,) = [u for u in updates if u.state is TaskState.ACCEPTED]
    assert isinstance(accepted, TaskUpdate)
    return accepted


async def _collect(handle: Any) -> list[Any]:
    return [u async for u in handle.updates()]

