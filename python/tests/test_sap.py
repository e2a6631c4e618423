"""The gateway's Synadia Agent Protocol 0.3 binding, driven by its Python client
(synadia-ai-agents) against a Rust agent on the bus: discovery, a streamed reply, the status
endpoint and heartbeats, a question answered mid-stream, and refusals as service errors."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from .test_gateway import WAIT, gateway

if sys.version_info < (3, 11):
    pytest.skip("synadia-ai-agents needs Python 3.11 or newer", allow_module_level=True)

sap = pytest.importorskip("synadia_ai.agents", reason="synadia-ai-agents is installed by scripts/install-python-sdk")

DRAFTER = """
[[gateway.sap]]
agent = "drafter"
owner = "chorus"
identity = "sap-user"
to = "rust-peer"
command = "draft"
heartbeat_interval_s = 1
"""

BINDINGS = DRAFTER + """
[[gateway.sap]]
agent = "speller"
owner = "chorus"
identity = "sap-user"
to = "rust-peer"
command = "spell"

[[gateway.sap]]
agent = "painter"
owner = "chorus"
session = "studio"
identity = "sap-user"
to = "rust-peer"
command = "question"

[[gateway.sap]]
agent = "nobody"
owner = "chorus"
identity = "sap-user"
to = "no-such-agent"
command = "draft"
"""


async def _discover(agents: Any, name: str) -> Any:
    """The one SAP agent called `name`, once discovery finds it."""
    from synadia_ai.agents import DiscoverFilter

    async with asyncio.timeout(WAIT):
        while True:
            found = await agents.discover(filter=DiscoverFilter(agent=name, owner="chorus"))
            if found:
                assert len(found) == 1, found
                return found[0]
            await asyncio.sleep(0.1)


async def test_the_sap_client_discovers_prompts_and_streams_a_rust_agent(
    server: Any, rust_peer: Any, tmp_path: Path
) -> None:
    import nats
    from synadia_ai.agents import Agents, ProtocolError, Query, ResponseChunk, StatusChunk

    rust_peer()
    with gateway(server, tmp_path, "sap-user", BINDINGS):
        nc = await nats.connect(server.url)
        agents = Agents(nc=nc)
        try:
            async with asyncio.timeout(60):
                drafter = await _discover(agents, "drafter")
                assert drafter.protocol_version == "0.3"
                assert drafter.session_name == "default"
                assert drafter.prompt_endpoint.subject == "agents.prompt.drafter.chorus.default"
                assert drafter.prompt_endpoint.queue_group == "agents"
                assert drafter.prompt_endpoint.attachments_ok is False
                assert (drafter.prompt_endpoint.max_payload_bytes or 0) > 100_000

                # The reply streams: the ack first, then each chunk of the task as a response.
                stream = [m async for m in drafter.prompt("gateways", timeout=WAIT)]
                assert isinstance(stream[0], StatusChunk) and stream[0].status == "ack", stream
                words = [m.text for m in stream if isinstance(m, ResponseChunk)]
                assert words == "a short draft about gateways".split(), stream

                # Chunks go out as the task streamed them, spaces and all.
                speller = await _discover(agents, "speller")
                pieces = [m.text async for m in speller.prompt("keep the spaces", timeout=WAIT)
                          if isinstance(m, ResponseChunk)]
                assert pieces == ["kee", "p t", "he ", "spa", "ces"], pieces

                # The status endpoint and the heartbeats carry the same instance.
                status = await drafter.status()
                assert (status.agent, status.owner, status.session) == ("drafter", "chorus", "default")
                assert status.instance_id == drafter.instance_id and status.interval_s == 1
                async with asyncio.timeout(WAIT):
                    while (live := agents.liveness(drafter.instance_id)) is None:
                        await asyncio.sleep(0.1)
                assert live.is_online

                # A question comes as a query; its reply continues the task to its result.
                painter = await _discover(agents, "painter")
                assert painter.session_name == "studio"
                answers = []
                async for m in painter.prompt("paint", timeout=WAIT):
                    if isinstance(m, Query):
                        assert "which colour?" in m.prompt, m.prompt
                        await m.reply("blue")
                    elif isinstance(m, ResponseChunk):
                        answers.append(m.text)
                assert answers == ["painted blue"]

                # No agent behind it: a service error (404, no responders), then the end.
                nobody = await _discover(agents, "nobody")
                with pytest.raises(ProtocolError, match="service error 404"):
                    [m async for m in nobody.prompt("anything", timeout=WAIT)]

                # Below the client: an empty prompt is answered 400 and the terminator.
                inbox = nc.new_inbox()
                sub = await nc.subscribe(inbox)
                await nc.publish(drafter.prompt_endpoint.subject, b"", reply=inbox)
                error = await sub.next_msg(timeout=WAIT)
                assert error.headers is not None and error.headers["Nats-Service-Error-Code"] == "400", error
                # The body as SAP 0.3 section 9.1 writes it: a snake_case code and a message.
                body = json.loads(error.data)
                assert body["error"] == "invalid_argument" and body["message"], body
                assert set(body) == {"error", "message", "chorus_status"}, body
                end = await sub.next_msg(timeout=WAIT)
                assert end.data == b"" and not end.headers
                await sub.unsubscribe()
        finally:
            await agents.close()
            await nc.close()


async def test_a_gateway_with_only_sap_agents_needs_no_http_listener(
    server: Any, rust_peer: Any, tmp_path: Path
) -> None:
    import subprocess

    import nats
    from synadia_ai.agents import Agents, ResponseChunk

    from .conftest import rust_binary

    rust_peer()
    config = tmp_path / "sap-only.toml"
    config.write_text('[gateway]\n[[gateway.identities]]\nid = "sap-user"\n' + DRAFTER)
    serve = subprocess.Popen(
        [rust_binary("chorus"), "--server", server.url, "serve", "--config", str(config)],
        env={"CHORUS_SERVE__METRICS_ADDR": "127.0.0.1:0", "RUST_LOG": "warn", "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    nc = await nats.connect(server.url)
    agents = Agents(nc=nc)
    try:
        async with asyncio.timeout(60):
            drafter = await _discover(agents, "drafter")
            words = [m.text async for m in drafter.prompt("leaves", timeout=WAIT) if isinstance(m, ResponseChunk)]
            assert words == "a short draft about leaves".split()
    finally:
        await agents.close()
        await nc.close()
        serve.terminate()
        serve.wait(timeout=15)
