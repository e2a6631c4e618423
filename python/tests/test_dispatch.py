"""Messages taken as the connection reads them (``chorus_sdk._dispatch``), against a real
nats-server: a request's reply wakes its request and no other, a late reply is nobody's, no
responders and timeouts raise what nats-py's ``request`` raises, a taker that fails does not
stop the connection, and the path for a nats-py the SDK was not tested with (a callback per
subscription) delivers the same."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.msg import Msg

from chorus_sdk import Context, StatusCode, _dispatch
from chorus_sdk._connection import settle
from chorus_sdk._dispatch import Replies, _tested, subscribe

from .conftest import py_agent

WAIT = 10.0


def test_the_read_loop_path_is_taken_only_with_a_tested_nats_py() -> None:
    assert _tested("2.7.0") and _tested("2.16.0") and _tested("2.16.3")
    assert not _tested("2.6.9") and not _tested("2.17.0") and not _tested("3.0.0")
    assert not _tested("0") and not _tested("2.x") and not _tested("")
    # The one this SDK is tested with (python/constraints.txt) takes it.
    assert _dispatch.DIRECT


async def _echo(nc: Any, subject: str, delay: float = 0.0) -> Any:
    async def answer(msg: Msg) -> None:
        if delay:
            await asyncio.sleep(delay)
        await msg.respond(b"re:" + msg.data)

    return await nc.subscribe(subject, cb=answer)


async def test_each_reply_wakes_its_own_request(server: Any) -> None:
    nc = await nats.connect(server.url)
    try:
        await _echo(nc, "dispatch.echo")
        replies = Replies()
        bodies = [f"m{i}".encode() for i in range(200)]
        got = await asyncio.wait_for(
            asyncio.gather(*(replies.request(nc, "dispatch.echo", b, WAIT) for b in bodies)), WAIT
        )
        assert [m.data for m in got] == [b"re:" + b for b in bodies]
        assert replies.waiting == 0
    finally:
        await nc.close()


async def test_a_late_reply_is_nobodys_and_timeouts_and_no_responders_raise_as_nats_py_does(server: Any) -> None:
    nc = await nats.connect(server.url)
    try:
        await _echo(nc, "dispatch.slow", delay=0.5)
        await _echo(nc, "dispatch.fast")
        replies = Replies()
        with pytest.raises(nats.errors.TimeoutError):
            await replies.request(nc, "dispatch.slow", b"late", 0.1)
        assert replies.waiting == 0
        # The slow reply arrives while this one waits: it does not answer it.
        msg = await replies.request(nc, "dispatch.slow", b"second", WAIT)
        assert msg.data == b"re:second"
        with pytest.raises(nats.errors.NoRespondersError):
            await replies.request(nc, "dispatch.nobody", b"x", WAIT)
        # A request cancelled while it waits leaves nothing behind.
        waiting = asyncio.ensure_future(replies.request(nc, "dispatch.slow", b"cancelled", WAIT))
        while replies.waiting == 0:
            await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert replies.waiting == 0
        # An inbox let go: the next request makes another, on the same connection.
        for sub in replies.stop():
            await sub.unsubscribe()
        assert (await replies.request(nc, "dispatch.fast", b"again", WAIT)).data == b"re:again"
    finally:
        await nc.close()


async def test_a_taker_that_fails_leaves_the_connection_reading(server: Any, caplog: pytest.LogCaptureFixture) -> None:
    nc = await nats.connect(server.url)
    try:
        taken: list[bytes] = []

        def take(msg: Msg) -> None:
            if msg.data == b"boom":
                raise RuntimeError("boom")
            taken.append(msg.data)

        await subscribe(nc, "dispatch.taker", take)
        with caplog.at_level(logging.ERROR, logger="chorus_sdk"):
            for body in (b"one", b"boom", b"two"):
                await nc.publish("dispatch.taker", body)
            await nc.flush()
            deadline = asyncio.get_running_loop().time() + WAIT
            while len(taken) < 2 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
        assert taken == [b"one", b"two"]
        assert "a message on dispatch.taker was not taken" in caplog.text
        # The connection still answers.
        await nc.flush(timeout=WAIT)
    finally:
        await nc.close()


async def test_with_an_untested_nats_py_agents_talk_through_callbacks(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_dispatch, "DIRECT", False)
    async with py_agent(server, "dispatch-callee") as callee, py_agent(server, "dispatch-caller") as caller:

        @callee.command("twice")
        async def twice(ctx: Context) -> int:
            return int(ctx.data()) * 2

        await callee.flush()
        assert all(sub._cb is not None for sub in callee._subs)
        assert await caller.request("dispatch-callee", "twice", 21, timeout=WAIT) == 42
        with pytest.raises(Exception) as refused:
            await caller.request("dispatch-nobody", "twice", 1, timeout=WAIT)
        assert getattr(refused.value, "status", None) == StatusCode.NO_RESPONDERS


async def test_agents_take_their_messages_in_the_read_loop(server: Any) -> None:
    async with py_agent(server, "dispatch-direct") as callee, py_agent(server, "dispatch-asker") as caller:

        @callee.command("twice")
        async def twice(ctx: Context) -> int:
            return int(ctx.data()) * 2

        await callee.flush()
        # No task of nats-py's own per subscription: the read loop hands messages over.
        inbound = callee._subs[0]
        assert inbound._cb is None and inbound._wait_for_msgs_task is None
        results = await asyncio.wait_for(
            asyncio.gather(*(caller.request("dispatch-direct", "twice", i, timeout=WAIT) for i in range(50))), WAIT
        )
        assert results == [i * 2 for i in range(50)]
        assert caller._replies.waiting == 0


async def test_settle_returns_once_the_server_has_the_subscriptions_queued_before_it(server: Any) -> None:
    """nats-py's ``flush`` writes its PING ahead of commands still queued for its writer: the
    PONG can come back before the server has a subscription just made. ``settle`` waits for
    a PING written after them (the bytes the connection writes, in order)."""
    nc = await nats.connect(server.url)
    try:
        written: list[bytes] = []
        transport = nc._transport
        assert transport is not None
        write, writelines = transport.write, transport.writelines

        def record(data: bytes) -> None:
            written.append(bytes(data))
            write(data)

        def record_lines(lines: list[bytes]) -> None:
            written.extend(bytes(line) for line in lines)
            writelines(lines)

        transport.write = record  # type: ignore[method-assign]
        transport.writelines = record_lines  # type: ignore[method-assign]
        try:
            await nc.subscribe("settle.a", cb=_ignore)
            await nc.flush()
            # What nats-py does alone: the PING went first.
            assert written.index(b"PING\r\n") < next(i for i, w in enumerate(written) if w.startswith(b"SUB settle.a"))
            written.clear()
            await nc.subscribe("settle.b", cb=_ignore)
            await settle(nc)
            sub = next(i for i, w in enumerate(written) if w.startswith(b"SUB settle.b"))
            last_ping = max(i for i, w in enumerate(written) if w == b"PING\r\n")
            assert last_ping > sub, written
        finally:
            transport.write, transport.writelines = write, writelines  # type: ignore[method-assign]
    finally:
        await nc.close()


async def _ignore(msg: Msg) -> None:
    return None
