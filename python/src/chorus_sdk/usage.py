"""Usage: what each agent handled, per endpoint, customer and session (docs/PROTOCOL.md
section 7.13), as the Rust SDK's ``chorus_sdk::usage``.

Every agent counts, in its inbound pipeline, each command, request, event (with a topic) and
task that came for one of its endpoints, after its handler ran or it was refused: one more
``handled``, one more ``failed`` when the handler failed or the message was refused, its payload
size in ``bytes_in``, its reply's payload size in ``bytes_out`` and the time its run through
the pipeline took in ``handling_us``, under the endpoint (the command or capability, or the
event's topic), the kind, and the envelope's ``customer_id`` and ``session_id``; a task's run,
from its acceptance to its end (however it ends), adds its time to the row that counted its
acceptance. Every ``usage_interval`` seconds, and once more at shutdown, an agent that
counted anything publishes what it counted since its last report as one :class:`UsageReport`
to ``<root>.usage.<agent-id>``, stored by the coordinator's stream ``<ROOT>_USAGE``; a report
that is not stored (no stream yet, the server away) is merged into the next one.
``chorus usage --by customer,session`` sums the stored reports."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from ._connection import describe
from .envelope import Envelope, now_ms
from .subjects import Subjects, validate_token

log = logging.getLogger("chorus_sdk")

#: How often an agent reports its usage unless told otherwise, in seconds.
DEFAULT_USAGE_INTERVAL = 5.0
#: Suffix of the usage stream's name (``CHORUS_USAGE``).
USAGE_STREAM = "USAGE"
#: Rows an agent keeps between reports at most: beyond, what new keys count is folded into one
#: row whose customer and session are :data:`OVERFLOW`, so nothing is lost and memory stays
#: bounded.
MAX_USAGE_ROWS = 10_000
#: The customer and session of the overflow row.
OVERFLOW = "(overflow)"
#: How long shutdown waits to store the last report, in seconds.
LAST_REPORT_TIMEOUT = 2.0


class UsageKind(str, Enum):
    """What a counted message was."""

    #: A request (a reply was expected).
    REQUEST = "request"
    #: A command (no reply).
    COMMAND = "command"
    #: An event.
    EVENT = "event"
    #: A task submitted to the agent.
    TASK = "task"


@dataclass(frozen=True)
class UsageRow:
    """One row of a report: what one agent handled of one kind at one endpoint (a command,
    capability or topic) for one customer and session (empty: none)."""

    endpoint: str
    kind: UsageKind
    customer: str = ""
    session: str = ""
    #: Messages handled, successfully or not.
    handled: int = 0
    #: Of those, the ones whose handler failed or that were refused before it.
    failed: int = 0
    #: Payload bytes received.
    bytes_in: int = 0
    #: Reply payload bytes sent.
    bytes_out: int = 0
    #: Time spent handling them, in µs (Agentify's ``duration``): each message's run through
    #: the pipeline, a task's from its acceptance to its end.
    handling_us: int = 0

    def to_json(self) -> dict[str, Any]:
        """The row as it is on the wire."""
        return {
            "endpoint": self.endpoint,
            "kind": self.kind.value,
            "customer": self.customer,
            "session": self.session,
            "handled": self.handled,
            "failed": self.failed,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "handling_us": self.handling_us,
        }

    @classmethod
    def from_json(cls, value: Any) -> UsageRow:
        """A row read from the wire. Raises :class:`ValueError` when it is not one."""
        if not isinstance(value, dict):
            raise ValueError("a usage row is a JSON object")
        endpoint, kind = value.get("endpoint"), value.get("kind")
        if not isinstance(endpoint, str):
            raise ValueError("a usage row has an endpoint")
        try:
            usage_kind = UsageKind(kind)
        except ValueError:
            raise ValueError(f"usage row kind {kind!r}: one of request, command, event, task") from None
        return cls(
            endpoint,
            usage_kind,
            _text(value, "customer"),
            _text(value, "session"),
            _count(value, "handled", required=True),
            _count(value, "failed"),
            _count(value, "bytes_in"),
            _count(value, "bytes_out"),
            _count(value, "handling_us"),
        )


@dataclass
class UsageReport:
    """What one agent counted between two reports."""

    #: The agent.
    agent: str
    #: Its run (the instance id of its heartbeat manifest; changes when it restarts).
    instance: str
    #: The report's number in this run, from 1.
    seq: int
    #: Start of what it counts, ms since the epoch.
    from_ms: int
    #: End of what it counts.
    to_ms: int
    rows: list[UsageRow] = field(default_factory=list)

    @property
    def message_id(self) -> str:
        """The report's ``Nats-Msg-Id``: one per agent run and number, so a report published
        twice is stored once."""
        return f"{self.agent}-{self.instance}-{self.seq}"

    def to_json(self) -> dict[str, Any]:
        """The report as it is on the wire."""
        return {
            "agent": self.agent,
            "instance": self.instance,
            "seq": self.seq,
            "from_ms": self.from_ms,
            "to_ms": self.to_ms,
            "rows": [row.to_json() for row in self.rows],
        }

    def encode(self) -> bytes:
        """The report's JSON body."""
        return json.dumps(self.to_json(), separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> UsageReport:
        """A report read from the usage stream. Raises :class:`ValueError` when it is not
        one."""
        try:
            value = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"a usage report is JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("a usage report is a JSON object")
        agent, instance, rows = value.get("agent"), value.get("instance"), value.get("rows")
        if not isinstance(agent, str) or not isinstance(instance, str):
            raise ValueError("a usage report has an agent and an instance")
        if not isinstance(rows, list):
            raise ValueError("a usage report has rows")
        return cls(
            agent,
            instance,
            _count(value, "seq", required=True),
            _count(value, "from_ms", required=True),
            _count(value, "to_ms", required=True),
            [UsageRow.from_json(row) for row in rows],
        )


def usage_subject(subjects: Subjects, agent: str) -> str:
    """``<root>.usage.<agent>``: where ``agent`` publishes its reports."""
    return f"{subjects.root}.usage.{validate_token('agent id', agent)}"


def _text(value: dict[str, Any], name: str) -> str:
    text = value.get(name, "")
    if not isinstance(text, str):
        raise ValueError(f"usage {name} is a string")
    return text


def _count(value: dict[str, Any], name: str, required: bool = False) -> int:
    if name not in value and not required:
        return 0
    count = value.get(name)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"usage {name} is a count (0 or more)")
    return count


