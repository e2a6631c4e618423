"""Large payloads (docs/PROTOCOL.md section 7.11), as the Rust SDK carries them.

Above one size a payload is compressed with zstd when its reader's manifest says it reads zstd;
above a larger one (by default the server's ``max_payload`` less room for the envelope) it
travels by reference: it is stored in parts in the bus's payload bucket (the key-value bucket
``<root>_payloads``) under the writer's own name, ``<writer>.<message id>``, and the message
carries an :class:`ObjectRef` with its size and SHA-256 digest instead. Each part carries the
message's expiry as its TTL, so the server removes it then (the bucket's own age limit removes
those of messages that never expire). An agent's credentials let it write under its own id
only: no agent replaces or removes another's payload.

On the way out a payload is compressed (never an encrypted one, nor an event's: its readers
are not known), then stored by reference, then signed: the signature covers the reference and
so the digest of what it points to. On the way in the signature is checked, the object fetched
and checked against the reference, then the payload is decrypted and decompressed. Both
directions are transparent to handlers and callers. Every refusal is a :class:`ChorusError`
with the code and reason the Rust SDK answers with: 5006 for a payload over the limit, a
reference that does not read, an object that is gone or does not match, an unknown encoding or
a frame that does not decompress within the limit; 5019 when the payload bucket cannot be read
(a durable delivery is then tried again after 2 s)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import nats.errors
import nats.js.errors
import zstandard

from ._buckets import ensure_bucket
from .codec import DecodeError, decode_payload, encode_payload
from .envelope import CONTENT_TYPE_MSGPACK, CONTENT_TYPE_OBJECT, Envelope, now_ms
from .exactly_once import RetryAfter
from .status import ChorusError, StatusCode

if TYPE_CHECKING:
    from ._host import Host

#: The one content encoding Chorus writes.
ZSTD = "zstd"
#: Suffix of the payload bucket's name (``<root>_payloads``, a key-value bucket).
PAYLOAD_BUCKET = "payloads"
#: Payloads at least this large are compressed for readers that read zstd, by default.
DEFAULT_COMPRESS_ABOVE = 64 * 1024
#: The largest payload an agent sends or takes by reference, by default.
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
#: Room left for the envelope and headers under the server's ``max_payload``.
INLINE_HEADROOM = 64 * 1024
#: How long an object is kept for a message that does not expire (seconds), and the bucket's
#: age limit.
DEFAULT_PAYLOAD_RETENTION = 7 * 24 * 3600.0
#: How long an object outlives its message's expiry by default (seconds).
PAYLOAD_GRACE = 60.0

#: zstd's default level: fast on both sides.
_LEVEL = 3
#: Payloads this small always travel inline, unless the limits say less.
_ALWAYS_INLINE = 16 * 1024
#: Payloads at least this large are compressed, decompressed and hashed off the event loop.
_BLOCKING_ABOVE = 1024 * 1024
#: How long what is known of a reader is used before it is asked again (seconds).
_READER_TTL = 10.0
#: Most readers remembered; past this the memory starts again.
_MAX_READERS = 4096
#: The longest the lookup of a reader's manifest may take before the payload goes plain.
_READER_LOOKUP_TIMEOUT = 1.0
#: How long a durable delivery whose payload could not be fetched waits before it is tried again.
_FETCH_RETRY_DELAY = 2.0
#: The registry bucket's suffix (the coordinator's record of every live agent).
_REGISTRY_BUCKET = "registry"
_BUCKET_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class PayloadLimits:
    """An agent's limits for large payloads (the agent option ``payload_limits``), with the
    Rust SDK's defaults: ``PayloadLimits(max_bytes=1 << 20, accept_compressed=False)``.

    - ``compress_above``: compress payloads at least this large for readers that read zstd
      (``None``: never);
    - ``inline_max``: send payloads larger than this by reference (``None``: the server's
      ``max_payload`` less 64 KiB);
    - ``max_bytes``: the largest payload sent or taken (larger is refused with 5006);
    - ``accept_compressed``: say in the manifest that this agent reads zstd, so that senders
      compress for it;
    - ``keep_after_expiry``: seconds an object outlives the expiry of the message that carries it.

    Raises ``ValueError`` for a negative or zero size, or a negative time."""

    compress_above: int | None = DEFAULT_COMPRESS_ABOVE
    inline_max: int | None = None
    max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    accept_compressed: bool = True
    keep_after_expiry: float = PAYLOAD_GRACE

    def __post_init__(self) -> None:
        if self.compress_above is not None and self.compress_above < 0:
            raise ValueError("compress_above must be 0 or more (None: never compress)")
        if self.inline_max is not None and self.inline_max < 1:
            raise ValueError("inline_max must be 1 or more (None: the server's max_payload less 64 KiB)")
        if self.max_bytes < 1:
            raise ValueError("max_bytes must be 1 or more")
        if self.keep_after_expiry < 0:
            raise ValueError("keep_after_expiry must be 0 or more seconds")

    def inline_max_for(self, server_max: int) -> int:
        """The size above which a payload goes by reference on a server whose ``max_payload``
        is ``server_max``."""
        if self.inline_max is not None:
            return self.inline_max
        return max(server_max - INLINE_HEADROOM, 1024)

    @staticmethod
    def chunk_for(server_max: int) -> int:
        """The parts a payload is stored in on a server whose ``max_payload`` is
        ``server_max``: half of it, between 16 KiB and 1 MiB."""
        return min(max(server_max // 2, 16 * 1024), 1024 * 1024)


@dataclass(frozen=True)
class ObjectRef:
    """What a message carried by reference holds in place of its payload (content type
    ``application/chorus-object``), a MessagePack map."""

    #: The payload bucket (``<root>_payloads``).
    bucket: str
    #: The payload's name in it, ``<writer>.<message id>``: its parts are the keys ``<name>.<n>``.
    name: str
    #: The payload's size in bytes.
    size: int
    #: The payload's SHA-256 digest, lowercase hex.
    sha256: str
    #: The payload's own content type.
    content_type: str
    #: When the object may be removed, ms since the epoch.
    expires_ms: int

    def encode(self) -> bytes:
        """The reference as a message's payload (MessagePack)."""
        return encode_payload(
            {
                "bucket": self.bucket,
                "name": self.name,
                "size": self.size,
                "sha256": self.sha256,
                "content_type": self.content_type,
                "expires_ms": self.expires_ms,
            },
            CONTENT_TYPE_MSGPACK,
        )

    @classmethod
    def decode(cls, payload: bytes) -> ObjectRef:
        """Reads a reference from a message's payload; 5006 when it does not read."""
        try:
            raw = decode_payload(payload, CONTENT_TYPE_MSGPACK)
        except DecodeError as e:
            raise _refused(f"the payload reference does not read: {e.reason}") from None
        if not isinstance(raw, dict):
            raise _refused("the payload reference does not read: not a map")
        fields: dict[str, Any] = {}
        for key in ("bucket", "name", "size", "sha256", "content_type", "expires_ms"):
            value: Any = raw.get(key)
            if value is None:
                raise _refused(f"the payload reference does not read: missing field `{key}`")
            if key in ("size", "expires_ms"):
                valid = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64
            else:
                valid = isinstance(value, str)
            if not valid:
                raise _refused(f"the payload reference does not read: invalid `{key}`")
            fields[key] = value
        return cls(**fields)


