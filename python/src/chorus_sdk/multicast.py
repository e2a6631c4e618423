"""Multicast: one call to a list of agents, sent once per recipient as a request of its own,
the replies collected (all of them, the first ``n``, or a quorum of ``n``) within one deadline
and reported per recipient (docs/PROTOCOL.md section 7.6.1). As ``Agent::multicast`` in the
Rust SDK: the same outcomes, limits, reasons and status codes."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .codec import DecodeError, decode_payload, typed
from .envelope import CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, Envelope
from .status import ChorusError, NoResponders, Refused, StatusCode, Timeout
from .subjects import SubjectError, validate_token

log = logging.getLogger("chorus_sdk")

#: The most recipients one multicast may name (``MAX_MULTICAST_RECIPIENTS`` in the Rust SDK).
MAX_MULTICAST_RECIPIENTS = 1000


@dataclass(frozen=True)
class Collect:
    """Which replies a multicast waits for; whatever it waits for, it returns at the call's
    deadline at the latest, with what has come by then. Made with :meth:`all`,
    :meth:`first` or :meth:`quorum` (``Collect::All``, ``First(n)``, ``Quorum(n)`` in Rust)."""

    mode: str
    n: int = 0

    @classmethod
    def all(cls) -> Collect:
        """Every recipient's answer (a reply, a refusal, no responders), or the deadline."""
        return cls("all")

    @classmethod
    def first(cls, n: int) -> Collect:
        """The first ``n`` successful replies: it returns as soon as ``n`` have come. When
        too many recipients have failed for ``n`` to come, it still waits for the others'
        replies (as many as come by the deadline)."""
        return cls("first", n)

    @classmethod
    def quorum(cls, n: int) -> Collect:
        """A quorum of ``n`` successful replies: it returns as soon as ``n`` have come, or as
        soon as too many recipients have failed for ``n`` to come; the report's ``met``
        says which."""
        return cls("quorum", n)

    def __repr__(self) -> str:
        return "Collect.all()" if self.mode == "all" else f"Collect.{self.mode}({self.n})"

    def wanted(self, recipients: int) -> int:
        """How many successful replies it asks for, of ``recipients``."""
        return recipients if self.mode == "all" else self.n

    def check(self, recipients: int) -> None:
        """Raises :class:`ChorusError` 5018 for an unknown mode, or an ``n`` that is not a
        number from 1 to ``recipients``."""
        if self.mode == "all":
            return
        if self.mode not in ("first", "quorum"):
            raise _invalid(f"collect {self.mode!r}: all, first or quorum")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= recipients:
            raise _invalid(f"{self!r}: n must be 1 to the number of recipients ({recipients})")

    def done(self, replied: int, pending: int) -> bool:
        """Whether the collection is over with ``replied`` successful replies in and
        ``pending`` recipients not yet in: nothing more to wait for, or (first, quorum) ``n``
        replies in, or (quorum) ``n`` out of reach."""
        if pending == 0:
            return True
        if self.mode == "first":
            return replied >= self.n
        if self.mode == "quorum":
            return replied >= self.n or replied + pending < self.n
        return False

    def met(self, replied: int, recipients: int) -> bool:
        """Whether ``replied`` successful replies of ``recipients`` meet what it asked for."""
        return replied >= self.wanted(recipients)


class MulticastOutcome(str, Enum):
    """How one recipient of a multicast fared."""

    #: It answered with success (:attr:`MulticastRecipient.reply`).
    REPLIED = "replied"
    #: It answered with an error status: its handler's error or the receiver's refusal.
    REFUSED = "refused"
    #: Nobody serves the agent's command subject (the server said so at once, 5012).
    NO_RESPONDERS = "no_responders"
    #: No answer by the deadline (5005).
    SILENT = "silent"
    #: The multicast returned before it answered: its request was dropped, a late reply ignored.
    NOT_AWAITED = "not_awaited"
    #: Its copy could not be sent or its reply not read, on this side (an open circuit
    #: breaker, no encryption key for it, a payload too large, the connection gone).
    FAILED = "failed"


