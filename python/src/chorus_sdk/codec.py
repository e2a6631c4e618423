"""Encoding and decoding envelopes (docs/PROTOCOL.md section 3): MessagePack with field names,
JSON, and the compact form of protocol 2.0. The encoders write exactly the bytes of the Rust SDK
(the vectors in ``tests/vectors`` check it); the decoders accept any key order and any integer,
string or binary format of the right family, and refuse what the spec calls malformed."""

from __future__ import annotations

import base64
import dataclasses
import binascii
import importlib
import json
import os
import re
import struct
import uuid
from enum import Enum
from typing import Any, Callable, TypeVar

import msgpack

from ._wire import Writer, f32_text, put_bin, put_str, put_uint, to_f32
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
    uuid_from_bytes,
    uuid_from_int,
)
from .status import StatusCode
from .subjects import NOTHING_IMPLIED, Implied

__all__ = ["encode_struct", "F32", "Struct", "Encoding", "DecodeError", "encode", "decode", "sniff", "encode_payload", "decode_payload"]


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
        # The named form's keys are strings; a map keyed by an integer is the compact form
        # (malformed unless that first key is 0).
        if len(data) > header and (data[header] <= 0x7F or 0xCC <= data[header] <= 0xD3 or data[header] >= 0xE0):
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
        return _encode_compact(env, implied or NOTHING_IMPLIED)
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
    if env.content_encoding is not None:
        out.append(("content_encoding", env.content_encoding))
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


def encode_struct(members: list[tuple[str, Any]]) -> bytes:
    """A MessagePack map of ``members`` in their order, written as the envelope's own
    structures are (the manifest uses it): nested ``Struct``s, ``F32`` floats, lists, plain
    values."""
    w = Writer()
    _write_members(w, members)
    return bytes(w.buf)


class _F32(float):
    """A float written as a 32-bit float."""


class _Struct:
    def __init__(self, members: list[tuple[str, Any]]) -> None:
        self.members = members


