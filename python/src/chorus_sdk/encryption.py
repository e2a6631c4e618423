"""End-to-end payload encryption for named recipients (docs/PROTOCOL.md section 4, notes;
docs/SECURITY.md): HPKE base mode with X25519, HKDF-SHA256 and AES-256-GCM, info
``chorus-e2e-v1``, empty AAD. The payload is sealed once to a key pair made for the message;
that key pair's private key is sealed to each recipient's public key. The signature, when
there is one, covers the ciphertext."""

from __future__ import annotations

import base64
import binascii

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hpke, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from .envelope import CONTENT_TYPE_ENCRYPTED, Encryption, Envelope, Recipient
from .status import ChorusError, StatusCode

ENCRYPTION_ALG = "hpke-x25519-hkdfsha256-aes256gcm"
INFO = b"chorus-e2e-v1"
ENC_LEN = 32

_SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)
_RAW = serialization.Encoding.Raw


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _raw_public(key: X25519PublicKey) -> bytes:
    return key.public_bytes(_RAW, serialization.PublicFormat.Raw)


class EncryptionKey:
    """An agent's decryption key pair (X25519). Its public half is announced in the manifest
    (``encryption_key``), so others can encrypt for it."""

    def __init__(self, private: X25519PrivateKey) -> None:
        self._private = private

    @classmethod
    def generate(cls) -> EncryptionKey:
        return cls(X25519PrivateKey.generate())

    @classmethod
    def from_secret(cls, secret: str) -> EncryptionKey:
        """The key pair of a base64 private key (as ``secret`` gives it, and the Rust SDK's
        ``EncryptionKey::secret``)."""
        try:
            raw = base64.b64decode(secret, validate=True)
            return cls(X25519PrivateKey.from_private_bytes(raw))
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"not an X25519 private key in base64: {e}") from e

    @property
    def public_key(self) -> str:
        """The public key, base64 of 32 bytes."""
        return base64.b64encode(_raw_public(self._private.public_key())).decode()

    @property
    def secret(self) -> str:
        """The private key, base64 (store it securely)."""
        return base64.b64encode(_raw_private(self._private)).decode()

    def decrypt(self, me: str, env: Envelope) -> None:
        """Opens ``env``'s payload if it is encrypted for agent ``me``: the plaintext and its
        content type replace the ciphertext. Raises :class:`ChorusError` 5007 when ``me`` is
        not a recipient or its copy of the key does not open, 5006 when the payload does not."""
        enc = env.encryption
        if enc is None:
            return
        if enc.alg != ENCRYPTION_ALG:
            raise ChorusError(StatusCode.DATA_FORMAT, "unsupported encryption scheme")
        mine = next((r for r in enc.recipients if r.agent == me), None)
        if mine is None:
            raise ChorusError(StatusCode.ACCESS, "this agent is not a recipient of the encrypted payload")
        message_key = _open(mine.key, self._private)
        if message_key is None:
            raise ChorusError(StatusCode.ACCESS, "the message key does not open with this agent's key")
        try:
            message_sk = X25519PrivateKey.from_private_bytes(message_key)
        except ValueError as err:
            raise ChorusError(StatusCode.DATA_FORMAT, "malformed message key") from err
        plain = _open(env.payload, message_sk)
        if plain is None:
            raise ChorusError(StatusCode.DATA_FORMAT, "the payload does not decrypt")
        env.payload = plain
        env.content_type = enc.inner_content_type
        env.encryption = None


def _open(sealed: bytes, key: X25519PrivateKey) -> bytes | None:
    if len(sealed) < ENC_LEN:
        return None
    try:
        return bytes(_SUITE.decrypt(bytes(sealed), key, info=INFO))
    except (InvalidTag, ValueError):
        return None


def encrypt(env: Envelope, recipients: list[tuple[str, str]]) -> None:
    """Encrypts ``env``'s payload for ``recipients`` (agent id and base64 public key each)."""
    if not recipients:
        raise ChorusError(StatusCode.INVALID_ARGUMENT, "no recipients to encrypt for")
    message_sk = X25519PrivateKey.generate()
    sealed_payload = bytes(_SUITE.encrypt(bytes(env.payload), message_sk.public_key(), info=INFO))
    wrapped = []
    for agent, public in recipients:
        try:
            pk = X25519PublicKey.from_public_bytes(base64.b64decode(public, validate=True))
        except (binascii.Error, ValueError) as e:
            raise ChorusError(StatusCode.INVALID_ARGUMENT, f"{agent}'s key: {e}") from e
        wrapped.append(Recipient(agent, bytes(_SUITE.encrypt(_raw_private(message_sk), pk, info=INFO))))
    env.encryption = Encryption(ENCRYPTION_ALG, env.content_type, wrapped)
    env.content_type = CONTENT_TYPE_ENCRYPTED
    env.payload = sealed_payload
