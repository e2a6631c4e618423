"""Keys other agents announce in the registry, as the Rust SDK learns them
(``agent-sdk/src/presence/keys.rs``): each registered agent's signing key (``public_key`` in
its manifest) is trusted for the signature check under its registry key, and its encryption
key (``encryption_key``) is used to seal payloads for it; an entry deleted (the agent left or
expired) forgets its signing key. A key the registry announces replaces one given by hand, as
in Rust. Without a registry bucket (no coordinator), only keys given by hand are known."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ._connection import describe
from .signing import Verifier
from .subjects import Subjects

log = logging.getLogger("chorus_sdk")

#: Suffix of the registry bucket's name (``<root>_registry``, dots of the root as ``_``).
REGISTRY_BUCKET = "registry"

_DELETES = ("DEL", "PURGE")


class RegisteredKeys:
    """Follows the registry bucket for one agent, feeding its verifier and its table of
    encryption keys."""

    def __init__(self, agent: str, subjects: Subjects, verifier: Verifier | None, encryption_keys: dict[str, str]) -> None:
        self.agent = agent
        self.bucket = subjects.bucket_name(REGISTRY_BUCKET)
        self.verifier = verifier
        self.encryption_keys = encryption_keys
        #: Set once the entries present when the watch started have been read.
        self.ready = asyncio.Event()
        self._watcher: Any = None
        #: Keys found unusable, per agent, so that each is warned about once.
        self._unusable: dict[str, str] = {}

    async def open(self, nc: Any) -> bool:
        """Starts watching the bucket; False when there is none (or it cannot be read)."""
        try:
            kv = await nc.jetstream().key_value(self.bucket)
            self._watcher = await kv.watchall()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - no coordinator, or no JetStream: keys by hand only
            log.debug("agent %s: no registry bucket %s (%s): only keys given by hand are known", self.agent, self.bucket, describe(e))
            self.ready.set()
            return False
        return True

    async def follow(self) -> None:
        """Applies every change of the registry until stopped (cancelled, or the watch ends)."""
        watcher = self._watcher
        if watcher is None:
            return
        try:
            async for entry in watcher:
                if entry is None:
                    # The marker after the entries that were there when the watch started.
                    self.ready.set()
                    continue
                try:
                    self.apply(str(entry.key), entry.operation, entry.value)
                except Exception as e:  # noqa: BLE001 - one bad entry never ends the watch
                    log.debug("agent %s: registry entry %s not read: %s", self.agent, entry.key, describe(e))
        finally:
            self.ready.set()
            await self.stop()

    async def stop(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            try:
                await watcher.stop()
            except Exception:  # noqa: BLE001 - the connection may be gone already
                pass

    def apply(self, agent: str, operation: str | None, value: bytes | None) -> None:
        """One registry change: ``agent``'s record put (its keys learned) or deleted (its
        signing key forgotten)."""
        if operation in _DELETES:
            if self.verifier is not None:
                self.verifier.unlearn(agent)
            return
        try:
            record = json.loads(value or b"")
        except (ValueError, UnicodeDecodeError):
            return
        manifest = record.get("manifest") if isinstance(record, dict) else None
        if not isinstance(manifest, dict):
            return
        public_key = manifest.get("public_key")
        if self.verifier is not None and isinstance(public_key, str) and self.verifier.key_of(agent) != public_key:
            try:
                self.verifier.learn(agent, public_key)
            except ValueError:
                if self._unusable.get(agent) != public_key:
                    self._unusable[agent] = public_key
                    log.warning("agent %s: ignoring an unusable public key registered for %s", self.agent, agent)
        encryption_key = manifest.get("encryption_key")
        if isinstance(encryption_key, str):
            self.encryption_keys[agent] = encryption_key
