"""An agent's life as its user sees it, in a process of its own: no bus, a bus that goes away
and comes back, Ctrl-C. What it prints is one line per change of the connection's state and
never a traceback; bounded tries end in one clear error. The programs run are the README's
greeter (taken from python/README.md as written there) and small variants of it."""

from __future__ import annotations

import asyncio
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from chorus_sdk import (
    Agent,
    Context,
    DecodeError,
    Encoding,
    Envelope,
    Kind,
    NoResponders,
    Performative,
    Refused,
    StatusCode,
    Subjects,
    decode,
    decode_payload,
    encode,
    encode_payload,
)

from .conftest import REPO, ChorusProcess, NatsServer, _free_port, eventually

WAIT = 30.0
README = REPO / "python" / "README.md"
README_URL = "nats://127.0.0.1:4222"


def readme_greeter() -> str:
    """The program of the README's "A first agent", as written there."""
    text = README.read_text()
    section = text[text.index("## A first agent") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "no Python program under 'A first agent'"
    program = match.group(1)
    assert README_URL in program
    return program


class Program:
    """A Python program run on its own, its standard output and error read line by line."""

    def __init__(self, path: Path, source: str) -> None:
        path.write_text(source)
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self.stdout: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # Ctrl-C as a terminal sends it: a shell may have started the tests with SIGINT ignored.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out, self.stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err, self.stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, lines: queue.Queue[str], kept: list[str]) -> None:
        for line in stream:
            kept.append(line.rstrip("\n"))
            lines.put(line.rstrip("\n"))

    def line(self, where: queue.Queue[str], pattern: str, wait: float = WAIT) -> str:
        """The next line on ``where`` that contains ``pattern``, within ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no line with {pattern!r} within {wait} s; stderr: {self.stderr}")
            try:
                line = where.get(timeout=remaining)
            except queue.Empty:
                continue
            if pattern in line:
                return line

    def wait(self, timeout: float = WAIT) -> int:
        """Its exit code, within ``timeout`` seconds."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running after {timeout} s; stderr: {self.stderr}") from None
        return code

    def interrupt(self) -> int:
        """Ctrl-C, and its exit code."""
        self.proc.send_signal(signal.SIGINT)
        return self.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stderr_lines(self) -> list[str]:
        """What it wrote on standard error, once it has exited (its pipes read to the end,
        within a deadline)."""
        for reader in self._readers:
            reader.join(timeout=5)
        return [line for line in self.stderr if line.strip()]


@pytest.fixture
def programs(tmp_path: Path) -> Iterator[Any]:
    started: list[Program] = []

    def run(source: str, name: str = "agent.py") -> Program:
        program = Program(tmp_path / name, source)
        started.append(program)
        return program

    yield run
    for program in started:
        program.kill()


async def answers(url: str, agent: str = "greeter") -> None:
    """Waits (within a deadline) until ``agent`` answers its ``hello`` (refused without a
    name: the answer shows it serves)."""
    deadline = time.monotonic() + WAIT
    async with Agent("py-asker", servers=url, heartbeat_interval=0, durable_inbox=False) as asker:
        while True:
            try:
                await asker.request(agent, "hello", "", timeout=1.0)
                return
            except Refused as e:
                assert e.status == StatusCode.INVALID_ARGUMENT and e.reason == "whom should I greet?"
                return
            except Exception:  # noqa: BLE001 - not there yet
                if time.monotonic() > deadline:
                    raise


class Heartbeats:
    """The heartbeats of agent ``agent`` on a bus, from now on."""

    def __init__(self, url: str, agent: str = "greeter") -> None:
        self.url = url
        self.agent = agent
        self.beats: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._nc: Any = None

    async def __aenter__(self) -> Heartbeats:
        self._nc = await nats.connect(self.url)

        async def beat(msg: Any) -> None:
            try:
                env = decode(msg.data, Subjects().implied(msg.subject))[0]
                manifest = decode_payload(env.payload, env.content_type)
            except DecodeError:
                return
            if isinstance(manifest, dict):
                await self.beats.put(manifest)

        await self._nc.subscribe(Subjects().heartbeat(self.agent), cb=beat)
        await self._nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._nc.close()

    async def serving(self, command: str = "hello") -> None:
        """Waits (within a deadline) for a heartbeat announcing ``command``: the agent sends it
        once that command is served, its durable inbox started."""
        deadline = asyncio.get_running_loop().time() + WAIT
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            assert remaining > 0, f"no heartbeat of {self.agent} announcing {command} within {WAIT} s"
            manifest = await asyncio.wait_for(self.beats.get(), remaining)
            if command in manifest.get("commands", []):
                return


