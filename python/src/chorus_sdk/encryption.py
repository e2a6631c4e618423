"""End-to-end payload encryption for named recipients (docs/PROTOCOL.md section 4.2;
docs/SECURITY.md), in two schemes a receiver reads alike, both on HPKE base mode with X25519,
HKDF-SHA256 and AES-256-GCM:

- **Sessions** (:data:`SESSION_ALG`, what agents send, :func:`encrypt_in_sessions`): one HPKE
  setup per sender, recipient key and session, which seals a session secret (the header);
  then each message's content key is wrapped under the session's key with a sequence-numbered
  nonce, bound to the message's sender and id.
- **One setup per message** (:data:`ENCRYPTION_ALG`, :func:`encrypt`): the payload is sealed
  to a key pair made for the message, whose private key is sealed to each recipient's public
  key (info ``chorus-e2e-v1``, empty AAD).

The signature, when there is one, covers the ciphertext."""

from __future__ import annotations

import base64
import binascii
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, hpke, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .envelope import CONTENT_TYPE_ENCRYPTED, Encryption, Envelope, Recipient
from .status import ChorusError, StatusCode

ENCRYPTION_ALG = "hpke-x25519-hkdfsha256-aes256gcm"
INFO = b"chorus-e2e-v1"
ENC_LEN = 32

SESSION_ALG = "hpke-x25519-session-aes256gcm"
#: HPKE's ``info`` when a session's secret is sealed to the recipient.
SESSION_INFO = b"chorus-e2e-session-v1"
#: HKDF's ``info`` when a session's key and base nonce are derived.
KEYS_INFO = b"chorus-e2e-session-v1 keys"
#: A session header: HPKE's 32-byte encapsulated key, then the sealed secret (32 + 16).
HEADER_LEN = 80
#: A recipient's ``key`` in sessions: the header, the number (8 bytes), the wrapped content key.
KEY_LEN = HEADER_LEN + 8 + 48
#: Sessions a receiver keeps opened; past it the older half is forgotten.
OPENED_MAX = 4096

_SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)
_RAW = serialization.Encoding.Raw
_ZERO_NONCE = bytes(12)
_U64_MAX = 2**64 - 1


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _raw_public(key: X25519PublicKey) -> bytes:
    return key.public_bytes(_RAW, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class Rekey:
    """When a sender ends a session with a recipient and begins another: after ``messages``
    messages or ``age`` seconds, whichever comes first (and whenever the recipient's key
    changes). 100,000 messages or 10 minutes unless told."""

    messages: int = 100_000
    age: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.messages, bool) or not isinstance(self.messages, int) or not 1 <= self.messages <= _U64_MAX:
            raise ValueError(f"encryption_rekey: messages is a whole number from 1 to 2**64 - 1, not {self.messages!r}")
        if isinstance(self.age, bool) or not isinstance(self.age, (int, float)) or math.isnan(self.age) or self.age < 0:
            raise ValueError(f"encryption_rekey: age is a number of seconds, 0 or more, not {self.age!r}")


def key_material(secret: bytes, header: bytes) -> bytes:
    """The 44 bytes a session's key (the first 32) and base nonce (the last 12) are taken
    from: HKDF-SHA256 with the header as salt, the secret as input and :data:`KEYS_INFO`."""
    return HKDF(algorithm=hashes.SHA256(), length=44, salt=header, info=KEYS_INFO).derive(secret)


def _aad(sender: str, id: str) -> bytes:
    """What a wrapped content key is bound to: the sender's id, a zero byte, the message's id."""
    return sender.encode("utf-8", "surrogatepass") + b"\x00" + id.encode("utf-8", "surrogatepass")


class SessionKeys:
    """A session's key and base nonce."""

    __slots__ = ("_aead", "_nonce")

    def __init__(self, secret: bytes, header: bytes) -> None:
        okm = key_material(secret, header)
        self._aead = AESGCM(okm[:32])
        self._nonce = int.from_bytes(okm[32:], "big")

    def nonce(self, seq: int) -> bytes:
        """The nonce of message ``seq``: the base nonce, its last 8 bytes XORed with ``seq``."""
        return (self._nonce ^ seq).to_bytes(12, "big")

    def wrap(self, seq: int, sender: str, id: str, content_key: bytes) -> bytes:
        """The content key wrapped for message ``seq`` from ``sender`` with id ``id`` (48 bytes)."""
        return self._aead.encrypt(self.nonce(seq), content_key, _aad(sender, id))

    def unwrap(self, seq: int, sender: str, id: str, wrapped: bytes) -> bytes | None:
        """The content key of message ``seq``, or None when ``wrapped`` was not sealed for it."""
        try:
            key = self._aead.decrypt(self.nonce(seq), wrapped, _aad(sender, id))
        except (InvalidTag, ValueError):
            return None
        return key if len(key) == 32 else None


