"""The envelope (docs/PROTOCOL.md section 4) and its vocabularies (section 5)."""

from __future__ import annotations

import os
import random
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

PROTOCOL_VERSION = (1, 0)
COMPACT_VERSION = (2, 0)
DEFAULT_HOP_LIMIT = 16

CONTENT_TYPE_MSGPACK = "application/msgpack"
CONTENT_TYPE_JSON = "application/json"
CONTENT_TYPE_ENCRYPTED = "application/chorus-encrypted"
# A payload carried by reference through the JetStream object store (section 7.11): the
# payload is a map naming the object. This SDK does not fetch such payloads.
CONTENT_TYPE_OBJECT = "application/chorus-object"

E = TypeVar("E", bound="Vocabulary")


class Vocabulary(str, Enum):
    """A closed vocabulary: lowercase strings in the named forms, codes (the position in the
    spec's table, from 1) in the compact form. A value this version does not know reads as
    ``UNKNOWN`` (code 0)."""

    @classmethod
    def _missing_(cls, value: object) -> Vocabulary:
        return cls("unknown")

    @property
    def code(self) -> int:
        code = _CODE_OF.get(self)
        if code is None:
            _table(type(self))
            code = _CODE_OF.get(self, 0)
        return code

    @classmethod
    def from_code(cls: type[E], code: int) -> E:
        members = _table(cls)
        if 1 <= code <= len(members):
            return members[code - 1]  # type: ignore[return-value]
        return cls("unknown")

    @classmethod
    def read(cls: type[E], value: str) -> E:
        """The member named ``value``, or ``UNKNOWN``."""
        member = cls._value2member_map_.get(value)
        return member if member is not None else cls("unknown")  # type: ignore[return-value]


# Codes of the closed vocabularies, computed once per vocabulary.
_CODE_OF: dict[Vocabulary, int] = {}
_BY_CODE: dict[type, list[Vocabulary]] = {}


def _table(cls: type[Vocabulary]) -> list[Vocabulary]:
    members = _BY_CODE.get(cls)
    if members is None:
        members = [m for m in cls if m.value != "unknown"]
        _BY_CODE[cls] = members
        for i, m in enumerate(members):
            _CODE_OF[m] = i + 1
        _CODE_OF[cls("unknown")] = 0
    return members


class Kind(Vocabulary):
    """What a message is, structurally (section 5.1)."""

    REQUEST = "request"
    RESPONSE = "response"
    EVENT = "event"
    COMMAND = "command"
    HEARTBEAT = "heartbeat"
    ERROR = "error"
    #: A push to one agent (or, through the coordinator, each member of a group) that expects
    #: no reply and needs no topic subscription (section 7.14).
    NOTIFICATION = "notification"
    UNKNOWN = "unknown"


class Performative(Vocabulary):
    """What the sender means by it (section 5.2)."""

    REQUEST = "request"
    INFORM = "inform"
    PROPOSE = "propose"
    AGREE = "agree"
    REFUSE = "refuse"
    CONFIRM = "confirm"
    FAILURE = "failure"
    DONE = "done"
    QUERY = "query"
    DISCOVER = "discover"
    OFFER = "offer"
    ASSIGN = "assign"
    CANCEL = "cancel"
    HANDOFF = "handoff"
    NEGOTIATE = "negotiate"
    PROGRESS = "progress"
    HEALTH = "health"
    UNKNOWN = "unknown"


class Priority(Vocabulary):
    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"
    CRITICAL = "critical"
    UNKNOWN = "unknown"


class Delivery(Vocabulary):
    """The delivery class a sender chose (section 7.9)."""

    AT_MOST_ONCE = "at_most_once"
    AT_LEAST_ONCE = "at_least_once"
    EXACTLY_ONCE = "exactly_once"
    UNKNOWN = "unknown"


class TaskState(Vocabulary):
    """Where a task (or other reported work) stands (section 4.1, ``progress``)."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SUBMITTED = "submitted"
    ACCEPTED = "accepted"
    WORKING = "working"
    INPUT_REQUIRED = "input_required"
    REJECTED = "rejected"
    EXPIRED = "expired"
    UNKNOWN = "unknown"


@dataclass(slots=True)
class Seq:
    """A publisher's count on one subject."""

    epoch: int
    n: int


@dataclass(slots=True)
class Expect:
    """The reply the sender expects, and how long it waits."""

    performative: Performative
    timeout_ms: int


@dataclass(slots=True)
class Progress:
    state: TaskState
    fraction: float | None = None


@dataclass(slots=True)
class Trace:
    """W3C trace context."""

    traceparent: str
    tracestate: str | None = None


@dataclass(slots=True)
class Signature:
    key: str
    value: bytes
    alg: str = "ed25519"


