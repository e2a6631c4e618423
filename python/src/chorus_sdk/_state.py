"""An agent's settings and state, what every layer of :class:`~chorus_sdk.Agent` shares: its
identity and options, its connection, the tasks it owns, and what it counted.

The agent is built in layers, each a class in a room of its own and each using only those
below it: this state, :mod:`.outbound` (what it sends), :mod:`.inbound` (what it receives, the
pipeline and the replies), :mod:`.presence` (heartbeats, goodbye, discovery answers),
:mod:`.handlers` (what it serves), and :mod:`.agent` (connecting, shutting down, tasks)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, TypeVar, Union, cast
from ._host import Host

import nats
import nats.errors
from nats.aio.client import Client as NATS

from ._backlog import Slots
from .batch import Batching
from ._connection import Connection
from ._dispatch import Replies
from .credits import Ledger
from . import metrics
from .access import Access, RateLimit, SeenIds
from .routing import DEFAULT_ROUTING_REFRESH, BreakerPolicy, Breakers, Router, Routing
from .codec import Encoding
from .context import Context
from .durable import DurableInbox, InboxOptions
from .exactly_once import ExactlyOnce
from .negotiate import Bidding
from .payloads import PayloadLimits, Payloads
from .envelope import DEFAULT_HOP_LIMIT, Delivery, now_ms, uuid7
from .eta import U64_MAX, Handling
from .encryption import EncryptionKey, Rekey, Sessions
from .service import EndpointStats
from .identity import Identity
from .signing import Verifier
from .status import Unreachable
from .subjects import Subjects, validate_dotted, validate_token
from .tasks import Tasks
from .usage import DEFAULT_USAGE_INTERVAL, Usage

log = logging.getLogger("chorus_sdk")

# The type a request's answer is decoded into (`returns=`).
R = TypeVar("R")

Handler = Callable[[Context], Awaitable[Any]]
EventHandler = Callable[[Context], Awaitable[None]]
Payload = Union[bytes, Any]

# How many handlers may wait for a slot per agent before requests are refused with 5019 and
# events dropped (counted), as the Rust SDK's queue capacity.
DEFAULT_QUEUE_CAPACITY = 4096
# The most subjects an agent keeps event counts for (section 4.1, `seq`).
MAX_SEQ_SUBJECTS = 4096
# The longest heartbeat interval an announcement on ``sys.wire`` can ask for, in milliseconds.
MAX_HEARTBEAT_FLOOR_MS = 120_000
# The notification in which the coordinator tells an agent whose heartbeats come faster than
# the floor what its last ``sys.wire`` announcement said (docs/PROTOCOL.md section 3.5); taken
# only from the coordinator, never by a handler.
WIRE_NOTIFICATION = "chorus-wire"
from .subjects import COORDINATOR_ID as COORDINATOR_ID  # noqa: E402 - re-exported for the rooms above
# How many times an agent tries to reach each server before its first connection fails with
# Unreachable (about 2 s apart, nats-py's reconnect wait).
DEFAULT_CONNECT_ATTEMPTS = 3



@dataclass
class Stats:
    """What an agent counted."""

    handled: int = 0
    failed: int = 0
    refused: int = 0
    dropped: int = 0
    lost: int = 0
    shed: int = 0
    redelivered: int = 0
    retries: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    #: Inbox consumers opened because commands waited, and deleted once none did (on demand).
    inbox_consumers_opened: int = 0
    inbox_consumers_released: int = 0
    #: Large payloads (section 7.11): stored by reference, fetched, decompressed.
    payloads_stored: int = 0
    payloads_fetched: int = 0
    payloads_decompressed: int = 0
    #: Messages taken off the wire (commands, requests, events), and their refusals by reason
    #: (``refused`` counts them all): undecodable or unknown kind (5006), expired (5011), past
    #: the hop limit (5010), no handler (5016), the signature check, access (5007), the rate
    #: limit (5013). As the Rust SDK's ``AgentStats``; ``chorus_agent_*`` metrics read them.
    received: int = 0
    bad_input: int = 0
    expired: int = 0
    loop_refused: int = 0
    unknown_command: int = 0
    security_refused: int = 0
    access_refused: int = 0
    rate_limited: int = 0
    #: Notifications that reached this agent (handled or not), those no handler took
    #: (counted, never answered), and those it sent to one agent (section 7.14).
    notifications_received: int = 0
    notifications_unhandled: int = 0
    notifications_sent: int = 0
    #: Replies sent, and those that could not be.
    replies_sent: int = 0
    reply_failures: int = 0
    #: Requests (and discovery, broadcast, task calls) and events this agent sent.
    requests_sent: int = 0
    events_published: int = 0
    #: Batches a :class:`~chorus_sdk.batch.Batcher` sent, and the messages in them.
    batches_sent: int = 0
    batched_messages: int = 0




def _max_tokens(given: Mapping[str, int] | None) -> dict[str, int]:
    """The ``capability_max_tokens`` option checked: capability names, each with the most
    tokens one request to it may carry (a whole number, 0 or more). Raises
    :class:`ValueError` (:class:`~chorus_sdk.SubjectError` for a bad name)."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise ValueError(f"capability_max_tokens is a mapping of capability to token count, not {type(given).__name__}")
    checked: dict[str, int] = {}
    for capability, tokens in given.items():
        validate_dotted("capability", capability)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= U64_MAX:
            raise ValueError(f"capability_max_tokens[{capability!r}] = {tokens!r}: a token count is a whole number, 0 or more")
        checked[capability] = tokens
    return checked


