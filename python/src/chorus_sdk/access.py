"""The application's own access rules, as the Rust SDK applies them: permissions a handler
requires of its senders (refused with 5007), a per-sender rate limit (a token bucket, 5013),
and replay protection that survives a restart (verified message ids kept in a key-value
bucket, 5015).

Grants name the sender by its ``from`` field, so they apply only to a message whose signature
verified against that sender's key, unless the agent explicitly trusts unverified senders."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from .status import ChorusError, StatusCode

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

    from ._host import Host
    from .envelope import Envelope

# The key-value bucket of verified ids (``<root>_seen``), as the Rust SDK names it.
SEEN_BUCKET = "seen"
# The most senders a rate limit keeps a bucket for; the quietest are forgotten beyond it.
MAX_RATE_BUCKETS = 65_536


@dataclass(frozen=True)
class RateLimit:
    """A per-sender limit on requests and commands: a bucket of ``burst`` tokens refilled at
    ``per_second`` (the Rust SDK's ``RateLimit``)."""

    per_second: float
    burst: float

    def __post_init__(self) -> None:
        if not (self.per_second > 0 and self.burst >= 1):
            raise ValueError("a rate limit needs per_second > 0 and burst >= 1")


class Access:
    """One agent's grants and rate limit."""

    def __init__(
        self,
        grants: dict[str, Iterable[str]] | None = None,
        rate_limit: RateLimit | None = None,
        trust_unverified: bool = False,
    ) -> None:
        self._grants: dict[str, set[str]] = {}
        for agent, permissions in (grants or {}).items():
            self.grant(agent, permissions)
        self.rate_limit = rate_limit
        self.trust_unverified = trust_unverified
        self._buckets: dict[str, tuple[float, float]] = {}

    def grant(self, agent: str, permissions: Iterable[str]) -> None:
        """Grants ``agent`` more permissions."""
        if isinstance(permissions, str):
            raise TypeError("permissions are a list of strings, not one string")
        self._grants.setdefault(agent, set()).update(permissions)

    def check(self, sender: str, verified: bool, name: str, required: Iterable[str], now: float | None = None) -> ChorusError | None:
        """The refusal of a message from ``sender`` to endpoint ``name``: 5007 when it lacks a
        permission in ``required`` (or its grants are not proven), 5013 past its rate; ``None``
        lets it through (taking one token)."""
        required = list(required)
        if required:
            held = self._grants.get(sender)
            if not verified and not self.trust_unverified and held is not None:
                return ChorusError(
                    StatusCode.ACCESS,
                    f"{sender} is not verified (the message is unsigned, or this agent does not verify "
                    f"signatures), so its grants do not apply to {name}",
                )
            missing = [p for p in required if held is None or p not in held]
            if missing:
                return ChorusError(StatusCode.ACCESS, f"{sender} lacks permission {', '.join(missing)} for {name}")
        return self.take_token(sender, time.monotonic() if now is None else now)

    def take_token(self, sender: str, now: float) -> ChorusError | None:
        """One token of ``sender``'s bucket at time ``now`` (seconds), or the 5013 refusal."""
        limit = self.rate_limit
        if limit is None:
            return None
        tokens, last = self._buckets.pop(sender, (limit.burst, now))
        tokens = min(tokens + max(now - last, 0.0) * limit.per_second, limit.burst)
        if len(self._buckets) >= MAX_RATE_BUCKETS:
            # The bucket least recently used: a sender that returns starts full again.
            self._buckets.pop(next(iter(self._buckets)))
        if tokens < 1.0:
            self._buckets[sender] = (tokens, now)
            return ChorusError(StatusCode.RATE_LIMITED, f"{sender} exceeds {_number(limit.per_second)} requests a second")
        self._buckets[sender] = (tokens - 1.0, now)
        return None


def _number(value: float) -> str:
    """``value`` as Rust's ``{}`` prints an f64 (``2``, ``0.5``)."""
    return str(int(value)) if value == int(value) else repr(value)


class SeenIds:
    """Replay protection across restarts: the id of every verified command and request the
    agent accepts is written to the bucket ``<root>_seen`` (key ``<agent>.<id>``), whose
    entries expire after the signature tolerance. A copy recorded before is refused with 5015;
    when the bucket cannot be written the message is refused with 5019 (failing closed; a
    durable delivery retries)."""

    def __init__(self, agent: Host, tolerance_ms: int) -> None:
        self.agent = agent
        self.window = max(tolerance_ms / 1000.0, 1.0)
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            from ._buckets import ensure_bucket

            js = self.agent.nc.jetstream(timeout=self.agent.request_timeout)
            name = self.agent.subjects.bucket_name(SEEN_BUCKET)
            self._kv = await ensure_bucket(js, name, self.window, "Chorus replay protection: verified message ids")
        return self._kv

    async def record(self, env: Envelope, stored: int | None = None, seen_id: uuid.UUID | None = None) -> ChorusError | None:
        """Records ``seen_id`` (``env``'s id unless given: a replay's,
        :func:`~chorus_sdk.replay.replay_id`), with the stream sequence of the stored copy it came from
        (``stored``) for a durable delivery: ``None`` the first time or for a redelivery of
        that same copy, else the refusal."""
        from nats.js.errors import KeyWrongLastSequenceError

        from ._state import log

        key = f"{self.agent.id}.{env.id if seen_id is None else seen_id}"
        value = b"" if stored is None else str(stored).encode()
        try:
            kv = await self._bucket()
            await kv.create(key, value)
        except KeyWrongLastSequenceError:
            if stored is not None:
                try:
                    entry = await kv.get(key)
                except Exception as e:  # noqa: BLE001 - failing closed: refused, retried
                    log.warning("agent %s: seen-id record unavailable: %s", self.agent.id, e)
                    return ChorusError(StatusCode.UNAVAILABLE, "replay protection store unavailable")
                if entry.value == value:
                    return None
            log.warning("agent %s: replay refused: id %s from %s already seen", self.agent.id, env.id, env.from_)
            return ChorusError(StatusCode.REPLAY, f"message {env.id} was already received")
        except Exception as e:  # noqa: BLE001 - failing closed: refused, retried if durable
            log.warning("agent %s: seen-id record unavailable: %s", self.agent.id, e)
            return ChorusError(StatusCode.UNAVAILABLE, "replay protection store unavailable")
        return None
