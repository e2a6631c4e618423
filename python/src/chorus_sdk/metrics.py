"""Prometheus metrics of the agents in this process, the same series as the Rust SDK's.

Every agent records into one process-wide :func:`registry` with an ``agent`` label, so a
process running several agents has one ``/metrics``. Most counts are plain integers on the
agent (its :class:`~chorus_sdk.Stats`), read when Prometheus scrapes; only the messages by kind
and status and the request durations are kept here per message, as the Rust SDK keeps them.

An agent serves the registry itself with ``Agent(..., metrics_address="127.0.0.1:9464")`` and
announces where in its manifest (``metrics_url``), so the coordinator's service discovery
(``/sd/agents`` on its metrics listener) hands it to Prometheus. A process may instead run one
listener of its own with :func:`serve` and give each agent ``metrics_url``.

The output is Prometheus's text exposition format (version 0.0.4), written here: the registry
reads the agents' own counters at scrape time, which is what keeps the message path cheap."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import ssl
import time
import weakref
from bisect import bisect_left
from dataclasses import dataclass, fields
from typing import Any, Awaitable, Callable, Iterable, Protocol

import nats.errors

from .status import StatusCode

log = logging.getLogger("chorus_sdk")

#: The request-duration histogram's buckets, in seconds (the Rust SDK's).
DURATION_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)
#: Where an agent serves its metrics when asked to without an address.
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9464"
#: The content type of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The most bytes of a request's head the listener reads, and how long it waits for them.
MAX_HEAD_BYTES = 8192
READ_TIMEOUT = 5.0

# Status codes as metric labels, as the Rust SDK writes them (`ok`, `invalid_argument`, ...);
# a code this version does not know is `unknown`.
_STATUS_LABELS: dict[int, str] = {int(code): code.name.lower() for code in StatusCode}

# The counters' families: (name, help, label of the series, [(label value, Stats field)]).
_REFUSALS = (
    "chorus_agent_refusals_total",
    "Inbound messages refused unhandled, by reason: loop_detected (hop limit), expired (past its deadline), data_format (undecodable or bad version), unknown_command, signature (missing, bad or stale signature), access (not granted), rate_limited.",
    "reason",
    (
        ("loop_detected", "loop_refused"),
        ("expired", "expired"),
        ("data_format", "bad_input"),
        ("unknown_command", "unknown_command"),
        ("signature", "security_refused"),
        ("access", "access_refused"),
        ("rate_limited", "rate_limited"),
    ),
)
_TRAFFIC = (
    "chorus_agent_traffic_total",
    "Messages by direction: received, requests_sent, events_published, replies_sent, reply_failures, retries, dead_lettered, dropped (slow subscriber), lost (events missed, from sequence gaps, dropped ones included), shed (overloaded, answered 5019), redelivered, duplicates_suppressed, notifications_sent, notifications_received, notifications_unhandled (no handler took it: dropped).",
    "direction",
    (
        ("received", "received"),
        ("requests_sent", "requests_sent"),
        ("events_published", "events_published"),
        ("replies_sent", "replies_sent"),
        ("reply_failures", "reply_failures"),
        ("retries", "retries"),
        ("dead_lettered", "dead_lettered"),
        ("dropped", "dropped"),
        ("lost", "lost"),
        ("shed", "shed"),
        ("redelivered", "redelivered"),
        ("duplicates_suppressed", "duplicates"),
        ("notifications_sent", "notifications_sent"),
        ("notifications_received", "notifications_received"),
        ("notifications_unhandled", "notifications_unhandled"),
    ),
)
_INBOX_CONSUMERS = (
    "chorus_agent_inbox_consumers_total",
    "Durable inbox consumers an on-demand inbox opened because commands waited (opened) and deleted once none did (released).",
    "event",
    (("opened", "inbox_consumers_opened"), ("released", "inbox_consumers_released")),
)
_BATCHED = (
    "chorus_agent_batched_total",
    "What this agent's batchers sent, by unit: batches, and the messages in them (messages / batches is the mean batch).",
    "unit",
    (("batches", "batches_sent"), ("messages", "batched_messages")),
)
_CONNECTION_HELP = "NATS connection events: disconnects, reconnects, slow_consumer_drops, permission_violations, server_errors, client_errors."
_HANDLED_HELP = "Inbound messages by kind and the status they were answered (or refused) with."
_DURATION_HELP = "Time from sending a request or command to its reply, by reply status."
_CIRCUIT_STATE_HELP = "Each destination's circuit breaker in this agent: 0 closed, 1 half-open, 2 open."
_ACTIVE_CONNECTIONS_HELP = (
    "NATS connections of this process's agents that are up, by the server each is on or was last on "
    "(destination, host:port); one shared by several agents counts once."
)
_CIRCUITS_OPENED_HELP = "Times a destination's circuit breaker opened in this agent."


# A series' labels, a family's series (labels and the value as written), and a family (name,
# help, type, series).
Labels = tuple[tuple[str, str], ...]
Series = list[tuple[Labels, str]]
Family = tuple[str, str, str, Series]


def status_label(status: int) -> str:
    """The label of a status code in the metrics (``ok``, ``invalid_argument``), ``unknown``
    for a code this version does not know."""
    return _STATUS_LABELS.get(status, "unknown")


# ---------------------------------------------------------------------------------------------
# What an agent records


class ConnectionEvents:
    """Counts of one agent's NATS connection events, by the names of
    ``chorus_agent_connection_events_total``."""

    NAMES = ("disconnects", "reconnects", "slow_consumer_drops", "permission_violations", "server_errors", "client_errors")

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(self.NAMES, 0)

    def error(self, error: BaseException) -> None:
        """Counts an error nats-py reported: a slow consumer's drop, a permission violation or
        another error from the server, or a client-side error."""
        if isinstance(error, nats.errors.SlowConsumerError):
            event = "slow_consumer_drops"
        elif isinstance(error, nats.errors.AuthorizationError):
            event = "permission_violations"
        elif type(error) is nats.errors.Error:
            # What the server said (-ERR); it gives permission refusals as text only.
            event = "permission_violations" if "permissions violation" in str(error).lower() else "server_errors"
        else:
            event = "client_errors"
        self.counts[event] += 1

    def watch(self, options: dict[str, Any], closing: Callable[[], bool]) -> None:
        """Counts the events of the connection made with nats-py ``options``, calling the
        callbacks already there after counting. ``closing()`` says whether the agent is
        shutting down (its disconnect then is no loss)."""
        user_error = options.get("error_cb")
        user_disconnected = options.get("disconnected_cb")
        user_reconnected = options.get("reconnected_cb")

        async def error_cb(error: Exception) -> None:
            self.error(error)
            if user_error is not None:
                await user_error(error)

        async def disconnected_cb() -> None:
            if not closing():
                self.counts["disconnects"] += 1
            if user_disconnected is not None:
                await user_disconnected()

        async def reconnected_cb() -> None:
            self.counts["reconnects"] += 1
            if user_reconnected is not None:
                await user_reconnected()

        options.update(error_cb=error_cb, disconnected_cb=disconnected_cb, reconnected_cb=reconnected_cb)


class _Histogram:
    """One series of the request-duration histogram: a count per bucket (the last for
    values past every bound), their sum and their number."""

    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1


class AgentMetrics:
    """What the agents with one id record per message: inbound messages by kind and status,
    and their requests' durations by reply status. Kept by the registry for as long as the
    process runs, as the Rust SDK keeps its series."""

    __slots__ = ("handled", "requests")

    def __init__(self) -> None:
        #: (kind, status label) -> messages.
        self.handled: dict[tuple[str, str], int] = {}
        #: status label -> durations.
        self.requests: dict[str, _Histogram] = {}

    def message(self, kind: str, status: int) -> None:
        """Counts an inbound message of ``kind`` answered (or refused) with ``status``."""
        key = (kind, _STATUS_LABELS.get(status, "unknown"))
        handled = self.handled
        handled[key] = handled.get(key, 0) + 1

    def request(self, status: int, seconds: float) -> None:
        """Records a request answered with ``status`` (or failed with it) after ``seconds``."""
        label = _STATUS_LABELS.get(status, "unknown")
        series = self.requests.get(label)
        if series is None:
            series = self.requests[label] = _Histogram()
        series.observe(seconds)


class StatsSource(Protocol):
    """An agent, as the registry reads it at scrape time."""

    id: str
    stats: Any
    connection_events: ConnectionEvents

    @property
    def in_flight(self) -> int:
        """Messages being handled right now."""
        ...

    @property
    def connections(self) -> list[Any]:
        """The NATS clients it uses."""
        ...


# ---------------------------------------------------------------------------------------------
# The registry


class Registry:
    """The metrics of a process's agents. :func:`registry` is the one every agent records
    into; :meth:`render` writes it in the text exposition format."""

    def __init__(self, process: bool = True) -> None:
        self._agents: dict[str, AgentMetrics] = {}
        self._live: list[weakref.ReferenceType[Any]] = []
        self._circuit_state: dict[tuple[str, str], int] = {}
        self._circuits_opened: dict[tuple[str, str], int] = {}
        self._process = process

    def agent(self, agent: str) -> AgentMetrics:
        """The per-message metrics of the agents with id ``agent`` (shared between them)."""
        found = self._agents.get(agent)
        if found is None:
            found = self._agents[agent] = AgentMetrics()
        return found

    def track(self, source: StatsSource) -> None:
        """Makes an agent's counters visible for as long as it lives (held weakly)."""
        self._live = [ref for ref in self._live if ref() is not None and ref() is not source]
        self._live.append(weakref.ref(source))

    def record_circuit(self, agent: str, destination: str, state: int) -> None:
        """Sets ``chorus_agent_circuit_state`` of ``agent``'s breaker for ``destination``:
        0 closed, 1 half-open, 2 open. Raises ``ValueError`` for another value."""
        state = int(state)
        if state not in (0, 1, 2):
            raise ValueError(f"circuit state {state}: 0 closed, 1 half-open or 2 open")
        self._circuit_state[(agent, destination)] = state

    def record_circuit_opened(self, agent: str, destination: str) -> None:
        """Counts one opening of ``agent``'s breaker for ``destination``
        (``chorus_agent_circuits_opened_total``)."""
        key = (agent, destination)
        self._circuits_opened[key] = self._circuits_opened.get(key, 0) + 1

    def render(self) -> str:
        """Every series in Prometheus's text exposition format (version 0.0.4): families by
        name, series by their labels, families with no series left out."""
        families = self._agent_families()
        families.append(
            (
                "chorus_agent_messages_total",
                _HANDLED_HELP,
                "counter",
                [
                    ((("agent", agent), ("kind", kind), ("status", status)), str(n))
                    for agent, m in self._agents.items()
                    for (kind, status), n in m.handled.items()
                ],
            )
        )
        families.append(
            (
                "chorus_agent_circuit_state",
                _CIRCUIT_STATE_HELP,
                "gauge",
                [((("agent", a), ("destination", d)), str(v)) for (a, d), v in self._circuit_state.items()],
            )
        )
        families.append(
            (
                "chorus_agent_circuits_opened_total",
                _CIRCUITS_OPENED_HELP,
                "counter",
                [((("agent", a), ("destination", d)), str(v)) for (a, d), v in self._circuits_opened.items()],
            )
        )
        if self._process:
            families.extend(_process_families())
        blocks = [(name, _family_text(name, help_text, kind, series)) for name, help_text, kind, series in families if series]
        histograms: list[tuple[Labels, _Histogram]] = [
            ((("agent", agent), ("status", status)), series)
            for agent, m in self._agents.items()
            for status, series in m.requests.items()
        ]
        if histograms:
            blocks.append((_DURATION, _histogram_text(histograms)))
        return "".join(text for _, text in sorted(blocks))

    def _agent_families(self) -> list[Family]:
        """The live agents' counters, read now."""
        # Agents sharing an id in one process are summed, so no series is reported twice.
        sums: dict[str, dict[str, int]] = {}
        # Each connection once: the server it is on (or was last), and whether it is up.
        connections: dict[int, tuple[str, bool]] = {}
        live = []
        for ref in self._live:
            source = ref()
            if source is None:
                continue
            live.append(ref)
            s = sums.setdefault(source.id, {})
            stats = source.stats
            for f in fields(stats):
                value = getattr(stats, f.name)
                if isinstance(value, int):
                    s[f.name] = s.get(f.name, 0) + value
            for event, n in source.connection_events.counts.items():
                s["connection:" + event] = s.get("connection:" + event, 0) + n
            s["in_flight"] = s.get("in_flight", 0) + int(source.in_flight)
            for nc in source.connections:
                connections.setdefault(id(nc), (_destination(nc), bool(nc.is_connected)))
        self._live = live
        by_destination: dict[str, int] = {}
        for destination, up in connections.values():
            by_destination[destination] = by_destination.get(destination, 0) + int(up)
        families: list[Family] = [
            (name, help_text, "counter", [((("agent", a), (label, value)), str(s.get(field, 0))) for a, s in sums.items() for value, field in members])
            for name, help_text, label, members in (_REFUSALS, _TRAFFIC, _INBOX_CONSUMERS, _BATCHED)
        ]
        families.append(
            (
                "chorus_agent_connection_events_total",
                _CONNECTION_HELP,
                "counter",
                [
                    ((("agent", a), ("event", event)), str(s.get("connection:" + event, 0)))
                    for a, s in sums.items()
                    for event in ConnectionEvents.NAMES
                ],
            )
        )
        families.append(
            (
                "chorus_agent_in_flight",
                "Messages being handled right now.",
                "gauge",
                [((("agent", a),), str(s.get("in_flight", 0))) for a, s in sums.items()],
            )
        )
        families.append(
            (
                "chorus_agent_active_connections",
                _ACTIVE_CONNECTIONS_HELP,
                "gauge",
                [((("destination", d),), str(n)) for d, n in by_destination.items()],
            )
        )
        return families


