"""A Chorus agent in Python: commands, capabilities, events, request-reply, durable commands,
discovery, broadcast, heartbeats and goodbye, on NATS, speaking docs/PROTOCOL.md."""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal, TypeVar, Union, overload

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from . import __version__
from .codec import F32, DecodeError, Encoding, Struct, decode, decode_payload, encode, encode_payload, encode_struct, sniff, typed
from .context import Context, Reply
from .durable import DurableInbox, InboxOptions
from .exactly_once import ExactlyOnce
from .envelope import (
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_MSGPACK,
    CONTENT_TYPE_OBJECT,
    DEFAULT_HOP_LIMIT,
    Delivery,
    Envelope,
    Expect,
    Kind,
    Performative,
    Priority,
    Seq,
    now_ms,
    uuid7,
)
from .encryption import EncryptionKey, encrypt
from . import service
from .service import EndpointStats
from .signing import Identity, Verifier
from .status import ChorusError, NoResponders, Refused, StatusCode, Timeout, Unreachable, is_success, reply_performative
from .subjects import Subjects, validate_dotted, validate_token
from .tasks import Check, TaskHandle, TaskHandler, TaskResult, Tasks
from .tasks import verify as verify_task
from .tasks import submit as submit_task

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


@dataclass
class _Route:
    kind: str  # "command", "capability", "event"
    handler: Callable[[Context], Awaitable[Any]]
    name: str


@dataclass
class _Gaps:
    seen: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)

    def observe(self, sender: str, subject: str, seq: Seq | None) -> int:
        if seq is None:
            return 0
        key = (sender, subject)
        last = self.seen.get(key)
        if last is None or last[0] != seq.epoch:
            self.seen[key] = (seq.epoch, seq.n)
            return 0
        if seq.n <= last[1]:
            return 0
        self.seen[key] = (seq.epoch, seq.n)
        if len(self.seen) > MAX_SEQ_SUBJECTS:
            self.seen.pop(next(iter(self.seen)))
        return seq.n - last[1] - 1


