"""Request-reply latency from Python, in one run: plain nats-py, Chorus Python -> Python, and
Chorus Python -> Rust (the `interop_peer` example), sequential requests with a 128-byte
payload, p50 and p99 of each. What the envelope costs in Python is the Chorus Python -> Python
figure less the plain one.

    .tools/python/bin/python python/benchmarks/latency.py [--requests 5000] [--encoding compact]

It starts its own nats-server (``NATS_SERVER`` or ``.tools/bin/nats-server``) on a free loopback
port, and the Rust peer from ``CARGO_TARGET_DIR`` (or ``target``)/debug or /release; build it
with ``cargo build --release -p agent-sdk --example interop_peer`` for figures that mean
something.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import nats

from chorus import Agent, Context, Encoding

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = bytes(range(128))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, deadline: float) -> None:
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"nothing listens on port {port}") from None
            time.sleep(0.02)


def peer_binary() -> Path:
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    for profile in ("release", "debug"):
        path = target / profile / "examples" / "interop_peer"
        if path.exists():
            return path
    raise SystemExit("build the Rust peer first: cargo build --release -p agent-sdk --example interop_peer")


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


async def measure(n: int, call: object) -> tuple[float, float]:
    assert callable(call)
    for _ in range(min(500, n // 5)):  # warm up
        await call()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1e6)
    return percentiles(samples)


async def run(url: str, n: int, encoding: Encoding) -> None:
    nc = await nats.connect(url)

    async def raw_echo(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("bench.raw.echo", cb=raw_echo)
    await nc.flush()

    async def raw() -> None:
        await nc.request("bench.raw.echo", PAYLOAD, timeout=5)

    async with Agent("bench-py-echo", servers=url, heartbeat_interval=0, encoding=encoding) as echo:

        @echo.command("echo")
        async def echo_back(ctx: Context) -> object:
            return ctx.data()

        async with Agent("bench-py-caller", servers=url, heartbeat_interval=0, encoding=encoding) as caller:

            async def py_to_py() -> None:
                await caller.request("bench-py-echo", "echo", PAYLOAD)

            async def py_to_rust() -> None:
                await caller.request("rust-peer", "echo", PAYLOAD)

            rows = [
                ("plain nats-py request-reply", await measure(n, raw)),
                (f"Chorus Python -> Python ({encoding.value})", await measure(n, py_to_py)),
                (f"Chorus Python -> Rust ({encoding.value})", await measure(n, py_to_rust)),
            ]
    await nc.close()
    print(f"request-reply latency from Python, {n} sequential requests, 128-byte payload (µs):")
    print(f"  {'path':<42} {'p50':>8} {'p99':>8}")
    for name, (p50, p99) in rows:
        print(f"  {name:<42} {p50:8.0f} {p99:8.0f}")
    envelope = rows[1][1][0] - rows[0][1][0]
    print(f"  the envelope's cost in Python (Python -> Python less plain), p50: {envelope / 1000:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--encoding", choices=[e.value for e in Encoding], default="compact")
    args = parser.parse_args()
    binary = os.environ.get("NATS_SERVER") or str(REPO / ".tools" / "bin" / "nats-server")
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as store:
        server = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        peer = None
        try:
            wait_for_port(port, time.monotonic() + 10)
            peer = subprocess.Popen([str(peer_binary())], env={**os.environ, "CHORUS_NATS_URL": url, "RUST_LOG": "warn"},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert peer.stdout is not None
            deadline = time.monotonic() + 20
            for line in peer.stdout:
                if "interop_peer: ready" in line:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit("the Rust peer did not start")
            asyncio.run(run(url, args.requests, Encoding(args.encoding)))
        finally:
            if peer is not None and peer.stdin is not None:
                peer.stdin.close()
                peer.wait(timeout=15)
            server.terminate()
            server.wait(timeout=10)


if __name__ == "__main__":
    main()