def _refused(reason: str) -> ChorusError:
    return ChorusError(StatusCode.DATA_FORMAT, reason)


# ---------------------------------------------------------------------------------------------
# Compression


def compress(payload: bytes) -> bytes | None:
    """``payload`` compressed (one zstd frame that says its size), if that saves at least a
    tenth of it; ``None`` otherwise."""
    packed = zstandard.ZstdCompressor(level=_LEVEL).compress(payload)
    return packed if len(packed) <= len(payload) - len(payload) // 10 else None


def decompress(payload: bytes, limit: int) -> bytes:
    """``payload`` decompressed, never past ``limit`` bytes. A frame that says its size is
    refused before any memory is taken for it when that is over the limit; one that does not
    say is read up to the limit.

    Raises :class:`ChorusError` 5006 when ``payload`` is not a zstd frame, does not
    decompress, or would be larger than ``limit``."""
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError:
        raise _refused("the payload is not a zstd frame") from None
    if size > limit:
        raise _refused(f"the payload decompresses to {size} bytes, over the limit of {limit}")
    dctx = zstandard.ZstdDecompressor()
    try:
        if size >= 0:
            out = dctx.decompress(payload)
            if len(out) != size:
                raise _refused(f"the payload does not decompress: {len(out)} bytes, its frame says {size}")
            return out
        # The size is not said: read at most one byte past the limit.
        with dctx.stream_reader(payload, read_across_frames=True) as reader:
            parts = []
            total = 0
            while total <= limit:
                part = reader.read(min(limit + 1 - total, 1 << 20))
                if not part:
                    break
                parts.append(part)
                total += len(part)
    except zstandard.ZstdError as e:
        raise _refused(f"the payload does not decompress: {e}") from None
    if total > limit:
        raise _refused(f"the payload does not decompress within the limit of {limit} bytes")
    return b"".join(parts)


