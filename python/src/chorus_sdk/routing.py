"""Where an agent's requests go and when it stops sending them, as the Rust SDK decides.

**Load-aware routing** (:attr:`Routing.LEAST_LOADED`): a capability call goes to the live
holder with the lowest load, as the registry last heard it plus the share of its handler slots
this agent's own calls to it are using now, instead of whichever member of the queue group the
server picks. The holders discovery returned are kept for ``refresh`` seconds; holders of equal
load take turns; when discovery fails or finds none, the call goes to the queue group.

**Circuit breakers** (:class:`BreakerPolicy`), per destination (``agent:<id>`` or
``cap:<capability>``): ``failures`` failures in a row (no reply in time, no responders, 5019,
5017, 5009/5003, 5022) open it; while open every call is refused at once with 5019
(:class:`CircuitOpen`); after ``open_for`` one call tries as a probe, and its success closes
the breaker, its failure opens it again. Any other answer, a refusal included, resets the
count: a refusal is the destination working as it should."""

from __future__ import annotations

import enum
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .status import ChorusError, StatusCode

log = logging.getLogger("chorus_sdk")

#: How long a capability's holders are used before discovery is asked again, in seconds.
DEFAULT_ROUTING_REFRESH = 1.0
#: The longest a routing lookup waits for discovery before the call goes to the queue group.
LOOKUP_TIMEOUT = 1.0
#: Failures in a row that open a breaker, and how long it stays open, by default.
DEFAULT_BREAKER_FAILURES = 5
DEFAULT_BREAKER_OPEN_FOR = 30.0

# The answers that count against a destination.
_FAILURES = frozenset(
    {
        StatusCode.TIMEOUT,
        StatusCode.NO_RESPONDERS,
        StatusCode.UNAVAILABLE,
        StatusCode.HANDLER_FAILED,
        StatusCode.UNEXPECTED_DISCONNECT,
        StatusCode.DISCONNECTED,
        StatusCode.INTERNAL,
    }
)


class Routing(enum.Enum):
    """How a capability call picks the agent that answers it."""

    #: The access point's queue group: the server picks a member at random.
    QUEUE_GROUP = "queue_group"
    #: The least-loaded live holder by the registry's view and this agent's own calls in
    #: flight; the queue group when the registry knows none.
    LEAST_LOADED = "least_loaded"


@dataclass(frozen=True)
class _Holder:
    agent: str
    load: float
    slots: int


class Router:
    """One agent's routing state: each capability's holders and its own calls in flight."""

    def __init__(self, refresh: float = DEFAULT_ROUTING_REFRESH) -> None:
        self.refresh = refresh
        self._views: dict[str, tuple[float, list[_Holder]]] = {}
        self._in_flight: dict[str, int] = {}
        self._turn = itertools.count()

    def cached(self, capability: str) -> bool:
        """Whether a fresh view of ``capability``'s holders is kept."""
        view = self._views.get(capability)
        return view is not None and time.monotonic() - view[0] < self.refresh

    def learn(self, capability: str, records: Iterable[dict[str, Any]]) -> None:
        """Keeps what discovery returned (``[{"manifest": ...}]``; nothing when it failed: the
        queue group serves until the next refresh)."""
        holders = []
        for record in records:
            manifest = record.get("manifest") if isinstance(record, dict) else None
            if not isinstance(manifest, dict) or manifest.get("availability") == "away":
                continue
            agent = manifest.get("agent")
            if not isinstance(agent, str):
                continue
            load = manifest.get("load", 0.0)
            slots = manifest.get("slots") or 1
            holders.append(
                _Holder(
                    agent,
                    min(max(float(load), 0.0), 1.0) if isinstance(load, (int, float)) else 0.0,
                    max(int(slots), 1) if isinstance(slots, int) else 1,
                )
            )
        # In a stable order, so holders of equal load keep taking turns across refreshes.
        holders.sort(key=lambda h: h.agent)
        self._views[capability] = (time.monotonic(), holders)

    def forget(self, capability: str) -> None:
        """Drops what is known of ``capability`` (its chosen holder was not there)."""
        self._views.pop(capability, None)

    def choose(self, capability: str) -> str | None:
        """The holder to call now, counted in flight until :meth:`done`; ``None`` when none
        is known (the queue group serves)."""
        view = self._views.get(capability)
        if view is None or not view[1]:
            return None

        def score(h: _Holder) -> float:
            return h.load + self._in_flight.get(h.agent, 0) / h.slots

        scores = [(score(h), h) for h in view[1]]
        best = min(s for s, _ in scores)
        tied = [h for s, h in scores if s <= best + 1e-6]
        chosen = tied[next(self._turn) % len(tied)].agent
        self._in_flight[chosen] = self._in_flight.get(chosen, 0) + 1
        return chosen

    def done(self, agent: str) -> None:
        """A call to ``agent`` chosen by :meth:`choose` has ended."""
        n = self._in_flight.get(agent, 0) - 1
        if n > 0:
            self._in_flight[agent] = n
        else:
            self._in_flight.pop(agent, None)


