"""Encoding and decoding envelopes (docs/PROTOCOL.md section 3): MessagePack with field names,
JSON, and the compact form of protocol 2.0. The encoders write exactly the bytes of the Rust SDK
(the vectors in ``tests/vectors`` check it); the decoders accept any key order and any integer,
string or binary format of the right family, and refuse what the spec calls malformed."""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from enum import Enum
from typing import Any, Callable

import msgpack

from ._wire import Writer, f32_text, to_f32
from .envelope import (
    CONTENT_TYPE_ENCRYPTED,
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_MSGPACK,
    DEFAULT_HOP_LIMIT,
    Delivery,
    Encryption,
    Envelope,
    Expect,
    Kind,
    Performative,
    Priority,
    Progress,
    Recipient,
    Seq,
    Signature,
    TaskState,
    Trace,
    Vocabulary,
    uuid7_ms,
)
from .status import StatusCode
from .subjects import Implied

__all__ = ["Encoding", "DecodeError", "encode", "decode", "sniff", "encode_payload", "decode_payload"]


class Encoding(Enum):
    """How an envelope is written."""

    MSGPACK = "msgpack"
    JSON = "json"
    COMPACT = "compact"

    @property
    def content_type(self) -> str:
        return CONTENT_TYPE_JSON if self is Encoding.JSON else CONTENT_TYPE_MSGPACK


class DecodeError(Exception):
    """Bytes that are not a usable envelope: always status 5006."""

    status = StatusCode.DATA_FORMAT

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _malformed(what: str) -> DecodeError:
    return DecodeError(f"malformed envelope: {what}")


def _unsupported(found: str) -> DecodeError:
    return DecodeError(f"unsupported protocol version {found} (this side speaks 1.0 and 2.0)")


def sniff(data: bytes) -> Encoding | None:
    """Which encoding ``data`` is in, from its first bytes (section 3.1)."""
    if not data:
        return None
    first = data[0]
    if first == 0x7B:
        return Encoding.JSON
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        header = 1 if first <= 0x8F else (3 if first == 0xDE else 5)
        if len(data) > header and data[header] == 0x00:
            return Encoding.COMPACT
        return Encoding.MSGPACK
    if first in b" \t\r\n":
        stripped = data.lstrip(b" \t\r\n")
        return Encoding.JSON if stripped[:1] == b"{" else None
    return None


# ---------------------------------------------------------------------------------------------
# Encoding


def encode(env: Envelope, encoding: Encoding = Encoding.MSGPACK, implied: Implied | None = None) -> bytes:
    """``env`` in ``encoding``. The compact form leaves out what ``implied`` (the subject it is
    published on, :meth:`Subjects.implied`) carries; the other forms write everything."""
    if encoding is Encoding.JSON:
        return _encode_json(env)
    if encoding is Encoding.COMPACT:
        return _encode_compact(env, implied or Implied())
    return _encode_named(env)


def _named_fields(env: Envelope) -> list[tuple[str, Any]]:
    """The fields the written rules keep, in the order of section 4."""
    out: list[tuple[str, Any]] = [("version", f"{env.version[0]}.{env.version[1]}"), ("id", env.id)]
    if env.correlation_id is not None:
        out.append(("correlation_id", env.correlation_id))
    if env.in_reply_to is not None:
        out.append(("in_reply_to", env.in_reply_to))
    out.append(("from", env.from_))
    if env.to:
        out.append(("to", list(env.to)))
    for name in ("topic", "capability", "name"):
        if getattr(env, name) is not None:
            out.append((name, getattr(env, name)))
    out += [("kind", env.kind), ("performative", env.performative), ("timestamp_ms", env.timestamp_ms)]
    if env.ttl_ms is not None:
        out.append(("ttl_ms", env.ttl_ms))
    if env.deadline_ms is not None:
        out.append(("deadline_ms", env.deadline_ms))
    if env.hops != 0:
        out.append(("hops", env.hops))
    if env.hop_limit != DEFAULT_HOP_LIMIT:
        out.append(("hop_limit", env.hop_limit))
    if env.priority is not Priority.NORMAL:
        out.append(("priority", env.priority))
    if env.delivery is not Delivery.AT_MOST_ONCE:
        out.append(("delivery", env.delivery))
    for name in ("seq", "expect", "progress", "status", "reason", "trace", "session_id", "customer_id"):
        if getattr(env, name) is not None:
            out.append((name, getattr(env, name)))
    if env.headers:
        out.append(("headers", env.headers))
    out.append(("content_type", env.content_type))
    if env.payload:
        out.append(("payload", bytes(env.payload)))
    for name in ("token", "signature", "encryption"):
        if getattr(env, name) is not None:
            out.append((name, getattr(env, name)))
    return out


