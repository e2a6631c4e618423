"""Exactly-once handling (docs/PROTOCOL.md section 7.9): before an ``exactly_once`` message's
handler runs, its id is claimed in the key-value bucket ``<root>_idempotency``; success
replaces the claim with the reply, a failure releases it. A copy that finds the reply gets it
again without running the handler; one that finds a claim of another run is never run again
(5023 ``uncertain``)."""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import nats.errors
import nats.js.errors

from ._buckets import ensure_bucket
from ._host import Host
from .context import Reply
from .envelope import Envelope, now_ms
from .status import ChorusError, StatusCode


log = logging.getLogger("chorus_sdk")

IDEMPOTENCY_BUCKET = "idempotency"
DEFAULT_IDEMPOTENCY_TTL = 24 * 3600.0
# How long a copy waits before it is tried again when the bucket is away or the first copy
# still runs here.
RETRY_DELAY = 1.0


class RetryAfter(ChorusError):
    """A failure to retry after ``delay`` seconds, whatever the attempt (a durable copy is
    NAK'd with that delay)."""

    def __init__(self, status: int, reason: str, delay: float) -> None:
        super().__init__(status, reason)
        self.delay = delay


@dataclass
class _Local:
    running: bool
    reply: Any = None


class ExactlyOnce:
    def __init__(self, agent: Host, ttl: float = DEFAULT_IDEMPOTENCY_TTL) -> None:
        self.agent = agent
        self.ttl = ttl
        self._kv: Any = None
        self._local: dict[Any, _Local] = {}

    async def kv(self) -> Any:
        if self._kv is None:
            js = self.agent.nc.jetstream(timeout=self.agent.request_timeout)
            bucket = self.agent.subjects.bucket_name(IDEMPOTENCY_BUCKET)
            self._kv = await ensure_bucket(js, bucket, self.ttl, "Chorus exactly-once records: handled message ids")
        return self._kv

    async def run(self, env: Envelope, handler: Callable[[], Awaitable[Any]]) -> Any:
        """Runs ``handler`` at most once for ``env``'s id; returns its value (or the recorded
        reply of an earlier copy) or the error to answer with."""
        key = f"{self.agent.id}.{env.id}"
        claim = json.dumps({"state": "claimed", "instance": self.agent.instance, "claimed_ms": now_ms()}).encode()
        try:
            kv = await self.kv()
            try:
                revision = await kv.create(key, claim)
            except nats.js.errors.KeyWrongLastSequenceError:
                revision = None
            if revision is None:
                entry = await kv.get(key)
                record = json.loads(entry.value)
                local = self._local.get(env.id)
                if record.get("state") == "done":
                    self.agent.stats.duplicates += 1
                    return self._stored(record)
                if local is not None and local.running:
                    return RetryAfter(StatusCode.UNAVAILABLE, "an earlier copy is still running here", RETRY_DELAY)
                if local is not None:
                    self.agent.stats.duplicates += 1
                    return local.reply
                if record.get("instance") != self.agent.instance:
                    log.error("agent %s: exactly-once message %s claimed by a run that never finished; not run again", self.agent.id, env.id)
                    return ChorusError(
                        StatusCode.UNCERTAIN,
                        f"an earlier run (instance {record.get('instance')}) was interrupted; whether it took effect is unknown",
                    )
                # This instance's own claim that never ran here: take it over.
                revision = await kv.update(key, claim, last=entry.revision)
        except (nats.js.errors.Error, nats.errors.Error, TimeoutError, ValueError) as e:
            return RetryAfter(StatusCode.UNAVAILABLE, f"idempotency records unavailable: {e}", RETRY_DELAY)
        self._local[env.id] = _Local(running=True)
        outcome = await handler()
        if isinstance(outcome, ChorusError):
            self._local.pop(env.id, None)
            try:
                await kv.delete(key)
            except Exception as e:  # noqa: BLE001 - the claim stays: a copy is reported uncertain
                log.warning("agent %s: claim of %s not released: %s", self.agent.id, env.id, e)
            return outcome
        payload, content_type = self.agent.reply_payload(env, outcome)
        done = {
            "state": "done",
            "status": int(StatusCode.OK),
            "content_type": content_type,
            "payload": base64.b64encode(payload).decode(),
            "handled_ms": now_ms(),
        }
        self._local[env.id] = _Local(running=False, reply=Reply(payload, content_type))
        if len(self._local) > 16_384:
            self._local.pop(next(iter(self._local)))
        try:
            await kv.update(key, json.dumps(done).encode(), last=revision)
        except Exception as e:  # noqa: BLE001 - answered from memory here; elsewhere uncertain
            log.warning("agent %s: result of %s not recorded: %s", self.agent.id, env.id, e)
        return outcome

    @staticmethod
    def _stored(record: dict[str, Any]) -> Any:
        status = int(record.get("status", StatusCode.OK))
        payload = base64.b64decode(record.get("payload", ""))
        if status not in (5001, 5002, 5021):
            return ChorusError(status, "recorded failure")
        return Reply(payload, str(record.get("content_type", "application/msgpack")))
