"""Signing keys learned from the registry, as docs/SECURITY.md describes and the Rust SDK does:
each agent generates its identity and announces its public key in its manifest, the
coordinator (`chorus serve`) writes it into the registry, and receivers that require
signatures learn it from there, with no key given by hand. Python and Rust, both ways."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio

from chorus_sdk import Agent, ChorusError, Context, Identity, StatusCode, Subjects, Verifier

from .conftest import Coordinator, eventually

WAIT = 20.0


@pytest_asyncio.fixture
async def registry(server: Any) -> AsyncIterator[None]:
    """`chorus serve` on the module's server, once its registry bucket exists."""
    coordinator = Coordinator(server.url)
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()

        async def bucket() -> bool:
            try:
                await js.key_value(Subjects().bucket_name("registry"))
                return True
            except Exception:  # noqa: BLE001 - not created yet
                return False

        await eventually("the registry bucket", bucket, WAIT)
        yield
    finally:
        await nc.close()
        coordinator.stop()


async def registered(verifier: Verifier, agent: str, key: str) -> None:
    """Waits (within a deadline) until ``verifier`` has ``agent``'s key from the registry."""

    async def known() -> bool:
        return verifier.key_of(agent) == key

    await eventually(f"{agent}'s key in the registry", known, WAIT)


async def test_a_python_agent_learns_signing_keys_from_the_registry(
    server: Any, registry: None, rust_peer: Any, tmp_path: Path
) -> None:
    rust_identity = Identity.generate()
    seed = tmp_path / "rust.seed"
    seed.write_text(rust_identity.seed)
    # The Rust peer signs with a generated key and requires signatures; the one key it is
    # given by hand is for an agent that never speaks: the Python agents' keys it must learn
    # from the registry too.
    peer = rust_peer("rust-keyed", PEER_SEED=str(seed), PEER_TRUST=f"nobody={Identity.generate().public_key}")

    receiver_identity, sender_identity = Identity.generate(), Identity.generate()
    verifier = Verifier(require_signed=True)  # no key given by hand
    receiver = Agent("py-keyed", servers=server.url, heartbeat_interval=0.5, identity=receiver_identity, verifier=verifier)
    seen: list[tuple[str, bool]] = []

    @receiver.command("shout")
    async def shout(ctx: Context) -> str:
        seen.append((ctx.sender, ctx.envelope.signature is not None))
        return str(ctx.data()).upper()

    async with receiver:
        async with Agent("py-signer", servers=server.url, heartbeat_interval=0.5, identity=sender_identity) as sender:
            await registered(verifier, peer.id, rust_identity.public_key)
            await registered(verifier, sender.id, sender_identity.public_key)

            # Python (generated identity) -> Python: accepted with the key from the registry.
            assert await sender.request(receiver.id, "shout", "from python") == "FROM PYTHON"
            # Rust -> Python: the Rust peer (which learned py-signer's key from the registry,
            # or it would refuse the request) forwards to py-keyed, which verifies the Rust
            # signature and answers; the Rust peer verifies that answer against py-keyed's key.
            asked = {"to": receiver.id, "command": "shout", "payload": "from rust"}
            assert await sender.request(peer.id, "ask", asked) == "FROM RUST"
            assert seen == [(sender.id, True), (peer.id, True)]

            # An impostor: signed, claiming to be py-signer, with a key of its own (no
            # heartbeat, so the registry keeps the real one).
            async with Agent("py-signer", servers=server.url, heartbeat_interval=0, identity=Identity.generate()) as impostor:
                with pytest.raises(ChorusError) as refused:
                    await impostor.request(receiver.id, "shout", "forged")
                assert refused.value.status == StatusCode.IDENTITY
                assert refused.value.reason == 'signed with a key that is not "py-signer"\'s'
                # The Rust peer refuses it the same way.
                with pytest.raises(ChorusError) as refused_by_rust:
                    await impostor.request(peer.id, "echo", "forged")
                assert refused_by_rust.value.status == StatusCode.IDENTITY
                assert refused_by_rust.value.reason == refused.value.reason

            # A signed sender the registry does not know.
            async with Agent("py-stranger", servers=server.url, heartbeat_interval=0, identity=Identity.generate()) as stranger:
                with pytest.raises(ChorusError) as unknown:
                    await stranger.request(receiver.id, "shout", "who?")
                assert unknown.value.status == StatusCode.IDENTITY
                assert unknown.value.reason == 'no key is registered for "py-stranger"'
            assert seen == [(sender.id, True), (peer.id, True)]

        # py-signer said goodbye: the registry deleted it, and its key is forgotten.
        async def forgotten() -> bool:
            return verifier.key_of("py-signer") is None

        await eventually("py-signer's key forgotten", forgotten, WAIT)


async def test_a_key_given_by_hand_stays_whatever_the_registry_announces(server: Any, registry: None) -> None:
    """A key given by hand (``Verifier.trust``: the bus's own, an operator's) is not replaced by
    one the registry announces for that id, as in Rust: an agent registering under an
    operator's id with a key of its own is refused, not taken for the operator."""
    impostor = Identity.generate()
    verifier = Verifier(require_signed=True)
    pinned = Identity.generate().public_key
    verifier.trust("py-ops", pinned)
    async with Agent("py-judge", servers=server.url, heartbeat_interval=0, verifier=verifier) as judge:

        @judge.command("ping")
        async def ping(ctx: Context) -> str:
            return "pong"

        await judge.flush()
        async with Agent("py-ops", servers=server.url, heartbeat_interval=0.5, identity=impostor) as posing:
            # Registered (the judge hears its record: its encryption key, say) but not trusted.
            kv = await judge.nc.jetstream().key_value(Subjects().bucket_name("registry"))

            async def announced() -> bool:
                try:
                    return bool((await kv.get("py-ops")).value)
                except Exception:  # noqa: BLE001 - not registered yet
                    return False

            await eventually("py-ops registered", announced, WAIT)
            assert verifier.key_of("py-ops") == pinned
            with pytest.raises(ChorusError) as refused:
                await posing.request(judge.id, "ping")
            assert refused.value.status == StatusCode.IDENTITY
        assert verifier.key_of("py-ops") == pinned
