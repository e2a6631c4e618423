"""The shared vectors (tests/vectors, docs/PROTOCOL.md section 9): every one decodes, and
re-encodes byte for byte, in all three forms."""

from __future__ import annotations

from pathlib import Path

import pytest

from chorus_sdk.codec import DecodeError, Encoding, decode, encode
from chorus_sdk.subjects import Subjects

VECTORS = Path(__file__).resolve().parents[2] / "tests" / "vectors"
NAMES = sorted(p.name[: -len(".msgpack.hex")] for p in VECTORS.glob("*.msgpack.hex"))
# The subject each compact vector is published on, where it carries part of the envelope
# (the others travel on a reply inbox, a task or a bid subject, which carry nothing).
SUBJECTS = {
    "01-request": "chorus.agent.calculator.calculation",
    "03-event": "chorus.evt.doc.text.extracted",
    "05-command-secured": "chorus.cap.code.review",
    "16-payload-reference": "chorus.agent.archivist.store",
    "20-request-rerouted": "chorus.agent.reviewer-02.review",
    "23-notification": "chorus.agent.ops-bot.$notify",
}


def hex_file(path: Path) -> bytes:
    return bytes.fromhex(path.read_text().strip())


def test_there_are_vectors() -> None:
    assert len(NAMES) >= 22, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_msgpack_vector_round_trips(name: str) -> None:
    data = hex_file(VECTORS / f"{name}.msgpack.hex")
    env, encoding = decode(data)
    assert encoding is Encoding.MSGPACK
    assert encode(env, Encoding.MSGPACK) == data


@pytest.mark.parametrize("name", NAMES)
def test_json_vector_round_trips_and_matches_msgpack(name: str) -> None:
    data = (VECTORS / "json" / f"{name}.json").read_bytes()
    env, encoding = decode(data)
    assert encoding is Encoding.JSON
    assert encode(env, Encoding.JSON) == data
    assert env == decode(hex_file(VECTORS / f"{name}.msgpack.hex"))[0]


@pytest.mark.parametrize("name", NAMES)
def test_compact_vector_round_trips_on_its_subject(name: str) -> None:
    subjects = Subjects("chorus")
    implied = subjects.implied(SUBJECTS.get(name, "_INBOX.someone.1"))
    data = hex_file(VECTORS / f"{name}.compact.hex")
    env, encoding = decode(data, implied)
    assert encoding is Encoding.COMPACT
    assert env == decode(hex_file(VECTORS / f"{name}.msgpack.hex"))[0]
    assert encode(env, Encoding.COMPACT, implied) == data


DECODE = VECTORS / "decode"
DECODE_NAMES = sorted(p.stem for p in DECODE.glob("*.hex"))


def test_there_are_decoding_cases() -> None:
    assert len(DECODE_NAMES) >= 15, DECODE_NAMES


@pytest.mark.parametrize("name", DECODE_NAMES)
def test_decoding_case_is_read_or_refused_as_rust_does(name: str) -> None:
    """tests/vectors/decode: bytes no encoder writes, each read to the envelope in NAME.json
    (as written in JSON) or refused with the 5006 reason in NAME.error, word for word."""
    data = hex_file(DECODE / f"{name}.hex")
    implied = Subjects("chorus").implied("_INBOX.planner.a1b2c3")
    expected_json = DECODE / f"{name}.json"
    if expected_json.exists():
        env, encoding = decode(data, implied)
        assert encoding is Encoding.COMPACT
        assert encode(env, Encoding.JSON) + b"\n" == expected_json.read_bytes()
    else:
        reason = (DECODE / f"{name}.error").read_text().strip()
        with pytest.raises(DecodeError) as refused:
            decode(data, implied)
        assert str(refused.value) == reason


def test_json_floats_are_written_as_rust_writes_them() -> None:
    """tests/vectors/floats.txt: 32-bit floats and their JSON text as the Rust SDK writes
    them (PROTOCOL.md section 3.2's rule), every one the same here."""
    import struct

    from chorus_sdk._wire import f32_text

    lines = (VECTORS / "floats.txt").read_text().splitlines()
    assert len(lines) > 1900
    for line in lines:
        bits, text = line.split(" ")
        (x,) = struct.unpack(">f", bytes.fromhex(bits))
        assert f32_text(x) == text, line
