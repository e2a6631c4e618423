"""An agent's settings from a TOML file (docs/AGENT-CONFIG.md): the file and keys the Rust SDK
reads (``AgentConfig``), so an agent is configured as the coordinator is. Every key is
optional; an unknown key is refused by name, a value outside its vocabulary names its key, and
file paths are taken relative to the file.

>>> agent = Agent.from_config("agent.toml")          # doctest: +SKIP
"""

from __future__ import annotations

import ssl
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .batch import MAX_BATCH_DELAY, MAX_BATCH_MESSAGES, Batching
from .codec import Encoding
from .envelope import Delivery
from .identity import Identity
from .signing import Verifier
from .subjects import SubjectError, validate_token

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the same parser, from PyPI
    import tomli as tomllib

# The keys outside any section: the agent's id and the customer it is dedicated to.
TOP_LEVEL = ("id", "customer")

# Each section's keys and the type of each.
SECTIONS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "bus": {"servers": str, "root": str, "encoding": str, "groups": list},
    "transport": {"tls_ca": str, "tls_cert": str, "tls_key": str, "nkey_seed_file": str},
    "reliability": {
        "default_delivery": str,
        "request_timeout_ms": int,
        "durable_inbox": bool,
        "max_in_flight": int,
        "hop_limit": int,
        "shutdown_timeout_ms": int,
    },
    "security": {"sign": bool, "verify_signatures": str, "trust_unverified_senders": bool},
    "monitoring": {
        "heartbeat_interval_ms": int,
        "usage_interval_ms": int,
        "service_discovery": bool,
        "metrics_url": str,
    },
    # What ``agent.batcher()`` batches by when not told (the Rust SDK's ``default_batcher``).
    "batching": {"max_messages": int, "max_delay_ms": int},
}

ENCODINGS = {"json": Encoding.JSON, "msgpack": Encoding.MSGPACK, "compact": Encoding.COMPACT}
DELIVERIES = {
    "at_most_once": Delivery.AT_MOST_ONCE,
    "at_least_once": Delivery.AT_LEAST_ONCE,
    "exactly_once": Delivery.EXACTLY_ONCE,
}


class ConfigError(ValueError):
    """An agent configuration that cannot be used: the message names the key and why."""


def _check(raw: Mapping[str, Any]) -> None:
    for name, value in raw.items():
        if name in TOP_LEVEL:
            if not isinstance(value, str):
                raise ConfigError(f"agent configuration: {name}: a string, not {value!r}")
            continue
        keys = SECTIONS.get(name)
        if keys is None or not isinstance(value, dict):
            raise ConfigError(
                f"agent configuration: {name}: not a key this version knows "
                f"({', '.join(TOP_LEVEL)}, or a section: {', '.join(SECTIONS)})")
        for key, item in value.items():
            kind = keys.get(key)
            if kind is None:
                raise ConfigError(
                    f"agent configuration: {name}.{key}: not a key this version knows "
                    f"(one of {', '.join(keys)})")
            # A bool is an int in Python: an int key refuses it, as TOML's types do.
            negative = isinstance(item, int) and item < 0
            if not isinstance(item, kind) or (kind is int and (isinstance(item, bool) or negative)):
                raise ConfigError(f"agent configuration: {name}.{key}: {item!r} is not a {_kind(kind)}")


def _kind(kind: type | tuple[type, ...]) -> str:
    return {str: "string", int: "non-negative integer", bool: "boolean", list: "list"}.get(
        kind if isinstance(kind, type) else str, "value")


def parse(text: str) -> dict[str, Any]:
    """The configuration in TOML ``text``, checked key by key."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"agent configuration: not TOML: {e}") from e
    _check(raw)
    return dict(raw)


def load(path: str | Path) -> dict[str, Any]:
    """The configuration in the file at ``path``, its ``[transport]`` files made relative to
    the file's directory."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror or e}") from e
    try:
        raw = parse(text)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    transport = raw.get("transport", {})
    for key, value in list(transport.items()):
        transport[key] = str(path.parent / value)
    return raw


