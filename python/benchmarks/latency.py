"""Request-reply latency from Python, in one run: plain nats-py, Chorus Python -> Python, and
Chorus Python -> Rust (the `interop_peer` example), sequential requests with a 128-byte
payload, p50 and p99 of each; and, to tell the envelope's share from the agent's, plain nats-py
writing and reading the envelope itself (codec only, no agent). The Python responders run in a
process of their own, as the Rust one does. What the envelope costs in Python is the
"with the envelope" figure less the plain one, round by round (the median of the rounds'
differences); what the whole SDK costs, the Chorus Python -> Python figure less the plain one.

    .tools/python/bin/python python/benchmarks/latency.py [--requests 10000] [--rounds 20] [--encoding compact]

It starts its own nats-server (``NATS_SERVER`` or ``.tools/bin/nats-server``) on a free loopback
port, and the Rust peer from ``CARGO_TARGET_DIR`` (or ``target``)/debug or /release; build it
with ``cargo build --release -p chorus-sdk --example interop_peer`` for figures that mean
something. With the compiled codec installed (``chorus-sdk[speedups]``, as
``scripts/install-python-sdk`` installs it) both ends use it; ``CHORUS_SPEEDUPS=0`` measures
the pure-Python codec instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from chorus_sdk import Agent, Context, Encoding, Envelope, Kind, Performative, Subjects, codec, decode, encode

REPO = Path(__file__).resolve().parents[2]
# A 128-byte MessagePack payload (a string of 126 characters), the same on every path.
PAYLOAD = "x" * 126
RAW = b"\xd9\x7e" + PAYLOAD.encode()


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
    raise SystemExit("build the Rust peer first: cargo build --release -p chorus-sdk --example interop_peer")


async def measure(rounds: int, n: int, calls: list[Any]) -> tuple[list[tuple[float, float]], list[list[float]]]:
    """p50 and p99 of each call, measured in interleaved rounds of ``n`` so that drift on a
    busy machine touches every path alike: the p50 is the median of the rounds' medians. Also
    each round's median per call, for differences taken round by round."""
    for call in calls:
        for _ in range(200):  # warm up
            await call()
    medians: list[list[float]] = [[] for _ in calls]
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for i, call in enumerate(calls):
            times = []
            for _ in range(n):
                start = time.perf_counter()
                await call()
                times.append((time.perf_counter() - start) * 1e6)
            medians[i].append(statistics.median(times))
            samples[i] += times
    out = []
    for i in range(len(calls)):
        ordered = sorted(samples[i])
        out.append((statistics.median(medians[i]), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]))
    return out, medians


def cost(medians: list[list[float]], row: int) -> float:
    """What ``row`` adds to plain nats-py (row 0): the median over rounds of the difference of
    the two in the same round, which a machine slowing down or speeding up between rounds
    does not move."""
    return statistics.median(m - p for m, p in zip(medians[row], medians[0]))


