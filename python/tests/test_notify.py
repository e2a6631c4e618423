"""Notifications (section 7.14): a push to one agent, or through the coordinator to each live
member of a group, that expects no reply and needs no topic subscription; durable when asked.
Both ways between Python and Rust: Python notifies the Rust peer
(``agent-sdk/examples/interop_peer/notify.rs``, whose ``notifications`` command lists what it
got), and the peer's ``notify`` command notifies Python agents. The codec of the new kind is
tested on its own first."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import pytest

from chorus_sdk import Agent, Context, NotifyReport, NotifyTarget, StatusCode
from chorus_sdk.codec import Encoding, decode, decode_payload, encode
from chorus_sdk.durable import RetryPolicy
from chorus_sdk.envelope import Delivery, Envelope, Kind, Performative, Priority
from chorus_sdk.notify import DELIVERED, STORED
from chorus_sdk.subjects import NOTIFY_TOKEN, SubjectError, Subjects

from .conftest import Coordinator, eventually, py_agent

SUBJECTS = Subjects("chorus")


# ---------------------------------------------------------------------------------------------
# The kind and its subjects, on their own


def test_the_notification_kind_is_code_7_and_round_trips_in_every_form() -> None:
    assert Kind.NOTIFICATION.code == 7 and Kind.from_code(7) is Kind.NOTIFICATION
    assert Kind.read("notification") is Kind.NOTIFICATION
    env = Envelope.new(Kind.NOTIFICATION, Performative.INFORM, "monitor")
    env.to = ["ops-bot"]
    env.name = "disk-full"
    env.priority = Priority.HIGH
    env.headers = {"x-host": "db-2"}
    subject = SUBJECTS.notification("ops-bot")
    assert subject == "chorus.agent.ops-bot.$notify"
    implied = SUBJECTS.implied(subject)
    for encoding in (Encoding.MSGPACK, Encoding.JSON, Encoding.COMPACT):
        data = encode(env, encoding, implied)
        back, _ = decode(data, implied)
        assert back.kind is Kind.NOTIFICATION, encoding
        # The name is always written: the subject's last token is never a name.
        assert back.name == "disk-full" and back.to == ["ops-bot"], encoding
        assert back.headers == {"x-host": "db-2"} and back.priority is Priority.HIGH
    # In the compact form the kind is its code: key 3 holds 7.
    compact = encode(env, Encoding.COMPACT, implied)
    assert b"\x03\x07" in compact


def test_notification_subjects_sit_under_the_agents_own() -> None:
    assert SUBJECTS.durable_notification("pager", True) == "chorus.inbox.pager.high.$notify"
    assert SUBJECTS.durable_notification("pager", False) == "chorus.inbox.pager.normal.$notify"
    assert SUBJECTS.is_notification("chorus.agent.pager.$notify")
    assert SUBJECTS.is_notification("chorus.inbox.pager.normal.$notify")
    assert not SUBJECTS.is_notification("chorus.agent.pager.notify")
    # The token is no command name: no command can shadow it.
    with pytest.raises(SubjectError):
        SUBJECTS.command("pager", NOTIFY_TOKEN)
    report = NotifyReport.from_broadcast(
        {
            "broadcast_id": "01a2ce8b-d401-7101-8101-010101010101",
            "target": {"type": "group", "name": "night"},
            "recipients": [{"agent": "a", "outcome": "stored", "status": 5002}, {"agent": "b", "outcome": "failed", "status": 5019, "reason": "r"}],
        }
    )
    assert report.count(STORED) == 1 and report.recipient("b") is not None and report.recipient("b").reason == "r"  # type: ignore[union-attr]


async def test_bad_notifications_are_refused_before_anything_is_sent(server: Any) -> None:
    async with py_agent(server, "py-bad") as agent:
        with pytest.raises(SubjectError):
            await agent.notify("ops-bot", "disk full")
        with pytest.raises(SubjectError):
            await agent.notify("ops bot", "disk-full")
        with pytest.raises(SubjectError):
            agent.on_notification("a.b", lambda ctx: None)  # type: ignore[arg-type, return-value]


# ---------------------------------------------------------------------------------------------
# Python to Rust, Rust to Python


async def seen_by(agent: Agent, peer: str, count: int = 1) -> dict[str, Any]:
    """The Rust peer's record of its notifications, once it has ``count``."""

    async def check() -> Any:
        got = await agent.request(peer, "notifications", None)
        return got if len(got["seen"]) >= count else None

    return dict(await eventually(f"{peer} got {count} notification(s)", check))


