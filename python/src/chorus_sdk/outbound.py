"""What an agent sends: envelopes built and forwarded (hop count, deadline, trace), signed and
encoded within the size limit, published, requested with a typed answer, sent durably;
discovery and broadcast through the coordinator; payloads sealed for named recipients."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, overload

import nats
import nats.errors
from nats.aio.msg import Msg

from .codec import DecodeError, Encoding, decode, encode, encode_payload, typed
from .context import Reply, check_headers
from .envelope import CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, CONTENT_TYPE_OBJECT, Delivery, Envelope, Expect, Kind, Performative, Priority, Seq, now_ms, uuid7
from .encryption import encrypt_in_sessions
from .status import SUCCESS, ChorusError, NoResponders, Refused, StatusCode, Timeout, Unreachable
from .subjects import validate_dotted, validate_token

from .dead_letters import DeadLetter, write_dead_letter
from .multicast import Collect, MulticastReport, check_multicast, collect_replies, reply_value
from .notify import DELIVERED, STORED, NotifyRecipient, NotifyReport, NotifyTarget
from .durable import RetryPolicy
from .credits import CREDITS_BUCKET, Ledger
from .routing import LOOKUP_TIMEOUT, CircuitOpen, CircuitState, Routing
from .eta import U64_MAX

from ._state import MAX_SEQ_SUBJECTS, AgentState, Payload, R, log

if TYPE_CHECKING:
    from typing_extensions import Unpack

O = TypeVar("O", bound="Outbound")

# What every request reads, looked up once: before Python 3.12 each read of an Enum's member
# off its class (``Kind.REQUEST``) is a descriptor call.
_REQUEST, _ASK, _INFORM = Kind.REQUEST, Performative.REQUEST, Performative.INFORM
_AT_MOST_ONCE = Delivery.AT_MOST_ONCE
_OK = int(StatusCode.OK)


class Outbound(AgentState):
    """The sending layer of an agent."""

    @property
    def encoding(self) -> Encoding:
        """The form this agent writes: its own if set, else the bus's (section 3.5)."""
        if self._fixed_encoding is not None:
            return self._fixed_encoding
        return Encoding.COMPACT if self._bus_major == 2 else Encoding.MSGPACK

    def trust_encryption(self: O, agent: str, public_key: str) -> O:
        """Registers ``agent``'s public encryption key (base64) for ``encrypt_for``, besides
        the one its manifest announces."""
        self._encryption_trust[validate_token("agent id", agent)] = public_key
        return self

    async def _encrypt(self, env: Envelope, recipients: list[str]) -> None:
        """Seals ``env``'s payload for ``recipients`` in this agent's sessions (section 4.2);
        keys from :meth:`trust_encryption`, else from the registry (discovery). 5007 when one
        has no known key."""
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
        encrypt_in_sessions(env, keys, self._encryption_sessions)


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
                self.stats.loop_refused += 1
                raise ChorusError(StatusCode.LOOP_DETECTED, f"hop limit {env.hop_limit} reached")
            expires = parent.expires_ms()
            if expires is not None:
                if expires <= env.timestamp_ms:
                    self.stats.expired += 1
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

    async def _publish_envelope(self, subject: str, env: Envelope, reply: str = "") -> None:
        await self.nc.publish(subject, self.encode_for(subject, env), reply=reply)

    async def publish(
        self,
        topic: str,
        payload: Payload = None,
        *,
        content_type: str | None = None,
        priority: Priority = Priority.NORMAL,
        headers: dict[str, str] | None = None,
        parent: Envelope | None = None,
        session: str | None = None,
        customer: str | None = None,
    ) -> None:
        """Publishes an event on ``<root>.evt.<topic>``, numbered on its subject (``session``
        and ``customer`` as :meth:`request` sets them)."""
        subject = self.subjects.event(topic)
        env = self._envelope(Kind.EVENT, Performative.INFORM, parent)
        _set_context(env, session, customer)
        env.topic = topic
        env.priority = priority
        env.headers = check_headers(headers)
        self.set_payload(env, payload, content_type)
        # A large payload is stored first (an event's readers are unknown: never compressed),
        # before the event is numbered, so that the numbers go out in order.
        if not self._payloads.fits_inline(len(env.payload)):
            await self._payloads.fit(env)
        count = self._seq.get(subject)
        if count is None:
            if len(self._seq) >= MAX_SEQ_SUBJECTS:
                self._seq.pop(next(iter(self._seq)))
            count = self._seq[subject] = [random.getrandbits(32), 0]
        count[1] += 1
        env.seq = Seq(count[0], count[1])
        await self._publish_envelope(subject, env)
        self.stats.events_published += 1

    @overload
    async def request(
        self, agent: str, command: str, payload: Payload = None, *, raw: Literal[False] = False, returns: type[R], **kw: Unpack[CallOptions]
    ) -> R: ...

    @overload
    async def request(
        self, agent: str, command: str, payload: Payload = None, *, raw: Literal[True], returns: None = None, **kw: Unpack[CallOptions]
    ) -> Envelope: ...

    @overload
    async def request(
        self, agent: str, command: str, payload: Payload = None, *, raw: bool = False, returns: None = None, **kw: Unpack[CallOptions]
    ) -> Any: ...

    async def request(
        self,
        agent: str,
        command: str,
        payload: Payload = None,
        *,
        raw: bool = False,
        returns: type[Any] | None = None,
        **kw: Unpack[CallOptions],
    ) -> Any:
        """Asks ``agent`` to run ``command`` and returns the answer's value (as a ``returns``
        when given: a dataclass, a pydantic model or a plain type; the reply envelope itself
        with ``raw=True``). Raises :class:`ChorusError` with the reply's code, 5005 on
        timeout, 5012 when nobody serves the subject, :class:`CircuitOpen` (5019) while the
        agent's breaker is open. The keyword options are :class:`CallOptions`'s: ``timeout``,
        ``content_type``, ``headers``, ``encoding``, ``encrypt_for``; ``retry`` retries a
        failure the policy names, with the same message id each time (a receiver's
        exactly-once record answers a copy it already handled); ``dead_letter`` writes a
        request that failed for good to the dead-letter queue; ``delivery=EXACTLY_ONCE`` has
        the receiver run its handler once per message id; ``session`` and ``customer`` set the
        envelope's ``session_id`` and ``customer_id`` (a forward, ``parent=``, inherits its
        parent's); ``id`` fixes the message id; ``priority`` orders it in a receiver's backlog
        (section 7.9)."""
        subject = self.subjects.command(agent, command)
        env = self._envelope(_REQUEST, _ASK, kw.get("parent"))
        env.to = [agent]
        env.name = command
        return await self._call(subject, env, payload, raw, returns, kw, f"agent:{agent}", agent, None)

    @overload
    async def request_capability(
        self,
        capability: str,
        payload: Payload = None,
        *,
        at: str | None = None,
        routing: Routing | None = None,
        raw: Literal[False] = False,
        returns: type[R],
        **kw: Unpack[CallOptions],
    ) -> R: ...

    @overload
    async def request_capability(
        self,
        capability: str,
        payload: Payload = None,
        *,
        at: str | None = None,
        routing: Routing | None = None,
        raw: Literal[True],
        returns: None = None,
        **kw: Unpack[CallOptions],
    ) -> Envelope: ...

    @overload
    async def request_capability(
        self,
        capability: str,
        payload: Payload = None,
        *,
        at: str | None = None,
        routing: Routing | None = None,
        raw: bool = False,
        returns: None = None,
        **kw: Unpack[CallOptions],
    ) -> Any: ...

    async def request_capability(
        self,
        capability: str,
        payload: Payload = None,
        *,
        at: str | None = None,
        routing: Routing | None = None,
        raw: bool = False,
        returns: type[Any] | None = None,
        **kw: Unpack[CallOptions],
    ) -> Any:
        """Asks one agent serving ``capability`` (any of them, or the one named by ``at``);
        as :meth:`request` otherwise. ``routing`` (by default the agent's
        ``capability_routing``) picks the holder: the queue group, or the least-loaded live
        holder the registry knows."""
        env = self._envelope(_REQUEST, _ASK, kw.get("parent"))
        env.capability = capability
        if at is not None:
            env.to = [at]
            subject = self.subjects.capability_at(at, capability)
            return await self._call(subject, env, payload, raw, returns, kw, f"agent:{at}", at, None)
        routed = (routing or self.capability_routing) is Routing.LEAST_LOADED
        subject = self.subjects.capability(capability)
        return await self._call(
            subject, env, payload, raw, returns, kw, f"cap:{capability}", capability.replace(".", "-"), capability if routed else None
        )

    async def multicast(
        self,
        to: Sequence[str],
        command: str,
        payload: Payload = None,
        *,
        collect: Collect | None = None,
        **kw: Unpack[CallOptions],
    ) -> MulticastReport:
        """Asks every agent in ``to`` to run ``command`` and collects their replies as
        ``collect`` asks (``Collect.all()`` by default, ``Collect.first(n)``,
        ``Collect.quorum(n)``) within ``timeout`` (one deadline for all; the agent's
        ``request_timeout`` by default). Each recipient gets a request of its own, sent at
        once: its own message id, ``to`` naming it alone, and one ``correlation_id`` shared by
        every copy (the report's ``multicast_id``; a forward, ``parent=``, keeps its
        parent's conversation). The other keyword options are :meth:`request`'s and apply to
        every copy.

        Returns a :class:`MulticastReport`: per recipient, in the order of ``to``, replied
        (the reply), refused (its code and reason), no responders, silent (nothing by the
        deadline), not awaited (the collection ended first: its request is dropped, a late
        reply ignored) or failed (on this side), and whether enough replies came (``met``).
        Raises :class:`ChorusError` 5018 before anything is sent for no recipients, more than
        :data:`~chorus_sdk.multicast.MAX_MULTICAST_RECIPIENTS`, an invalid or repeated agent
        id, an invalid command name, an ``n`` of 0 or more than the recipients, or ``id=``;
        a recipient's failure is in the report, not raised (as ``Agent::multicast`` in Rust)."""
        if not _CALL_OPTIONS.issuperset(kw):
            raise TypeError(f"unknown request options {sorted(set(kw) - _CALL_OPTIONS)}; the known ones: {sorted(_CALL_OPTIONS)}")
        collect = Collect.all() if collect is None else collect
        recipients = check_multicast(to, command, collect, kw.get("id"))
        parent = kw.get("parent")
        multicast_id = parent.conversation if parent is not None else uuid7()
        # Encoded once, for every copy (and its failure raised before anything is sent).
        probe = Envelope.new(Kind.REQUEST, Performative.REQUEST, self.id)
        self.set_payload(probe, payload, kw.get("content_type"))
        encoded = Reply(probe.payload, probe.content_type)
        timeout = kw.get("timeout")
        wait = self.request_timeout if timeout is None else timeout

        async def send(agent: str) -> Envelope:
            env = self._envelope(Kind.REQUEST, Performative.REQUEST, parent)
            if parent is None:
                env.correlation_id = multicast_id
            env.to = [agent]
            env.name = command
            subject = self.subjects.command(agent, command)
            reply: Envelope = await self._call(subject, env, encoded, True, None, kw, f"agent:{agent}", agent, None)
            return reply

        return await collect_replies(recipients, send, collect, wait, multicast_id)

    async def _call(
        self,
        subject: str,
        env: Envelope,
        payload: Payload,
        raw: bool,
        returns: type[Any] | None,
        kw: CallOptions,
        destination: str,
        dead_letter_agent: str,
        routed_capability: str | None,
    ) -> Any:
        """A request's envelope completed by its options, sent (retried, dead-lettered,
        through its breaker and routing as they ask) and its answer read."""
        if kw:
            if not _CALL_OPTIONS.issuperset(kw):
                raise TypeError(f"unknown request options {sorted(set(kw) - _CALL_OPTIONS)}; the known ones: {sorted(_CALL_OPTIONS)}")
            timeout = kw.get("timeout")
            retry, dead_letter = kw.get("retry"), kw.get("dead_letter", False)
            env.delivery = kw.get("delivery") or _AT_MOST_ONCE
            if (id := kw.get("id")) is not None:
                env.id = id
            if (priority := kw.get("priority")) is not None:
                env.priority = priority
            _set_context(env, kw.get("session"), kw.get("customer"))
            headers, content_type, encoding, encrypt_for = kw.get("headers"), kw.get("content_type"), kw.get("encoding"), kw.get("encrypt_for")
        else:
            # No options: every one its default, without a dozen lookups (a call each time).
            timeout = retry = headers = content_type = encoding = encrypt_for = None
            dead_letter = False
            env.delivery = _AT_MOST_ONCE
        wait = self.request_timeout if timeout is None else timeout
        wait_ms = max(1, int(wait * 1000))
        if env.deadline_ms is not None:
            wait_ms = min(wait_ms, max(1, env.deadline_ms - env.timestamp_ms))
        env.ttl_ms = wait_ms
        env.expect = Expect(_INFORM, wait_ms)
        if headers is not None:
            # (Without headers the new envelope's own empty map stands: check_headers(None)
            # would make another.)
            env.headers = check_headers(headers)
        self.set_payload(env, payload, content_type)
        if encrypt_for:
            await self._encrypt(env, encrypt_for)
        if retry is None and not dead_letter and routed_capability is None and self._breakers.policy is None:
            # No retries, dead letter, routing or breaker: nothing between the call and its
            # exchange, no frames (nor an _Attempts) added to the hot path.
            reply = await self.exchange(subject, env, wait_ms / 1000, encoding)
        else:
            options = _Attempts(destination, dead_letter_agent, routed_capability, retry, dead_letter)
            reply = await self._attempts(subject, env, wait_ms / 1000, encoding, options)
        if raw:
            return reply
        value = reply_value(reply)
        if returns is None:
            return value
        try:
            return typed(value, returns)
        except DecodeError as e:
            raise ChorusError(StatusCode.DATA_FORMAT, e.reason) from e

    async def _attempts(self, subject: str, env: Envelope, wait: float, encoding: Encoding | None, options: _Attempts) -> Envelope:
        """A call's attempts: retried by its policy with the same id, dead-lettered when asked
        once it fails for good."""
        if options.retry is None and not options.dead_letter:
            return await self._attempt(subject, env, wait, encoding, options)
        first_ms = env.timestamp_ms
        attempt = 1
        while True:
            try:
                return await self._attempt(subject, env, wait, encoding, options)
            except ChorusError as err:
                policy = options.retry
                if not isinstance(err, CircuitOpen) and policy is not None and policy.should_retry(err.status, attempt):
                    pause = policy.delay(attempt)
                    self.stats.retries += 1
                    log.debug("agent %s: request %s failed (%s): retrying with the same id in %.3f s", self.id, env.id, err.status, pause)
                    await asyncio.sleep(pause)
                    attempt += 1
                    # The same id, sent anew: a fresh timestamp (its time to live counts from
                    # here) and so a fresh signature.
                    env.timestamp_ms = now_ms()
                    env.signature = None
                    continue
                if options.dead_letter:
                    exhausted = policy is not None and err.status in policy.retry_on
                    await self._dead_letter_request(subject, env, options, attempt, first_ms, exhausted, err)
                raise

    async def _dead_letter_request(
        self, subject: str, env: Envelope, options: _Attempts, attempts: int, first_ms: int, exhausted: bool, err: ChorusError
    ) -> None:
        """Writes a request that failed for good to the dead-letter queue (a failure to write
        it is logged: the caller gets the request's own error either way)."""
        try:
            letter = DeadLetter(
                reason="max_attempts" if exhausted else "refused",
                status=err.status,
                detail=str(err),
                agent=options.dead_letter_agent,
                subject=subject,
                envelope=self.encode_for(subject, env),
                attempts=attempts,
                stored_ms=first_ms,
                message_id=env.id,
            )
            await write_dead_letter(self.nc, self.subjects, letter, self.request_timeout)
        except Exception as e:  # noqa: BLE001 - reported, never raised over the request's error
            log.warning("agent %s: a failed request %s could not be dead-lettered: %s", self.id, env.id, e)
            return
        self.stats.dead_lettered += 1

    async def _attempt(self, subject: str, env: Envelope, wait: float, encoding: Encoding | None, options: _Attempts) -> Envelope:
        """One attempt at a call: through its destination's circuit breaker, routed by load
        if asked."""
        breakers = self._breakers
        destination = options.destination
        ticket = breakers.admit(destination)
        try:
            reply = await self._routed(subject, env, wait, encoding, options)
        except ChorusError as e:
            if ticket:
                breakers.finish(destination, e.status)
            raise
        except BaseException:
            if ticket:
                breakers.abandon(destination)
            raise
        if ticket:
            breakers.finish(destination, reply.status if reply.status is not None else StatusCode.OK)
        return reply

    async def _routed(self, subject: str, env: Envelope, wait: float, encoding: Encoding | None, options: _Attempts) -> Envelope:
        """The exchange: to the least-loaded holder when routing by load and one is known,
        else to ``subject``."""
        capability = options.routed_capability
        if capability is not None:
            chosen = await self._route(capability, wait)
            if chosen is not None:
                env.to = [chosen]
                env.signature = None
                try:
                    return await self.exchange(self.subjects.capability_at(chosen, capability), env, wait, encoding)
                except NoResponders:
                    # The holder has gone since discovery said otherwise: the queue group serves.
                    log.debug("agent %s: %s's chosen holder %s has gone: the queue group serves", self.id, capability, chosen)
                    self._router.forget(capability)
                finally:
                    self._router.done(chosen)
                env.to = []
                env.signature = None
        return await self.exchange(subject, env, wait, encoding)

    async def _route(self, capability: str, wait: float) -> str | None:
        """The holder of ``capability`` to call, by load, counted in flight; ``None``: the
        queue group."""
        if not self._router.cached(capability):
            try:
                records = await self.discover(capability=capability, timeout=min(wait, LOOKUP_TIMEOUT))
            except ChorusError as e:
                log.debug("agent %s: no registry to route %s by (%s): the queue group serves", self.id, capability, e)
                records = []
            self._router.learn(capability, records)
        return self._router.choose(capability)

    def circuit(self, destination: str) -> CircuitState:
        """How the breaker of ``destination`` (``agent:<id>`` or ``cap:<capability>``) stands."""
        return self._breakers.state(destination)

    async def exchange(self, subject: str, env: Envelope, wait: float, encoding: Encoding | None = None) -> Envelope:
        """Sends ``env`` as a request on ``subject`` and returns the reply envelope within
        ``wait`` seconds; raises :class:`ChorusError` with the reply's failure code, 5012 when
        nobody serves the subject, 5005 on timeout, 5006 for a reply that does not decode.
        A large payload goes compressed or by reference, and comes back opened (section 7.11)."""
        if not self._payloads.fits_inline(len(env.payload)):
            await self._payloads.fit(env)
        data = self.encode_for(subject, env, encoding)
        # Timed from send to reply, by the reply's status (chorus_agent_request_duration_seconds);
        # a call cancelled half way is not.
        self.stats.requests_sent += 1
        started = time.perf_counter()
        status = _OK
        try:
            # Written here rather than in a coroutine of its own: one call less per request.
            try:
                msg = await self._replies.request(self.nc, subject, data, wait)
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
            if reply.status is not None and reply.status not in SUCCESS:
                raise Refused(reply.status, reply.reason or "")
            if reply.content_encoding is not None or reply.content_type == CONTENT_TYPE_OBJECT:
                await self._payloads.open_reply(reply)
            return reply
        except ChorusError as e:
            status = e.status
            raise
        except Exception:
            status = int(StatusCode.UNEXPECTED_DISCONNECT)
            raise
        except BaseException:
            status = 0
            raise
        finally:
            if status:
                self._metrics.request(status, time.perf_counter() - started)

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
        session: str | None = None,
        customer: str | None = None,
    ) -> int:
        """Sends a command in a delivery class: ``AT_MOST_ONCE`` publishes it to the agent's
        command subject; ``AT_LEAST_ONCE`` and ``EXACTLY_ONCE`` store it in the agent's
        durable inbox (section 7.5) and return its stream sequence once the stream has it
        (``session`` and ``customer`` as :meth:`request` sets them)."""
        delivery = delivery or self.default_delivery
        env = self._envelope(Kind.COMMAND, Performative.REQUEST, parent)
        _set_context(env, session, customer)
        env.to = [agent]
        env.name = command
        env.priority = priority
        env.delivery = delivery
        env.headers = check_headers(headers)
        if ttl is not None:
            env.ttl_ms = max(1, int(ttl * 1000))
        self.set_payload(env, payload, content_type)
        if encrypt_for:
            await self._encrypt(env, encrypt_for)
        if not self._payloads.fits_inline(len(env.payload)):
            await self._payloads.fit(env)
        self.stats.requests_sent += 1
        if delivery is Delivery.AT_MOST_ONCE:
            await self._publish_envelope(self.subjects.command(agent, command), env)
            return 0
        high = priority in (Priority.HIGH, Priority.CRITICAL)
        return await self._store(self.subjects.durable_inbox(agent, high, command), env)

    async def _store(self, subject: str, env: Envelope) -> int:
        """Stores ``env`` (a durable class) in an agent's inbox on ``subject`` (section 7.5);
        its stream sequence once the stream has it."""
        delivery = env.delivery
        data = self.encode_for(subject, env)
        limit = (self.max_message_bytes or self.nc.max_payload) - 4096
        if len(data) > limit:
            raise ChorusError(
                StatusCode.DATA_FORMAT,
                f"durable message of {len(data)} bytes exceeds the limit of max_payload - 4096 = {limit} bytes",
            )
        # Trace context travels in the envelope only (PROTOCOL.md section 3.4): the one header
        # is the server's dedupe id, on exactly-once publishes.
        nats_headers = {"Nats-Msg-Id": str(env.id)} if delivery is Delivery.EXACTLY_ONCE else None
        js = self.nc.jetstream(timeout=self.request_timeout)
        try:
            ack = await js.publish(subject, data, headers=nats_headers)
        except nats.errors.TimeoutError as err:
            raise Timeout(f"the inbox stream did not acknowledge {subject}") from err
        except nats.js.errors.NoStreamResponseError as err:
            raise ChorusError(
                StatusCode.UNAVAILABLE,
                f"no stream stores {subject}: start the coordinator (chorus serve) or a durable agent first",
            ) from err
        return int(ack.seq)

    async def notify(
        self,
        to: str | NotifyTarget,
        name: str,
        payload: Payload = None,
        *,
        priority: Priority = Priority.NORMAL,
        headers: dict[str, str] | None = None,
        session: str | None = None,
        customer: str | None = None,
        durable: bool = False,
        ttl: float | None = None,
        content_type: str | None = None,
        timeout: float | None = None,
        parent: Envelope | None = None,
    ) -> NotifyReport:
        """Sends notification ``name`` (section 7.14): a push that expects no reply and needs
        no topic subscription on the receiver's side, taken by its :meth:`notification`
        handlers (``Agent::notify`` in Rust).

        ``to`` an agent id: published on its notification subject (``durable=True``: stored in
        its durable inbox), without waiting for the receiver; the report has its one line,
        ``delivered`` (published, whether or not anyone listened) or ``stored``. ``to`` a
        :class:`NotifyTarget` (a group, a capability's holders, or all): sent to the
        coordinator, which pushes one copy to each live member (stored in each inbox when
        durable) and reports per recipient (``delivered``, ``stored`` or ``failed``); it waits
        ``timeout`` seconds for that report (the agent's ``request_timeout`` by default).
        ``ttl`` bounds how long a durable one may wait for its recipient (then it is
        dead-lettered as expired).

        Raises :class:`~chorus_sdk.SubjectError` for a bad agent id, group, capability or
        name; :class:`ChorusError` (5018) for headers past their limits; for a group,
        :class:`~chorus_sdk.Timeout` or :class:`~chorus_sdk.NoResponders` when no coordinator
        reports. A group member's failure is in the report, not an error."""
        validate_token("notification name", name)
        env = self._envelope(Kind.NOTIFICATION, Performative.INFORM, parent)
        _set_context(env, session, customer)
        env.name = name
        env.priority = priority
        env.delivery = Delivery.AT_LEAST_ONCE if durable else Delivery.AT_MOST_ONCE
        env.headers = check_headers(headers)
        self.set_payload(env, payload, content_type)
        if isinstance(to, NotifyTarget):
            if ttl is not None:
                # The copies expire together, at one moment.
                at = now_ms() + max(1, int(ttl * 1000))
                env.deadline_ms = at if env.deadline_ms is None else min(env.deadline_ms, at)
            wait = self.request_timeout if timeout is None else timeout
            env.ttl_ms = max(1, int(wait * 1000))
            env.expect = Expect(Performative.INFORM, env.ttl_ms)
            subject = self.subjects.broadcast(
                group=to.name if to.kind == "group" else None,
                capability=to.name if to.kind == "capability" else None,
            )
            return NotifyReport.from_broadcast(reply_value(await self.exchange(subject, env, wait)))
        validate_token("agent id", to)
        env.to = [to]
        if ttl is not None:
            env.ttl_ms = max(1, int(ttl * 1000))
        if not self._payloads.fits_inline(len(env.payload)):
            await self._payloads.fit(env)
        if durable:
            high = priority in (Priority.HIGH, Priority.CRITICAL)
            await self._store(self.subjects.durable_notification(to, high), env)
            outcome = STORED
        else:
            await self._publish_envelope(self.subjects.notification(to), env)
            outcome = DELIVERED
        self.stats.notifications_sent += 1
        return NotifyReport(env.id, [NotifyRecipient(to, outcome)])

    async def discover(
        self,
        capability: str | None = None,
        group: str | None = None,
        available_only: bool = False,
        max_load: float | None = None,
        timeout: float | None = None,
        *,
        capabilities: Sequence[str] | None = None,
        max_tokens: int | None = None,
        priority: Priority | str | None = None,
        customer: str | None = None,
    ) -> list[dict[str, Any]]:
        """The live agents that match, least loaded first: ``[{"manifest": {...},
        "last_seen_ms": ..., "eta_ms": ...}]`` (section 7.7; answered by the coordinator, with
        an ``offer``).

        ``capabilities`` names more capabilities an agent must all offer (besides
        ``capability``); ``max_tokens`` keeps the agents whose named capabilities (any one of
        theirs when none is named) take requests of that many tokens (a capability that
        states no ``max_tokens`` takes any); ``priority`` is the priority the work would be
        sent at: each record's ``eta_ms`` (how long until that work sent now would be done,
        absent while the agent has handled nothing) is then at that priority, and the
        records come soonest first, unknown last. ``customer`` keeps the agents that serve that
        customer: those dedicated to it (a manifest's ``customer``) and those dedicated to
        none, not another customer's (Agentify's ``discover`` with a ``customer_id``).

        Raises :class:`~chorus_sdk.SubjectError` for a bad capability, group or customer name,
        :class:`TypeError` for ``capabilities`` given as one string, :class:`ValueError` for
        a ``max_tokens`` that is not a whole number of 0 or more or an unknown ``priority``."""
        query: dict[str, Any] = {}
        if capability is not None:
            query["capability"] = validate_dotted("capability", capability)
        if capabilities is not None:
            if isinstance(capabilities, str):
                raise TypeError("capabilities is a list of capability names, not one string (use capability=)")
            named = [validate_dotted("capability", c) for c in capabilities]
            if named:
                query["capabilities"] = named
        if group is not None:
            query["group"] = validate_token("group", group)
        if available_only:
            query["available_only"] = True
        if max_load is not None:
            query["max_load"] = max_load
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 <= max_tokens <= U64_MAX:
                raise ValueError(f"max_tokens {max_tokens!r}: a token count is a whole number, 0 or more")
            query["max_tokens"] = max_tokens
        if priority is not None:
            known = Priority.read(priority.value if isinstance(priority, Priority) else str(priority))
            if known is Priority.UNKNOWN:
                raise ValueError(f"priority {priority!r}: one of critical, high, normal or low")
            query["priority"] = known.value
        if customer is not None:
            query["customer"] = validate_token("customer", customer)
        env = self._envelope(Kind.REQUEST, Performative.DISCOVER, None)
        wait = self.request_timeout if timeout is None else timeout
        env.ttl_ms = int(wait * 1000)
        env.expect = Expect(Performative.OFFER, env.ttl_ms)
        self.set_payload(env, query, CONTENT_TYPE_MSGPACK)
        found = reply_value(await self.exchange(self.subjects.discover, env, wait))
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
        report = reply_value(await self.exchange(subject, env, timeout + 5.0))
        return dict(report or {})

    async def ledger(self) -> Ledger:
        """The bus's credits ledger (docs/PROTOCOL.md section 7.15): the negotiations settled
        at a price, by round, read by :meth:`~chorus_sdk.credits.Ledger.entries` and summed by
        :func:`~chorus_sdk.credits.balances`."""
        if self._ledger is None:
            js = self.nc.jetstream(timeout=self.request_timeout)
            self._ledger = await Ledger.open(js, self.subjects.bucket_name(CREDITS_BUCKET))
        return self._ledger


