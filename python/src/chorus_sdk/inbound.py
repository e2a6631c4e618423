"""What an agent receives: its subscriptions, one reader per message with a bounded queue,
the inbound pipeline (admission, signature, decryption, the handler, exactly-once), and the
reply each outcome becomes."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from nats.aio.msg import Msg

from .codec import DecodeError, Encoding, decode, decode_payload, encode_payload, sniff
from .context import Context, Reply
from .envelope import CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, CONTENT_TYPE_OBJECT, Delivery, Envelope, Kind, Performative, Priority, Seq, now_ms
from .service import EndpointStats
from .status import ChorusError, StatusCode, is_success, reply_performative
from .negotiate import bid_subject
from .replay import ReplayProof
from .subjects import NOTIFY_TOKEN
from .usage import UsageKind

from ._connection import CONNECTION_GONE, describe
from ._dispatch import subscribe
from ._state import COORDINATOR_ID, MAX_SEQ_SUBJECTS, WIRE_NOTIFICATION, log
from .outbound import Outbound


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


class Inbound(Outbound):
    """The receiving layer of an agent."""

    # -----------------------------------------------------------------------------------------
    # Receiving

    async def _subscribe_capability(self, capability: str) -> None:
        nc = self.nc
        shared = self.subjects.capability(capability)
        self._subs.append(await subscribe(nc, shared, self._inbound("capability", capability), queue=shared))
        own = self.subjects.capability_at(self.id, capability)
        self._subs.append(await subscribe(nc, own, self._inbound("capability", capability)))

    async def _subscribe_bid(self, capability: str) -> None:
        """``<root>.agent.<id>.bid.<capability>``: calls for proposals and round outcomes
        (contract-net), once per capability."""
        if capability in self._bidding.subscribed:
            return
        self._bidding.subscribed.add(capability)
        subject = bid_subject(self.subjects, self.id, capability)
        self._subs.append(await subscribe(self.nc, subject, self._inbound("bid", capability)))

    async def _subscribe_event(self, pattern: str) -> None:
        gaps = _Gaps()
        self._subs.append(await subscribe(self.nc, self.subjects.event_pattern(pattern), self._inbound("event", pattern, gaps)))

    def _inbound(self, route: str, name: str = "", gaps: _Gaps | None = None) -> Callable[[Msg], None]:
        """What takes each message of a subscription as it is read (:mod:`._dispatch`): it
        decodes it and starts its own task, or answers or drops it when the queue is full."""

        def on_message(msg: Msg) -> None:
            if self._stopping:
                return
            # Decoded once, here: an event's numbering is checked as it arrives, before anything
            # is queued, and the handler gets the same envelope (bytes that do not decode get
            # their DecodeError, answered in the pipeline).
            decoded: tuple[Envelope, Encoding] | DecodeError
            try:
                decoded = decode(msg.data, self.subjects.implied(msg.subject), self.max_message_bytes)
            except DecodeError as e:
                decoded = e
            if gaps is not None and not isinstance(decoded, DecodeError):
                self.stats.lost += gaps.observe(decoded[0].from_, msg.subject, decoded[0].seq)
            if self._waiting >= self.queue_capacity:
                self._overflow(msg, route)
                return
            self._waiting += 1
            # A task of its own (a slow handler holds up no other message), started eagerly
            # where Python can (3.12): a handler that waits for nothing then costs no turn of
            # the event loop.
            self.spawn(self._run(msg, route, name, decoded), name="chorus-handler", eager=True)

        return on_message

    def _overflow(self, msg: Msg, route: str) -> None:
        # A notification is dropped like an event, never answered.
        if route == "event" or not msg.reply or self.subjects.is_notification(msg.subject):
            self.stats.dropped += 1
            self.stats.lost += 1
            return
        self.stats.shed += 1
        refusal = ChorusError(StatusCode.UNAVAILABLE, "overloaded: the agent's queue is full")
        self.spawn(self._answer(msg, None, _encoding_of(msg.data, self.encoding), refusal), name="chorus-shed", eager=True)

    async def _run(self, msg: Msg, route: str, name: str, decoded: tuple[Envelope, Encoding] | DecodeError) -> None:
        try:
            if not self._started.is_set():
                # Came while the agent starts: handled once connect() returns.
                await self._started.wait()
            # With a backlog, the next free slot goes to the most urgent message waiting
            # (section 7.9, "Priority"); bytes that did not decode wait as normal.
            slots = self._slots
            if not slots.try_acquire():
                await slots.acquire(Priority.NORMAL if isinstance(decoded, DecodeError) else decoded[0].priority)
            try:
                self._waiting -= 1
                self._busy += 1
                try:
                    await self._process(msg, route, name, decoded)
                finally:
                    self._busy -= 1
            finally:
                slots.release()
        except asyncio.CancelledError:
            raise
        except CONNECTION_GONE as e:
            log.warning("agent %s: message on %s not answered: the connection is gone (%s)", self.id, msg.subject, describe(e))
        except Exception:  # noqa: BLE001 - a handler's crash must not end the agent
            log.exception("agent %s: message on %s not handled", self.id, msg.subject)

    async def _process(self, msg: Msg, route: str, name: str, decoded: tuple[Envelope, Encoding] | DecodeError) -> None:
        # A notification is never answered, whatever it carries (section 7.14).
        notification = route == "command" and self.subjects.is_notification(msg.subject)
        if isinstance(decoded, DecodeError):
            self.stats.received += 1
            self.stats.refused += 1
            self.stats.bad_input += 1
            self._metrics.message("unknown", StatusCode.DATA_FORMAT)
            if not notification:
                encoding = _encoding_of(msg.data, self.encoding)
                await self._answer(msg, None, encoding, ChorusError(StatusCode.DATA_FORMAT, decoded.reason))
            return
        env, encoding = decoded
        outcome = await self.handle(env, msg.subject, route, name)
        if route == "event" or notification:
            if isinstance(outcome, ChorusError) and outcome.status != StatusCode.UNKNOWN_COMMAND:
                log.warning("agent %s: %s handler failed on %s: %s", self.id, route if route == "event" else "notification", msg.subject, outcome)
            return
        await self._answer(msg, env, encoding, outcome)

    async def handle(
        self,
        env: Envelope,
        subject: str,
        route: str,
        name: str,
        attempt: int = 1,
        stored: int | None = None,
        replay: ReplayProof | str | None = None,
    ) -> Any:
        """The inbound pipeline after decoding (:meth:`_handle`), counted as the Rust SDK
        counts it: received, and by kind and the status it is answered with, and in the
        agent's usage (a copy that exactly-once does not run again only as received).
        ``stored`` is the stream sequence of the stored copy a durable delivery came from: the
        same copy delivered again is not a replay. ``replay`` is a replayer's signed word that
        this is its replay of a dead letter (:mod:`chorus_sdk.replay`), read from its headers."""
        stats = self.stats
        stats.received += 1
        duplicates = stats.duplicates
        # Timed only when usage is counted: two clock reads per message otherwise saved.
        started = time.perf_counter_ns() if self._usage.enabled else 0
        outcome = await self._handle(env, subject, route, name, attempt, stored, replay)
        if env.delivery is not _EXACTLY_ONCE or stats.duplicates == duplicates:
            self._metrics.message(_KIND_LABELS[env.kind], outcome.status if isinstance(outcome, ChorusError) else _OK)
            if self._usage.enabled:
                outcome = self._count_usage(env, subject, route, name, outcome, started)
        return outcome

    def _count_usage(self, env: Envelope, subject: str, route: str, name: str, outcome: Any, started: int) -> Any:
        """Counts one message that came for an endpoint or an event handler in the agent's
        usage (section 7.13): at its command, capability or (an event) topic, as a task when
        its endpoint runs tasks, with the time from ``started`` (``perf_counter_ns``, the start
        of its pipeline) to its outcome; an event without a topic is the bus's own traffic, not
        counted. Returns the outcome, a handler's value as the :class:`Reply` it is answered
        with (encoded once, here, to count its size)."""
        task = False
        if route == "event":
            if not env.topic or name not in self._events:
                return outcome
            endpoint = env.topic
        elif route == "command":
            endpoint = self.subjects.command_of(subject)
            if endpoint not in self._commands:
                return outcome
            task = bool(self._endpoints.get(("command", endpoint), _NOT_SAID).get("task"))
        elif route == "capability":
            if name not in self._capabilities:
                return outcome
            endpoint = name
            task = bool(self._endpoints.get(("capability", name), _NOT_SAID).get("task"))
        elif route == "bid":
            if name not in self._bidding.bids:
                return outcome
            endpoint = f"bid.{name}"
        else:
            return outcome
        kind = UsageKind.TASK if task else _USAGE_KINDS.get(env.kind)
        if kind is None:
            return outcome
        failed = isinstance(outcome, ChorusError)
        bytes_out = 0
        if not failed and route != "event":
            try:
                payload, content_type = self.reply_payload(env, outcome)
            except DecodeError:
                # A value that cannot be answered with: no reply goes out.
                failed = True
            else:
                outcome = Reply(payload, content_type)
                bytes_out = len(payload)
        self._usage.record(env, endpoint, kind, failed, bytes_out, (time.perf_counter_ns() - started) // 1000)
        return outcome

    async def _handle(
        self,
        env: Envelope,
        subject: str,
        route: str,
        name: str,
        attempt: int = 1,
        stored: int | None = None,
        replay: ReplayProof | str | None = None,
    ) -> Any:
        """The inbound pipeline after decoding: admission, signature, the access rules, the
        payload opened (fetched, decrypted, decompressed), the handler. Returns the
        handler's value, or the :class:`ChorusError` to answer with."""
        admitted = self._admit(env, subject, stored, replay)
        if isinstance(admitted, ChorusError):
            self.stats.refused += 1
            return admitted
        # The endpoint's name, worked out once: the handler, the access rules and the
        # endpoint's counts all go by it.
        endpoint = name
        if route == "command":
            endpoint = self.subjects.command_of(subject)
            if endpoint == NOTIFY_TOKEN:
                return await self._notification(env, subject, attempt)
            handler = self._commands.get(endpoint)
        elif route == "capability":
            handler = self._capabilities.get(name)
        elif route == "bid":
            endpoint = f"bid.{name}"
            handler = self._bidding.endpoint(name)
        else:
            handler = self._events.get(name)
        if handler is None:
            self.stats.refused += 1
            self.stats.unknown_command += 1
            return ChorusError(StatusCode.UNKNOWN_COMMAND, f"no handler for {subject}")
        # Without access rules there is nothing to work out (nor a coroutine to make for it).
        if route != "event" and self._has_access_rules():
            denied = await self._authorize(env, endpoint, stored, admitted)
            if denied is not None:
                self.stats.refused += 1
                if denied.status == StatusCode.RATE_LIMITED:
                    self.stats.rate_limited += 1
                elif denied.status == StatusCode.ACCESS:
                    self.stats.access_refused += 1
                else:
                    # A verified id seen before (5015): the signature check's, as in Rust.
                    self.stats.security_refused += 1
                return denied
        if env.content_type == CONTENT_TYPE_OBJECT or env.encryption is not None or env.content_encoding is not None:
            unopened = await self._open(env)
            if unopened is not None:
                self.stats.refused += 1
                return unopened
        ctx = Context(self, env, subject, attempt)
        if route == "event":
            return await self._invoke(handler, ctx)
        started = time.perf_counter_ns()
        # Its handling time (the manifest's handling_ms): a task's handler only accepts it,
        # its runs are timed where they end.
        timed = not self._endpoints.get((route, endpoint), _NOT_SAID).get("task")
        if env.delivery is _EXACTLY_ONCE:
            run = self._timed(handler, ctx, route, endpoint) if timed else (lambda: self._invoke(handler, ctx))
            outcome = await self._exactly_once.run(env, run)
            ended = time.perf_counter_ns()
        else:
            # Run here rather than through _timed's closure (the same clock reads serve both
            # the handling time and the endpoint's).
            outcome = await self._invoke(handler, ctx)
            ended = time.perf_counter_ns()
            if timed:
                self._handling.record(route, endpoint, ended - started)
        stats = self._endpoint_stats.get(endpoint)
        if stats is None:
            stats = self._endpoint_stats[endpoint] = EndpointStats()
        stats.record(ended - started, f"{outcome.status} {outcome.reason}" if isinstance(outcome, ChorusError) else None)
        return outcome

    async def _notification(self, env: Envelope, subject: str, attempt: int) -> Any:
        """A notification that passed admission (section 7.14): run by the handler of its
        name, else the one registered as ``"*"``. Returns ``None`` when handled, or the
        :class:`ChorusError` it failed with (retried and dead-lettered by the retry policy when
        it is durable). One that no handler takes is counted; a core one is dropped, a durable
        one refused with 5016, to wait while the policy's attempts last as a durable command
        without a handler does. Nothing is ever answered."""
        stats = self.stats
        stats.notifications_received += 1
        name = env.name or ""
        if name == WIRE_NOTIFICATION and env.from_ == COORDINATOR_ID:
            # The coordinator's word on the bus's level and heartbeat floor, for this agent
            # alone (section 3.5): taken here, never a handler's. Where the agent knows the
            # coordinator's key, an unsigned one is not its word (a signed one passed the
            # signature check already).
            if env.signature is None and self.verifier is not None and self.verifier.key_of(COORDINATOR_ID) is not None:
                stats.security_refused += 1
                log.warning("agent %s: an unsigned wire notification from the coordinator ignored", self.id)
                return None
            try:
                self._take_wire(decode_payload(env.payload, env.content_type))
            except DecodeError as e:
                log.debug("agent %s: the coordinator's wire notification did not decode: %s", self.id, e.reason)
            return None
        handler = self._notifications.get(name) or self._notifications.get("*")
        if handler is None:
            stats.notifications_unhandled += 1
            log.debug("agent %s: notification %r from %s has no handler", self.id, name, env.from_)
            if self.subjects.durable_command(subject) is not None:
                return ChorusError(StatusCode.UNKNOWN_COMMAND, f"agent {self.id} has no handler for notification {name!r}")
            return None
        if env.content_type == CONTENT_TYPE_OBJECT or env.encryption is not None or env.content_encoding is not None:
            unopened = await self._open(env)
            if unopened is not None:
                stats.refused += 1
                return unopened
        outcome = await self._invoke(handler, Context(self, env, subject, attempt))
        return outcome if isinstance(outcome, ChorusError) else None

    def _has_access_rules(self) -> bool:
        """Whether :meth:`_authorize` has anything to apply: required permissions, a rate
        limit, or ids kept across restarts."""
        return self._seen_ids is not None or self.access.rate_limit is not None or bool(self._required)

    async def _authorize(
        self, env: Envelope, endpoint: str, stored: int | None = None, seen_id: uuid.UUID | None = None
    ) -> ChorusError | None:
        """The application's access rules for a command or request that passed admission
        (:meth:`_has_access_rules`): the permissions its endpoint requires (5007), the sender's
        rate (5013), and a verified id seen before a restart (5015, when ids are kept)."""
        access = self.access
        # Admitted with a signature by an agent that verifies: the signature proved the sender.
        verified = self.verifier is not None and env.signature is not None
        denied = access.check(env.from_, verified, endpoint, self._required.get(endpoint, ()))
        if denied is None and verified and self._seen_ids is not None:
            denied = await self._seen_ids.record(env, stored, seen_id)
        return denied

    def _timed(self, handler: Callable[[Context], Awaitable[Any]], ctx: Context, kind: str, endpoint: str) -> Callable[[], Awaitable[Any]]:
        """Runs ``handler`` as :meth:`_invoke` does, its time added to the handling time of
        ``endpoint`` (of ``kind``) and the agent's, whatever it returns (a copy exactly-once
        does not run again is not timed)."""

        async def run() -> Any:
            began = time.perf_counter_ns()
            outcome = await self._invoke(handler, ctx)
            self._handling.record(kind, endpoint, time.perf_counter_ns() - began)
            return outcome

        return run

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

    def _admit(
        self, env: Envelope, subject: str, stored: int | None = None, replay: ReplayProof | str | None = None
    ) -> ChorusError | uuid.UUID:
        """The refusal, or the id the message is remembered by against replays (its own, or
        for a replay of a dead letter, :func:`~chorus_sdk.replay.replay_id`)."""
        # Each refusal counted by its reason (chorus_agent_refusals_total), as in Rust.
        if env.kind is _UNKNOWN_KIND:
            self.stats.bad_input += 1
            return ChorusError(StatusCode.DATA_FORMAT, "unknown message kind")
        expires = env.expires_ms()
        if expires is not None and now_ms() > expires:
            self.stats.expired += 1
            return ChorusError(StatusCode.EXPIRED, "the message expired before it was handled")
        limit = min(env.hop_limit, self.hop_limit)
        if env.hops > limit:
            self.stats.loop_refused += 1
            return ChorusError(StatusCode.LOOP_DETECTED, f"hops {env.hops} exceed the hop limit {limit}")
        if self.verifier is not None:
            try:
                if replay is None:
                    self.verifier.verify(subject, env, stored=stored)
                elif isinstance(replay, str):
                    raise ChorusError(StatusCode.IDENTITY, replay)
                else:
                    seen_id = self.verifier.verify_replay(subject, env, replay, stored=stored)
                    log.info("agent %s: dead letter %s replayed by %s (message %s from %s)", self.id, replay.of, replay.by, env.id, env.from_)
                    return seen_id
            except ChorusError as e:
                self.stats.security_refused += 1
                log.warning("agent %s: message %s from %s refused by signature check: %s", self.id, env.id, env.from_, e)
                return e
        return env.id

    async def _open(self, env: Envelope) -> ChorusError | None:
        """Puts back the payload as it was sent, after the signature check (which covers the
        payload as sent: the reference, the ciphertext) and the access rules, as the Rust SDK
        does: fetched when it came by reference, decrypted, decompressed (section 7.11). The
        refusal to answer with when it does not open (5006, 5007; 5019 to retry when the
        object store is out of reach)."""
        try:
            if env.content_type == CONTENT_TYPE_OBJECT:
                await self._payloads.fetch(env)
            if env.encryption is not None:
                if self.encryption_key is None:
                    return ChorusError(StatusCode.ACCESS, "this agent has no decryption key")
                self.encryption_key.decrypt(self.id, env)
            if env.content_encoding is not None:
                await self._payloads.decompress(env)
        except ChorusError as e:
            log.debug("agent %s: payload of %s not opened: %s", self.id, env.id, e)
            return e
        return None

    def reply_envelope(self, request: Envelope | None, outcome: Any) -> Envelope:
        """The response to ``request`` for a handler's value or error (section 7.1): a success
        answers a ``discover`` with ``offer``, anything else with ``inform``."""
        if isinstance(outcome, ChorusError):
            status, reason = outcome.status, outcome.reason
        else:
            status, reason = _OK, None
        performative = _REPLY_PERFORMATIVES.get(status)
        if performative is None:
            performative = Performative.read(reply_performative(status))
            if len(_REPLY_PERFORMATIVES) < 1024:
                _REPLY_PERFORMATIVES[status] = performative
        if request is not None and request.performative is _DISCOVER and is_success(status):
            # Agentify: the answer to a discover is an offer.
            performative = Performative.OFFER
        env = Envelope.new(_RESPONSE, performative, self.id)
        env.status = status
        env.reason = reason or (None if status in (5001, 5002, 5021) else "")
        if request is not None:
            env.in_reply_to = request.id
            env.correlation_id = request.conversation
            env.to = [request.from_]
            env.name, env.capability = request.name, request.capability
            env.hops, env.hop_limit = request.hops, request.hop_limit
            env.trace = request.trace
            env.session_id, env.customer_id = request.session_id, request.customer_id
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
            # A large reply goes compressed (its reader is the requester) or by reference.
            if not self._payloads.fits_inline(len(env.payload)):
                await self._payloads.fit(env)
        except ChorusError as e:
            # Too large even by reference, or the object store refused it: tell the caller.
            env = self.reply_envelope(request, ChorusError(e.status, f"the reply could not be sent: {e.reason}"))
            if env.content_type == CONTENT_TYPE_OBJECT:
                env.content_type = encoding.content_type
        try:
            data = self.encode_for(msg.reply, env, encoding)
        except ChorusError as e:
            # Too large for the server: a refusal instead.
            env = self.reply_envelope(request, e)
            data = self.encode_for(msg.reply, env, encoding)
        try:
            await self.nc.publish(msg.reply, data)
        except Exception as e:  # noqa: BLE001 - the caller times out
            self.stats.reply_failures += 1
            log.debug("reply not sent: %s", e)
        else:
            self.stats.replies_sent += 1


_OK = int(StatusCode.OK)
# The members the pipeline reads for every message, looked up once: before Python 3.12 each
# read of an Enum's member off its class (``Kind.RESPONSE``), or of its ``value``, is a
# descriptor call.
_EXACTLY_ONCE = Delivery.EXACTLY_ONCE
_UNKNOWN_KIND = Kind.UNKNOWN
_RESPONSE = Kind.RESPONSE
_DISCOVER = Performative.DISCOVER
_KIND_LABELS = {kind: kind.value for kind in Kind}
# The performative of a reply by its status (section 7.1), as replies are made.
_REPLY_PERFORMATIVES: dict[int, Performative] = {}
# What the manifest says of an endpoint it has nothing for (read only).
_NOT_SAID: dict[str, Any] = {}
# The usage kind of each kind of message counted (section 7.13).
_USAGE_KINDS = {Kind.REQUEST: UsageKind.REQUEST, Kind.COMMAND: UsageKind.COMMAND, Kind.EVENT: UsageKind.EVENT}


def _encoding_of(data: bytes, default: Encoding) -> Encoding:
    """The encoding to answer a message in: its own, else this agent's (section 3.1)."""
    return sniff(data) or default

