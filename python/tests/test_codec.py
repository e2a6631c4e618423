"""The codec's rules without a server: what is malformed, what is read leniently, and that no
input makes it fail with anything but a DecodeError (5006). Also: the package type-checks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import msgpack
import pytest

from chorus_sdk import DecodeError, Encoding, Envelope, Kind, Performative, StatusCode, decode, encode
from chorus_sdk._wire import f32_text
from chorus_sdk.envelope import Progress, TaskState, Trace, uuid7, uuid7_ms
from chorus_sdk.subjects import Implied, SubjectError, Subjects


def sample() -> Envelope:
    env = Envelope.new(Kind.REQUEST, Performative.REQUEST, "planner")
    env.to = ["worker"]
    env.name = "plan"
    env.payload = b"\x81\xa1a\x01"
    return env


def named(**changes: object) -> bytes:
    raw = json.loads(encode(sample(), Encoding.JSON))
    for k, v in changes.items():
        if v is ...:
            raw.pop(k, None)
        else:
            raw[k] = v
    return json.dumps(raw).encode()


@pytest.mark.parametrize("encoding", list(Encoding))
def test_every_encoding_round_trips(encoding: Encoding) -> None:
    env = sample()
    env.progress = Progress(TaskState.WORKING, 0.1)
    env.trace = Trace("not-a-w3c-traceparent", "vendor=1")
    decoded, found = decode(encode(env, encoding))
    assert found is encoding
    # 0.1 travels as a 32-bit float.
    assert decoded.progress is not None and decoded.progress.fraction == pytest.approx(0.1, rel=1e-6)
    decoded.progress = env.progress
    assert decoded == env


def test_version_rules() -> None:
    assert decode(named(version="1"))[0].version == (1, 0)
    assert decode(named(version="1.7"))[0].version == (1, 7)
    for bad in ("1.0.0", "1.", 1):
        with pytest.raises(DecodeError, match="malformed envelope"):
            decode(named(version=bad))
    with pytest.raises(DecodeError, match="unsupported protocol version 3.0"):
        decode(named(version="3.0", id="not even a uuid"))
    with pytest.raises(DecodeError, match="unsupported protocol version 3"):
        decode(b"\x82\x00\x03\x01\xc0")


def test_malformed_envelopes_are_refused() -> None:
    for data in (
        b"",
        b"hello",
        b'{"version":"1.0"',
        named(id=...),
        named(kind=None),
        named(hops=-1),
        named(hops=256),
        named(timestamp_ms=1.5),
        named(to="worker"),
        named(payload="not base64!"),
        b'{"version":"1.0","version":"1.0"}',
        encode(sample()) + b"\x00",
    ):
        with pytest.raises(DecodeError) as e:
            decode(data)
        assert e.value.status == StatusCode.DATA_FORMAT


def test_unknown_values_and_fields_are_read_not_refused() -> None:
    env, _ = decode(named(performative="ponder", extra={"future": True}, priority="urgent"))
    assert env.performative is Performative.UNKNOWN
    assert env.priority.value == "unknown"
    assert decode(named(kind="telepathy"))[0].kind is Kind.UNKNOWN
    # null reads as absent where the default is none.
    assert decode(named(reason=None, ttl_ms=None))[0].reason is None


def test_compact_form_rules() -> None:
    subjects = Subjects("chorus")
    implied = subjects.implied("chorus.agent.worker.plan")
    env = sample()
    data = encode(env, Encoding.COMPACT, implied)
    pairs = msgpack.unpackb(data, strict_map_key=False, object_pairs_hook=list)
    keys = [k for k, _ in pairs]
    assert keys == sorted(keys) and keys[0] == 0
    assert 8 not in keys and 11 not in keys and 5 not in keys  # to, name, timestamp implied
    assert decode(data, implied)[0] == env
    # An unknown key (a newer minor's) is skipped; a repeated key is refused.
    more = bytes([data[0] + 1]) + data[1:] + b"\x3f\xa3new"
    assert decode(more, implied)[0] == env
    with pytest.raises(DecodeError, match="repeated"):
        decode(bytes([data[0] + 1]) + data[1:] + b"\x02\xa1x", implied)
    # A tracestate without a traceparent.
    with pytest.raises(DecodeError, match="tracestate"):
        decode(bytes([data[0] + 1]) + data[1:] + b"\x18\xa1x", implied)
    # A traceparent that is not canonical travels as text (key 25).
    env.trace = Trace("01-abc", None)
    assert b"\x19\xa601-abc" in encode(env, Encoding.COMPACT, implied)


def test_content_encoding_is_read_and_written_in_every_form() -> None:
    env = sample()
    env.content_encoding = "zstd"
    for encoding in Encoding:
        assert decode(encode(env, encoding))[0] == env
    # Named forms: right after content_type; compact: key 35, written last.
    assert b'"content_type":"application/msgpack","content_encoding":"zstd","payload":' in encode(env, Encoding.JSON)
    assert b"\xb0content_encoding\xa4zstd\xa7payload" in encode(env, Encoding.MSGPACK)
    pairs = msgpack.unpackb(encode(env, Encoding.COMPACT), strict_map_key=False, object_pairs_hook=list)
    assert pairs[-1] == (35, "zstd")
    # Absent unless set; null reads as absent; anything but a string is malformed.
    assert b"content_encoding" not in encode(sample(), Encoding.JSON)
    assert decode(named(content_encoding=None))[0].content_encoding is None
    with pytest.raises(DecodeError, match="content_encoding"):
        decode(named(content_encoding=1))
    compact = encode(sample(), Encoding.COMPACT)
    with pytest.raises(DecodeError, match="key 35"):
        decode(bytes([compact[0] + 1]) + compact[1:] + b"\x23\x01")


def test_subjects_refuse_bad_names() -> None:
    s = Subjects("chorus")
    for bad in ("", "a.b", "a b", "x" * 65, "a*"):
        with pytest.raises(SubjectError):
            s.command(bad, "run")
    with pytest.raises(SubjectError):
        s.event("a..b")
    assert s.event_pattern("doc.*.>") == "chorus.evt.doc.*.>"
    assert s.implied("chorus.inbox.ledger.high.post") == Implied(agent="ledger", name="post")
    assert s.implied("chorus.agent.x.cap.sum") == Implied()
    assert s.stream_name("INBOX") == "CHORUS_INBOX"


def test_uuid7_and_floats() -> None:
    ids = [uuid7() for _ in range(5_000)]
    assert ids == sorted(ids) and all(i.version == 7 for i in ids)
    assert uuid7_ms(ids[0]) == ids[0].int >> 80
    assert uuid7_ms(uuid.uuid4()) is None
    assert [f32_text(x) for x in (0.25, 0.0, 1e-7, 0.95, 1.0, 1e20)] == ["0.25", "0.0", "1e-7", "0.95", "1.0", "1e+20"]


def test_no_input_fails_with_anything_but_a_decode_error() -> None:
    rng = random.Random(7)
    seeds = [encode(sample(), e, Subjects().implied("chorus.agent.worker.plan")) for e in Encoding]
    for _ in range(20_000):
        base = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            what = rng.random()
            if what < 0.4 and base:
                base[rng.randrange(len(base))] = rng.randrange(256)
            elif what < 0.7 and base:
                del base[rng.randrange(len(base)) :]
            else:
                base.insert(rng.randrange(len(base) + 1), rng.randrange(256))
        try:
            decode(bytes(base), Subjects().implied("chorus.agent.worker.plan"))
        except DecodeError:
            pass


@pytest.mark.skipif(os.environ.get("CHORUS_SKIP_MYPY") == "1", reason="CHORUS_SKIP_MYPY=1")
def test_the_package_type_checks_strictly() -> None:
    python = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=python, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
