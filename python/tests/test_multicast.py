"""Multicast (section 7.6.1): one call to a list of agents, a request of its own per recipient,
the replies collected (all, the first n, a quorum) within one deadline and reported per
recipient: replied, refused, no responders, silent or not awaited. Both ways between Python
and Rust: a Python multicast to Rust recipients, and the Rust peer's multicast
(``agent-sdk/examples/interop_peer/multicast.rs``) to Python recipients. The collection logic
is tested on its own first.

Every recipient serves ``vote``: its ballot names who refuses (5018) and who answers only
after ``slow_ms``; it answers its id and the copy's id, conversation and ``to``."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import pytest

from chorus_sdk import MAX_MULTICAST_RECIPIENTS, Agent, ChorusError, Collect, Context, MulticastOutcome, MulticastReport, StatusCode
from chorus_sdk.envelope import Envelope, Kind, Performative
from chorus_sdk.multicast import check_multicast, collect_replies
from chorus_sdk.status import NoResponders, Refused, Timeout

from .conftest import py_agent

WAIT = 15.0
#: How long a slow recipient takes; the early returns must come well before it.
SLOW_MS = 3000
EARLY = 2.0

R, F, NR, S, NA = (
    MulticastOutcome.REPLIED,
    MulticastOutcome.REFUSED,
    MulticastOutcome.NO_RESPONDERS,
    MulticastOutcome.SILENT,
    MulticastOutcome.NOT_AWAITED,
)


def outcomes(report: MulticastReport) -> list[tuple[str, MulticastOutcome]]:
    return [(r.agent, r.outcome) for r in report.recipients]


# ---------------------------------------------------------------------------------------------
# The collection on its own


def test_collect_stops_when_it_should() -> None:
    # All: until nothing is pending.
    assert not Collect.all().done(replied=3, pending=1)
    assert Collect.all().done(replied=2, pending=0)
    assert Collect.all().met(4, 4) and not Collect.all().met(3, 4)
    # First n: at n replies; out of reach it still waits for the pending ones.
    assert Collect.first(2).done(replied=2, pending=2)
    assert not Collect.first(2).done(replied=1, pending=3)
    assert not Collect.first(3).done(replied=1, pending=1)
    assert Collect.first(3).done(replied=1, pending=0)
    # Quorum n: at n replies, or as soon as n is out of reach.
    q = Collect.quorum(3)
    assert not q.done(replied=0, pending=4)
    assert not q.done(replied=1, pending=2)
    assert q.done(replied=1, pending=1)
    assert q.done(replied=0, pending=2)
    assert q.done(replied=3, pending=1)
    assert q.met(3, 4) and not q.met(2, 4)
    assert repr(Collect.quorum(2)) == "Collect.quorum(2)" and repr(Collect.all()) == "Collect.all()"


def test_bad_multicasts_are_refused_with_5018() -> None:
    many = [f"a{i}" for i in range(MAX_MULTICAST_RECIPIENTS + 1)]
    cases: list[tuple[Any, str, Collect, Any, str]] = [
        ([], "vote", Collect.all(), None, "no recipients"),
        (["a", "b", "a"], "vote", Collect.all(), None, "recipient a is listed twice"),
        (["a", "b c"], "vote", Collect.all(), None, "agent id"),
        ("ab", "vote", Collect.all(), None, "to is a list of agent ids, not str"),
        (["a"], "vote", Collect.first(0), None, "n must be 1 to the number of recipients (1)"),
        (["a", "b"], "vote", Collect.quorum(3), None, "n must be 1 to the number of recipients (2)"),
        (["a"], "vote", Collect("most", 1), None, "collect 'most': all, first or quorum"),
        (many, "vote", Collect.all(), None, "1001 recipients: at most 1000 are allowed"),
        (["a"], "no.dots", Collect.all(), None, "command name"),
        (["a"], "vote", Collect.all(), uuid.uuid4(), "every copy has an id of its own"),
    ]
    for to, command, collect, id, why in cases:
        with pytest.raises(ChorusError) as refused:
            check_multicast(to, command, collect, id)
        assert refused.value.status == StatusCode.INVALID_ARGUMENT
        assert why in refused.value.reason, (why, refused.value.reason)
    assert check_multicast(("a", "b"), "vote", Collect.quorum(2)) == ["a", "b"]


async def test_the_collection_returns_early_and_leaves_no_copy_running() -> None:
    cancelled: list[str] = []
    reply = Envelope.new(Kind.RESPONSE, Performative.INFORM, "x")

    async def send(agent: str) -> Envelope:
        try:
            if agent.startswith("slow"):
                await asyncio.sleep(30)
            if agent.startswith("refuse"):
                raise Refused(StatusCode.INVALID_ARGUMENT, f"{agent} refuses")
            if agent.startswith("absent"):
                raise NoResponders("nobody")
            if agent.startswith("late"):
                raise Timeout("no reply")
            if agent.startswith("broken"):
                raise RuntimeError("a bug")
            return reply
        except asyncio.CancelledError:
            cancelled.append(agent)
            raise

    mid = uuid.uuid4()
    started = time.monotonic()
    report = await collect_replies(["slow-1", "fast", "slow-2"], send, Collect.first(1), 10.0, mid)
    assert time.monotonic() - started < EARLY
    assert outcomes(report) == [("slow-1", NA), ("fast", R), ("slow-2", NA)]
    assert report.met and report.multicast_id == mid
    assert sorted(cancelled) == ["slow-1", "slow-2"], "every copy still out is cancelled and awaited"

    report = await collect_replies(["fast", "refuse", "absent", "slow"], send, Collect.quorum(3), 10.0, mid)
    assert not report.met and report.elapsed < EARLY
    assert outcomes(report)[1:] == [("refuse", F), ("absent", NR), ("slow", NA)]
    assert report.recipients[1].status == 5018 and report.recipients[1].reason == "refuse refuses"

    report = await collect_replies(["fast", "late", "broken", "slow"], send, Collect.all(), 0.3, mid)
    assert outcomes(report) == [
        ("fast", R),
        ("late", S),
        ("broken", MulticastOutcome.FAILED),
        ("slow", S),
    ]
    assert report.recipients[2].status == StatusCode.INTERNAL
    assert report.counts().silent == 2 and not report.met


# ---------------------------------------------------------------------------------------------
# Through a real server, both ways


def vote_handler(py: Agent) -> None:
    """Serves ``vote`` on ``py`` as the Rust peer does."""

    @py.command("vote")
    async def vote(ctx: Context) -> dict[str, Any]:
        ballot = ctx.data() or {}
        me = py.id
        env = ctx.envelope
        seen = {"agent": me, "id": str(env.id), "conversation": str(env.conversation), "to": list(env.to)}
        if me in ballot.get("slow", []):
            await asyncio.sleep(min(int(ballot.get("slow_ms", 0)), 10_000) / 1000)
        if me in ballot.get("refuse", []):
            raise ChorusError(StatusCode.INVALID_ARGUMENT, f"{me} refuses")
        return seen


def ballot(refuse: list[str] = [], slow: list[str] = []) -> dict[str, Any]:  # noqa: B006 - read only
    return {"refuse": refuse, "slow": slow, "slow_ms": SLOW_MS}


async def test_a_python_multicast_reports_each_rust_recipient(server: Any, rust_peer: Any) -> None:
    a, b, c = (rust_peer(f"rust-mc-{x}").id for x in "abc")
    async with py_agent(server, "py-mc-caller") as py:
        # Every outcome: replied, refused, nobody listening, silent past the deadline.
        report = await asyncio.wait_for(
            py.multicast([a, b, "rust-mc-absent", c], "vote", ballot(refuse=[b], slow=[c]), timeout=1.0),
            WAIT,
        )
        assert outcomes(report) == [(a, R), (b, F), ("rust-mc-absent", NR), (c, S)]
        assert [r.status for r in report.recipients] == [5002, 5018, 5012, 5005]
        assert report.recipients[1].reason == f"{b} refuses"
        assert not report.met and 0.95 <= report.elapsed < EARLY + 1.0
        answer = report.replies()[a]
        # The copy was addressed to its one recipient, in the multicast's conversation.
        assert answer["agent"] == a and answer["to"] == [a]
        assert answer["conversation"] == str(report.multicast_id)
        line = report.outcome(a)
        assert line is not None and line.value() == answer
        counts = report.counts()
        assert (counts.replied, counts.refused, counts.no_responders, counts.silent, counts.not_awaited) == (1, 1, 1, 1, 0)

        # The first reply, without waiting for the slow one.
        report = await asyncio.wait_for(
            py.multicast([c, a], "vote", ballot(slow=[c]), collect=Collect.first(1), timeout=10.0), WAIT
        )
        assert outcomes(report) == [(c, NA), (a, R)] and report.met
        assert report.elapsed < EARLY, report.elapsed

        # A quorum of two of three, the third slow: met at once.
        report = await asyncio.wait_for(
            py.multicast([a, c, b], "vote", ballot(slow=[c]), collect=Collect.quorum(2), timeout=10.0), WAIT
        )
        assert outcomes(report) == [(a, R), (c, NA), (b, R)] and report.met
        assert report.elapsed < EARLY, report.elapsed

        # A quorum of three of four with a refusal and nobody listening: out of reach, not met, at once.
        report = await asyncio.wait_for(
            py.multicast([a, b, "rust-mc-absent", c], "vote", ballot(refuse=[b], slow=[c]), collect=Collect.quorum(3), timeout=10.0),
            WAIT,
        )
        assert not report.met and report.elapsed < EARLY, report.elapsed
        assert outcomes(report)[1:] == [(b, F), ("rust-mc-absent", NR), (c, NA)]
        assert report.recipients[0].outcome in (R, NA)


async def test_a_rust_multicast_collects_python_replies(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-mc-sender")
    async with contextlib.AsyncExitStack() as stack:
        voters = [await stack.enter_async_context(py_agent(server, f"py-mc-{x}")) for x in "abc"]
        for voter in voters:
            vote_handler(voter)
        lead = await stack.enter_async_context(py_agent(server, "py-mc-lead"))

        @lead.command("poll")
        async def poll(ctx: Context) -> dict[str, Any]:
            # A Python handler's multicast, to a Rust and a Python recipient, in its own conversation.
            report = await ctx.multicast([peer.id, "py-mc-a"], "vote", None, timeout=5.0)
            return {"multicast_id": str(report.multicast_id), "answers": report.replies()}

        for a in [*voters, lead]:
            await a.flush()
        a, b, c = (v.id for v in voters)

        order = {
            "to": [a, b, "py-mc-absent", c],
            "command": "vote",
            "payload": ballot(refuse=[b], slow=[c]),
            "collect": "all",
            "timeout_ms": 1000,
        }
        conversation = uuid.uuid4()
        report = await lead.request(peer.id, "multicast", order, timeout=WAIT, id=conversation)
        assert [(r["agent"], r["outcome"], r["status"]) for r in report["recipients"]] == [
            (a, "replied", 5002),
            (b, "refused", 5018),
            ("py-mc-absent", "no_responders", 5012),
            (c, "silent", 5005),
        ]
        assert report["recipients"][1]["reason"] == f"{b} refuses"
        assert report["met"] is False and 950 <= report["elapsed_ms"] < (EARLY + 1.0) * 1000
        assert report["counts"] == {"replied": 1, "refused": 1, "no_responders": 1, "silent": 1, "not_awaited": 0, "failed": 0}
        # The Rust handler's multicast is a forward: its copies are in the request's conversation.
        answer = report["recipients"][0]["answer"]
        assert report["multicast_id"] == str(conversation) == answer["conversation"]
        assert answer["to"] == [a]

        order = {**order, "to": [a, c, b], "payload": ballot(slow=[c]), "collect": "quorum", "n": 2, "timeout_ms": 10_000}
        report = await lead.request(peer.id, "multicast", order, timeout=WAIT)
        assert [(r["agent"], r["outcome"]) for r in report["recipients"]] == [(a, "replied"), (c, "not_awaited"), (b, "replied")]
        assert report["met"] is True and report["elapsed_ms"] < EARLY * 1000

        order = {**order, "to": [c, a], "collect": "first", "n": 1}
        report = await lead.request(peer.id, "multicast", order, timeout=WAIT)
        assert [(r["agent"], r["outcome"]) for r in report["recipients"]] == [(c, "not_awaited"), (a, "replied")]
        assert report["met"] is True and report["elapsed_ms"] < EARLY * 1000

        # The Rust SDK refuses the same bad input with the same code.
        for to, collect, why in [([a, b, a], "all", f"recipient {a} is listed twice"), ([], "all", "no recipients"), ([a], "quorum", "n must be 1")]:
            with pytest.raises(Refused) as refused:
                await lead.request(peer.id, "multicast", {**order, "to": to, "collect": collect, "n": 0}, timeout=WAIT)
            assert refused.value.status == StatusCode.INVALID_ARGUMENT and why in refused.value.reason

        # A Python handler's multicast keeps its conversation, to Rust and Python alike.
        conversation = uuid.uuid4()
        polled = await voters[0].request(lead.id, "poll", None, timeout=WAIT, id=conversation)
        assert polled["multicast_id"] == str(conversation)
        assert sorted(polled["answers"]) == sorted([peer.id, "py-mc-a"])
        assert all(ans["conversation"] == str(conversation) for ans in polled["answers"].values())


async def test_a_bad_python_multicast_sends_nothing(server: Any) -> None:
    async with py_agent(server, "py-mc-x") as voter, py_agent(server, "py-mc-caller-2") as caller:
        seen: list[str] = []

        @voter.command("vote")
        async def vote(ctx: Context) -> None:
            seen.append(str(ctx.envelope.id))

        await voter.flush()
        for to, collect in [([voter.id, voter.id], Collect.all()), ([voter.id], Collect.first(2)), ([], Collect.all())]:
            with pytest.raises(ChorusError) as refused:
                await caller.multicast(to, "vote", None, collect=collect)
            assert refused.value.status == StatusCode.INVALID_ARGUMENT
        with pytest.raises(TypeError):
            await caller.multicast([voter.id], "vote", None, retries=3)  # type: ignore[call-arg]
        report = await asyncio.wait_for(caller.multicast([voter.id], "vote", None, timeout=5.0), WAIT)
        assert report.met and outcomes(report) == [(voter.id, R)]
        assert len(seen) == 1, "only the valid multicast reached the recipient"