async def test_python_notifies_rust_without_a_reply_and_an_unhandled_one_is_counted(server: Any, rust_peer: Any) -> None:
    rust_peer("rust-bot")
    rust_peer("rust-deaf", PEER_NOTIFY_HANDLER="none")
    async with py_agent(server, "py-monitor") as monitor:
        report = await monitor.notify(
            "rust-bot",
            "disk-full",
            {"host": "db-2", "used": 0.91},
            priority=Priority.HIGH,
            headers={"x-host": "db-2"},
            session="night-7",
            customer="acme",
        )
        assert [(r.agent, r.outcome, r.status) for r in report.recipients] == [("rust-bot", DELIVERED, 5002)]
        assert monitor.stats.notifications_sent == 1
        got = await seen_by(monitor, "rust-bot")
        (one,) = got["seen"]
        assert one["name"] == "disk-full" and one["from"] == "py-monitor"
        assert one["payload"] == {"host": "db-2", "used": 0.91}
        assert one["headers"] == {"x-host": "db-2"} and one["priority"] == "high"
        assert one["delivery"] == "at_most_once" and one["attempt"] == 1
        assert one["session"] == "night-7" and one["customer"] == "acme"
        assert got["received"] == 1 and got["unhandled"] == 0

        # No handler there: counted and dropped. Sent as a request, it is not answered.
        await monitor.notify("rust-deaf", "disk-full", "x")
        env = Envelope.new(Kind.NOTIFICATION, Performative.INFORM, "py-monitor")
        env.to, env.name = ["rust-deaf"], "cpu-hot"
        subject = SUBJECTS.notification("rust-deaf")
        with pytest.raises(nats.errors.TimeoutError):
            await monitor.nc.request(subject, encode(env, Encoding.MSGPACK), timeout=0.5)

        async def counted() -> Any:
            got = await monitor.request("rust-deaf", "notifications", None)
            return got if got["unhandled"] == 2 else None

        deaf = await eventually("both counted as unhandled", counted)
        assert deaf["received"] == 2 and deaf["seen"] == []


async def test_rust_notifies_python_which_answers_nothing(server: Any, rust_peer: Any) -> None:
    rust_peer("rust-notifier")
    bot = py_agent(server, "py-bot")
    got: asyncio.Queue[tuple[str, Any, dict[str, str], Priority, str, Kind]] = asyncio.Queue()
    other: list[str] = []

    @bot.notification("disk-full")
    async def disk_full(ctx: Context) -> None:
        env = ctx.envelope
        await got.put((env.name or "", ctx.data(), dict(ctx.headers), env.priority, ctx.sender, env.kind))

    async with bot, py_agent(server, "py-caller") as caller:
        report = await caller.request(
            "rust-notifier",
            "notify",
            {"to": "py-bot", "name": "disk-full", "payload": "db-3 at 95%", "headers": {"x-host": "db-3"}, "priority": "critical"},
        )
        assert report["recipients"] == [{"agent": "py-bot", "outcome": "delivered", "status": 5002}]
        name, data, headers, priority, sender, kind = await asyncio.wait_for(got.get(), 15)
        assert (name, data, headers, priority, sender, kind) == ("disk-full", "db-3 at 95%", {"x-host": "db-3"}, Priority.CRITICAL, "rust-notifier", Kind.NOTIFICATION)

        # A name without a handler: counted, dropped, never answered; then a catch-all takes it.
        await caller.request("rust-notifier", "notify", {"to": "py-bot", "name": "cpu-hot", "payload": 92})

        async def unhandled() -> bool:
            return bot.stats.notifications_unhandled == 1

        await eventually("the unhandled notification counted", unhandled)

        @bot.notification()
        async def anything(ctx: Context) -> None:
            other.append(ctx.envelope.name or "")

        await caller.request("rust-notifier", "notify", {"to": "py-bot", "name": "cpu-hot", "payload": 93})

        async def caught() -> bool:
            return other == ["cpu-hot"]

        await eventually("the catch-all took it", caught)
        assert bot.stats.notifications_received == 3
        assert bot.stats.replies_sent == 0


async def test_a_handler_notifies_as_part_of_its_conversation(server: Any) -> None:
    pager = py_agent(server, "py-pager")
    watchdog = py_agent(server, "py-watchdog")
    paged: asyncio.Queue[Any] = asyncio.Queue()

    @pager.notification("page")
    async def page(ctx: Context) -> None:
        await paged.put((ctx.data(), ctx.sender, ctx.envelope))

    @watchdog.command("alarm")
    async def alarm(ctx: Context) -> int:
        report = await ctx.notify("py-pager", "page", f"alarm: {ctx.data()}")
        return sum(1 for r in report.recipients if r.outcome == DELIVERED)

    async with pager, watchdog, py_agent(server, "py-operator") as operator:
        reply = await operator.request("py-watchdog", "alarm", "disk", raw=True)
        assert reply.payload and decode_payload(reply.payload, reply.content_type) == 1
        data, sender, env = await asyncio.wait_for(paged.get(), 15)
        assert (data, sender, env.kind) == ("alarm: disk", "py-watchdog", Kind.NOTIFICATION)
        # The alarm's conversation, one hop on.
        assert env.correlation_id == reply.correlation_id and env.hops == 1


# ---------------------------------------------------------------------------------------------
# Durable, across a restart


