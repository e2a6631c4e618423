"""Dead letters as the Rust SDK writes them (docs/PROTOCOL.md section 7.5): the original
message as the body of a message on ``<root>.dlq.<reason>.<agent>`` in the dead-letter stream,
with ``Chorus-Dlq-*`` headers saying why, when and after how many attempts; ``Nats-Msg-Id``
makes a second write of the same letter a no-op."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .envelope import now_ms
from .subjects import validate_token

if TYPE_CHECKING:
    from nats.aio.client import Client

    from .subjects import Subjects

MAX_DETAIL_BYTES = 512


@dataclass
class DeadLetter:
    """A message that failed for good, with why."""

    reason: str
    status: int
    detail: str
    agent: str
    subject: str
    envelope: bytes
    attempts: int
    stored_ms: int
    message_id: uuid.UUID | None = None
    #: ``(stream, sequence)`` of a stored message; ``None`` for a request.
    source: tuple[str, int] | None = None
    #: The original's own headers (``Nats-*`` ones are not kept).
    headers: dict[str, str] = field(default_factory=dict)
    dead_lettered_ms: int = field(default_factory=now_ms)

    def dedupe_id(self) -> str:
        if self.source is not None:
            return f"dlq:{self.source[0]}:{self.source[1]}"
        return f"dlq:{self.message_id or ''}:{self.agent}"

    def to_headers(self, omitted: int | None = None) -> dict[str, str]:
        headers = {k: v for k, v in self.headers.items() if not k.lower().startswith("nats-")}
        headers.update(
            {
                "Chorus-Dlq-Reason": self.reason,
                "Chorus-Dlq-Status": str(self.status),
                "Chorus-Dlq-Detail": _header_value(self.detail, MAX_DETAIL_BYTES),
                "Chorus-Dlq-Agent": _header_value(self.agent, MAX_DETAIL_BYTES),
                "Chorus-Dlq-Subject": _header_value(self.subject, 1024),
                "Chorus-Dlq-Attempts": str(self.attempts),
                "Chorus-Dlq-Stored-Ms": str(self.stored_ms),
                "Chorus-Dlq-Dead-Lettered-Ms": str(self.dead_lettered_ms),
            }
        )
        if self.message_id is not None:
            headers["Chorus-Dlq-Message-Id"] = str(self.message_id)
        if self.source is not None:
            headers["Chorus-Dlq-Source"] = f"{self.source[0]}:{self.source[1]}"
        if omitted is not None:
            headers["Chorus-Dlq-Omitted"] = str(omitted)
        headers["Nats-Msg-Id"] = self.dedupe_id()
        return headers


def _header_value(text: str, limit: int) -> str:
    """``text`` on one line, cut to ``limit`` bytes at a character boundary."""
    one_line = " ".join(text.splitlines())
    return one_line.encode()[:limit].decode("utf-8", "ignore")


async def write_dead_letter(nc: Client, subjects: Subjects, letter: DeadLetter, timeout: float) -> None:
    """Stores ``letter`` in the dead-letter stream; a letter too large for the server keeps its
    headers and says how large the original was (``Chorus-Dlq-Omitted``). Raises what the
    server's JetStream raises when it is not stored."""
    try:
        agent = validate_token("agent id", letter.agent)
    except ValueError:
        agent = "unknown"
    headers = letter.to_headers()
    body = letter.envelope
    if len(body) + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 64 > nc.max_payload:
        headers = letter.to_headers(omitted=len(body))
        body = b""
    js = nc.jetstream(timeout=timeout)
    await js.publish(f"{subjects.root}.dlq.{letter.reason}.{agent}", body, headers=headers)
