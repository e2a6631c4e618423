"""The security layers and outbound guarantees at parity with the Rust SDK, Python to Rust and
Rust to Python on a real nats-server: grants (5007), rate limits (5013), replay protection
that survives a restart (5015), circuit breakers (5019), retried requests with the same id
running an exactly-once handler once, requests dead-lettered when they fail for good,
least-loaded capability routing, and the session and customer carried along. The Rust side is
`agent-sdk/examples/interop_peer/access.rs`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest

from chorus_sdk import (
    Agent,
    BreakerPolicy,
    ChorusError,
    CircuitOpen,
    CircuitState,
    Context,
    Delivery,
    Identity,
    RateLimit,
    Refused,
    RetryPolicy,
    Routing,
    StatusCode,
    Subjects,
    TaskContext,
    TaskState,
    Verifier,
    decode,
    decode_payload,
)

from .conftest import Coordinator, eventually, py_agent, rust_binary

WAIT = 20.0


def seed_file(tmp_path: Path, identity: Identity, name: str) -> str:
    path = tmp_path / f"{name}.seed"
    path.write_text(identity.seed)
    return str(path)


async def peer_call(py: Agent, peer: str, order: dict[str, Any]) -> list[dict[str, Any]]:
    """What the Rust peer's ``call`` command saw, one outcome per call it made."""
    outcomes = await py.request(peer, "call", order, timeout=WAIT)
    assert isinstance(outcomes, list)
    return outcomes