class _Json:
    """Any JSON value (a JSON Schema, say), written as MessagePack as it is: maps with their
    keys, negative numbers, null."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _write_json(w: Writer, value: Any) -> None:
    if value is None:
        w.nil()
    elif isinstance(value, bool):
        w.bool(value)
    elif isinstance(value, int):
        if value >= 0:
            w.uint(value)
        else:
            w.buf += b"\xd3" + struct.pack(">q", value)
    elif isinstance(value, float):
        w.f64(value)
    elif isinstance(value, str):
        w.str(value)
    elif isinstance(value, list):
        w.array(len(value))
        for item in value:
            _write_json(w, item)
    elif isinstance(value, dict):
        w.map(len(value))
        for k, v in value.items():
            w.str(str(k))
            _write_json(w, v)
    else:
        raise TypeError(f"not a JSON value: {type(value).__name__}")


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
    elif isinstance(value, _Json):
        _write_json(w, value.value)
    else:
        _write_members(w, _nested(value))


def _write_members(w: Writer, members: list[tuple[str, Any]]) -> None:
    w.map(len(members))
    for key, value in members:
        w.str(key)
        _write_value(w, value)


def _k(name: str) -> bytes:
    """A field name as the MessagePack string it is written as."""
    w = Writer()
    w.str(name)
    return bytes(w.buf)


_K = {name: _k(name) for name in (
    "version", "id", "correlation_id", "in_reply_to", "from", "to", "topic", "capability", "name",
    "kind", "performative", "timestamp_ms", "ttl_ms", "deadline_ms", "hops", "hop_limit",
    "priority", "delivery", "seq", "expect", "progress", "status", "reason", "trace",
    "session_id", "customer_id", "headers", "content_type", "content_encoding", "payload", "token",
    "signature", "encryption", "epoch", "n", "timeout_ms", "state", "fraction", "traceparent", "tracestate",
)}
_UUID_BIN = b"\xc4\x10"


def _encode_named(env: Envelope) -> bytes:
    """The named MessagePack form, fields in the order of section 4 (as `_named_fields`)."""
    k = _K
    b = bytearray(k["version"])
    put_str(b, f"{env.version[0]}.{env.version[1]}")
    b += k["id"] + _UUID_BIN + env.id.bytes
    count = 2
    if env.correlation_id is not None:
        b += k["correlation_id"] + _UUID_BIN + env.correlation_id.bytes
        count += 1
    if env.in_reply_to is not None:
        b += k["in_reply_to"] + _UUID_BIN + env.in_reply_to.bytes
        count += 1
    b += k["from"]
    put_str(b, env.from_)
    count += 1
    if env.to:
        b += k["to"]
        n = len(env.to)
        b += bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
        for t in env.to:
            put_str(b, t)
        count += 1
    for name, value in (("topic", env.topic), ("capability", env.capability), ("name", env.name)):
        if value is not None:
            b += k[name]
            put_str(b, value)
            count += 1
    b += k["kind"]
    put_str(b, env.kind.value)
    b += k["performative"]
    put_str(b, env.performative.value)
    b += k["timestamp_ms"]
    put_uint(b, env.timestamp_ms)
    count += 3
    for name, number in (("ttl_ms", env.ttl_ms), ("deadline_ms", env.deadline_ms)):
        if number is not None:
            b += k[name]
            put_uint(b, number)
            count += 1
    if env.hops != 0:
        b += k["hops"]
        put_uint(b, env.hops)
        count += 1
    if env.hop_limit != DEFAULT_HOP_LIMIT:
        b += k["hop_limit"]
        put_uint(b, env.hop_limit)
        count += 1
    if env.priority is not Priority.NORMAL:
        b += k["priority"]
        put_str(b, env.priority.value)
        count += 1
    if env.delivery is not Delivery.AT_MOST_ONCE:
        b += k["delivery"]
        put_str(b, env.delivery.value)
        count += 1
    if env.seq is not None:
        b += k["seq"] + b"\x82" + k["epoch"]
        put_uint(b, env.seq.epoch)
        b += k["n"]
        put_uint(b, env.seq.n)
        count += 1
    if env.expect is not None:
        b += k["expect"] + b"\x82" + k["performative"]
        put_str(b, env.expect.performative.value)
        b += k["timeout_ms"]
        put_uint(b, env.expect.timeout_ms)
        count += 1
    if env.progress is not None:
        fraction = env.progress.fraction
        b += k["progress"] + (b"\x81" if fraction is None else b"\x82") + k["state"]
        put_str(b, env.progress.state.value)
        if fraction is not None:
            b += k["fraction"] + b"\xca" + struct.pack(">f", fraction)
        count += 1
    if env.status is not None:
        b += k["status"]
        put_uint(b, int(env.status))
        count += 1
    if env.reason is not None:
        b += k["reason"]
        put_str(b, env.reason)
        count += 1
    if env.trace is not None:
        state = env.trace.tracestate
        b += k["trace"] + (b"\x81" if state is None else b"\x82") + k["traceparent"]
        put_str(b, env.trace.traceparent)
        if state is not None:
            b += k["tracestate"]
            put_str(b, state)
        count += 1
    for name, value in (("session_id", env.session_id), ("customer_id", env.customer_id)):
        if value is not None:
            b += k[name]
            put_str(b, value)
            count += 1
    rest = Writer()
    if env.headers:
        rest.buf += k["headers"]
        _write_value(rest, env.headers)
        count += 1
    b += rest.buf
    b += k["content_type"]
    put_str(b, env.content_type)
    count += 1
    if env.content_encoding is not None:
        b += k["content_encoding"]
        put_str(b, env.content_encoding)
        count += 1
    if env.payload:
        b += k["payload"]
        put_bin(b, bytes(env.payload))
        count += 1
    tail = [(name, getattr(env, name)) for name in ("token", "signature", "encryption") if getattr(env, name) is not None]
    if tail:
        w = Writer()
        for name, value in tail:
            w.str(name)
            _write_value(w, value)
        b += w.buf
        count += len(tail)
    head = bytes((0x80 | count,)) if count < 16 else b"\xde" + count.to_bytes(2, "big")
    return head + bytes(b)


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


def _field(head: bytes, code: int) -> bytes:
    """``head`` (a compact key, below 128: one byte, and an array header if any) and a code
    after it, as ``put_uint`` writes it."""
    b = bytearray(head)
    put_uint(b, code)
    return bytes(b)


# What every envelope writes of its vocabularies, written once per member: its kind (key 3),
# its performative (key 4), and an expected reply's performative (key 19, the first of two).
# A table per vocabulary: members of two vocabularies with the same name compare equal.
_KIND_FIELDS = {m: _field(b"\x03", m.code) for m in Kind}
_PERFORMATIVE_FIELDS = {m: _field(b"\x04", m.code) for m in Performative}
_EXPECT_HEADS = {m: _field(b"\x13\x92", m.code) for m in Performative}


def _encode_compact(env: Envelope, implied: Implied) -> bytes:
    if _fast_encode is not None:
        data = _fast_encode(env, implied)
        if data is not None:
            return data
    return _encode_compact_py(env, implied)


def _encode_compact_py(env: Envelope, implied: Implied) -> bytes:
    # The definition of the compact form's writing (the compiled codec writes the same).
    # The body after key 0; the map's header is put in front once the count is known. Every
    # key is below 128: one byte.
    b = bytearray(b"\x01\xc4\x10")
    b += env.id.bytes
    b.append(2)
    put_str(b, env.from_)
    # Keys 3 and 4 written whole, looked up by member (no code lookup nor writer call).
    b += _KIND_FIELDS[env.kind]
    b += _PERFORMATIVE_FIELDS[env.performative]
    count = 4
    if uuid7_ms(env.id) != env.timestamp_ms:
        b.append(5)
        put_uint(b, env.timestamp_ms)
        count += 1
    cid, irt = env.correlation_id, env.in_reply_to
    if cid is not None and cid != irt:
        b += b"\x06\xc4\x10"
        b += cid.bytes
        count += 1
    elif cid is None and irt is not None:
        b += b"\x06\xc0"
        count += 1
    if irt is not None:
        b += b"\x07\xc4\x10"
        b += irt.bytes
        count += 1
    to = env.to
    if to and not (len(to) == 1 and to[0] == implied.agent):
        b.append(8)
        n = len(to)
        if n < 16:
            b.append(0x90 | n)
        else:
            b += b"\xdc" + n.to_bytes(2, "big")
        for t in to:
            put_str(b, t)
        count += 1
    if env.topic is not None and env.topic != implied.topic:
        b.append(9)
        put_str(b, env.topic)
        count += 1
    if env.capability is not None and env.capability != implied.capability:
        b.append(10)
        put_str(b, env.capability)
        count += 1
    if env.name is not None and env.name != implied.name:
        b.append(11)
        put_str(b, env.name)
        count += 1
    if env.ttl_ms is not None:
        b.append(12)
        put_uint(b, env.ttl_ms)
        count += 1
    if env.deadline_ms is not None:
        b.append(13)
        put_uint(b, env.deadline_ms)
        count += 1
    if env.hops != 0:
        b.append(14)
        put_uint(b, env.hops)
        count += 1
    if env.hop_limit != DEFAULT_HOP_LIMIT:
        b.append(15)
        put_uint(b, env.hop_limit)
        count += 1
    if env.priority is not Priority.NORMAL:
        b.append(16)
        put_uint(b, env.priority.code)
        count += 1
    if env.delivery is not Delivery.AT_MOST_ONCE:
        b.append(17)
        put_uint(b, env.delivery.code)
        count += 1
    if env.seq is not None:
        b += b"\x12\x92"
        put_uint(b, env.seq.epoch)
        put_uint(b, env.seq.n)
        count += 1
    if env.expect is not None:
        b += _EXPECT_HEADS[env.expect.performative]
        put_uint(b, env.expect.timeout_ms)
        count += 1
    if env.progress is not None:
        fraction = env.progress.fraction
        b += b"\x14\x91" if fraction is None else b"\x14\x92"
        put_uint(b, env.progress.state.code)
        if fraction is not None:
            b += b"\xca" + struct.pack(">f", fraction)
        count += 1
    if env.status is not None:
        b.append(21)
        put_uint(b, int(env.status))
        count += 1
    if env.reason is not None:
        b.append(22)
        put_str(b, env.reason)
        count += 1
    if env.trace is not None:
        tp = env.trace.traceparent
        canonical = _CANONICAL_TRACEPARENT.fullmatch(tp) is not None
        if canonical:
            b += b"\x17\xc4\x19"
            b += bytes.fromhex(tp[3:35] + tp[36:52] + tp[53:55])
            count += 1
        if env.trace.tracestate is not None:
            b.append(24)
            put_str(b, env.trace.tracestate)
            count += 1
        if not canonical:
            b.append(25)
            put_str(b, tp)
            count += 1
    if env.session_id is not None:
        b.append(26)
        put_str(b, env.session_id)
        count += 1
    if env.customer_id is not None:
        b.append(27)
        put_str(b, env.customer_id)
        count += 1
    if env.headers:
        w = Writer()
        _write_value(w, env.headers)
        b.append(28)
        b += w.buf
        count += 1
    ct = env.content_type
    if ct != CONTENT_TYPE_MSGPACK:
        if ct == CONTENT_TYPE_JSON:
            b += b"\x1d\x01"
        elif ct == CONTENT_TYPE_ENCRYPTED:
            b += b"\x1d\x02"
        else:
            b.append(29)
            put_str(b, ct)
        count += 1
    if env.payload:
        b.append(30)
        put_bin(b, env.payload)
        count += 1
    if env.token is not None:
        b.append(31)
        put_str(b, env.token)
        count += 1
    if env.signature is not None:
        b += b"\x20\x92"
        put_str(b, env.signature.key)
        put_bin(b, bytes(env.signature.value))
        count += 1
    if env.encryption is not None:
        enc = env.encryption
        w = Writer()
        w.array(3)
        w.str(enc.alg)
        w.str(enc.inner_content_type)
        w.array(len(enc.recipients))
        for r in enc.recipients:
            w.array(2)
            w.str(r.agent)
            w.bin(bytes(r.key))
        b.append(33)
        b += w.buf
        count += 1
    # Key 34 (the minor version) is not written in 2.0; the content encoding comes after it.
    if env.content_encoding is not None:
        b.append(35)
        put_str(b, env.content_encoding)
        count += 1
    count += 1  # key 0
    head = bytes((0x80 | count,)) if count < 16 else b"\xde" + count.to_bytes(2, "big")
    return head + b"\x00\x02" + b


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
        fast = _fast_decode(data) if _fast_decode is not None and type(data) is bytes else None
        env = _decode_compact(data) if fast is None else fast
        if implied is not None:
            restore(env, implied)
        return env, encoding
    try:
        if encoding is Encoding.JSON:
            raw = json.loads(data, object_pairs_hook=_unique_pairs)
        else:
            raw = _unpack_map(data, "")
    except DecodeError:
        raise
    except (ValueError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as e:
        raise _malformed(str(e) or type(e).__name__) from e
    if not isinstance(raw, dict):
        raise _malformed("not a map")
    version = raw.get("version")
    try:
        env = _from_named(raw, binary=encoding is Encoding.MSGPACK)
    except DecodeError as err:
        if isinstance(version, str) and not version.startswith("1."):
            raise _unsupported(version) from err
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
    except (binascii.Error, ValueError) as err:
        raise _malformed(f"{name} is not standard base64") from err


def _uuid(name: str, v: Any, binary: bool) -> uuid.UUID:
    if binary:
        if not isinstance(v, bytes) or len(v) != 16:
            raise _malformed(f"{name} is not a 16-byte uuid")
        return uuid_from_bytes(v)
    if not isinstance(v, str):
        raise _malformed(f"{name} is not a uuid string")
    try:
        return uuid.UUID(v)
    except ValueError as err:
        raise _malformed(f"{name} is not a uuid") from err


def _float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _malformed(f"{name} is not a number")
    return to_f32(float(v))


def _vocab(cls: Any, name: str, v: Any) -> Any:
    return cls.read(_str(name, v))


def _map(name: str, v: Any) -> dict[Any, Any]:
    if not isinstance(v, dict):
        raise _malformed(f"{name} is not a map")
    return v


def _list(name: str, v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise _malformed(f"{name} is not an array")
    return v


def parse_version(v: Any) -> tuple[int, int]:
    if v == "1.0":
        return (1, 0)
    if not isinstance(v, str):
        raise _malformed("version is not a string")
    parts = v.split(".")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() and p.isascii() and int(p) <= 65535 for p in parts):
        raise _malformed(f"version {v!r} is not <major>.<minor>")
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0


# Fields whose nil reads as absent (their default is none).
_NULLABLE = {
    "correlation_id", "in_reply_to", "topic", "capability", "name", "ttl_ms", "deadline_ms", "seq",
    "expect", "progress", "status", "reason", "trace", "session_id", "customer_id",
    "content_encoding", "token", "signature", "encryption",
}


def _from_named(raw: dict[Any, Any], binary: bool) -> Envelope:
    for key in ("version", "id", "from", "kind", "performative", "timestamp_ms"):
        if raw.get(key) is None:
            raise _malformed(f"missing field `{key}`")
    if None in raw.values():
        for key, value in raw.items():
            if value is None and key not in _NULLABLE and isinstance(key, str) and key in _KNOWN:
                raise _malformed(f"`{key}` is null")
    g = raw.get
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
    if g("content_encoding") is not None:
        env.content_encoding = _str("content_encoding", g("content_encoding"))
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
    "customer_id", "headers", "content_type", "content_encoding", "payload", "token", "signature",
    "encryption",
}


def _unpack_map(data: bytes, what: str) -> dict[Any, Any]:
    """A whole MessagePack map (nothing after it), its keys each once."""
    # The first key each map repeats, innermost maps first: the last is the outer map's.
    repeated: list[Any] = []

    def pairs(items: list[tuple[Any, Any]]) -> dict[Any, Any]:
        # Built at C speed; only a map that came out shorter than its pairs repeats a key,
        # and only then are they walked to name the first one repeated.
        out = dict(items)
        first = None
        if len(out) != len(items):
            seen: set[Any] = set()
            for k, _ in items:
                if k in seen:
                    first = k
                    break
                seen.add(k)
        repeated.append(first)
        return out

    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False, object_pairs_hook=pairs)
    except msgpack.ExtraData as e:
        raise _malformed(f"{what}bytes after the envelope") from e
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise _malformed(f"{what}{e or type(e).__name__}") from e
    if not isinstance(raw, dict):
        raise _malformed(f"{what}not a map")
    if repeated and repeated[-1] is not None:
        raise _malformed(f"{what}key {repeated[-1]} repeated")
    return raw


_PREFIX = "compact envelope: "
_ABSENT = object()


def _c_uint(v: Any, bits: int = 64) -> int:
    if type(v) is not int or v < 0 or v >= 1 << bits:
        raise ValueError
    return v


def _c_str(v: Any) -> str:
    if type(v) is not str:
        raise ValueError
    return v


def _c_bin(v: Any) -> bytes:
    if type(v) is not bytes:
        raise ValueError
    return v


def _c_uuid(v: Any) -> uuid.UUID:
    if type(v) is not bytes or len(v) != 16:
        raise ValueError
    return uuid_from_int(int.from_bytes(v, "big"))


def _c_pair(v: Any) -> tuple[Any, Any]:
    if type(v) is not list or len(v) != 2:
        raise ValueError
    return v[0], v[1]


def _c_float(v: Any) -> float:
    if type(v) is not float and type(v) is not int:
        raise ValueError
    return to_f32(float(v))


def _c_content_type(v: Any) -> str:
    if v == 1 and type(v) is int:
        return CONTENT_TYPE_JSON
    if v == 2 and type(v) is int:
        return CONTENT_TYPE_ENCRYPTED
    return _c_str(v)


def _c_strings(v: Any) -> list[str]:
    if type(v) is not list:
        raise ValueError
    # Checked in place (a call per string saved): the list is the unpacker's own, kept as is.
    for x in v:
        if type(x) is not str:
            raise ValueError
    return v


def _c_headers(v: Any) -> dict[str, str]:
    if type(v) is not dict:
        raise ValueError
    return {_c_str(k): _c_str(x) for k, x in v.items()}


def _c_progress(v: Any) -> Progress:
    if type(v) is not list or len(v) not in (1, 2):
        raise ValueError
    state = TaskState.from_code(_c_uint(v[0]))
    return Progress(state, _c_float(v[1]) if len(v) == 2 else None)


def _c_traceparent(v: Any) -> str:
    if type(v) is not bytes or len(v) != 25:
        raise ValueError
    return f"00-{v[:16].hex()}-{v[16:24].hex()}-{v[24:].hex()}"


def _c_encryption(v: Any) -> Encryption:
    if type(v) is not list or len(v) != 3 or type(v[2]) is not list:
        raise ValueError
    recipients = []
    for r in v[2]:
        agent, key = _c_pair(r)
        recipients.append(Recipient(_c_str(agent), _c_bin(key)))
    return Encryption(_c_str(v[0]), _c_str(v[1]), recipients)


def _s_seq(env: Envelope, v: Any) -> None:
    epoch, n = _c_pair(v)
    env.seq = Seq(_c_uint(epoch, 32), _c_uint(n))


def _s_expect(env: Envelope, v: Any) -> None:
    perf, timeout = _c_pair(v)
    # As Performative.from_code(_c_uint(perf)), by the table key 4 is read with.
    env.expect = Expect(_c_vocab(perf, _PERFORMATIVES, Performative.UNKNOWN), _c_uint(timeout))


def _s_signature(env: Envelope, v: Any) -> None:
    key, value = _c_pair(v)
    env.signature = Signature(key=_c_str(key), value=_c_bin(value))


def _s_check(read: Callable[[Any], Any]) -> Callable[[Envelope, Any], None]:
    def setter(env: Envelope, v: Any) -> None:
        read(v)

    return setter


# The compact keys (beyond 0-4) that set one attribute, read by their reader; the third is
# the type a value that reads as itself has (the reader is then not called: it would return
# it unchanged), ``None`` when every value goes through the reader.
_ATTRIBUTES: dict[int, tuple[str, Callable[[Any], Any], type | None]] = {
    7: ("in_reply_to", _c_uuid, None),
    8: ("to", _c_strings, None),
    9: ("topic", _c_str, str),
    10: ("capability", _c_str, str),
    11: ("name", _c_str, str),
    12: ("ttl_ms", _c_uint, None),
    13: ("deadline_ms", _c_uint, None),
    14: ("hops", lambda v: _c_uint(v, 8), None),
    15: ("hop_limit", lambda v: _c_uint(v, 8), None),
    16: ("priority", lambda v: Priority.from_code(_c_uint(v)), None),
    17: ("delivery", lambda v: Delivery.from_code(_c_uint(v)), None),
    20: ("progress", _c_progress, None),
    21: ("status", lambda v: _c_uint(v, 16), None),
    22: ("reason", _c_str, str),
    26: ("session_id", _c_str, str),
    27: ("customer_id", _c_str, str),
    28: ("headers", _c_headers, None),
    29: ("content_type", _c_content_type, None),
    30: ("payload", _c_bin, bytes),
    31: ("token", _c_str, str),
    35: ("content_encoding", _c_str, str),
}
# The others that set more than one, or only check; 5, 6 and 23-25 (the timestamp, the
# correlation and the trace context) are read in the loop itself.
_SETTERS: dict[int, Callable[[Envelope, Any], None]] = {
    18: _s_seq,
    19: _s_expect,
    32: _s_signature,
    33: lambda env, v: setattr(env, "encryption", _c_encryption(v)),
    34: _s_check(lambda v: _c_uint(v, 16)),
}
_KINDS = tuple(Kind.from_code(i) for i in range(1, 64) if Kind.from_code(i) is not Kind.UNKNOWN)
_PERFORMATIVES = tuple(
    Performative.from_code(i) for i in range(1, 256) if Performative.from_code(i) is not Performative.UNKNOWN
)
_U64 = 1 << 64


def _c_vocab(v: Any, members: tuple[Any, ...], unknown: Any) -> Any:
    if type(v) is not int or v < 0 or v >= _U64:
        raise ValueError
    return members[v - 1] if 1 <= v <= len(members) else unknown


def _decode_compact(data: bytes) -> Envelope:
    # The hot path of every message received: one pass over the map, the common keys read
    # inline, the rest by table.
    raw = _unpack_map(data, _PREFIX)
    if next(iter(raw), None) != 0:
        raise _malformed(_PREFIX + "the first key is not 0 (the version)")
    major = raw.get(0)
    if type(major) is not int or major < 0:
        raise _malformed(_PREFIX + "key 0 does not read")
    if major != 2:
        raise _unsupported(str(major))
    for required, name in ((1, "id"), (2, "from"), (3, "kind"), (4, "performative")):
        if required not in raw:
            raise _malformed(f"{_PREFIX}no {name} (key {required})")
    key: Any = 1
    try:
        v = raw[1]
        if type(v) is not bytes or len(v) != 16:
            raise ValueError
        id_int = int.from_bytes(v, "big")
        key = 2
        sender = raw[2]
        if type(sender) is not str:
            raise ValueError
        key = 3
        kind = _c_vocab(raw[3], _KINDS, Kind.UNKNOWN)
        key = 4
        performative = _c_vocab(raw[4], _PERFORMATIVES, Performative.UNKNOWN)
        env = Envelope(uuid_from_int(id_int), sender, kind, performative, 0)
        timestamp = None
        correlated = False
        trace_raw: list[Any] = []
        for key, v in raw.items():
            if type(key) is not int or key < 0:
                raise _malformed(_PREFIX + "a key that is not a small unsigned integer")
            if key <= 4:
                continue
            attribute = _ATTRIBUTES.get(key)
            if attribute is not None:
                attr, read, as_is = attribute
                setattr(env, attr, v if type(v) is as_is else read(v))
            elif key == 5:
                timestamp = _c_uint(v)
            elif key == 6:
                correlated = True
                env.correlation_id = None if v is None else _c_uuid(v)
            elif 23 <= key <= 25:
                trace_raw.append(key)
            else:
                setter = _SETTERS.get(key)
                if setter is not None:
                    setter(env, v)
        if not correlated:
            env.correlation_id = env.in_reply_to
        traceparent = tracestate = None
        if trace_raw:
            key = 23
            if 23 in raw:
                traceparent = _c_traceparent(raw[23])
            key = 25
            if 25 in raw:
                traceparent = _c_str(raw[25])
            key = 24
            tracestate = _c_str(raw[24]) if 24 in raw else None
    except ValueError as err:
        raise _malformed(f"{_PREFIX}key {key} does not read") from err
    if traceparent is not None:
        env.trace = Trace(traceparent, tracestate)
    elif tracestate is not None:
        raise _malformed(_PREFIX + "tracestate (key 24) without a traceparent (key 23 or 25)")
    if timestamp is None:
        # The id's time, if it is a UUIDv7.
        if (id_int >> 76) & 0xF != 7:
            raise _malformed(_PREFIX + "no timestamp_ms (key 5), and the id is not a UUIDv7")
        timestamp = id_int >> 80
    env.timestamp_ms = timestamp
    return env


# ---------------------------------------------------------------------------------------------
# Payloads


def _plain(value: Any) -> Any:
    """A dataclass or a pydantic model as the plain value it is written as."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} cannot be a payload (plain values, dataclasses or pydantic models)")


