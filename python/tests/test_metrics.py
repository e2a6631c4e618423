"""Prometheus metrics of a Python agent: the same `chorus_agent_*` series as a Rust agent's
(names, types, labels, and values that match the same traffic), output that Prometheus's own
`promtool` accepts, a listener announced in the manifest that the coordinator's service
discovery (`/sd/agents`) hands to Prometheus, and the listener's rules (loopback unless TLS or
plain HTTP is asked for, one listener per address in a process). The Rust side is
`agent-sdk/examples/interop_peer/metrics.rs`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import nats
import pytest

from chorus_sdk import Agent, BreakerPolicy, ChorusError, Context, StatusCode, metrics

from .conftest import ChorusProcess, NatsServer, _free_port, eventually, rust_binary

WAIT = 15.0
# The traffic each agent (the Python one and the Rust one) gets from a driver.
ECHOES = 5
ASKS = 3
PINGS = 2
FAILED_ASKS = 2

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Scrape:
    """One scrape in the text exposition format: each family's type, and its samples."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types: dict[str, str] = {}
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                self.types[name] = kind
            elif line and not line.startswith("#"):
                m = _SAMPLE.match(line)
                assert m is not None, f"not a sample line: {line!r}"
                labels = dict(_LABEL.findall(m.group(2) or ""))
                self.samples.append((m.group(1), labels, float(m.group(3))))

    def family(self, sample: str) -> str:
        for suffix in ("_bucket", "_sum", "_count"):
            base = sample[: -len(suffix)] if sample.endswith(suffix) else None
            if base is not None and self.types.get(base) == "histogram":
                return base
        return sample

    def shape(self, prefix: str, agent: str | None = None) -> dict[str, tuple[str, frozenset[str]]]:
        """Each family named ``prefix...`` with a series (of ``agent``, when given): its type
        and the label names of its series (``le`` left out)."""
        found: dict[str, tuple[str, set[str]]] = {}
        for name, labels, _ in self.samples:
            family = self.family(name)
            if not family.startswith(prefix) or (agent is not None and labels.get("agent") != agent):
                continue
            kind, names = found.setdefault(family, (self.types[family], set()))
            names.update(k for k in labels if k != "le")
        return {family: (kind, frozenset(names)) for family, (kind, names) in found.items()}

    def value(self, sample: str, **labels: str) -> float:
        """The value of the one sample named ``sample`` with ``labels`` (among others); 0 when
        there is none."""
        hits = [v for name, have, v in self.samples if name == sample and all(have.get(k) == w for k, w in labels.items())]
        assert len(hits) <= 1, f"{sample} {labels}: {len(hits)} samples"
        return hits[0] if hits else 0.0


def fetch(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=5, context=context) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return str(answer.read().decode())


async def scrape(url: str) -> Scrape:
    return Scrape(await asyncio.to_thread(fetch, url))


def expected(agent: str) -> list[tuple[str, dict[str, str], float]]:
    """What the driver's traffic makes each agent count: ECHOES echoes, a failure, an unknown
    command, ASKS asks (each an echo of the other agent in turn), FAILED_ASKS asks of nobody,
    PINGS events (each answered with a pong)."""
    requests_ok = ECHOES + 2 * ASKS
    answered = requests_ok + 2 + FAILED_ASKS
    return [
        ("chorus_agent_messages_total", {"kind": "request", "status": "ok"}, requests_ok),
        ("chorus_agent_messages_total", {"kind": "request", "status": "invalid_argument"}, 1),
        ("chorus_agent_messages_total", {"kind": "request", "status": "unknown_command"}, 1),
        ("chorus_agent_messages_total", {"kind": "request", "status": "no_responders"}, FAILED_ASKS),
        ("chorus_agent_messages_total", {"kind": "event", "status": "ok"}, PINGS),
        ("chorus_agent_request_duration_seconds_count", {"status": "ok"}, ASKS),
        ("chorus_agent_request_duration_seconds_count", {"status": "no_responders"}, FAILED_ASKS),
        ("chorus_agent_request_duration_seconds_bucket", {"status": "ok", "le": "+Inf"}, ASKS),
        ("chorus_agent_traffic_total", {"direction": "received"}, answered + PINGS),
        ("chorus_agent_traffic_total", {"direction": "replies_sent"}, answered),
        ("chorus_agent_traffic_total", {"direction": "requests_sent"}, ASKS + FAILED_ASKS),
        ("chorus_agent_traffic_total", {"direction": "events_published"}, PINGS),
        ("chorus_agent_traffic_total", {"direction": "reply_failures"}, 0),
        ("chorus_agent_refusals_total", {"reason": "unknown_command"}, 1),
        ("chorus_agent_refusals_total", {"reason": "expired"}, 0),
        ("chorus_agent_connection_events_total", {"event": "disconnects"}, 0),
        ("chorus_agent_inbox_consumers_total", {"event": "opened"}, 0),
        ("chorus_agent_in_flight", {}, 0),
        ("chorus_agent_circuit_state", {"destination": "agent:nobody"}, 2),
        ("chorus_agent_circuits_opened_total", {"destination": "agent:nobody"}, 1),
    ]