class Agent:
    """One agent on a Chorus bus.

    ``async with Agent("summarizer", servers="nats://127.0.0.1:4222") as agent:`` connects,
    subscribes what its handlers need, announces itself, and on leaving says goodbye and waits
    for running handlers (up to ``shutdown_timeout``).
    """

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
        heartbeat_interval: float = 5.0,
        request_timeout: float = 5.0,
        max_in_flight: int = 64,
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        hop_limit: int = DEFAULT_HOP_LIMIT,
        groups: list[str] | None = None,
        capability_version: str = "",
        max_message_bytes: int | None = None,
        durable_inbox: bool = True,
        service_discovery: bool = True,
        inbox: InboxOptions | None = None,
        default_delivery: Delivery = Delivery.AT_LEAST_ONCE,
        shutdown_timeout: float = 10.0,
        nats_options: dict[str, Any] | None = None,
    ) -> None:
        self.id = validate_token("agent id", id)
        self.subjects = Subjects(root)
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self._fixed_encoding = encoding
        self._bus_major = 1
        self.identity = identity
        self.verifier = verifier
        self.encryption_key = encryption_key
        self._encryption_trust: dict[str, str] = {}
        self.heartbeat_interval = heartbeat_interval
        self.request_timeout = request_timeout
        self.max_in_flight = max_in_flight
        self.queue_capacity = queue_capacity
        self.hop_limit = hop_limit
        self.groups = [validate_token("group", g) for g in (groups or [])]
        self.capability_version = capability_version
        self.max_message_bytes = max_message_bytes
        self.durable_inbox = durable_inbox
        self.service_discovery = service_discovery
        self._endpoint_stats: dict[str, EndpointStats] = {}
        self.inbox_options = inbox or InboxOptions()
        self.reconnect_hooks: list[Callable[[], None]] = []
        self.default_delivery = default_delivery
        self.shutdown_timeout = shutdown_timeout
        self.nats_options = dict(nats_options or {})
        self.instance = uuid7().hex
        self.started_ms = now_ms()
        self.stats = Stats()

        self._commands: dict[str, Handler] = {}
        self._capabilities: dict[str, Handler] = {}
        self._events: dict[str, EventHandler] = {}
        self._nc: NATS | None = None
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._waiting = 0
        self._busy = 0
        self._seq: dict[str, list[int]] = {}
        self._stopping = False
        self._stopped = asyncio.Event()
        self._durable: DurableInbox | None = None
        self._task_worker = Tasks(self)
        self._exactly_once = ExactlyOnce(self)

    # -----------------------------------------------------------------------------------------
    # Handlers

    def on_command(self, name: str, handler: Handler) -> None:
        """Handles requests and commands sent to ``<root>.agent.<id>.<name>``, and durable
        commands stored for this agent under that name."""
        self._commands[validate_token("command name", name)] = handler
        self._changed()

    def on_capability(self, capability: str, handler: Handler) -> None:
        """Serves a capability's access point (``<root>.cap.<capability>``, in its queue group)
        and this agent's own (``<root>.agent.<id>.cap.<capability>``)."""
        self._capabilities[validate_dotted("capability", capability)] = handler
        self._changed(capability=capability)

    def on_event(self, pattern: str, handler: EventHandler) -> None:
        """Runs ``handler`` for every event whose topic matches ``pattern`` (``*`` a token,
        ``>`` the rest)."""
        self.subjects.event_pattern(pattern)
        self._events[pattern] = handler
        self._changed(pattern=pattern)

    def command(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`on_command`: ``@agent.command("add")``."""

        def register(f: Handler) -> Handler:
            self.on_command(name, _as_async(f))
            return f

        return register

    def capability(self, capability: str) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`on_capability`."""

        def register(f: Handler) -> Handler:
            self.on_capability(capability, _as_async(f))
            return f

        return register

    def event(self, pattern: str) -> Callable[[EventHandler], EventHandler]:
        """Decorator form of :meth:`on_event`."""

        def register(f: EventHandler) -> EventHandler:
            self.on_event(pattern, _as_async(f))
            return f

        return register

    def on_task(self, name: str, handler: TaskHandler) -> None:
        """Serves task ``name`` (section 7.4): a submission to ``<root>.agent.<id>.<name>`` is
        taken (answered 5002) and ``handler`` runs with a :class:`TaskContext`; what it returns
        completes the task, a :class:`ChorusError` it raises fails it with that code."""
        self.on_command(name, self._task_worker.endpoint(_as_async(handler)))

    def on_task_capability(self, capability: str, handler: TaskHandler) -> None:
        """Serves tasks submitted to a capability."""
        self.on_capability(capability, self._task_worker.endpoint(_as_async(handler)))

    def task(self, name: str) -> Callable[[TaskHandler], TaskHandler]:
        """Decorator form of :meth:`on_task`: ``@agent.task("draft")``."""

        def register(f: TaskHandler) -> TaskHandler:
            self.on_task(name, f)
            return f

        return register

    def _changed(self, capability: str | None = None, pattern: str | None = None) -> None:
        """A handler registered while connected: subscribe what it needs and announce it."""
        if self._nc is None or not self._nc.is_connected:
            return

        async def apply() -> None:
            if capability is not None:
                await self._subscribe_capability(capability)
            if pattern is not None:
                await self._subscribe_event(pattern)
            if self._commands and self.durable_inbox:
                await self._start_durable()
            await self._heartbeat()

        self.spawn(apply())

    # -----------------------------------------------------------------------------------------
    # Life cycle

    async def __aenter__(self) -> Agent:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

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
        return self._nc

    async def connect(self) -> Agent:
        """Connects, subscribes every handler registered so far, and announces the agent."""
        options: dict[str, Any] = {"name": self.id, "inbox_prefix": self.subjects.reply_prefix(self.id).encode()}
        options.update(self.nats_options)
        # Bells may be lost while the connection is down: the durable inbox looks after it.
        user_reconnected = options.get("reconnected_cb")

        async def reconnected() -> None:
            for hook in list(self.reconnect_hooks):
                hook()
            if user_reconnected is not None:
                await user_reconnected()

        options["reconnected_cb"] = reconnected
        self._nc = await nats.connect(self.servers, **options)
        if self.max_message_bytes is None:
            self.max_message_bytes = self._nc.max_payload
        nc = self._nc
        self._subs.append(await nc.subscribe(self.subjects.agent_inbound(self.id), cb=self._inbound("command")))
        for capability in list(self._capabilities):
            await self._subscribe_capability(capability)
        for pattern in list(self._events):
            await self._subscribe_event(pattern)
        self._subs.append(await nc.subscribe(self.subjects.wire, cb=self._on_wire))
        if self.service_discovery:
            for subject in service.subjects(self.id, self.instance):
                self._subs.append(await nc.subscribe(subject, cb=self._on_service))
        await nc.flush()
        if self._commands and self.durable_inbox:
            await self._start_durable()
        if self.heartbeat_interval > 0:
            await self._heartbeat()
            self.spawn(self._heartbeats(), name="chorus-heartbeats")
        return self

    async def flush(self) -> None:
        """Waits until what this agent sent, and subscriptions made by late registrations,
        have reached the server."""
        pending = [t for t in self._tasks if not t.done() and t.get_name() == "chorus-setup"]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await self.nc.flush()

    async def shutdown(self) -> None:
        """Says goodbye, stops taking messages, waits for running handlers (up to
        ``shutdown_timeout``), then closes the connection."""
        if self._nc is None or self._stopping:
            return
        self._stopping = True
        self._stopped.set()
        nc = self._nc
        try:
            if nc.is_connected and self.heartbeat_interval > 0:
                await self._send_presence(goodbye=True)
            for sub in self._subs:
                try:
                    await sub.unsubscribe()
                except Exception:  # noqa: BLE001 - the connection may be gone already
                    pass
            if self._durable is not None:
                await self._durable.stop()
            current = asyncio.current_task()
            for task in self._tasks:
                if task.get_name() == "chorus-heartbeats":
                    task.cancel()
            running = [t for t in self._tasks if t is not current]
            if running:
                _, late = await asyncio.wait(running, timeout=self.shutdown_timeout)
                for task in late:
                    task.cancel()
                if late:
                    await asyncio.wait(late, timeout=1.0)
        finally:
            try:
                await nc.drain()
            except Exception:  # noqa: BLE001
                await nc.close()
            self._nc = None

    def spawn(self, coro: Awaitable[Any], name: str = "chorus-setup") -> asyncio.Task[Any]:
        """Runs ``coro`` as a task this agent owns: it waits for it at shutdown."""
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro, name=name)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -----------------------------------------------------------------------------------------
    # Presence

    def manifest(self) -> bytes:
        """This agent's capability manifest (section 7.7), MessagePack."""
        load = self._busy / self.max_in_flight if self.max_in_flight else 0.0
        fields: list[tuple[str, Any]] = [
            ("agent", self.id),
            ("instance", self.instance),
            ("capabilities", [Struct([("name", c), ("version", self.capability_version)]) for c in sorted(self._capabilities)]),
            ("commands", sorted(self._commands)),
            ("groups", sorted(self.groups)),
            ("content_types", [CONTENT_TYPE_MSGPACK, CONTENT_TYPE_JSON]),
            ("load", F32(min(load, 1.0))),
            ("slots", self.max_in_flight),
            ("availability", "away" if self._stopping else ("busy" if load >= 1.0 else "available")),
        ]
        if self.identity is not None:
            fields.append(("public_key", self.identity.public_key))
        if self.encryption_key is not None:
            fields.append(("encryption_key", self.encryption_key.public_key))
        fields += [
            ("heartbeat_ms", int(self.heartbeat_interval * 1000)),
            ("started_ms", self.started_ms),
            ("sdk_version", __version__),
            ("wire_versions", [1, 2]),
        ]
        return encode_struct(fields)

    async def _send_presence(self, goodbye: bool = False) -> None:
        env = Envelope.new(Kind.HEARTBEAT, Performative.DONE if goodbye else Performative.HEALTH, self.id)
        env.payload = self.manifest()
        if goodbye:
            env.status = StatusCode.DISCONNECTED
        subject = self.subjects.goodbye(self.id) if goodbye else self.subjects.heartbeat(self.id)
        await self._publish_envelope(subject, env)

    async def _heartbeat(self) -> None:
        try:
            await self._send_presence()
        except Exception as e:  # noqa: BLE001 - the next beat tries again
            log.debug("heartbeat not sent: %s", e)

    async def _heartbeats(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.heartbeat_interval)
            if not self._stopping:
                await self._heartbeat()

    async def _on_service(self, msg: Msg) -> None:
        if not msg.reply:
            return
        endpoints = [
            (name, self.subjects.command(self.id, name), "", self._endpoint_stats.setdefault(name, EndpointStats()))
            for name in sorted(self._commands)
        ] + [
            (
                name,
                self.subjects.capability(name),
                self.subjects.capability(name),
                self._endpoint_stats.setdefault(name, EndpointStats()),
            )
            for name in sorted(self._capabilities)
        ]
        body = service.answer(
            msg.subject.split(".")[1],
            agent=self.id,
            instance=self.instance,
            version=__version__,
            root=self.subjects.root,
            capabilities=sorted(self._capabilities),
            endpoints=endpoints,
            started_ms=self.started_ms,
        )
        if body is not None:
            await self.nc.publish(msg.reply, body)

    async def _on_wire(self, msg: Msg) -> None:
        try:
            env, _ = decode(msg.data, self.subjects.implied(msg.subject))
            level = decode_payload(env.payload, env.content_type)
        except DecodeError:
            return
        if isinstance(level, dict) and level.get("major") in (1, 2):
            self._bus_major = int(level["major"])

    @property
    def encoding(self) -> Encoding:
        """The form this agent writes: its own if set, else the bus's (section 3.5)."""
        if self._fixed_encoding is not None:
            return self._fixed_encoding
        return Encoding.COMPACT if self._bus_major == 2 else Encoding.MSGPACK

    def trust_encryption(self, agent: str, public_key: str) -> Agent:
        """Registers ``agent``'s public encryption key (base64) for ``encrypt_for``, besides
        the one its manifest announces."""
        self._encryption_trust[validate_token("agent id", agent)] = public_key
        return self

    async def _encrypt(self, env: Envelope, recipients: list[str]) -> None:
        """Seals ``env``'s payload for ``recipients``; keys from :meth:`trust_encryption`, else
        from the registry (discovery). 5007 when one has no known key."""
        missing = [a for a in recipients if a not in self._encryption_trust]
        if missing:
            try:
                for record in await self.discover():
                    manifest = record.get("manifest", {})
                    if manifest.get("agent") in missing and manifest.get("encryption_key"):
                        self._encryption_trust[manifest["agent"]] = manifest["encryption_key"]
            except ChorusError:
                pass
        keys = []
        for agent in recipients:
            key = self._encryption_trust.get(agent)
            if key is None:
                raise ChorusError(StatusCode.ACCESS, f"no encryption key is known for {agent}")
            keys.append((agent, key))
        encrypt(env, keys)

    # -----------------------------------------------------------------------------------------
    # Sending

    def _envelope(
        self,
        kind: Kind,
        performative: Performative,
        parent: Envelope | None,
        *,
        hop_limit: int | None = None,
    ) -> Envelope:
        """A new envelope; a forward of ``parent`` when given (section 7.3)."""
        env = Envelope.new(kind, performative, self.id)
        env.hop_limit = min(hop_limit or self.hop_limit, self.hop_limit)
        if parent is not None:
            env.correlation_id = parent.conversation
            env.hops = parent.hops + 1
            env.hop_limit = min(env.hop_limit, parent.hop_limit)
            if env.hops > env.hop_limit:
                raise ChorusError(StatusCode.LOOP_DETECTED, f"hop limit {env.hop_limit} reached")
            expires = parent.expires_ms()
            if expires is not None:
                if expires <= env.timestamp_ms:
                    raise ChorusError(StatusCode.EXPIRED, "the message this answers has expired")
                env.deadline_ms = expires
            env.trace = parent.trace
            env.session_id = parent.session_id
            env.customer_id = parent.customer_id
        return env

    def set_payload(self, env: Envelope, payload: Payload, content_type: str | None) -> None:
        """Puts a payload into ``env``: bytes as they are, a ``Reply`` with its content type,
        any other value encoded (MessagePack unless ``content_type`` says JSON)."""
        if isinstance(payload, Reply):
            env.payload, env.content_type = payload.payload, payload.content_type
        elif isinstance(payload, (bytes, bytearray, memoryview)):
            env.payload = bytes(payload)
            env.content_type = content_type or "application/octet-stream"
        else:
            # None travels as nil (`null` in JSON), as the Rust SDK writes a unit value.
            env.content_type = content_type or CONTENT_TYPE_MSGPACK
            env.payload = encode_payload(payload, env.content_type)

    def encode_for(self, subject: str, env: Envelope, encoding: Encoding | None = None) -> bytes:
        """``env`` signed (when this agent signs) and encoded for ``subject``, within the size
        limit (5006 past it)."""
        if self.identity is not None and env.signature is None:
            self.identity.sign(subject, env)
        data = encode(env, encoding or self.encoding, self.subjects.implied(subject))
        limit = self.max_message_bytes
        if limit is not None and len(data) > limit:
            raise ChorusError(StatusCode.DATA_FORMAT, f"message of {len(data)} bytes exceeds the limit of {limit} bytes")
        return data

    @staticmethod
    def nats_headers(env: Envelope) -> dict[str, str] | None:
        """The NATS headers that mirror ``env``: its trace context, when it has one."""
        if env.trace is None:
            return None
        headers = {"traceparent": env.trace.traceparent}
        if env.trace.tracestate is not None:
            headers["tracestate"] = env.trace.tracestate
        return headers

    async def _publish_envelope(self, subject: str, env: Envelope, reply: str = "") -> None:
        await self.nc.publish(subject, self.encode_for(subject, env), reply=reply, headers=self.nats_headers(env))

    async def publish(
        self,
        topic: str,
        payload: Payload = None,
        *,
        content_type: str | None = None,
        priority: Priority = Priority.NORMAL,
        headers: dict[str, str] | None = None,
        parent: Envelope | None = None,
    ) -> None:
        """Publishes an event on ``<root>.evt.<topic>``, numbered on its subject."""
        subject = self.subjects.event(topic)
        env = self._envelope(Kind.EVENT, Performative.INFORM, parent)
        env.topic = topic
        env.priority = priority
        env.headers = dict(headers or {})
        self.set_payload(env, payload, content_type)
        count = self._seq.get(subject)
        if count is None:
            if len(self._seq) >= MAX_SEQ_SUBJECTS:
                self._seq.pop(next(iter(self._seq)))
            count = self._seq[subject] = [random.getrandbits(32), 0]
        count[1] += 1
        env.seq = Seq(count[0], count[1])
        await self._publish_envelope(subject, env)

    @overload
    async def request(
        self,
        agent: str,
        command: str,
        payload: Payload = None,
        *,
        timeout: float | None = None,
        content_type: str | None = None,
        parent: Envelope | None = None,
        headers: dict[str, str] | None = None,
        encoding: Encoding | None = None,
        encrypt_for: list[str] | None = None,
        raw: Literal[False] = False,
        returns: type[R],
    ) -> R: ...

    @overload
    async def request(
        self,
        agent: str,
        command: str,
        payload: Payload = None,
        *,
        timeout: float | None = None,
        content_type: str | None = None,
        parent: Envelope | None = None,
        headers: dict[str, str] | None = None,
        encoding: Encoding | None = None,
        encrypt_for: list[str] | None = None,
        raw: Literal[True],
        returns: None = None,
    ) -> Envelope: ...

    @overload
    async def request(
        self,
        agent: str,
        command: str,
        payload: Payload = None,
        *,
        timeout: float | None = None,
        content_type: str | None = None,
        parent: Envelope | None = None,
        headers: dict[str, str] | None = None,
        encoding: Encoding | None = None,
        encrypt_for: list[str] | None = None,
        raw: bool = False,
        returns: None = None,
    ) -> Any: ...

    async def request(
        self,
        agent: str,
        command: str,
        payload: Payload = None,
        *,
        timeout: float | None = None,
        content_type: str | None = None,
        raw: bool = False,
        parent: Envelope | None = None,
        headers: dict[str, str] | None = None,
        encoding: Encoding | None = None,
        returns: type[Any] | None = None,
        encrypt_for: list[str] | None = None,
    ) -> Any:
        """Asks ``agent`` to run ``command`` and returns the answer's value (as a ``returns``
        when given: a dataclass, a pydantic model or a plain type; the reply envelope itself
        with ``raw=True``). Raises :class:`ChorusError` with the reply's code, 5005 on
        timeout, 5012 when nobody serves the subject."""
        subject = self.subjects.command(agent, command)
        env = self._envelope(Kind.REQUEST, Performative.REQUEST, parent)
        env.to = [agent]
        env.name = command
        return await self._call(subject, env, payload, timeout, content_type, raw, headers, encoding, returns, encrypt_for)

    @overload
    async def request_capability(
        self,
        capability: str,
        payload: Payload = None,
        *,
        at: str | None = None,
        timeout: float | None = None,
        content_type: str | None = None,
        parent: Envelope | None = None,
        headers: dict[str, str] | None = None,
        encoding: Encoding | None = None,
        encrypt_for: list[str] | None = None,
        raw: Literal[False] = False,
        returns: type[R],
    ) -> R: ...

    @overload
    async def request_capability(
        self,
        capability: str,
        payload: Payload = None,
        *,
        at: str | None = None,
        timeout: float | None = None,
        content_type: str | None = None,
        parent: Envelope | None = None,
        headers: dict[str, str] | None = None,
        encoding: Encoding | None = None,
        encrypt_for: list[str] | None = None,
        raw: Literal[True],
        returns: None = None,
    ) -> Envelope: ...

    @overload
    async def request_capability(
        self,
        capability: str,
        payload: Payload = None,
        *,
        at: str | None = None,
        timeout: float | None = None,
        content_type: str | None = None,
        parent: Envelope | None = None,
        headers: dict[str, str] | None = None,
        encoding: Encoding | None = None,
        encrypt_for: list[str] | None = None,
        raw: bool = False,
        returns: None = None,
    ) -> Any: ...

    async def request_capability(
        self,
        capability: str,
        payload: Payload = None,
        *,
        at: str | None = None,
        timeout: float | None = None,
        content_type: str | None = None,
        raw: bool = False,
        parent: Envelope | None = None,
        headers: dict[str, str] | None = None,
        encoding: Encoding | None = None,
        returns: type[Any] | None = None,
        encrypt_for: list[str] | None = None,
    ) -> Any:
        """Asks one agent serving ``capability`` (any of them, or the one named by ``at``);
        as :meth:`request` otherwise."""
        if at is not None:
            subject = self.subjects.capability_at(at, capability)
        else:
            subject = self.subjects.capability(capability)
        env = self._envelope(Kind.REQUEST, Performative.REQUEST, parent)
        env.capability = capability
        if at is not None:
            env.to = [at]
        return await self._call(subject, env, payload, timeout, content_type, raw, headers, encoding, returns, encrypt_for)

    async def _call(
        self,
        subject: str,
        env: Envelope,
        payload: Payload,
        timeout: float | None,
        content_type: str | None,
        raw: bool,
        headers: dict[str, str] | None,
        encoding: Encoding | None,
        returns: type[Any] | None = None,
        encrypt_for: list[str] | None = None,
    ) -> Any:
        wait = self.request_timeout if timeout is None else timeout
        wait_ms = max(1, int(wait * 1000))
        if env.deadline_ms is not None:
            wait_ms = min(wait_ms, max(1, env.deadline_ms - env.timestamp_ms))
        env.ttl_ms = wait_ms
        env.expect = Expect(Performative.INFORM, wait_ms)
        env.headers = dict(headers or {})
        self.set_payload(env, payload, content_type)
        if encrypt_for:
            await self._encrypt(env, encrypt_for)
        reply = await self.exchange(subject, env, wait_ms / 1000, encoding)
        if raw:
            return reply
        try:
            return typed(_value(reply), returns)
        except DecodeError as e:
            raise ChorusError(StatusCode.DATA_FORMAT, e.reason) from e

    async def exchange(self, subject: str, env: Envelope, wait: float, encoding: Encoding | None = None) -> Envelope:
        """Sends ``env`` as a request on ``subject`` and returns the reply envelope within
        ``wait`` seconds; raises :class:`ChorusError` with the reply's failure code, 5012 when
        nobody serves the subject, 5005 on timeout, 5006 for a reply that does not decode."""
        data = self.encode_for(subject, env, encoding)
        try:
            msg = await self.nc.request(subject, data, timeout=wait, headers=self.nats_headers(env))
        except nats.errors.NoRespondersError as err:
            raise NoResponders(f"nobody serves {subject}") from err
        except nats.errors.TimeoutError as err:
            raise Timeout(f"no reply from {subject} within {wait:.3f} s") from err
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as err:
            raise Unreachable(f"agent {self.id} lost its connection: {err}") from err
        try:
            reply, _ = decode(msg.data, self.subjects.implied(msg.subject))
        except DecodeError as e:
            raise ChorusError(StatusCode.DATA_FORMAT, f"the reply did not decode: {e.reason}") from e
        if self.verifier is not None:
            self.verifier.verify(msg.subject, reply)
        if reply.status is not None and not is_success(reply.status):
            raise Refused(reply.status, reply.reason or "")
        return reply

    async def send(
        self,
        agent: str,
        command: str,
        payload: Payload = None,
        *,
        delivery: Delivery | None = None,
        priority: Priority = Priority.NORMAL,
        ttl: float | None = None,
        content_type: str | None = None,
        parent: Envelope | None = None,
        headers: dict[str, str] | None = None,
        encrypt_for: list[str] | None = None,
    ) -> int:
        """Sends a command in a delivery class: ``AT_MOST_ONCE`` publishes it to the agent's
        command subject; ``AT_LEAST_ONCE`` and ``EXACTLY_ONCE`` store it in the agent's
        durable inbox (section 7.5) and return its stream sequence once the stream has it."""
        delivery = delivery or self.default_delivery
        env = self._envelope(Kind.COMMAND, Performative.REQUEST, parent)
        env.to = [agent]
        env.name = command
        env.priority = priority
        env.delivery = delivery
        env.headers = dict(headers or {})
        if ttl is not None:
            env.ttl_ms = max(1, int(ttl * 1000))
        self.set_payload(env, payload, content_type)
        if encrypt_for:
            await self._encrypt(env, encrypt_for)
        if delivery is Delivery.AT_MOST_ONCE:
            await self._publish_envelope(self.subjects.command(agent, command), env)
            return 0
        high = priority in (Priority.HIGH, Priority.CRITICAL)
        subject = self.subjects.durable_inbox(agent, high, command)
        data = self.encode_for(subject, env)
        limit = (self.max_message_bytes or self.nc.max_payload) - 4096
        if len(data) > limit:
            raise ChorusError(
                StatusCode.DATA_FORMAT,
                f"durable message of {len(data)} bytes exceeds the limit of max_payload - 4096 = {limit} bytes",
            )
        nats_headers = self.nats_headers(env) or {}
        if delivery is Delivery.EXACTLY_ONCE:
            nats_headers["Nats-Msg-Id"] = str(env.id)
        js = self.nc.jetstream(timeout=self.request_timeout)
        try:
            ack = await js.publish(subject, data, headers=nats_headers or None)
        except nats.errors.TimeoutError as err:
            raise Timeout(f"the inbox stream did not acknowledge {subject}") from err
        except nats.js.errors.NoStreamResponseError as err:
            raise ChorusError(
                StatusCode.UNAVAILABLE,
                f"no stream stores {subject}: start the coordinator (chorus serve) or a durable agent first",
            ) from err
        return int(ack.seq)

    async def discover(
        self,
        capability: str | None = None,
        group: str | None = None,
        available_only: bool = False,
        max_load: float | None = None,
        timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        """The live agents that match, least loaded first: ``[{"manifest": {...},
        "last_seen_ms": ...}]`` (section 7.7; answered by the coordinator)."""
        query: dict[str, Any] = {}
        if capability is not None:
            query["capability"] = validate_dotted("capability", capability)
        if group is not None:
            query["group"] = validate_token("group", group)
        if available_only:
            query["available_only"] = True
        if max_load is not None:
            query["max_load"] = max_load
        env = self._envelope(Kind.REQUEST, Performative.DISCOVER, None)
        wait = self.request_timeout if timeout is None else timeout
        env.ttl_ms = int(wait * 1000)
        env.expect = Expect(Performative.INFORM, env.ttl_ms)
        self.set_payload(env, query, CONTENT_TYPE_MSGPACK)
        found = _value(await self.exchange(self.subjects.discover, env, wait))
        return list(found or [])

    async def broadcast(
        self,
        command: str,
        payload: Payload = None,
        *,
        group: str | None = None,
        capability: str | None = None,
        timeout: float = 2.0,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        """Sends ``command`` to every live agent (or a group's, or a capability's holders)
        through the coordinator, and returns its report (section 7.6)."""
        subject = self.subjects.broadcast(group=group, capability=capability)
        env = self._envelope(Kind.COMMAND, Performative.REQUEST, None)
        env.name = validate_token("command name", command)
        timeout_ms = int(timeout * 1000)
        env.expect = Expect(Performative.INFORM, timeout_ms)
        env.ttl_ms = timeout_ms + 5000
        self.set_payload(env, payload, content_type)
        report = _value(await self.exchange(subject, env, timeout + 5.0))
        return dict(report or {})

    async def submit(
        self,
        payload: Payload = None,
        *,
        to: str | None = None,
        name: str | None = None,
        capability: str | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        verify: bool = False,
    ) -> TaskHandle:
        """Submits a task to agent ``to``'s task ``name``, or to a ``capability`` (any holder,
        or ``to``'s own access point), and returns its handle once a worker has taken it.
        ``deadline`` (seconds from now) expires it. Raises :class:`ChorusError` with the code
        when nobody takes it (the task is then recorded ``rejected``)."""
        if capability is None and (to is None or name is None):
            raise ValueError("submit needs to= and name=, or capability=")
        return await submit_task(
            self,
            self._task_worker.store,
            payload,
            to=to,
            name=name,
            capability=capability,
            deadline=deadline,
            timeout=self.request_timeout if timeout is None else timeout,
            verify=verify,
        )

    async def verify(
        self,
        handle: TaskHandle,
        check: Check,
        *,
        max_attempts: int = 3,
        retries: int = 0,
        candidates: tuple[str, ...] | list[str] = (),
        supervisor: str | None = None,
    ) -> TaskResult:
        """Judges each result of a task submitted with ``verify=True`` until one passes or the
        attempts run out (then 5025); see :func:`chorus.tasks.verify`."""
        return await verify_task(
            self,
            handle,
            check,
            max_attempts=max_attempts,
            retries=retries,
            candidates=candidates,
            supervisor=supervisor,
        )

    def task_handle(self, task: uuid.UUID | str) -> TaskHandle:
        """The handle of a task submitted earlier (after a restart, say), by its id."""
        task = task if isinstance(task, uuid.UUID) else uuid.UUID(task)
        return TaskHandle(self, self._task_worker.store, task)

    # -----------------------------------------------------------------------------------------
    # Receiving

    async def _subscribe_capability(self, capability: str) -> None:
        nc = self.nc
        shared = self.subjects.capability(capability)
        self._subs.append(await nc.subscribe(shared, queue=shared, cb=self._inbound("capability", capability)))
        own = self.subjects.capability_at(self.id, capability)
        self._subs.append(await nc.subscribe(own, cb=self._inbound("capability", capability)))

    async def _subscribe_event(self, pattern: str) -> None:
        gaps = _Gaps()
        self._subs.append(
            await self.nc.subscribe(self.subjects.event_pattern(pattern), cb=self._inbound("event", pattern, gaps))
        )

    def _inbound(self, route: str, name: str = "", gaps: _Gaps | None = None) -> Callable[[Msg], Awaitable[None]]:
        async def on_message(msg: Msg) -> None:
            if self._stopping:
                return
            # Decoded once, here: an event's numbering is checked as it arrives, before anything
            # is queued, and the handler gets the same envelope.
            decoded = self._decode(msg)
            if gaps is not None and not isinstance(decoded, DecodeError):
                self.stats.lost += gaps.observe(decoded[0].from_, msg.subject, decoded[0].seq)
            if self._waiting >= self.queue_capacity:
                await self._overflow(msg, route)
                return
            self._waiting += 1
            self.spawn(self._run(msg, route, name, decoded), name="chorus-handler")

        return on_message

    def _decode(self, msg: Msg) -> tuple[Envelope, Encoding] | DecodeError:
        try:
            return decode(msg.data, self.subjects.implied(msg.subject), self.max_message_bytes)
        except DecodeError as e:
            return e

    async def _overflow(self, msg: Msg, route: str) -> None:
        if route == "event" or not msg.reply:
            self.stats.dropped += 1
            self.stats.lost += 1
            return
        self.stats.shed += 1
        await self._answer(msg, None, _encoding_of(msg.data, self.encoding), ChorusError(StatusCode.UNAVAILABLE, "overloaded: the agent's queue is full"))

    async def _run(self, msg: Msg, route: str, name: str, decoded: tuple[Envelope, Encoding] | DecodeError) -> None:
        try:
            async with self._slots:
                self._waiting -= 1
                self._busy += 1
                try:
                    await self._process(msg, route, name, decoded)
                finally:
                    self._busy -= 1
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a handler's crash must not end the agent
            log.exception("agent %s: message on %s not handled", self.id, msg.subject)

    async def _process(self, msg: Msg, route: str, name: str, decoded: tuple[Envelope, Encoding] | DecodeError) -> None:
        if isinstance(decoded, DecodeError):
            self.stats.refused += 1
            encoding = _encoding_of(msg.data, self.encoding)
            await self._answer(msg, None, encoding, ChorusError(StatusCode.DATA_FORMAT, decoded.reason))
            return
        env, encoding = decoded
        outcome = await self.handle(env, msg.subject, route, name)
        if route == "event":
            if isinstance(outcome, ChorusError):
                log.warning("agent %s: event handler failed on %s: %s", self.id, msg.subject, outcome)
            return
        await self._answer(msg, env, encoding, outcome)

    async def handle(self, env: Envelope, subject: str, route: str, name: str, attempt: int = 1) -> Any:
        """The inbound pipeline after decoding: admission, signature, the handler. Returns the
        handler's value, or the :class:`ChorusError` to answer with."""
        refused = self._admit(env, subject)
        if refused is not None:
            self.stats.refused += 1
            return refused
        if route == "command":
            command = self.subjects.command_name(subject) or self.subjects.durable_command(subject) or ""
            handler = self._commands.get(command)
        elif route == "capability":
            handler = self._capabilities.get(name)
        else:
            handler = self._events.get(name)
        if handler is None:
            self.stats.refused += 1
            return ChorusError(StatusCode.UNKNOWN_COMMAND, f"no handler for {subject}")
        ctx = Context(self, env, subject, attempt)
        started = time.perf_counter_ns()
        if env.delivery is Delivery.EXACTLY_ONCE and route != "event":
            outcome = await self._exactly_once.run(env, lambda: self._invoke(handler, ctx))
        else:
            outcome = await self._invoke(handler, ctx)
        if route != "event":
            endpoint = name if route == "capability" else (self.subjects.command_name(subject) or self.subjects.durable_command(subject) or "")
            self._endpoint_stats.setdefault(endpoint, EndpointStats()).record(
                time.perf_counter_ns() - started,
                f"{outcome.status} {outcome.reason}" if isinstance(outcome, ChorusError) else None,
            )
        return outcome

    async def _invoke(self, handler: Callable[[Context], Awaitable[Any]], ctx: Context) -> Any:
        """Runs a handler: its value, or the :class:`ChorusError` to answer with (anything
        else it raises is 5017)."""
        try:
            result = await handler(ctx)
        except ChorusError as e:
            self.stats.failed += 1
            return e
        except DecodeError as e:
            self.stats.failed += 1
            return ChorusError(StatusCode.DATA_FORMAT, e.reason)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - answered as 5017, never a crash
            self.stats.failed += 1
            log.warning("agent %s: handler for %s raised %r", self.id, ctx.subject, e)
            return ChorusError(StatusCode.HANDLER_FAILED, f"{type(e).__name__}: {e}")
        self.stats.handled += 1
        return result

    def _admit(self, env: Envelope, subject: str) -> ChorusError | None:
        if env.kind is Kind.UNKNOWN:
            return ChorusError(StatusCode.DATA_FORMAT, "unknown message kind")
        expires = env.expires_ms()
        if expires is not None and now_ms() > expires:
            return ChorusError(StatusCode.EXPIRED, "the message expired before it was handled")
        limit = min(env.hop_limit, self.hop_limit)
        if env.hops > limit:
            return ChorusError(StatusCode.LOOP_DETECTED, f"hops {env.hops} exceed the hop limit {limit}")
        if self.verifier is not None:
            try:
                self.verifier.verify(subject, env)
            except ChorusError as e:
                return e
        # After the signature check (which covers the payload as sent), as the Rust SDK opens
        # payloads; before decryption, as there is nothing this SDK could do with the result.
        unread = unreadable_payload(env)
        if unread is not None:
            return unread
        if env.encryption is not None:
            # After the signature check, which covers the ciphertext.
            if self.encryption_key is None:
                return ChorusError(StatusCode.ACCESS, "this agent has no decryption key")
            try:
                self.encryption_key.decrypt(self.id, env)
            except ChorusError as e:
                return e
        return None

    def reply_envelope(self, request: Envelope | None, outcome: Any) -> Envelope:
        """The response to ``request`` for a handler's value or error (section 7.1)."""
        if isinstance(outcome, ChorusError):
            status, reason = outcome.status, outcome.reason
        else:
            status, reason = int(StatusCode.OK), None
        env = Envelope.new(Kind.RESPONSE, Performative.read(reply_performative(status)), self.id)
        env.status = status
        env.reason = reason or (None if status in (5001, 5002, 5021) else "")
        if request is not None:
            env.in_reply_to = request.id
            env.correlation_id = request.conversation
            env.to = [request.from_]
            env.name, env.capability = request.name, request.capability
            env.hops, env.hop_limit = request.hops, request.hop_limit
            env.trace = request.trace
            env.content_type = request.content_type
        if not isinstance(outcome, ChorusError):
            env.payload, env.content_type = self.reply_payload(request, outcome)
        return env

    @staticmethod
    def reply_payload(request: Envelope | None, value: Any) -> tuple[bytes, str]:
        """A handler's value as a reply payload: raw for a :class:`Reply`, else encoded in the
        request's content type (MessagePack unless it asked in JSON)."""
        if isinstance(value, Reply):
            return value.payload, value.content_type
        asked = request.content_type if request is not None else CONTENT_TYPE_MSGPACK
        content_type = CONTENT_TYPE_JSON if asked == CONTENT_TYPE_JSON else CONTENT_TYPE_MSGPACK
        return encode_payload(value, content_type), content_type

    async def _answer(self, msg: Msg, request: Envelope | None, encoding: Encoding, outcome: Any) -> None:
        if not msg.reply:
            return
        env = self.reply_envelope(request, outcome)
        if env.content_type == CONTENT_TYPE_OBJECT:
            # A refusal of a request whose payload came by reference carries no payload of
            # that kind (as the Rust SDK answers it).
            env.content_type = encoding.content_type
        try:
            data = self.encode_for(msg.reply, env, encoding)
        except ChorusError as e:
            # Too large for the server: a refusal instead.
            env = self.reply_envelope(request, e)
            data = self.encode_for(msg.reply, env, encoding)
        try:
            await self.nc.publish(msg.reply, data, headers=self.nats_headers(env))
        except Exception as e:  # noqa: BLE001 - the caller times out
            log.debug("reply not sent: %s", e)

    # -----------------------------------------------------------------------------------------
    # Durable inbox

    async def _start_durable(self) -> None:
        if self._durable is None:
            self._durable = DurableInbox(self, self.inbox_options)
        try:
            await self._durable.start()
        except Exception as e:  # noqa: BLE001 - a bus without JetStream still serves core traffic
            log.warning("agent %s: durable inbox not started: %s", self.id, e)


C = TypeVar("C", bound=Context)


def _as_async(f: Callable[[C], Any]) -> Callable[[C], Awaitable[Any]]:
    """A handler written as a plain function runs as a coroutine."""
    if inspect.iscoroutinefunction(f):
        return f

    async def call(ctx: C) -> Any:
        return f(ctx)

    return call


def _encoding_of(data: bytes, default: Encoding) -> Encoding:
    """The encoding to answer a message in: its own, else this agent's (section 3.1)."""
    return sniff(data) or default


def unreadable_payload(env: Envelope) -> ChorusError | None:
    """The 5006 refusal of a payload this SDK does not read: a compressed one (the manifest
    announces no content encoding, so a Rust sender does not compress for this agent) or one
    carried by reference through the object store (section 7.11), which it does not fetch.
    ``None`` for any other."""
    if env.content_encoding is not None:
        return ChorusError(StatusCode.DATA_FORMAT, f"unsupported content encoding '{env.content_encoding}'")
    if env.content_type == CONTENT_TYPE_OBJECT:
        return ChorusError(
            StatusCode.DATA_FORMAT,
            f"payloads by reference ({CONTENT_TYPE_OBJECT}) are not read by the Python SDK",
        )
    return None


def _value(reply: Envelope) -> Any:
    if not reply.payload:
        return None
    unread = unreadable_payload(reply)
    if unread is not None:
        raise unread
    if reply.content_type in (CONTENT_TYPE_MSGPACK, CONTENT_TYPE_JSON):
        try:
            return decode_payload(reply.payload, reply.content_type)
        except DecodeError as e:
            raise ChorusError(StatusCode.DATA_FORMAT, e.reason) from e
    return reply.payload


__all__ = ["Agent", "Stats", "Context", "Reply"]
