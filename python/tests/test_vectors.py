"""The shared vectors (tests/vectors, docs/PROTOCOL.md section 9): every one decodes, and
re-encodes byte for byte, in all three forms."""

from __future__ import annotations

from pathlib import Path

import pytest

from chorus_sdk.codec import Encoding, decode, encode
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
}


def hex_file(path: Path) -> bytes:
    return bytes.fromhex(path.read_text().strip())


def test_there_are_vectors() -> None:
    assert len(NAMES) >= 17, NAMES


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