def _set_context(env: Envelope, session: str | None, customer: str | None) -> None:
    """The session and customer a message is sent for, over what it inherited."""
    if session is not None:
        env.session_id = session
    if customer is not None:
        env.customer_id = customer


class CallOptions(TypedDict, total=False):
    """The keyword options of :meth:`Outbound.request` and :meth:`Outbound.request_capability`."""

    #: Seconds to wait for the reply (the agent's ``request_timeout`` when not given).
    timeout: float | None
    #: The payload's content type (MessagePack unless it says JSON).
    content_type: str | None
    #: The message this one forwards: same conversation, one more hop, its deadline and trace.
    parent: Envelope | None
    #: Application headers.
    headers: dict[str, str] | None
    #: The form to write the envelope in (the agent's by default).
    encoding: Encoding | None
    #: Agents to seal the payload for.
    encrypt_for: list[str] | None
    #: Retried by this policy, with the same message id.
    retry: RetryPolicy | None
    #: ``EXACTLY_ONCE``: the receiver runs its handler once per message id.
    delivery: Delivery | None
    #: Written to the dead-letter queue when it fails for good.
    dead_letter: bool
    #: The message id (a fresh UUIDv7 when not given).
    id: uuid.UUID | None
    #: The envelope's ``session_id`` and ``customer_id``.
    session: str | None
    customer: str | None
    #: Its priority (``NORMAL`` when not given): a receiver with a backlog serves higher first.
    priority: Priority | None


_CALL_OPTIONS = frozenset(CallOptions.__annotations__)


@dataclass(frozen=True)
class _Attempts:
    """How a request is attempted: its breaker's destination, the agent its dead letter is
    filed under, the capability to route by load (``None``: no routing), its retry policy and
    dead-lettering."""

    destination: str
    dead_letter_agent: str
    routed_capability: str | None
    retry: RetryPolicy | None
    dead_letter: bool



