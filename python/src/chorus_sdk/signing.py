"""Signed envelopes (docs/PROTOCOL.md section 4, notes; docs/SECURITY.md): an agent signs what
it sends with its ed25519 identity, an nkey user key; a receiver checks the signature against
the key registered for the claimed sender, and refuses stale timestamps and repeated ids."""

from __future__ import annotations

import base64
import binascii
import json
import threading
import uuid

import nacl.exceptions
import nacl.signing
import nkeys

from .envelope import Envelope, now_ms
from .identity import SIGNATURE_ALG, canonical_bytes
from .replay import ReplayProof, replay_bytes, replay_id
from .status import ChorusError, StatusCode

DEFAULT_TOLERANCE_MS = 120_000


def _public_key_bytes(public_key: str) -> bytes | None:
    """The 32-byte ed25519 key of a user nkey public key, or None when it is not one (its
    prefix, length and checksum are checked)."""
    try:
        raw = base64.b32decode(public_key.encode("ascii"))
    except (binascii.Error, ValueError, UnicodeEncodeError):
        return None
    if len(raw) != 35 or raw[0] != nkeys.PREFIX_BYTE_USER:
        return None
    if nkeys.crc16(bytearray(raw[:-2])) != int.from_bytes(raw[-2:], "little"):
        return None
    return bytes(raw[1:33])


def _quoted(text: str) -> str:
    """``text`` in double quotes, escaped, as the Rust SDK writes it in a reason (``{:?}``)."""
    return json.dumps(text, ensure_ascii=False)


