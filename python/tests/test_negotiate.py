"""Contract-net across languages (docs/PROTOCOL.md section 7.10): a Python requester with Rust
and Python bidders found through discovery, a Rust requester (the interop peer's `negotiate`
command and `chorus negotiate`) with Python and Rust bidders, counter-offers both ways, a round
without proposals, and malformed or late bids. The Rust side is
`agent-sdk/examples/interop_peer/negotiate.rs`."""

from __future__ import annotations

import asyncio
import json
import subprocess
from contextlib import AsyncExitStack
from typing import Any

import nats
import pytest

from chorus_sdk import (
    Agent,
    Answer,
    Bid,
    ChorusError,
    Context,
    CounterOffer,
    Envelope,
    Kind,
    NoAward,
    NoResponders,
    Performative,
    Policy,
    Proposal,
    Refused,
    RoundResult,
    Settlement,
    StatusCode,
    Subjects,
    TaskContext,
    TaskState,
    decode,
    encode,
    encode_payload,
)
from chorus_sdk.credits import Balance, LedgerEntry, balances
from chorus_sdk.negotiate import ROUND_HEADER, bid_subject

from .conftest import ChorusProcess, eventually, py_agent, rust_binary

WAIT = 20.0


def py_bidder(server: Any, id: str, capability: str, price: float | None, rounds: list[str] | None = None, **kw: Any) -> Agent:
    """A Python agent that bids ``price`` for ``capability`` (refusing with 5018 when None) and
    does the work when awarded, noting the round header its task came with in ``rounds``."""
    agent = py_agent(server, id, **kw)

    @agent.bid(capability)
    async def bid(ctx: Context) -> Proposal:
        if price is None:
            raise ChorusError(StatusCode.INVALID_ARGUMENT, "not my field")
        return Proposal.at(price, eta_ms=50, confidence=0.9)

    async def work(task: TaskContext) -> str:
        if rounds is not None:
            rounds.append(task.envelope.headers.get(ROUND_HEADER, ""))
        return f"{task.agent.id} did {json.dumps(task.data())}"

    agent.on_task_capability(capability, work)
    return agent


async def rust_rounds(requester: Agent, peer: str) -> list[dict[str, Any]]:
    """The round outcomes the Rust peer has been told, once it has been told one."""

    async def told() -> Any:
        return await requester.request(peer, "rounds", None)

    return list(await eventually(f"{peer} told of a round", told))


async def test_a_python_requester_awards_a_python_bidder_over_rust_bidders_found_by_discovery(server: Any, rust_peer: Any) -> None:
    coordinator = ChorusProcess(server.url, "serve", CHORUS_SERVE__METRICS_ADDR="127.0.0.1:0")
    try:
        async with AsyncExitStack() as stack:
            requester = await stack.enter_async_context(py_agent(server, "py-requester"))
            settled: asyncio.Queue[Any] = asyncio.Queue()

            @requester.event("negotiation.settled")
            async def on_settled(ctx: Context) -> None:
                await settled.put(Settlement.from_value(ctx.data()))

            async def coordinator_up() -> bool:
                try:
                    await requester.discover(timeout=1.0)
                    return True
                except ChorusError:
                    return False

            await eventually("the coordinator answers", coordinator_up)
            dear = rust_peer("rust-dear", PEER_BID_CAPABILITY="translate", PEER_BID_PRICE="7")
            fair = rust_peer("rust-fair", PEER_BID_CAPABILITY="translate", PEER_BID_PRICE="4", PEER_BID_ETA_MS="20")
            rounds: list[str] = []
            bidder = await stack.enter_async_context(py_bidder(server, "py-cheap", "translate", 3.0, rounds, heartbeat_interval=1.0))
            results = bidder.round_results()
            await requester.flush()

            async def three_holders() -> Any:
                try:
                    found = await requester.discover(capability="translate")
                except ChorusError:
                    return None
                names = {r["manifest"]["agent"] for r in found}
                return names == {dear.id, fair.id, bidder.id}

            await eventually("the three bidders in discovery", three_holders)
            # A capability nobody holds: nobody to ask.
            with pytest.raises(NoResponders):
                await requester.negotiate("nobody.holds.this", "work")
            award = await asyncio.wait_for(requester.negotiate("translate", "bonjour", deadline=2.0), WAIT)

            assert (award.winner, award.proposal.price, award.capability) == ("py-cheap", 3.0, "translate")
            answers = {b.agent: (b.answer, b.proposal and b.proposal.price) for b in award.bids}
            assert answers == {
                "rust-dear": (Answer.PROPOSED, 7.0),
                "rust-fair": (Answer.PROPOSED, 4.0),
                "py-cheap": (Answer.PROPOSED, 3.0),
            }
            fair_bid = next(b for b in award.bids if b.agent == "rust-fair")
            assert fair_bid.proposal is not None and fair_bid.proposal.eta_ms == 20
            # The winner does the work; its task says which round it came from.
            result = await award.task.result(timeout=WAIT)
            assert (result.state, result.worker) == (TaskState.COMPLETED, "py-cheap")
            assert result.data() == 'py-cheap did "bonjour"'
            assert rounds == [str(award.round)]
            # The winner hears it won; the Rust proposers that they lost.
            assert await results.get(timeout=WAIT) == RoundResult(award.round, "translate", True)
            for peer in (dear, fair):
                assert await rust_rounds(requester, peer.id) == [{"round": str(award.round), "capability": "translate", "won": False}]
            # The settlement records what was agreed.
            settlement = await asyncio.wait_for(settled.get(), WAIT)
            assert settlement == Settlement(
                round=award.round,
                capability="translate",
                requester="py-requester",
                winner="py-cheap",
                proposal=Proposal.at(3.0, eta_ms=50, confidence=award.proposal.confidence),
                task=award.task.id,
                asked=3,
                proposals=3,
                refusals=0,
                countered=0,
                credited=True,
            )
            # The price is in the credits ledger, once: recording the round again changes nothing.
            ledger = await requester.ledger()
            entry = await ledger.entry(award.round)
            assert entry is not None
            assert (entry.payer, entry.payee, entry.price, entry.task, entry.customer) == (
                "py-requester", "py-cheap", 3.0, award.task.id, None)
            again = LedgerEntry(entry.round, entry.capability, entry.payer, entry.payee, 99.0, entry.task, entry.settled_ms)
            assert await ledger.record(again) == entry
            assert (await ledger.entry(award.round)) == entry
    finally:
        coordinator.stop()


