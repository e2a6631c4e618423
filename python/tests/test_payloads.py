"""Large payloads (docs/PROTOCOL.md section 7.11) between Python and Rust agents, each way: a
50 MiB payload by reference, a compressed one that travels compressed, an event and a durable
command by reference, replies of both kinds, and the refusals (a digest that does not match, an
object that is gone, a payload over the limit, a decompression bomb), answered with the Rust
SDK's codes and reasons. The Rust side is `agent-sdk/examples/interop_peer/payloads.rs`."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from typing import Any

import nats
import pytest
import zstandard

from chorus_sdk import Agent, ChorusError, Context, Delivery, Envelope, Kind, PayloadLimits, Performative, Reply, StatusCode
from chorus_sdk import decode, decode_payload, encode, encode_payload
from chorus_sdk.envelope import CONTENT_TYPE_OBJECT
from chorus_sdk._buckets import ensure_bucket
from chorus_sdk.payloads import DEFAULT_PAYLOAD_RETENTION, ObjectRef, compress, decompress

from .conftest import Coordinator, eventually, py_agent

WAIT = 20.0
MIB = 1024 * 1024


def noise(size: int, seed: int = 7) -> bytes:
    """``size`` bytes that do not compress."""
    return random.Random(seed).randbytes(size)


def text(size: int) -> bytes:
    """``size`` bytes of repetitive JSON lines, which compress well."""
    line = b'{"row":1,"status":"ok","note":"all quiet"}\n'
    return (line * (size // len(line) + 1))[:size]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Tap:
    """A plain nats-py subscriber: what crossed the wire on a subject, as the server saw it."""

    def __init__(self) -> None:
        self.seen: asyncio.Queue[tuple[int, Envelope]] = asyncio.Queue()
        self.nc: Any = None

    async def open(self, url: str, *subjects: str) -> Tap:
        self.nc = await nats.connect(url)

        async def on(msg: Any) -> None:
            try:
                self.seen.put_nowait((len(msg.data), decode(msg.data)[0]))
            except Exception:  # noqa: BLE001 - a JetStream answer in an inbox: not an envelope
                pass

        for subject in subjects:
            await self.nc.subscribe(subject, cb=on)
        await self.nc.flush()
        return self

    async def next(self) -> tuple[int, Envelope]:
        return await asyncio.wait_for(self.seen.get(), WAIT)

    async def close(self) -> None:
        await self.nc.close()


def digest_handler(agent: Agent, name: str = "digest") -> list[Envelope]:
    """Registers ``name``: answers the digest, size and content type of what it was given."""
    handled: list[Envelope] = []

    @agent.command(name)
    async def digest(ctx: Context) -> dict[str, Any]:
        handled.append(ctx.envelope)
        return {"sha256": sha(ctx.payload), "len": len(ctx.payload), "content_type": ctx.content_type}

    return handled


def seen_of(report: dict[str, Any]) -> dict[str, Any]:
    """What a digest report says of the payload (the Rust one also names its subject)."""
    return {k: report[k] for k in ("sha256", "len", "content_type")}


async def digests(agent: Agent) -> asyncio.Queue[Any]:
    """The ``interop.digest`` events the Rust peer publishes, as they come."""
    seen: asyncio.Queue[Any] = asyncio.Queue()

    @agent.event("interop.digest")
    async def on_digest(ctx: Context) -> None:
        await seen.put(ctx.data())

    await agent.flush()
    return seen


async def next_made(seen: asyncio.Queue[Any]) -> Any:
    """The next digest report of bytes the Rust peer made (others are skipped)."""
    while True:
        report = await asyncio.wait_for(seen.get(), WAIT)
        if report.get("made"):
            return report


async def test_a_50_mib_payload_goes_by_reference_both_ways_with_the_same_digest(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-bulk")
    big = noise(50 * MIB)
    tap = await Tap().open(server.url, "chorus.agent.rust-bulk.digest", "chorus.agent.py-bulk.digest")
    try:
        async with py_agent(server, "py-bulk") as py:
            digest_handler(py)
            await py.flush()
            # Python -> Rust: stored by the Python agent, fetched and hashed by the Rust one.
            answer = await py.request(peer.id, "digest", big, timeout=120)
            assert seen_of(answer) == {"sha256": sha(big), "len": len(big), "content_type": "application/octet-stream"}
            size, env = await tap.next()
            assert env.content_type == CONTENT_TYPE_OBJECT and size < 4096
            reference = ObjectRef.decode(env.payload)
            assert (reference.size, reference.sha256, reference.name) == (len(big), sha(big), f"{env.from_}.{env.id}")
            assert reference.expires_ms > env.timestamp_ms
            # Rust -> Python: the Rust agent makes 50 MiB and sends them; the Python handler
            # hashes what it fetched.
            pushed = await py.request(peer.id, "push", {"to": py.id, "command": "digest", "len": 50 * MIB}, timeout=120)
            assert pushed["len"] == 50 * MIB
            assert pushed["answer"] == {"sha256": pushed["sha256"], "len": 50 * MIB, "content_type": "application/octet-stream"}
            size, env = await tap.next()
            assert env.content_type == CONTENT_TYPE_OBJECT and env.from_ == peer.id and size < 4096
            assert (py.stats.payloads_stored, py.stats.payloads_fetched) == (1, 1)
    finally:
        await tap.close()


async def test_replies_by_reference_both_ways(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-replies")
    tap = await Tap().open(server.url, "_INBOX.py-replies.>", "_INBOX.rust-replies.>")
    try:
        async with py_agent(server, "py-replies") as py:
            seen = await digests(py)

            @py.command("echo")
            async def echo(ctx: Context) -> Reply:
                return Reply(ctx.payload, ctx.content_type)

            await py.flush()
            # Rust -> Python: a 3 MiB reply by reference, opened for the caller.
            made = await py.request(peer.id, "make", {"len": 3 * MIB})
            report = await next_made(seen)
            assert isinstance(made, bytes) and (len(made), sha(made)) == (report["len"], report["sha256"])
            # Python -> Rust: the Python agent's reply to 3 MiB goes by reference too.
            pushed = await py.request(peer.id, "push", {"to": py.id, "command": "echo", "len": 3 * MIB})
            assert (pushed["answer_sha256"], pushed["answer_len"]) == (pushed["sha256"], 3 * MIB)
            kinds = set()
            while len(kinds) < 2:
                _, env = await tap.next()
                if env.kind is Kind.RESPONSE:
                    assert env.content_type == CONTENT_TYPE_OBJECT, env.from_
                    kinds.add(env.from_)
            assert kinds == {peer.id, py.id}
    finally:
        await tap.close()


async def test_a_compressed_payload_travels_compressed_both_ways(server: Any, rust_peer: Any) -> None:
    coordinator = Coordinator(server.url)
    tap = await Tap().open(server.url, "chorus.agent.rust-zstd.*", "chorus.agent.py-zstd.*", "_INBOX.py-zstd.>", "_INBOX.rust-zstd.>")
    try:
        peer = rust_peer("rust-zstd")
        async with py_agent(server, "py-zstd", heartbeat_interval=0.5) as py:
            digest_handler(py)

            @py.command("echo")
            async def echo(ctx: Context) -> Reply:
                return Reply(ctx.payload, ctx.content_type)

            seen = await digests(py)

            # Both manifests say they read zstd, as the registry has them.
            async def both_read_zstd() -> bool:
                records = {r["manifest"]["agent"]: r["manifest"] for r in await py.discover()}
                return all("zstd" in records.get(a, {}).get("content_encodings", []) for a in (py.id, peer.id))

            await eventually("both agents registered with content_encodings", both_read_zstd)
            body = text(512 * 1024)

            # Python -> Rust: a request, compressed on the wire, read whole by the Rust handler.
            answer = await py.request(peer.id, "digest", body, content_type="application/json")
            assert seen_of(answer) == {"sha256": sha(body), "len": len(body), "content_type": "application/json"}
            # Rust -> Python: a request compressed for the Python agent, opened before its handler.
            pushed = await py.request(peer.id, "push", {"to": py.id, "command": "digest", "len": len(body), "kind": "text"})
            assert pushed["answer"] == {"sha256": pushed["sha256"], "len": len(body), "content_type": "application/json"}
            # Replies each way: Rust's `make`, and the Python agent's echo to Rust's `push`.
            made = await py.request(peer.id, "make", {"len": len(body), "kind": "text"}, raw=True)
            report = await next_made(seen)
            # Opened for the caller (JSON lines: read raw).
            assert (sha(made.payload), made.content_encoding) == (report["sha256"], None)
            echoed = await py.request(peer.id, "push", {"to": py.id, "command": "echo", "len": len(body), "kind": "text"})
            assert echoed["answer_sha256"] == echoed["sha256"]
            # What crossed the wire: each of the four large JSON payloads, compressed (the tap
            # also sees discovery answers, in MessagePack, and small JSON digests).
            compressed: dict[tuple[str, Kind], bool] = {}
            while len(compressed) < 4:
                size, env = await tap.next()
                if env.content_type == "application/json" and (env.content_encoding is not None or len(env.payload) > 4096):
                    compressed[(env.from_, env.kind)] = env.content_encoding == "zstd" and size < len(body) // 5
            assert compressed == {
                (py.id, Kind.REQUEST): True,
                (peer.id, Kind.REQUEST): True,
                (peer.id, Kind.RESPONSE): True,
                (py.id, Kind.RESPONSE): True,
            }
            assert py.stats.payloads_decompressed >= 2
    finally:
        await tap.close()
        coordinator.stop()


async def test_an_event_by_reference_reaches_a_python_handler_and_a_rust_stream(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-events")
    async with py_agent(server, "py-events") as py:
        large: asyncio.Queue[Any] = asyncio.Queue()

        @py.event("interop.large.>")
        async def on_large(ctx: Context) -> None:
            await large.put((ctx.topic, ctx.content_type, sha(ctx.payload), len(ctx.payload)))

        seen = await digests(py)
        # Rust -> Python: a 3 MiB event, fetched before the Python handler runs.
        report = await py.request(peer.id, "emit_large", {"topic": "interop.large.one", "len": 3 * MIB})
        got = await asyncio.wait_for(large.get(), WAIT)
        assert got == ("interop.large.one", "application/octet-stream", report["sha256"], 3 * MIB)
        # Python -> Rust: read by `Agent::subscribe`, an event stream, which fetches it too.
        body = noise(3 * MIB, seed=11)
        await py.publish("interop.bulk.one", body)
        digest = await asyncio.wait_for(seen.get(), WAIT)
        assert digest == {"sha256": sha(body), "len": len(body), "content_type": "application/octet-stream", "topic": "interop.bulk.one"}
        assert (py.stats.payloads_stored, py.stats.payloads_fetched) == (1, 1)


async def test_a_durable_command_by_reference_both_ways(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-durable-bulk")
    # What the inbox stream stores, as a plain subscriber sees it published.
    tap = await Tap().open(server.url, "chorus.inbox.>")
    try:
        async with py_agent(server, "py-durable-bulk") as py:
            kept: asyncio.Queue[Any] = asyncio.Queue()

            @py.command("keep")
            async def keep(ctx: Context) -> None:
                await kept.put((sha(ctx.payload), len(ctx.payload), ctx.attempt))

            seen = await digests(py)
            # Python -> Rust: stored in the Rust agent's inbox as a reference, fetched on delivery.
            body = noise(3 * MIB, seed=3)
            await py.send(peer.id, "digest", body, delivery=Delivery.AT_LEAST_ONCE)
            report = await asyncio.wait_for(seen.get(), WAIT)
            assert (report["sha256"], report["len"], report["attempt"]) == (sha(body), len(body), 1)
            assert ".inbox." in report["subject"]
            # Rust -> Python: the Rust agent stores 3 MiB in the Python agent's inbox.
            pushed = await py.request(peer.id, "push", {"to": py.id, "command": "keep", "len": 3 * MIB, "delivery": "at_least_once"})
            assert pushed["stored"] > 0
            assert await asyncio.wait_for(kept.get(), WAIT) == (pushed["sha256"], 3 * MIB, 1)
            # Both stored commands were references, small, not the payload.
            for sender in (py.id, peer.id):
                size, env = await tap.next()
                assert (env.from_, env.content_type, env.delivery) == (sender, CONTENT_TYPE_OBJECT, Delivery.AT_LEAST_ONCE)
                assert size < 4096
    finally:
        await tap.close()


def forged(to: str, command: str, **fields: Any) -> Envelope:
    """A request as a forger writes it, to ``to``'s ``command``."""
    env = Envelope.new(Kind.REQUEST, Performative.REQUEST, "forger")
    env.to, env.name = [to], command
    for name, value in fields.items():
        setattr(env, name, value)
    return env


