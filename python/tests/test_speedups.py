"""The compiled compact codec (python/speedups, ``chorus-sdk[speedups]``) against the Python one,
which defines the form: the same bytes written and the same envelopes read for the shared
vectors and for thousands of generated envelopes, and for damaged bytes either the same
envelope or the Python codec's own error. ``scripts/install-python-sdk`` installs it, so the
tests run with it."""

from __future__ import annotations

import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from chorus_sdk import codec
from chorus_sdk.codec import DecodeError, Encoding, decode, encode
from chorus_sdk.envelope import (
    CONTENT_TYPE_ENCRYPTED,
    CONTENT_TYPE_JSON,
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
    uuid7,
)
from chorus_sdk.subjects import Implied, Subjects

from .test_vectors import NAMES, SUBJECTS, VECTORS, hex_file

fast_encode = codec._fast_encode
fast_decode = codec._fast_decode


def test_the_compiled_codec_is_in_use() -> None:
    assert codec.SPEEDUPS and fast_encode is not None and fast_decode is not None


def test_it_can_be_turned_off() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from chorus_sdk import codec; print(codec.SPEEDUPS)"],
        env={"CHORUS_SPEEDUPS": "0", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "False"


def both_write(env: Envelope, implied: Implied) -> bytes:
    assert fast_encode is not None
    python = codec._encode_compact_py(env, implied)
    assert fast_encode(env, implied) == python
    return python


def both_read(data: bytes) -> Envelope:
    assert fast_decode is not None
    python = codec._decode_compact(data)
    compiled = fast_decode(data)
    assert compiled == python
    assert type(compiled) is Envelope
    return python


@pytest.mark.parametrize("name", NAMES)
def test_the_vectors_read_and_write_alike(name: str) -> None:
    implied = Subjects("chorus").implied(SUBJECTS.get(name, "_INBOX.someone.1"))
    data = hex_file(VECTORS / f"{name}.compact.hex")
    env = both_read(data)
    codec.restore(env, implied)
    assert both_write(env, implied) == data


def _text(rng: random.Random) -> str:
    alphabet = "abcxyz-._ é✓𝄞"
    return "".join(rng.choice(alphabet) for _ in range(rng.choice((0, 1, 5, 31, 32, 40, 300))))


def _maybe(rng: random.Random, value: object) -> object:
    return value if rng.random() < 0.5 else None


def _envelope(rng: random.Random) -> Envelope:
    kind = rng.choice(list(Kind))
    performative = rng.choice(list(Performative))
    env = Envelope.new(kind, performative, _text(rng) or "a")
    if rng.random() < 0.3:
        env.id = uuid.UUID(int=rng.getrandbits(128))
    if rng.random() < 0.3:
        env.timestamp_ms = rng.choice((0, 1, 2**32, 2**64 - 1, rng.getrandbits(48)))
    env.correlation_id = _maybe(rng, uuid7())  # type: ignore[assignment]
    env.in_reply_to = rng.choice((None, env.correlation_id, uuid7()))
    env.to = [_text(rng) for _ in range(rng.choice((0, 1, 2, 17)))]
    env.topic, env.capability, env.name = (_maybe(rng, _text(rng)) for _ in range(3))  # type: ignore[assignment]
    env.ttl_ms, env.deadline_ms = (_maybe(rng, rng.choice((0, 127, 128, 255, 256, 65535, 65536, 2**40))) for _ in range(2))  # type: ignore[assignment]
    env.hops = rng.choice((0, 1, 5, 255))
    env.hop_limit = rng.choice((8, 16, 255))
    env.priority = rng.choice(list(Priority))
    env.delivery = rng.choice(list(Delivery))
    env.seq = _maybe(rng, Seq(rng.getrandbits(32), rng.getrandbits(64)))  # type: ignore[assignment]
    env.expect = _maybe(rng, Expect(rng.choice(list(Performative)), rng.getrandbits(20)))  # type: ignore[assignment]
    if rng.random() < 0.3:
        env.progress = Progress(rng.choice(list(TaskState)), rng.choice((None, 0.0, 0.25, 1.0, 0.375, -0.5, 3)))
    env.status = _maybe(rng, rng.choice((0, 5002, 5006, 65535)))  # type: ignore[assignment]
    env.reason = _maybe(rng, _text(rng))  # type: ignore[assignment]
    if rng.random() < 0.3:
        canonical = f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-{rng.getrandbits(8):02x}"
        env.trace = Trace(rng.choice((canonical, canonical.upper(), "not-a-traceparent")), _maybe(rng, _text(rng)))  # type: ignore[arg-type]
    env.session_id, env.customer_id = (_maybe(rng, _text(rng)) for _ in range(2))  # type: ignore[assignment]
    env.headers = {_text(rng): _text(rng) for _ in range(rng.choice((0, 0, 1, 3, 20)))}
    env.content_type = rng.choice((env.content_type, CONTENT_TYPE_JSON, CONTENT_TYPE_ENCRYPTED, "text/plain"))
    env.payload = rng.randbytes(rng.choice((0, 1, 255, 256, 70000)))
    env.token = _maybe(rng, _text(rng))  # type: ignore[assignment]
    if rng.random() < 0.2:
        env.signature = Signature(_text(rng), rng.randbytes(64))
    if rng.random() < 0.2:
        env.encryption = Encryption("x25519", CONTENT_TYPE_JSON, [Recipient(_text(rng), rng.randbytes(32)) for _ in range(rng.choice((0, 2)))])
    env.content_encoding = _maybe(rng, "zstd")  # type: ignore[assignment]
    return env


def test_generated_envelopes_write_and_read_alike() -> None:
    rng = random.Random(20261206)
    for _ in range(3000):
        env = _envelope(rng)
        implied = rng.choice(
            (
                Implied(),
                Implied(agent=env.to[0] if env.to else None, name=env.name),
                Implied(topic=env.topic, capability=env.capability),
            )
        )
        data = both_write(env, implied)
        read = both_read(data)
        codec.restore(read, implied)
        assert read == env


def _outcome(read: object, data: bytes) -> object:
    try:
        return read(data)  # type: ignore[operator]
    except DecodeError as e:
        return ("refused", str(e))


def test_damaged_bytes_read_as_the_python_codec_reads_them() -> None:
    rng = random.Random(7)
    samples = [hex_file(VECTORS / f"{name}.compact.hex") for name in NAMES]
    samples += [encode(_envelope(rng), Encoding.COMPACT) for _ in range(50)]
    checked = 0
    for data in samples:
        for _ in range(60):
            damaged = bytearray(data)
            how = rng.random()
            if how < 0.3:
                damaged = damaged[: rng.randrange(len(damaged))]
            elif how < 0.8:
                for _ in range(rng.choice((1, 2, 4))):
                    damaged[rng.randrange(len(damaged))] = rng.getrandbits(8)
            else:
                damaged += bytes(rng.getrandbits(8) for _ in range(rng.choice((1, 3))))
            damaged_bytes = bytes(damaged)
            python = _outcome(lambda d: (codec._decode_compact(d), Encoding.COMPACT), damaged_bytes)
            # Through the public decode, which takes the compiled codec first.
            assert _outcome(decode, damaged_bytes) == python if codec.sniff(damaged_bytes) is Encoding.COMPACT else True
            checked += 1
    assert checked > 3000


def test_what_it_leaves_to_the_python_codec_still_reads_and_writes() -> None:
    env = Envelope.new(Kind.REQUEST, Performative.REQUEST, "a")
    # A bytearray payload and a header that is not a string: the Python codec writes them.
    env.payload = bytearray(b"\x01\x02")  # type: ignore[assignment]
    assert fast_encode is not None and fast_encode(env, Implied()) is None
    assert encode(env, Encoding.COMPACT) == codec._encode_compact_py(env, Implied())
    # An unknown key holding a map: the Python codec reads it (and checks its keys).
    data = encode(Envelope.new(Kind.EVENT, Performative.INFORM, "b"), Encoding.COMPACT)
    head, count = data[0], data[0] & 0x0F
    extended = bytes((head + 1,)) + data[1:] + b"\x3f\x81\xa1k\xa1v"
    assert count + 1 < 16 and fast_decode is not None and fast_decode(extended) is None
    assert decode(extended)[0] == codec._decode_compact(extended)
    # Not an envelope the Python codec can read either: its own error.
    with pytest.raises(DecodeError, match="compact envelope"):
        decode(b"\x81\x00\x02")


def test_its_readme_names_the_test() -> None:
    readme = (Path(__file__).resolve().parents[1] / "speedups" / "README.md").read_text()
    assert "python/tests/test_speedups.py" in readme