def agent_arguments(raw: Mapping[str, Any], id: str | None = None) -> dict[str, Any]:
    """The :class:`~chorus_sdk.Agent` keyword arguments (``id`` among them) of a checked
    configuration, for agent ``id`` (or the file's)."""
    agent_id = id or raw.get("id")
    if not agent_id:
        raise ConfigError("agent configuration: id: no agent id: give one in the file or the code")
    out: dict[str, Any] = {"id": agent_id}
    bus = raw.get("bus", {})
    if "servers" in bus:
        out["servers"] = [s.strip() for s in bus["servers"].split(",") if s.strip()]
    if "root" in bus:
        out["root"] = bus["root"]
    if "encoding" in bus:
        out["encoding"] = _one_of("bus.encoding", bus["encoding"], ENCODINGS)
    if "groups" in bus:
        out["groups"] = list(bus["groups"])
    if "customer" in raw:
        try:
            out["customer"] = validate_token("customer", raw["customer"])
        except SubjectError as e:
            raise ConfigError(f"agent configuration: customer: {e}") from e
    if "batching" in raw:
        out["batching"] = _batching(raw["batching"])
    transport = raw.get("transport", {})
    nats: dict[str, Any] = {}
    if "tls_ca" in transport or "tls_cert" in transport:
        context = ssl.create_default_context(cafile=transport.get("tls_ca"))
        cert, key = transport.get("tls_cert"), transport.get("tls_key")
        if (cert is None) != (key is None):
            raise ConfigError("agent configuration: transport: a client certificate comes with its key")
        if cert is not None:
            context.load_cert_chain(cert, key)
        nats["tls"] = context
    seed: str | None = None
    if "nkey_seed_file" in transport:
        try:
            seed = Path(transport["nkey_seed_file"]).read_text().strip()
        except OSError as e:
            raise ConfigError(f"agent configuration: transport.nkey_seed_file: {e.strerror or e}") from e
        nats["nkeys_seed_str"] = seed
    if nats:
        out["nats_options"] = nats
    reliability = raw.get("reliability", {})
    if "default_delivery" in reliability:
        out["default_delivery"] = _one_of(
            "reliability.default_delivery", reliability["default_delivery"], DELIVERIES)
    if "request_timeout_ms" in reliability:
        out["request_timeout"] = reliability["request_timeout_ms"] / 1000
    for key in ("durable_inbox", "max_in_flight", "hop_limit"):
        if key in reliability:
            out[key] = reliability[key]
    if "shutdown_timeout_ms" in reliability:
        out["shutdown_timeout"] = reliability["shutdown_timeout_ms"] / 1000
    security = raw.get("security", {})
    if security.get("sign", seed is not None):
        if seed is None:
            raise ConfigError("agent configuration: security.sign: signing needs transport.nkey_seed_file")
        try:
            out["identity"] = Identity(seed)
        except ValueError as e:
            raise ConfigError(f"agent configuration: transport.nkey_seed_file: {e}") from e
    verify = security.get("verify_signatures", "off")
    required = _one_of("security.verify_signatures", verify, {"off": None, "check": False, "require": True})
    if required is not None:
        out["verifier"] = Verifier(require_signed=required)
    if "trust_unverified_senders" in security:
        out["trust_unverified_senders"] = security["trust_unverified_senders"]
    monitoring = raw.get("monitoring", {})
    if "heartbeat_interval_ms" in monitoring:
        out["heartbeat_interval"] = monitoring["heartbeat_interval_ms"] / 1000
    if "usage_interval_ms" in monitoring:
        out["usage_interval"] = monitoring["usage_interval_ms"] / 1000
    for key in ("service_discovery", "metrics_url"):
        if key in monitoring:
            out[key] = monitoring[key]
    return out


def _batching(section: Mapping[str, int]) -> Batching:
    """``[batching]``: the most messages a batch holds (1 to 10,000; default 100) and the
    longest it waits after its first message (``max_delay_ms``, above 0 and at most 60,000;
    default 5), each out of bounds refused by its key, as the Rust SDK refuses them."""
    default = Batching()
    max_messages = section.get("max_messages", default.max_messages)
    if not 1 <= max_messages <= MAX_BATCH_MESSAGES:
        raise ConfigError(
            f"agent configuration: batching.max_messages: between 1 and {MAX_BATCH_MESSAGES}, not {max_messages}")
    if "max_delay_ms" not in section:
        return Batching(max_messages, default.max_delay)
    max_delay_ms = section["max_delay_ms"]
    if not 0 < max_delay_ms <= MAX_BATCH_DELAY * 1000:
        raise ConfigError(
            f"agent configuration: batching.max_delay_ms: above 0 and at most {MAX_BATCH_DELAY * 1000:.0f}, "
            f"not {max_delay_ms}")
    return Batching(max_messages, max_delay_ms / 1000)


def _one_of(key: str, value: str, vocabulary: Mapping[str, Any]) -> Any:
    if value not in vocabulary:
        raise ConfigError(f"agent configuration: {key}: {value!r} is not {', '.join(vocabulary)}")
    return vocabulary[value]
