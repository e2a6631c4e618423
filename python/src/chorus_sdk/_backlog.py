"""The order in which messages waiting for a handler slot are served (section 7.9, "Priority"):
by priority (critical, high, normal, low), in arrival order within a priority, with a bound on
how long a lower one waits, as the Rust SDK serves them (``inbound::backlog``)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

from .envelope import Priority

T = TypeVar("T")

#: How many times in a row the message that has waited longest may be overtaken by a later one
#: of a higher priority; the next slot is then its own. Under a steady stream of higher ones,
#: lower messages still get one slot in ``MAX_OVERTAKES + 1``.
MAX_OVERTAKES = 8

# The class of each priority: 0 is served first; one from a newer version counts as normal.
_CLASS = {Priority.CRITICAL: 0, Priority.HIGH: 1, Priority.NORMAL: 2, Priority.LOW: 3}
_NORMAL = 2


class Backlog(Generic[T]):
    """A queue of waiting items, each with a priority, taken by :meth:`pop` in the order above.
    ``capacity`` bounds it (``None``: its user bounds it)."""

    def __init__(self, capacity: int | None = None) -> None:
        self._classes: tuple[deque[tuple[int, T]], ...] = tuple(deque() for _ in range(4))
        # Items held, over every class (kept as they come and go: asked once per message).
        self._length = 0
        self._arrivals = 0
        self._overtakes = 0
        self._capacity = None if capacity is None else max(1, capacity)

    def __len__(self) -> int:
        return self._length

    def push(self, priority: Priority, item: T) -> bool:
        """Adds ``item`` behind the others of its priority; ``False`` (nothing added) when the
        backlog is full."""
        if self._capacity is not None and len(self) >= self._capacity:
            return False
        self._classes[_CLASS.get(priority, _NORMAL)].append((self._arrivals, item))
        self._arrivals += 1
        self._length += 1
        return True

    def pop(self) -> T | None:
        """Takes the next item, ``None`` when there is none: the first of the most urgent
        priority, unless the item that has waited longest was overtaken ``MAX_OVERTAKES`` times
        in a row, which then goes."""
        if not self._length:
            return None
        heads = [(q[0][0], i) for i, q in enumerate(self._classes) if q]
        if not heads:
            return None
        urgent = heads[0][1]
        oldest = min(heads)[1]
        if urgent == oldest or self._overtakes >= MAX_OVERTAKES:
            self._overtakes = 0
            chosen = oldest
        else:
            self._overtakes += 1
            chosen = urgent
        self._length -= 1
        return self._classes[chosen].popleft()[1]


class Slots:
    """An agent's handler slots (``max_in_flight``): a free slot is taken at once when nothing
    waits; otherwise a message waits its turn in a :class:`Backlog`, so a freed slot goes to the
    most urgent waiting message. It counts what waits per priority (the manifest's
    ``waiting``)."""

    def __init__(self, slots: int) -> None:
        self._free = max(1, slots)
        # Each waiter with its priority class.
        self._waiting: Backlog[tuple[int, asyncio.Future[None]]] = Backlog()
        # Waiters given a slot or cancelled that are still in the backlog.
        self._stale = 0
        # Those still waiting, per class (critical, high, normal, low).
        self._counts = [0, 0, 0, 0]

    @property
    def waiting(self) -> int:
        """Messages waiting for a slot."""
        return len(self._waiting) - self._stale

    @property
    def waiting_by_class(self) -> tuple[int, int, int, int]:
        """Messages waiting for a slot, per priority: critical, high, normal (with the
        priorities this version does not know), low."""
        critical, high, normal, low = self._counts
        return critical, high, normal, low

    def try_acquire(self) -> bool:
        """Takes a free slot when one is free and nothing waits for it (what :meth:`acquire`
        does first, without a coroutine); ``False``: none taken, :meth:`acquire` waits."""
        if self._free > 0 and self._waiting._length == self._stale:
            self._free -= 1
            return True
        return False

    async def acquire(self, priority: Priority) -> None:
        """Waits for a slot, served by ``priority``; cancelled, it takes none."""
        if self.try_acquire():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cls = _CLASS.get(priority, _NORMAL)
        self._waiting.push(priority, (cls, waiter))
        self._counts[cls] += 1
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # Given a slot as it was cancelled: hand it on.
                self.release()
            else:
                # Marked done, so the release that meets it in the backlog passes it by.
                waiter.cancel()
                self._stale += 1
                self._counts[cls] -= 1
            raise

    def release(self) -> None:
        """Gives a slot back: to the next waiting message, or free."""
        if not self._waiting._length:
            # Nothing waits (the usual case): free, without a look at the backlog.
            self._free += 1
            return
        while (waiting := self._waiting.pop()) is not None:
            cls, waiter = waiting
            if waiter.done():
                self._stale -= 1
                continue
            self._counts[cls] -= 1
            waiter.set_result(None)
            return
        self._free += 1