# Content types that are their own base type (nothing to parse off).
_PLAIN_TYPES = frozenset({CONTENT_TYPE_MSGPACK, CONTENT_TYPE_JSON})


def encode_payload(value: Any, content_type: str = CONTENT_TYPE_MSGPACK) -> bytes:
    """A payload value in ``content_type`` (MessagePack or JSON). Dataclasses and pydantic
    models are written as their fields."""
    # The usual content types as they are; parameters (``; charset=``) and spaces parsed off
    # the others.
    base = content_type if content_type in _PLAIN_TYPES else content_type.split(";")[0].strip()
    try:
        if base == CONTENT_TYPE_JSON:
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_plain).encode("utf-8")
        if base in (CONTENT_TYPE_MSGPACK, "application/x-msgpack", "application/vnd.msgpack"):
            return _packb(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise DecodeError(f"payload: {e}") from e
    raise DecodeError(f"unsupported payload content type {content_type!r}")


# Packers kept for reuse: ``msgpack.packb`` makes one (and its buffer) per call, several times
# the cost of packing a small payload. One is taken off this list while it packs, so no other
# thread and no nested call shares it; they have no ``default`` (no Python code runs while
# packing), a value that needs it is packed anew the full way.
_PACKERS: list[msgpack.Packer] = []


def _packb(value: Any) -> bytes:
    try:
        packer = _PACKERS.pop()
    except IndexError:
        packer = msgpack.Packer(use_bin_type=True)
    try:
        data: bytes = packer.pack(value)
    except (TypeError, ValueError, OverflowError):
        # Not a plain value (a dataclass, a model: ``_plain`` reads it), or one msgpack refuses
        # either way: the full call says which. The packer is dropped, whatever its buffer holds.
        return bytes(msgpack.packb(value, use_bin_type=True, default=_plain))
    if len(_PACKERS) < 8:
        _PACKERS.append(packer)
    return data


T = TypeVar("T")


def typed(value: Any, cls: type[T] | None) -> Any:
    """``value`` as a ``cls``: a dataclass from its fields, a pydantic model validated, or a
    plain type checked. Raises :class:`DecodeError` (5006) when it does not fit."""
    if cls is None or cls is Any:
        return value
    try:
        if dataclasses.is_dataclass(cls):
            if not isinstance(value, dict):
                raise TypeError(f"expected a map, got {type(value).__name__}")
            return cls(**value)
        validate = getattr(cls, "model_validate", None)
        if callable(validate):
            return validate(value)
        if cls is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, cls):
            return value
    except (TypeError, ValueError) as e:
        raise DecodeError(f"payload is not a {cls.__name__}: {e}") from e
    raise DecodeError(f"payload is not a {cls.__name__}: got {type(value).__name__}")


