"""Python agents with each other through a real nats-server: requests, errors with their codes,
events, and what the inbound pipeline refuses."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest

from chorus_sdk import (
    Agent,
    ChorusError,
    NoResponders,
    Refused,
    Timeout,
    Unreachable,
    Context,
    Delivery,
    Encoding,
    Envelope,
    Kind,
    Performative,
    StatusCode,
    decode,
    decode_payload,
    encode,
    encode_payload,
)
from chorus_sdk.envelope import Trace, now_ms

WAIT = 10.0
VECTORS = Path(__file__).resolve().parents[2] / "tests" / "vectors"


async def test_request_reply_in_every_encoding_and_errors_carry_their_code(server: Any) -> None:
    async with Agent("py-calc", servers=server.url, heartbeat_interval=0) as calc:

        @calc.command("add")
        async def add(ctx: Context) -> float:
            a, b = ctx.data()
            return float(a + b)

        @calc.command("divide")
        def divide(ctx: Context) -> float:
            a, b = ctx.data()
            if b == 0:
                raise ChorusError(StatusCode.INVALID_ARGUMENT, "division by zero")
            return float(a / b)

        @calc.command("crash")
        async def crash(ctx: Context) -> None:
            raise RuntimeError("boom")

        for encoding in Encoding:
            async with Agent(f"py-caller-{encoding.value}", servers=server.url, heartbeat_interval=0, encoding=encoding) as caller:
                assert await caller.request("py-calc", "add", [2, 3]) == 5.0
                with pytest.raises(ChorusError) as refused:
                    await caller.request("py-calc", "divide", [1, 0])
                assert refused.value.status == 5018 and refused.value.reason == "division by zero"
                with pytest.raises(ChorusError) as crashed:
                    await caller.request("py-calc", "crash")
                assert crashed.value.status == 5017 and "boom" in crashed.value.reason
                with pytest.raises(ChorusError) as unknown:
                    await caller.request("py-calc", "nothing")
                assert unknown.value.status == 5016
                with pytest.raises(ChorusError) as nobody:
                    await caller.request("nobody-here", "add", [1, 2], timeout=2)
                assert nobody.value.status == 5012
        assert calc.stats.handled == len(Encoding)
        assert calc.stats.failed == 2 * len(Encoding)


async def test_errors_are_caught_by_meaning_and_keep_their_cause(server: Any) -> None:
    @dataclass
    class Total:
        value: float

    async with Agent("py-meaning", servers=server.url, heartbeat_interval=0) as calc:

        @calc.command("total")
        async def total(ctx: Context) -> dict[str, float]:
            return {"value": float(sum(ctx.data()))}

        @calc.command("refuse")
        async def refuse(ctx: Context) -> None:
            raise ChorusError(StatusCode.INVALID_ARGUMENT, "no")

        @calc.command("slow")
        async def slow(ctx: Context) -> None:
            await asyncio.sleep(1.0)

        async with Agent("py-meaning-caller", servers=server.url, heartbeat_interval=0) as caller:
            answer = await caller.request("py-meaning", "total", [1, 2], returns=Total)
            assert answer == Total(3.0)
            with pytest.raises(Refused) as refused:
                await caller.request("py-meaning", "refuse")
            assert refused.value.status == StatusCode.INVALID_ARGUMENT
            with pytest.raises(NoResponders) as nobody:
                await caller.request("nobody-here", "total", [1])
            assert nobody.value.status == StatusCode.NO_RESPONDERS
            assert isinstance(nobody.value.__cause__, nats.errors.NoRespondersError)
            with pytest.raises(TimeoutError) as late:
                await caller.request("py-meaning", "slow", timeout=0.2)
            assert isinstance(late.value, Timeout) and isinstance(late.value, ChorusError)
            assert late.value.status == StatusCode.TIMEOUT
            assert isinstance(late.value.__cause__, nats.errors.TimeoutError)
        with pytest.raises(Unreachable) as gone:
            await caller.request("py-meaning", "total", [1])
        assert gone.value.status == StatusCode.UNAVAILABLE


async def test_events_reach_every_matching_subscriber_and_gaps_are_counted(server: Any) -> None:
    got: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    async with Agent("py-listener", servers=server.url, heartbeat_interval=0) as listener:

        @listener.event("doc.>")
        async def on_doc(ctx: Context) -> None:
            await got.put((ctx.envelope.topic or "", ctx.data()))

        await listener.flush()
        async with Agent("py-publisher", servers=server.url, heartbeat_interval=0) as publisher:
            await publisher.publish("doc.text.extracted", {"pages": 3})
            await publisher.publish("other.topic", "not for the listener")
            await publisher.publish("doc.deleted", "gone")
            first = await asyncio.wait_for(got.get(), WAIT)
            second = await asyncio.wait_for(got.get(), WAIT)
            assert first == ("doc.text.extracted", {"pages": 3})
            assert second == ("doc.deleted", "gone")
            # Two events the listener never sees: the next one shows the gap.
            publisher._seq[publisher.subjects.event("doc.deleted")][1] += 2
            await publisher.publish("doc.deleted", "again")
            await asyncio.wait_for(got.get(), WAIT)
            assert listener.stats.lost == 2


async def test_an_event_handler_gets_the_topic_it_matched_in_every_encoding(server: Any) -> None:
    got: asyncio.Queue[str | None] = asyncio.Queue()
    async with Agent("py-topics", servers=server.url, heartbeat_interval=0) as listener:

        @listener.event("doc.>")
        async def on_doc(ctx: Context) -> None:
            await got.put(ctx.topic)

        @listener.command("which")
        async def which(ctx: Context) -> str | None:
            return ctx.topic

        await listener.flush()
        for encoding in Encoding:
            async with Agent(f"py-topic-{encoding.value}", servers=server.url, heartbeat_interval=0, encoding=encoding) as publisher:
                # The compact form leaves the topic out of the envelope: it is the subject's.
                await publisher.publish(f"doc.{encoding.value}.created", {"n": 1})
                assert await asyncio.wait_for(got.get(), WAIT) == f"doc.{encoding.value}.created"
                # A command has no topic.
                assert await publisher.request("py-topics", "which") is None


async def raw_request(url: str, subject: str, data: bytes) -> Envelope:
    nc = await nats.connect(url)
    try:
        msg = await nc.request(subject, data, timeout=WAIT)
        return decode(msg.data)[0]
    finally:
        await nc.close()


async def test_what_the_pipeline_refuses_is_answered_with_its_code(server: Any) -> None:
    async with Agent("py-guard", servers=server.url, heartbeat_interval=0, hop_limit=4) as guard:

        @guard.command("work")
        async def work(ctx: Context) -> str:
            return "done"

        subject = guard.subjects.command("py-guard", "work")
        garbage = await raw_request(server.url, subject, b"\x01\x02 not an envelope")
        assert garbage.status == 5006 and garbage.performative is Performative.REFUSE

        broken = await raw_request(server.url, subject, b'{"version":"1.0","id":')
        assert broken.status == 5006 and broken.reason and broken.reason.startswith("malformed envelope")

        future = await raw_request(server.url, subject, b'{"version":"7.0","anything":1}')
        assert future.status == 5006 and "unsupported protocol version 7.0" in (future.reason or "")

        looping = Envelope.new(Kind.REQUEST, Performative.REQUEST, "someone")
        looping.hops = 5
        answer = await raw_request(server.url, subject, encode(looping))
        assert answer.status == 5010 and answer.in_reply_to == looping.id

        stale = Envelope.new(Kind.REQUEST, Performative.REQUEST, "someone")
        stale.deadline_ms = now_ms() - 1000
        answer = await raw_request(server.url, subject, encode(stale, Encoding.JSON))
        assert answer.status == 5011

        odd = encode(Envelope.new(Kind.REQUEST, Performative.REQUEST, "someone")).replace(b"\xa7request", b"\xa7mystery", 1)
        answer = await raw_request(server.url, subject, odd)
        assert answer.status == 5006 and "kind" in (answer.reason or "")

        fine = Envelope.new(Kind.REQUEST, Performative.REQUEST, "someone")
        answer = await raw_request(server.url, subject, encode(fine, Encoding.COMPACT, guard.subjects.implied(subject)))
        assert answer.status == 5002 and answer.correlation_id == fine.id


async def test_an_exactly_once_request_runs_once_and_a_copy_gets_the_same_reply(server: Any) -> None:
    runs: list[Any] = []
    async with Agent("py-once", servers=server.url, heartbeat_interval=0) as once:

        @once.command("charge")
        async def charge(ctx: Context) -> dict[str, Any]:
            runs.append(ctx.data())
            return {"charged": ctx.data(), "run": len(runs)}

        subject = once.subjects.command("py-once", "charge")
        request = Envelope.new(Kind.REQUEST, Performative.REQUEST, "billing")
        request.delivery = Delivery.EXACTLY_ONCE
        request.payload = encode_payload(42)
        first = await raw_request(server.url, subject, encode(request))
        second = await raw_request(server.url, subject, encode(request))
        assert first.status == second.status == 5002
        assert decode_payload(first.payload) == decode_payload(second.payload) == {"charged": 42, "run": 1}
        assert runs == [42] and once.stats.duplicates == 1

        # A claim left by another instance that never finished: never run again, reported.
        js = once.nc.jetstream()
        kv = await js.key_value("chorus_idempotency")
        lost = Envelope.new(Kind.REQUEST, Performative.REQUEST, "billing")
        lost.delivery = Delivery.EXACTLY_ONCE
        await kv.create(f"py-once.{lost.id}", b'{"state":"claimed","instance":"0123","claimed_ms":1}')
        answer = await raw_request(server.url, subject, encode(lost))
        assert answer.status == StatusCode.UNCERTAIN and runs == [42]


@dataclass
class Order:
    item: str
    quantity: int


@dataclass
class Receipt:
    item: str
    total: float


async def test_dataclass_payloads_in_and_out_and_a_wrong_shape_is_5006(server: Any) -> None:
    async with Agent("py-shop", servers=server.url, heartbeat_interval=0) as shop:

        @shop.command("order")
        async def order(ctx: Context) -> Receipt:
            o = ctx.data(Order)
            return Receipt(item=o.item, total=o.quantity * 2.5)

        for encoding in (Encoding.MSGPACK, Encoding.JSON):
            async with Agent(f"py-buyer-{encoding.value}", servers=server.url, heartbeat_interval=0, encoding=encoding) as buyer:
                content_type = "application/json" if encoding is Encoding.JSON else None
                receipt = await buyer.request("py-shop", "order", Order("tea", 4), returns=Receipt, content_type=content_type)
                assert receipt == Receipt("tea", 10.0)
                with pytest.raises(ChorusError) as wrong:
                    await buyer.request("py-shop", "order", {"item": "tea"}, content_type=content_type)
                assert wrong.value.status == StatusCode.DATA_FORMAT


async def test_trace_context_is_carried_into_replies_and_forwards_and_never_in_nats_headers(server: Any) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    seen: asyncio.Queue[Any] = asyncio.Queue()
    async with Agent("py-traced", servers=server.url, heartbeat_interval=0) as traced, Agent(
        "py-next", servers=server.url, heartbeat_interval=0
    ) as nxt:

        @nxt.command("inner")
        async def inner(ctx: Context) -> str:
            await seen.put(ctx.envelope)
            return "inner done"

        @traced.command("outer")
        async def outer(ctx: Context) -> Any:
            return await ctx.request("py-next", "inner", None)

        await nxt.flush()
        request = Envelope.new(Kind.REQUEST, Performative.REQUEST, "client")
        request.trace = Trace(traceparent, "congo=t61rcWkgMzE")
        nc = await nats.connect(server.url)
        try:
            msg = await nc.request(traced.subjects.command("py-traced", "outer"), encode(request), timeout=WAIT)
        finally:
            await nc.close()
        reply, _ = decode(msg.data)
        assert reply.status == 5002 and reply.trace == request.trace
        # The envelope carries it; NATS headers never do (PROTOCOL.md section 3.4).
        assert not msg.headers, msg.headers
        forwarded = await asyncio.wait_for(seen.get(), WAIT)
        assert forwarded.trace == request.trace
        assert forwarded.correlation_id == request.id and forwarded.hops == 1


async def test_nats_service_discovery_lists_a_python_agent(server: Any) -> None:
    async with Agent("py-svc", servers=server.url, heartbeat_interval=0) as svc:

        @svc.command("work")
        async def work(ctx: Context) -> str:
            if ctx.data() == "fail":
                raise ChorusError(StatusCode.INVALID_ARGUMENT, "asked to")
            return "done"

        @svc.capability("py.svc")
        async def cap(ctx: Context) -> str:
            return "cap"

        await svc.flush()
        async with Agent("py-svc-client", servers=server.url, heartbeat_interval=0) as client:
            assert await client.request("py-svc", "work", "ok") == "done"
            with pytest.raises(ChorusError):
                await client.request("py-svc", "work", "fail")
        nc = await nats.connect(server.url)
        try:
            ping = json.loads((await nc.request("$SRV.PING.py-svc", b"", timeout=WAIT)).data)
            info = json.loads((await nc.request(f"$SRV.INFO.py-svc.{svc.instance}", b"", timeout=WAIT)).data)
            stats = json.loads((await nc.request("$SRV.STATS.py-svc", b"", timeout=WAIT)).data)
        finally:
            await nc.close()
        assert ping["type"] == "io.nats.micro.v1.ping_response" and ping["name"] == "py-svc" and ping["id"] == svc.instance
        assert ping["metadata"] == {"chorus.root": "chorus", "chorus.capabilities": "py.svc"}
        assert info["type"] == "io.nats.micro.v1.info_response"
        assert [(e["name"], e["subject"], e["queue_group"]) for e in info["endpoints"]] == [
            ("work", "chorus.agent.py-svc.work", ""),
            ("py.svc", "chorus.cap.py.svc", "chorus.cap.py.svc"),
        ]
        work_stats = stats["endpoints"][0]
        assert (work_stats["num_requests"], work_stats["num_errors"]) == (2, 1)
        assert work_stats["last_error"] == "5018 asked to" and work_stats["processing_time"] > 0
        assert stats["started"].endswith("Z")


def vector(name: str) -> Envelope:
    """One of the shared vectors (tests/vectors), decoded."""
    return decode(bytes.fromhex((VECTORS / f"{name}.msgpack.hex").read_text().strip()))[0]


def large_payload(env: Envelope, how: str, encoding: str = "zstd") -> Envelope:
    """``env`` with the payload of a large message as a Rust sender writes it: compressed (the
    zstd frame of vector 17, or another ``encoding``) or by reference (the object-store
    reference of vector 16)."""
    source = vector("17-payload-compressed" if how == "compressed" else "16-payload-reference")
    env.content_type, env.payload = source.content_type, source.payload
    if how == "compressed":
        env.content_encoding = encoding
    return env


# Vector 16's object was never stored here: refused as gone (or its bucket as missing, on a
# server where no payload was stored yet), with the Rust SDK's reasons (tests/test_payloads.py
# has the rest of large payloads).
REFERENCE_REASONS = (
    "the payload scanner.01a2ce8b-d410-7010-9010-101010101010 is gone (expired or removed)",
    "the payload's bucket cannot be opened: no bucket chorus_payloads",
)


async def test_a_rust_compressed_payload_is_read_and_unknown_encodings_or_missing_objects_refused_in_every_encoding(server: Any) -> None:
    handled: list[Envelope] = []
    async with Agent("py-plain", servers=server.url, heartbeat_interval=0) as plain:

        @plain.command("store")
        async def store(ctx: Context) -> str:
            handled.append(ctx.envelope)
            return "stored"

        # The manifest says it reads zstd: a Rust sender compresses large payloads for it.
        assert decode_payload(plain.manifest())["content_encodings"] == ["zstd"]
        subject = plain.subjects.command("py-plain", "store")
        implied = plain.subjects.implied(subject)
        compressed = vector("17-payload-compressed")
        for encoding in Encoding:
            request = large_payload(Envelope.new(Kind.REQUEST, Performative.REQUEST, "rust-sender"), "compressed")
            answer = await raw_request(server.url, subject, encode(request, encoding, implied))
            assert answer.status == 5002 and answer.in_reply_to == request.id
            # The handler saw the payload as it was before compression.
            assert handled[-1].content_encoding is None and handled[-1].content_type == compressed.content_type
            assert len(handled[-1].payload) == 841 and decode_payload(handled[-1].payload, compressed.content_type) is not None

            request = large_payload(Envelope.new(Kind.REQUEST, Performative.REQUEST, "rust-sender"), "compressed", "br")
            answer = await raw_request(server.url, subject, encode(request, encoding, implied))
            assert (answer.status, answer.performative) == (StatusCode.DATA_FORMAT, Performative.REFUSE)
            assert answer.reason == 'unsupported content encoding "br"'
            assert answer.in_reply_to == request.id and answer.content_encoding is None

            request = large_payload(Envelope.new(Kind.REQUEST, Performative.REQUEST, "rust-sender"), "by reference")
            answer = await raw_request(server.url, subject, encode(request, encoding, implied))
            assert (answer.status, answer.performative) == (StatusCode.DATA_FORMAT, Performative.REFUSE)
            assert answer.reason in REFERENCE_REASONS and answer.in_reply_to == request.id
            # The refusal carries no reference: it names the content type of its own encoding.
            assert answer.content_type == encoding.content_type and not answer.payload
        assert len(handled) == len(Encoding) and plain.stats.refused == 2 * len(Encoding)

        fine = Envelope.new(Kind.REQUEST, Performative.REQUEST, "rust-sender")
        fine.payload = encode_payload("small")
        answer = await raw_request(server.url, subject, encode(fine))
        assert answer.status == 5002 and decode_payload(answer.payload) == "stored" and len(handled) == len(Encoding) + 1


async def test_a_durable_command_that_does_not_open_is_dead_lettered_with_5006(server: Any) -> None:
    handled: list[Envelope] = []
    async with Agent("py-plain-durable", servers=server.url, heartbeat_interval=0) as plain:

        @plain.command("store")
        async def store(ctx: Context) -> None:
            handled.append(ctx.envelope)

        await plain.flush()
        js = plain.nc.jetstream()
        inbox = plain.subjects.durable_inbox(plain.id, False, "store")
        cases = [("compressed", 'unsupported content encoding "br"'), ("by reference", REFERENCE_REASONS)]
        for n, (how, detail) in enumerate(cases, 1):
            command = large_payload(Envelope.new(Kind.COMMAND, Performative.REQUEST, "rust-sender"), how, "br")
            command.to, command.name, command.delivery = [plain.id], "store", Delivery.AT_LEAST_ONCE
            await js.publish(inbox, encode(command))
            deadline = asyncio.get_running_loop().time() + WAIT
            while plain.stats.dead_lettered < n:
                assert asyncio.get_running_loop().time() < deadline, plain.stats
                await asyncio.sleep(0.05)
            dead = await js.get_last_msg(plain.subjects.stream_name("DLQ"), f"chorus.dlq.refused.{plain.id}")
            assert dead.headers is not None
            assert dead.headers["Chorus-Dlq-Status"] == "5006" and dead.headers["Chorus-Dlq-Detail"] in detail
            # Refused on its first delivery, not retried.
            assert dead.headers["Chorus-Dlq-Attempts"] == "1"
            assert dead.headers["Chorus-Dlq-Message-Id"] == str(command.id)
        assert handled == [] and plain.stats.retries == 0


async def test_a_compressed_reply_is_opened_for_the_caller_and_a_missing_object_refused(server: Any) -> None:
    nc = await nats.connect(server.url)

    async def answer(msg: Any) -> None:
        request = decode(msg.data)[0]
        reply = Envelope.new(Kind.RESPONSE, Performative.INFORM, "rust-large")
        reply.in_reply_to = reply.correlation_id = request.id
        reply.to, reply.status = [request.from_], 5002
        await nc.publish(msg.reply, encode(large_payload(reply, decode_payload(request.payload))))

    try:
        await nc.subscribe("chorus.agent.rust-large.fetch", cb=answer)
        await nc.flush()
        async with Agent("py-fetcher", servers=server.url, heartbeat_interval=0) as fetcher:
            with pytest.raises(ChorusError) as refused:
                await fetcher.request("rust-large", "fetch", "by reference")
            assert refused.value.status == StatusCode.DATA_FORMAT and refused.value.reason in REFERENCE_REASONS
            # The compressed reply is read as the 841 bytes of JSON it holds, raw or not.
            raw = await fetcher.request("rust-large", "fetch", "compressed", raw=True)
            assert raw.content_encoding is None and len(raw.payload) == 841
            assert await fetcher.request("rust-large", "fetch", "compressed") == decode_payload(raw.payload, raw.content_type)
            assert fetcher.stats.payloads_decompressed == 2
    finally:
        await nc.close()


async def _consumer_exists(js: Any, stream: str, name: str) -> bool:
    try:
        await js.consumer_info(stream, name)
        return True
    except nats.js.errors.NotFoundError:
        return False


async def _until(what: str, check: Any) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


async def _inbox_started(agent: Agent) -> None:
    async def started() -> bool:
        return agent._durable is not None and agent._durable._started

    await _until("the durable inbox started", started)


async def test_an_on_demand_inbox_holds_no_consumer_until_a_bell_and_releases_it_when_quiet(server: Any) -> None:
    from chorus_sdk.durable import InboxOptions

    handled: list[int] = []
    options = InboxOptions(release_after=0.4)
    async with Agent("py-on-demand", servers=server.url, heartbeat_interval=0, inbox=options) as worker:

        @worker.command("work")
        async def work(ctx: Context) -> None:
            handled.append(decode_payload(ctx.envelope.payload, ctx.envelope.content_type))

        await _inbox_started(worker)
        js = worker.nc.jetstream()
        stream = worker.subjects.stream_name("INBOX")
        # Started with an empty inbox: no consumer on the server.
        assert not await _consumer_exists(js, stream, "py-on-demand")
        assert not await _consumer_exists(js, stream, "py-on-demand_high")
        async with Agent("py-on-demand-sender", servers=server.url, heartbeat_interval=0) as sender:
            for n in range(3):
                await sender.send("py-on-demand", "work", n, delivery=Delivery.AT_LEAST_ONCE)

            async def three() -> bool:
                return len(handled) == 3

            await _until("three commands handled", three)
            assert handled == [0, 1, 2]
            assert worker.stats.inbox_consumers_opened == 1
            assert not await _consumer_exists(js, stream, "py-on-demand_high"), "no bell for the high lane"

            async def released() -> bool:
                return worker.stats.inbox_consumers_released == 1 and not await _consumer_exists(
                    js, stream, "py-on-demand"
                )

            await _until("the consumer released", released)
            # The next command rings again and opens it again.
            await sender.send("py-on-demand", "work", 3, delivery=Delivery.AT_LEAST_ONCE)

            async def four() -> bool:
                return len(handled) == 4

            await _until("a command after the release handled", four)
            assert worker.stats.inbox_consumers_opened == 2


def _covers(pattern: str, subject: str) -> bool:
    """Whether a NATS subscription subject (with `*` and `>`) matches `subject`."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