@dataclass
class MulticastRecipient:
    """One recipient's line in a multicast report: its ``outcome``; the reply envelope when
    it replied; the status it stands for (the reply's, the refusal's or the error's, 5012
    for no responders, 5005 for silence, ``None`` when not awaited) and the reason given."""

    agent: str
    outcome: MulticastOutcome
    reply: Envelope | None = None
    status: int | None = None
    reason: str | None = None

    def value(self, returns: type[Any] | None = None) -> Any:
        """The reply's value, as ``request`` returns it (as a ``returns`` when given). Raises
        :class:`ChorusError` 5006 when it does not decode, 5018 when it did not reply."""
        if self.reply is None:
            raise _invalid(f"{self.agent} did not reply ({self.outcome.value})")
        value = reply_value(self.reply)
        try:
            return typed(value, returns)
        except DecodeError as e:
            raise ChorusError(StatusCode.DATA_FORMAT, e.reason) from e


@dataclass(frozen=True)
class MulticastCounts:
    """How many recipients fared each way."""

    replied: int = 0
    refused: int = 0
    no_responders: int = 0
    silent: int = 0
    not_awaited: int = 0
    failed: int = 0


@dataclass
class MulticastReport:
    """What a multicast brought back: one line per recipient, in the order given.
    ``multicast_id`` is the conversation every copy carries as its ``correlation_id`` (a
    fresh id, or the conversation of the message being handled); ``met`` whether enough
    successful replies came (every recipient's for ``all``, ``n`` for ``first`` and
    ``quorum``); ``elapsed`` the seconds from the first send to the return."""

    multicast_id: uuid.UUID
    collect: Collect
    met: bool
    elapsed: float
    recipients: list[MulticastRecipient] = field(default_factory=list)

    def counts(self) -> MulticastCounts:
        """How many recipients fared each way."""
        tally = {o: 0 for o in MulticastOutcome}
        for r in self.recipients:
            tally[r.outcome] += 1
        return MulticastCounts(**{o.value: n for o, n in tally.items()})

    def outcome(self, agent: str) -> MulticastRecipient | None:
        """Agent ``agent``'s line, if it was a recipient."""
        return next((r for r in self.recipients if r.agent == agent), None)

    def replies(self, returns: type[Any] | None = None) -> dict[str, Any]:
        """The successful replies' values by agent, in the recipients' order."""
        return {r.agent: r.value(returns) for r in self.recipients if r.reply is not None}


def check_multicast(to: Sequence[str], command: str, collect: Collect, id: object = None) -> list[str]:
    """The recipients as a list once the multicast is checked, before anything is sent: 1 to
    :data:`MAX_MULTICAST_RECIPIENTS` valid agent ids, none twice; a valid command name; no
    fixed message ``id``; and ``collect``'s ``n``. Raises :class:`ChorusError` 5018 saying
    what is wrong."""
    if id is not None:
        raise _invalid("every copy has an id of its own: do not set id")
    try:
        validate_token("command name", command)
    except SubjectError as e:
        raise _invalid(str(e)) from e
    if isinstance(to, (str, bytes)) or not isinstance(to, Sequence):
        raise _invalid(f"to is a list of agent ids, not {type(to).__name__}")
    if not to:
        raise _invalid("no recipients: name at least one agent")
    if len(to) > MAX_MULTICAST_RECIPIENTS:
        raise _invalid(f"{len(to)} recipients: at most {MAX_MULTICAST_RECIPIENTS} are allowed")
    seen: set[str] = set()
    for agent in to:
        try:
            validate_token("agent id", agent)
        except SubjectError as e:
            raise _invalid(str(e)) from e
        if agent in seen:
            raise _invalid(f"recipient {agent} is listed twice")
        seen.add(agent)
    if not isinstance(collect, Collect):
        raise _invalid(f"collect is a Collect (Collect.all(), .first(n), .quorum(n)), not {type(collect).__name__}")
    collect.check(len(to))
    return list(to)