async def serve(url: str, encoding: Encoding) -> None:
    """The responders, in a process of their own (as the Rust peer is): a plain nats-py echo
    and a Chorus echo agent, until standard input closes."""
    nc = await nats.connect(url)

    async def raw_echo(msg: Any) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("bench.raw.echo", cb=raw_echo)
    subjects = Subjects()

    async def envelope_echo(msg: Any) -> None:
        # The envelope alone, without the agent around it: decode, answer, encode.
        request, _ = decode(msg.data, subjects.implied(msg.subject))
        reply = Envelope.new(Kind.RESPONSE, Performative.INFORM, "bench-py-envelope")
        reply.in_reply_to, reply.correlation_id, reply.to = request.id, request.conversation, [request.from_]
        reply.status, reply.payload = 5002, request.payload
        await msg.respond(encode(reply, encoding))

    await nc.subscribe("chorus.agent.bench-py-envelope.echo", cb=envelope_echo)
    await nc.flush()
    async with Agent("bench-py-echo", servers=url, heartbeat_interval=0, encoding=encoding) as echo:

        @echo.command("echo")
        async def echo_back(ctx: Context) -> object:
            return ctx.data()

        await echo.flush()
        print("responders ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await nc.close()


async def run(url: str, n: int, rounds: int, encoding: Encoding) -> None:
    nc = await nats.connect(url)

    async def raw() -> None:
        await nc.request("bench.raw.echo", RAW, timeout=5)

    subjects = Subjects()
    envelope_subject = subjects.command("bench-py-envelope", "echo")
    implied = subjects.implied(envelope_subject)

    async def envelope_only() -> None:
        request = Envelope.new(Kind.REQUEST, Performative.REQUEST, "bench-py-caller")
        request.to, request.name, request.payload = ["bench-py-envelope"], "echo", RAW
        msg = await nc.request(envelope_subject, encode(request, encoding, implied), timeout=5)
        decode(msg.data)

    async with Agent("bench-py-caller", servers=url, heartbeat_interval=0, encoding=encoding) as caller:

        async def py_to_py() -> None:
            await caller.request("bench-py-echo", "echo", PAYLOAD)

        async def py_to_rust() -> None:
            await caller.request("rust-peer", "echo", PAYLOAD)

        figures, medians = await measure(rounds, n // rounds, [raw, envelope_only, py_to_py, py_to_rust])
    names = [
        "plain nats-py request-reply",
        f"nats-py with the envelope ({encoding.value})",
        f"Chorus Python -> Python ({encoding.value})",
        f"Chorus Python -> Rust ({encoding.value})",
    ]
    rows = list(zip(names, figures))
    await nc.close()
    print(f"request-reply latency from Python, {n} sequential requests per path in {rounds} interleaved rounds, 128-byte payload (µs):")
    which = "compiled (chorus-sdk[speedups])" if codec.SPEEDUPS else "pure Python (CHORUS_SPEEDUPS=0 or chorus-sdk[speedups] not installed)"
    print(f"  the compact codec, both ends: {which}")
    print(f"  {'path':<42} {'p50':>8} {'p99':>8}")
    for name, (p50, p99) in rows:
        print(f"  {name:<42} {p50:8.0f} {p99:8.0f}")
    print("  costs, the median over rounds of each round's p50 less plain nats-py's in that round:")
    print(f"  the envelope's cost in Python, both ends (with the envelope less plain): {cost(medians, 1) / 1000:.3f} ms")
    print(f"  the SDK's cost in Python, both ends (Python -> Python less plain): {cost(medians, 2) / 1000:.3f} ms")
    print("  this machine's yardstick, in-process with nothing else running (the CPU the envelope needs,")
    print(f"  without the wait for a scheduler: a request and its reply each written and read): {yardstick(encoding):.1f} µs")


def yardstick(encoding: Encoding, n: int = 20_000) -> float:
    """The CPU time, in µs, of writing and reading a request and its reply in ``encoding``,
    in this process alone: what the envelope costs where no other process waits for a core.
    The latency costs above include that wait; on a contended machine they grow while this
    stays, which tells a slow machine from a slow SDK."""
    request = Envelope.new(Kind.REQUEST, Performative.REQUEST, "bench-py")
    request.to, request.name, request.payload = ["bench-py-echo"], "echo", RAW
    reply = Envelope.new(Kind.RESPONSE, Performative.INFORM, "bench-py-echo")
    reply.status, reply.in_reply_to, reply.payload = 5002, request.id, RAW
    subjects = Subjects()
    implied = subjects.implied(subjects.command("bench-py-echo", "echo"))
    started = time.process_time()
    for _ in range(n):
        decode(encode(request, encoding, implied), implied)
        decode(encode(reply, encoding))
    return (time.process_time() - started) / n * 1e6


def started(proc: subprocess.Popen[str], marker: str) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + 20
    for line in proc.stdout:
        if marker in line:
            return
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"{proc.args} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--encoding", choices=[e.value for e in Encoding], default="compact")
    parser.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    encoding = Encoding(args.encoding)
    if args.serve:
        asyncio.run(serve(args.serve, encoding))
        return
    binary = os.environ.get("NATS_SERVER") or str(REPO / ".tools" / "bin" / "nats-server")
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as store:
        server = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        children: list[subprocess.Popen[str]] = []
        try:
            wait_for_port(port, time.monotonic() + 10)
            peer = subprocess.Popen([str(peer_binary())], env={**os.environ, "CHORUS_NATS_URL": url, "RUST_LOG": "warn"},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            children.append(peer)
            started(peer, "interop_peer: ready")
            responders = subprocess.Popen([sys.executable, __file__, "--serve", url, "--encoding", encoding.value],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            children.append(responders)
            started(responders, "responders ready")
            asyncio.run(run(url, args.requests, args.rounds, encoding))
        finally:
            for child in children:
                if child.stdin is not None:
                    child.stdin.close()
                try:
                    child.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    child.kill()
            server.terminate()
            server.wait(timeout=10)


if __name__ == "__main__":
    main()