async def test_a_durable_notification_waits_for_its_recipient_across_a_restart(server: Any, rust_peer: Any) -> None:
    # The peer is durable: its first start makes the inbox stream.
    pager = rust_peer("rust-pager")
    pager.stop()
    async with py_agent(server, "py-oncall") as oncall:
        report = await oncall.notify("rust-pager", "incident", {"db": "down"}, priority=Priority.HIGH, durable=True)
        assert [(r.agent, r.outcome) for r in report.recipients] == [("rust-pager", STORED)]
        rust_peer("rust-pager")
        got = await seen_by(oncall, "rust-pager")
        (one,) = got["seen"]
        assert one["name"] == "incident" and one["payload"] == {"db": "down"}
        assert one["delivery"] == "at_least_once" and one["priority"] == "high"

        # Rust to a Python agent that is not running: stored, taken when it starts.
        rust_peer("rust-sender")
        report = await oncall.request("rust-sender", "notify", {"to": "py-pager", "name": "incident", "payload": "db-4", "durable": True})
        assert report["recipients"] == [{"agent": "py-pager", "outcome": "stored", "status": 5002}]
    taken: asyncio.Queue[tuple[Any, Delivery, int]] = asyncio.Queue()
    later = py_agent(server, "py-pager")

    @later.notification("incident")
    async def incident(ctx: Context) -> None:
        await taken.put((ctx.data(), ctx.envelope.delivery, ctx.attempt))

    async with later:
        assert await asyncio.wait_for(taken.get(), 15) == ("db-4", Delivery.AT_LEAST_ONCE, 1)


async def test_a_failing_durable_notification_is_retried_then_dead_lettered(server: Any, rust_peer: Any) -> None:
    rust_peer("rust-flaky-sender")
    attempts: list[int] = []
    flaky = py_agent(server, "py-flaky")

    @flaky.notification("fail")
    async def fail(ctx: Context) -> None:
        attempts.append(ctx.attempt)
        raise RuntimeError("the pager service is down")

    async with flaky, py_agent(server, "py-boss") as boss:
        assert flaky._durable is not None
        # A short policy for this agent alone (the published ones are read at start).
        flaky._durable.policies.default = RetryPolicy(max_attempts=2, initial_backoff_ms=50, max_backoff_ms=50, jitter=0.0, retry_on=(int(StatusCode.HANDLER_FAILED),))
        await boss.request("rust-flaky-sender", "notify", {"to": "py-flaky", "name": "fail", "payload": 1, "durable": True})

        async def dead() -> bool:
            return flaky.stats.dead_lettered == 1

        await eventually("the failing notification dead-lettered", dead)
        assert attempts == [1, 2]
        assert flaky.stats.replies_sent == 0


# ---------------------------------------------------------------------------------------------
# A group, through the coordinator


async def test_a_group_notification_reaches_every_live_member_through_the_coordinator(server: Any, rust_peer: Any) -> None:
    coordinator = Coordinator(server.url)
    try:
        got: asyncio.Queue[tuple[str, Any, str, str | None]] = asyncio.Queue()
        member = Agent("py-night", servers=server.url, heartbeat_interval=0.5, groups=["night-shift"])

        @member.notification("maintenance")
        async def maintenance(ctx: Context) -> None:
            await got.put((ctx.envelope.name or "", ctx.data(), ctx.sender, ctx.headers.get("chorus-origin")))

        rust_peer("rust-night", PEER_GROUPS="night-shift")
        async with member, py_agent(server, "py-planner") as planner:

            async def both_live() -> bool:
                try:
                    found = await planner.discover(group="night-shift", timeout=1.0)
                except Exception:  # noqa: BLE001 - the coordinator still starting
                    return False
                return sorted(r["manifest"]["agent"] for r in found) == ["py-night", "rust-night"]

            await eventually("both members registered", both_live)
            report = await planner.notify(NotifyTarget.group("night-shift"), "maintenance", "22:00", headers={"window": "2h"})
            assert [(r.agent, r.outcome) for r in report.recipients] == [("py-night", DELIVERED), ("rust-night", DELIVERED)]
            assert await asyncio.wait_for(got.get(), 15) == ("maintenance", "22:00", "coordinator", "py-planner")
            rust = await seen_by(planner, "rust-night")
            (one,) = rust["seen"]
            assert one["from"] == "coordinator" and one["origin"] == "py-planner"
            assert one["headers"]["window"] == "2h" and one["payload"] == "22:00"

            # The Rust peer's group notification, durable: stored in each member's inbox.
            report2 = await planner.request("rust-night", "notify", {"group": "night-shift", "name": "maintenance", "payload": "23:00", "durable": True})
            assert sorted((r["agent"], r["outcome"]) for r in report2["recipients"]) == [("py-night", "stored"), ("rust-night", "stored")]
            assert await asyncio.wait_for(got.get(), 15) == ("maintenance", "23:00", "coordinator", "rust-night")
            await seen_by(planner, "rust-night", 2)
    finally:
        coordinator.stop()