# A row's key (endpoint, kind, customer, session); its counts are handled, failed, bytes in,
# bytes out and handling µs.
_Key = tuple[str, UsageKind, str, str]
_Counts = tuple[int, int, int, int, int]


def _key(env: Envelope, endpoint: str, kind: UsageKind) -> _Key:
    return (endpoint, kind, env.customer_id or "", env.session_id or "")


class Usage:
    """What one agent counted since its last report (as the Rust SDK's ``Usage``)."""

    def __init__(self, agent: str, instance: str, enabled: bool) -> None:
        #: Off when the agent reports no usage (``usage_interval`` 0): nothing is counted.
        self.enabled = enabled
        self.agent = agent
        self.instance = instance
        self._from_ms = now_ms()
        self._rows: dict[_Key, list[int]] = {}
        self._seq = 0
        #: Whether the last report was not stored because there is no usage stream (no
        #: coordinator has made it): an expected condition, said at debug level.
        self.no_stream = False

    @property
    def pending(self) -> bool:
        """Whether something was counted that no stored report holds yet."""
        return bool(self._rows)

    def record(
        self, env: Envelope, endpoint: str, kind: UsageKind, failed: bool, bytes_out: int, handling_us: int = 0
    ) -> None:
        """Counts one handled message: at ``endpoint`` (a command, capability or topic), of
        ``kind``, whether it ``failed``, its reply's payload size and how long handling it took
        (µs)."""
        if not self.enabled:
            return
        self._merge(_key(env, endpoint, kind), (1, 1 if failed else 0, len(env.payload), bytes_out, handling_us))

    def record_run(self, env: Envelope, endpoint: str, handling_us: int) -> None:
        """Adds the time (µs) a task of ``endpoint``, submitted as ``env``, ran (counted as
        handled when it was accepted)."""
        if not self.enabled:
            return
        self._merge(_key(env, endpoint, UsageKind.TASK), (0, 0, 0, 0, handling_us))

    def _merge(self, key: _Key, counts: _Counts) -> None:
        rows = self._rows
        row = rows.get(key)
        if row is None:
            if len(rows) >= MAX_USAGE_ROWS:
                key = (key[0], key[1], OVERFLOW, OVERFLOW)
            row = rows.setdefault(key, [0, 0, 0, 0, 0])
        for i, n in enumerate(counts):
            row[i] += n

    def take(self) -> UsageReport | None:
        """What was counted since the last report, as the next report (numbered); ``None``
        when nothing was."""
        if not self._rows:
            return None
        now = now_ms()
        from_ms, self._from_ms = self._from_ms, now
        rows, self._rows = self._rows, {}
        self._seq += 1
        report = [
            UsageRow(endpoint, kind, customer, session, *counts)
            for (endpoint, kind, customer, session), counts in rows.items()
        ]
        report.sort(key=lambda r: (r.endpoint, r.customer, r.session, r.kind.value))
        return UsageReport(self.agent, self.instance, self._seq, from_ms, now, report)

    def put_back(self, report: UsageReport) -> None:
        """Puts back a report that was not stored, to go with the next one."""
        self._from_ms = min(self._from_ms, report.from_ms)
        for row in report.rows:
            self._merge(
                (row.endpoint, row.kind, row.customer, row.session),
                (row.handled, row.failed, row.bytes_in, row.bytes_out, row.handling_us),
            )

    async def report(self, nc: NATS, subjects: Subjects, timeout: float) -> bool:
        """Stores what was counted since the last report in the usage stream (a JetStream
        publish, waiting up to ``timeout`` seconds for its ack); what is not stored (no stream,
        the server away) is kept for the next report and logged at debug level. Returns whether
        nothing is left to report."""
        report = self.take()
        if report is None:
            return True
        try:
            js = nc.jetstream(timeout=timeout)
            await js.publish(
                usage_subject(subjects, self.agent), report.encode(), headers={"Nats-Msg-Id": report.message_id}
            )
        except asyncio.CancelledError:
            self.put_back(report)
            raise
        except Exception as e:  # noqa: BLE001 - not stored: kept for the next report
            self.put_back(report)
            self.no_stream = isinstance(e, (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError))
            why = "no usage stream (is the coordinator running?)" if self.no_stream else describe(e)
            log.debug("agent %s: usage report kept for the next one: %s", self.agent, why)
            return False
        self.no_stream = False
        return True


__all__ = [
    "DEFAULT_USAGE_INTERVAL",
    "LAST_REPORT_TIMEOUT",
    "MAX_USAGE_ROWS",
    "OVERFLOW",
    "USAGE_STREAM",
    "Usage",
    "UsageKind",
    "UsageReport",
    "UsageRow",
    "usage_subject",
]