def _sorted_headers(headers: dict[str, str]) -> list[tuple[str, str]]:
    return sorted(headers.items(), key=lambda kv: kv[0].encode("utf-8"))


def _nested(value: Any) -> list[tuple[str, Any]]:
    """A nested structure's members in the order of section 4.1, as written."""
    if isinstance(value, Seq):
        return [("epoch", value.epoch), ("n", value.n)]
    if isinstance(value, Expect):
        return [("performative", value.performative), ("timeout_ms", value.timeout_ms)]
    if isinstance(value, Progress):
        out: list[tuple[str, Any]] = [("state", value.state)]
        if value.fraction is not None:
            out.append(("fraction", _F32(value.fraction)))
        return out
    if isinstance(value, Trace):
        out = [("traceparent", value.traceparent)]
        if value.tracestate is not None:
            out.append(("tracestate", value.tracestate))
        return out
    if isinstance(value, Signature):
        return [("alg", value.alg), ("key", value.key), ("value", bytes(value.value))]
    if isinstance(value, Encryption):
        return [
            ("alg", value.alg),
            ("inner_content_type", value.inner_content_type),
            ("recipients", [_Struct([("agent", r.agent), ("key", bytes(r.key))]) for r in value.recipients]),
        ]
    raise TypeError(f"not a nested structure: {value!r}")


class _F32(float):
    """A float written as a 32-bit float."""


class _Struct:
    def __init__(self, members: list[tuple[str, Any]]) -> None:
        self.members = members


def _write_value(w: Writer, value: Any) -> None:
    if isinstance(value, Vocabulary):
        w.str(str(value.value))
    elif isinstance(value, bool):
        w.bool(value)
    elif isinstance(value, _F32):
        w.f32(float(value))
    elif isinstance(value, int):
        w.uint(int(value))
    elif isinstance(value, float):
        w.f64(value)
    elif isinstance(value, str):
        w.str(value)
    elif isinstance(value, uuid.UUID):
        w.bin(value.bytes)
    elif isinstance(value, (bytes, bytearray)):
        w.bin(bytes(value))
    elif isinstance(value, list):
        w.array(len(value))
        for item in value:
            _write_value(w, item)
    elif isinstance(value, dict):
        items = _sorted_headers(value)
        w.map(len(items))
        for k, v in items:
            w.str(k)
            w.str(v)
    elif isinstance(value, _Struct):
        _write_members(w, value.members)
    else:
        _write_members(w, _nested(value))


def _write_members(w: Writer, members: list[tuple[str, Any]]) -> None:
    w.map(len(members))
    for key, value in members:
        w.str(key)
        _write_value(w, value)


def _encode_named(env: Envelope) -> bytes:
    w = Writer()
    _write_members(w, _named_fields(env))
    return bytes(w.buf)


def _json_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _json_value(value: Any) -> str:
    if isinstance(value, Vocabulary):
        return _json_str(str(value.value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, _F32):
        return f32_text(float(value))
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return json.dumps(value)
    if isinstance(value, str):
        return _json_str(value)
    if isinstance(value, uuid.UUID):
        return _json_str(str(value))
    if isinstance(value, (bytes, bytearray)):
        return _json_str(base64.b64encode(bytes(value)).decode("ascii"))
    if isinstance(value, list):
        return "[" + ",".join(_json_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_json_str(k)}:{_json_str(v)}" for k, v in _sorted_headers(value)) + "}"
    members = value.members if isinstance(value, _Struct) else _nested(value)
    return _json_members(members)


def _json_members(members: list[tuple[str, Any]]) -> str:
    return "{" + ",".join(f"{_json_str(k)}:{_json_value(v)}" for k, v in members) + "}"