def no_traceback(lines: list[str]) -> None:
    assert not any("Traceback" in line for line in lines), "\n".join(lines)


async def test_without_a_bus_the_readme_greeter_says_so_in_a_line_and_stops(programs: Any) -> None:
    url = f"nats://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    greeter = programs(readme_greeter().replace(README_URL, url))
    code = greeter.wait()
    lines = greeter.stderr_lines()
    no_traceback(lines)
    # One line for the first failure, one for the error it ends with; within the deadline.
    assert code == 1 and len(lines) <= 2, lines
    assert time.monotonic() - started < WAIT
    assert f"cannot connect to {url}" in lines[0], lines
    assert f"cannot reach the bus at {url} after 3 attempts" in lines[-1], lines
    assert "5019" in lines[-1] and "scripts/up" in lines[-1], lines


async def test_told_to_keep_trying_it_says_so_once_and_ctrl_c_ends_it_quietly(programs: Any) -> None:
    url = f"nats://127.0.0.1:{_free_port()}"
    program = readme_greeter().replace(README_URL, url)
    # Keeps trying (connect_attempts=None), and shows each try on its standard output.
    program = program.replace(
        f'servers="{url}"',
        f'servers="{url}", connect_attempts=None, nats_options={{"error_cb": tried, "reconnect_time_wait": 0.2}}',
    )
    program = program.replace("async def main", 'async def tried(e: Exception) -> None:\n    print("tried", flush=True)\n\nasync def main', 1)
    greeter = programs(program)
    for _ in range(5):
        greeter.line(greeter.out, "tried")
    assert greeter.interrupt() == 0
    lines = greeter.stderr_lines()
    no_traceback(lines)
    assert len(lines) == 1 and f"cannot connect to {url}" in lines[0] and "keeps trying" in lines[0], lines


async def test_a_lost_bus_is_said_once_and_its_return_once(programs: Any) -> None:
    server = NatsServer()
    server.start()
    try:
        async with Heartbeats(server.url) as heartbeats:
            greeter = programs(readme_greeter().replace(README_URL, server.url))
            # Everything started (its durable inbox too) before the server goes.
            await heartbeats.serving()
        server.halt()
        greeter.line(greeter.err, "disconnected from")
        server.start()
        greeter.line(greeter.err, "reconnected to")
        await answers(server.url)
        assert greeter.interrupt() == 0
        lines = greeter.stderr_lines()
        no_traceback(lines)
        assert len(lines) == 2, lines
        assert lines[0] == f"agent greeter: disconnected from {server.url} (nats: unexpected EOF); reconnecting"
        assert lines[1].startswith(f"agent greeter: reconnected to {server.url} (after ")
    finally:
        server.stop()


async def test_with_bounded_reconnects_a_lost_bus_ends_serve_forever_with_unreachable(programs: Any) -> None:
    server = NatsServer()
    server.start()
    try:
        program = readme_greeter().replace(README_URL, server.url)
        program = program.replace(
            f'servers="{server.url}"',
            f'servers="{server.url}", reconnect_attempts=2, nats_options={{"reconnect_time_wait": 0.2}}',
        )
        async with Heartbeats(server.url) as heartbeats:
            greeter = programs(program)
            await heartbeats.serving()
        server.halt()
        code = greeter.wait()
        lines = greeter.stderr_lines()
        no_traceback(lines)
        assert code == 1, lines
        gave_up = f"agent greeter lost its connection to {server.url} and gave up reconnecting after 2 attempts"
        # The disconnect, the giving up (logged), and the program's exit with that error.
        assert len(lines) == 3, lines
        assert lines[0].startswith(f"agent greeter: disconnected from {server.url}")
        assert lines[1].startswith(gave_up) and lines[2].startswith(f"5019 unavailable: {gave_up}"), lines
    finally:
        server.stop()


