"""A Chorus agent in Python: commands, capabilities, events, request-reply, durable commands,
discovery, broadcast, tasks, heartbeats and goodbye, on NATS, speaking docs/PROTOCOL.md.

:class:`Agent` is the top of its layers (see :mod:`._state`): it connects, shuts down, and
submits and verifies tasks."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats
import nats.errors

from .context import Context, Reply
from . import service
from .tasks import Check, TaskHandle, TaskResult
from .tasks import verify as verify_task
from .tasks import submit as submit_task

from ._state import Payload, Stats
from .handlers import Handlers


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
        """Connects, subscribes every handler registered so far, and announces the agent."""
        options: dict[str, Any] = {"name": self.id, "inbox_prefix": self.subjects.reply_prefix(self.id).encode()}
        options.update(self.nats_options)
        # Bells may be lost while the connection is down: the durable inbox looks after it.
        user_reconnected = options.get("reconnected_cb")

        async def reconnected() -> None:
            for hook in list(self.reconnect_hooks):
                hook()
            if user_reconnected is not None:
                await user_reconnected()

        options["reconnected_cb"] = reconnected
        self._nc = await nats.connect(self.servers, **options)
        if self.max_message_bytes is None:
            self.max_message_bytes = self._nc.max_payload
        nc = self._nc
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
        if self._commands and self.durable_inbox:
            await self._start_durable()
        if self.heartbeat_interval > 0:
            await self._heartbeat()
            self.spawn(self._heartbeats(), name="chorus-heartbeats")
        return self

    async def flush(self) -> None:
        """Waits until what this agent sent, and subscriptions made by late registrations,
        have reached the server."""
        pending = [t for t in self._tasks if not t.done() and t.get_name() == "chorus-setup"]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await self.nc.flush()

    async def shutdown(self) -> None:
        """Says goodbye, stops taking messages, waits for running handlers (up to
        ``shutdown_timeout``), then closes the connection."""
        if self._nc is None or self._stopping:
            return
        self._stopping = True
        self._stopped.set()
        nc = self._nc
        try:
            if nc.is_connected and self.heartbeat_interval > 0:
                await self._send_presence(goodbye=True)
            for sub in self._subs:
                try:
                    await sub.unsubscribe()
                except Exception:  # noqa: BLE001 - the connection may be gone already
                    pass
            if self._durable is not None:
                await self._durable.stop()
            current = asyncio.current_task()
            for task in self._tasks:
                if task.get_name() == "chorus-heartbeats":
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
                await nc.drain()
            except Exception:  # noqa: BLE001
                await nc.close()
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
