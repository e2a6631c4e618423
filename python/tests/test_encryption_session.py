"""Encryption sessions (docs/PROTOCOL.md section 4.2, alg ``hpke-x25519-session-aes256gcm``):
the shared vectors (tests/vectors/crypto/session.json) read and written byte for byte, as the
Rust SDK's ``the_session_vectors_are_read_and_written_byte_for_byte`` does; sessions begun,
numbered and renewed; what a receiver refuses and with which status; and encrypted traffic
through the agents' real send path on a real nats-server, Python to Python and both ways with
the Rust peer (``agent-sdk/examples/interop_peer``)."""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest

from chorus_sdk import Agent, ChorusError, Context, Delivery, EncryptionKey, Envelope, Kind, Performative, Rekey, StatusCode, decode
from chorus_sdk.encryption import (
    ENCRYPTION_ALG,
    HEADER_LEN,
    KEY_LEN,
    OPENED_MAX,
    SESSION_ALG,
    OpenedSessions,
    SessionKeys,
    Sessions,
    encrypt,
    encrypt_in_sessions,
    key_material,
    open_payload,
    seal_payload,
)
from chorus_sdk.envelope import CONTENT_TYPE_ENCRYPTED, Encryption, Recipient
from chorus_sdk.subjects import Subjects

from .conftest import NatsServer, py_agent

VECTORS = json.loads((Path(__file__).resolve().parents[2] / "tests" / "vectors" / "crypto" / "session.json").read_text())
WAIT = 20.0


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def vector_envelope(sender: str, id: str, key: bytes, payload: bytes, inner: str) -> Envelope:
    """An envelope as the vectors' writer sealed it for their recipient."""
    env = Envelope.new(Kind.COMMAND, Performative.REQUEST, sender)
    env.id = uuid.UUID(id)
    env.payload = payload
    env.content_type = CONTENT_TYPE_ENCRYPTED
    env.encryption = Encryption(SESSION_ALG, inner, [Recipient(VECTORS["recipient"]["agent"], key)])
    return env


def status_of(key: EncryptionKey, me: str, env: Envelope) -> int:
    """The status ``key`` refuses ``env`` with (failing the test when it opens)."""
    with pytest.raises(ChorusError) as refused:
        key.decrypt(me, env)
    return int(refused.value.status)


# -------------------------------------------------------------------------------------------
# The vectors


def test_the_vectors_name_this_scheme_and_their_recipient() -> None:
    assert VECTORS["alg"] == SESSION_ALG
    bob = EncryptionKey.from_secret(VECTORS["recipient"]["secret"])
    assert bob.public_key == VECTORS["recipient"]["public"]
    assert len(VECTORS["messages"]) >= 3 and len(VECTORS["refused"]) >= 5


def test_the_vector_header_opens_to_the_secret_and_derives_the_key_and_nonce() -> None:
    bob = EncryptionKey.from_secret(VECTORS["recipient"]["secret"])
    session = VECTORS["session"]
    header, secret = h(session["header"]), h(session["secret"])
    assert len(header) == HEADER_LEN
    assert bob.open_header(header) == secret
    okm = key_material(secret, header)
    assert okm[:32] == h(session["key"])
    assert okm[32:] == h(session["nonce"])
    assert SessionKeys(secret, header).nonce(0) == h(session["nonce"])


@pytest.mark.parametrize("n", range(len(VECTORS["messages"])))
def test_a_vector_message_is_written_byte_for_byte(n: int) -> None:
    m = VECTORS["messages"][n]
    header = h(VECTORS["session"]["header"])
    keys = SessionKeys(h(VECTORS["session"]["secret"]), header)
    seq, content_key = m["seq"], h(m["content_key"])
    key = header + seq.to_bytes(8, "big") + keys.wrap(seq, m["from"], m["id"], content_key)
    assert key == h(m["key"]) and len(key) == KEY_LEN
    assert seal_payload(content_key, h(m["plaintext"])) == h(m["payload"])