class Verifier:
    """Checks signatures against registered keys and remembers recent ids to refuse replays.

    The keys are those given to :meth:`trust` and, for an agent built with this verifier,
    those the registry announces (each agent's manifest carries its ``public_key``): the agent
    follows the registry bucket as the Rust SDK does (:meth:`learn`), an agent that leaves the
    registry being forgotten. A key given by hand stays: the registry neither replaces nor
    removes it, and its holder may replay dead letters here (:meth:`verify_replay`)."""

    def __init__(self, require_signed: bool = False, tolerance_ms: int = DEFAULT_TOLERANCE_MS) -> None:
        self.require_signed = require_signed
        self.tolerance_ms = tolerance_ms
        self._keys: dict[str, tuple[str, nacl.signing.VerifyKey]] = {}
        # Each id seen: until when it is remembered, and the stream sequence of the stored copy
        # it came from, if it came from one.
        self._seen: dict[uuid.UUID, tuple[int, int | None]] = {}
        self._next_prune = 0
        self._lock = threading.Lock()
        # The agents whose keys were given by hand.
        self._pinned: set[str] = set()

    def trust(self, agent: str, public_key: str) -> None:
        """Trusts ``agent``'s public key (``U...``), given by hand: the registry does not change
        it, and ``agent`` may replay dead letters here."""
        self._set(agent, public_key)
        self._pinned.add(agent)

    def learn(self, agent: str, public_key: str) -> None:
        """A key the registry announces for ``agent``; one given by hand stays."""
        if agent not in self._pinned:
            self._set(agent, public_key)

    def _set(self, agent: str, public_key: str) -> None:
        raw = _public_key_bytes(public_key)
        if raw is None:
            raise ValueError(f"{public_key!r} is not a user nkey public key")
        self._keys[agent] = (public_key, nacl.signing.VerifyKey(raw))

    def forget(self, agent: str) -> None:
        """Forgets ``agent``'s key (its messages are then refused with 5004 until one is
        registered again)."""
        self._pinned.discard(agent)
        self._keys.pop(agent, None)

    def unlearn(self, agent: str) -> None:
        """``agent`` left the registry: its key is forgotten unless it was given by hand."""
        if agent not in self._pinned:
            self._keys.pop(agent, None)

    def key_of(self, agent: str) -> str | None:
        """The key registered for ``agent``: given to :meth:`trust`, or learned from the
        registry by an agent this verifier serves."""
        entry = self._keys.get(agent)
        return entry[0] if entry else None

    def verify_replay(self, subject: str, env: Envelope, proof: ReplayProof, now: int | None = None, stored: int | None = None) -> uuid.UUID:
        """Checks a replay of a dead letter (:mod:`chorus_sdk.replay`): the replayer trusted by
        hand, its signature and time, the original's signature (its age not counted); returns the
        id the replay is remembered by. Raises :class:`ChorusError` with 5004, 5014 or 5015."""
        now = now_ms() if now is None else now
        entry = self._keys.get(proof.by) if proof.by in self._pinned else None
        if entry is None:
            raise ChorusError(StatusCode.IDENTITY, f"replays are accepted only from senders trusted here, not {_quoted(proof.by)}")
        if entry[0] != proof.key:
            raise ChorusError(StatusCode.IDENTITY, f"the replay is signed with a key that is not {_quoted(proof.by)}'s")
        self._within_tolerance(proof.at_ms, now, "the replay's time")
        try:
            entry[1].verify(replay_bytes(subject, env.id, proof.of, proof.at_ms, proof.by), proof.signature)
        except (nacl.exceptions.BadSignatureError, ValueError, TypeError) as err:
            raise ChorusError(StatusCode.IDENTITY, "the replay signature does not verify") from err
        self._check_signature(subject, env, env.timestamp_ms)
        seen_id = replay_id(env.id, proof.of)
        with self._lock:
            seen = self._seen.get(seen_id)
            if seen is not None:
                if stored is not None and seen[1] == stored:
                    return seen_id
                raise ChorusError(StatusCode.REPLAY, f"dead letter {proof.of} was replayed here already")
            self._seen[seen_id] = (proof.at_ms + self.tolerance_ms + 1, stored)
        return seen_id

    def _within_tolerance(self, at_ms: int, now: int, what: str) -> None:
        """Raises 5015 when ``at_ms`` is further than the tolerance from ``now``."""
        drift = abs(at_ms - now)
        if drift > self.tolerance_ms:
            raise ChorusError(
                StatusCode.REPLAY,
                f"{what} is {drift} ms from this receiver's clock, beyond the tolerance of {self.tolerance_ms} ms",
            )

    def _check_signature(self, subject: str, env: Envelope, now: int) -> bool:
        """Everything but the seen ids: ``False`` for an unsigned envelope this verifier lets
        through."""
        sig = env.signature
        if sig is None:
            if self.require_signed:
                raise ChorusError(StatusCode.UNAUTHORIZED, "unsigned messages are refused here")
            return False
        if sig.alg != SIGNATURE_ALG:
            raise ChorusError(StatusCode.UNAUTHORIZED, f"unsupported signature algorithm {_quoted(sig.alg)}")
        entry = self._keys.get(env.from_)
        if entry is None:
            raise ChorusError(StatusCode.IDENTITY, f"no key is registered for {_quoted(env.from_)}")
        if entry[0] != sig.key:
            raise ChorusError(StatusCode.IDENTITY, f"signed with a key that is not {_quoted(env.from_)}'s")
        self._within_tolerance(env.timestamp_ms, now, "timestamp")
        try:
            entry[1].verify(canonical_bytes(subject, env), bytes(sig.value))
        except (nacl.exceptions.BadSignatureError, ValueError, TypeError) as err:
            raise ChorusError(StatusCode.IDENTITY, "the signature does not verify") from err
        return True

    def verify(self, subject: str, env: Envelope, now: int | None = None, stored: int | None = None) -> bool:
        """Raises :class:`ChorusError` with 5014, 5004 or 5015 when ``env`` must be refused;
        returns whether its signature proved its sender (``False``: unsigned, and allowed).
        ``stored`` is the stream sequence of the stored copy a durable delivery came from: the
        same copy delivered again (a redelivery) is not a replay; the same id from anywhere
        else is."""
        now = now_ms() if now is None else now
        if not self._check_signature(subject, env, now):
            return False
        with self._lock:
            if now >= self._next_prune:
                self._seen = {k: v for k, v in self._seen.items() if v[0] > now}
                self._next_prune = now + max(self.tolerance_ms, 1000)
            seen = self._seen.get(env.id)
            if seen is not None:
                if stored is not None and seen[1] == stored:
                    return True
                raise ChorusError(StatusCode.REPLAY, "this message id was seen before")
            self._seen[env.id] = (env.timestamp_ms + self.tolerance_ms + 1, stored)
        return True