async def collect_replies(
    to: list[str],
    send: Callable[[str], Awaitable[Envelope]],
    collect: Collect,
    wait: float,
    multicast_id: uuid.UUID,
) -> MulticastReport:
    """Runs ``send(agent)`` for every recipient at once, each its own task, and collects the
    outcomes as ``collect`` asks within ``wait`` seconds; the tasks still running when it
    returns (or is cancelled) are cancelled and awaited, so none outlives it."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + wait
    outcomes: list[MulticastRecipient | None] = [None] * len(to)

    async def one(agent: str) -> MulticastRecipient:
        try:
            reply = await send(agent)
        except Refused as e:
            return MulticastRecipient(agent, MulticastOutcome.REFUSED, status=e.status, reason=e.reason)
        except NoResponders:
            return MulticastRecipient(agent, MulticastOutcome.NO_RESPONDERS, status=int(StatusCode.NO_RESPONDERS))
        except Timeout:
            return MulticastRecipient(agent, MulticastOutcome.SILENT, status=int(StatusCode.TIMEOUT))
        except ChorusError as e:
            return MulticastRecipient(agent, MulticastOutcome.FAILED, status=e.status, reason=e.reason or str(e))
        except Exception as e:  # noqa: BLE001 - one copy's failure is its line, not the multicast's
            log.warning("multicast %s: the copy to %s failed: %r", multicast_id, agent, e)
            return MulticastRecipient(agent, MulticastOutcome.FAILED, status=int(StatusCode.INTERNAL), reason=repr(e))
        status = reply.status if reply.status is not None else int(StatusCode.OK)
        return MulticastRecipient(agent, MulticastOutcome.REPLIED, reply=reply, status=status)

    tasks: dict[asyncio.Future[MulticastRecipient], int] = {asyncio.ensure_future(one(agent)): i for i, agent in enumerate(to)}
    pending: set[asyncio.Future[MulticastRecipient]] = set(tasks)
    replied = 0
    expired = False
    try:
        while not collect.done(replied, len(pending)):
            remaining = deadline - loop.time()
            if remaining <= 0:
                expired = True
                break
            done, _ = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                expired = True
                break
            # One at a time, in the order sent, as the Rust SDK takes them: the collection
            # may end before the rest of this batch is counted.
            for task in sorted(done, key=tasks.__getitem__):
                if collect.done(replied, len(pending)):
                    break
                pending.discard(task)
                line = task.result()
                outcomes[tasks[task]] = line
                if line.outcome is MulticastOutcome.REPLIED:
                    replied += 1
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    left = MulticastOutcome.SILENT if expired else MulticastOutcome.NOT_AWAITED
    left_status = int(StatusCode.TIMEOUT) if expired else None
    recipients = [line or MulticastRecipient(agent, left, status=left_status) for agent, line in zip(to, outcomes)]
    log.debug("multicast %s: %d recipients, %d replied, %r, expired=%s", multicast_id, len(to), replied, collect, expired)
    return MulticastReport(multicast_id, collect, collect.met(replied, len(to)), loop.time() - started, recipients)


def _invalid(why: str) -> ChorusError:
    return ChorusError(StatusCode.INVALID_ARGUMENT, f"multicast: {why}")


def reply_value(reply: Envelope) -> Any:
    """A reply's payload read by its content type (raw bytes for other types)."""
    if not reply.payload:
        return None
    if reply.content_type in (CONTENT_TYPE_MSGPACK, CONTENT_TYPE_JSON):
        try:
            return decode_payload(reply.payload, reply.content_type)
        except DecodeError as e:
            raise ChorusError(StatusCode.DATA_FORMAT, e.reason) from e
    return reply.payload


__all__ = [
    "MAX_MULTICAST_RECIPIENTS",
    "Collect",
    "MulticastCounts",
    "MulticastOutcome",
    "MulticastRecipient",
    "MulticastReport",
    "check_multicast",
    "collect_replies",
]