@pytest.mark.parametrize("n", range(len(VECTORS["messages"])))
def test_a_vector_message_opens_to_its_plaintext_and_content_type(n: int) -> None:
    m = VECTORS["messages"][n]
    bob = EncryptionKey.from_secret(VECTORS["recipient"]["secret"])
    env = vector_envelope(m["from"], m["id"], h(m["key"]), h(m["payload"]), m["inner_content_type"])
    bob.decrypt(VECTORS["recipient"]["agent"], env)
    assert env.payload == h(m["plaintext"])
    assert env.content_type == m["inner_content_type"]
    assert env.encryption is None


def test_the_vector_messages_open_in_one_session() -> None:
    bob = EncryptionKey.from_secret(VECTORS["recipient"]["secret"])
    for m in VECTORS["messages"]:
        env = vector_envelope(m["from"], m["id"], h(m["key"]), h(m["payload"]), m["inner_content_type"])
        bob.decrypt(VECTORS["recipient"]["agent"], env)
        assert env.payload == h(m["plaintext"])
    assert bob.opened_sessions == 1


@pytest.mark.parametrize("n", range(len(VECTORS["refused"])), ids=[r["why"] for r in VECTORS["refused"]])
def test_a_refused_vector_gets_its_status(n: int) -> None:
    r = VECTORS["refused"][n]
    agent = VECTORS["recipient"]["agent"]
    fresh = EncryptionKey.from_secret(VECTORS["recipient"]["secret"])
    # The same with the session already opened (the cached path).
    warm = EncryptionKey.from_secret(VECTORS["recipient"]["secret"])
    m = VECTORS["messages"][0]
    warm.decrypt(agent, vector_envelope(m["from"], m["id"], h(m["key"]), h(m["payload"]), m["inner_content_type"]))
    for key in (fresh, warm):
        env = vector_envelope(r["from"], r["id"], h(r["key"]), h(r["payload"]), "text/plain")
        assert status_of(key, agent, env) == r["status"], r["why"]


# -------------------------------------------------------------------------------------------
# Sessions


def sealed(sessions: Sessions, to: list[tuple[str, EncryptionKey]], n: int, sender: str = "alice") -> list[Envelope]:
    """``n`` messages from ``sender``, ``order <i>`` each, sealed for ``to`` in ``sessions``."""
    out = []
    for i in range(n):
        env = Envelope.new(Kind.COMMAND, Performative.REQUEST, sender)
        env.payload = f"order {i}".encode()
        env.content_type = "text/plain"
        encrypt_in_sessions(env, [(agent, key.public_key) for agent, key in to], sessions)
        out.append(env)
    return out


def header_and_seq(env: Envelope, agent: str) -> tuple[bytes, int]:
    assert env.encryption is not None
    key = next(r.key for r in env.encryption.recipients if r.agent == agent)
    assert len(key) == KEY_LEN
    return key[:HEADER_LEN], int.from_bytes(key[HEADER_LEN:HEADER_LEN + 8], "big")


def copy(env: Envelope) -> Envelope:
    """A copy whose encryption can be changed without touching ``env``'s."""
    assert env.encryption is not None
    enc = env.encryption
    out = Envelope.new(env.kind, env.performative, env.from_)
    out.id, out.payload, out.content_type = env.id, env.payload, env.content_type
    out.encryption = Encryption(enc.alg, enc.inner_content_type, [Recipient(r.agent, r.key) for r in enc.recipients])
    return out