async def test_a_lane_with_its_consumer_open_is_sent_no_bell_per_command(server: Any) -> None:
    from chorus_sdk.durable import InboxOptions

    handled: list[int] = []
    options = InboxOptions(release_after=30)
    async with Agent("py-busy", servers=server.url, heartbeat_interval=0, inbox=options) as worker:

        @worker.command("work")
        async def work(ctx: Context) -> None:
            handled.append(decode_payload(ctx.envelope.payload, ctx.envelope.content_type))

        await _inbox_started(worker)
        async with Agent("py-busy-sender", servers=server.url, heartbeat_interval=0) as sender:
            await sender.send("py-busy", "work", 0, delivery=Delivery.AT_LEAST_ONCE)

            async def first() -> bool:
                return len(handled) == 1

            # Its bell opened the normal lane's consumer, which stays open while commands come.
            await _until("the first command handled", first)
            before = worker.nc.stats["in_msgs"]
            # A normal command's bell would reach none of the agent's subscriptions.
            bell = f"_INBOX.py-busy.bell.{worker.subjects.root}.normal.work"
            assert not [sub.subject for sub in worker.nc._subs.values() if _covers(sub.subject, bell)]
            more = 200
            for n in range(1, more + 1):
                await sender.send("py-busy", "work", n, delivery=Delivery.AT_LEAST_ONCE)

            async def all_of_them() -> bool:
                return len(handled) == more + 1

            await _until("the others handled", all_of_them)
            received = worker.nc.stats["in_msgs"] - before
            assert received >= more, f"{received} messages for {more} commands"
            # Still none while the consumer is open: the server sends the lane no bells.
            assert not [sub.subject for sub in worker.nc._subs.values() if _covers(sub.subject, bell)]
            assert worker.stats.inbox_consumers_opened == 1