_DURATION = "chorus_agent_request_duration_seconds"


def _destination(nc: Any) -> str:
    """The server a NATS client is on, or was last on, as that server reports itself
    (``host:port`` of its INFO), as the Rust SDK labels it."""
    info = getattr(nc, "_server_info", None) or {}
    return f"{info.get('host', '')}:{info.get('port', '')}"


def _family_text(name: str, help_text: str, kind: str, series: Series) -> str:
    out = [f"# HELP {name} {_escape_help(help_text)}\n# TYPE {name} {kind}\n"]
    for labels, value in sorted(series):
        out.append(f"{name}{_labels(labels)} {value}\n")
    return "".join(out)


def _histogram_text(histograms: list[tuple[Labels, _Histogram]]) -> str:
    name = _DURATION
    out = [f"# HELP {name} {_escape_help(_DURATION_HELP)}\n# TYPE {name} histogram\n"]
    for labels, series in sorted(histograms, key=lambda h: h[0]):
        cumulative = 0
        for bound, n in zip(DURATION_BUCKETS, series.counts):
            cumulative += n
            out.append(f"{name}_bucket{_labels(labels + (('le', _number(bound)),))} {cumulative}\n")
        out.append(f"{name}_bucket{_labels(labels + (('le', '+Inf'),))} {series.count}\n")
        out.append(f"{name}_sum{_labels(labels)} {_number(series.sum)}\n")
        out.append(f"{name}_count{_labels(labels)} {series.count}\n")
    return "".join(out)


