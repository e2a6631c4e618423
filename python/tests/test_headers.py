"""Application headers (the envelope's ``headers``) between Python and Rust agents: a sender sets
them, the receiving handler reads them (``ctx.headers``, ``Context::headers`` in Rust), replies
and forwards do not carry them on, and both SDKs refuse headers past the same limits before
sending anything. The Rust side is ``agent-sdk/examples/interop_peer/headers.rs``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from chorus_sdk import MAX_HEADER_NAME_BYTES, MAX_HEADERS, MAX_HEADERS_BYTES, ChorusError, Context, StatusCode

from .conftest import py_agent

WAIT = 15.0
SENT = {"x-request-id": "r-17", "tenant": "acme", "empty": "", "ünïcode": "ṽalue"}


async def test_headers_reach_handlers_both_ways_and_stay_with_their_message(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-headers")
    async with py_agent(server, "py-headers") as py:
        seen: list[tuple[dict[str, str], int]] = []

        @py.command("seen")
        async def seen_command(ctx: Context) -> dict[str, str]:
            seen.append((dict(ctx.headers), ctx.envelope.hops))
            return dict(ctx.headers)

        @py.command("relay")
        async def relay(ctx: Context) -> dict[str, Any]:
            # A forward made while handling a message with headers: the Rust peer sees none.
            return {"mine": dict(ctx.headers), "rust_saw": await ctx.request(peer.id, "headers", None)}

        await py.flush()

        # Python -> Rust: the Rust handler reads what the Python sender set; the reply has none.
        reply = await py.request(peer.id, "headers", None, headers=SENT, raw=True, timeout=WAIT)
        assert reply.headers == {}
        assert await py.request(peer.id, "headers", None, headers=SENT, timeout=WAIT) == {"headers": SENT, "forwarded": None}
        # The Rust handler's own forward to Python carries none of them.
        forwarded = await py.request(peer.id, "headers", {"forward_to": py.id, "command": "seen"}, headers=SENT, timeout=WAIT)
        assert forwarded == {"headers": SENT, "forwarded": {}}
        assert seen[-1] == ({}, 1)

        # Rust -> Python: the Python handler reads what the Rust sender set; its reply has none.
        order = {"to": py.id, "command": "seen", "payload": None, "headers": {"x-from": "rust", "lang": "en"}}
        answer = await py.request(peer.id, "call_with_headers", order, timeout=WAIT)
        assert answer == {"answer": {"x-from": "rust", "lang": "en"}, "reply_headers": {}}
        # And the Python handler's own forward to Rust carries none of them.
        order = {"to": py.id, "command": "relay", "payload": None, "headers": {"x-from": "rust"}}
        answer = await py.request(peer.id, "call_with_headers", order, timeout=WAIT)
        assert answer["answer"] == {"mine": {"x-from": "rust"}, "rust_saw": {"headers": {}, "forwarded": None}}
        assert answer["reply_headers"] == {}

        # ctx.headers is read-only.
        with pytest.raises(TypeError):
            Context(py, reply, "s").headers["x"] = "y"  # type: ignore[arg-type, index]


async def test_both_sdks_refuse_headers_past_the_limits_before_sending(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-headers-2")
    async with py_agent(server, "py-headers-2") as py:
        calls: list[dict[str, str]] = []

        @py.command("seen")
        async def seen_command(ctx: Context) -> None:
            calls.append(dict(ctx.headers))

        await py.flush()
        too_many = {f"h{i}": "" for i in range(MAX_HEADERS + 1)}
        cases: list[tuple[dict[str, Any], str]] = [
            (too_many, f"{MAX_HEADERS + 1} application headers: at most {MAX_HEADERS} are allowed"),
            ({"n" * (MAX_HEADER_NAME_BYTES + 1): "v"}, f"1 to {MAX_HEADER_NAME_BYTES} bytes, not {MAX_HEADER_NAME_BYTES + 1}"),
            ({"": "v"}, f"1 to {MAX_HEADER_NAME_BYTES} bytes, not 0"),
            ({"a\nb": "v"}, "holds a control character"),
            ({"k": "v" * MAX_HEADERS_BYTES}, f"application headers of {MAX_HEADERS_BYTES + 1} bytes: at most {MAX_HEADERS_BYTES} are allowed"),
        ]
        for headers, why in cases:
            # Python refuses them before sending, in every way of sending.
            for send in (
                py.request(peer.id, "echo", 1, headers=headers, timeout=WAIT),
                py.send(peer.id, "echo", 1, headers=headers),
                py.publish("interop.headers", 1, headers=headers),
            ):
                with pytest.raises(ChorusError) as refused:
                    await send
                assert refused.value.status == StatusCode.INVALID_ARGUMENT
                assert why in refused.value.reason
            # The Rust SDK refuses the same ones with the same reason (5018 back to us).
            order = {"to": py.id, "command": "seen", "payload": None, "headers": headers}
            with pytest.raises(ChorusError) as refused:
                await py.request(peer.id, "call_with_headers", order, timeout=WAIT)
            assert refused.value.status == StatusCode.INVALID_ARGUMENT
            assert why in refused.value.reason, refused.value.reason
        with pytest.raises(ChorusError) as not_text:
            await py.request(peer.id, "echo", 1, headers={"n": 3}, timeout=WAIT)  # type: ignore[dict-item]
        assert not_text.value.status == StatusCode.INVALID_ARGUMENT
        # At the limits exactly, both pass.
        largest = {f"h{i:02}": "v" * 200 for i in range(MAX_HEADERS)}
        assert await py.request(peer.id, "headers", None, headers=largest, timeout=WAIT) == {"headers": largest, "forwarded": None}
        order = {"to": py.id, "command": "seen", "payload": None, "headers": largest}
        await py.request(peer.id, "call_with_headers", order, timeout=WAIT)
        assert calls == [largest]


async def test_events_and_commands_carry_headers_to_python_handlers(server: Any) -> None:
    async with py_agent(server, "py-headers-3") as py, py_agent(server, "py-headers-4") as other:
        got: asyncio.Queue[tuple[str, dict[str, str]]] = asyncio.Queue()

        @other.event("interop.headers.>")
        async def on_event(ctx: Context) -> None:
            await got.put(("event", dict(ctx.headers)))

        @other.command("note")
        async def note(ctx: Context) -> None:
            await got.put(("command", dict(ctx.headers)))

        await other.flush()
        await py.publish("interop.headers.one", 1, headers={"k": "event"})
        await py.send(other.id, "note", 1, headers={"k": "command"})
        assert await asyncio.wait_for(got.get(), WAIT) == ("event", {"k": "event"})
        assert await asyncio.wait_for(got.get(), WAIT) == ("command", {"k": "command"})