def _batching(given: Batching | tuple[int, float] | None) -> Batching:
    """The ``batching`` option checked: a :class:`~chorus_sdk.batch.Batching`, or a
    ``(max_messages, max_delay)`` pair (seconds); ``None``, the default. Raises
    :class:`ValueError` naming what is out of bounds."""
    if given is None:
        return Batching()
    if not isinstance(given, tuple) or len(given) != 2:
        raise ValueError(f"batching is a Batching(max_messages, max_delay), not {given!r}")
    batching = Batching(*given)
    problem = batching.problem()
    if problem is not None:
        raise ValueError(problem)
    return batching


def _rekey(given: Rekey | tuple[int, float] | None) -> Rekey:
    """``encryption_rekey=``: a :class:`Rekey`, or its messages and age (seconds) as a pair."""
    if given is None or isinstance(given, Rekey):
        return given or Rekey()
    if not isinstance(given, tuple) or len(given) != 2:
        raise ValueError(f"encryption_rekey is a Rekey(messages, age), not {given!r}")
    return Rekey(*given)


class AgentState:
    """The settings and state every layer of an agent shares."""


    def __init__(
        self,
        id: str,
        *,
        servers: str | list[str] = "nats://127.0.0.1:4222",
        root: str = "chorus",
        encoding: Encoding | None = None,
        identity: Identity | None = None,
        verifier: Verifier | None = None,
        encryption_key: EncryptionKey | None = None,
        encryption_rekey: Rekey | tuple[int, float] | None = None,
        heartbeat_interval: float = 5.0,
        request_timeout: float = 5.0,
        max_in_flight: int = 64,
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        hop_limit: int = DEFAULT_HOP_LIMIT,
        groups: list[str] | None = None,
        customer: str | None = None,
        batching: Batching | tuple[int, float] | None = None,
        capability_version: str = "",
        capability_max_tokens: Mapping[str, int] | None = None,
        max_message_bytes: int | None = None,
        durable_inbox: bool = True,
        service_discovery: bool = True,
        inbox: InboxOptions | None = None,
        default_delivery: Delivery = Delivery.AT_LEAST_ONCE,
        shutdown_timeout: float = 10.0,
        connect_attempts: int | None = DEFAULT_CONNECT_ATTEMPTS,
        reconnect_attempts: int | None = None,
        nats_options: dict[str, Any] | None = None,
        metrics_address: str | None = None,
        metrics_url: str | None = None,
        metrics_tls: ssl.SSLContext | None = None,
        metrics_allow_plain_http: bool = False,
        payload_limits: PayloadLimits | None = None,
        grants: dict[str, Iterable[str]] | None = None,
        trust_unverified_senders: bool = False,
        rate_limit: RateLimit | None = None,
        persist_seen_ids: bool = False,
        capability_routing: Routing = Routing.QUEUE_GROUP,
        routing_refresh: float = DEFAULT_ROUTING_REFRESH,
        circuit_breaker: BreakerPolicy | None = None,
        usage_interval: float = DEFAULT_USAGE_INTERVAL,
        connection: NATS | None = None,
    ) -> None:
        self.id = validate_token("agent id", id)
        self.subjects = Subjects(root)
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self._fixed_encoding = encoding
        self._bus_major = 1
        # The least time between heartbeats the coordinator asks for (docs/PROTOCOL.md 3.5).
        self._heartbeat_floor = 0.0
        self.identity = identity
        self.verifier = verifier
        self.encryption_key = encryption_key
        self._encryption_trust: dict[str, str] = {}
        # The sessions payloads are sealed in for each recipient key (section 4.2).
        self._encryption_sessions = Sessions(_rekey(encryption_rekey))
        self.heartbeat_interval = heartbeat_interval
        # The interval the last heartbeat announced, which the next one keeps to.
        self._beat_every = heartbeat_interval
        self.request_timeout = request_timeout
        self.max_in_flight = max_in_flight
        self.queue_capacity = queue_capacity
        self.hop_limit = hop_limit
        self.groups = [validate_token("group", g) for g in (groups or [])]
        # The customer it is dedicated to (its manifest's ``customer``): a discovery for
        # another customer passes it by. None: it serves every customer.
        self.customer = validate_token("customer", customer) if customer is not None else None
        # What ``batcher()`` batches by when not told (``[batching]`` in a configuration file).
        self.batching = _batching(batching)
        self.capability_version = capability_version
        self.capability_max_tokens = _max_tokens(capability_max_tokens)
        self.max_message_bytes = max_message_bytes
        self.durable_inbox = durable_inbox
        self.service_discovery = service_discovery
        self._endpoint_stats: dict[str, EndpointStats] = {}
        self.inbox_options = inbox or InboxOptions()
        self.reconnect_hooks: list[Callable[[], None]] = []
        self.default_delivery = default_delivery
        self.shutdown_timeout = shutdown_timeout
        if connect_attempts is not None and connect_attempts < 1:
            raise ValueError("connect_attempts must be 1 or more (None: keep trying)")
        if reconnect_attempts is not None and reconnect_attempts < 0:
            raise ValueError("reconnect_attempts must be 0 or more (None: keep trying)")
        self.connect_attempts = connect_attempts
        self.reconnect_attempts = reconnect_attempts
        self.nats_options = dict(nats_options or {})
        self._ledger: Ledger | None = None
        # Prometheus metrics (metrics.py): served on metrics_address when given, announced in
        # the manifest as metrics_url (derived from the listener when not given).
        self._metrics_listen = (
            metrics.listen(metrics_address, metrics_tls, metrics_allow_plain_http) if metrics_address is not None else None
        )
        if self._metrics_listen is not None and self._metrics_listen.unspecified and metrics_url is None:
            raise ValueError(
                f"metrics_address {metrics_address} listens on every interface: give metrics_url, "
                "the address Prometheus reaches this process at"
            )
        self.metrics_url = metrics.check_url(metrics_url) if metrics_url is not None else None
        self._metrics_server: metrics.MetricsServer | None = None
        self._metrics = metrics.registry().agent(self.id)
        self.connection_events = metrics.ConnectionEvents()
        self.payload_limits = payload_limits or PayloadLimits()
        if persist_seen_ids and verifier is None:
            raise ValueError("persist_seen_ids needs a verifier: only verified ids are kept")
        self.access = Access(grants, rate_limit, trust_unverified_senders)
        self._required: dict[str, list[str]] = {}
        self._seen_ids = SeenIds(cast("Host", self), verifier.tolerance_ms) if persist_seen_ids and verifier is not None else None
        self.capability_routing = capability_routing
        self._router = Router(routing_refresh)
        self._breakers = Breakers(self.id, circuit_breaker)
        self._breakers.on_change.append(lambda destination, state: metrics.circuit_changed(self.id, destination, state))
        self.instance = uuid7().hex
        # Usage (section 7.13): counted by the pipeline, reported every usage_interval
        # seconds and at shutdown; 0 turns it off.
        if not 0 <= usage_interval < float("inf"):
            raise ValueError("usage_interval must be 0 (off) or a finite number of seconds")
        self.usage_interval = usage_interval
        self._usage = Usage(self.id, self.instance, usage_interval > 0)
        # A connection shared with the process's other agents, instead of one of its own: its
        # owner drains it after the last agent, so shutdown leaves it open.
        self._shared_connection = connection
        self.started_ms = now_ms()
        self.stats = Stats()

        self._commands: dict[str, Handler] = {}
        self._capabilities: dict[str, Handler] = {}
        # What the manifest says of commands and capabilities (``endpoints``), by (kind, name).
        self._endpoints: dict[tuple[str, str], dict[str, Any]] = {}
        self._events: dict[str, EventHandler] = {}
        # Notification handlers by name; "*" takes every one without a handler of its own.
        self._notifications: dict[str, EventHandler] = {}
        # Contract-net: bid and counter handlers by capability, and who hears the outcomes.
        self._bidding = Bidding()
        self._nc: NATS | None = None
        self._connection: Connection | None = None
        self._subs: list[Any] = []
        # The replies to its requests, on an inbox subscription of its own (:mod:`._dispatch`).
        self._replies = Replies()
        self._tasks: set[asyncio.Task[Any]] = set()
        # Handler slots, given by priority when messages wait for one (section 7.9).
        self._slots = Slots(max_in_flight)
        # How long its handlers take lately (the manifest's handling_ms and eta_ms).
        self._handling = Handling()
        self._waiting = 0
        self._busy = 0
        self._seq: dict[str, list[int]] = {}
        self._stopping = False
        self._stopped = asyncio.Event()
        # Set once connect() has returned: a message that comes while the agent starts waits
        # for it, so that the handlers registered right after ``async with Agent(...)`` (no
        # await in between) serve it, rather than a 5016 for a handler not there yet.
        self._started = asyncio.Event()
        self._durable: DurableInbox | None = None
        # The parts that serve the agent see it as their Host; every layer is mixed in by Agent.
        host = cast("Host", self)
        self._task_worker = Tasks(host, self._handling, self._usage)
        self._exactly_once = ExactlyOnce(host)
        # Discovery is the sending layer's: a capability's holders say whether they read zstd.
        self._payloads = Payloads(
            host, self.payload_limits, lambda capability, timeout: cast(Any, self).discover(capability=capability, timeout=timeout)
        )

    def _take_wire(self, level: object) -> None:
        """Takes what the coordinator announced, on ``sys.wire`` or in a ``chorus-wire``
        notification: the bus's protocol major and the heartbeat floor (bounded, as in Rust:
        an announcement cannot silence the agent for long). Anything else is ignored."""
        if isinstance(level, dict) and level.get("major") in (1, 2):
            self._bus_major = int(level["major"])
            floor = level.get("heartbeat_ms")
            self._heartbeat_floor = (
                min(floor, MAX_HEARTBEAT_FLOOR_MS) / 1000 if isinstance(floor, int) and floor > 0 else 0.0
            )

    @property
    def in_flight(self) -> int:
        """Messages being handled right now."""
        return self._busy

    @property
    def connections(self) -> list[Any]:
        """The NATS connections it uses (its own, or one it shares), for the
        ``chorus_agent_active_connections`` gauge."""
        return [self._nc] if self._nc is not None else []

    @property
    def stopping(self) -> bool:
        """Whether the agent is shutting down."""
        return self._stopping

    async def until_stopping(self) -> None:
        """Returns once the agent starts shutting down."""
        await self._stopped.wait()

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise Unreachable(f"agent {self.id} is not connected")
        if self._connection is not None and self._connection.lost is not None:
            raise Unreachable(self._connection.lost.reason)
        return self._nc

    def spawn(self, coro: Awaitable[Any], name: str = "chorus-setup", eager: bool = False) -> asyncio.Task[Any]:
        """Runs ``coro`` as a task this agent owns: it waits for it at shutdown.

        ``eager``: from Python 3.12, the task starts at once, in this turn of the event loop
        (``eager_start``), and one that waits for nothing is done when this returns, without
        a turn of the loop of its own nor a place among the tasks shutdown waits for; it is
        its own task from its first line (``asyncio.current_task``, timeouts and task groups
        see it). An event loop with a task factory of its own makes it as before."""
        loop = asyncio.get_running_loop()
        task: asyncio.Task[Any]
        if sys.version_info >= (3, 12) and eager and loop.get_task_factory() is None:
            task = asyncio.Task(coro, loop=loop, name=name, eager_start=True)  # type: ignore[arg-type]
            if task.done():
                return task
        else:
            task = loop.create_task(coro, name=name)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