def _number(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
    return "{" + inner + "}" if inner else ""


def _process_families() -> list[Family]:
    """The process's own metrics, as the Rust SDK exports them on Linux (read from /proc);
    none elsewhere or when /proc cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        # The fields after the command name (which may hold spaces), from the state on.
        rest = stat[stat.rindex(")") + 2 :].split()
        ticks = os.sysconf("SC_CLK_TCK")
        page = os.sysconf("SC_PAGE_SIZE")
        cpu = (int(rest[11]) + int(rest[12])) / ticks
        threads = int(rest[17])
        started = int(rest[19]) / ticks
        virtual, resident = int(rest[20]), int(rest[21]) * page
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        open_fds = len(os.listdir("/proc/self/fd"))
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError, IndexError, StopIteration, ImportError):
        return []
    plain: list[tuple[str, str, str, float]] = [
        ("process_cpu_seconds_total", "CPU time the process used, user and system, in seconds.", "counter", cpu),
        ("process_max_fds", "The most file descriptors the process may open.", "gauge", soft),
        ("process_open_fds", "File descriptors the process has open.", "gauge", open_fds),
        ("process_resident_memory_bytes", "The process's resident memory, in bytes.", "gauge", resident),
        ("process_start_time_seconds", "When the process started, in seconds since the Unix epoch.", "gauge", boot + started),
        ("process_threads", "The process's operating-system threads.", "gauge", threads),
        ("process_virtual_memory_bytes", "The process's virtual memory, in bytes.", "gauge", virtual),
    ]
    return [(name, help_text, kind, [((), _number(value))]) for name, help_text, kind, value in plain]


_REGISTRY = Registry()


def registry() -> Registry:
    """The registry every agent of this process records into, with the process's own
    ``process_*`` metrics (Linux)."""
    return _REGISTRY


def render(of: Registry | None = None) -> str:
    """``of`` (the process's :func:`registry` by default) in Prometheus's text format."""
    return (of or _REGISTRY).render()


def record_circuit(agent: str, destination: str, state: int) -> None:
    """Sets the process registry's ``chorus_agent_circuit_state`` for ``agent``'s breaker on
    ``destination`` (``agent:<id>`` or ``cap:<capability>``): 0 closed, 1 half-open, 2 open
    (a :class:`~chorus_sdk.CircuitState` will do). Raises ``ValueError`` for another value."""
    _REGISTRY.record_circuit(agent, destination, state)


def record_circuit_opened(agent: str, destination: str) -> None:
    """Counts one opening of ``agent``'s breaker on ``destination`` in the process registry
    (``chorus_agent_circuits_opened_total``)."""
    _REGISTRY.record_circuit_opened(agent, destination)


def circuit_changed(agent: str, destination: str, state: int) -> None:
    """Records a breaker's move to ``state``: the gauge, and one opening when it opened (the
    Rust SDK records both on every state change)."""
    record_circuit(agent, destination, state)
    if int(state) == 2:
        record_circuit_opened(agent, destination)


# ---------------------------------------------------------------------------------------------
# Serving


@dataclass(frozen=True)
class Listen:
    """Where and how a metrics listener listens (checked: see :func:`listen`)."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None

    @property
    def unspecified(self) -> bool:
        """Whether it listens on every interface (no URL can be derived from it)."""
        return self.host in ("0.0.0.0", "::", "")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(address: str, tls: ssl.SSLContext | None = None, allow_plain_http: bool = False) -> Listen:
    """Checks a listener's ``address`` (``host:port``, ``[v6]:port``; port 0: one the system
    picks). Off loopback it speaks TLS (``tls``, a server-side ``ssl.SSLContext``) unless
    ``allow_plain_http`` says otherwise in so many words. Raises ``ValueError`` for an address
    that does not parse or plain HTTP off loopback."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"metrics address {address!r} is not host:port")
    host, _, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port_text.isdigit() or int(port_text) > 65535 or any(c.isspace() for c in host):
        raise ValueError(f"metrics address {address!r} is not host:port (port 0-65535)")
    if tls is not None and not isinstance(tls, ssl.SSLContext):
        raise ValueError("metrics_tls must be an ssl.SSLContext (server side)")
    if tls is None and not _is_loopback(host) and not allow_plain_http:
        raise ValueError(
            f"metrics address {address} is off loopback without TLS: give metrics_tls (an "
            "ssl.SSLContext with the certificate), or metrics_allow_plain_http=True behind a "
            "proxy that terminates TLS"
        )
    return Listen(host, int(port_text), tls)


def check_url(url: str) -> str:
    """``url`` if it is ``http[s]://host:port[/path]`` (what the coordinator's service
    discovery accepts, as the Rust SDK checks it); raises ``ValueError`` otherwise."""
    scheme, sep, rest = url.partition("://") if isinstance(url, str) else ("", "", "")
    ok = bool(sep) and scheme in ("http", "https")
    if ok:
        slash = rest.find("/")
        address, path = (rest, "/metrics") if slash < 0 else (rest[:slash], rest[slash:])
        host, colon, port = address.rpartition(":")
        ok = (
            bool(colon)
            and bool(host)
            and all(c.isascii() and (c.isalnum() or c in "-._[]:") for c in host)
            and port.isascii()
            and port.isdigit()
            and int(port) <= 65535
            and not any(c.isspace() or c in "?#" for c in path)
        )
    if not ok:
        raise ValueError(f"metrics URL {url!r} is not http[s]://host:port[/path]")
    return url


class MetricsServer:
    """An HTTP (or HTTPS) listener answering ``GET /metrics`` with a registry, in this event
    loop. Made by :func:`serve`; :meth:`close` stops it."""

    def __init__(self, server: asyncio.Server, listen: Listen, of: Registry) -> None:
        self._server = server
        self._listen = listen
        self._registry = of
        sock = server.sockets[0].getsockname()
        #: The host and port it listens on (the port the system picked, for port 0).
        self.host: str = listen.host
        self.port: int = int(sock[1])
        self._users = 1
        self._key: tuple[str, int, int] | None = None

    @property
    def url(self) -> str:
        """``http[s]://host:port/metrics``, as an agent announces it."""
        scheme = "https" if self._listen.tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/metrics"

    async def close(self) -> None:
        """Stops listening and waits for the answers in progress."""
        self._server.close()
        try:
            await asyncio.wait_for(self._server.wait_closed(), timeout=READ_TIMEOUT)
        except asyncio.TimeoutError:
            log.debug("metrics listener %s: answers still in progress at close", self.url)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=READ_TIMEOUT)
            except asyncio.LimitOverrunError:
                await _respond(writer, "431 Request Header Fields Too Large", "request head too large\n")
                return
            except (asyncio.IncompleteReadError, asyncio.TimeoutError):
                return
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                await _respond(writer, "400 Bad Request", "not an HTTP request\n")
                return
            method, path = parts[0], parts[1].split("?", 1)[0]
            if path != "/metrics":
                await _respond(writer, "404 Not Found", "not found: metrics are at /metrics\n", head_only=method == "HEAD")
            elif method not in ("GET", "HEAD"):
                await _respond(writer, "405 Method Not Allowed", "GET or HEAD\n", extra="Allow: GET, HEAD\r\n")
            else:
                await _respond(writer, "200 OK", self._registry.render(), head_only=method == "HEAD", content_type=CONTENT_TYPE)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as e:
            log.debug("metrics listener: a scrape failed: %s", e)
        finally:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), timeout=READ_TIMEOUT)
            except (OSError, ssl.SSLError, asyncio.TimeoutError):
                pass


