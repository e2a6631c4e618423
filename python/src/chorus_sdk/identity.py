"""An agent's signing identity: its ed25519 key (a user nkey), and the bytes a message's
signature covers (docs/PROTOCOL.md section 4). What receivers do with signatures is
:mod:`chorus_sdk.signing`'s; a replay's own signature is :mod:`chorus_sdk.replay`'s; both stand
on this."""

from __future__ import annotations

import hashlib
import os

import nacl.signing
import nkeys

from .envelope import Envelope, Signature

SIGNATURE_ALG = "ed25519"


def canonical_bytes(subject: str, env: Envelope) -> bytes:
    """The bytes a signature covers: ``chorus-sig-v1``, the subject, the id, ``timestamp_ms``,
    ``from`` and the hex SHA-256 of the payload, joined by ``\\n``."""
    digest = hashlib.sha256(bytes(env.payload)).hexdigest()
    return f"chorus-sig-v1\n{subject}\n{env.id}\n{env.timestamp_ms}\n{env.from_}\n{digest}".encode()


class Identity:
    """An agent's signing identity: a user nkey (seed ``SU...``, public key ``U...``)."""

    def __init__(self, seed: str) -> None:
        try:
            self._pair = nkeys.from_seed(seed.encode() if isinstance(seed, str) else seed)
            public = self._pair.public_key
        except Exception as e:  # nkeys raises several kinds for a bad seed
            raise ValueError(f"not a valid nkey seed: {e}") from e
        self.public_key: str = public.decode() if isinstance(public, bytes) else str(public)
        if not self.public_key.startswith("U"):
            raise ValueError("not a user nkey seed (it must start with SU)")
        self._seed = seed
        raw = nkeys.decode_seed(seed.encode())
        self._signer = nacl.signing.SigningKey(bytes(raw[1]))

    @classmethod
    def generate(cls) -> Identity:
        """A new random identity."""
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        return cls(seed.decode() if isinstance(seed, bytes) else seed)

    @property
    def seed(self) -> str:
        """The seed, to store securely."""
        return self._seed

    def sign_bytes(self, data: bytes) -> bytes:
        """The ed25519 signature of ``data`` (a replay's: :mod:`chorus_sdk.replay`)."""
        return bytes(self._signer.sign(data).signature)

    def sign(self, subject: str, env: Envelope) -> None:
        """Signs ``env`` as published to ``subject``."""
        value = self._signer.sign(canonical_bytes(subject, env)).signature
        env.signature = Signature(key=self.public_key, value=bytes(value))


__all__ = ["SIGNATURE_ALG", "Identity", "canonical_bytes"]