async def test_ctrl_c_on_the_readme_greeter_ends_it_quietly(server: Any, programs: Any) -> None:
    greeter = programs(readme_greeter().replace(README_URL, server.url))
    await answers(server.url)
    assert greeter.interrupt() == 0
    lines = greeter.stderr_lines()
    no_traceback(lines)
    assert lines == []
    # It said goodbye: nobody serves it any more.
    async with Agent("py-after", servers=server.url, heartbeat_interval=0, durable_inbox=False) as after:
        with pytest.raises(Exception) as gone:
            await after.request("greeter", "hello", "", timeout=1.0)
        assert getattr(gone.value, "status", None) in (StatusCode.NO_RESPONDERS, StatusCode.TIMEOUT)


async def test_a_python_agent_keeps_to_the_heartbeat_floor_its_coordinator_announces(server: NatsServer) -> None:
    """The coordinator paces a large fleet's heartbeats (docs/COORDINATOR.md): with one
    heartbeat a second allowed and one agent live it announces a 1 s floor on ``sys.wire``, and a
    Python agent beating every 0.2 s keeps to it, announces it in each beat, and stays live
    through silences that three of its own intervals would not cover."""
    coordinator = ChorusProcess(
        server.url,
        "serve",
        CHORUS_SERVE__METRICS_ADDR="127.0.0.1:0",
        CHORUS_SERVE__MAX_HEARTBEATS_PER_SECOND="1",
        CHORUS_SERVE__REAP_INTERVAL_MS="50",
    )
    try:
        async with Heartbeats(server.url, "py-paced") as heartbeats:
            async with Agent("py-paced", servers=server.url, heartbeat_interval=0.2, durable_inbox=False) as paced:
                deadline = asyncio.get_running_loop().time() + WAIT
                while True:
                    remaining = deadline - asyncio.get_running_loop().time()
                    assert remaining > 0, "no heartbeat announced the 1 s floor"
                    manifest = await asyncio.wait_for(heartbeats.beats.get(), remaining)
                    if manifest["heartbeat_ms"] == 1000:
                        break
                    assert manifest["heartbeat_ms"] == 200, manifest
                assert paced.beat_interval() == 1.0
                loop = asyncio.get_running_loop()
                at = loop.time()
                for _ in range(2):
                    # 0.8 s after a beat, past three of its own 0.2 s intervals: still found.
                    await asyncio.sleep(0.8)
                    found = [r for r in await paced.discover(timeout=WAIT) if r["manifest"]["agent"] == "py-paced"]
                    assert [r["manifest"]["heartbeat_ms"] for r in found] == [1000], found
                    manifest = await asyncio.wait_for(heartbeats.beats.get(), WAIT)
                    now = loop.time()
                    assert manifest["heartbeat_ms"] == 1000, manifest
                    assert now - at >= 0.9, f"a paced agent beat after {now - at:.2f} s, within its 1 s floor"
                    at = now
                await _a_newcomer_is_told_the_floor(server.url)
    finally:
        coordinator.stop()


async def _a_newcomer_is_told_the_floor(url: str) -> None:
    """A newcomer hears the floor at its first heartbeat, in a ``chorus-wire`` notification from
    the coordinator (docs/PROTOCOL.md section 3.5), not at the next announcement; its next
    heartbeat keeps to it, and no handler of its own sees the notification."""
    told: asyncio.Queue[Envelope] = asyncio.Queue()
    nc = await nats.connect(url)
    try:

        async def notified(msg: Any) -> None:
            await told.put(decode(msg.data, Subjects().implied(msg.subject))[0])

        await nc.subscribe(Subjects().notification("py-newcomer"), cb=notified)
        await nc.flush()
        async with Heartbeats(url, "py-newcomer") as heartbeats:
            async with Agent("py-newcomer", servers=url, heartbeat_interval=0.2, durable_inbox=False) as newcomer:
                seen: list[str] = []

                @newcomer.notification("*")
                async def anything(ctx: Context) -> None:
                    seen.append(ctx.envelope.name or "")

                env = await asyncio.wait_for(told.get(), WAIT)
                assert (env.from_, env.name) == ("coordinator", "chorus-wire")
                level = decode_payload(env.payload, env.content_type)
                assert isinstance(level, dict) and level["heartbeat_ms"] == 1000, level
                first = await asyncio.wait_for(heartbeats.beats.get(), WAIT)
                assert first["heartbeat_ms"] == 200, first
                # (A beat for the handler registered above may come before the floor is heard.)
                later: list[int] = []
                while not later or later[-1] < 1000:
                    assert len(later) < 4, f"the newcomer kept beating fast: {later}"
                    later.append((await asyncio.wait_for(heartbeats.beats.get(), WAIT))["heartbeat_ms"])
                assert newcomer.beat_interval() >= 1.0
                assert seen == []
    finally:
        await nc.close()