@dataclass(frozen=True)
class BreakerPolicy:
    """When an agent's breakers open and for how long (the Rust SDK's ``BreakerPolicy``)."""

    failures: int = DEFAULT_BREAKER_FAILURES
    open_for: float = DEFAULT_BREAKER_OPEN_FOR

    def __post_init__(self) -> None:
        if self.failures < 1 or self.open_for < 0:
            raise ValueError("a breaker needs failures >= 1 and open_for >= 0")


class CircuitState(enum.IntEnum):
    """A breaker's state; the value is the ``chorus_agent_circuit_state`` gauge's."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitOpen(ChorusError):
    """A call refused at once, without being sent (5019): its destination's breaker is open."""

    def __init__(self, destination: str, retry_in: float) -> None:
        super().__init__(
            StatusCode.UNAVAILABLE,
            f"circuit open for {destination}: calls to it are refused for another {retry_in:.3f}s",
        )
        self.destination = destination
        self.retry_in = retry_in


def counts_as_failure(status: int) -> bool:
    """Whether an answer with ``status`` counts against its destination."""
    return status in _FAILURES


class Breakers:
    """An agent's breakers, one per destination that has failed. ``on_change(destination,
    state, opened)`` is called on every state change (metrics, the next heartbeat)."""

    def __init__(self, agent: str, policy: BreakerPolicy | None) -> None:
        self.agent = agent
        self.policy = policy
        # destination -> ("closed", failures) | ("open", until) | ("half_open", 0)
        self._circuits: dict[str, tuple[str, float]] = {}
        self.on_change: list[Callable[[str, CircuitState], None]] = []

    def admit(self, destination: str) -> bool:
        """Lets a call to ``destination`` through (``True``: report it with :meth:`finish`),
        or raises :class:`CircuitOpen` while its breaker is open. ``False``: no breakers."""
        if self.policy is None:
            return False
        state = self._circuits.get(destination)
        if state is None or state[0] == "closed":
            return True
        if state[0] == "half_open":
            raise CircuitOpen(destination, 0.0)
        now = time.monotonic()
        if now < state[1]:
            raise CircuitOpen(destination, state[1] - now)
        self._circuits[destination] = ("half_open", 0)
        self._moved(destination, CircuitState.HALF_OPEN)
        return True

    def state(self, destination: str) -> CircuitState:
        """How ``destination``'s breaker stands."""
        state = self._circuits.get(destination)
        if state is None or state[0] == "closed":
            return CircuitState.CLOSED
        return CircuitState.OPEN if state[0] == "open" else CircuitState.HALF_OPEN

    def open(self) -> list[str]:
        """The destinations whose breakers are open or half-open, sorted."""
        return sorted(d for d, s in self._circuits.items() if s[0] != "closed")

    def finish(self, destination: str, status: int) -> None:
        """How a call let through ended: its reply's status, or the error's."""
        policy = self.policy
        if policy is None:
            return
        failed = counts_as_failure(status)
        kind, value = self._circuits.get(destination, ("closed", 0))
        if kind == "closed":
            if not failed:
                self._circuits.pop(destination, None)
                return
            failures = int(value) + 1
            if failures < policy.failures:
                self._circuits[destination] = ("closed", failures)
                return
        elif kind == "half_open":
            if not failed:
                del self._circuits[destination]
                self._moved(destination, CircuitState.CLOSED)
                return
        else:
            # Answered after another call opened it: the open state stands.
            return
        self._circuits[destination] = ("open", time.monotonic() + policy.open_for)
        self._moved(destination, CircuitState.OPEN)

    def abandon(self, destination: str) -> None:
        """A probe given up before its answer (cancelled): the next call may try."""
        state = self._circuits.get(destination)
        if state is not None and state[0] == "half_open":
            self._circuits[destination] = ("open", time.monotonic())

    def _moved(self, destination: str, to: CircuitState) -> None:
        if to is CircuitState.OPEN:
            log.warning("agent %s: circuit opened for %s: calls to it are refused for %.1f s", self.agent, destination, self.policy.open_for if self.policy else 0.0)
        elif to is CircuitState.CLOSED:
            log.info("agent %s: circuit closed for %s", self.agent, destination)
        for hook in self.on_change:
            hook(destination, to)
