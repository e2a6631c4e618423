"""Answers to NATS's own service discovery (``$SRV.PING``, ``$SRV.INFO``, ``$SRV.STATS``, the
micro-service JSON of ADR-32), so standard NATS tooling (``nats micro ls``) lists Python agents
as it lists Rust ones (docs/PROTOCOL.md section 2)."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

from .envelope import now_ms


@dataclass
class EndpointStats:
    """What one command or capability has handled."""

    requests: int = 0
    errors: int = 0
    last_error: str = ""
    processing_ns: int = 0

    def record(self, elapsed_ns: int, error: str | None) -> None:
        self.requests += 1
        self.processing_ns += elapsed_ns
        if error is not None:
            self.errors += 1
            self.last_error = error


def subjects(agent: str, instance: str) -> list[str]:
    """The ``$SRV`` subjects an agent answers on."""
    return ["$SRV.*", f"$SRV.*.{agent}", f"$SRV.*.{agent}.{instance}"]


def rfc3339(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def answer(
    verb: str,
    *,
    agent: str,
    instance: str,
    version: str,
    root: str,
    capabilities: list[str],
    endpoints: list[tuple[str, str, str, EndpointStats]],
    started_ms: int,
) -> bytes | None:
    """The JSON answer to ``$SRV.<verb>``, or None for a verb this does not know. ``endpoints``
    are (name, subject, queue group, stats)."""
    body: dict[str, Any] = {
        "name": agent,
        "id": instance,
        "version": version,
        "metadata": {"chorus.root": root, "chorus.capabilities": ",".join(capabilities)},
    }
    if verb == "PING":
        body["type"] = "io.nats.micro.v1.ping_response"
    elif verb == "INFO":
        body["type"] = "io.nats.micro.v1.info_response"
        body["description"] = f"Chorus agent {agent}"
        body["endpoints"] = [
            {"name": name, "subject": subject, "queue_group": group, "metadata": {}}
            for name, subject, group, _ in endpoints
        ]
    elif verb == "STATS":
        body["type"] = "io.nats.micro.v1.stats_response"
        body["started"] = rfc3339(started_ms or now_ms())
        body["endpoints"] = [
            {
                "name": name,
                "subject": subject,
                "queue_group": group,
                "num_requests": stats.requests,
                "num_errors": stats.errors,
                "last_error": stats.last_error,
                "processing_time": stats.processing_ns,
                "average_processing_time": stats.processing_ns // stats.requests if stats.requests else 0,
            }
            for name, subject, group, stats in endpoints
        ]
    else:
        return None
    return json.dumps(body, separators=(",", ":")).encode()