def decode_payload(data: bytes, content_type: str = CONTENT_TYPE_MSGPACK) -> Any:
    """A payload's value; raises :class:`DecodeError` (5006) when it does not read."""
    base = content_type if content_type in _PLAIN_TYPES else content_type.split(";")[0].strip()
    try:
        if base == CONTENT_TYPE_JSON:
            return json.loads(data)
        if base in (CONTENT_TYPE_MSGPACK, "application/x-msgpack", "application/vnd.msgpack"):
            return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException, msgpack.ExtraData) as e:
        # TypeError: a MessagePack map keyed by a map or an array (unhashable here);
        # RecursionError: JSON nested too deep.
        raise DecodeError(f"payload: {e}") from e
    raise DecodeError(f"unsupported payload content type {content_type!r}")


# The names `encode_struct`'s callers build with.
F32 = _F32
Struct = _Struct
Json = _Json


# ---------------------------------------------------------------------------------------------
# The compiled compact codec


def _speedups() -> tuple[Callable[[Envelope, Implied], bytes | None], Callable[[bytes], Envelope | None]] | None:
    """The compact codec compiled (the ``chorus-sdk-speedups`` wheel, ``pip install
    chorus-sdk[speedups]``), configured with this module's classes and vocabularies: its
    encoder and decoder, which write and read what the functions above do and leave the rest
    to them (returning ``None``). ``None`` when it is not installed, when ``CHORUS_SPEEDUPS=0``
    turns it off, or when this module's vocabularies are not the plain tables it expects."""
    if os.environ.get("CHORUS_SPEEDUPS", "1") == "0":
        return None
    try:
        compiled = importlib.import_module("chorus_sdk_speedups")
    except ImportError:
        return None

    def table(cls: type[Vocabulary]) -> list[tuple[Vocabulary, int]]:
        # Code 0 (unknown) first, then every code from 1 that reads as a member of its own.
        unknown = cls.from_code(0)
        out: list[tuple[Vocabulary, int]] = [(unknown, 0)]
        while (member := cls.from_code(len(out))) is not unknown:
            out.append((member, len(out)))
        if len(out) != len(cls) or any(member.code != code for member, code in out):
            raise ValueError(f"{cls.__name__} is not a plain table of codes")
        return out

    defaults: list[tuple[str, Any, bool]] = []
    for f in dataclasses.fields(Envelope):
        if f.default_factory is not dataclasses.MISSING:
            if (f.name, f.default_factory) not in (("to", list), ("headers", dict)):
                return None
            defaults.append((f.name, None, True))
        else:
            defaults.append((f.name, None if f.default is dataclasses.MISSING else f.default, False))
    try:
        kinds, performatives = table(Kind), table(Performative)
        if tuple(m for m, _ in kinds[1:]) != _KINDS or tuple(m for m, _ in performatives[1:]) != _PERFORMATIVES:
            return None
        compiled.configure(
            {
                "envelope": Envelope,
                "new_object": object.__new__,
                "uuid": uuid.UUID,
                "uuid_set_int": uuid.UUID.__dict__["int"].__set__,
                "uuid_set_safety": uuid.UUID.__dict__["is_safe"].__set__,
                "uuid_safety": uuid.SafeUUID.unknown,
                "defaults": defaults,
                "kinds": kinds,
                "performatives": performatives,
                "priorities": table(Priority),
                "deliveries": table(Delivery),
                "task_states": table(TaskState),
                "priority_normal": Priority.NORMAL,
                "at_most_once": Delivery.AT_MOST_ONCE,
                "seq": Seq,
                "expect": Expect,
                "progress": Progress,
                "trace": Trace,
                "signature": Signature,
                "encryption": Encryption,
                "recipient": Recipient,
                "msgpack": CONTENT_TYPE_MSGPACK,
                "json": CONTENT_TYPE_JSON,
                "encrypted": CONTENT_TYPE_ENCRYPTED,
                "default_hop_limit": DEFAULT_HOP_LIMIT,
            }
        )
    except ValueError:
        # A table this build cannot take, or configured already by an earlier import.
        return None
    return compiled.encode_compact, compiled.decode_compact


_compiled = _speedups()
#: Whether the compact form is written and read by the compiled codec.
SPEEDUPS = _compiled is not None
_fast_encode, _fast_decode = _compiled if _compiled is not None else (None, None)
