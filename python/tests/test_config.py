"""Agent configuration files (docs/AGENT-CONFIG.md): the same TOML file, read by the Python SDK
(``Agent.from_config``) and by a Rust agent (``chorus agent --config``, ``AgentOptions::from_file``),
puts both on the bus it names (its root, groups, customer, encoding, timeouts, batching); a file
that cannot be used is refused naming its key, by both."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import pytest

from chorus_sdk import Agent, Batching, ConfigError, Delivery, Encoding, Identity
from chorus_sdk.config import agent_arguments, load, parse

from .conftest import DEADLINE, ChorusProcess, NatsServer, eventually, rust_binary


def config(server: NatsServer, id: str) -> str:
    return f"""
id = "{id}"
customer = "night-owls"

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

[batching]
max_messages = 20
max_delay_ms = 40
"""

# `[batching]` and `customer` values each SDK refuses, and the key its refusal names.
REFUSED_BY_BOTH = {
    "[batching]\nmax_messages = 0\n": "batching",
    "[batching]\nmax_messages = 10001\n": "batching",
    "[batching]\nmax_delay_ms = 0\n": "batching",
    "[batching]\nmax_delay_ms = 60001\n": "batching",
    "[batching]\nbatch_size = 3\n": "batch_size",
    "[batching]\nmax_messages = '3'\n": "max_messages",
}


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
        "[batching]\nmax_messages = 0\n": "batching.max_messages: between 1 and 10000, not 0",
        "[batching]\nmax_messages = 10001\n": "batching.max_messages: between 1 and 10000, not 10001",
        "[batching]\nmax_delay_ms = 0\n": "batching.max_delay_ms: above 0 and at most 60000, not 0",
        "[batching]\nmax_delay_ms = 60001\n": "batching.max_delay_ms: above 0 and at most 60000, not 60001",
        "[batching]\nmax_delay_ms = -5\n": "batching.max_delay_ms: -5",
        "[batching]\nbatch_size = 3\n": "batching.batch_size: not a key this version knows (one of max_messages, max_delay_ms)",
        "[batching]\nmax_messages = 2.5\n": "batching.max_messages: 2.5 is not",
        "customer = 7\n": "customer: a string, not 7",
        "customer = 'acme.eu'\n": "customer: customer 'acme.eu' must be",
        "customers = 'acme'\n": "customers: not a key this version knows (id, customer, or a section",
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
customer = "acme"
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
[batching]
max_messages = 20
max_delay_ms = 40
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
    assert agent.customer == "acme"
    assert agent.batching == Batching(max_messages=20, max_delay=0.04)
    assert agent.max_in_flight == 3, "an argument given in the code wins over the file"
    assert Agent.from_config(path, id="ledger-2").id == "ledger-2"
    # Unsaid: no customer (it serves every one) and the Rust SDK's Batching::new(); one
    # batching key alone leaves the other at its default.
    (tmp_path / "plain.toml").write_text('id = "plain"\n')
    plain = Agent.from_config(tmp_path / "plain.toml")
    assert plain.customer is None and plain.batching == Batching(100, 0.005)
    (tmp_path / "half.toml").write_text('id = "half"\n[batching]\nmax_messages = 3\n')
    assert Agent.from_config(tmp_path / "half.toml").batching == Batching(3, 0.005)
    (tmp_path / "slow.toml").write_text('id = "slow"\n[batching]\nmax_delay_ms = 60000\n')
    assert Agent.from_config(tmp_path / "slow.toml").batching == Batching(100, 60.0)


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
            # The file's customer: both are dedicated to it, so a discovery for another
            # customer passes them by; its batching is the Python agent's.
            for_them = await agent.discover(customer="night-owls")
            assert {r["manifest"]["agent"]: r["manifest"].get("customer") for r in for_them} == {
                "night-py": "night-owls", "night-rust": "night-owls"}
            assert await agent.discover(customer="day-shift") == []
            assert agent.batching == Batching(20, 0.04)

    try:
        asyncio.run(run())
    finally:
        rust.stop()
        coordinator.stop()


def test_both_sdks_refuse_the_same_batching_and_customer_naming_the_key(tmp_path: Path) -> None:
    """The Rust SDK (``chorus agent --config``) refuses before it connects what the Python SDK
    refuses, each naming the key."""
    for n, (text, named) in enumerate(REFUSED_BY_BOTH.items()):
        path = tmp_path / f"refused-{n}.toml"
        path.write_text(f'id = "refused"\n{text}')
        with pytest.raises(ConfigError) as refused:
            Agent.from_config(path)
        assert named in str(refused.value), (text, str(refused.value))
        rust = subprocess.run(
            [rust_binary("chorus"), "agent", "--config", str(path)],
            capture_output=True, text=True, timeout=DEADLINE, stdin=subprocess.DEVNULL,
        )
        assert rust.returncode != 0, (text, rust.stdout)
        assert named in rust.stderr + rust.stdout, (text, rust.stderr)
