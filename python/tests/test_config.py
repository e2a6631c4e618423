"""Agent configuration files (docs/AGENT-CONFIG.md): the same TOML file, read by the Python SDK
(``Agent.from_config``) and by a Rust agent (``chorus agent --config``, ``AgentOptions::from_file``),
puts both on the bus it names (its root, groups, encoding, timeouts); a file that cannot be
used is refused naming its key."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from chorus_sdk import Agent, ConfigError, Delivery, Encoding, Identity
from chorus_sdk.config import agent_arguments, load, parse

from .conftest import DEADLINE, ChorusProcess, NatsServer, eventually


def config(server: NatsServer, id: str) -> str:
    return f"""
id = "{id}"

[bus]
servers = "{server.url}"
root = "night-bus"
encoding = "compact"
groups = ["night-shift"]

[reliability]
default_delivery = "exactly_once"
request_timeout_ms = 4000
max_in_flight = 8

[monitoring]
heartbeat_interval_ms = 300
"""


def test_a_file_that_cannot_be_used_is_refused_naming_its_key(tmp_path: Path) -> None:
    cases = {
        "[reliability]\nretries = 3\n": "reliability.retries: not a key",
        "[logging]\nlevel = 'debug'\n": "logging: not a key",
        "[bus]\nencoding = 'xml'\n": "bus.encoding: 'xml' is not json, msgpack, compact",
        "[reliability]\ndefault_delivery = 'often'\n": "reliability.default_delivery",
        "[reliability]\nrequest_timeout_ms = '5s'\n": "reliability.request_timeout_ms: '5s' is not",
        "[reliability]\nmax_in_flight = -1\n": "reliability.max_in_flight: -1",
        "[security]\nverify_signatures = 'always'\n": "security.verify_signatures",
        "[security]\nsign = true\n": "signing needs transport.nkey_seed_file",
        "[bus\n": "not TOML",
    }
    for text, named in cases.items():
        with pytest.raises(ConfigError) as refused:
            agent_arguments(parse(text), "a")
        assert named in str(refused.value), (text, str(refused.value))
    with pytest.raises(ConfigError, match="no agent id"):
        agent_arguments(parse(""))
    with pytest.raises(ConfigError, match="missing.toml"):
        load(tmp_path / "missing.toml")
    (tmp_path / "bad.nk").write_text("not a seed")
    (tmp_path / "bad.toml").write_text("[transport]\nnkey_seed_file = 'bad.nk'\n")
    with pytest.raises(ConfigError, match="transport.nkey_seed_file: not a valid nkey seed"):
        agent_arguments(load(tmp_path / "bad.toml"), "a")


def test_every_section_reaches_the_agent_and_files_are_relative_to_the_config(tmp_path: Path) -> None:
    seed = Identity.generate().seed
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "ledger.nk").write_text(seed + "\n")
    path = tmp_path / "agent.toml"
    path.write_text("""
id = "ledger"
[bus]
servers = "nats://a:4222, nats://b:4222"
root = "books"
encoding = "json"
groups = ["accounts"]
[transport]
nkey_seed_file = "keys/ledger.nk"
[reliability]
default_delivery = "at_most_once"
request_timeout_ms = 1500
durable_inbox = false
hop_limit = 4
shutdown_timeout_ms = 2500
[security]
verify_signatures = "require"
[monitoring]
heartbeat_interval_ms = 250
usage_interval_ms = 0
service_discovery = false
""")
    agent = Agent.from_config(path, max_in_flight=3)
    assert agent.id == "ledger" and agent.servers == ["nats://a:4222", "nats://b:4222"]
    assert agent.subjects.root == "books" and agent.groups == ["accounts"]
    assert agent._fixed_encoding == Encoding.JSON
    assert agent.nats_options["nkeys_seed_str"] == seed
    assert agent.identity is not None and agent.identity.public_key == Identity(seed).public_key
    assert agent.default_delivery == Delivery.AT_MOST_ONCE and agent.request_timeout == 1.5
    assert not agent.durable_inbox and agent.hop_limit == 4 and agent.shutdown_timeout == 2.5
    assert agent.verifier is not None and agent.verifier.require_signed
    assert agent.heartbeat_interval == 0.25 and not agent.service_discovery
    assert agent.max_in_flight == 3, "an argument given in the code wins over the file"
    assert Agent.from_config(path, id="ledger-2").id == "ledger-2"


def test_a_rust_agent_and_a_python_agent_configured_by_the_same_file_meet_on_its_bus(
        server: NatsServer, tmp_path: Path) -> None:
    (tmp_path / "rust.toml").write_text(config(server, "night-rust"))
    (tmp_path / "py.toml").write_text(config(server, "night-py"))
    # The coordinator of that bus (its root), to discover the group through.
    coordinator = ChorusProcess(server.url, "--root", "night-bus", "serve", CHORUS_SERVE__METRICS_ADDR="127.0.0.1:0")
    rust = ChorusProcess(server.url, "agent", "--config", str(tmp_path / "rust.toml"), "--capability", "night.echo")

    async def run() -> None:
        coordinator.wait_for('coordinator for root "night-bus"', DEADLINE)
        rust.wait_for("night-rust serving night.echo", DEADLINE)
        async with Agent.from_config(tmp_path / "py.toml") as agent:
            assert agent.request_timeout == 4.0 and agent.default_delivery == Delivery.EXACTLY_ONCE
            answer: dict[str, Any] = await asyncio.wait_for(
                agent.request_capability("night.echo", {"n": 1}), DEADLINE)
            assert answer["agent"] == "night-rust" and answer["payload"] == {"n": 1}

            async def both_in_the_group() -> list[str]:
                found = await agent.discover(group="night-shift")
                ids = sorted(r["manifest"]["agent"] for r in found)
                return ids if ids == ["night-py", "night-rust"] else []

            await eventually("both agents in night-shift on night-bus", both_in_the_group)

    try:
        asyncio.run(run())
    finally:
        rust.stop()
        coordinator.stop()
