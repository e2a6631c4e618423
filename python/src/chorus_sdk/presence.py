"""An agent's presence: its capability manifest in heartbeats and a goodbye, answers to NATS
service discovery (``$SRV``), and the bus's wire level it follows."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from nats.aio.msg import Msg

from . import __version__
from .codec import F32, DecodeError, Json, Struct, decode, decode_payload, encode_struct
from .envelope import CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, Envelope, Kind, Performative, Priority
from .eta import PRIORITIES, estimate_eta_ms, waiting_at_or_above
from . import service
from .payloads import ZSTD
from .service import EndpointStats
from .status import ChorusError, StatusCode

from ._state import COORDINATOR_ID, log
from .inbound import Inbound

# How long a heartbeat waits after a change of the manifest, for the changes that follow it.
CHANGE_SETTLE = 0.05

# The keys of the manifest's ``waiting``, in the order the handler slots count them.
WAITING_KEYS = tuple(p.value for p in PRIORITIES)


class Presence(Inbound):
    """The presence layer of an agent."""

    # -----------------------------------------------------------------------------------------
    # Presence

    def manifest(self) -> bytes:
        """This agent's capability manifest (section 7.7), MessagePack."""
        load = self._busy / self.max_in_flight if self.max_in_flight else 0.0
        fields: list[tuple[str, Any]] = [
            ("agent", self.id),
            ("instance", self.instance),
            ("capabilities", [self._capability_info(c) for c in sorted(self._capabilities)]),
            ("commands", sorted(self._commands)),
            ("groups", sorted(self.groups)),
            # The customer it is dedicated to, when it is (section 7.7); unsaid, every one.
            *([("customer", self.customer)] if self.customer is not None else []),
            ("content_types", [CONTENT_TYPE_MSGPACK, CONTENT_TYPE_JSON]),
            ("load", F32(min(load, 1.0))),
            ("slots", self.max_in_flight),
            ("availability", "away" if self._stopping else ("busy" if load >= 1.0 else "available")),
        ]
        # How long its handlers take lately, what waits for a slot, and the ETA of new work of
        # normal priority both give (IACP's eta_seconds), once it has handled something.
        handling = self._handling.agent.ms
        waiting = self._slots.waiting_by_class
        if handling is not None:
            # The handlers busy as the announced load says, as the coordinator reads it.
            slots = max(self.max_in_flight, 1)
            busy = math.floor(min(load, 1.0) * slots + 0.5)
            ahead = waiting_at_or_above(dict(zip(WAITING_KEYS, waiting)), Priority.NORMAL)
            fields.append(("eta_ms", estimate_eta_ms(handling, slots, busy, ahead)))
            fields.append(("handling_ms", handling))
        if any(waiting):
            fields.append(("waiting", Struct([(k, n) for k, n in zip(WAITING_KEYS, waiting) if n])))
        if self.identity is not None:
            fields.append(("public_key", self.identity.public_key))
        if self.encryption_key is not None:
            fields.append(("encryption_key", self.encryption_key.public_key))
        fields += [
            ("heartbeat_ms", int(self._beat_every * 1000)),
            ("started_ms", self.started_ms),
            ("sdk_version", __version__),
        ]
        if self.metrics_url is not None:
            # Where this process serves its metrics: the coordinator's /sd/agents lists it.
            fields.append(("metrics_url", self.metrics_url))
        fields += [
            ("wire_versions", [1, 2]),
        ]
        if self.payload_limits.accept_compressed:
            # Senders compress large payloads for it (section 7.11).
            fields.append(("content_encodings", [ZSTD]))
        endpoints = self._endpoint_infos()
        if endpoints:
            fields.append(("endpoints", endpoints))
        open_circuits = self._breakers.open()
        if open_circuits:
            fields.append(("open_circuits", open_circuits))
        return encode_struct(fields)

    def beat_interval(self) -> float:
        """Seconds until the next heartbeat: the agent's interval, or the bus's heartbeat floor
        when that is longer (docs/PROTOCOL.md section 3.5)."""
        return max(self.heartbeat_interval, self._heartbeat_floor)

    def _capability_info(self, capability: str) -> Struct:
        """What the manifest says of one capability: its name and version, the most tokens one
        request may carry (when the agent says), and how long it takes lately (once it ran)."""
        info: list[tuple[str, Any]] = [("name", capability), ("version", self.capability_version)]
        max_tokens = self.capability_max_tokens.get(capability)
        if max_tokens is not None:
            info.append(("max_tokens", max_tokens))
        handling = self._handling.ms("capability", capability)
        if handling is not None:
            info.append(("handling_ms", handling))
        return Struct(info)

    def _endpoint_infos(self) -> list[Struct]:
        """What the manifest says of the commands and capabilities still served that say
        something: commands first, then capabilities, each by name."""
        served = {"command": self._commands, "capability": self._capabilities}
        infos = []
        for (kind, name), said in sorted(self._endpoints.items(), key=lambda e: (e[0][0] != "command", e[0][1])):
            if name not in served[kind]:
                continue
            info: list[tuple[str, Any]] = [("name", name), ("kind", kind)]
            if said.get("description") is not None:
                info.append(("description", said["description"]))
            if said.get("input_schema") is not None:
                info.append(("input_schema", Json(said["input_schema"])))
            if said.get("task"):
                info.append(("task", True))
            if said.get("reply") is not None:
                info.append(("reply", said["reply"]))
            infos.append(Struct(info))
        return infos

    async def _send_presence(self, goodbye: bool = False) -> None:
        env = Envelope.new(Kind.HEARTBEAT, Performative.DONE if goodbye else Performative.HEALTH, self.id)
        self._beat_every = self.beat_interval()
        env.payload = self.manifest()
        if goodbye:
            env.status = StatusCode.DISCONNECTED
        subject = self.subjects.goodbye(self.id) if goodbye else self.subjects.heartbeat(self.id)
        await self._publish_envelope(subject, env)

    async def _heartbeat(self) -> None:
        try:
            await self._send_presence()
        except Exception as e:  # noqa: BLE001 - the next beat tries again
            log.debug("heartbeat not sent: %s", e)

    async def _heartbeats(self) -> None:
        # A breaker that opens or closes is announced at once (``open_circuits``), not at the
        # next beat.
        changed = asyncio.Event()
        self._breakers.on_change.append(lambda _destination, _state: changed.set())
        while not self._stopping:
            try:
                # The wait the last beat announced (its ``heartbeat_ms``).
                await asyncio.wait_for(changed.wait(), timeout=self._beat_every)
                # The changes that follow within CHANGE_SETTLE go out in the same beat.
                await asyncio.sleep(CHANGE_SETTLE)
            except asyncio.TimeoutError:
                pass
            changed.clear()
            if not self._stopping:
                await self._heartbeat()

    async def _on_service(self, msg: Msg) -> None:
        if not msg.reply:
            return
        endpoints = [
            (name, self.subjects.command(self.id, name), "", self._endpoint_stats.setdefault(name, EndpointStats()))
            for name in sorted(self._commands)
        ] + [
            (
                name,
                self.subjects.capability(name),
                self.subjects.capability(name),
                self._endpoint_stats.setdefault(name, EndpointStats()),
            )
            for name in sorted(self._capabilities)
        ]
        body = service.answer(
            msg.subject.split(".")[1],
            agent=self.id,
            instance=self.instance,
            version=__version__,
            root=self.subjects.root,
            capabilities=sorted(self._capabilities),
            endpoints=endpoints,
            started_ms=self.started_ms,
        )
        if body is not None:
            await self.nc.publish(msg.reply, body)

    async def _on_wire(self, msg: Msg) -> None:
        try:
            env, _ = decode(msg.data, self.subjects.implied(msg.subject))
            level = decode_payload(env.payload, env.content_type)
        except DecodeError:
            return
        why = self._not_coordinators_word(msg.subject, env)
        if why is not None:
            self.stats.security_refused += 1
            log.warning("agent %s: an announcement on the wire subject from %s ignored: %s", self.id, env.from_, why)
            return
        self._take_wire(level)

    def _not_coordinators_word(self, subject: str, env: Envelope) -> str | None:
        """Why ``env`` (received on ``subject``) is not the coordinator's word, or ``None``: it
        must come from ``coordinator``, and where this agent verifies signatures and knows the
        coordinator's key, be signed with it (as the Rust SDK holds it)."""
        if env.from_ != COORDINATOR_ID:
            return f"{env.from_} is not the coordinator"
        verifier = self.verifier
        if verifier is None or verifier.key_of(COORDINATOR_ID) is None:
            return None
        if env.signature is None:
            return "unsigned, and the coordinator's key is known"
        try:
            verifier.verify(subject, env)
        except ChorusError as e:
            return f"{e.status}: {e.reason}"
        return None
