"""A Chorus agent in Python: commands, capabilities, events, request-reply, durable commands,
discovery, broadcast, tasks, heartbeats and goodbye, on NATS, speaking docs/PROTOCOL.md.

:class:`Agent` is the top of its layers (see :mod:`._state`): it connects, shuts down, and
submits and verifies tasks."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any, Iterable

from nats.aio.client import Client as NATS

from ._connection import Connection, settle
from ._dispatch import subscribe
from .batch import Batcher
from .context import Context, Reply
from . import config, service
from .tasks import Check, TaskHandle, TaskReport, Verification
from .tasks import verify as verify_task
from .tasks import submit as submit_task

from ._keys import RegisteredKeys
from ._state import Payload, Stats, log
from .status import ChorusError, StatusCode, Unreachable
from .handlers import Handlers
from . import metrics
from .negotiate import DEFAULT_BID_DEADLINE, Award, CounterFn, Policy
from .negotiate import negotiate as run_negotiation
from .usage import LAST_REPORT_TIMEOUT


# The task that follows the registry's keys: stopped at shutdown, not waited for.
KEYS_TASK = "chorus-keys"
# How often an agent on a shared connection looks whether its owner closed it while it
# serves, and how long its shutdown waits for what it sent to be flushed, in seconds.
SHARED_CHECK_INTERVAL = 1.0
SHARED_FLUSH_TIMEOUT = 2


class Agent(Handlers):
    """One agent on a Chorus bus.

    ``async with Agent("summarizer", servers="nats://127.0.0.1:4222") as agent:`` connects,
    subscribes what its handlers need, announces itself, and on leaving says goodbye and waits
    for running handlers (up to ``shutdown_timeout``).

    It reports what it handled, per endpoint, customer and session, to the usage stream every
    ``usage_interval`` seconds (default 5; 0 turns it off) and once more at shutdown
    (:mod:`chorus_sdk.usage`). Given ``connection=`` (a connected nats-py client), it serves on
    that connection, shared with the process's other agents, instead of one of its own: its id,
    handlers, heartbeats and usage stay its own, and shutting it down leaves the connection
    open; its owner drains it after the last agent.
    """

    @classmethod
    def from_config(cls, path: str | Path, id: str | None = None, **overrides: Any) -> Agent:
        """The agent the configuration file at ``path`` describes (docs/AGENT-CONFIG.md, the
        file the Rust SDK reads with ``AgentOptions::from_file``): named ``id``, or the file's
        ``id``; keyword arguments given here win over the file. Raises
        :class:`~chorus_sdk.config.ConfigError` naming the key that cannot be used."""
        arguments = config.agent_arguments(config.load(path), id)
        arguments.update(overrides)
        agent_id = arguments.pop("id")
        return cls(agent_id, **arguments)

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
        tries of each server (saying where it tried and why it failed), or when the shared
        ``connection`` given is not connected."""
        shared = self._shared_connection
        if shared is not None:
            # The process's connection, shared with its other agents: used as it is (its
            # servers, name, credentials and reply prefix are its owner's).
            if not shared.is_connected:
                raise Unreachable(f"agent {self.id}: the connection it was given is not connected")
            self._nc = shared
        else:
            options: dict[str, Any] = {"name": self.id, "inbox_prefix": self.subjects.reply_prefix(self.id).encode()}
            options.update(self.nats_options)
            connection = Connection(self.id, self.servers, self.connect_attempts, self.reconnect_attempts, self._reconnected)
            self._connection = connection
            self.connection_events.watch(options, lambda: connection.state == "closing")
            self._nc = await connection.open(options)
        self._started.clear()
        try:
            await self._start()
        except BaseException:
            # Cancelled (Ctrl-C) or failed half way: nothing is left running.
            await self._abandon()
            raise
        # What came meanwhile is handled from the caller's next await on.
        self._started.set()
        return self

    async def _start(self) -> None:
        nc = self.nc
        if self.max_message_bytes is None:
            self.max_message_bytes = nc.max_payload
        await self._serve_metrics()
        self._subs.append(await subscribe(nc, self.subjects.agent_inbound(self.id), self._inbound("command")))
        for capability in list(self._capabilities):
            await self._subscribe_capability(capability)
        for pattern in list(self._events):
            await self._subscribe_event(pattern)
        for capability in list(self._bidding.bids):
            await self._subscribe_bid(capability)
        self._subs.append(await nc.subscribe(self.subjects.wire, cb=self._on_wire))
        if self.service_discovery:
            for subject in service.subjects(self.id, self.instance):
                self._subs.append(await nc.subscribe(subject, cb=self._on_service))
        await settle(nc)
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
        if (self._commands or self._notifications) and self.durable_inbox:
            await self._start_durable()
        if self.heartbeat_interval > 0:
            await self._heartbeat()
            self.spawn(self._heartbeats(), name="chorus-heartbeats")
        if self._usage.enabled:
            self.spawn(self._report_usage(), name="chorus-usage")

    async def _report_usage(self) -> None:
        """Stores what the agent counted in the usage stream every ``usage_interval`` seconds
        until it starts shutting down (the last report is made at shutdown, after its handlers
        finish); a report not stored goes with the next one."""
        while not self._stopping:
            try:
                await asyncio.wait_for(self._stopped.wait(), timeout=self.usage_interval)
                return
            except asyncio.TimeoutError:
                pass
            nc = self._nc
            if nc is None:
                return
            await self._usage.report(nc, self.subjects, self.request_timeout)

    async def _last_usage_report(self, nc: NATS) -> None:
        """Stores what was counted since the last usage report, waiting up to 2 s (at
        shutdown, after the handlers finish, before the connection goes)."""
        if not self._usage.pending:
            return
        try:
            stored = await asyncio.wait_for(
                self._usage.report(nc, self.subjects, LAST_REPORT_TIMEOUT), timeout=LAST_REPORT_TIMEOUT
            )
        except asyncio.TimeoutError:
            stored = self._usage.no_stream = False
        if stored:
            return
        if self._usage.no_stream:
            # No coordinator made the stream: nothing to store it in, as expected without one.
            log.debug("agent %s: the last usage report was not stored: no usage stream", self.id)
        else:
            log.warning("agent %s: the last usage report was not stored", self.id)

    async def _serve_metrics(self) -> None:
        """Makes this agent's counters visible in the process's metrics, and serves them on
        ``metrics_address`` when given (the URL the manifest announces derived from it when
        ``metrics_url`` is not given). Raises :class:`ChorusError` (5018) when it cannot
        listen there."""
        metrics.registry().track(self)
        if self._metrics_listen is None or self._metrics_server is not None:
            return
        where = self._metrics_listen
        try:
            self._metrics_server = await metrics.acquire(where)
        except OSError as e:
            raise ChorusError(
                StatusCode.INVALID_ARGUMENT,
                f"agent {self.id} cannot serve metrics on {where.host}:{where.port} ({e.strerror or e}): "
                "give another metrics_address, or port 0 for one the system picks",
            ) from None
        if self.metrics_url is None:
            self.metrics_url = self._metrics_server.url

    async def _stop_metrics(self) -> None:
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            await metrics.release(server)

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
        await self._stop_metrics()
        if nc is not None and self._shared_connection is None:
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - closing what may never have opened
                pass

    async def serve_forever(self) -> None:
        """Serves until the agent shuts down. Raises :class:`Unreachable` if its connection is
        lost for good (after ``reconnect_attempts`` failed tries); cancelling it (Ctrl-C under
        ``asyncio.run``) ends it as any other wait. On a shared connection, raises
        :class:`Unreachable` once its owner closes it."""
        connection = self._connection
        nc = self._nc
        if nc is not None and self._shared_connection is not None:
            while not self._stopped.is_set():
                if nc.is_closed:
                    raise Unreachable(f"agent {self.id}: the connection it shares was closed")
                try:
                    await asyncio.wait_for(self._stopped.wait(), timeout=SHARED_CHECK_INTERVAL)
                except asyncio.TimeoutError:
                    pass
            return
        if nc is None or connection is None:
            raise Unreachable(f"agent {self.id} is not connected")
        waits = [asyncio.ensure_future(self._stopped.wait()), asyncio.ensure_future(connection.closed.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if connection.lost is not None:
            raise Unreachable(connection.lost.reason)

    def batcher(self, max_messages: int | None = None, max_delay: float | None = None) -> Batcher:
        """A publisher that gathers this agent's events and one-way commands into batches of up
        to ``max_messages`` or ``max_delay`` seconds (:class:`~chorus_sdk.batch.Batcher`; the
        Rust SDK's ``Agent::batcher``). Either not given is the agent's own batching
        (``batching=``, ``[batching]`` in its configuration file; by default 100 messages or
        5 ms), as the Rust SDK's ``Agent::default_batcher``. Raises :class:`ChorusError` (5018)
        for settings out of bounds, (5019) once the agent is shutting down."""
        own = self.batching
        return Batcher(
            self,
            own.max_messages if max_messages is None else max_messages,
            own.max_delay if max_delay is None else max_delay,
        )

    async def flush(self) -> None:
        """Waits until what this agent sent, and subscriptions made by late registrations,
        have reached the server."""
        pending = [t for t in self._tasks if not t.done() and t.get_name() == "chorus-setup"]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await settle(self.nc)

    async def shutdown(self) -> None:
        """Says goodbye, stops taking messages, waits for running handlers (up to
        ``shutdown_timeout``), stores its last usage report (up to 2 s), then closes the
        connection; cancelled half way, it still closes the connection. A shared connection
        is left open to its owner (this agent's subscriptions are gone from it)."""
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
            for sub in [*self._subs, *self._replies.stop()]:
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
            # What was handled since the last usage report, stored before the connection goes.
            await self._last_usage_report(nc)
        finally:
            shared = self._shared_connection is not None
            try:
                if shared:
                    # Its owner's, serving the process's other agents: only what this agent
                    # sent (its goodbye, its unsubscriptions) is flushed.
                    if nc.is_connected:
                        await settle(nc, SHARED_FLUSH_TIMEOUT)
                elif nc.is_connected:
                    await nc.drain()
                else:
                    await nc.close()
            except BaseException as e:
                try:
                    if not shared:
                        await nc.close()
                except Exception:  # noqa: BLE001 - closed as far as it can be
                    pass
                if not isinstance(e, Exception):
                    raise
            finally:
                self._nc = None
                await self._stop_metrics()

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
        headers: dict[str, str] | None = None,
        session: str | None = None,
        customer: str | None = None,
    ) -> TaskHandle:
        """Submits a task to agent ``to``'s task ``name``, or to a ``capability`` (any holder,
        or ``to``'s own access point), and returns its handle once a worker has taken it.
        ``deadline`` (seconds from now) expires it; ``session`` and ``customer`` say whom it
        is for (the envelope's ``session_id`` and ``customer_id``, carried by its worker's
        messages and handoffs). Raises :class:`ChorusError` with the code when nobody takes it
        (the task is then recorded ``rejected``)."""
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
            headers=headers,
            session=session,
            customer=customer,
        )

    async def verify(self, handle: TaskHandle, verification: Verification | Check, **policy: Any) -> TaskReport:
        """Sees a task submitted with ``verify=True`` through to its end and returns its report
        (every attempt, its agent, timing and verdict): each attempt's result is judged by
        ``verification`` (a :class:`~chorus_sdk.tasks.Verification`: a function, a JSON
        Schema or a supervisor agent, with its policy), or by a check function with the policy
        as keywords (``max_attempts=3``, ``retries=0``, ``reassign=True``, ``candidates=``,
        ``escalate_to=``); a failed result is retried, reassigned or escalated, and the task
        fails with 5025 when no attempt passes. See :func:`chorus_sdk.tasks.verify`."""
        if not isinstance(verification, Verification):
            verification = Verification.function(verification, **policy)
        elif policy:
            verification = verification.with_policy(**policy)
        return await verify_task(self, handle, verification, discover=self.discover)

    def task_handle(self, task: uuid.UUID | str) -> TaskHandle:
        """The handle of a task submitted earlier (after a restart, say), by its id."""
        task = task if isinstance(task, uuid.UUID) else uuid.UUID(task)
        return TaskHandle(self, self._task_worker.store, task)

    # -----------------------------------------------------------------------------------------
    # Contract-net

    async def negotiate(
        self,
        capability: str,
        payload: Payload = None,
        *,
        content_type: str | None = None,
        bidders: Iterable[str] | None = None,
        deadline: float = DEFAULT_BID_DEADLINE,
        policy: Policy | str = Policy.CHEAPEST,
        counter: CounterFn | None = None,
        counter_rounds: int = 1,
        task_deadline: float | None = None,
        customer: str | None = None,
    ) -> Award:
        """Runs a contract-net round (section 7.10): calls for proposals on ``capability``
        from its live holders (from discovery) or the ``bidders`` named, waits up to
        ``deadline`` seconds, lets ``counter`` put an offer to each proposal (up to
        ``counter_rounds`` times; a proposer answers with a new proposal, or refuses and its
        proposal stands), ranks what stands by ``policy`` (:class:`Policy` or its name) and
        gives the work (``payload``) to the best as a task with ``task_deadline`` (the next
        best if it will not take it), tells the other proposers they lost, and publishes a
        :class:`Settlement` on ``negotiation.settled``. A price agreed is recorded in the credits
        ledger (:meth:`ledger`), under ``customer`` when given (the winner's task carries it
        too). Returns the :class:`Award`.

        Raises :class:`ValueError` for a bad capability, deadline, policy or counter setting,
        or more than 1,000 bidders (:class:`TypeError` for ``bidders`` given as one string);
        :class:`NoResponders` when there is no bidder to ask; :class:`NoAward` (5019, a
        :class:`Refused`) when no proposal was awarded, its reason saying what each bidder
        answered; without named bidders, what :meth:`discover` raises."""
        return await run_negotiation(
            self,
            capability,
            payload,
            content_type=content_type,
            bidders=bidders,
            deadline=deadline,
            policy=policy,
            counter=counter,
            counter_rounds=counter_rounds,
            task_deadline=task_deadline,
            customer=customer,
        )



__all__ = ["Agent", "Stats", "Context", "Reply"]
