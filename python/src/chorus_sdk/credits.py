"""Settlement with credits (docs/PROTOCOL.md section 7.15): a negotiation awarded at a price is
recorded once in the bus's ledger, the key-value bucket ``<root>_credits``, under its round
(``round.<uuid>``, the entry as JSON): who paid (the requester), who earned (the winner), for
which customer, how much. The requester writes it as it settles the round, with a create that
fails when the round is there already, so a settlement recorded twice counts once. The Rust SDK
writes and reads the same entries (``chorus_sdk::credits``, ``chorus credits``)."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError

from ._buckets import ensure_bucket

#: The ledger bucket's name under the root (``<root>_credits``).
CREDITS_BUCKET = "credits"


@dataclass(frozen=True)
class LedgerEntry:
    """One settled round in the ledger."""

    round: uuid.UUID
    capability: str
    #: Who pays: the requester.
    payer: str
    #: Who earns: the winner.
    payee: str
    price: float
    task: uuid.UUID
    #: When it was settled (ms since the Unix epoch).
    settled_ms: int
    #: The customer the work was for, if the round named one.
    customer: str | None = None

    def to_json(self) -> bytes:
        """The entry as the Rust SDK writes it."""
        value: dict[str, Any] = {
            "round": str(self.round),
            "capability": self.capability,
            "payer": self.payer,
            "payee": self.payee,
        }
        if self.customer is not None:
            value["customer"] = self.customer
        value.update({"price": float(self.price), "task": str(self.task), "settled_ms": self.settled_ms})
        return json.dumps(value, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> LedgerEntry:
        """An entry from its JSON; raises :class:`ValueError` when it is not one."""
        try:
            v = json.loads(raw)
            customer = v.get("customer")
            return cls(
                round=uuid.UUID(v["round"]),
                capability=str(v["capability"]),
                payer=str(v["payer"]),
                payee=str(v["payee"]),
                price=float(v["price"]),
                task=uuid.UUID(v["task"]),
                settled_ms=int(v["settled_ms"]),
                customer=None if customer is None else str(customer),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a ledger entry: {e}") from e


@dataclass
class Balance:
    """One line of the balances: what an agent earned and spent (or what was spent for a
    customer), over how many settled rounds."""

    name: str
    earned: float = 0.0
    spent: float = 0.0
    rounds: int = 0


def _key(round: uuid.UUID) -> str:
    return f"round.{round}"


class Ledger:
    """The bus's credits ledger (:meth:`chorus_sdk.Agent.ledger`)."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, js: Any, bucket: str) -> Ledger:
        """The ledger in bucket ``bucket``, made as the Rust SDK makes it if it is not there."""
        return cls(await ensure_bucket(js, bucket, 0, "Chorus credits: negotiations settled at a price, by round"))

    async def record(self, entry: LedgerEntry) -> LedgerEntry | None:
        """Records ``entry`` unless its round is there already: returns None when it is new,
        else the entry there (unchanged). Raises :class:`ValueError` for a price that is
        negative or not a number."""
        if not math.isfinite(entry.price) or entry.price < 0:
            raise ValueError(f"price {entry.price}: a settlement's price is a number, 0 or more")
        try:
            await self._kv.create(_key(entry.round), entry.to_json())
            return None
        except KeyWrongLastSequenceError:
            there = await self.entry(entry.round)
            if there is None:
                raise
            return there

    async def entry(self, round: uuid.UUID) -> LedgerEntry | None:
        """The entry of ``round``, if it was settled."""
        try:
            found = await self._kv.get(_key(round))
        except KeyNotFoundError:
            return None
        return LedgerEntry.from_json(found.value) if found.value else None

    async def entries(self) -> list[LedgerEntry]:
        """Every entry, oldest first."""
        out = []
        try:
            keys = await self._kv.keys()
        except NoKeysError:
            return []
        for key in keys:
            if key.startswith("round."):
                found = await self.entry(uuid.UUID(key[len("round."):]))
                if found is not None:
                    out.append(found)
        return sorted(out, key=lambda e: (e.settled_ms, e.round))


def balances(entries: list[LedgerEntry], by: str = "agent") -> list[Balance]:
    """The balances of ``entries`` by ``"agent"`` (earned as a winner, spent as a requester)
    or ``"customer"`` (spent for each; rounds without one under ``-``), by name."""
    if by not in ("agent", "customer"):
        raise ValueError(f"balances by {by!r}: agent or customer")
    lines: dict[str, Balance] = {}

    def line(name: str) -> Balance:
        return lines.setdefault(name, Balance(name))

    for e in entries:
        if by == "agent":
            payer, payee = line(e.payer), line(e.payee)
            payer.spent += e.price
            payer.rounds += 1
            payee.earned += e.price
            payee.rounds += 1
        else:
            customer = line(e.customer or "-")
            customer.spent += e.price
            customer.rounds += 1
    return [lines[name] for name in sorted(lines)]


__all__ = ["CREDITS_BUCKET", "Balance", "Ledger", "LedgerEntry", "balances"]
