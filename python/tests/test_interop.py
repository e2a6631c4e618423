"""Python and Rust agents on one bus, every message kind both ways: requests and their errors,
capabilities, events, durable commands (across a Python agent's restart), signed messages, and
the `chorus` CLI asking a Python agent. The Rust side is `agent-sdk/examples/interop_peer/`."""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import pytest

import nats

from chorus_sdk import Agent, ChorusError, Context, Delivery, Encoding, EncryptionKey, Identity, StatusCode, Verifier, decode

from .conftest import Coordinator, eventually, py_agent, rust_binary

WAIT = 15.0

ENCODINGS = {"msgpack": Encoding.MSGPACK, "json": Encoding.JSON, "compact": Encoding.COMPACT}


@pytest.mark.parametrize("rust_encoding", list(ENCODINGS))
async def test_requests_both_ways_in_every_pair_of_encodings(server: Any, rust_peer: Any, rust_encoding: str) -> None:
    peer = rust_peer(f"rust-{rust_encoding}", PEER_ENCODING=rust_encoding)
    for py_encoding in Encoding:
        seen: list[Any] = []
        async with py_agent(server, f"py-{py_encoding.value}", encoding=py_encoding) as py:

            @py.command("shout")
            async def shout(ctx: Context) -> str:
                seen.append(ctx.envelope)
                text = ctx.data()
                if text == "":
                    raise ChorusError(StatusCode.INVALID_ARGUMENT, "nothing to shout")
                return str(text).upper() + "!"

            # Python -> Rust: a request, an error with its code, a capability.
            value = {"n": 7, "list": [1, 2.5, "three"], "nested": {"ok": True}}
            assert await py.request(peer.id, "echo", value) == value
            with pytest.raises(ChorusError) as failed:
                await py.request(peer.id, "fail", None)
            assert failed.value.status == StatusCode.INVALID_ARGUMENT
            assert failed.value.reason == "asked to fail"
            assert await py.request_capability("interop.upper", "quiet") == "QUIET"
            assert await py.request_capability("interop.upper", "mine", at=peer.id) == "MINE"

            # Rust -> Python: the peer asks the Python agent (a forward of this request).
            answer = await py.request(peer.id, "ask", {"to": py.id, "command": "shout", "payload": "hello"})
            assert answer == "HELLO!"
            forwarded = seen[-1]
            assert forwarded.from_ == peer.id
            assert forwarded.hops == 1
            with pytest.raises(ChorusError) as refused:
                await py.request(peer.id, "ask", {"to": py.id, "command": "shout", "payload": ""})
            assert refused.value.status == StatusCode.INVALID_ARGUMENT
            assert refused.value.reason == "nothing to shout"
            with pytest.raises(ChorusError) as unknown:
                await py.request(peer.id, "ask", {"to": py.id, "command": "whisper", "payload": "x"})
            assert unknown.value.status == StatusCode.UNKNOWN_COMMAND