async def open_encoding(env: Envelope, limit: int) -> None:
    """Decompresses ``env``'s payload if it came with a content encoding, leaving none (a
    large one off the event loop). Raises :class:`ChorusError` 5006 for an encoding this SDK
    does not read, or a payload that does not decompress within ``limit``."""
    encoding = env.content_encoding
    if encoding is None:
        return
    if encoding != ZSTD:
        raise _refused(f'unsupported content encoding "{encoding}"')
    try:
        size = zstandard.frame_content_size(env.payload)
    except zstandard.ZstdError:
        size = 0  # not a frame: refused at once
    # A large frame, or one that does not say its size, is decompressed off the event loop.
    if size < 0 or size >= _BLOCKING_ABOVE:
        env.payload = await asyncio.to_thread(decompress, env.payload, limit)
    else:
        env.payload = decompress(env.payload, limit)
    env.content_encoding = None


# ---------------------------------------------------------------------------------------------
# The payload bucket (docs/PROTOCOL.md section 7.11): the key-value bucket `<root>_payloads`
# (stream `KV_<root>_payloads`, per-message TTLs allowed); a payload's parts are the keys
# `<writer>.<message id>.<n>` from 0, each the chunk size but the last.

#: Parts written or read at once.
_PARTS_IN_FLIGHT = 16
#: A payload's name: key tokens of letters, digits, ``-`` and ``_``.
_PAYLOAD_NAME = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def _part_subject(bucket: str, name: str, n: int) -> str:
    return f"$KV.{bucket}.{name}.{n}"


