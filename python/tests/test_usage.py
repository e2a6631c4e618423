"""Usage accounting and many agents on one connection, at parity with the Rust SDK (issue 36):
a Python agent counts what it handles per endpoint, kind, customer and session, and the time it
spent handling it (a task's from its acceptance to its end), reports it to the usage stream (a report not stored goes with the next, under the next number), and the
Rust coordinator sums it for `chorus usage`, exactly and the same after it restarts; twenty
Python agents serve on one nats-py connection, and one shutting down leaves it to the rest.
The specification is docs/PROTOCOL.md section 7.13."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import tempfile
from typing import Any

import nats
import pytest

from chorus_sdk import Agent, ChorusError, Context, NoResponders, StatusCode, TaskContext, Timeout, UsageKind, UsageReport
from chorus_sdk.envelope import Envelope, Kind, Performative
from chorus_sdk.usage import MAX_USAGE_ROWS, OVERFLOW, Usage, UsageRow

from .conftest import Coordinator, NatsServer, eventually, py_agent, rust_binary

WAIT = 20.0


# ---------------------------------------------------------------------------------------------
# Counting (no server)


def message(customer: str | None, session: str | None, payload: bytes) -> Envelope:
    env = Envelope.new(Kind.REQUEST, Performative.REQUEST, "caller")
    env.customer_id, env.session_id, env.payload = customer, session, payload
    return env


def test_counts_are_kept_per_key_taken_once_put_back_with_the_next_and_bounded() -> None:
    usage = Usage("calc", "run1", True)
    acme = message("acme", "s1", b"12345")
    usage.record(acme, "add", UsageKind.REQUEST, False, 3, 250)
    usage.record(acme, "add", UsageKind.REQUEST, True, 0, 250)
    usage.record(message(None, None, b""), "add", UsageKind.REQUEST, False, 1, 250)
    first = usage.take()
    assert first is not None and (first.agent, first.seq, first.message_id) == ("calc", 1, "calc-run1-1")
    assert [(r.customer, r.session, r.handled, r.failed, r.bytes_in, r.bytes_out, r.handling_us) for r in first.rows] == [
        ("", "", 1, 0, 0, 1, 250),
        ("acme", "s1", 2, 1, 10, 3, 500),
    ]
    assert usage.take() is None, "taken once"
    # Not stored: merged into the next, which has the next number.
    usage.record(acme, "add", UsageKind.REQUEST, False, 3, 250)
    usage.put_back(first)
    second = usage.take()
    assert second is not None and second.seq == 2 and second.from_ms <= first.from_ms
    assert sum(r.handled for r in second.rows) == 4
    assert sum(r.handling_us for r in second.rows) == 1000, "the time spent is merged too"
    assert UsageReport.decode(second.encode()) == second, "the wire form reads back"
    assert second.to_json()["rows"][0]["handling_us"] == 250

    # A task: counted when accepted, its run's time added to the same row when it ends.
    usage.record(acme, "draft", UsageKind.TASK, False, 0, 100)
    usage.record_run(acme, "draft", 80_000)
    third = usage.take()
    assert third is not None
    [task] = third.rows
    assert (task.endpoint, task.kind, task.customer, task.handled, task.handling_us) == (
        "draft",
        UsageKind.TASK,
        "acme",
        1,
        80_100,
    )

    for i in range(MAX_USAGE_ROWS + 10):
        usage.record(message("acme", f"s{i}", b""), "ping", UsageKind.EVENT, False, 0, 7)
    # A task's run time beyond the bound goes to the overflow row too.
    usage.record_run(message("acme", "late", b""), "ping", 1000)
    bounded = usage.take()
    assert bounded is not None and len(bounded.rows) == MAX_USAGE_ROWS + 2
    overflows = {r.kind: r for r in bounded.rows if r.session == OVERFLOW}
    assert {k: (r.customer, r.handled, r.handling_us) for k, r in overflows.items()} == {
        UsageKind.EVENT: (OVERFLOW, 10, 70),
        UsageKind.TASK: (OVERFLOW, 0, 1000),
    }
    assert sum(r.handled for r in bounded.rows) == MAX_USAGE_ROWS + 10
    assert sum(r.handling_us for r in bounded.rows) == 7 * (MAX_USAGE_ROWS + 10) + 1000, "none lost"
    # A row from an agent that does not time its work reads as none spent.
    assert UsageRow.from_json({"endpoint": "add", "kind": "request", "handled": 1}).handling_us == 0

    off = Usage("calc", "run1", False)
    off.record(acme, "add", UsageKind.REQUEST, False, 3)
    assert off.take() is None, "usage_interval 0: nothing counted"
    with pytest.raises(ValueError):
        Agent("calc", usage_interval=-1)


# ---------------------------------------------------------------------------------------------
# Reports on the bus


async def stored_reports(nc: Any, stream: str) -> list[tuple[str, dict[str, str], UsageReport]]:
    """Every report in ``stream``: its subject, headers and body."""
    js = nc.jetstream()
    try:
        info = await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return []
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        msg = await js.get_msg(stream, seq)
        found.append((msg.subject, dict(msg.headers or {}), UsageReport.decode(msg.data)))
    return found


async def test_a_report_not_stored_goes_with_the_next_under_the_next_number(server: NatsServer, caplog: Any) -> None:
    caplog.set_level(logging.DEBUG, logger="chorus_sdk")
    # A root of its own: no coordinator here, the test makes the stream when it wants it.
    root, stream = "pyusage", "PYUSAGE_USAGE"
    nc = await nats.connect(server.url)
    try:
        async with py_agent(server, "py-usage-retry", root=root, usage_interval=0.1, durable_inbox=False) as calc, py_agent(
            server, "py-usage-retry-caller", root=root
        ) as caller:

            @calc.command("echo")
            async def echo(ctx: Context) -> Any:
                return ctx.data()

            await calc.flush()
            for i in range(3):
                assert await caller.request(calc.id, "echo", i, customer="acme", session="s1") == i
            # No stream yet: the reports are not stored, and kept.
            await eventually("two reports not stored", lambda: _true(calc._usage._seq >= 2), WAIT, 0.05)
            await nc.jetstream().add_stream(name=stream, subjects=[f"{root}.usage.>"], duplicate_window=600.0)
            reports = await eventually("the report stored", lambda: stored_reports(nc, stream), WAIT)
            [(subject, headers, report)] = reports
            assert subject == f"{root}.usage.{calc.id}"
            assert (report.agent, report.instance) == (calc.id, calc.instance)
            assert report.seq >= 3, "the numbers of the reports never stored are not used again"
            assert headers["Nats-Msg-Id"] == f"{calc.id}-{calc.instance}-{report.seq}"
            [row] = report.rows
            assert (row.endpoint, row.kind, row.customer, row.session, row.handled, row.failed) == (
                "echo",
                UsageKind.REQUEST,
                "acme",
                "s1",
                3,
                0,
            ), "all three, in one report"
            first_seq = report.seq
            await caller.request(calc.id, "echo", "x", customer="acme", session="s2")
        # Shut down: what it counted since is in its last report, the next number.
        reports = await stored_reports(nc, stream)
        assert [r.seq for _, _, r in reports] == [first_seq, first_seq + 1]
        last = reports[-1][2]
        assert [(r.session, r.handled) for r in last.rows] == [("s2", 1)]
        await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()
    assert not [r for r in caplog.records if r.exc_info], "an expected failure is a line, not a traceback"


async def _true(value: bool) -> bool:
    return value


async def coordinator_ready(server: NatsServer) -> None:
    """Waits (within a deadline) until the coordinator answers discovery, its streams made."""
    async with py_agent(server, "py-usage-probe", usage_interval=0) as probe:

        async def answers() -> bool:
            try:
                await probe.discover(timeout=1.0)
                return True
            except ChorusError:
                return False

        await eventually("the coordinator", answers, WAIT)


def chorus_usage(server: NatsServer, by: str) -> dict[tuple[str, ...], tuple[int, int, int, int, int]]:
    """`chorus usage --by <by> --json`: (handled, failed, bytes in, bytes out, handling µs) by
    group."""
    with tempfile.TemporaryDirectory(prefix="chorus-usage-") as config:
        env = {k: v for k, v in os.environ.items() if k != "CHORUS_CONTEXT"}
        done = subprocess.run(
            [rust_binary("chorus"), "--server", server.url, "usage", "--by", by, "--since", "10m", "--json"],
            capture_output=True,
            text=True,
            timeout=WAIT,
            env={**env, "CHORUS_CONFIG_DIR": config, "RUST_LOG": "warn"},
        )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    keys = by.split(",")
    return {
        tuple(line["group"][k] for k in keys): (
            line["handled"],
            line["failed"],
            line["bytes_in"],
            line["bytes_out"],
            line["handling_us"],
        )
        for line in summary["lines"]
    }


async def test_usage_is_summed_by_the_coordinator_per_customer_and_session_exactly_after_a_restart(
    server: NatsServer,
) -> None:
    coordinator = Coordinator(server.url)
    try:
        await coordinator_ready(server)
        async with py_agent(server, "py-usage-calc", usage_interval=0.2) as calc, py_agent(
            server, "py-usage-caller"
        ) as caller:

            @calc.command("add")
            async def add(ctx: Context) -> int:
                a, b = ctx.data()
                if a < 0:
                    raise ChorusError(StatusCode.INVALID_ARGUMENT, "negative")
                return int(a + b)

            seen = {"note": 0, "ping": 0}

            @calc.command("note")
            async def note(ctx: Context) -> None:
                seen["note"] += 1

            @calc.event("usage.ping")
            async def ping(ctx: Context) -> None:
                seen["ping"] += 1

            @calc.task("draft")
            async def draft(task: TaskContext) -> str:
                return f"a draft about {task.data()}"

            await calc.flush()
            for i in range(4):
                a = -1 if i == 0 else i
                try:
                    assert await caller.request(calc.id, "add", [a, 2], customer="acme", session="s1") == a + 2
                except ChorusError as e:
                    assert (a, e.status) == (-1, StatusCode.INVALID_ARGUMENT)
            for i in range(2):
                assert await caller.request(calc.id, "add", [i, 2], customer="globex", session="s2") == i + 2
            for _ in range(3):
                await caller.send(calc.id, "note", "hello", customer="acme", session="s1")
            for _ in range(2):
                await caller.publish("usage.ping", "ping")
            task = await caller.submit("usage", to=calc.id, name="draft", customer="acme", session="s1")
            assert (await task.result(timeout=WAIT)).data() == "a draft about usage"
            # All handled before the agent stops: it reports the rest at shutdown.
            await eventually("all handled", lambda: _true(seen == {"note": 3, "ping": 2}), WAIT)

        expected = {("acme", "s1"): (4 + 3 + 1, 1), ("globex", "s2"): (2, 0), ("", ""): (2, 0)}

        def by_session() -> dict[tuple[str, ...], tuple[int, int]]:
            return {k: v[:2] for k, v in chorus_usage(server, "customer,session").items()}

        async def summed() -> bool:
            return await asyncio.to_thread(by_session) == expected

        await eventually("the summary by customer and session", summed, WAIT, 0.5)

        # The coordinator restarts: the sums come from the stream, not its memory.
        coordinator.stop()
        coordinator = Coordinator(server.url)
        await coordinator_ready(server)
        assert await asyncio.to_thread(by_session) == expected
        by_kind = await asyncio.to_thread(chorus_usage, server, "customer,kind")
        assert {k: v[:2] for k, v in by_kind.items()} == {
            ("acme", "request"): (4, 1),
            ("acme", "command"): (3, 0),
            ("acme", "task"): (1, 0),
            ("globex", "request"): (2, 0),
            ("", "event"): (2, 0),
        }
        assert by_kind[("acme", "request")][2] > 0 and by_kind[("acme", "request")][3] > 0, "payload bytes in and out"
        assert by_kind[("", "event")][3] == 0, "an event has no reply"
        assert all(v[4] > 0 for v in by_kind.values()), f"the time spent handling each kind: {by_kind}"
    finally:
        coordinator.stop()


async def test_usage_counts_the_time_spent_handling_each_customers_work() -> None:
    """Agentify's usage tracking counts the time spent per action (``duration``): a request's
    run through the pipeline, and a task's run from its acceptance to its end, summed per
    customer by the Rust coordinator (as the Rust e2e test
    ``usage_counts_the_time_spent_handling_each_customers_work``)."""
    # A server of its own: the other tests' sums stay exact.
    server = NatsServer()
    server.start()
    coordinator = Coordinator(server.url)
    try:
        await coordinator_ready(server)
        async with py_agent(server, "py-usage-timer", usage_interval=0.2) as worker, py_agent(
            server, "py-usage-timer-caller"
        ) as caller:

            @worker.command("slow")
            async def slow(ctx: Context) -> None:
                await asyncio.sleep(0.05)

            @worker.task("brew")
            async def brew(task: TaskContext) -> str:
                await asyncio.sleep(0.08)
                return "brewed"

            await worker.flush()
            for _ in range(3):
                await caller.request(worker.id, "slow", None, customer="initech")
            task = await caller.submit(None, to=worker.id, name="brew", customer="initech")
            assert (await task.result(timeout=WAIT)).data() == "brewed"
        # Shut down: it reported what was left, the task's run time with it.

        async def lines() -> dict[tuple[str, ...], tuple[int, int, int, int, int]] | None:
            by_kind = await asyncio.to_thread(chorus_usage, server, "customer,kind")
            counted = {k: v for k, v in by_kind.items() if k[0] == "initech"}
            done = {k: v[0] for k, v in counted.items()} == {("initech", "request"): 3, ("initech", "task"): 1}
            return counted if done else None

        by_kind = await eventually("the summary by customer and kind", lines, WAIT, 0.5)
        requests, tasks = by_kind[("initech", "request")], by_kind[("initech", "task")]
        # At least the handlers' sleeps; an upper bound only against a unit mix-up (ms for µs).
        assert 150_000 <= requests[4] < 30_000_000, requests
        assert 80_000 <= tasks[4] < 10_000_000, tasks
    finally:
        coordinator.stop()
        server.stop()


# ---------------------------------------------------------------------------------------------
# Many agents on one connection


async def test_twenty_agents_share_one_connection_and_one_leaving_leaves_it_to_the_rest(server: NatsServer) -> None:
    nc = await nats.connect(server.url, name="py-fleet")
    try:
        fleet = [
            Agent(f"py-fleet-{i}", connection=nc, heartbeat_interval=0, durable_inbox=False, usage_interval=0) for i in range(20)
        ]
        heard: list[str] = []
        for agent in fleet:

            async def whoami(ctx: Context, agent: Agent = agent) -> str:
                return agent.id

            agent.on_command("whoami", whoami)

        async def on_ping(ctx: Context) -> None:
            heard.append(ctx.data())

        fleet[3].on_event("fleet.ping", on_ping)
        await asyncio.gather(*(agent.connect() for agent in fleet))
        assert all(agent.nc is nc for agent in fleet), "one connection"
        async with py_agent(server, "py-fleet-caller") as caller:
            answers = await asyncio.gather(*(caller.request(f"py-fleet-{i}", "whoami") for i in range(20)))
            assert answers == [f"py-fleet-{i}" for i in range(20)], "each answers its own command"
            await caller.publish("fleet.ping", "hi")
            await eventually("the event heard on the shared connection", lambda: _true(heard == ["hi"]), WAIT)

            await fleet[7].shutdown()
            assert nc.is_connected and not nc.is_draining, "the shared connection is its owner's"
            # Its subscriptions are gone from the server once the shared connection's
            # unsubscriptions reach it (a loaded machine may take a moment): no responders.
            async def seven_gone() -> bool:
                try:
                    answer = await caller.request("py-fleet-7", "whoami", timeout=2.0)
                except NoResponders:
                    return True
                except Timeout:
                    return False
                raise AssertionError(f"py-fleet-7 answered after its shutdown: {answer!r}")

            await eventually("py-fleet-7's subscriptions gone from the server", seven_gone, WAIT)
            others = [i for i in range(20) if i != 7]
            answers = await asyncio.gather(*(caller.request(f"py-fleet-{i}", "whoami") for i in others))
            assert answers == [f"py-fleet-{i}" for i in others]
            for agent in fleet:
                await agent.shutdown()
            assert nc.is_connected, "still open after the last agent: its owner drains it"
    finally:
        await nc.drain()
