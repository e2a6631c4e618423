"""Fixtures: a real nats-server with JetStream per test module, and the Rust side (the
`interop_peer` example and the `chorus` CLI), as built by `cargo build --workspace --examples`.

The server is ``NATS_SERVER`` (or ``.tools/bin/nats-server``, as ``scripts/install-nats-server``
puts it); the Rust binaries are looked up in ``CARGO_TARGET_DIR`` (or ``target``)."""

from __future__ import annotations

import collections
import os
import queue
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import asyncio
from typing import Any

import pytest

from chorus_sdk import Agent

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nats_server_binary() -> str:
    binary = os.environ.get("NATS_SERVER") or str(REPO / ".tools" / "bin" / "nats-server")
    if not Path(binary).exists() and shutil.which("nats-server"):
        binary = shutil.which("nats-server") or binary
    if not Path(binary).exists():
        pytest.fail("nats-server not found: run scripts/install-nats-server or set NATS_SERVER")
    return binary


def rust_binary(name: str, example: bool = False) -> str:
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    path = target / "debug" / ("examples" if example else "") / name
    if not path.exists():
        pytest.fail(f"{path} not built: run `cargo build --workspace --examples` first")
    return str(path)


class ChorusProcess:
    """A `chorus` command (``rust_binary("chorus") --server URL *args``) running beside a test,
    its standard output and error read line by line into :attr:`lines`."""

    def __init__(self, url: str, *args: str, cwd: Path | None = None, **env: str) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        # The last lines it printed, for a failure's message.
        self.recent: collections.deque[str] = collections.deque(maxlen=40)
        self.proc = subprocess.Popen(
            [rust_binary("chorus"), "--server", url, *args],
            env={**os.environ, "RUST_LOG": "warn", **env},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.recent.append(line.rstrip())
            self.lines.put(line.rstrip())

    def wait_for(self, text: str, within: float = 60.0) -> str:
        """The next line that contains ``text``, within ``within`` seconds."""
        deadline = time.monotonic() + within
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                printed = "\n".join(self.recent)
                raise AssertionError(
                    f"{self.proc.args!r} did not print {text!r} within {within:.0f} s; its last lines:\n{printed}")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if text in line:
                return line

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class NatsServer:
    """A nats-server with JetStream on a free loopback port, its store in a temporary dir."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="chorus-py-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [_nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self._dir.name],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    raise RuntimeError("nats-server did not start") from None
                time.sleep(0.02)

    def halt(self) -> None:
        """Stops the server, keeping its port and store: :meth:`start` brings it back."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def stop(self) -> None:
        self.halt()
        self._dir.cleanup()


@pytest.fixture(scope="module")
def server() -> Iterator[NatsServer]:
    s = NatsServer()
    s.start()
    yield s
    s.stop()


class RustPeer:
    """The `interop_peer` example running against a server, until stopped."""

    def __init__(self, url: str, id: str, **env: str) -> None:
        self.id = id
        self.lines: queue.Queue[str] = queue.Queue()
        # The last lines it printed, for a failure's message.
        self.recent: collections.deque[str] = collections.deque(maxlen=40)
        self.proc = subprocess.Popen(
            [rust_binary("interop_peer", example=True)],
            env={**os.environ, "CHORUS_NATS_URL": url, "PEER_ID": id, "RUST_LOG": "warn", **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + DEADLINE
        seen: list[str] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.stop()
                raise RuntimeError(f"interop_peer {id} not ready: {seen}")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            seen.append(line)
            if "interop_peer: ready" in line:
                return

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.recent.append(line.rstrip())
            self.lines.put(line.rstrip())

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def rust_peer(server: NatsServer) -> Iterator[type[RustPeer]]:
    """Starts Rust peers on the module's server; all are stopped after the test."""
    started: list[RustPeer] = []

    class Started(RustPeer):
        def __init__(self, id: str = "rust-peer", **env: str) -> None:
            super().__init__(server.url, id, **env)
            started.append(self)

    yield Started
    for peer in started:
        peer.stop()


def py_agent(server: NatsServer, id: str, **kw: Any) -> Agent:
    """A Python agent on ``server``, without heartbeats unless ``heartbeat_interval`` is given."""
    kw.setdefault("heartbeat_interval", 0)
    return Agent(id, servers=server.url, **kw)


async def eventually(what: str, check: Any, wait: float = DEADLINE, every: float = 0.1) -> Any:
    """What ``check()`` returns once it is true, asked every ``every`` seconds; fails the test
    with ``what`` if that is not within ``wait`` seconds."""
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        found = await check()
        if found:
            return found
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not within {wait} s")
        await asyncio.sleep(every)


class Coordinator(ChorusProcess):
    """`chorus serve` on a server, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(url, "serve", CHORUS_SERVE__METRICS_ADDR="127.0.0.1:0", RUST_LOG="info")