def dead_letters(url: str) -> list[dict[str, Any]]:
    """The dead-letter queue as the Rust CLI reads it."""
    done = subprocess.run(
        [rust_binary("chorus"), "--server", url, "dlq", "ls", "--json"],
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert isinstance(rows, list)
    return rows


async def coordinator_ready(server: Any) -> None:
    """Waits (within a deadline) until the coordinator answers discovery, its streams made."""
    async with py_agent(server, "py-probe") as probe:

        async def answers() -> bool:
            try:
                await probe.discover(timeout=1.0)
                return True
            except ChorusError:
                return False

        await eventually("the coordinator", answers, WAIT)


async def test_grants_refuse_a_sender_without_the_permission_both_ways(server: Any, rust_peer: Any, tmp_path: Path) -> None:
    granted, other = Identity.generate(), Identity.generate()
    py_granted, py_other = Identity.generate(), Identity.generate()
    verifier = Verifier()
    verifier.trust("rust-granted", granted.public_key)
    verifier.trust("rust-other", other.public_key)
    async with py_agent(server, "py-ledger", verifier=verifier, grants={"rust-granted": ["ledger:write"], "py-unsigned": ["ledger:write"]}) as ledger:

        @ledger.command("post")
        async def post(ctx: Context) -> str:
            return f"posted by {ctx.sender}"

        ledger.require("post", ["ledger:write"])
        with pytest.raises(ValueError, match="no command or capability handler"):
            ledger.require("nothing", ["x"])
        await ledger.flush()

        # Rust -> Python: the granted signer is served, the other is refused with 5007 naming
        # what it lacks.
        rust_granted = rust_peer("rust-granted", PEER_SEED=seed_file(tmp_path, granted, "granted"))
        rust_other = rust_peer("rust-other", PEER_SEED=seed_file(tmp_path, other, "other"))
        async with py_agent(server, "py-asker") as asker:
            [ok] = await peer_call(asker, rust_granted.id, {"to": "py-ledger", "command": "post"})
            assert ok["status"] == StatusCode.OK and ok["value"] == "posted by rust-granted"
            [refused] = await peer_call(asker, rust_other.id, {"to": "py-ledger", "command": "post"})
            assert refused["status"] == StatusCode.ACCESS
            assert "rust-other lacks permission ledger:write for post" in refused["error"]
        # A granted name that no signature proves gets nothing.
        async with py_agent(server, "py-unsigned") as unsigned:
            with pytest.raises(Refused) as e:
                await unsigned.request("py-ledger", "post")
            assert e.value.status == StatusCode.ACCESS
            assert "py-unsigned is not verified" in e.value.reason
        # Granted at run time.
        ledger.grant("rust-other", ["ledger:write"])
        async with py_agent(server, "py-asker") as asker:
            [ok] = await peer_call(asker, rust_other.id, {"to": "py-ledger", "command": "post"})
            assert ok["status"] == StatusCode.OK

    # Python -> Rust: the Rust peer requires ledger:write of `guarded` and grants it to one
    # Python signer only.
    bank = rust_peer(
        "rust-bank",
        PEER_TRUST=f"py-granted={py_granted.public_key}",
        PEER_TRUST_MORE=f"py-other={py_other.public_key}",
        PEER_GRANT="py-granted=ledger:write",
    )
    async with py_agent(server, "py-granted", identity=py_granted) as py:
        assert await py.request(bank.id, "guarded") == "posted"
    async with py_agent(server, "py-other", identity=py_other) as py:
        with pytest.raises(Refused) as e:
            await py.request(bank.id, "guarded")
        assert e.value.status == StatusCode.ACCESS
        assert e.value.reason == "py-other lacks permission ledger:write for guarded"


async def test_rate_limits_refuse_with_5013_both_ways(server: Any, rust_peer: Any) -> None:
    # Rust -> Python: two at once, the third refused.
    async with py_agent(server, "py-limited", rate_limit=RateLimit(per_second=0.5, burst=2)) as limited:

        @limited.command("echo")
        async def echo(ctx: Context) -> Any:
            return ctx.data()

        await limited.flush()
        peer = rust_peer("rust-caller")
        async with py_agent(server, "py-asker") as asker:
            outcomes = await peer_call(asker, peer.id, {"to": "py-limited", "command": "echo", "payload": 1, "times": 3})
        assert [o["status"] for o in outcomes] == [StatusCode.OK, StatusCode.OK, StatusCode.RATE_LIMITED]
        assert "rust-caller exceeds 0.5 requests a second" in outcomes[2]["error"]
        with pytest.raises(ValueError):
            RateLimit(per_second=0, burst=1)

    # Python -> Rust.
    limiter = rust_peer("rust-limited", PEER_RATE_LIMIT="0.5,2")
    async with py_agent(server, "py-eager") as eager:
        assert await eager.request(limiter.id, "echo", 1) == 1
        assert await eager.request(limiter.id, "echo", 2) == 2
        with pytest.raises(Refused) as e:
            await eager.request(limiter.id, "echo", 3)
        assert e.value.status == StatusCode.RATE_LIMITED
        assert e.value.reason == "py-eager exceeds 0.5 requests a second"


async def test_a_breaker_opens_after_failures_in_a_row_both_ways(server: Any, rust_peer: Any) -> None:
    # Python -> Rust: two 5019s open the breaker; the third call is refused without being sent,
    # and the next heartbeat announces the open circuit.
    peer = rust_peer("rust-down")
    heartbeats: asyncio.Queue[Any] = asyncio.Queue()
    nc = await nats.connect(server.url)
    try:

        async def on_heartbeat(msg: Any) -> None:
            env, _ = decode(msg.data)
            await heartbeats.put(env)

        await nc.subscribe(Subjects().heartbeat("py-breaker"), cb=on_heartbeat)
        await nc.flush()
        async with py_agent(server, "py-breaker", heartbeat_interval=30, circuit_breaker=BreakerPolicy(failures=2, open_for=30)) as py:
            for _ in range(2):
                with pytest.raises(Refused) as failed:
                    await py.request(peer.id, "unavailable")
                assert failed.value.status == StatusCode.UNAVAILABLE
            assert py.circuit(f"agent:{peer.id}") is CircuitState.OPEN
            with pytest.raises(CircuitOpen) as cut:
                await py.request(peer.id, "unavailable")
            assert cut.value.status == StatusCode.UNAVAILABLE
            assert cut.value.destination == f"agent:{peer.id}"
            assert f"circuit open for agent:{peer.id}" in cut.value.reason
            # Another destination is not affected.
            assert await py.request_capability("interop.upper", "still here") == "STILL HERE"

            async def announced() -> bool:
                while not heartbeats.empty():
                    manifest = (await heartbeats.get()).payload
                    if decode_payload(manifest, "application/msgpack").get("open_circuits") == [f"agent:{peer.id}"]:
                        return True
                return False

            await eventually("open_circuits in a heartbeat", announced, WAIT)
    finally:
        await nc.close()

    # Rust -> Python: the peer's breaker opens on the Python agent's failures.
    runs = []
    async with py_agent(server, "py-down") as down:

        @down.command("down")
        async def fail(ctx: Context) -> None:
            runs.append(ctx.envelope.id)
            raise ChorusError(StatusCode.HANDLER_FAILED, "the disk is full")

        await down.flush()
        breaker = rust_peer("rust-breaker", PEER_BREAKER="2,30000")
        async with py_agent(server, "py-asker") as asker:
            outcomes = await peer_call(asker, breaker.id, {"to": "py-down", "command": "down", "times": 3})
    assert [o["status"] for o in outcomes] == [StatusCode.HANDLER_FAILED, StatusCode.HANDLER_FAILED, StatusCode.UNAVAILABLE]
    assert "circuit open for agent:py-down" in outcomes[2]["error"]
    assert len(runs) == 2, "the third call was never sent"


FAST_RETRY = {"max_attempts": 5, "initial_backoff_ms": 600, "max_backoff_ms": 600, "jitter": 0.0}


async def test_a_retried_request_runs_an_exactly_once_handler_once_both_ways(server: Any, rust_peer: Any) -> None:
    # Python -> Rust: the first attempt times out while the handler runs; the retries carry
    # the same id and the receiver's exactly-once record answers them.
    peer = rust_peer("rust-ledger")
    async with py_agent(server, "py-shop") as shop:
        id = uuid.uuid4()
        reply = await shop.request(
            peer.id,
            "charge",
            {"amount": 42},
            id=id,
            delivery=Delivery.EXACTLY_ONCE,
            timeout=0.15,
            retry=RetryPolicy(**FAST_RETRY),  # type: ignore[arg-type]
            raw=True,
        )
        assert decode_payload(reply.payload, reply.content_type) == "charged 42"
        assert reply.in_reply_to == id, "the same id went again"
        assert await shop.request(peer.id, "runs") == 1, "the handler ran once"
        assert shop.stats.retries >= 1

    # Rust -> Python.
    runs: list[uuid.UUID] = []
    async with py_agent(server, "py-ledger2") as ledger:

        @ledger.command("charge")
        async def charge(ctx: Context) -> str:
            runs.append(ctx.envelope.id)
            if len(runs) == 1:
                await asyncio.sleep(0.4)
            return f"charged {ctx.data()['amount']}"

        await ledger.flush()
        id = uuid.uuid4()
        async with py_agent(server, "py-asker") as asker:
            [outcome] = await peer_call(
                asker,
                peer.id,
                {
                    "to": "py-ledger2",
                    "command": "charge",
                    "payload": {"amount": 7},
                    "id": str(id),
                    "timeout_ms": 150,
                    "exactly_once": True,
                    "retry": FAST_RETRY,
                },
            )
    assert outcome["status"] == StatusCode.OK, outcome
    assert outcome["value"] == "charged 7"
    assert outcome["in_reply_to"] == str(id)
    assert runs == [id], "the handler ran once, for that id"


async def test_a_request_that_fails_for_good_is_dead_lettered_both_ways(server: Any, rust_peer: Any) -> None:
    coordinator = Coordinator(server.url)
    try:
        await coordinator_ready(server)
        peer = rust_peer("rust-refunds")
        policy = {"max_attempts": 3, "initial_backoff_ms": 50, "max_backoff_ms": 50, "jitter": 0.0}
        async with py_agent(server, "py-refunds") as py:

            @py.command("refund")
            async def refund(ctx: Context) -> None:
                raise ChorusError(StatusCode.HANDLER_FAILED, "the bank is down")

            await py.flush()
            # Python -> Rust: retried three times, then the dead-letter queue.
            id = uuid.uuid4()
            with pytest.raises(Refused) as e:
                await py.request(peer.id, "unavailable", 1, id=id, retry=RetryPolicy(**policy), dead_letter=True)  # type: ignore[arg-type]
            assert e.value.status == StatusCode.UNAVAILABLE
            # A failure the policy does not retry is dead-lettered at once, as refused.
            refused_id = uuid.uuid4()
            with pytest.raises(Refused):
                await py.request(peer.id, "fail", 1, id=refused_id, retry=RetryPolicy(**policy), dead_letter=True)  # type: ignore[arg-type]
            # Rust -> Python.
            rust_id = uuid.uuid4()
            [outcome] = await peer_call(
                py,
                peer.id,
                {"to": "py-refunds", "command": "refund", "id": str(rust_id), "retry": policy, "dead_letter": True},
            )
            assert outcome["status"] == StatusCode.HANDLER_FAILED

        async def letters() -> dict[str, dict[str, Any]] | None:
            found = {row["message_id"]: row for row in dead_letters(server.url)}
            wanted = {str(id), str(refused_id), str(rust_id)}
            return found if wanted <= set(found) else None

        found = await eventually("the three dead letters", letters, WAIT)
        python_letter = found[str(id)]
        assert (python_letter["reason"], python_letter["status"], python_letter["attempts"], python_letter["agent"]) == (
            "max_attempts",
            StatusCode.UNAVAILABLE,
            3,
            peer.id,
        )
        assert "down for maintenance" in python_letter["detail"]
        assert found[str(refused_id)]["reason"] == "refused"
        assert found[str(refused_id)]["attempts"] == 1
        rust_letter = found[str(rust_id)]
        assert (rust_letter["reason"], rust_letter["attempts"], rust_letter["agent"]) == ("max_attempts", 3, "py-refunds")
        assert "the bank is down" in rust_letter["detail"]
    finally:
        coordinator.stop()


async def test_capability_calls_go_to_the_least_loaded_holder_both_ways(server: Any, rust_peer: Any) -> None:
    coordinator = Coordinator(server.url)
    try:
        await coordinator_ready(server)
        # A capability of their own: other tests' peers (all holding interop.upper) may still
        # be in the registry until it notices they left.
        a = rust_peer("rust-holder-a", PEER_ROUTE_CAPABILITY="route.rust")
        b = rust_peer("rust-holder-b", PEER_ROUTE_CAPABILITY="route.rust")
        async with py_agent(server, "py-router", capability_routing=Routing.LEAST_LOADED) as py:

            async def both_registered() -> bool:
                holders = {r["manifest"]["agent"] for r in await py.discover(capability="route.rust")}
                return {a.id, b.id} <= holders

            await eventually("both Rust holders in the registry", both_registered, WAIT)
            answered = []
            for i in range(8):
                answered.append(await py.request_capability("route.rust", i))
            # Equal load: the holders take turns, where the queue group picks at random.
            assert set(answered) == {a.id, b.id}
            assert all(answered[i] != answered[i + 1] for i in range(7)), answered

        # Rust -> Python: two Python holders, the Rust caller routing by load.
        holders = [py_agent(server, f"py-holder-{n}", heartbeat_interval=0.5) for n in ("a", "b")]
        for holder in holders:

            @holder.capability("py.route")
            async def route(ctx: Context, holder: Agent = holder) -> str:
                return holder.id

        async with holders[0], holders[1]:
            router = rust_peer("rust-router", PEER_ROUTING="least_loaded")
            async with py_agent(server, "py-asker") as asker:

                async def registered() -> bool:
                    found = {r["manifest"]["agent"] for r in await asker.discover(capability="py.route")}
                    return {"py-holder-a", "py-holder-b"} <= found

                await eventually("both Python holders in the registry", registered, WAIT)
                outcomes = await peer_call(asker, router.id, {"capability": "py.route", "times": 8})
            order = [o["value"] for o in outcomes]
            assert set(order) == {"py-holder-a", "py-holder-b"}
            assert all(order[i] != order[i + 1] for i in range(7)), order
    finally:
        coordinator.stop()


async def test_replay_protection_survives_a_restart_both_ways(server: Any, rust_peer: Any, tmp_path: Path) -> None:
    nc = await nats.connect(server.url)
    try:
        # Rust -> Python: a signed request seen by a Python agent that keeps ids is refused
        # after its restart.
        rust_identity = Identity.generate()
        signer = rust_peer("rust-signer", PEER_SEED=seed_file(tmp_path, rust_identity, "signer"))

        def vault() -> Agent:
            verifier = Verifier(require_signed=True)
            verifier.trust(signer.id, rust_identity.public_key)
            agent = py_agent(server, "py-vault", verifier=verifier, persist_seen_ids=True)

            @agent.command("open")
            async def open_(ctx: Context) -> str:
                return "opened"

            return agent

        copies: asyncio.Queue[bytes] = asyncio.Queue()

        async def copy(msg: Any) -> None:
            await copies.put(msg.data)

        await nc.subscribe("chorus.agent.py-vault.open", cb=copy)
        await nc.flush()
        async with vault():
            async with py_agent(server, "py-asker") as asker:
                [ok] = await peer_call(asker, signer.id, {"to": "py-vault", "command": "open"})
                assert ok["status"] == StatusCode.OK
        signed = await asyncio.wait_for(copies.get(), WAIT)
        async with vault():
            answer = await nc.request("chorus.agent.py-vault.open", signed, timeout=WAIT)
            reply, _ = decode(answer.data)
            assert reply.status == StatusCode.REPLAY
            assert reply.reason is not None and "was already received" in reply.reason

        # Python -> Rust: the same with the Rust peer keeping ids.
        py_identity = Identity.generate()
        env = {"PEER_TRUST": f"py-sender={py_identity.public_key}", "PEER_PERSIST_SEEN": "1"}
        keeper = rust_peer("rust-keeper", **env)
        copies = asyncio.Queue()  # a queue of its own: the replay above was copied too
        await nc.subscribe("chorus.agent.rust-keeper.echo", cb=copy)
        await nc.flush()
        async with py_agent(server, "py-sender", identity=py_identity) as sender:
            assert await sender.request(keeper.id, "echo", "once") == "once"
        signed = await asyncio.wait_for(copies.get(), WAIT)
        keeper.stop()
        keeper = rust_peer("rust-keeper", **env)
        answer = await nc.request("chorus.agent.rust-keeper.echo", signed, timeout=WAIT)
        reply, _ = decode(answer.data)
        assert reply.status == StatusCode.REPLAY, reply.reason
        assert reply.reason is not None and "was already received" in reply.reason
    finally:
        await nc.close()
    with pytest.raises(ValueError, match="persist_seen_ids needs a verifier"):
        Agent("py-nothing", persist_seen_ids=True)


async def test_session_and_customer_travel_along_replies_and_forwards_both_ways(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-context")
    async with py_agent(server, "py-context") as py:

        @py.command("whoami")
        async def whoami(ctx: Context) -> dict[str, Any]:
            return {"session": ctx.session, "customer": ctx.customer}

        await py.flush()
        # Python -> Rust -> Python: the Rust handler saw them, its forward to Python carried
        # them, and each reply carried them back.
        reply = await py.request(
            peer.id,
            "context",
            {"to": "py-context", "command": "whoami"},
            session="chat-7",
            customer="acme",
            raw=True,
        )
        seen = decode_payload(reply.payload, reply.content_type)
        assert (reply.session_id, reply.customer_id) == ("chat-7", "acme")
        assert (seen["session"], seen["customer"]) == ("chat-7", "acme")
        assert seen["reply"] == {"session": "chat-7", "customer": "acme"}
        assert (seen["reply_session"], seen["reply_customer"]) == ("chat-7", "acme")

        # Rust -> Python with the Rust setters.
        [outcome] = await peer_call(py, peer.id, {"to": "py-context", "command": "whoami", "session": "s-2", "customer": "globex"})
        assert outcome["value"] == {"session": "s-2", "customer": "globex"}
        assert (outcome["session"], outcome["customer"]) == ("s-2", "globex")

        # A task submitted for a session keeps it through a Rust worker's handoff to a
        # Python one.
        worked_for: list[tuple[str | None, str | None]] = []

        @py.task("ticket_py")
        async def ticket(task: TaskContext) -> str:
            worked_for.append((task.session, task.customer))
            return f"fixed: {task.data()}"

        await py.flush()
        handle = await py.submit(
            {"to": "py-context", "name": "ticket_py", "context": "printer"},
            to=peer.id,
            name="triage",
            session="s-9",
            customer="initech",
        )
        report = await asyncio.wait_for(handle.result(), WAIT)
        assert report.state is TaskState.COMPLETED, report
        assert worked_for == [("s-9", "initech")]

        # `chorus tap` shows them.
        tap = subprocess.Popen(
            [rust_binary("chorus"), "--server", server.url, "tap", "agent.rust-context.echo", "--json", "--count", "1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:

            async def tapped() -> str | None:
                await py.request(peer.id, "echo", "hi", session="s-3", customer="umbrella")
                return None if tap.poll() is None else tap.communicate(timeout=WAIT)[0]

            line = json.loads(await eventually("chorus tap's line", tapped, WAIT))
        finally:
            tap.kill()
            tap.wait()
        assert (line["session_id"], line["customer_id"]) == ("s-3", "umbrella")


@pytest.mark.parametrize("persist", [False, True])
async def test_a_signed_durable_command_that_fails_twice_is_retried_not_refused_as_a_replay(server: Any, persist: bool) -> None:
    """A redelivery of the same stored message is not a replay (SECURITY.md): a signed durable
    command to an agent that requires signatures, whose handler fails twice and then
    succeeds, runs three times and is acknowledged, with no refusal and no dead letter; with
    ``persist_seen_ids`` too."""
    shop = Identity.generate()
    verifier = Verifier(require_signed=True)
    verifier.trust("py-shop", shop.public_key)
    worker_id = "py-payments-kept" if persist else "py-payments"
    attempts: list[int] = []
    worker = py_agent(server, worker_id, verifier=verifier, persist_seen_ids=persist)

    @worker.command("charge")
    async def charge(ctx: Context) -> int:
        attempts.append(ctx.attempt)
        if len(attempts) <= 2:
            raise RuntimeError("the card service is down")
        return int(ctx.data())

    async with worker, py_agent(server, "py-shop", identity=shop) as sender:
        assert worker._durable is not None
        # A short policy for this agent alone (the published ones are read at start).
        worker._durable.policies.default = RetryPolicy(
            max_attempts=5, initial_backoff_ms=50, max_backoff_ms=50, jitter=0.0, retry_on=(int(StatusCode.HANDLER_FAILED),)
        )
        await sender.send(worker_id, "charge", 4200, delivery=Delivery.AT_LEAST_ONCE)

        async def third() -> bool:
            return len(attempts) >= 3

        await eventually("the third attempt", third, WAIT)
        assert attempts == [1, 2, 3]
        assert worker.stats.security_refused == 0
        assert worker.stats.dead_lettered == 0


async def test_a_signed_dead_letter_replayed_by_a_trusted_operator_is_handled_once(server: Any, tmp_path: Path) -> None:
    """An operator's replay of a signed dead letter (PROTOCOL.md, "Replaying a signed dead
    letter"), as SECURITY.md's walk-through does it: ``chorus --id ops --nkey-file ops.seed dlq
    replay ID`` signs the replay, and a Python agent that requires signatures and trusts ops's
    key by hand handles it once, as from its original sender. Replayed by an id it does not
    trust, the letter is refused (5004) and dead-lettered again, the handler not run; replayed
    by ops a second time, refused as a replay (5015)."""
    shop, ops, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    verifier = Verifier(require_signed=True)
    verifier.trust("py-shop", shop.public_key)
    verifier.trust("ops", ops.public_key)
    broken = True
    senders: list[str] = []
    worker = py_agent(server, "py-ledger", verifier=verifier, persist_seen_ids=True)

    @worker.command("charge")
    async def charge(ctx: Context) -> int:
        if broken:
            raise RuntimeError("the card service is down")
        senders.append(ctx.sender)
        return int(ctx.data())

    def replay(by: str, identity: Identity, letter: int) -> str:
        done = subprocess.run(
            [rust_binary("chorus"), "--server", server.url, "--id", by, "--nkey-file", seed_file(tmp_path, identity, by),
             "dlq", "replay", str(letter)],
            capture_output=True, text=True, timeout=WAIT,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def letters_for(status: int | None = None) -> list[dict[str, Any]]:
        return [row for row in dead_letters(server.url)
                if row["agent"] == "py-ledger" and (status is None or row["status"] == status)]

    async with worker, py_agent(server, "py-shop", identity=shop) as sender:
        assert worker._durable is not None
        worker._durable.policies.default = RetryPolicy(
            max_attempts=2, initial_backoff_ms=50, max_backoff_ms=50, jitter=0.0, retry_on=(int(StatusCode.HANDLER_FAILED),)
        )
        await sender.send("py-ledger", "charge", 4200, delivery=Delivery.AT_LEAST_ONCE)

        async def dead_lettered(status: int | None = None) -> dict[str, Any] | None:
            rows = await asyncio.to_thread(letters_for, status)
            return rows[-1] if rows else None

        first = await eventually("the dead letter", dead_lettered, WAIT)
        broken = False
        replay("mallory", mallory, first["id"])

        async def refused_5004() -> dict[str, Any] | None:
            return await dead_lettered(int(StatusCode.IDENTITY))

        refused = await eventually("mallory's replay refused", refused_5004, WAIT)
        assert "replays are accepted only from senders trusted here" in refused["detail"], refused
        assert senders == []
        js = sender.nc.jetstream()
        original_bytes = (await js.get_msg("CHORUS_DLQ", refused["id"])).data
        assert original_bytes
        replay("ops", ops, refused["id"])

        async def handled() -> bool:
            return len(senders) == 1

        await eventually("the operator's replay handled", handled, WAIT)
        assert senders == ["py-shop"]
        # The same dead letter replayed once more, signed afresh by ops (the letter's bytes as
        # the queue kept them): refused as a replay, the handler not run again.
        from chorus_sdk.envelope import now_ms
        from chorus_sdk.replay import ReplayProof

        of = f"CHORUS_DLQ:{refused['id']}"
        proof = ReplayProof.sign(ops, "ops", refused["subject"], uuid.UUID(refused["message_id"]), of, now_ms())
        await js.publish(refused["subject"], original_bytes, headers={**proof.headers(), "Nats-Msg-Id": "again"})

        async def refused_5015() -> dict[str, Any] | None:
            return await dead_lettered(int(StatusCode.REPLAY))

        again = await eventually("the second replay refused", refused_5015, WAIT)
        assert "replayed here already" in again["detail"], again
        assert senders == ["py-shop"]


async def test_a_forged_wire_announcement_is_ignored_where_the_coordinators_key_is_known(server: Any) -> None:
    """The coordinator's announcements on ``sys.wire`` are its word only when signed with its
    key, where an agent verifies signatures and knows that key (as in Rust): a forged unsigned
    one switching the bus to protocol 2 is ignored and counted; the same signed with the
    coordinator's key is followed."""
    from chorus_sdk.codec import Encoding, encode, encode_payload, sniff
    from chorus_sdk.envelope import CONTENT_TYPE_MSGPACK, Envelope, Kind, Performative, now_ms, uuid7

    coordinator = Identity.generate()
    verifier = Verifier()
    verifier.trust("coordinator", coordinator.public_key)
    nc = await nats.connect(server.url)
    forms: asyncio.Queue[Encoding | None] = asyncio.Queue()

    async def probe(msg: Any) -> None:
        await forms.put(sniff(msg.data))

    await nc.subscribe("chorus.evt.probe", cb=probe)
    await nc.flush()

    async def announce(signed: bool) -> None:
        env = Envelope(id=uuid7(), from_="coordinator", kind=Kind.EVENT, performative=Performative.INFORM, timestamp_ms=now_ms())
        env.payload = encode_payload({"major": 2}, CONTENT_TYPE_MSGPACK)
        env.content_type = CONTENT_TYPE_MSGPACK
        if signed:
            coordinator.sign("chorus.sys.wire", env)
        await nc.publish("chorus.sys.wire", encode(env, Encoding.MSGPACK))
        await nc.flush()

    try:
        async with py_agent(server, "py-follower", verifier=verifier) as agent:

            async def form_now() -> Encoding | None:
                await agent.publish("probe", 1)
                return await asyncio.wait_for(forms.get(), WAIT)

            assert await form_now() is Encoding.MSGPACK
            await announce(signed=False)

            async def counted() -> bool:
                return agent.stats.security_refused >= 1

            await eventually("the forgery counted", counted, WAIT)
            assert await form_now() is Encoding.MSGPACK, "a forged announcement switched the form"
            await announce(signed=True)

            async def followed() -> bool:
                return await form_now() is Encoding.COMPACT

            await eventually("the coordinator's signed word followed", followed, WAIT)
            assert agent.stats.security_refused == 1
    finally:
        await nc.close()


async def test_a_strangers_cancel_is_ignored_and_the_requesters_stops_the_task(server: Any) -> None:
    """A task's cancel counts only from its requester (or the agent working on it, or the
    bus's own agents), as in Rust: a stranger's cancel on the task's subject is ignored and
    counted, and the requester's stops it."""
    from chorus_sdk import TaskContext, TaskState
    from chorus_sdk.codec import Encoding, encode
    from chorus_sdk.envelope import Envelope, Kind, Performative, now_ms, uuid7

    started = asyncio.Event()
    stopped: list[str] = []
    async with py_agent(server, "py-slow") as worker, py_agent(server, "py-boss") as boss:

        @worker.task("wait")
        async def wait(task: TaskContext) -> None:
            started.set()
            stopped.append(await task.cancelled())

        await worker.flush()
        handle = await boss.submit(None, to="py-slow", name="wait")
        await asyncio.wait_for(started.wait(), WAIT)
        nc = await nats.connect(server.url)
        try:
            forged = Envelope(id=uuid7(), from_="mallory", kind=Kind.COMMAND, performative=Performative.CANCEL, timestamp_ms=now_ms())
            await nc.publish(f"chorus.task.{handle.id}.cancel", encode(forged, Encoding.MSGPACK))
            await nc.flush()
        finally:
            await nc.close()

        async def counted() -> bool:
            return worker.stats.security_refused >= 1

        await eventually("the stranger's cancel counted", counted, WAIT)
        assert stopped == [], "a stranger cancelled the task"
        report = await asyncio.wait_for(handle.cancel(), WAIT)
        assert report.state is TaskState.CANCELLED
        assert stopped == ["cancelled"]
