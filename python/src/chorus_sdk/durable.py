"""An agent's durable inbox (docs/PROTOCOL.md sections 7.5, 7.8, 7.9): its two consumers
(normal and high priority), lanes that keep one sender's commands in order, and the one place a
delivery's outcome becomes an ack, a nak with the retry policy's delay, or a dead letter."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, RePublish, RetentionPolicy, StorageType, StreamConfig

from ._connection import CONNECTION_GONE, describe
from ._host import Host
from .codec import DecodeError, decode
from .dead_letters import DeadLetter, write_dead_letter
from .envelope import Envelope, Kind
from .exactly_once import RetryAfter
from .replay import ReplayProof
from .status import ChorusError, StatusCode


log = logging.getLogger("chorus_sdk")

INBOX_STREAM = "INBOX"
#: How long the server keeps an on-demand consumer no client pulls from (its agent went away).
ABANDONED_CONSUMER_AFTER = 3600.0
#: How soon a failed look for stored commands is tried again (JetStream out of reach).
LOOK_RETRY = 5.0
#: How long a consumer that could not be opened waits before the first try again (doubling).
REOPEN_DELAY = 1.0
#: Opens tried in a row before a lane gives up with an error (until the next bell or look).
MAX_OPEN_ATTEMPTS = 5
DLQ_STREAM = "DLQ"
ADVISORY_STREAM = "ADVISORIES"
CONFIG_BUCKET = "config"
RETRY_KEY = "retry"
DEAD_LETTER_RETRY_DELAY = 5.0
HIGH_PRIORITY_LANE_SHARE = 4
MAX_PULL_BATCH = 256
RECENT_DELIVERIES = 16_384

# The status codes the default policy retries.
DEFAULT_RETRY_ON = (5017, 5005, 5019, 5022, 5012, 5009, 5013)


@dataclass
class RetryPolicy:
    """How a failed durable message is retried (the coordinator's ``[retry]`` config)."""

    max_attempts: int = 5
    initial_backoff_ms: int = 500
    multiplier: float = 2.0
    max_backoff_ms: int = 30_000
    jitter: float = 0.2
    retry_on: tuple[int, ...] = DEFAULT_RETRY_ON

    def should_retry(self, status: int, delivered: int) -> bool:
        return delivered < self.max_attempts and status in self.retry_on

    def delay(self, delivered: int, rand: float | None = None) -> float:
        """Seconds to wait before delivery ``delivered + 1``."""
        base = min(self.initial_backoff_ms * self.multiplier ** max(delivered - 1, 0), self.max_backoff_ms)
        r = random.random() if rand is None else min(max(rand, 0.0), 1.0)
        return base * (1.0 - self.jitter * r) / 1000.0

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RetryPolicy:
        known = {"max_attempts", "initial_backoff_ms", "multiplier", "max_backoff_ms", "jitter", "retry_on"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown retry policy fields {sorted(unknown)}")
        policy = cls(**{k: v for k, v in raw.items() if k != "retry_on"})
        if "retry_on" in raw:
            policy.retry_on = tuple(int(c) for c in raw["retry_on"])
        if policy.max_attempts < 1 or policy.multiplier < 1 or not 0 <= policy.jitter <= 1:
            raise ValueError("invalid retry policy")
        return policy


@dataclass
class RetryRule:
    policy: RetryPolicy
    subject: str | None = None
    kind: str | None = None


@dataclass
class RetryPolicies:
    default: RetryPolicy = field(default_factory=RetryPolicy)
    rules: list[RetryRule] = field(default_factory=list)

    def for_message(self, subject: str, kind: Kind) -> RetryPolicy:
        for rule in self.rules:
            if (rule.kind is None or rule.kind == kind.value) and (
                rule.subject is None or subject_matches(rule.subject, subject)
            ):
                return rule.policy
        return self.default

    def max_attempts(self) -> int:
        return max([self.default.max_attempts] + [r.policy.max_attempts for r in self.rules])

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RetryPolicies:
        policies = cls()
        if "default" in raw:
            policies.default = RetryPolicy.from_json(raw["default"])
        for rule in raw.get("rules", []):
            policies.rules.append(
                RetryRule(RetryPolicy.from_json(rule["policy"]), rule.get("subject"), rule.get("kind"))
            )
        return policies


def subject_matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


@dataclass
class InboxOptions:
    """The durable inbox's settings (the Rust SDK's defaults)."""

    ack_wait: float = 5.0
    lanes: int = 16
    max_in_flight: int = 256
    max_age_secs: int = 7 * 24 * 3600
    max_bytes: int = 1 << 30
    duplicate_window_secs: int = 120
    #: Consumers the inbox stream takes: two per durable agent. Set because nats-server 2.15
    #: limits a stream that does not say to 1,000 (500 durable agents); the Rust default.
    max_consumers: int = 200_000
    replicas: int = 1
    #: Hold each lane's consumer only while commands wait (the Rust default): a stored
    #: command's bell opens it, and it is deleted after ``release_after`` seconds with nothing
    #: arriving and nothing pending. False: both consumers are held from the start.
    on_demand: bool = True
    release_after: float = 30.0
    #: Longest time between the agent's own looks for stored commands (a bell can be lost).
    recheck: float = 60.0


@dataclass
class _Settle:
    action: str  # "ack", "nak", "dead"
    delay: float = 0.0
    status: int = 0
    reason: str = ""
    detail: str = ""


def settle(policies: RetryPolicies, subject: str, delivered: int, kind: Kind, outcome: Any) -> _Settle:
    """What becomes of delivery number ``delivered`` (section 7.5)."""
    if not isinstance(outcome, ChorusError):
        return _Settle("ack")
    if isinstance(outcome, RetryAfter):
        return _Settle("nak", outcome.delay)
    policy = policies.for_message(subject, kind)
    status = outcome.status
    last = delivered >= policy.max_attempts
    if status == StatusCode.UNKNOWN_COMMAND and not last:
        # Another instance may know the command: wait for it, up to the attempts.
        return _Settle("nak", policy.delay(delivered))
    if policy.should_retry(status, delivered):
        return _Settle("nak", policy.delay(delivered))
    if status in policy.retry_on:
        reason = "max_attempts"
    elif status == StatusCode.EXPIRED:
        reason = "expired"
    elif status == StatusCode.UNCERTAIN:
        reason = "uncertain"
    else:
        reason = "refused"
    return _Settle("dead", status=status, reason=reason, detail=outcome.reason)


class DurableInbox:
    def __init__(self, agent: Host, options: InboxOptions) -> None:
        self.agent = agent
        self.options = options
        self.policies = RetryPolicies()
        self._started = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._stop = asyncio.Event()
        self._held: dict[int, Msg] = {}
        self._recent: dict[int, None] = {}
        self._bells: list[asyncio.Event] = []
        #: Asks the looker to look for stored commands now.
        self._look_soon = asyncio.Event()
        #: Each lane's bell subscription, held only while the lane has no consumer.
        self._bell_subs: list[Any] = [None, None]
        #: One start at a time: each late command registration asks for one.
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        """Starts taking this agent's deliveries, once (later calls, concurrent ones included,
        return when the first is done)."""
        async with self._starting:
            if not self._started:
                await self._start()

    async def _start(self) -> None:
        agent = self.agent
        js = agent.nc.jetstream(timeout=agent.request_timeout)
        subjects = agent.subjects
        inbox = subjects.stream_name(INBOX_STREAM)
        await self._ensure_stream(
            js,
            StreamConfig(
                name=inbox,
                subjects=[f"{subjects.root}.inbox.>"],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                max_age=float(self.options.max_age_secs),
                max_bytes=self.options.max_bytes,
                max_msgs_per_subject=-1,
                duplicate_window=float(self.options.duplicate_window_secs),
                num_replicas=self.options.replicas,
                max_consumers=self.options.max_consumers,
                # The bells Rust agents with on-demand consumers wait for (PROTOCOL.md 7.5).
                republish=RePublish(
                    src=subjects.bell_source(), dest=subjects.bell_destination(), headers_only=True
                ),
                description="Chorus durable inboxes: commands waiting for their agent",
            ),
        )
        await self._ensure_stream(
            js,
            StreamConfig(
                name=subjects.stream_name(DLQ_STREAM),
                subjects=[f"{subjects.root}.dlq.>"],
                storage=StorageType.FILE,
                max_age=30 * 24 * 3600.0,
                duplicate_window=24 * 3600.0,
                num_replicas=self.options.replicas,
                description="Chorus dead letters",
            ),
        )
        await self._load_policies(js)
        waiting = [False, False]
        if self.options.on_demand:
            self._bells = [asyncio.Event(), asyncio.Event()]
            # Bells heard before the look, so a command stored after it rings.
            for high in (False, True):
                await self._hear_bells(high)
            waiting = await self._look(js)
            self._tasks.append(asyncio.ensure_future(self._looker(js)))
        for high in (False, True):
            lanes = max(self.options.lanes // HIGH_PRIORITY_LANE_SHARE, 1) if high else self.options.lanes
            queues: list[asyncio.Queue[tuple[Msg, Envelope | DecodeError]]] = [asyncio.Queue() for _ in range(lanes)]
            for q in queues:
                self._tasks.append(asyncio.ensure_future(self._lane(q)))
            if self.options.on_demand:
                self._tasks.append(asyncio.ensure_future(self._on_demand(js, high, queues, waiting[high])))
            else:
                await js.add_consumer(inbox, self._consumer_config(high))
                sub = await js.pull_subscribe_bind(durable=self._durable_name(high), stream=inbox)
                self._tasks.append(asyncio.ensure_future(self._pull(sub, queues)))
        self._tasks.append(asyncio.ensure_future(self._keeper()))
        self._started = True

    def _durable_name(self, high: bool) -> str:
        return f"{self.agent.id}_high" if high else self.agent.id

    def _consumer_config(self, high: bool) -> ConsumerConfig:
        agent = self.agent
        return ConsumerConfig(
            durable_name=self._durable_name(high),
            description=f"durable inbox of agent {agent.id} ({'high' if high else 'normal'} priority)",
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.options.ack_wait,
            max_deliver=self.policies.max_attempts(),
            max_ack_pending=self.options.max_in_flight,
            filter_subjects=[agent.subjects.durable_inbox(agent.id, high)],
            inactive_threshold=ABANDONED_CONSUMER_AFTER if self.options.on_demand else None,
        )

    async def _hear_bells(self, high: bool) -> None:
        """Subscribes to the lane's bells, if it is not already. If that fails (the connection
        closing), the looker's looks still find what is stored."""
        if self._bell_subs[high] is not None:
            return
        bell = self._bells[high]

        async def ring(msg: Msg) -> None:
            bell.set()

        try:
            self._bell_subs[high] = await self.agent.nc.subscribe(
                self.agent.subjects.lane_bells(self.agent.id, high), cb=ring
            )
        except Exception as e:  # noqa: BLE001 - looks still find the commands
            log.warning("durable inbox: bells not heard; stored commands are found by looks: %s", e)

    async def _stop_hearing_bells(self, high: bool) -> None:
        """Unsubscribes from the lane's bells: its consumer delivers what is stored."""
        sub, self._bell_subs[high] = self._bell_subs[high], None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection closing
                pass

    async def _stored(self, js: Any, filter_subject: str) -> list[str]:
        """The subjects under ``filter_subject`` with commands stored: one request."""
        info = await js.stream_info(self.agent.subjects.stream_name(INBOX_STREAM), subjects_filter=filter_subject)
        return [subject for subject, count in (info.state.subjects or {}).items() if count]

    async def _look(self, js: Any) -> list[bool]:
        """Which lanes (normal, high) have commands stored for this agent."""
        waiting = [False, False]
        for subject in await self._stored(js, self.agent.subjects.durable_agent_all(self.agent.id)):
            waiting[subject.split(".")[-2] == "high"] = True
        return waiting

    async def _looker(self, js: Any) -> None:
        """Looks for stored commands every ``recheck`` (jittered), after a reconnect, when a lane
        asks, and every 5 s while looks fail, and rings the lanes where some wait: a lost bell
        is made up. The only place an on-demand inbox looks again after a failure."""
        self.agent.reconnect_hooks.append(self._look_soon.set)
        look_in = self.options.recheck
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._look_soon.wait(), timeout=look_in * (0.75 + 0.5 * random.random()))
            except asyncio.TimeoutError:
                pass
            self._look_soon.clear()
            try:
                for high, waits in enumerate(await self._look(js)):
                    if waits:
                        self._bells[high].set()
                look_in = self.options.recheck
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - JetStream out of reach: look again soon
                log.debug("durable inbox: stored commands not looked for: %s", e)
                look_in = min(self.options.recheck, LOOK_RETRY)

    async def _on_demand(
        self, js: Any, high: bool, queues: list[asyncio.Queue[tuple[Msg, Envelope | DecodeError]]], waiting: bool
    ) -> None:
        """One lane's consumer, opened when a bell rings or a look finds commands, deleted after
        ``release_after`` seconds with nothing arriving and nothing pending (section 7.5)."""
        agent = self.agent
        inbox = agent.subjects.stream_name(INBOX_STREAM)
        durable = self._durable_name(high)
        lane = agent.subjects.durable_inbox(agent.id, high)
        bell = self._bells[high]
        look_now = waiting
        # Opens that failed in a row: each waits twice as long as the one before; the last ends
        # the try, with an error, until the next bell or look.
        failed_opens = 0
        while not self._stop.is_set():
            if self._bell_subs[high] is None:
                # The consumer went away while bells were not heard: hear them, then look.
                await self._hear_bells(high)
                look_now = True
            if look_now:
                try:
                    if await self._stored(js, lane):
                        bell.set()
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - out of reach: the looker looks again
                    log.debug("durable inbox: stored commands not looked for: %s", e)
                    self._look_soon.set()
                look_now = False
            await bell.wait()
            bell.clear()
            try:
                await js.add_consumer(inbox, self._consumer_config(high))
                sub = await js.pull_subscribe_bind(durable=durable, stream=inbox)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - tried again, a bounded number of times
                failed_opens += 1
                if failed_opens >= MAX_OPEN_ATTEMPTS:
                    log.error(
                        "durable inbox: consumer %s cannot be opened after %d tries (%s); "
                        "trying again at the next bell or look",
                        durable,
                        failed_opens,
                        e,
                    )
                    failed_opens = 0
                    continue
                log.warning("durable inbox: consumer %s not opened: %s", durable, e)
                await asyncio.sleep(REOPEN_DELAY * 2 ** (failed_opens - 1))
                look_now = True
                continue
            failed_opens = 0
            agent.stats.inbox_consumers_opened += 1
            # The consumer delivers what is stored: no bell for each (PROTOCOL.md 7.5).
            await self._stop_hearing_bells(high)
            await self._pull(sub, queues, quiet=self.options.release_after)
            if self._stop.is_set():
                return
            # Bells heard again before the state below is read: one from now on is for a command
            # the state may not count, and reopens.
            await self._hear_bells(high)
            bell.clear()
            try:
                if await self._release(js, inbox, durable, lane):
                    agent.stats.inbox_consumers_released += 1
                else:
                    look_now = True  # something pending or held, or given up on: it stays
            except nats.js.errors.NotFoundError:
                look_now = True  # another instance released it: look
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - out of reach: the looker looks until it answers
                self._look_soon.set()

    async def _release(self, js: Any, inbox: str, durable: str, lane: str) -> bool:
        """Deletes the lane's consumer if nothing is pending, nothing awaits an ack, and no
        command is stored for the lane: one still stored that the consumer neither offers nor
        waits on is one it gave up on (max_deliver), waiting for the coordinator to dead-letter
        it, and the consumer stays so that a new one does not deliver it all over again."""
        info = await js.consumer_info(inbox, durable)
        if info.num_pending or info.num_ack_pending or await self._stored(js, lane):
            return False
        await js.delete_consumer(inbox, durable)
        return True

    async def stop(self) -> None:
        self._stop.set()
        for high in (False, True):
            await self._stop_hearing_bells(high)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        self._tasks.clear()

    async def _ensure_stream(self, js: Any, config: StreamConfig) -> None:
        try:
            await js.stream_info(config.name)
        except nats.js.errors.NotFoundError:
            try:
                await js.add_stream(config)
            except nats.js.errors.BadRequestError:
                pass  # created by someone else meanwhile

    async def _load_policies(self, js: Any) -> None:
        try:
            kv = await js.key_value(self.agent.subjects.bucket_name(CONFIG_BUCKET))
            entry = await kv.get(RETRY_KEY)
        except Exception:  # noqa: BLE001 - no published policies: the defaults
            return
        try:
            self.policies = RetryPolicies.from_json(json.loads(entry.value))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("agent %s: published retry policies unusable (%s); using defaults", self.agent.id, e)

    async def _pull(
        self,
        sub: Any,
        queues: list[asyncio.Queue[tuple[Msg, Envelope | DecodeError]]],
        quiet: float | None = None,
    ) -> None:
        """Takes deliveries until the agent stops or, with ``quiet``, until nothing has arrived
        for that long and nothing is held here. The subscription goes with it, however it ends:
        one left behind (a pull cancelled as the agent stops) would hold the connection's
        drain until its timeout."""
        try:
            await self._pull_until_done(sub, queues, quiet)
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - unsubscribed already, or the connection closing
                pass

    async def _pull_until_done(
        self,
        sub: Any,
        queues: list[asyncio.Queue[tuple[Msg, Envelope | DecodeError]]],
        quiet: float | None,
    ) -> None:
        batch = min(self.options.max_in_flight, MAX_PULL_BATCH)
        loop = asyncio.get_running_loop()
        last = loop.time()
        while not self._stop.is_set():
            if quiet is not None and loop.time() - last >= quiet:
                if not self._held:
                    return
                last = loop.time()
            wait = 5.0 if quiet is None else max(min(5.0, quiet), 0.05)
            try:
                msgs = await sub.fetch(batch, timeout=wait)
            except nats.errors.TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the server away: try again shortly
                log.debug("durable inbox: pull interrupted: %s", e)
                await asyncio.sleep(1.0 if quiet is None else min(1.0, quiet))
                continue
            last = loop.time()
            for msg in msgs:
                # Decoded once, here, to choose the lane by sender; the lane gets the envelope.
                try:
                    decoded: Envelope | DecodeError = decode(
                        msg.data, self.agent.subjects.implied(msg.subject), self.agent.max_message_bytes
                    )[0]
                except DecodeError as e:
                    decoded = e
                sender = decoded.from_ if isinstance(decoded, Envelope) else ""
                lane = zlib.crc32(sender.encode()) % len(queues) if sender else 0
                self._held[msg.metadata.sequence.stream] = msg
                queues[lane].put_nowait((msg, decoded))

    async def _lane(self, queue: asyncio.Queue[tuple[Msg, Envelope | DecodeError]]) -> None:
        while True:
            msg, decoded = await queue.get()
            try:
                await self._process(msg, decoded)
            except asyncio.CancelledError:
                raise
            except CONNECTION_GONE as e:
                log.warning("durable delivery not settled, the connection is gone (%s); the server will redeliver it", describe(e))
            except Exception:  # noqa: BLE001 - never lose the lane
                log.exception("durable delivery not settled; the server will redeliver it")

    async def _keeper(self) -> None:
        """Reports progress on every held delivery every third of the ack wait, so none is
        redelivered while this instance lives."""
        while True:
            await asyncio.sleep(self.options.ack_wait / 3)
            for msg in list(self._held.values()):
                try:
                    await msg.in_progress()
                except Exception as e:  # noqa: BLE001
                    log.debug("in-progress ack not sent: %s", e)

    async def _process(self, msg: Msg, decoded: Envelope | DecodeError) -> None:
        agent = self.agent
        meta = msg.metadata
        seq, delivered = meta.sequence.stream, meta.num_delivered
        if delivered > 1 or seq in self._recent:
            agent.stats.redelivered += 1
        self._recent[seq] = None
        if len(self._recent) > RECENT_DELIVERIES:
            self._recent.pop(next(iter(self._recent)))
        kind = Kind.UNKNOWN
        message_id = None
        if isinstance(decoded, DecodeError):
            outcome: Any = ChorusError(StatusCode.DATA_FORMAT, decoded.reason)
        else:
            kind, message_id = decoded.kind, decoded.id
            outcome = await agent.handle(
                decoded, msg.subject, "command", "", attempt=delivered, stored=seq, replay=ReplayProof.from_headers(msg.headers)
            )
        decision = settle(self.policies, msg.subject, delivered, kind, outcome)
        try:
            if decision.action == "ack":
                await msg.ack()
            elif decision.action == "nak":
                agent.stats.retries += 1
                await msg.nak(delay=decision.delay)
            else:
                await self._dead_letter(msg, decision, message_id)
        finally:
            if self._held.get(seq) is msg:
                del self._held[seq]

    async def _dead_letter(self, msg: Msg, decision: _Settle, message_id: Any) -> None:
        agent = self.agent
        subjects = agent.subjects
        meta = msg.metadata
        inbox = subjects.stream_name(INBOX_STREAM)
        letter = DeadLetter(
            reason=decision.reason,
            status=decision.status,
            detail=decision.detail,
            agent=agent.id,
            subject=msg.subject,
            envelope=msg.data,
            attempts=meta.num_delivered,
            stored_ms=int(meta.timestamp.timestamp() * 1000) if meta.timestamp else 0,
            message_id=message_id,
            source=(inbox, meta.sequence.stream),
            headers=dict(msg.headers or {}),
        )
        try:
            await write_dead_letter(agent.nc, subjects, letter, agent.request_timeout)
        except Exception as e:  # noqa: BLE001 - not stored: keep the message, try again later
            log.error("agent %s: dead letter not written (%s); will retry", agent.id, e)
            await msg.nak(delay=DEAD_LETTER_RETRY_DELAY)
            return
        agent.stats.dead_lettered += 1
        note = f"{decision.status} {decision.reason}: {decision.detail}"
        note = "".join(c for c in note if c.isprintable())[:200]
        log.warning("agent %s: durable message %s dead-lettered: %s", agent.id, meta.sequence.stream, note)
        await agent.nc.publish(msg.reply, f"+TERM {note}".encode())