def _encode_json(env: Envelope) -> bytes:
    return _json_members(_named_fields(env)).encode("utf-8")


_CANONICAL_TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def _encode_compact(env: Envelope, implied: Implied) -> bytes:
    body = Writer()
    count = 0

    def key(k: int) -> Writer:
        nonlocal count
        count += 1
        body.uint(k)
        return body

    key(0).uint(2)
    key(1).bin(env.id.bytes)
    key(2).str(env.from_)
    key(3).uint(env.kind.code)
    key(4).uint(env.performative.code)
    if uuid7_ms(env.id) != env.timestamp_ms:
        key(5).uint(env.timestamp_ms)
    if env.correlation_id is not None and env.correlation_id != env.in_reply_to:
        key(6).bin(env.correlation_id.bytes)
    elif env.correlation_id is None and env.in_reply_to is not None:
        key(6).nil()
    if env.in_reply_to is not None:
        key(7).bin(env.in_reply_to.bytes)
    if env.to and not (len(env.to) == 1 and env.to[0] == implied.agent):
        _write_value(key(8), list(env.to))
    for k, value, same in ((9, env.topic, implied.topic), (10, env.capability, implied.capability), (11, env.name, implied.name)):
        if value is not None and value != same:
            key(k).str(value)
    if env.ttl_ms is not None:
        key(12).uint(env.ttl_ms)
    if env.deadline_ms is not None:
        key(13).uint(env.deadline_ms)
    if env.hops != 0:
        key(14).uint(env.hops)
    if env.hop_limit != DEFAULT_HOP_LIMIT:
        key(15).uint(env.hop_limit)
    if env.priority is not Priority.NORMAL:
        key(16).uint(env.priority.code)
    if env.delivery is not Delivery.AT_MOST_ONCE:
        key(17).uint(env.delivery.code)
    if env.seq is not None:
        key(18).array(2)
        body.uint(env.seq.epoch)
        body.uint(env.seq.n)
    if env.expect is not None:
        key(19).array(2)
        body.uint(env.expect.performative.code)
        body.uint(env.expect.timeout_ms)
    if env.progress is not None:
        key(20).array(1 if env.progress.fraction is None else 2)
        body.uint(env.progress.state.code)
        if env.progress.fraction is not None:
            body.f32(env.progress.fraction)
    if env.status is not None:
        key(21).uint(env.status)
    if env.reason is not None:
        key(22).str(env.reason)
    if env.trace is not None:
        tp = env.trace.traceparent
        if _CANONICAL_TRACEPARENT.fullmatch(tp):
            key(23).bin(bytes.fromhex(tp[3:35] + tp[36:52] + tp[53:55]))
        if env.trace.tracestate is not None:
            key(24).str(env.trace.tracestate)
        if not _CANONICAL_TRACEPARENT.fullmatch(tp):
            key(25).str(tp)
    if env.session_id is not None:
        key(26).str(env.session_id)
    if env.customer_id is not None:
        key(27).str(env.customer_id)
    if env.headers:
        _write_value(key(28), env.headers)
    if env.content_type != CONTENT_TYPE_MSGPACK:
        ct = env.content_type
        if ct == CONTENT_TYPE_JSON:
            key(29).uint(1)
        elif ct == CONTENT_TYPE_ENCRYPTED:
            key(29).uint(2)
        else:
            key(29).str(ct)
    if env.payload:
        key(30).bin(bytes(env.payload))
    if env.token is not None:
        key(31).str(env.token)
    if env.signature is not None:
        key(32).array(2)
        body.str(env.signature.key)
        body.bin(bytes(env.signature.value))
    if env.encryption is not None:
        enc = env.encryption
        key(33).array(3)
        body.str(enc.alg)
        body.str(enc.inner_content_type)
        body.array(len(enc.recipients))
        for r in enc.recipients:
            body.array(2)
            body.str(r.agent)
            body.bin(bytes(r.key))
    head = Writer()
    head.map(count)
    return bytes(head.buf + body.buf)


# ---------------------------------------------------------------------------------------------
# Decoding