@dataclass(slots=True)
class Recipient:
    agent: str
    key: bytes


@dataclass(slots=True)
class Encryption:
    alg: str
    inner_content_type: str
    recipients: list[Recipient] = field(default_factory=list)


@dataclass(slots=True)
class Envelope:
    """One Chorus message. Field names are the spec's; ``from_`` is ``from``."""

    id: uuid.UUID
    from_: str
    kind: Kind
    performative: Performative
    timestamp_ms: int
    version: tuple[int, int] = PROTOCOL_VERSION
    correlation_id: uuid.UUID | None = None
    in_reply_to: uuid.UUID | None = None
    to: list[str] = field(default_factory=list)
    topic: str | None = None
    capability: str | None = None
    name: str | None = None
    ttl_ms: int | None = None
    deadline_ms: int | None = None
    hops: int = 0
    hop_limit: int = DEFAULT_HOP_LIMIT
    priority: Priority = Priority.NORMAL
    delivery: Delivery = Delivery.AT_MOST_ONCE
    seq: Seq | None = None
    expect: Expect | None = None
    progress: Progress | None = None
    status: int | None = None
    reason: str | None = None
    trace: Trace | None = None
    session_id: str | None = None
    customer_id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = CONTENT_TYPE_MSGPACK
    content_encoding: str | None = None
    payload: bytes = b""
    token: str | None = None
    signature: Signature | None = None
    encryption: Encryption | None = None

    @classmethod
    def new(cls, kind: Kind, performative: Performative, sender: str) -> Envelope:
        """A new message: a fresh UUIDv7 id and the current time."""
        id = uuid7()
        return cls(id=id, from_=sender, kind=kind, performative=performative, timestamp_ms=id.int >> 80)

    @property
    def conversation(self) -> uuid.UUID:
        """The conversation this message belongs to: ``correlation_id``, else its own id."""
        return self.correlation_id or self.id

    def expires_ms(self) -> int | None:
        """When it expires: the earlier of ``timestamp_ms + ttl_ms`` and ``deadline_ms``."""
        ttl, deadline = self.ttl_ms, self.deadline_ms
        if ttl is None:
            return deadline
        ends = self.timestamp_ms + ttl
        return ends if deadline is None or ends <= deadline else deadline


def now_ms() -> int:
    return time.time_ns() // 1_000_000


_last_v7 = [0, 0]
# Ids need to be unique, not secret: a generator seeded from the OS, fast to draw from.
_random = random.Random(os.urandom(16))
if hasattr(os, "register_at_fork"):
    # A forked child draws its own ids, not its parent's.
    os.register_at_fork(after_in_child=lambda: _random.seed(os.urandom(16)))


def uuid7(ms: int | None = None) -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48 bits of milliseconds, a 12-bit counter, then random bits. Ids
    made by this process sort in the order made: within one millisecond the counter (started
    at a random value below 2048) counts up, and a clock that steps back is not followed."""
    # now_ms(), written out: twice per request-reply.
    ms = time.time_ns() // 1_000_000 if ms is None else ms
    if ms <= _last_v7[0]:
        ms, counter = _last_v7[0], _last_v7[1] + 1
        if counter > 0x0FFF:
            ms, counter = ms + 1, _random.getrandbits(11)
    else:
        counter = _random.getrandbits(11)
    _last_v7[0], _last_v7[1] = ms, counter
    rand_b = _random.getrandbits(62)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | rand_b
    return uuid_from_int(value)


_new_object = object.__new__
_UUID = uuid.UUID
# The setters of UUID's two slots, what ``object.__setattr__(u, "int", value)`` calls after
# looking them up each time (UUID's own __setattr__ refuses: a UUID is immutable).
_set_int = _UUID.__dict__["int"].__set__
_set_safety = _UUID.__dict__["is_safe"].__set__
_UNKNOWN_SAFETY = uuid.SafeUUID.unknown


def uuid_from_int(value: int) -> uuid.UUID:
    """A ``uuid.UUID`` of a 128-bit value the caller guarantees is in range, without
    ``UUID.__init__``'s argument parsing (the hot paths make five per request-reply)."""
    u = _new_object(_UUID)
    _set_int(u, value)
    _set_safety(u, _UNKNOWN_SAFETY)
    return u


def uuid_from_bytes(data: bytes) -> uuid.UUID:
    """A ``uuid.UUID`` of exactly 16 big-endian bytes (checked by the caller)."""
    return uuid_from_int(int.from_bytes(data, "big"))


def uuid7_ms(u: uuid.UUID) -> int | None:
    """The millisecond time of a UUIDv7, or None for another version."""
    if (u.int >> 76) & 0xF != 7:
        return None
    return u.int >> 80