def test_a_session_seals_each_message_with_the_next_number_and_one_header() -> None:
    bob, carol = EncryptionKey.generate(), EncryptionKey.generate()
    sessions = Sessions()
    envs = sealed(sessions, [("bob", bob), ("carol", carol)], 5)
    assert len(sessions) == 2, "one session per recipient key"
    first = header_and_seq(envs[0], "bob")[0]
    assert header_and_seq(envs[0], "carol")[0] != first
    for i, env in enumerate(envs):
        assert env.encryption is not None and env.encryption.alg == SESSION_ALG
        assert env.content_type == CONTENT_TYPE_ENCRYPTED and b"order" not in env.payload
        assert header_and_seq(env, "bob") == (first, i)
        for_bob, for_carol = copy(env), copy(env)
        bob.decrypt("bob", for_bob)
        assert for_bob.payload == f"order {i}".encode() and for_bob.content_type == "text/plain"
        carol.decrypt("carol", for_carol)
        assert for_carol.payload == f"order {i}".encode()
    assert bob.opened_sessions == 1, "the session was opened once for five messages"
    # Not a recipient, or the wrong key.
    eve = EncryptionKey.generate()
    assert status_of(eve, "bob", copy(envs[0])) == StatusCode.ACCESS
    assert status_of(eve, "eve", copy(envs[0])) == StatusCode.ACCESS


def test_a_session_ends_after_its_count() -> None:
    bob = EncryptionKey.generate()
    envs = sealed(Sessions(Rekey(messages=3)), [("bob", bob)], 7)
    assert [header_and_seq(e, "bob")[1] for e in envs] == [0, 1, 2, 0, 1, 2, 0]
    assert len({header_and_seq(e, "bob")[0] for e in envs}) == 3, "a new session every 3 messages"
    for i, env in enumerate(envs):
        bob.decrypt("bob", env)
        assert env.payload == f"order {i}".encode()
    assert bob.opened_sessions == 3


def test_an_age_of_zero_begins_a_session_per_message() -> None:
    bob = EncryptionKey.generate()
    envs = sealed(Sessions(Rekey(messages=1_000, age=0)), [("bob", bob)], 3)
    assert [header_and_seq(e, "bob")[1] for e in envs] == [0, 0, 0]
    assert len({header_and_seq(e, "bob")[0] for e in envs}) == 3


def test_a_new_recipient_key_begins_a_new_session() -> None:
    old, new = EncryptionKey.generate(), EncryptionKey.generate()
    sessions = Sessions()
    before = sealed(sessions, [("bob", old)], 2)
    after = sealed(sessions, [("bob", new)], 2)
    assert [header_and_seq(e, "bob")[1] for e in before + after] == [0, 1, 0, 1]
    assert header_and_seq(before[0], "bob")[0] != header_and_seq(after[0], "bob")[0]
    assert status_of(old, "bob", copy(after[0])) == StatusCode.ACCESS
    new.decrypt("bob", after[1])
    assert after[1].payload == b"order 1"


def test_a_restarted_receiver_opens_the_next_message_of_a_session() -> None:
    bob = EncryptionKey.generate()
    envs = sealed(Sessions(Rekey(messages=3)), [("bob", bob)], 7)
    for env in envs[:4]:
        bob.decrypt("bob", env)
    # Restarted mid-session: the opened sessions are gone, the next message carries its header.
    restarted = EncryptionKey.from_secret(bob.secret)
    assert restarted.opened_sessions == 0
    assert header_and_seq(envs[4], "bob")[1] == 1
    restarted.decrypt("bob", envs[4])
    assert envs[4].payload == b"order 4"
    assert restarted.opened_sessions == 1