def decode(data: bytes, implied: Implied | None = None, limit: int | None = None) -> tuple[Envelope, Encoding]:
    """The envelope in ``data`` and the encoding it came in. A compact envelope gets the
    fields it left to its subject back from ``implied``. Raises :class:`DecodeError` (5006)."""
    if limit is not None and len(data) > limit:
        raise DecodeError(f"message of {len(data)} bytes exceeds the limit of {limit} bytes")
    encoding = sniff(data)
    if encoding is None:
        raise DecodeError("not an envelope: unrecognised encoding")
    if encoding is Encoding.COMPACT:
        env = _decode_compact(data)
        if implied is not None:
            restore(env, implied)
        return env, encoding
    try:
        if encoding is Encoding.JSON:
            raw = json.loads(data, object_pairs_hook=_unique_pairs)
        else:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False, object_pairs_hook=_unique_pairs)
    except DecodeError:
        raise
    except (ValueError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as e:
        raise _malformed(str(e) or type(e).__name__) from None
    if not isinstance(raw, dict):
        raise _malformed("not a map")
    version = raw.get("version")
    try:
        env = _from_named(raw, binary=encoding is Encoding.MSGPACK)
    except DecodeError:
        if isinstance(version, str) and not version.startswith("1."):
            raise _unsupported(version) from None
        raise
    if env.version[0] != 1:
        raise _unsupported(version if isinstance(version, str) else f"{env.version[0]}.{env.version[1]}")
    return env, encoding


def restore(env: Envelope, implied: Implied) -> None:
    """Fills the fields a compact envelope left to its subject."""
    if not env.to and implied.agent is not None:
        env.to = [implied.agent]
    if env.name is None and implied.name is not None:
        env.name = implied.name
    if env.topic is None and implied.topic is not None:
        env.topic = implied.topic
    if env.capability is None and implied.capability is not None:
        env.capability = implied.capability


def _unique_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for k, v in pairs:
        if isinstance(k, (dict, list)):
            raise _malformed("a map key that is not a string or an integer")
        if k in out:
            raise _malformed(f"key {k!r} repeated")
        out[k] = v
    return out


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _uint(name: str, v: Any, bits: int = 64) -> int:
    if not _is_uint(v) or v >= 1 << bits:
        raise _malformed(f"{name} is not an unsigned {bits}-bit integer")
    return int(v)


def _str(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _malformed(f"{name} is not a string")
    return v


def _bytes(name: str, v: Any, binary: bool) -> bytes:
    if binary:
        if not isinstance(v, bytes):
            raise _malformed(f"{name} is not binary")
        return v
    if not isinstance(v, str):
        raise _malformed(f"{name} is not base64 text")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise _malformed(f"{name} is not standard base64") from None


def _uuid(name: str, v: Any, binary: bool) -> uuid.UUID:
    if binary:
        if not isinstance(v, bytes) or len(v) != 16:
            raise _malformed(f"{name} is not a 16-byte uuid")
        return uuid.UUID(bytes=v)
    if not isinstance(v, str):
        raise _malformed(f"{name} is not a uuid string")
    try:
        return uuid.UUID(v)
    except ValueError:
        raise _malformed(f"{name} is not a uuid") from None


def _float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _malformed(f"{name} is not a number")
    return to_f32(float(v))


def _vocab(cls: Any, name: str, v: Any) -> Any:
    return cls(_str(name, v))


def _map(name: str, v: Any) -> dict[Any, Any]:
    if not isinstance(v, dict):
        raise _malformed(f"{name} is not a map")
    return v


def _list(name: str, v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise _malformed(f"{name} is not an array")
    return v


def parse_version(v: Any) -> tuple[int, int]:
    if not isinstance(v, str):
        raise _malformed("version is not a string")
    parts = v.split(".")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() and p.isascii() and int(p) <= 65535 for p in parts):
        raise _malformed(f"version {v!r} is not <major>.<minor>")
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0


# Fields whose nil reads as absent (their default is none).
_NULLABLE = {
    "correlation_id", "in_reply_to", "topic", "capability", "name", "ttl_ms", "deadline_ms", "seq",
    "expect", "progress", "status", "reason", "trace", "session_id", "customer_id", "token",
    "signature", "encryption",
}


def _from_named(raw: dict[Any, Any], binary: bool) -> Envelope:
    for key in ("version", "id", "from", "kind", "performative", "timestamp_ms"):
        if raw.get(key) is None:
            raise _malformed(f"missing field `{key}`")
    for key, value in raw.items():
        if value is None and key not in _NULLABLE and isinstance(key, str) and key in _KNOWN:
            raise _malformed(f"`{key}` is null")

    def g(k: str) -> Any:
        return raw.get(k)

    env = Envelope(
        version=parse_version(raw["version"]),
        id=_uuid("id", raw["id"], binary),
        from_=_str("from", raw["from"]),
        kind=_vocab(Kind, "kind", raw["kind"]),
        performative=_vocab(Performative, "performative", raw["performative"]),
        timestamp_ms=_uint("timestamp_ms", raw["timestamp_ms"]),
    )
    if g("correlation_id") is not None:
        env.correlation_id = _uuid("correlation_id", g("correlation_id"), binary)
    if g("in_reply_to") is not None:
        env.in_reply_to = _uuid("in_reply_to", g("in_reply_to"), binary)
    if "to" in raw:
        env.to = [_str("to", t) for t in _list("to", raw["to"])]
    for name in ("topic", "capability", "name", "reason", "session_id", "customer_id", "token"):
        if g(name) is not None:
            setattr(env, name, _str(name, g(name)))
    for name in ("ttl_ms", "deadline_ms"):
        if g(name) is not None:
            setattr(env, name, _uint(name, g(name)))
    if "hops" in raw:
        env.hops = _uint("hops", raw["hops"], 8)
    if "hop_limit" in raw:
        env.hop_limit = _uint("hop_limit", raw["hop_limit"], 8)
    if "priority" in raw:
        env.priority = _vocab(Priority, "priority", raw["priority"])
    if "delivery" in raw:
        env.delivery = _vocab(Delivery, "delivery", raw["delivery"])
    if g("seq") is not None:
        s = _map("seq", g("seq"))
        env.seq = Seq(epoch=_uint("seq.epoch", s.get("epoch"), 32), n=_uint("seq.n", s.get("n")))
    if g("expect") is not None:
        e = _map("expect", g("expect"))
        env.expect = Expect(
            performative=_vocab(Performative, "expect.performative", e.get("performative")),
            timeout_ms=_uint("expect.timeout_ms", e.get("timeout_ms")),
        )
    if g("progress") is not None:
        p = _map("progress", g("progress"))
        fraction = p.get("fraction")
        env.progress = Progress(
            state=_vocab(TaskState, "progress.state", p.get("state")),
            fraction=None if fraction is None else _float("progress.fraction", fraction),
        )
    if g("status") is not None:
        env.status = _uint("status", g("status"), 16)
    if g("trace") is not None:
        t = _map("trace", g("trace"))
        ts = t.get("tracestate")
        env.trace = Trace(
            traceparent=_str("trace.traceparent", t.get("traceparent")),
            tracestate=None if ts is None else _str("trace.tracestate", ts),
        )
    if "headers" in raw:
        env.headers = {_str("headers", k): _str("headers", v) for k, v in _map("headers", raw["headers"]).items()}
    if "content_type" in raw:
        env.content_type = _str("content_type", raw["content_type"])
    if "payload" in raw:
        env.payload = _bytes("payload", raw["payload"], binary)
    if g("signature") is not None:
        s = _map("signature", g("signature"))
        env.signature = Signature(
            alg=_str("signature.alg", s.get("alg")),
            key=_str("signature.key", s.get("key")),
            value=_bytes("signature.value", s.get("value"), binary),
        )
    if g("encryption") is not None:
        e = _map("encryption", g("encryption"))
        env.encryption = Encryption(
            alg=_str("encryption.alg", e.get("alg")),
            inner_content_type=_str("encryption.inner_content_type", e.get("inner_content_type")),
            recipients=[
                Recipient(
                    agent=_str("recipient.agent", _map("recipient", r).get("agent")),
                    key=_bytes("recipient.key", _map("recipient", r).get("key"), binary),
                )
                for r in _list("encryption.recipients", e.get("recipients"))
            ],
        )
    return env


_KNOWN = {
    "version", "id", "correlation_id", "in_reply_to", "from", "to", "topic", "capability", "name",
    "kind", "performative", "timestamp_ms", "ttl_ms", "deadline_ms", "hops", "hop_limit", "priority",
    "delivery", "seq", "expect", "progress", "status", "reason", "trace", "session_id",
    "customer_id", "headers", "content_type", "payload", "token", "signature", "encryption",
}


def _decode_compact(data: bytes) -> Envelope:
    def bad(what: str) -> DecodeError:
        return _malformed(f"compact envelope: {what}")

    try:
        pairs: list[tuple[Any, Any]] = msgpack.unpackb(
            data, raw=False, strict_map_key=False, object_pairs_hook=lambda p: p
        )
    except (ValueError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as e:
        raise bad(str(e) or type(e).__name__) from None
    if not isinstance(pairs, list) or not pairs:
        raise bad("not a map")
    fields: dict[int, Any] = {}
    for i, (key, value) in enumerate(pairs):
        if not _is_uint(key):
            raise bad("a key that is not a small unsigned integer")
        if i == 0 and key != 0:
            raise bad("the first key is not 0 (the version)")
        if key in fields:
            raise bad(f"key {key} repeated")
        fields[key] = value
    major = fields[0]
    if not _is_uint(major):
        raise bad("key 0 does not read")
    if major != 2:
        raise _unsupported(str(major))
    for required, name in ((1, "id"), (2, "from"), (3, "kind"), (4, "performative")):
        if required not in fields:
            raise bad(f"no {name} (key {required})")

    def get(key: int, read: Callable[[Any], Any]) -> Any:
        value = fields.get(key)
        try:
            return read(value)
        except DecodeError:
            raise bad(f"key {key} does not read") from None

    def code(cls: Any) -> Callable[[Any], Any]:
        return lambda v: cls.from_code(_uint("code", v))

    def uid(v: Any) -> uuid.UUID:
        return _uuid("uuid", v, True)

    def pair(v: Any, first: Callable[[Any], Any], second: Callable[[Any], Any]) -> tuple[Any, Any]:
        items = _list("pair", v)
        if len(items) != 2:
            raise _malformed("not a pair")
        return first(items[0]), second(items[1])

    env = Envelope(
        id=get(1, uid),
        from_=get(2, lambda v: _str("from", v)),
        kind=get(3, code(Kind)),
        performative=get(4, code(Performative)),
        timestamp_ms=0,
    )
    timestamp = get(5, lambda v: _uint("t", v)) if 5 in fields else None
    if 7 in fields:
        env.in_reply_to = get(7, uid)
    if 6 in fields:
        env.correlation_id = None if fields[6] is None else get(6, uid)
    else:
        env.correlation_id = env.in_reply_to
    if 8 in fields:
        env.to = get(8, lambda v: [_str("to", t) for t in _list("to", v)])
    for key, name in ((9, "topic"), (10, "capability"), (11, "name"), (22, "reason"), (26, "session_id"), (27, "customer_id"), (31, "token")):
        if key in fields:
            setattr(env, name, get(key, lambda v: _str(name, v)))
    if 12 in fields:
        env.ttl_ms = get(12, lambda v: _uint("ttl", v))
    if 13 in fields:
        env.deadline_ms = get(13, lambda v: _uint("deadline", v))
    if 14 in fields:
        env.hops = get(14, lambda v: _uint("hops", v, 8))
    if 15 in fields:
        env.hop_limit = get(15, lambda v: _uint("hop_limit", v, 8))
    if 16 in fields:
        env.priority = get(16, code(Priority))
    if 17 in fields:
        env.delivery = get(17, code(Delivery))
    if 18 in fields:
        epoch, n = get(18, lambda v: pair(v, lambda e: _uint("epoch", e, 32), lambda n: _uint("n", n)))
        env.seq = Seq(epoch, n)
    if 19 in fields:
        perf, timeout = get(19, lambda v: pair(v, code(Performative), lambda t: _uint("t", t)))
        env.expect = Expect(perf, timeout)
    if 20 in fields:

        def progress(v: Any) -> Progress:
            items = _list("progress", v)
            if len(items) not in (1, 2):
                raise _malformed("progress")
            state = TaskState.from_code(_uint("state", items[0]))
            return Progress(state, _float("fraction", items[1]) if len(items) == 2 else None)

        env.progress = get(20, progress)
    if 21 in fields:
        env.status = get(21, lambda v: _uint("status", v, 16))
    traceparent = None
    if 23 in fields:

        def binary_trace(v: Any) -> str:
            if not isinstance(v, bytes) or len(v) != 25:
                raise _malformed("traceparent")
            return f"00-{v[:16].hex()}-{v[16:24].hex()}-{v[24:].hex()}"

        traceparent = get(23, binary_trace)
    if 25 in fields:
        traceparent = get(25, lambda v: _str("traceparent", v))
    tracestate = get(24, lambda v: _str("tracestate", v)) if 24 in fields else None
    if traceparent is not None:
        env.trace = Trace(traceparent, tracestate)
    elif tracestate is not None:
        raise bad("tracestate (key 24) without a traceparent (key 23 or 25)")
    if 28 in fields:
        env.headers = get(28, lambda v: {_str("h", k): _str("h", x) for k, x in _pairs_map(v).items()})
    if 29 in fields:

        def content_type(v: Any) -> str:
            if v == 1 and _is_uint(v):
                return CONTENT_TYPE_JSON
            if v == 2 and _is_uint(v):
                return CONTENT_TYPE_ENCRYPTED
            return _str("content_type", v)

        env.content_type = get(29, content_type)
    if 30 in fields:
        env.payload = get(30, lambda v: _bytes("payload", v, True))
    if 32 in fields:
        key, value = get(32, lambda v: pair(v, lambda k: _str("key", k), lambda x: _bytes("value", x, True)))
        env.signature = Signature(key=key, value=value)
    if 33 in fields:

        def encryption(v: Any) -> Encryption:
            items = _list("encryption", v)
            if len(items) != 3:
                raise _malformed("encryption")
            recipients = [
                Recipient(*pair(r, lambda a: _str("agent", a), lambda k: _bytes("key", k, True)))
                for r in _list("recipients", items[2])
            ]
            return Encryption(_str("alg", items[0]), _str("inner", items[1]), recipients)

        env.encryption = get(33, encryption)
    if 34 in fields:
        get(34, lambda v: _uint("minor", v, 16))
    t = timestamp if timestamp is not None else uuid7_ms(env.id)
    if t is None:
        raise bad("no timestamp_ms (key 5), and the id is not a UUIDv7")
    env.timestamp_ms = t
    return env


def _pairs_map(v: Any) -> dict[Any, Any]:
    """A nested map read with the pairs hook of the compact reader."""
    if isinstance(v, list) and all(isinstance(p, tuple) and len(p) == 2 for p in v):
        return _unique_pairs(v)
    if isinstance(v, dict):
        return v
    raise _malformed("not a map")


# ---------------------------------------------------------------------------------------------
# Payloads


def encode_payload(value: Any, content_type: str = CONTENT_TYPE_MSGPACK) -> bytes:
    """A payload value in ``content_type`` (MessagePack or JSON)."""
    base = content_type.split(";")[0].strip()
    if base == CONTENT_TYPE_JSON:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if base in (CONTENT_TYPE_MSGPACK, "application/x-msgpack", "application/vnd.msgpack"):
        return bytes(msgpack.packb(value, use_bin_type=True))
    raise DecodeError(f"unsupported payload content type {content_type!r}")


def decode_payload(data: bytes, content_type: str = CONTENT_TYPE_MSGPACK) -> Any:
    """A payload's value; raises :class:`DecodeError` (5006) when it does not read."""
    base = content_type.split(";")[0].strip()
    try:
        if base == CONTENT_TYPE_JSON:
            return json.loads(data)
        if base in (CONTENT_TYPE_MSGPACK, "application/x-msgpack", "application/vnd.msgpack"):
            return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException, msgpack.ExtraData) as e:
        raise DecodeError(f"payload: {e}") from None
    raise DecodeError(f"unsupported payload content type {content_type!r}")
