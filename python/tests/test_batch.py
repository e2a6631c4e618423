"""Automatic batching (issue 39, item 4), as the Rust SDK's ``Batcher`` does it: a batch leaves
when it holds N messages, T seconds after its first one, or on flush; each message still
reaches its receiver as its own envelope, in order; durable commands come back with their
stream sequences; what is queued when the agent shuts down is sent, and queuing after is
refused; ``[batching]`` in an agent's configuration file (or ``batching=``) is what
``agent.batcher()`` batches by when not told. A Rust agent (the interop peer) receives a Python
batch like any other."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from chorus_sdk import MAX_BATCH_DELAY, MAX_BATCH_MESSAGES, Agent, Batching, ChorusError, Context, StatusCode
from chorus_sdk.envelope import Delivery

from .conftest import eventually, py_agent

WAIT = 10.0


async def _listener(server: Any, id: str) -> tuple[Agent, asyncio.Queue[tuple[Any, str]]]:
    got: asyncio.Queue[tuple[Any, str]] = asyncio.Queue()
    listener = py_agent(server, id)
    await listener.connect()

    @listener.event("ticks")
    async def on_tick(ctx: Context) -> None:
        await got.put((ctx.data(), str(ctx.envelope.id)))

    await listener.flush()
    return listener, got


async def test_a_batch_leaves_when_full_or_flushed_and_each_message_is_its_own_envelope(server: Any) -> None:
    listener, got = await _listener(server, "py-batch-listener")
    async with py_agent(server, "py-full-batches") as publisher:
        batcher = publisher.batcher(max_messages=10, max_delay=50.0)
        queued = [await batcher.publish("ticks", n) for n in range(25)]
        # Two full batches leave by size; the five after them wait (the delay is 50 s).
        seen = [await asyncio.wait_for(got.get(), WAIT) for _ in range(20)]

        async def two_batches() -> bool:
            return publisher.stats.batches_sent == 2

        await eventually("two batches counted", two_batches)
        assert publisher.stats.batched_messages == 20
        assert got.empty()
        await asyncio.wait_for(batcher.flush(), WAIT)
        seen += [await asyncio.wait_for(got.get(), WAIT) for _ in range(5)]
        await asyncio.wait_for(asyncio.gather(*queued), WAIT)
        assert [n for n, _ in seen] == list(range(25))
        assert len({i for _, i in seen}) == 25, "each event is its own envelope"
        assert (publisher.stats.batches_sent, publisher.stats.batched_messages) == (3, 25)
        # The metrics say the same, as the Rust SDK's do.
        from chorus_sdk import metrics

        text = metrics.registry().render()
        assert 'chorus_agent_batched_total{agent="py-full-batches",unit="batches"} 3' in text, text
        assert 'chorus_agent_batched_total{agent="py-full-batches",unit="messages"} 25' in text, text
        await batcher.close()
    await listener.shutdown()


async def test_a_batch_that_does_not_fill_leaves_after_its_delay(server: Any) -> None:
    listener, got = await _listener(server, "py-delay-listener")
    async with py_agent(server, "py-delayed") as publisher:
        delay = 0.4
        loop = asyncio.get_running_loop()
        async with publisher.batcher(max_messages=1000, max_delay=delay) as batcher:
            started = loop.time()
            queued = [await batcher.publish("ticks", n) for n in range(3)]
            await asyncio.wait_for(asyncio.gather(*queued), WAIT)
            assert loop.time() - started >= delay * 0.99
            assert [(await asyncio.wait_for(got.get(), WAIT))[0] for _ in range(3)] == [0, 1, 2]
            assert (publisher.stats.batches_sent, publisher.stats.batched_messages) == (1, 3)
    await listener.shutdown()


async def test_commands_through_a_batcher_are_stored_with_their_sequences_and_handled(server: Any) -> None:
    handled: list[int] = []
    async with py_agent(server, "py-batch-worker") as worker:

        @worker.command("work")
        async def work(ctx: Context) -> None:
            handled.append(ctx.data())

        async def inbox_started() -> bool:
            return worker._durable is not None and worker._durable._started

        await eventually("the durable inbox started", inbox_started)
        async with py_agent(server, "py-batch-sender") as sender:
            async with sender.batcher(max_messages=16, max_delay=0.02) as batcher:
                queued = []
                for n in range(40):
                    delivery = Delivery.AT_MOST_ONCE if n % 4 == 3 else Delivery.AT_LEAST_ONCE
                    queued.append((delivery, await batcher.send("py-batch-worker", "work", n, delivery=delivery)))
                stored = []
                for delivery, sent in queued:
                    seq = await asyncio.wait_for(sent, WAIT)
                    if delivery is Delivery.AT_LEAST_ONCE:
                        assert seq > 0
                        stored.append(seq)
                    else:
                        assert seq == 0
                assert len(set(stored)) == 30, "each durable command stored once"

            async def all_handled() -> bool:
                return len(handled) >= 40

            await eventually("the worker handled all 40", all_handled)
            assert sorted(handled) == list(range(40))
            assert sender.stats.batched_messages == 40
            assert sender.stats.batches_sent >= 3


async def test_shutdown_sends_what_is_queued_and_refuses_more(server: Any) -> None:
    listener, got = await _listener(server, "py-shutdown-listener")
    publisher = py_agent(server, "py-shutdown-publisher")
    await publisher.connect()
    for bad in ({"max_messages": 0}, {"max_messages": MAX_BATCH_MESSAGES + 1}, {"max_delay": 0.0}, {"max_delay": MAX_BATCH_DELAY + 1}):
        with pytest.raises(ChorusError) as refused:
            publisher.batcher(**bad)
        assert refused.value.status == StatusCode.INVALID_ARGUMENT, bad
    batcher = publisher.batcher(max_delay=50.0)
    queued = [await batcher.publish("ticks", n) for n in range(5)]
    await asyncio.wait_for(publisher.shutdown(), WAIT)
    await asyncio.wait_for(asyncio.gather(*queued), WAIT)
    assert [(await asyncio.wait_for(got.get(), WAIT))[0] for _ in range(5)] == list(range(5))
    with pytest.raises(ChorusError) as refused:
        await batcher.publish("ticks", 5)
    assert refused.value.status == StatusCode.UNAVAILABLE
    await listener.shutdown()


async def test_the_configuration_files_batching_is_what_batcher_uses_when_not_told(server: Any, tmp_path: Path) -> None:
    """002's ``flow_control`` in an agent's configuration file, as the Rust e2e
    ``batching::the_configuration_file_s_batching_is_the_default_batcher_s``: ``[batching]``
    sets what ``agent.batcher()`` batches by, here 3 messages and a delay too long to matter."""
    listener, got = await _listener(server, "py-config-listener")
    path = tmp_path / "batches.toml"
    path.write_text(
        f'id = "py-configured-batches"\n[bus]\nservers = "{server.url}"\n'
        "[monitoring]\nheartbeat_interval_ms = 0\n"
        "[batching]\nmax_messages = 3\nmax_delay_ms = 50000\n"
    )
    async with Agent.from_config(path) as publisher:
        assert publisher.batching == Batching(3, 50.0)
        batcher = publisher.batcher()
        assert (batcher.max_messages, batcher.max_delay) == (3, 50.0)
        queued = [await batcher.publish("ticks", n) for n in range(3)]
        # Three make a full batch: it leaves without a flush, long before its delay.
        seen = [(await asyncio.wait_for(got.get(), WAIT))[0] for _ in range(3)]
        await asyncio.wait_for(asyncio.gather(*queued), WAIT)
        assert seen == [0, 1, 2]

        async def one_batch() -> bool:
            return publisher.stats.batches_sent == 1

        await eventually("one batch counted", one_batch, WAIT)
        assert publisher.stats.batched_messages == 3
        from chorus_sdk import metrics

        text = metrics.registry().render()
        assert 'chorus_agent_batched_total{agent="py-configured-batches",unit="batches"} 1' in text, text
        assert 'chorus_agent_batched_total{agent="py-configured-batches",unit="messages"} 3' in text, text
        # What the call says wins, each setting on its own; the other stays the agent's.
        told = publisher.batcher(max_messages=2)
        assert (told.max_messages, told.max_delay) == (2, 50.0)
        quick = publisher.batcher(max_delay=0.01)
        assert (quick.max_messages, quick.max_delay) == (3, 0.01)
        await told.close()
        await quick.close()
        await batcher.close()
    await listener.shutdown()


def test_an_agents_batching_is_checked_when_it_is_made() -> None:
    assert Agent("py-default-batching").batching == Batching(100, 0.005), "Batching::new()'s 100 or 5 ms"
    assert Agent("py-pair-batching", batching=(7, 0.25)).batching == Batching(max_messages=7, max_delay=0.25)
    for bad in [(0, 0.005), (MAX_BATCH_MESSAGES + 1, 0.005), (10, 0.0), (10, MAX_BATCH_DELAY + 1), (True, 0.1), (10,)]:
        with pytest.raises(ValueError, match="batching"):
            Agent("py-bad-batching", batching=bad)  # type: ignore[arg-type]
