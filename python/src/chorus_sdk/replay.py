"""A person's replay of a signed dead letter (docs/PROTOCOL.md 7.5, "Replaying a signed dead
letter"), as the Rust SDK reads it.

A replay republishes the original bytes unchanged, the original sender's signature kept as
provenance, with the replayer's own signature in headers beside them: ``Chorus-Replay-Of``
(the dead letter, ``<stream>:<sequence>``), ``Chorus-Replay-By``, ``Chorus-Replay-Ms`` and
``Chorus-Replay-Signature`` (``<nkey> <hex>``), over ``chorus-replay-v1``, the subject, the
original id, the dead letter, the time and the replayer's id, joined by ``\\n``. A receiver
that verifies accepts it from a replayer whose key it was given by hand
(:meth:`~chorus_sdk.signing.Verifier.trust`), once per dead letter."""

from __future__ import annotations

import binascii
import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .identity import Identity

REPLAY_OF_HEADER = "Chorus-Replay-Of"
REPLAY_BY_HEADER = "Chorus-Replay-By"
REPLAY_MS_HEADER = "Chorus-Replay-Ms"
REPLAY_SIGNATURE_HEADER = "Chorus-Replay-Signature"


@dataclass(frozen=True)
class ReplayProof:
    """A replayer's signed word that it replayed a dead letter."""

    of: str
    by: str
    at_ms: int
    key: str
    signature: bytes

    @classmethod
    def sign(cls, identity: Identity, by: str, subject: str, message_id: uuid.UUID, of: str, at_ms: int) -> ReplayProof:
        """``identity`` (id ``by``) replaying dead letter ``of``, the message ``message_id``
        published to ``subject``, at ``at_ms``."""
        signature = identity.sign_bytes(replay_bytes(subject, message_id, of, at_ms, by))
        return cls(of=of, by=by, at_ms=at_ms, key=identity.public_key, signature=signature)

    def headers(self) -> dict[str, str]:
        """The headers that carry it."""
        return {
            REPLAY_OF_HEADER: self.of,
            REPLAY_BY_HEADER: self.by,
            REPLAY_MS_HEADER: str(self.at_ms),
            REPLAY_SIGNATURE_HEADER: f"{self.key} {self.signature.hex()}",
        }

    @classmethod
    def from_headers(cls, headers: Mapping[str, str] | None) -> ReplayProof | str | None:
        """The proof in a message's headers; ``None`` when there is none, the reason when one
        is there and does not read."""
        if not headers or REPLAY_SIGNATURE_HEADER not in headers:
            return None
        key, _, value = headers[REPLAY_SIGNATURE_HEADER].partition(" ")
        if not value:
            return "Chorus-Replay-Signature is not `<key> <hex>`"
        try:
            signature = binascii.unhexlify(value.strip())
        except (binascii.Error, ValueError):
            return "Chorus-Replay-Signature's signature is not hex"
        of, by, at = headers.get(REPLAY_OF_HEADER), headers.get(REPLAY_BY_HEADER), headers.get(REPLAY_MS_HEADER)
        if of is None:
            return "a replay signature without Chorus-Replay-Of"
        if by is None:
            return "a replay signature without Chorus-Replay-By"
        if at is None or not at.isdigit():
            return "a replay signature without a Chorus-Replay-Ms in ms"
        return cls(of=of, by=by, at_ms=int(at), key=key, signature=signature)


def replay_bytes(subject: str, message_id: uuid.UUID, of: str, at_ms: int, by: str) -> bytes:
    """What a replay signature covers."""
    return f"chorus-replay-v1\n{subject}\n{message_id}\n{of}\n{at_ms}\n{by}".encode()


def replay_id(message_id: uuid.UUID, of: str) -> uuid.UUID:
    """The id a replay is remembered by: the first 16 bytes of the SHA-256 of
    ``chorus-replay-v1\\n<original id>\\n<dead letter>``."""
    return uuid.UUID(bytes=hashlib.sha256(f"chorus-replay-v1\n{message_id}\n{of}".encode()).digest()[:16])