async def test_a_rust_requester_awards_a_python_bidder_and_so_does_chorus_negotiate(server: Any, rust_peer: Any) -> None:
    requester = rust_peer("rust-requester")
    dear = rust_peer("rust-quoter", PEER_BID_CAPABILITY="quote", PEER_BID_PRICE="6", PEER_BID_ETA_MS="500")
    refuser = rust_peer("rust-busy", PEER_BID_CAPABILITY="quote", PEER_BID_PRICE="refuse")
    rounds: list[str] = []
    async with py_bidder(server, "py-quoter", "quote", 2.5, rounds) as bidder, py_agent(server, "py-late") as late:

        @late.bid("quote")
        async def slow(ctx: Context) -> Proposal:
            # Past the round's deadline: silent, and the late answer is ignored.
            await asyncio.sleep(1.0)
            return Proposal.at(0.1)

        results = bidder.round_results()
        await bidder.flush()
        await late.flush()
        order = {
            "capability": "quote",
            "payload": {"items": 3},
            "bidders": [dear.id, "py-quoter", refuser.id, "py-late", "ghost"],
            "deadline_ms": 500,
            "wait": True,
        }
        round = await bidder.request(requester.id, "negotiate", order, timeout=WAIT)
        assert round["winner"] == "py-quoter"
        assert round["proposal"] == {"price": 2.5, "eta_ms": 50, "confidence": pytest.approx(0.9)}
        assert (round["state"], round["output"]) == ("completed", 'py-quoter did {"items": 3}')
        assert [(b["agent"], b["answer"]) for b in round["bids"]] == [
            ("rust-quoter", "proposed"),
            ("py-quoter", "proposed"),
            ("rust-busy", "refused"),
            ("py-late", "silent"),
            ("ghost", "silent"),
        ]
        assert round["bids"][2]["status"] == StatusCode.UNAVAILABLE
        assert rounds == [round["round"]]
        won = await results.get(timeout=WAIT)
        assert (str(won.round), won.capability, won.won) == (round["round"], "quote", True)
        assert await rust_rounds(bidder, dear.id) == [{"round": round["round"], "capability": "quote", "won": False}]

        # `chorus negotiate`, fastest first: the Python bidder's 50 ms beats the Rust one's 500.
        cli = await asyncio.to_thread(
            subprocess.run,
            [rust_binary("chorus"), "--server", server.url, "negotiate", "--capability", "quote", "--bidders",
             f"{dear.id},py-quoter", "--deadline", "1s", "--policy", "fastest", "--customer", "quote-co", "--wait", "--json",
             '"urgent"'],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stdout + cli.stderr
        printed = json.loads(cli.stdout)
        assert (printed["winner"], printed["state"], printed["output"]) == ("py-quoter", "completed", 'py-quoter did "urgent"')
        assert [b["answer"] for b in printed["bids"]] == ["proposed", "proposed"]
        assert (await results.get(timeout=WAIT)).won

        # The CLI's round is in the credits ledger under its customer, read by `chorus credits`
        # (the Rust SDK) and by the Python SDK alike.
        def credits(*args: str) -> Any:
            run = subprocess.run([rust_binary("chorus"), "--server", server.url, "credits", "--customer", "quote-co",
                                  "--json", *args], capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, run.stdout + run.stderr
            return json.loads(run.stdout)

        by_agent = await asyncio.to_thread(credits)
        earned = {b["name"]: (b["earned"], b["spent"]) for b in by_agent}
        assert earned["py-quoter"] == (2.5, 0.0)
        assert [spent for name, (_, spent) in earned.items() if name.startswith("cli-")] == [2.5]
        assert await asyncio.to_thread(credits, "--by", "customer") == [
            {"name": "quote-co", "earned": 0.0, "spent": 2.5, "rounds": 1}]
        [listed] = await asyncio.to_thread(credits, "--rounds")
        assert (listed["round"], listed["payee"], listed["price"]) == (printed["round"], "py-quoter", 2.5)
        entries = [e for e in await (await bidder.ledger()).entries() if e.customer == "quote-co"]
        assert [(str(e.round), e.payee, e.price) for e in entries] == [(printed["round"], "py-quoter", 2.5)]
        assert balances(entries, "customer") == [Balance("quote-co", spent=2.5, rounds=1)]


async def test_counter_offers_both_ways_are_accepted_refused_or_met_part_way(server: Any, rust_peer: Any) -> None:
    stubborn = rust_peer("rust-stubborn", PEER_BID_CAPABILITY="summarize", PEER_BID_PRICE="5")
    accepting = rust_peer("rust-accepting", PEER_BID_CAPABILITY="summarize", PEER_BID_PRICE="5.5", PEER_COUNTER="accept")
    splitting = rust_peer("rust-splitting", PEER_BID_CAPABILITY="summarize", PEER_BID_PRICE="9", PEER_COUNTER="split")
    offers: list[CounterOffer] = []
    async with AsyncExitStack() as stack:
        py_stubborn = await stack.enter_async_context(py_bidder(server, "py-stubborn", "summarize", 5.0))
        py_accepting = await stack.enter_async_context(py_bidder(server, "py-accepting", "summarize", 5.5))
        py_splitting = await stack.enter_async_context(py_bidder(server, "py-splitting", "summarize", 9.0))

        @py_accepting.counter("summarize")
        async def accept(ctx: Context, offer: CounterOffer) -> Proposal:
            offers.append(offer)
            return offer.offer

        @py_splitting.counter("summarize")
        def split(ctx: Context, offer: CounterOffer) -> Proposal:
            asked, offered = offer.previous.price or 0.0, offer.offer.price or 0.0
            return Proposal.at((asked + offered) / 2)

        requester = await stack.enter_async_context(py_agent(server, "py-haggler"))
        settled: asyncio.Queue[Any] = asyncio.Queue()

        @requester.event("negotiation.settled")
        async def on_settled(ctx: Context) -> None:
            await settled.put(Settlement.from_value(ctx.data()))

        for agent in (py_stubborn, py_accepting, py_splitting, requester):
            await agent.flush()

        def one_less(bid: Any) -> Proposal | None:
            price = bid.proposal.price
            return None if price is None else Proposal.at(price - 1.0)

        # A Python requester counters Rust bidders and a Python one.
        award = await asyncio.wait_for(
            requester.negotiate("summarize", "a long text", bidders=[stubborn.id, accepting.id, "py-splitting"], counter=one_less),
            WAIT,
        )
        assert [(b.agent, b.proposal and b.proposal.price) for b in award.bids] == [
            ("rust-stubborn", 5.0),
            ("rust-accepting", 4.5),
            ("py-splitting", 8.5),
        ]
        assert (award.winner, award.proposal.price, award.countered) == ("rust-accepting", 4.5, 3)
        assert (await award.task.result(timeout=WAIT)).state is TaskState.COMPLETED
        settlement = await asyncio.wait_for(settled.get(), WAIT)
        assert (settlement.winner, settlement.proposal.price, settlement.countered) == ("rust-accepting", 4.5, 3)

        # A Rust requester counters Python bidders and a Rust one: a Python bidder wins.
        round = await requester.request(
            stubborn.id,
            "negotiate",
            {"capability": "summarize", "payload": "another text", "bidders": ["py-stubborn", "py-accepting", splitting.id], "counter_by": 1.0, "wait": True},
            timeout=WAIT,
        )
        assert [(b["agent"], b["proposal"]["price"]) for b in round["bids"]] == [
            ("py-stubborn", 5.0),
            ("py-accepting", 4.5),
            ("rust-splitting", 8.5),
        ]
        assert (round["winner"], round["proposal"]["price"], round["state"]) == ("py-accepting", 4.5, "completed")
        # The Python bidder saw the Rust requester's offer beside its own proposal.
        assert [(o.offer.price, o.previous.price) for o in offers] == [(4.5, 5.5)]
        settlement = await asyncio.wait_for(settled.get(), WAIT)
        assert (settlement.requester, settlement.winner, settlement.countered) == ("rust-stubborn", "py-accepting", 3)


async def test_a_round_without_proposals_awards_nothing_and_says_why_in_both_languages(server: Any, rust_peer: Any) -> None:
    busy = rust_peer("rust-refuser", PEER_BID_CAPABILITY="audit", PEER_BID_PRICE="refuse")
    async with py_bidder(server, "py-refuser", "audit", None) as refuser, py_agent(server, "py-auditor") as requester:
        await refuser.flush()
        with pytest.raises(NoAward) as python_round:
            await requester.negotiate("audit", None, bidders=[busy.id, "py-refuser", "nobody"], deadline=0.3)
        err = python_round.value
        assert isinstance(err, Refused) and err.status == StatusCode.UNAVAILABLE
        assert err.reason == (
            "no proposal for audit was awarded: rust-refuser refused (5019 unavailable), "
            "py-refuser refused (5018 invalid_argument), nobody was silent"
        )
        assert [(b.agent, b.answer, b.status) for b in err.bids] == [
            ("rust-refuser", Answer.REFUSED, 5019),
            ("py-refuser", Answer.REFUSED, 5018),
            ("nobody", Answer.SILENT, None),
        ]

        # The Rust requester says the same of the same answers.
        with pytest.raises(Refused) as rust_round:
            await requester.request(
                busy.id, "negotiate", {"capability": "audit", "bidders": ["py-refuser", "nobody"], "deadline_ms": 300}, timeout=WAIT
            )
        assert rust_round.value.status == StatusCode.UNAVAILABLE
        assert rust_round.value.reason == (
            "no proposal for audit was awarded: py-refuser refused (5018 invalid_argument), nobody was silent"
        )

        # Bad settings are refused before anything is sent.
        for bad in ({"deadline": 0}, {"deadline": float("nan")}, {"policy": "random"}, {"counter_rounds": 0}):
            with pytest.raises(ValueError):
                await requester.negotiate("audit", None, bidders=["py-refuser"], **bad)
        with pytest.raises(ValueError):
            await requester.negotiate("not a capability!", None, bidders=["py-refuser"])
        with pytest.raises(TypeError):
            await requester.negotiate("audit", None, bidders="py-refuser")
        with pytest.raises(ValueError):
            await requester.negotiate("audit", None, bidders=[f"bidder-{i}" for i in range(1001)])


async def malformed_bidder(url: str, agent: str, capability: str) -> Any:
    """A raw NATS client answering calls for proposals as ``agent`` with a proposal whose
    price is a string."""
    nc = await nats.connect(url)

    async def answer(msg: Any) -> None:
        request, encoding = decode(msg.data)
        reply = Envelope.new(Kind.RESPONSE, Performative.INFORM, agent)
        reply.status, reply.in_reply_to, reply.correlation_id = 5002, request.id, request.correlation_id
        reply.to, reply.capability = [request.from_], request.capability
        reply.payload = encode_payload({"price": "cheap"})
        await nc.publish(msg.reply, encode(reply, encoding))

    await nc.subscribe(bid_subject(Subjects(), agent, capability), cb=answer)
    await nc.flush()
    return nc


async def test_a_malformed_bid_is_refused_5006_on_both_sides_and_bad_calls_to_a_bidder_are_refused(server: Any, rust_peer: Any) -> None:
    requester_peer = rust_peer("rust-buyer")
    raw = await malformed_bidder(server.url, "raw-bidder", "label")
    try:
        async with py_bidder(server, "py-labeller", "label", 8.0) as bidder, py_agent(server, "py-buyer") as buyer:
            await bidder.flush()
            award = await asyncio.wait_for(buyer.negotiate("label", "a photo", bidders=["raw-bidder", "py-labeller"], deadline=1.0), WAIT)
            assert award.winner == "py-labeller"
            bad = award.bids[0]
            assert (bad.agent, bad.answer, bad.status) == ("raw-bidder", Answer.REFUSED, StatusCode.DATA_FORMAT)
            assert bad.reason is not None and bad.reason.startswith("the proposal does not decode")

            round = await buyer.request(
                requester_peer.id, "negotiate", {"capability": "label", "bidders": ["raw-bidder", "py-labeller"], "wait": True}, timeout=WAIT
            )
            assert round["winner"] == "py-labeller" and round["state"] == "completed"
            assert (round["bids"][0]["answer"], round["bids"][0]["status"]) == ("refused", StatusCode.DATA_FORMAT)
            assert round["bids"][0]["reason"].startswith("the proposal does not decode")

            # What the bidder refuses on its bid subject: a counter-offer that is no counter-offer
            # (5006, it takes counters), one it takes none of (5016), a performative other than a
            # call for proposals or an outcome (5018).
            subject = bid_subject(buyer.subjects, "py-labeller", "label")

            async def put(performative: Performative, payload: Any) -> int:
                env = Envelope.new(Kind.REQUEST, performative, buyer.id)
                env.to, env.capability = ["py-labeller"], "label"
                buyer.set_payload(env, payload, None)
                try:
                    await buyer.exchange(subject, env, 5.0)
                except Refused as e:
                    return e.status
                return StatusCode.OK

            assert await put(Performative.PROPOSE, {"offer": {"price": 1.0}}) == StatusCode.UNKNOWN_COMMAND
            assert await put(Performative.REQUEST, "work") == StatusCode.INVALID_ARGUMENT

            @bidder.counter("label")
            async def take(ctx: Context, offer: CounterOffer) -> Proposal:
                return offer.offer

            assert await put(Performative.PROPOSE, {"offer": {"price": 1.0}}) == StatusCode.DATA_FORMAT
            assert await put(Performative.PROPOSE, {"offer": {"price": "free"}, "previous": {}}) == StatusCode.DATA_FORMAT
            assert await put(Performative.PROPOSE, {"offer": {"price": 7.0}, "previous": {"price": 8.0}}) == StatusCode.OK

            # A bid handler that returns no proposal fails (5017), as a handler that breaks.
            @bidder.bid("label")
            async def broken(ctx: Context) -> Any:
                return "cheap"

            assert await put(Performative.NEGOTIATE, "a photo") == StatusCode.HANDLER_FAILED
    finally:
        await raw.close()


def test_proposals_validate_and_policies_rank_as_the_rust_sdk() -> None:
    for bad in ({"price": "cheap"}, {"price": float("nan")}, {"price": True}, {"eta_ms": -1}, {"eta_ms": 1.5}, {"confidence": 1.5}, {"terms": b"x"}):
        with pytest.raises(ValueError):
            Proposal(**bad)
    with pytest.raises(ValueError):
        Proposal.from_value([1, 2])
    # The wire form of the spec's vectors 13 and 15 (price a float 64, confidence a float 32).
    proposal = Proposal(price=5.0, eta_ms=120, confidence=0.95)
    assert proposal.encode().hex() == "83a57072696365cb4014000000000000a66574615f6d7378aa636f6e666964656e6365ca3f733333"
    assert CounterOffer(Proposal.at(4.5), proposal).encode().hex().startswith("82a56f66666572")

    def bid(agent: str, price: float | None, eta: int | None, confidence: float | None) -> Bid:
        return Bid(agent, Answer.PROPOSED, Proposal(price=price, eta_ms=eta, confidence=confidence))

    bids = [bid("a", 5.0, 300, 0.5), bid("b", 2.0, None, 0.9), bid("c", None, 100, None), bid("d", 2.0, 200, 0.7)]
    assert Policy.CHEAPEST.rank(bids) == [1, 3, 0, 2]
    assert Policy.FASTEST.rank(bids) == [2, 3, 0, 1]
    assert Policy.MOST_CONFIDENT.rank(bids) == [1, 3, 0, 2]
    assert Policy.pick(lambda bs: len(bs) - 1).rank(bids) == [3, 0, 1, 2]
    assert Policy.pick(lambda bs: None).rank(bids) == []
    assert Policy.pick(lambda bs: 99).rank(bids) == []
