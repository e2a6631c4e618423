"""Handling times and ETAs (IACP's ``eta_seconds``), as the Rust SDK computes them: a moving
average of how long an agent's handlers take (:class:`Ewma`), announced in its manifest
(``handling_ms``, per capability and agent-wide) with the messages waiting for a handler slot
per priority (``waiting``), and the estimate both make (:func:`estimate_eta_ms`,
:func:`eta_at`): how long until work sent now would be done.

The coordinator computes each discovery record's ``eta_ms`` the same way, at the query's
priority and for its capabilities; :func:`eta_at` reads it from a manifest on this side."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from .envelope import Priority

#: The most a MessagePack integer holds (Rust's ``u64::MAX``): estimates saturate there.
U64_MAX = 2**64 - 1

#: The keys of a manifest's ``waiting``, most urgent first (the order a backlog serves them).
PRIORITIES = (Priority.CRITICAL, Priority.HIGH, Priority.NORMAL, Priority.LOW)

# A priority's rank: 0 is served first; one this version does not know counts as normal.
_RANK = {p: i for i, p in enumerate(PRIORITIES)}
_NORMAL_RANK = _RANK[Priority.NORMAL]
# The largest sample an Ewma keeps, in µs (so that ``old * 4 + sample`` stays within u64).
_MAX_SAMPLE = U64_MAX // 2


def rank(priority: Priority) -> int:
    """The rank of ``priority`` in :data:`PRIORITIES` (an unknown one ranks as normal)."""
    return _RANK.get(priority, _NORMAL_RANK)


class Ewma:
    """A moving average of durations, in µs, the most recent weighing most (each new sample
    moves it a fifth of the way, in integers): how long handlers take lately, for an ETA.
    The Rust SDK's ``stats::Ewma``, sample for sample."""

    __slots__ = ("_micros",)

    def __init__(self) -> None:
        self._micros: int | None = None

    def record(self, elapsed_ns: int) -> None:
        """Adds a sample of ``elapsed_ns`` nanoseconds (the first is taken as it is)."""
        # min(max(int(elapsed_ns), 0) // 1000, U64_MAX // 2), without the calls (twice per
        # message handled).
        sample = int(elapsed_ns) // 1000
        if sample < 0:
            sample = 0
        elif sample > _MAX_SAMPLE:
            sample = _MAX_SAMPLE
        old = self._micros
        self._micros = sample if old is None else (old * 4 + sample) // 5

    @property
    def ms(self) -> int | None:
        """The average in ms, rounded up and at least 1 (a handler that takes 200 µs is not
        free); ``None`` before the first sample."""
        micros = self._micros
        if micros is None:
            return None
        return max(1, -(-micros // 1000))


def estimate_eta_ms(handling_ms: int, slots: int, busy: int, ahead: int) -> int:
    """Estimated time until a message sent now would be handled, in ms: ``handling_ms`` when
    one of ``slots`` handler slots is free for it; otherwise it waits for ``busy + ahead -
    slots + 1`` handlers to finish, which finish at ``slots`` per ``handling_ms``, and then
    takes ``handling_ms`` itself. No slots read as one; the result saturates at
    :data:`U64_MAX`."""
    slots = max(int(slots), 1)
    handling = max(int(handling_ms), 0)
    before = max(int(busy), 0) + max(int(ahead), 0)
    if before < slots:
        return min(handling, U64_MAX)
    finishes = before - slots + 1
    waited = min(-(-(handling * finishes) // slots), U64_MAX)
    return min(waited + handling, U64_MAX)


def waiting_at_or_above(waiting: Any, priority: Priority) -> int:
    """Of a manifest's ``waiting`` (counts by priority name), those taken before a new message
    of ``priority``: its own priority and the more urgent ones. Counts that are not
    non-negative integers read as 0."""
    if not isinstance(waiting, Mapping):
        return 0
    return sum(_count(waiting.get(p.value)) for p in PRIORITIES[: rank(priority) + 1])


def eta_at(manifest: Mapping[str, Any], priority: Priority = Priority.NORMAL, capabilities: Iterable[str] = ()) -> int | None:
    """Estimated time until work of ``priority`` for ``capabilities`` (any of its work when
    none), sent now to the agent of ``manifest`` (a discovery record's manifest, as decoded),
    would be done, in ms: :func:`estimate_eta_ms` with the slowest named capability's
    ``handling_ms`` (the agent's own when none of them is timed), its slots, the handlers its
    load says are busy, and the messages waiting at ``priority`` or above. ``None`` until the
    agent has handled something, or when the manifest says nothing usable. The Rust SDK's
    ``Manifest::eta_at``; never raises on what a manifest holds."""
    if not isinstance(manifest, Mapping):
        return None
    named = {capabilities} if isinstance(capabilities, str) else set(capabilities)
    timed = [
        _count(c.get("handling_ms"))
        for c in _list(manifest.get("capabilities"))
        if isinstance(c, Mapping) and isinstance(c.get("name"), str) and c["name"] in named and _is_count(c.get("handling_ms"))
    ]
    if timed:
        handling = max(timed)
    elif _is_count(manifest.get("handling_ms")):
        handling = _count(manifest.get("handling_ms"))
    else:
        return None
    slots = manifest.get("slots")
    slots = max(_count(slots), 1) if _is_count(slots) else 1
    load = manifest.get("load")
    if isinstance(load, (int, float)) and not isinstance(load, bool) and math.isfinite(load):
        load = min(max(float(load), 0.0), 1.0)
    else:
        load = 0.0
    # Rounded half away from zero, as Rust's f32::round; at most `slots`.
    busy = math.floor(load * slots + 0.5)
    return estimate_eta_ms(handling, slots, busy, waiting_at_or_above(manifest.get("waiting"), priority))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(value: Any) -> int:
    return int(value) if _is_count(value) else 0


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


class Handling:
    """An agent's handling times: each command's, capability's (and bid's) own by (kind,
    name), and the agent's over all of them. A task endpoint is timed by its runs (its
    acceptance's ETA), not by the handler that accepts it."""

    def __init__(self) -> None:
        self.agent = Ewma()
        self._endpoints: dict[tuple[str, str], Ewma] = {}

    def record(self, kind: str, name: str, elapsed_ns: int) -> None:
        """Adds one run of endpoint ``name`` of ``kind`` (``command``, ``capability``,
        ``bid``) that took ``elapsed_ns``, to its average and the agent's."""
        # The endpoint's average found here once it exists (a call per message saved).
        ewma = self._endpoints.get((kind, name)) or self.endpoint(kind, name)
        ewma.record(elapsed_ns)
        self.agent.record(elapsed_ns)

    def endpoint(self, kind: str, name: str) -> Ewma:
        """The average of endpoint ``name`` of ``kind`` (empty until it ran)."""
        ewma = self._endpoints.get((kind, name))
        if ewma is None:
            ewma = self._endpoints[(kind, name)] = Ewma()
        return ewma

    def ms(self, kind: str, name: str) -> int | None:
        """The average of endpoint ``name`` of ``kind`` in ms, once it ran."""
        ewma = self._endpoints.get((kind, name))
        return None if ewma is None else ewma.ms


__all__ = ["PRIORITIES", "U64_MAX", "Ewma", "estimate_eta_ms", "eta_at", "waiting_at_or_above"]