async def test_commands_registered_late_together_start_one_inbox(server: Any) -> None:
    handled: list[int] = []
    async with Agent("py-late", servers=server.url, heartbeat_interval=0) as worker:
        # Registered after the start: each registration starts the inbox, concurrently.
        for name in ("one", "two", "three"):

            @worker.command(name)
            async def work(ctx: Context) -> None:
                handled.append(decode_payload(ctx.envelope.payload, ctx.envelope.content_type))

        await worker.flush()
        await worker.send("py-late", "two", 7, delivery=Delivery.AT_LEAST_ONCE)

        async def one() -> bool:
            return handled == [7]

        await _until("the command handled", one)
        # One start: one task per lane, one consumer opened for the one command.
        assert worker.stats.inbox_consumers_opened == 1
        assert worker._durable is not None
        assert worker._durable._started


async def test_an_inbox_with_consumers_always_held_holds_both_from_its_start(server: Any) -> None:
    from chorus_sdk.durable import InboxOptions

    options = InboxOptions(on_demand=False)
    async with Agent("py-always", servers=server.url, heartbeat_interval=0, inbox=options) as worker:

        @worker.command("work")
        async def work(ctx: Context) -> None:
            return None

        await _inbox_started(worker)
        js = worker.nc.jetstream()
        stream = worker.subjects.stream_name("INBOX")
        assert await _consumer_exists(js, stream, "py-always")
        assert await _consumer_exists(js, stream, "py-always_high")
        assert worker.stats.inbox_consumers_opened == 0