def test_a_wrapped_key_opens_only_its_own_message_and_a_changed_payload_is_refused() -> None:
    bob = EncryptionKey.generate()
    envs = sealed(Sessions(), [("bob", bob)], 2)
    # The second message's key pasted onto the first (another id and number).
    moved = copy(envs[0])
    moved.encryption = copy(envs[1]).encryption
    assert status_of(bob, "bob", moved) == StatusCode.ACCESS
    # Another id with the same key.
    renamed = copy(envs[0])
    renamed.id = uuid.uuid4()
    assert status_of(bob, "bob", renamed) == StatusCode.ACCESS
    # Another sender.
    other = copy(envs[0])
    other.from_ = "mallory"
    assert status_of(bob, "bob", other) == StatusCode.ACCESS
    # A payload changed in transit.
    changed = copy(envs[0])
    changed.payload = bytes([changed.payload[0] ^ 1]) + changed.payload[1:]
    assert status_of(bob, "bob", changed) == StatusCode.DATA_FORMAT
    # A key of the wrong length.
    short = copy(envs[0])
    assert short.encryption is not None
    short.encryption.recipients[0].key = b"\x01\x02\x03"
    assert status_of(bob, "bob", short) == StatusCode.DATA_FORMAT
    # A scheme this side does not know.
    unknown = copy(envs[0])
    assert unknown.encryption is not None
    unknown.encryption.alg = "rot13"
    assert status_of(bob, "bob", unknown) == StatusCode.DATA_FORMAT
    # The untouched message still opens.
    bob.decrypt("bob", envs[0])
    assert envs[0].payload == b"order 0"


def test_every_damaged_byte_is_refused_with_a_status_never_an_exception() -> None:
    bob = EncryptionKey.generate()
    (env,) = sealed(Sessions(), [("bob", bob)], 1)
    assert env.encryption is not None
    key = env.encryption.recipients[0].key
    for i in range(len(key)):
        damaged = copy(env)
        assert damaged.encryption is not None
        damaged.encryption.recipients[0].key = key[:i] + bytes([key[i] ^ 0x80]) + key[i + 1:]
        # A header that does not open, a number or wrapped key not sealed for it: 5007.
        assert status_of(bob, "bob", damaged) == StatusCode.ACCESS, f"byte {i} of the key"
    for cut in (0, 1, HEADER_LEN, KEY_LEN - 1):
        damaged = copy(env)
        assert damaged.encryption is not None
        damaged.encryption.recipients[0].key = key[:cut]
        assert status_of(bob, "bob", damaged) == StatusCode.DATA_FORMAT, f"a key of {cut} bytes"
    for payload in (b"", b"\x00" * 15, env.payload[:-1], env.payload + b"\x00"):
        damaged = copy(env)
        damaged.payload = payload
        assert status_of(bob, "bob", damaged) == StatusCode.DATA_FORMAT, f"a payload of {len(payload)} bytes"
    bob.decrypt("bob", env)
    assert env.payload == b"order 0"


def test_a_receiver_keeps_a_bounded_number_of_sessions_and_opens_each_once() -> None:
    opened = OpenedSessions(8)
    opens: list[int] = []

    def opener(i: int) -> Any:
        def open(header: bytes) -> bytes:
            opens.append(i)
            return bytes([i]) * 32

        return open

    def header(i: int) -> bytes:
        return bytes([i]) * HEADER_LEN

    for _ in range(2):
        for i in range(4):
            assert opened.keys(header(i), opener(i)) is not None
        assert opens == [0, 1, 2, 3], "each of 4 sessions opened once"
    for i in range(4, 40):
        assert opened.keys(header(i), opener(i)) is not None
        assert len(opened) <= 8
    assert len(opened) >= 4
    # The newest is still open; the first was forgotten and opens again.
    opens.clear()
    opened.keys(header(39), opener(39))
    opened.keys(header(0), opener(0))
    assert opens == [0]
    # A header that does not open, or opens to the wrong length, gives no keys.
    assert opened.keys(header(200), lambda _: None) is None
    assert opened.keys(header(201), lambda _: b"\x01" * 31) is None


def test_the_default_bound_is_4096_sessions() -> None:
    opened = OpenedSessions()
    assert opened.limit == OPENED_MAX == 4096
    for i in range(OPENED_MAX):
        opened.keys(i.to_bytes(HEADER_LEN, "big"), lambda _: b"\x07" * 32)
    assert len(opened) == OPENED_MAX
    opened.keys(b"\xff" * HEADER_LEN, lambda _: b"\x07" * 32)
    assert len(opened) == OPENED_MAX // 2
    assert EncryptionKey.generate()._opened.limit == OPENED_MAX