async def _respond(
    writer: asyncio.StreamWriter,
    status: str,
    body: str,
    *,
    head_only: bool = False,
    extra: str = "",
    content_type: str = "text/plain; charset=utf-8",
) -> None:
    data = body.encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
        f"{extra}Connection: close\r\n\r\n"
    ).encode()
    writer.write(head if head_only else head + data)
    await asyncio.wait_for(writer.drain(), timeout=READ_TIMEOUT)


async def serve(
    address: str = DEFAULT_METRICS_ADDRESS,
    *,
    tls: ssl.SSLContext | None = None,
    allow_plain_http: bool = False,
    of: Registry | None = None,
) -> MetricsServer:
    """Serves ``of`` (the process's :func:`registry` by default) at
    ``http://address/metrics`` (``https`` with ``tls``) from this event loop, until
    :meth:`MetricsServer.close`. Port 0 picks a free one (:attr:`MetricsServer.port`).
    Off loopback it needs ``tls`` or ``allow_plain_http=True``. Raises ``ValueError`` for such
    an address, ``OSError`` when it cannot listen there (the port taken, say)."""
    return await _start(listen(address, tls, allow_plain_http), of or _REGISTRY)


async def _start(where: Listen, of: Registry) -> MetricsServer:
    holder: list[MetricsServer] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await holder[0]._answer(reader, writer)

    server = await asyncio.start_server(answer, where.host or None, where.port, ssl=where.tls, limit=MAX_HEAD_BYTES)
    holder.append(MetricsServer(server, where, of))
    return holder[0]


