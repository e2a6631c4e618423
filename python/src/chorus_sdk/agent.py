"""A Chorus agent in Python: commands, capabilities, events, request-reply, durable commands,
discovery, broadcast, tasks, heartbeats and goodbye, on NATS, speaking docs/PROTOCOL.md.

:class:`Agent` is the top of its layers (see :mod:`._state`): it connects, shuts down, and
submits and verifies tasks."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from ._connection import Connection
from .context import Context, Reply
from . import service
from .tasks import Check, TaskHandle, TaskResult
from .tasks import verify as verify_task
from .tasks import submit as submit_task

from ._keys import RegisteredKeys
from ._state import Payload, Stats, log
from .status import Unreachable
from .handlers import Handlers


# The task that follows the registry's keys: stopped at shutdown, not waited for.
KEYS_TASK = "chorus-keys"


class Agent(Handlers):
    """One agent on a Chorus bus.

    ``async with Agent("summarizer", servers="nats://127.0.0.1:4222") as agent:`` connects,
    subscribes what its handlers need, announces itself, and on leaving says goodbye and waits
    for running handlers (up to ``shutdown_timeout``).
    """

    # -----------------------------------------------------------------------------------------
    # Life cycle

    async def __aenter__(self) -> Agent:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def connect(self) -> Agent:
        """Connects, subscribes every handler registered so far, and announces the agent.

        Raises :class:`Unreachable` when the bus cannot be reached in ``connect_attempts``
        tries of each server (saying where it tried and why it failed)."""
        options: dict[str, Any] = {"name": self.id, "inbox_prefix": self.subjects.reply_prefix(self.id).encode()}
        options.update(self.nats_options)
        connection = Connection(self.id, self.servers, self.connect_attempts, self.reconnect_attempts, self._reconnected)
        self._connection = connection
        self._nc = await connection.open(options)
        try:
            await self._start()
        except BaseException:
            # Cancelled (Ctrl-C) or failed half way: nothing is left running.
            await self._abandon()
            raise
        return self

    async def _start(self) -> None:
        nc = self.nc
        if self.max_message_bytes is None:
            self.max_message_bytes = nc.max_payload
        self._subs.append(await nc.subscribe(self.subjects.agent_inbound(self.id), cb=self._inbound("command")))
        for capability in list(self._capabilities):
            await self._subscribe_capability(capability)
        for pattern in list(self._events):
            await self._subscribe_event(pattern)
        self._subs.append(await nc.subscribe(self.subjects.wire, cb=self._on_wire))
        if self.service_discovery:
            for subject in service.subjects(self.id, self.instance):
                self._subs.append(await nc.subscribe(subject, cb=self._on_service))
        await nc.flush()
        if self.verifier is not None or self.encryption_key is not None:
            # Signing and encryption keys announced in the registry, as the Rust SDK learns
            # them; the entries already there are read before the agent starts taking work.
            keys = RegisteredKeys(self.id, self.subjects, self.verifier, self._encryption_trust)
            if await keys.open(nc):
                self.spawn(keys.follow(), name=KEYS_TASK)
                try:
                    await asyncio.wait_for(keys.ready.wait(), timeout=self.request_timeout)
                except asyncio.TimeoutError:
                    log.warning("agent %s: the registry's keys were not all read within %.1f s", self.id, self.request_timeout)
        if self._commands and self.durable_inbox:
            await self._start_durable()
        if self.heartbeat_interval > 0:
            await self._heartbeat()
            self.spawn(self._heartbeats(), name="chorus-heartbeats")

    async def _reconnected(self) -> None:
        # Bells may be lost while the connection is down: the durable inbox looks after it.
        for hook in list(self.reconnect_hooks):
            hook()

    async def _abandon(self) -> None:
        """Stops what a connect that did not finish started, and closes its connection."""
        nc, self._nc = self._nc, None
        if self._connection is not None:
            self._connection.closing()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
        if nc is not None:
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - closing what may never have opened
                pass

    async def serve_forever(self) -> None:
        """Serves until the agent shuts down. Raises :class:`Unreachable` if its connection is
        lost for good (after ``reconnect_attempts`` failed tries); cancelling it (Ctrl-C under
        ``asyncio.run``) ends it as any other wait."""
        connection = self._connection
        if self._nc is None or connection is None:
            raise Unreachable(f"agent {self.id} is not connected")
        waits = [asyncio.ensure_future(self._stopped.wait()), asyncio.ensure_future(connection.closed.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if connection.lost is not None:
            raise Unreachable(connection.lost.reason)

    async def flush(self) -> None:
        """Waits until what this agent sent, and subscriptions made by late registrations,
        have reached the server."""
        pending = [t for t in self._tasks if not t.done() and t.get_name() == "chorus-setup"]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await self.nc.flush()

    async def shutdown(self) -> None:
        """Says goodbye, stops taking messages, waits for running handlers (up to
        ``shutdown_timeout``), then closes the connection; cancelled half way, it still
        closes the connection."""
        if self._nc is None or self._stopping:
            return
        self._stopping = True
        self._stopped.set()
        nc = self._nc
        if self._connection is not None:
            self._connection.closing()
        try:
            if nc.is_connected and self.heartbeat_interval > 0:
                try:
                    await self._send_presence(goodbye=True)
                except Exception as e:  # noqa: BLE001 - leaving all the same
                    log.debug("agent %s: goodbye not sent: %s", self.id, e)
            for sub in self._subs:
                try:
                    await sub.unsubscribe()
                except Exception:  # noqa: BLE001 - the connection may be gone already
                    pass
            if self._durable is not None:
                await self._durable.stop()
            current = asyncio.current_task()
            for task in self._tasks:
                if task.get_name() in ("chorus-heartbeats", KEYS_TASK):
                    task.cancel()
            running = [t for t in self._tasks if t is not current]
            if running:
                _, late = await asyncio.wait(running, timeout=self.shutdown_timeout)
                for task in late:
                    task.cancel()
                if late:
                    await asyncio.wait(late, timeout=1.0)
        finally:
            try:
                if nc.is_connected:
                    await nc.drain()
                else:
                    await nc.close()
            except BaseException as e:
                try:
                    await nc.close()
                except Exception:  # noqa: BLE001 - closed as far as it can be
                    pass
                if not isinstance(e, Exception):
                    raise
            finally:
                self._nc = None

    # -----------------------------------------------------------------------------------------
    # Tasks

    async def submit(
        self,
        payload: Payload = None,
        *,
        to: str | None = None,
        name: str | None = None,
        capability: str | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        verify: bool = False,
    ) -> TaskHandle:
        """Submits a task to agent ``to``'s task ``name``, or to a ``capability`` (any holder,
        or ``to``'s own access point), and returns its handle once a worker has taken it.
        ``deadline`` (seconds from now) expires it. Raises :class:`ChorusError` with the code
        when nobody takes it (the task is then recorded ``rejected``)."""
        if capability is None and (to is None or name is None):
            raise ValueError("submit needs to= and name=, or capability=")
        return await submit_task(
            self,
            self._task_worker.store,
            payload,
            to=to,
            name=name,
            capability=capability,
            deadline=deadline,
            timeout=self.request_timeout if timeout is None else timeout,
            verify=verify,
        )

    async def verify(
        self,
        handle: TaskHandle,
        check: Check,
        *,
        max_attempts: int = 3,
        retries: int = 0,
        candidates: tuple[str, ...] | list[str] = (),
        supervisor: str | None = None,
    ) -> TaskResult:
        """Judges each result of a task submitted with ``verify=True`` until one passes or the
        attempts run out (then 5025); see :func:`chorus_sdk.tasks.verify`."""
        return await verify_task(
            self,
            handle,
            check,
            max_attempts=max_attempts,
            retries=retries,
            candidates=candidates,
            supervisor=supervisor,
        )

    def task_handle(self, task: uuid.UUID | str) -> TaskHandle:
        """The handle of a task submitted earlier (after a restart, say), by its id."""
        task = task if isinstance(task, uuid.UUID) else uuid.UUID(task)
        return TaskHandle(self, self._task_worker.store, task)



__all__ = ["Agent", "Stats", "Context", "Reply"]