async def test_a_wire_notification_sets_the_floor_only_from_the_coordinator(server: NatsServer) -> None:
    """A ``chorus-wire`` notification from ``coordinator`` gives a Python agent the heartbeat
    floor as the announcement on ``sys.wire`` does, and no handler sees it; from any other
    sender it is an ordinary notification and the floor stays as it was (no coordinator runs
    here: nothing announces)."""
    nc = await nats.connect(server.url)
    try:

        async def tell(sender: str, floor_ms: int) -> None:
            env = Envelope.new(Kind.NOTIFICATION, Performative.INFORM, sender)
            env.to, env.name = ["py-floored"], "chorus-wire"
            env.payload = encode_payload({"major": 2, "heartbeat_ms": floor_ms})
            await nc.publish(Subjects().notification("py-floored"), encode(env, Encoding.MSGPACK))
            await nc.flush()

        async with Agent("py-floored", servers=server.url, heartbeat_interval=0.2, durable_inbox=False) as agent:
            seen: list[tuple[str, str]] = []

            @agent.notification("*")
            async def anything(ctx: Context) -> None:
                seen.append((ctx.envelope.from_, ctx.envelope.name or ""))

            async def forged_handled() -> bool:
                return seen == [("mallory", "chorus-wire")]

            async def floor_taken() -> bool:
                return agent.beat_interval() == 1.5

            await tell("mallory", 1500)
            await eventually("the forged one handled as any other", forged_handled)
            assert agent.beat_interval() == 0.2
            await tell("coordinator", 1500)
            await eventually("the floor taken", floor_taken)
            assert seen == [("mallory", "chorus-wire")]
            assert agent.stats.notifications_unhandled == 0
    finally:
        await nc.close()


async def test_a_request_that_comes_while_the_agent_starts_waits_for_the_handler_registered_after_it(server: NatsServer) -> None:
    """The README's pattern, handlers registered right after ``async with Agent(...)``: a
    request the agent takes while it is still starting (here held at a gate before its start
    ends) is handled once it has started, by that handler, not refused with 5016."""
    gate = asyncio.Event()

    class SlowStart(Agent):
        async def _start(self) -> None:
            await super()._start()
            await gate.wait()

    late = SlowStart("late-greeter", servers=server.url, heartbeat_interval=0)

    async def serve() -> None:
        async with late:

            @late.command("hello")
            async def hello(ctx: Context) -> str:
                return f"hello, {ctx.data()}"

            await late.until_stopping()

    async with Agent("early-asker", servers=server.url, heartbeat_interval=0) as asker:

        async def ask() -> Any:
            deadline = asyncio.get_running_loop().time() + WAIT
            while True:
                try:
                    return await asker.request("late-greeter", "hello", "ada", timeout=WAIT)
                except NoResponders:
                    # Not subscribed yet.
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.01)

        serving = asyncio.ensure_future(serve())
        try:
            asking = asyncio.ensure_future(ask())

            async def waiting() -> bool:
                return late._waiting == 1

            # Subscribed but not started: the request is taken and waits.
            await eventually("the request taken while the agent starts", waiting, wait=WAIT, every=0.01)
            assert not asking.done()
            gate.set()
            assert await asyncio.wait_for(asking, WAIT) == "hello, ada"
            assert late.stats.unknown_command == 0
        finally:
            gate.set()
            await late.shutdown()
            await asyncio.wait_for(serving, WAIT)