def test_the_one_setup_per_message_scheme_is_still_read() -> None:
    bob = EncryptionKey.generate()
    env = Envelope.new(Kind.COMMAND, Performative.REQUEST, "alice")
    env.payload, env.content_type = b"the launch code", "text/plain"
    encrypt(env, [("bob", bob.public_key)])
    assert env.encryption is not None and env.encryption.alg == ENCRYPTION_ALG
    other = copy(env)
    bob.decrypt("bob", env)
    assert (env.payload, env.content_type) == (b"the launch code", "text/plain")
    assert status_of(EncryptionKey.generate(), "bob", other) == StatusCode.ACCESS


def test_sealing_for_no_one_or_a_malformed_key_is_refused() -> None:
    env = Envelope.new(Kind.COMMAND, Performative.REQUEST, "alice")
    with pytest.raises(ChorusError) as none:
        encrypt_in_sessions(env, [], Sessions())
    assert none.value.status == StatusCode.INVALID_ARGUMENT
    with pytest.raises(ChorusError) as malformed:
        encrypt_in_sessions(env, [("bob", "not base64!")], Sessions())
    assert malformed.value.status == StatusCode.INVALID_ARGUMENT
    with pytest.raises(ChorusError) as short:
        encrypt_in_sessions(env, [("bob", "AAAA")], Sessions())
    assert short.value.status == StatusCode.INVALID_ARGUMENT
    assert env.encryption is None and env.payload == b""


def test_the_content_key_seals_and_opens_the_payload() -> None:
    ck = b"\x42" * 32
    assert open_payload(ck, seal_payload(ck, b"x")) == b"x"
    assert open_payload(b"\x43" * 32, seal_payload(ck, b"x")) is None


@pytest.mark.parametrize(
    "bad",
    [(0, 600.0), (-1, 600.0), (2**64, 600.0), (1.5, 600.0), (True, 600.0), (10, -1.0), (10, math.nan)],
)
def test_a_bad_rekey_is_refused(bad: tuple[Any, Any]) -> None:
    with pytest.raises(ValueError, match="encryption_rekey"):
        Rekey(*bad)
    with pytest.raises(ValueError, match="encryption_rekey"):
        Agent("py-rekey", encryption_rekey=bad)


def test_the_default_rekey_is_100000_messages_or_10_minutes() -> None:
    assert Rekey() == Rekey(100_000, 600.0)
    assert Rekey(1, 0).age == 0
    with pytest.raises(ValueError, match="encryption_rekey"):
        Agent("py-rekey", encryption_rekey="often")  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------
# On a real server


class Tap:
    """A plain NATS subscriber on ``subject``, decoding what crosses the bus."""

    def __init__(self) -> None:
        self.seen: asyncio.Queue[Envelope] = asyncio.Queue()
        self._nc: Any = None

    async def start(self, url: str, subject: str) -> Tap:
        self._nc = await nats.connect(url)
        subjects = Subjects("chorus")

        async def on_msg(msg: Any) -> None:
            await self.seen.put(decode(msg.data, subjects.implied(msg.subject))[0])

        await self._nc.subscribe(subject, cb=on_msg)
        await self._nc.flush()
        return self

    async def take(self, n: int) -> list[Envelope]:
        return [await asyncio.wait_for(self.seen.get(), WAIT) for _ in range(n)]

    async def close(self) -> None:
        await self._nc.close()


def sessions_seen(envs: list[Envelope], agent: str) -> tuple[list[int], int]:
    """The numbers the envelopes carry for ``agent``, and how many headers."""
    for env in envs:
        assert env.encryption is not None and env.encryption.alg == SESSION_ALG, (
            f"sent as {env.encryption.alg if env.encryption else 'plaintext'}, not in sessions")
        assert env.content_type == CONTENT_TYPE_ENCRYPTED
    pairs = [header_and_seq(e, agent) for e in envs]
    return [seq for _, seq in pairs], len({header for header, _ in pairs})