def _digest_of(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


async def _hash(payload: bytes) -> bytes:
    if len(payload) >= _BLOCKING_ABOVE:
        return await asyncio.to_thread(_digest_of, payload)
    return _digest_of(payload)


@dataclass
class _Reader:
    at: float
    reads_zstd: bool


@dataclass
class Payloads:
    """One agent's large payloads: what its readers read (asked of the registry or of
    discovery, kept for 10 s), the payloads it stores and fetches, and what it counted."""

    host: Host
    limits: PayloadLimits
    #: The live holders of a capability, as discovery answers (``capability``, ``timeout``).
    discover: Callable[[str, float], Awaitable[list[dict[str, Any]]]]
    _readers: dict[str, _Reader] = field(default_factory=dict)
    _bucket_ready: str | None = None

    def fits_inline(self, length: int) -> bool:
        """Whether a payload of ``length`` bytes travels inline, as it is."""
        limits = self.limits
        if limits.compress_above is not None and length >= limits.compress_above:
            return False
        if length <= _ALWAYS_INLINE and (limits.inline_max is None or length <= limits.inline_max):
            return True
        return length <= limits.inline_max_for(self.host.nc.max_payload)

    async def fit(self, env: Envelope) -> None:
        """Makes ``env``'s payload fit the wire for its reader (its one recipient, or its
        capability's holders): compressed when it is large and the reader reads zstd, then
        stored by reference when larger than the inline limit (kept until the message expires
        plus ``keep_after_expiry``, or seven days for one that does not). Call before signing.

        Raises :class:`ChorusError` 5006 for a payload over ``max_bytes`` (the Rust SDK's
        reason), 5005 or 5009 when the object store does not take it."""
        length = len(env.payload)
        if self.fits_inline(length):
            return
        limits = self.limits
        server_max = self.host.nc.max_payload
        if length > limits.max_bytes:
            raise _refused(f"message of {length} bytes exceeds the limit of {limits.max_bytes} bytes")
        compress_above = limits.compress_above
        if (
            compress_above is not None
            and length >= compress_above
            and env.encryption is None
            and env.content_encoding is None
            and await self.reads_zstd(env)
        ):
            if length >= _BLOCKING_ABOVE:
                packed = await asyncio.to_thread(compress, env.payload)
            else:
                packed = compress(env.payload)
            if packed is not None:
                env.payload = packed
                env.content_encoding = ZSTD
        if len(env.payload) > limits.inline_max_for(server_max):
            expires = env.expires_ms()
            if expires is not None:
                expires += int(limits.keep_after_expiry * 1000)
            await self.store(env, expires, PayloadLimits.chunk_for(server_max))
            self.host.stats.payloads_stored += 1

    async def open_reply(self, env: Envelope) -> None:
        """Puts back a reply's payload: fetched when it came by reference, decompressed when it
        came compressed. Raises :class:`ChorusError` as :meth:`fetch` and :func:`open_encoding`."""
        if env.content_type == CONTENT_TYPE_OBJECT and env.payload:
            await self.fetch(env)
        if env.content_encoding is not None:
            await self.decompress(env)

    async def decompress(self, env: Envelope) -> None:
        """Decompresses ``env``'s payload within ``max_bytes`` (see :func:`open_encoding`)."""
        await open_encoding(env, self.limits.max_bytes)
        self.host.stats.payloads_decompressed += 1

    # -- readers ---------------------------------------------------------------------------

    async def reads_zstd(self, env: Envelope) -> bool:
        """Whether ``env``'s reader reads zstd, by its manifest: its one recipient's (in the
        registry), else every live holder's of its capability (by discovery); ``False`` when it
        cannot be known in a second (an event's readers never are)."""
        if len(env.to) == 1:
            key, agent, capability = f"agent:{env.to[0]}", env.to[0], None
        elif not env.to and env.capability is not None:
            key, agent, capability = f"cap:{env.capability}", None, env.capability
        else:
            return False
        known = self._readers.get(key)
        if known is not None and time.monotonic() - known.at < _READER_TTL:
            return known.reads_zstd
        if agent is not None:
            reads = await self._registered_reads_zstd(agent)
        else:
            assert capability is not None
            try:
                holders = await self.discover(capability, _READER_LOOKUP_TIMEOUT)
            except ChorusError:
                holders = []
            reads = bool(holders) and all(_manifest_reads_zstd(h.get("manifest")) for h in holders)
        if len(self._readers) >= _MAX_READERS:
            self._readers.clear()
        self._readers[key] = _Reader(time.monotonic(), reads)
        return reads

    async def _registered_reads_zstd(self, agent: str) -> bool:
        host = self.host

        async def lookup() -> bool:
            js = host.nc.jetstream(timeout=_READER_LOOKUP_TIMEOUT)
            kv = await js.key_value(host.subjects.bucket_name(_REGISTRY_BUCKET))
            entry = await kv.get(agent)
            record = json.loads(entry.value or b"null")
            return isinstance(record, dict) and _manifest_reads_zstd(record.get("manifest"))

        try:
            return await asyncio.wait_for(lookup(), _READER_LOOKUP_TIMEOUT)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - no registry, no record, or none in time: plain
            return False

    # -- storing ---------------------------------------------------------------------------

    async def store(self, env: Envelope, expires_ms: int | None, chunk: int) -> None:
        """Stores ``env``'s payload in the payload bucket as ``<agent id>.<message id>``, in parts
        of ``chunk`` bytes kept until ``expires_ms`` (seven days from now when ``None``), and
        puts a reference to it in its place. Creates the bucket (one replica) when there is none.

        Raises :class:`ChorusError` 5005 when JetStream does not answer in time, 5009 when it
        refuses a part."""
        host = self.host
        js = host.nc.jetstream(timeout=host.request_timeout)
        bucket = host.subjects.bucket_name(PAYLOAD_BUCKET)
        now = now_ms()
        if expires_ms is None:
            expires_ms = now + int(DEFAULT_PAYLOAD_RETENTION * 1000)
        name = f"{host.id}.{env.id}"
        payload = env.payload
        try:
            await self._ensure_bucket(js, bucket)
            digest = await _hash(payload)
            await self._put(js, bucket, name, payload, expires_ms - now, chunk)
        except ChorusError:
            raise
        except asyncio.CancelledError:
            raise
        except (asyncio.TimeoutError, nats.errors.TimeoutError) as e:
            raise ChorusError(StatusCode.TIMEOUT, f"the payload {name} was not stored in time: {type(e).__name__}") from e
        except Exception as e:  # noqa: BLE001 - the server refused: the sender is told
            raise ChorusError(StatusCode.UNEXPECTED_DISCONNECT, f"the payload {name} could not be stored: {e or type(e).__name__}") from e
        reference = ObjectRef(bucket, name, len(payload), digest.hex(), env.content_type, expires_ms)
        env.payload = reference.encode()
        env.content_type = CONTENT_TYPE_OBJECT

    async def _ensure_bucket(self, js: Any, bucket: str) -> None:
        """Creates the payload bucket as the coordinator does, when there is none (never
        reshaping one that exists)."""
        if self._bucket_ready == bucket:
            return
        try:
            await ensure_bucket(js, bucket, DEFAULT_PAYLOAD_RETENTION, "Chorus: payloads carried by reference", per_key_ttl=True)
        except nats.js.errors.BadRequestError:
            pass  # made by someone else meanwhile
        self._bucket_ready = bucket

    async def _put(self, js: Any, bucket: str, name: str, payload: bytes, ttl_ms: int, chunk: int) -> None:
        """Stores ``payload`` as the parts of ``name``, each kept ``ttl_ms`` (whole seconds, at
        least one)."""
        ttl = str(max(1, -(-ttl_ms // 1000)))
        view = memoryview(payload)
        chunk = max(chunk, 1)
        parts = [bytes(view[at : at + chunk]) for at in range(0, len(payload), chunk)] or [b""]
        for first in range(0, len(parts), _PARTS_IN_FLIGHT):
            await asyncio.gather(
                *(
                    js.publish(_part_subject(bucket, name, n), part, headers={"Nats-TTL": ttl})
                    for n, part in enumerate(parts[first : first + _PARTS_IN_FLIGHT], start=first)
                )
            )

    # -- fetching --------------------------------------------------------------------------

    async def fetch(self, env: Envelope) -> None:
        """Puts back the payload ``env`` carries by reference, after checking its size against
        ``max_bytes`` and its digest against the reference's.

        Raises :class:`ChorusError` 5006 when the reference does not read, is over the limit,
        or the object is gone, too large or does not match; a 5019 to retry after 2 s
        (:class:`~chorus_sdk.exactly_once.RetryAfter`) when the object store cannot be read."""
        limit = self.limits.max_bytes
        reference = ObjectRef.decode(env.payload)
        if reference.size > limit:
            raise _refused(f"the payload is {reference.size} bytes, over this agent's limit of {limit}")
        payload = await self._get(reference, limit)
        if len(payload) != reference.size:
            raise _refused(f"the payload is {len(payload)} bytes, its reference says {reference.size}")
        if (await _hash(payload)).hex() != reference.sha256.lower():
            raise _refused("the payload's SHA-256 digest does not match its reference")
        env.payload = payload
        env.content_type = reference.content_type
        self.host.stats.payloads_fetched += 1

    async def _get(self, reference: ObjectRef, limit: int) -> bytes:
        host = self.host
        bucket, name = reference.bucket, reference.name
        if not _BUCKET_NAME.match(bucket):
            raise _refused(f"the payload's bucket cannot be opened: invalid bucket name {bucket!r}")
        if len(name) > 256 or not _PAYLOAD_NAME.match(name):
            raise _refused(f"the payload reference does not read: invalid name {json.dumps(name)}")
        stream = f"KV_{bucket}"
        js = host.nc.jetstream(timeout=host.request_timeout)

        def unavailable(e: BaseException) -> RetryAfter:
            why = str(e) or type(e).__name__
            return RetryAfter(StatusCode.UNAVAILABLE, f"the payload {name} could not be read: {why}", _FETCH_RETRY_DELAY)

        async def part(n: int) -> bytes:
            try:
                raw = await js.get_msg(stream, subject=_part_subject(bucket, name, n), direct=True)
            except nats.js.errors.NotFoundError as e:
                if getattr(e, "err_code", None) == 10059:
                    raise _refused(f"the payload's bucket cannot be opened: no bucket {bucket}") from None
                raise _refused(f"the payload {name} is gone (expired or removed)") from None
            except nats.errors.NoRespondersError as e:
                # A direct read of a stream that is not there has no one to answer it.
                try:
                    await js.stream_info(stream)
                except nats.js.errors.NotFoundError:
                    raise _refused(f"the payload's bucket cannot be opened: no bucket {bucket}") from None
                except Exception:  # noqa: BLE001 - out of reach: tried again later
                    pass
                raise unavailable(e) from e
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - out of reach: tried again later
                raise unavailable(e) from e
            headers = raw.headers or {}
            if "Nats-Marker-Reason" in headers or headers.get("KV-Operation") in ("DEL", "PURGE"):
                raise _refused(f"the payload {name} is gone (expired or removed)")
            return raw.data or b""

        size = reference.size
        first = await part(0)
        if len(first) >= size:
            return first
        if not first:
            raise _refused(f"the payload {name} is damaged: its first part is empty")
        count = -(-size // len(first))
        buf = bytearray(first)
        for start in range(1, count, _PARTS_IN_FLIGHT):
            for data in await asyncio.gather(*(part(n) for n in range(start, min(count, start + _PARTS_IN_FLIGHT)))):
                buf += data
                if len(buf) > limit:
                    raise _refused(f"the payload {name} grew over the limit of {limit} bytes")
        return bytes(buf)


def _manifest_reads_zstd(manifest: Any) -> bool:
    encodings = manifest.get("content_encodings") if isinstance(manifest, dict) else None
    return isinstance(encodings, list) and ZSTD in encodings


__all__ = [
    "DEFAULT_COMPRESS_ABOVE",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "INLINE_HEADROOM",
    "ObjectRef",
    "PAYLOAD_BUCKET",
    "PayloadLimits",
    "Payloads",
    "ZSTD",
    "compress",
    "decompress",
    "open_encoding",
]
