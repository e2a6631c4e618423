"""Notifications (docs/PROTOCOL.md section 7.14): a push to one agent, or through the
coordinator to each live member of a group, that expects no reply and needs no topic
subscription. Core by default (published; gone if the agent is away), durable when asked
(stored in the recipient's inbox until its notification handler takes it). As
``Agent::notify`` and ``Notify`` in the Rust SDK: the same subjects, outcomes and codes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from .status import ChorusError, StatusCode
from .subjects import validate_dotted, validate_token

#: A recipient's outcome: published on core NATS (whether or not anyone listened).
DELIVERED = "delivered"
#: A recipient's outcome: stored in its durable inbox.
STORED = "stored"
#: A recipient's outcome: not published or stored (its status and reason say why).
FAILED = "failed"


@dataclass(frozen=True)
class NotifyTarget:
    """Who a notification goes to when it is not one agent: a broadcast group's live members,
    a capability's live holders, or every live agent, through the coordinator (``Notify::group``,
    ``Notify::capability``, ``Notify::all`` in Rust). Made with :meth:`group`,
    :meth:`capability` or :meth:`all`."""

    kind: str
    name: str = ""

    @classmethod
    def group(cls, group: str) -> NotifyTarget:
        """Every live member of broadcast group ``group``."""
        return cls("group", validate_token("group", group))

    @classmethod
    def capability(cls, capability: str) -> NotifyTarget:
        """Every live holder of ``capability``."""
        return cls("capability", validate_dotted("capability", capability))

    @classmethod
    def all(cls) -> NotifyTarget:
        """Every live agent."""
        return cls("all")


@dataclass(frozen=True)
class NotifyRecipient:
    """One recipient's line: ``outcome`` is :data:`DELIVERED`, :data:`STORED` or
    :data:`FAILED` (with the code and reason)."""

    agent: str
    outcome: str
    status: int = int(StatusCode.OK)
    reason: str | None = None


@dataclass(frozen=True)
class NotifyReport:
    """What became of a notification: one line per recipient (for one agent, one line),
    sorted by agent id, and the notification's message id (a group notification's copies
    share it as their ``correlation_id``)."""

    id: uuid.UUID
    recipients: list[NotifyRecipient] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        """How many recipients had ``outcome``."""
        return sum(1 for r in self.recipients if r.outcome == outcome)

    def recipient(self, agent: str) -> NotifyRecipient | None:
        """The line of ``agent``, if it was a recipient."""
        return next((r for r in self.recipients if r.agent == agent), None)

    @classmethod
    def from_broadcast(cls, report: Any) -> NotifyReport:
        """The coordinator's broadcast report (section 7.6) as a notification's. Raises
        :class:`ChorusError` (5006) when it is not one."""
        if not isinstance(report, dict):
            raise ChorusError(StatusCode.DATA_FORMAT, "the coordinator's report is not a map")
        try:
            raw_id = report["broadcast_id"]
            report_id = uuid.UUID(bytes=bytes(raw_id)) if isinstance(raw_id, (bytes, bytearray)) else uuid.UUID(str(raw_id))
            lines = [
                NotifyRecipient(
                    agent=str(line["agent"]),
                    outcome=str(line["outcome"]),
                    status=int(line.get("status", StatusCode.OK)),
                    reason=line.get("reason"),
                )
                for line in report.get("recipients") or []
            ]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ChorusError(StatusCode.DATA_FORMAT, f"the coordinator's report does not read: {e}") from e
        return cls(report_id, lines)

    def as_dict(self) -> dict[str, Any]:
        """The report as the Rust SDK's ``NotifyReport`` serializes: ``{"id", "recipients"}``."""
        return {
            "id": str(self.id),
            "recipients": [
                {"agent": r.agent, "outcome": r.outcome, "status": r.status, **({"reason": r.reason} if r.reason is not None else {})}
                for r in self.recipients
            ],
        }


__all__ = ["DELIVERED", "FAILED", "STORED", "NotifyRecipient", "NotifyReport", "NotifyTarget"]