async def test_a_stream_of_encrypted_commands_is_handled_in_rekeyed_sessions(server: NatsServer) -> None:
    key = EncryptionKey.generate()
    n = 35
    handled: dict[int, Any] = {}
    all_handled = asyncio.Event()
    tap = await Tap().start(server.url, "chorus.inbox.py-session-b.>")
    try:
        async with py_agent(server, "py-session-b", encryption_key=key) as receiver, \
                py_agent(server, "py-session-a", encryption_rekey=Rekey(messages=10)) as sender:

            @receiver.command("order")
            async def order(ctx: Context) -> None:
                data = ctx.data()
                handled[data["n"]] = data
                if len(handled) == n:
                    all_handled.set()

            await receiver.flush()
            sender.trust_encryption(receiver.id, key.public_key)
            sent = {i: {"n": i, "card": f"4111-{i:04d}", "bytes": "x" * i} for i in range(n)}
            for i in range(n):
                await sender.send(receiver.id, "order", sent[i], delivery=Delivery.AT_LEAST_ONCE, encrypt_for=[receiver.id])
            await asyncio.wait_for(all_handled.wait(), WAIT)
            assert handled == sent, "every command handled once with its exact payload"
            on_the_bus = await tap.take(n)
            seqs, headers = sessions_seen(on_the_bus, receiver.id)
            assert sorted(seqs) == sorted(list(range(10)) * 3 + list(range(5)))
            assert headers == 4, "a new session every 10 messages"
            assert all(b"4111" not in e.payload for e in on_the_bus)
            assert key.opened_sessions == 4
            assert receiver.stats.security_refused == 0
    finally:
        await tap.close()


async def test_python_and_rust_read_each_others_sessions(server: NatsServer, rust_peer: Any) -> None:
    """Needs ``interop_peer`` built from the Rust SDK that sends and reads sessions."""
    py_key, rust_key = EncryptionKey.generate(), EncryptionKey.generate()
    peer = rust_peer(
        "rust-session",
        PEER_ENCRYPTION_SECRET=rust_key.secret,
        PEER_TRUST_ENCRYPTION=f"py-session={py_key.public_key}",
    )
    whispered: list[Any] = []
    to_rust = await Tap().start(server.url, f"chorus.agent.{peer.id}.echo")
    to_python = await Tap().start(server.url, "chorus.agent.py-session.whisper")
    try:
        async with py_agent(server, "py-session", encryption_key=py_key, encryption_rekey=Rekey(messages=5)) as py:
            py.trust_encryption(peer.id, rust_key.public_key)

            @py.command("whisper")
            async def whisper(ctx: Context) -> str:
                whispered.append(ctx.data())
                return "heard"

            await py.flush()
            # Python -> Rust: 12 requests in three sessions, each opened and echoed.
            for i in range(12):
                value = {"card": "4111", "n": i}
                assert await py.request(peer.id, "echo", value, encrypt_for=[peer.id]) == value
            seqs, headers = sessions_seen(await to_rust.take(12), peer.id)
            assert (seqs, headers) == ([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1], 3)
            # Rust -> Python: the peer seals in one session (its default re-key), numbered on.
            for i in range(3):
                answer = await py.request(peer.id, "ask_sealed", {"to": py.id, "command": "whisper", "payload": f"code {i}"})
                assert answer == "heard"
            assert whispered == ["code 0", "code 1", "code 2"]
            seqs, headers = sessions_seen(await to_python.take(3), py.id)
            assert (seqs, headers) == ([0, 1, 2], 1)
            assert py_key.opened_sessions == 1
    finally:
        await to_rust.close()
        await to_python.close()