async def plant(nc: Any, name: str, data: bytes) -> None:
    """Writes ``data`` as the first part of payload ``name`` in the payload bucket (made as the
    SDKs make it when no test made it yet), as another writer of the layout would."""
    await ensure_bucket(nc.jetstream(), "chorus_payloads", DEFAULT_PAYLOAD_RETENTION, "Chorus: payloads carried by reference", per_key_ttl=True)
    await nc.jetstream().publish(f"$KV.chorus_payloads.{name}.0", data)


def reference(name: str, size: int, digest: str) -> bytes:
    return ObjectRef("chorus_payloads", name, size, digest, "application/octet-stream", 2**63).encode()


async def test_refusals_are_the_rust_sdks_codes_and_reasons(server: Any, rust_peer: Any, caplog: Any) -> None:
    caplog.set_level(logging.DEBUG, logger="chorus_sdk")
    limit = MIB
    peer = rust_peer("rust-guard", PEER_PAYLOAD_MAX_BYTES=str(limit))
    nc = await nats.connect(server.url)
    try:
        async with py_agent(server, "py-guard", payload_limits=PayloadLimits(max_bytes=limit)) as py:
            handled = digest_handler(py)
            await py.flush()
            # A payload planted by hand (another writer of the layout).
            planted = noise(4096)
            await plant(nc, "planted", planted)
            bomb = zstandard.ZstdCompressor().compress(bytes(limit + 1))
            cases = {
                "a digest that does not match": dict(content_type=CONTENT_TYPE_OBJECT, payload=reference("planted", 4096, sha(b"else"))),
                "a size that does not match": dict(content_type=CONTENT_TYPE_OBJECT, payload=reference("planted", 4000, sha(planted))),
                "an object that is gone": dict(content_type=CONTENT_TYPE_OBJECT, payload=reference("absent", 4096, sha(planted))),
                "a reference over the limit": dict(content_type=CONTENT_TYPE_OBJECT, payload=reference("planted", limit + 1, sha(planted))),
                "a decompression bomb": dict(content_encoding="zstd", payload=bomb),
                "garbage as zstd": dict(content_encoding="zstd", payload=b"not zstd at all"),
                "an unknown encoding": dict(content_encoding="br", payload=compress(text(100_000)) or b""),
            }
            for what, fields in cases.items():
                answers = []
                for agent in (peer.id, py.id):
                    request = forged(agent, "digest", **fields)
                    msg = await nc.request(f"chorus.agent.{agent}.digest", encode(request), timeout=WAIT)
                    answer = decode(msg.data)[0]
                    assert answer.in_reply_to == request.id and not answer.payload, what
                    answers.append((answer.status, answer.reason))
                assert answers[0][0] == StatusCode.DATA_FORMAT, (what, answers)
                assert answers[1] == answers[0], what
            assert handled == []
            # The reference that does not read: the same code and start of the reason (the
            # rest is each decoder's own words).
            for agent in (peer.id, py.id):
                request = forged(agent, "digest", content_type=CONTENT_TYPE_OBJECT, payload=encode_payload([1, 2]))
                answer = decode((await nc.request(f"chorus.agent.{agent}.digest", encode(request), timeout=WAIT)).data)[0]
                assert answer.status == StatusCode.DATA_FORMAT
                assert (answer.reason or "").startswith("the payload reference does not read: "), answer.reason

            # Over the sender's own limit: refused before anything is sent, on either side.
            with pytest.raises(ChorusError) as own:
                await py.request(peer.id, "digest", noise(limit + 1))
            assert (own.value.status, own.value.reason) == (StatusCode.DATA_FORMAT, f"message of {limit + 1} bytes exceeds the limit of {limit} bytes")
            with pytest.raises(ChorusError) as theirs:
                await py.request(peer.id, "push", {"to": py.id, "command": "digest", "len": limit + 1})
            assert theirs.value.status == StatusCode.DATA_FORMAT
            assert f"message of {limit + 1} bytes exceeds the limit of {limit} bytes" in theirs.value.reason
    finally:
        await nc.close()
    # Every refusal was an answer, not a crash.
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_a_durable_command_whose_payload_does_not_open_is_dead_lettered_with_5006(server: Any) -> None:
    async with py_agent(server, "py-dlq-bulk") as py:
        handled = digest_handler(py, "store")
        await py.flush()
        js = py.nc.jetstream()
        await ensure_bucket(js, "chorus_payloads", DEFAULT_PAYLOAD_RETENTION, "Chorus: payloads carried by reference", per_key_ttl=True)
        inbox = py.subjects.durable_inbox(py.id, False, "store")
        cases = [
            (dict(content_type=CONTENT_TYPE_OBJECT, payload=reference("absent-durable", 10, sha(b"x"))), "the payload absent-durable is gone (expired or removed)"),
            (dict(content_encoding="br", payload=b"x"), 'unsupported content encoding "br"'),
        ]
        for n, (fields, detail) in enumerate(cases, 1):
            command = forged(py.id, "store", **fields)
            command.kind, command.delivery = Kind.COMMAND, Delivery.AT_LEAST_ONCE
            await js.publish(inbox, encode(command))

            async def dead() -> bool:
                return py.stats.dead_lettered >= n

            await eventually("the command dead-lettered", dead)
            letter = await js.get_last_msg(py.subjects.stream_name("DLQ"), f"chorus.dlq.refused.{py.id}")
            assert letter.headers is not None
            assert (letter.headers["Chorus-Dlq-Status"], letter.headers["Chorus-Dlq-Detail"]) == ("5006", detail)
            assert letter.headers["Chorus-Dlq-Attempts"] == "1"
        assert handled == [] and py.stats.retries == 0


def test_a_frame_that_does_not_say_its_size_is_read_only_up_to_the_limit() -> None:
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(2 * MIB))
    with pytest.raises(ChorusError) as bomb:
        decompress(unsized, MIB)
    assert bomb.value.status == StatusCode.DATA_FORMAT
    assert decompress(unsized, 2 * MIB) == bytes(2 * MIB)
    packed = compress(text(200_000))
    assert packed is not None and decompress(packed, 200_000) == text(200_000)
    assert compress(noise(100_000)) is None
    with pytest.raises(ValueError):
        PayloadLimits(max_bytes=0)
    assert decode_payload(encode_payload(1)) == 1