def seal_payload(content_key: bytes, plain: bytes) -> bytes:
    """``plain`` sealed under a content key (AES-256-GCM, a nonce of 12 zero bytes, each
    content key sealing one payload): the ciphertext, then the 16-byte tag."""
    return AESGCM(content_key).encrypt(_ZERO_NONCE, plain, None)


def open_payload(content_key: bytes, sealed: bytes) -> bytes | None:
    """The plaintext of a payload sealed by :func:`seal_payload`, or None."""
    try:
        return AESGCM(content_key).decrypt(_ZERO_NONCE, sealed, None)
    except (InvalidTag, ValueError):
        return None


class _Outgoing:
    __slots__ = ("header", "keys", "next", "began")

    def __init__(self, header: bytes, keys: SessionKeys) -> None:
        self.header = header
        self.keys = keys
        self.next = 0
        self.began = time.monotonic()


class Sessions:
    """A sender's sessions, one per recipient public key, renewed as ``rekey`` says."""

    def __init__(self, rekey: Rekey | None = None) -> None:
        self.rekey = rekey or Rekey()
        self._by_key: dict[str, _Outgoing] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_key)

    def next(self, agent: str, public: str) -> tuple[bytes, SessionKeys, int]:
        """The header, keys and number of the next message to ``agent``, whose public key is
        ``public`` (base64): from its current session, or a new one when there is none or it
        is due. Raises :class:`ChorusError` 5018 when the key is not an X25519 public key."""
        with self._lock:
            s = self._by_key.get(public)
            if s is None or s.next >= self.rekey.messages or time.monotonic() - s.began >= self.rekey.age:
                secret = os.urandom(32)
                header = bytes(_SUITE.encrypt(secret, _public_key(agent, public), info=SESSION_INFO))
                s = self._by_key[public] = _Outgoing(header, SessionKeys(secret, header))
            seq = s.next
            s.next += 1
            return s.header, s.keys, seq