# The listeners agents opened, by address, shared by the agents of this process that ask for
# the same one (a port the system picks is never shared).
_SHARED: dict[tuple[str, int, int], tuple[asyncio.AbstractEventLoop, Awaitable[MetricsServer]]] = {}


async def acquire(where: Listen) -> MetricsServer:
    """A listener on ``where`` for an agent: the one this process already runs there, or a
    new one. Each :func:`acquire` is matched by a :func:`release`. Raises ``OSError`` when it
    cannot listen there."""
    loop = asyncio.get_running_loop()
    if where.port == 0:
        return await _start(where, _REGISTRY)
    key = (where.host, where.port, id(where.tls))
    found = _SHARED.get(key)
    if found is not None and found[0] is loop:
        server = await found[1]
        if server._users > 0:
            server._users += 1
            return server
    started = asyncio.ensure_future(_start(where, _REGISTRY))
    _SHARED[key] = (loop, started)
    try:
        server = await started
    except BaseException:
        if _SHARED.get(key, (None, None))[1] is started:
            del _SHARED[key]
        raise
    server._key = key
    return server


async def release(server: MetricsServer) -> None:
    """Gives back a listener from :func:`acquire`: closed once no agent uses it."""
    server._users -= 1
    if server._users > 0:
        return
    key = server._key
    if key is not None and key in _SHARED:
        del _SHARED[key]
    await server.close()


__all__ = [
    "DURATION_BUCKETS",
    "AgentMetrics",
    "ConnectionEvents",
    "Listen",
    "MetricsServer",
    "Registry",
    "check_url",
    "circuit_changed",
    "listen",
    "record_circuit",
    "record_circuit_opened",
    "registry",
    "render",
    "serve",
    "status_label",
]