def serving_agent(server: Any, id: str, **kw: Any) -> Agent:
    """A Python agent that serves what the Rust peer serves for this traffic: `echo`, `fail`
    (5018), `ask` (asks another agent in turn), and pongs to `interop.ping.>`."""
    agent = Agent(id, servers=server.url, heartbeat_interval=0, **kw)

    @agent.command("echo")
    async def echo(ctx: Context) -> Any:
        return ctx.data()

    @agent.command("fail")
    async def fail(ctx: Context) -> None:
        raise ChorusError(StatusCode.INVALID_ARGUMENT, "asked to fail")

    @agent.command("ask")
    async def ask(ctx: Context) -> Any:
        order = ctx.data()
        return await agent.request(order["to"], order["command"], order.get("payload"), parent=ctx.envelope)

    @agent.event("interop.ping.>")
    async def ping(ctx: Context) -> None:
        await agent.publish("interop.pong", {"from": ctx.sender, "topic": ctx.topic, "payload": ctx.data()}, parent=ctx.envelope)

    return agent


def promtool() -> str:
    found = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not found:
        pytest.fail("promtool not found: run scripts/install-promtool or set PROMTOOL")
    return found


async def test_a_python_agent_exposes_the_series_a_rust_agent_does_with_the_same_values(server: Any, rust_peer: Any) -> None:
    port = _free_port()
    peer = rust_peer("rust-metrics", PEER_METRICS_PORT=str(port), PEER_BREAKER_FAILURES=str(FAILED_ASKS))
    rust_url = f"http://127.0.0.1:{port}/metrics"
    async with serving_agent(
        server, "py-metrics", metrics_address="127.0.0.1:0", circuit_breaker=BreakerPolicy(failures=FAILED_ASKS)
    ) as py, Agent(
        "py-driver", servers=server.url, heartbeat_interval=0
    ) as driver:
        assert py.metrics_url is not None and py.metrics_url.startswith("http://127.0.0.1:")
        pairs = [(py.id, peer.id), (peer.id, py.id)]
        for target, other in pairs:
            for i in range(ECHOES):
                assert await driver.request(target, "echo", i) == i
            with pytest.raises(ChorusError) as failed:
                await driver.request(target, "fail", None)
            assert failed.value.status == StatusCode.INVALID_ARGUMENT
            with pytest.raises(ChorusError) as unknown:
                await driver.request(target, "nope", None)
            assert unknown.value.status == StatusCode.UNKNOWN_COMMAND
            for i in range(ASKS):
                assert await driver.request(target, "ask", {"to": other, "command": "echo", "payload": i}) == i
            for _ in range(FAILED_ASKS):
                with pytest.raises(ChorusError) as nobody:
                    await driver.request(target, "ask", {"to": "nobody", "command": "echo", "payload": 1})
                assert nobody.value.status == StatusCode.NO_RESPONDERS
        for i in range(PINGS):
            await driver.publish(f"interop.ping.{i}", i)
        # Each agent's breaker opened on nobody after FAILED_ASKS failures.

        async def both_pinged() -> tuple[Scrape, Scrape] | None:
            ours, theirs = await scrape(py.metrics_url or ""), await scrape(rust_url)
            done = all(
                s.value("chorus_agent_messages_total", agent=a, kind="event", status="ok") == PINGS
                for s, a in ((ours, py.id), (theirs, peer.id))
            )
            return (ours, theirs) if done else None

        ours, theirs = await eventually("both agents handled the pings", both_pinged)

    # Open connections by the server they are on: the Rust agent's own and the one its event
    # subscriptions use; the two Python agents' one each.
    destination = f"127.0.0.1:{server.port}"
    assert theirs.value("chorus_agent_active_connections", destination=destination) == 2, theirs.text
    assert ours.value("chorus_agent_active_connections", destination=destination) == 2, ours.text

    # The same families, types and label names: every chorus_agent_* series a Rust agent has.
    rust_shape = theirs.shape("chorus_agent_", peer.id)
    assert set(rust_shape) == {
        "chorus_agent_messages_total",
        "chorus_agent_request_duration_seconds",
        "chorus_agent_refusals_total",
        "chorus_agent_traffic_total",
        "chorus_agent_connection_events_total",
        "chorus_agent_inbox_consumers_total",
        "chorus_agent_batched_total",
        "chorus_agent_in_flight",
        "chorus_agent_circuit_state",
        "chorus_agent_circuits_opened_total",
    }
    assert ours.shape("chorus_agent_", py.id) == rust_shape
    # The process's own metrics too.
    assert ours.shape("process_") == theirs.shape("process_")
    # The same series within each family (reasons, directions, events; histogram buckets).
    for family in ("chorus_agent_refusals_total", "chorus_agent_traffic_total", "chorus_agent_connection_events_total", "chorus_agent_inbox_consumers_total", "chorus_agent_batched_total"):
        label = {"chorus_agent_refusals_total": "reason", "chorus_agent_traffic_total": "direction", "chorus_agent_batched_total": "unit"}.get(family, "event")
        mine = sorted(l[label] for n, l, _ in ours.samples if n == family and l["agent"] == py.id)
        rusts = sorted(l[label] for n, l, _ in theirs.samples if n == family and l["agent"] == peer.id)
        assert mine == rusts, family
    buckets = [l["le"] for n, l, _ in ours.samples if n == "chorus_agent_request_duration_seconds_bucket" and l["agent"] == py.id and l["status"] == "ok"]
    assert [float(b) for b in buckets] == [float(b) for n, l, _ in theirs.samples if n.endswith("_bucket") and l["agent"] == peer.id and l["status"] == "ok" for b in [l["le"]]]
    # Values that match the traffic, the same for both.
    for sample, labels, value in expected(py.id):
        assert ours.value(sample, agent=py.id, **labels) == value, (sample, labels, "python")
        assert theirs.value(sample, agent=peer.id, **labels) == value, (sample, labels, "rust")
    # The driver, an agent of the same process, is in the same registry under its own label.
    assert ours.value("chorus_agent_traffic_total", agent="py-driver", direction="requests_sent") == 2 * (ECHOES + 2 + ASKS + FAILED_ASKS)

    # Prometheus's own tool accepts the output.
    checked = subprocess.run([promtool(), "check", "metrics"], input=ours.text, capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def test_the_coordinator_gives_prometheus_a_python_agents_metrics_url(server: Any) -> None:
    coordinator = ChorusProcess(server.url, "serve", CHORUS_SERVE__METRICS_ADDR="127.0.0.1:0", RUST_LOG="info")
    try:
        line = await asyncio.to_thread(coordinator.wait_for, "metrics on http://", 30.0)
        sd = line.split("metrics on ", 1)[1].strip().replace("/metrics", "/sd/agents")
        async with Agent("py-announced", servers=server.url, heartbeat_interval=0.2, metrics_address="127.0.0.1:0") as py:
            url = py.metrics_url
            assert url is not None
            address = url.removeprefix("http://").removesuffix("/metrics")

            async def listed() -> dict[str, Any] | None:
                groups = json.loads(await asyncio.to_thread(lambda: urllib.request.urlopen(sd, timeout=5).read()))
                return next((g for g in groups if "py-announced" in g["labels"]["chorus_agents"].split(",")), None)

            group = await eventually("the coordinator lists the agent's metrics", listed)
            assert group == {
                "targets": [address],
                "labels": {"__scheme__": "http", "__metrics_path__": "/metrics", "chorus_agents": "py-announced"},
            }
            # What Prometheus then scrapes there is the agent's.
            scraped = await scrape(f"{group['labels']['__scheme__']}://{group['targets'][0]}{group['labels']['__metrics_path__']}")
            assert scraped.value("chorus_agent_in_flight", agent="py-announced") == 0
            assert scraped.shape("chorus_agent_traffic_total", "py-announced") == {
                "chorus_agent_traffic_total": ("counter", frozenset({"agent", "direction"}))
            }
        # Gone from the process with its last agent: the listener is closed.
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(fetch, url)
    finally:
        coordinator.stop()


def test_a_listener_off_loopback_speaks_tls_unless_told_otherwise() -> None:
    with pytest.raises(ValueError, match="off loopback without TLS"):
        Agent("py-open", metrics_address="0.0.0.0:9464")
    with pytest.raises(ValueError, match="off loopback without TLS"):
        Agent("py-open", metrics_address="192.0.2.7:9464")
    # Plain HTTP when asked for in so many words; on every interface only with the URL that
    # Prometheus reaches the process at.
    with pytest.raises(ValueError, match="every interface: give metrics_url"):
        Agent("py-open", metrics_address="0.0.0.0:9464", metrics_allow_plain_http=True)
    agent = Agent("py-open", metrics_address="0.0.0.0:9464", metrics_allow_plain_http=True, metrics_url="http://agents.example:9464/metrics")
    assert agent.metrics_url == "http://agents.example:9464/metrics"
    for bad in ("agents.example:9464", "ftp://agents.example:21/", "http://no-port/metrics", "http://h:99999/metrics", "http://h:1/a?b"):
        with pytest.raises(ValueError, match="is not http"):
            Agent("py-open", metrics_url=bad)
    for bad in ("9464", "localhost:", "localhost:65536", "local host:1"):
        with pytest.raises(ValueError, match="is not host:port"):
            Agent("py-open", metrics_address=bad)


async def test_a_tls_listener_serves_https_and_announces_it(server: Any, tmp_path: Path) -> None:
    made = subprocess.run([rust_binary("chorus"), "certs", "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(tmp_path / "server.pem", tmp_path / "server-key.pem")
    trusting = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    async with Agent("py-tls", servers=server.url, heartbeat_interval=0, metrics_address="127.0.0.1:0", metrics_tls=tls) as py:
        url = py.metrics_url or ""
        assert url.startswith("https://127.0.0.1:") and url.endswith("/metrics")
        text = await asyncio.to_thread(fetch, url, trusting)
        assert Scrape(text).value("chorus_agent_in_flight", agent="py-tls") == 0
        # No plain HTTP on it, and no answer to a client that does not trust the certificate.
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            await asyncio.to_thread(fetch, url.replace("https://", "http://"))
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(fetch, url, ssl.create_default_context())


async def test_agents_of_one_process_share_a_listener_and_it_answers_only_metrics(server: Any) -> None:
    port = _free_port()
    address = f"127.0.0.1:{port}"
    url = f"http://{address}/metrics"
    first = Agent("py-first", servers=server.url, heartbeat_interval=0, metrics_address=address)
    second = Agent("py-second", servers=server.url, heartbeat_interval=0, metrics_address=address)
    await first.connect()
    try:
        await second.connect()
        try:
            assert first.metrics_url == second.metrics_url == url
            scraped = await scrape(url)
            assert {"py-first", "py-second"} <= {l.get("agent") for n, l, _ in scraped.samples if n == "chorus_agent_in_flight"}

            def status(method: str, path: str) -> int:
                request = urllib.request.Request(f"http://{address}{path}", method=method)
                try:
                    with urllib.request.urlopen(request, timeout=5) as answer:
                        return int(answer.status)
                except urllib.error.HTTPError as e:
                    return int(e.code)

            assert await asyncio.to_thread(status, "GET", "/") == 404
            assert await asyncio.to_thread(status, "POST", "/metrics") == 405
            assert await asyncio.to_thread(status, "HEAD", "/metrics") == 200
            # Garbage is answered 400, and the listener goes on.
            def garbage() -> bytes:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                    raw.sendall(b"\x16\x03\x01garbage\r\n\r\n")
                    return raw.recv(100)

            assert (await asyncio.to_thread(garbage)).startswith(b"HTTP/1.1 400")
            # A port held by another listener: the agent says so and does not start.
            with socket.socket() as holder:
                holder.bind(("127.0.0.1", 0))
                holder.listen()
                taken = Agent("py-third", servers=server.url, heartbeat_interval=0, metrics_address=f"127.0.0.1:{holder.getsockname()[1]}")
                with pytest.raises(ChorusError, match="cannot serve metrics") as refused:
                    await taken.connect()
                assert refused.value.status == StatusCode.INVALID_ARGUMENT
        finally:
            await second.shutdown()
        # Still served while one agent uses it.
        assert (await scrape(url)).value("chorus_agent_in_flight", agent="py-first") == 0
    finally:
        await first.shutdown()
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(fetch, url)


def test_render_writes_the_text_format_for_any_registry() -> None:
    reg = metrics.Registry(process=False)
    assert reg.render() == ""
    reg.agent('odd "one"\n').message("request", 5002)
    reg.agent("a").request(5002, 0.0003)
    reg.agent("a").request(9999, 20.0)
    reg.record_circuit("a", "cap:x", 1)
    with pytest.raises(ValueError):
        reg.record_circuit("a", "cap:x", 3)
    text = metrics.render(reg)
    assert 'chorus_agent_messages_total{agent="odd \\"one\\"\\n",kind="request",status="ok"} 1' in text
    assert 'chorus_agent_request_duration_seconds_bucket{agent="a",status="ok",le="0.00025"} 0' in text
    assert 'chorus_agent_request_duration_seconds_bucket{agent="a",status="ok",le="0.0005"} 1' in text
    # A code this version does not know is "unknown"; past the last bound, only in +Inf.
    assert 'chorus_agent_request_duration_seconds_bucket{agent="a",status="unknown",le="10"} 0' in text
    assert 'chorus_agent_request_duration_seconds_bucket{agent="a",status="unknown",le="+Inf"} 1' in text
    assert 'chorus_agent_circuit_state{agent="a",destination="cap:x"} 1' in text
    assert "chorus_agent_circuits_opened_total" not in text
    checked = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def test_active_connections_count_a_shared_connection_once_and_a_lost_one_at_zero() -> None:
    own_server = NatsServer()
    own_server.start()
    destination = f"127.0.0.1:{own_server.port}"

    def active() -> float | None:
        found = [v for n, l, v in Scrape(metrics.render()).samples
                 if n == "chorus_agent_active_connections" and l.get("destination") == destination]
        return found[0] if found else None

    shared = await nats.connect(own_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    agents = [Agent(f"py-shared-{i}", connection=shared, heartbeat_interval=0) for i in range(3)]
    own = Agent("py-own", servers=own_server.url, heartbeat_interval=0)
    try:
        for agent in [*agents, own]:
            await agent.connect()
        # Three agents on one connection count it once; the fourth has its own.
        assert active() == 2
        await own.shutdown()
        assert active() == 1
        own_server.halt()

        async def lost() -> bool:
            return active() == 0

        # The series stays, at zero, while the connection is down, and counts it when it is
        # back.
        await eventually("the shared connection seen down", lost)
        own_server.start()

        async def back() -> bool:
            return active() == 1

        await eventually("the shared connection back", back)
    finally:
        for agent in agents:
            await agent.shutdown()
        await shared.close()
        own_server.stop()