class OpenedSessions:
    """A receiver's opened sessions by header, at most ``limit`` (the older half forgotten past
    it: a session still in use is opened again when next seen)."""

    def __init__(self, limit: int = OPENED_MAX) -> None:
        self.limit = max(limit, 2)
        self._by_header: dict[bytes, SessionKeys] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_header)

    def keys(self, header: bytes, open: Callable[[bytes], bytes | None]) -> SessionKeys | None:
        """The keys of the session ``header`` begins, opened with ``open`` (HPKE) the first time
        it is seen; None when it does not open to a 32-byte secret."""
        keys = self._by_header.get(header)
        if keys is not None:
            return keys
        secret = open(header)
        if secret is None or len(secret) != 32:
            return None
        keys = SessionKeys(secret, header)
        with self._lock:
            if len(self._by_header) >= self.limit:
                # Dicts keep insertion order: the first half are the oldest.
                kept = list(self._by_header.items())[len(self._by_header) // 2 + 1:]
                self._by_header = dict(kept)
            self._by_header[header] = keys
        return keys



class EncryptionKey:
    """An agent's decryption key pair (X25519). Its public half is announced in the manifest
    (``encryption_key``), so others can encrypt for it. It keeps the sessions it opened."""

    def __init__(self, private: X25519PrivateKey) -> None:
        self._private = private
        self._opened = OpenedSessions()

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

    @property
    def opened_sessions(self) -> int:
        """How many sessions this key keeps opened."""
        return len(self._opened)

    def open_header(self, header: bytes) -> bytes | None:
        """The secret a session header seals to this key, or None when it does not open."""
        return _open(header, self._private, SESSION_INFO)

    def decrypt(self, me: str, env: Envelope) -> None:
        """Opens ``env``'s payload if it is encrypted for agent ``me``, in either scheme: the
        plaintext and its content type replace the ciphertext. Raises :class:`ChorusError`
        5007 when ``me`` is not a recipient or its key or session does not open, 5006 when the
        scheme is unknown, the key malformed or the payload does not open."""
        enc = env.encryption
        if enc is None:
            return
        if enc.alg not in (ENCRYPTION_ALG, SESSION_ALG):
            raise ChorusError(StatusCode.DATA_FORMAT, "unsupported encryption scheme")
        mine = next((r for r in enc.recipients if r.agent == me), None)
        if mine is None:
            raise ChorusError(StatusCode.ACCESS, "this agent is not a recipient of the encrypted payload")
        if enc.alg == SESSION_ALG:
            plain = self._open_in_session(bytes(mine.key), env)
        else:
            plain = self._open_once(bytes(mine.key), env)
        env.payload = plain
        env.content_type = enc.inner_content_type
        env.encryption = None

    def _open_once(self, key: bytes, env: Envelope) -> bytes:
        message_key = _open(key, self._private, INFO)
        if message_key is None:
            raise ChorusError(StatusCode.ACCESS, "the message key does not open with this agent's key")
        try:
            message_sk = X25519PrivateKey.from_private_bytes(message_key)
        except ValueError as err:
            raise ChorusError(StatusCode.DATA_FORMAT, "malformed message key") from err
        plain = _open(bytes(env.payload), message_sk, INFO)
        if plain is None:
            raise ChorusError(StatusCode.DATA_FORMAT, "the payload does not decrypt")
        return plain

    def _open_in_session(self, key: bytes, env: Envelope) -> bytes:
        if len(key) != KEY_LEN:
            raise ChorusError(StatusCode.DATA_FORMAT, f"a session's recipient key is not {KEY_LEN} bytes")
        header, seq = key[:HEADER_LEN], int.from_bytes(key[HEADER_LEN:HEADER_LEN + 8], "big")
        keys = self._opened.keys(header, self.open_header)
        if keys is None:
            raise ChorusError(StatusCode.ACCESS, "the session does not open with this agent's key")
        content_key = keys.unwrap(seq, env.from_, str(env.id), key[HEADER_LEN + 8:])
        if content_key is None:
            raise ChorusError(StatusCode.ACCESS, "the message key was not sealed for this message")
        plain = open_payload(content_key, bytes(env.payload))
        if plain is None:
            raise ChorusError(StatusCode.DATA_FORMAT, "the payload does not decrypt")
        return plain


def _open(sealed: bytes, key: X25519PrivateKey, info: bytes) -> bytes | None:
    if len(sealed) < ENC_LEN:
        return None
    try:
        return bytes(_SUITE.decrypt(bytes(sealed), key, info=info))
    except (InvalidTag, ValueError):
        return None


def _public_key(agent: str, public: str) -> X25519PublicKey:
    try:
        return X25519PublicKey.from_public_bytes(base64.b64decode(public, validate=True))
    except (binascii.Error, ValueError) as e:
        raise ChorusError(StatusCode.INVALID_ARGUMENT, f"{agent}'s key: {e}") from e


def _seal(env: Envelope, alg: str, payload: bytes, recipients: list[Recipient]) -> None:
    env.encryption = Encryption(alg, env.content_type, recipients)
    env.content_type = CONTENT_TYPE_ENCRYPTED
    env.payload = payload


def encrypt(env: Envelope, recipients: list[tuple[str, str]]) -> None:
    """Encrypts ``env``'s payload for ``recipients`` (agent id and base64 public key each),
    with one HPKE setup per message and recipient (:data:`ENCRYPTION_ALG`). Agents send in
    sessions (:func:`encrypt_in_sessions`), one AES-GCM seal per message and recipient."""
    if not recipients:
        raise ChorusError(StatusCode.INVALID_ARGUMENT, "no recipients to encrypt for")
    message_sk = X25519PrivateKey.generate()
    sealed_payload = bytes(_SUITE.encrypt(bytes(env.payload), message_sk.public_key(), info=INFO))
    wrapped = [
        Recipient(agent, bytes(_SUITE.encrypt(_raw_private(message_sk), _public_key(agent, public), info=INFO)))
        for agent, public in recipients
    ]
    _seal(env, ENCRYPTION_ALG, sealed_payload, wrapped)


def encrypt_in_sessions(env: Envelope, recipients: list[tuple[str, str]], sessions: Sessions) -> None:
    """Encrypts ``env``'s payload for ``recipients`` (agent id and base64 public key each) in
    sessions (:data:`SESSION_ALG`), each recipient's taken from ``sessions``."""
    if not recipients:
        raise ChorusError(StatusCode.INVALID_ARGUMENT, "no recipients to encrypt for")
    content_key = os.urandom(32)
    id = str(env.id)
    wrapped = []
    for agent, public in recipients:
        header, keys, seq = sessions.next(agent, public)
        key = header + seq.to_bytes(8, "big") + keys.wrap(seq, env.from_, id, content_key)
        wrapped.append(Recipient(agent, key))
    _seal(env, SESSION_ALG, seal_payload(content_key, bytes(env.payload)), wrapped)