async def test_events_both_ways(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-events")
    pongs: asyncio.Queue[Any] = asyncio.Queue()
    recorded: asyncio.Queue[Any] = asyncio.Queue()
    async with py_agent(server, "py-events", encoding=Encoding.COMPACT) as py:

        @py.event("interop.pong")
        async def on_pong(ctx: Context) -> None:
            await pongs.put((ctx.sender, ctx.data()))

        @py.event("interop.from-rust.>")
        async def on_rust(ctx: Context) -> None:
            await recorded.put((ctx.sender, ctx.envelope.topic, ctx.data()))

        await py.flush()
        # Python -> Rust: the peer answers a ping with a pong naming the Python sender.
        await py.publish("interop.ping.one", {"k": "v"})
        sender, pong = await asyncio.wait_for(pongs.get(), WAIT)
        assert sender == peer.id
        assert pong == {"from": "py-events", "topic": "interop.ping.one", "payload": {"k": "v"}}
        # Rust -> Python: the peer publishes what it is told to.
        await py.request(peer.id, "emit", {"topic": "interop.from-rust.a", "payload": [1, 2, 3]})
        assert await asyncio.wait_for(recorded.get(), WAIT) == (peer.id, "interop.from-rust.a", [1, 2, 3])
        assert py.stats.lost == 0


async def test_durable_commands_both_ways_and_across_a_python_restart(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-durable")
    recorded: asyncio.Queue[Any] = asyncio.Queue()
    async with py_agent(server, "py-sender") as sender:

        @sender.event("interop.recorded")
        async def on_recorded(ctx: Context) -> None:
            await recorded.put(ctx.data())

        await sender.flush()
        # Python -> Rust: stored in the peer's inbox, handled, acked.
        for delivery in (Delivery.AT_LEAST_ONCE, Delivery.EXACTLY_ONCE):
            seq = await sender.send(peer.id, "record", {"class": delivery.value}, delivery=delivery)
            assert seq > 0
            got = await asyncio.wait_for(recorded.get(), WAIT)
            assert got == {"payload": {"class": delivery.value}, "attempt": 1, "from": "py-sender"}

        # Rust -> Python while the Python agent is away: stored, then handled when it is back.
        handled: asyncio.Queue[Any] = asyncio.Queue()

        def worker() -> Agent:
            w = py_agent(server, "py-worker")

            @w.command("post")
            async def post(ctx: Context) -> None:
                await handled.put((ctx.sender, ctx.data(), ctx.attempt))

            return w

        first = worker()
        await first.connect()  # creates its durable consumers
        await first.shutdown()
        stored = await sender.request(peer.id, "send", {"to": "py-worker", "command": "post", "payload": {"amount": 12}})
        assert stored["stored"] > 0
        assert handled.empty()
        async with worker():
            assert await asyncio.wait_for(handled.get(), WAIT) == (peer.id, {"amount": 12}, 1)


async def test_a_failing_durable_command_is_retried_then_dead_lettered(server: Any, rust_peer: Any) -> None:
    rust_peer("rust-dlq")  # provides the inbox and dead-letter streams
    attempts: list[int] = []
    async with py_agent(server, "py-flaky") as flaky:

        @flaky.command("flaky")
        async def fails(ctx: Context) -> None:
            attempts.append(ctx.attempt)
            raise ChorusError(StatusCode.UNAVAILABLE, "not now")

        @flaky.command("poison")
        async def poison(ctx: Context) -> None:
            raise ChorusError(StatusCode.INVALID_ARGUMENT, "never")

        await flaky.flush()
        flaky._durable.policies.default.initial_backoff_ms = 20  # type: ignore[union-attr]
        await flaky.send("py-flaky", "flaky", {"x": 1})
        await flaky.send("py-flaky", "poison", {"x": 2})
        js = flaky.nc.jetstream()
        deadline = asyncio.get_running_loop().time() + WAIT
        while flaky.stats.dead_lettered < 2:
            assert asyncio.get_running_loop().time() < deadline, flaky.stats
            await asyncio.sleep(0.05)
        assert attempts == [1, 2, 3, 4, 5]
        info = await js.stream_info("CHORUS_DLQ")
        assert info.state.messages == 2
        max_attempts = await js.get_last_msg("CHORUS_DLQ", "chorus.dlq.max_attempts.py-flaky")
        refused = await js.get_last_msg("CHORUS_DLQ", "chorus.dlq.refused.py-flaky")
        assert max_attempts.headers and max_attempts.headers["Chorus-Dlq-Status"] == "5019"
        assert max_attempts.headers["Chorus-Dlq-Attempts"] == "5"
        assert refused.headers and refused.headers["Chorus-Dlq-Status"] == "5018"
        assert refused.headers["Chorus-Dlq-Detail"] == "never"


async def test_signed_messages_both_ways_and_unsigned_ones_refused(server: Any, rust_peer: Any, tmp_path: Any) -> None:
    rust_identity = Identity.generate()
    py_identity = Identity.generate()
    seed = tmp_path / "rust.seed"
    seed.write_text(rust_identity.seed)
    peer = rust_peer("rust-signed", PEER_SEED=str(seed), PEER_TRUST=f"py-signed={py_identity.public_key}")
    verifier = Verifier(require_signed=True)
    verifier.trust(peer.id, rust_identity.public_key)
    async with py_agent(server, "py-signed", identity=py_identity, verifier=verifier) as py:

        @py.command("shout")
        async def shout(ctx: Context) -> str:
            assert ctx.envelope.signature is not None
            return str(ctx.data()).upper()

        # Python signs, Rust verifies; Rust signs its reply and its forward, Python verifies both.
        assert await py.request(peer.id, "echo", "signed") == "signed"
        assert await py.request(peer.id, "ask", {"to": py.id, "command": "shout", "payload": "hi"}) == "HI"

    # The peer refuses an unsigned sender, and one whose key it does not know.
    async with py_agent(server, "py-unsigned") as unsigned:
        with pytest.raises(ChorusError) as refused:
            await unsigned.request(peer.id, "echo", "x")
        assert refused.value.status == StatusCode.UNAUTHORIZED
    async with py_agent(server, "py-signed", identity=Identity.generate()) as impostor:
        with pytest.raises(ChorusError) as refused:
            await impostor.request(peer.id, "echo", "x")
        assert refused.value.status == StatusCode.IDENTITY


async def test_the_chorus_cli_asks_a_python_agent(server: Any) -> None:
    async with py_agent(server, "py-cli") as py:

        @py.command("add")
        async def add(ctx: Context) -> float:
            args = ctx.data()
            return float(sum(args["operands"]))

        await py.flush()
        cli = await asyncio.to_thread(
            subprocess.run,
            [rust_binary("chorus"), "--server", server.url, "request", "--to", "py-cli", "--command", "add", "--json", '{"operands":[2,3]}'],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert cli.returncode == 0, cli.stderr
        reply = json.loads(cli.stdout)
        assert reply["status"] == 5002 and reply["payload"] == 5.0 and reply["from"] == "py-cli"


async def test_the_coordinator_registers_discovers_and_broadcasts_to_python_agents(server: Any) -> None:
    coordinator = Coordinator(server.url)
    try:
        registry: asyncio.Queue[Any] = asyncio.Queue()
        async with py_agent(server, "py-watcher") as watcher:

            @watcher.event("registry.>")
            async def on_registry(ctx: Context) -> None:
                await registry.put((ctx.envelope.topic, ctx.envelope.status, ctx.data()))

            await watcher.flush()
            member = Agent("py-member", servers=server.url, heartbeat_interval=0.2, groups=["py-group"])
            pinged: list[Any] = []

            @member.command("ping")
            async def ping(ctx: Context) -> str:
                pinged.append(ctx.data())
                return "pong"

            @member.capability("py.analysis")
            async def analyse(ctx: Context) -> str:
                return "analysed"

            async with member:

                async def found() -> Any:
                    try:
                        return [r for r in await watcher.discover(capability="py.analysis") if r["manifest"]["agent"] == "py-member"]
                    except ChorusError:
                        return None

                records = await eventually("py-member in discovery", found)
                manifest = records[0]["manifest"]
                assert manifest["capabilities"] == [{"name": "py.analysis", "version": ""}]
                assert manifest["commands"] == ["ping"] and manifest["groups"] == ["py-group"]
                assert manifest["wire_versions"] == [1, 2]

                report = await watcher.broadcast("ping", "all of you", group="py-group", timeout=2.0)
                outcomes = {r["agent"]: r["outcome"] for r in report["recipients"]}
                assert outcomes == {"py-member": "delivered"}, report
                assert pinged == ["all of you"]

            # Its goodbye: the registry says it left in good order (5003).
            async def left() -> Any:
                while not registry.empty():
                    topic, status, data = registry.get_nowait()
                    if topic == "registry.left" and data.get("agent") == "py-member":
                        return status
                return None

            assert await eventually("registry.left for py-member", left) == StatusCode.DISCONNECTED
    finally:
        coordinator.stop()


async def test_encrypted_payloads_both_ways(server: Any, rust_peer: Any) -> None:
    py_key, rust_key = EncryptionKey.generate(), EncryptionKey.generate()
    peer = rust_peer(
        "rust-sealed",
        PEER_ENCRYPTION_SECRET=rust_key.secret,
        PEER_TRUST_ENCRYPTION=f"py-sealed={py_key.public_key}",
    )
    whispered: list[Any] = []
    async with py_agent(server, "py-sealed", encryption_key=py_key) as py:
        py.trust_encryption(peer.id, rust_key.public_key)

        @py.command("whisper")
        async def whisper(ctx: Context) -> str:
            whispered.append(ctx.data())
            return "heard"

        # What crosses the bus to the Python agent is ciphertext.
        tap = await nats.connect(server.url)
        seen: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_tap(msg: Any) -> None:
            await seen.put(msg.data)

        await tap.subscribe("chorus.agent.py-sealed.whisper", cb=on_tap)
        await tap.flush()
        await py.flush()
        try:
            # Python -> Rust: the Rust peer opens it and echoes the plaintext.
            assert await py.request(peer.id, "echo", {"card": "4111"}, encrypt_for=[peer.id]) == {"card": "4111"}
            # Rust -> Python: the peer encrypts for the Python agent, which opens it.
            answer = await py.request(peer.id, "ask_sealed", {"to": py.id, "command": "whisper", "payload": "the launch code"})
            assert answer == "heard" and whispered == ["the launch code"]
            sealed = decode(await asyncio.wait_for(seen.get(), WAIT))[0]
            assert sealed.content_type == "application/chorus-encrypted" and sealed.encryption is not None
            assert b"launch" not in sealed.payload
        finally:
            await tap.close()

        # An agent without a key refuses an encrypted payload (5007), unopened.
        async with py_agent(server, "py-keyless") as keyless:

            @keyless.command("whisper")
            async def keyless_whisper(ctx: Context) -> str:
                return "should not run"

            await keyless.flush()
            py.trust_encryption("py-keyless", EncryptionKey.generate().public_key)
            with pytest.raises(ChorusError) as refused:
                await py.request("py-keyless", "whisper", "x", encrypt_for=["py-keyless"])
            assert refused.value.status == StatusCode.ACCESS


async def test_core_commands_without_a_reply_both_ways(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-core-commands")
    recorded: asyncio.Queue[Any] = asyncio.Queue()
    noted: asyncio.Queue[Any] = asyncio.Queue()
    async with py_agent(server, "py-commander") as py:

        @py.event("interop.recorded")
        async def on_recorded(ctx: Context) -> None:
            await recorded.put(ctx.data())

        @py.command("note")
        async def note(ctx: Context) -> None:
            await noted.put((ctx.sender, ctx.envelope.kind.value, ctx.data()))

        await py.flush()
        # Python -> Rust: an at-most-once command, published to the command subject, no reply.
        assert await py.send(peer.id, "record", {"core": True}, delivery=Delivery.AT_MOST_ONCE) == 0
        assert await asyncio.wait_for(recorded.get(), WAIT) == {"payload": {"core": True}, "attempt": 1, "from": py.id}
        # Rust -> Python: the same the other way.
        sent = await py.request(peer.id, "send", {"to": py.id, "command": "note", "payload": 7, "delivery": "at_most_once"})
        assert sent == {"stored": None}
        assert await asyncio.wait_for(noted.get(), WAIT) == (peer.id, "command", 7)
