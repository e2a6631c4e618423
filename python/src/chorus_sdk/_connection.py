"""An agent's connection to NATS and what it says about it: one log line per change of state
(cannot connect, disconnected and reconnecting, reconnected, gave up), never a traceback for
what the network does, and bounded tries.

nats-py calls an error callback on every failed attempt, and its default logs a traceback
each time; here each failure is counted instead, against ``connect_attempts`` while the first
connection is made (then :class:`~chorus_sdk.Unreachable`) and ``reconnect_attempts`` after a
loss (then the connection is closed and the agent says it gave up)."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit, urlunsplit
from typing import Any, Awaitable, Callable

import nats.errors
from nats.aio.client import Client as NATS

from .status import Unreachable

log = logging.getLogger("chorus_sdk")

#: What an error in the connection's first attempts says to do about it.
HINT = "Is a NATS server running there? From a clone of Chorus, scripts/up starts one."

#: What a send raises when the connection is not there to take it: an expected condition,
#: logged in a line, never with a traceback.
CONNECTION_GONE: tuple[type[BaseException], ...] = (
    Unreachable,
    OSError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
)


def describe(error: BaseException) -> str:
    """An error in one line: its message, or its type when it has none."""
    if isinstance(error, asyncio.TimeoutError):
        return "timed out"
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def without_credentials(url: str) -> str:
    """``url`` without a user or password in it, to be logged."""
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        if parts.username is None and parts.password is None:
            return url
        host = parts.hostname or ""
        return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host))
    except ValueError:
        return "(a server URL that does not parse)"


#: Round trips :func:`settle` makes at most while commands are still queued to be written.
SETTLE_ROUNDS = 3


async def settle(nc: NATS, timeout: float | None = None) -> None:
    """Returns once the server has every command this connection sent so far: its
    subscriptions, unsubscriptions and publishes. nats-py's ``flush`` writes its PING at once,
    ahead of commands still queued for its writer task, so the PONG can come back before the
    server has them (a request sent right after could find no subscription yet); a PING sent
    with nothing queued comes after them. So it flushes again while something was queued when
    the PING went, a few rounds at most (a connection publishing all the while is settled as
    far as it can be)."""
    for _ in range(SETTLE_ROUNDS):
        queued = nc.pending_data_size > 0
        if timeout is None:
            await nc.flush()
        else:
            await nc.flush(timeout)  # type: ignore[arg-type]
        if not queued:
            return


class Connection:
    """The NATS connection of agent ``agent`` and its states: ``connecting`` (the first
    connection), ``connected``, ``reconnecting`` (after a loss), ``closing`` (the agent shuts
    down) and ``closed`` (shut down, or given up)."""

    def __init__(
        self,
        agent: str,
        servers: list[str],
        connect_attempts: int | None,
        reconnect_attempts: int | None,
        on_reconnected: Callable[[], Awaitable[None]],
    ) -> None:
        # The attempts are checked where they are given, in the agent's constructor.
        self.agent = agent
        self.servers = servers
        self.connect_attempts = connect_attempts
        self.reconnect_attempts = reconnect_attempts
        self._on_reconnected = on_reconnected
        self.state = "connecting"
        #: Failed attempts in a row, in the current state.
        self.failures = 0
        self._last_error: BaseException | None = None
        self._slow_consumer_drops = 0
        #: Why the connection was given up, once it was.
        self.lost: Unreachable | None = None
        #: Set when the connection is closed for good (shut down or given up).
        self.closed = asyncio.Event()
        self._nc: NATS | None = None
        self._closer: asyncio.Task[None] | None = None
        self._allow_reconnect = True
        #: The server connected to, as it can be logged.
        self._url: str | None = None

    @property
    def urls(self) -> str:
        return ", ".join(without_credentials(s) for s in self.servers)

    async def open(self, options: dict[str, Any]) -> NATS:
        """Connects with nats-py ``options`` (the caller's own callbacks among them are called
        too); raises :class:`Unreachable` when the bus cannot be reached in
        ``connect_attempts``."""
        user = {name: options.pop(name, None) for name in ("error_cb", "disconnected_cb", "reconnected_cb", "closed_cb")}
        # nats-py's own bound on reconnects (60 by default) is replaced by ours; unbounded for
        # it, so that its first connect keeps trying until this class says how many is enough.
        options.setdefault("max_reconnect_attempts", -1)
        self._allow_reconnect = bool(options.get("allow_reconnect", True))

        async def error_cb(error: Exception) -> None:
            self._on_error(error)
            if user["error_cb"] is not None:
                await user["error_cb"](error)

        async def disconnected_cb() -> None:
            self._on_disconnected()
            if user["disconnected_cb"] is not None:
                await user["disconnected_cb"]()

        async def reconnected_cb() -> None:
            await self._reconnected()
            if user["reconnected_cb"] is not None:
                await user["reconnected_cb"]()

        async def closed_cb() -> None:
            if self.state != "closed":
                self.state = "closed"
            self.closed.set()
            if user["closed_cb"] is not None:
                await user["closed_cb"]()

        nc = NATS()
        self._nc = nc
        try:
            await nc.connect(
                self.servers,
                error_cb=error_cb,
                disconnected_cb=disconnected_cb,
                reconnected_cb=reconnected_cb,
                closed_cb=closed_cb,
                **options,
            )
        except BaseException as e:
            self.state = "closed"
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - nothing more to do for a connection never made
                pass
            self.closed.set()
            if isinstance(e, Unreachable):
                cause = e.__cause__
            elif isinstance(e, (OSError, nats.errors.Error, asyncio.TimeoutError)):
                cause = e
            else:
                raise
            # Raised from here, its cause kept without nats-py's frames: an expected condition,
            # said in the message, not a crash to debug.
            if cause is not None:
                cause = cause.with_traceback(None)
            raise Unreachable(str(e.reason) if isinstance(e, Unreachable) else self._unreachable(e)) from cause
        self.state = "connected"
        self.failures = 0
        self._url = self._connected_url(nc)
        log.debug("agent %s: connected to %s", self.agent, self._url)
        return nc

    def closing(self) -> None:
        """The agent shuts down: what the connection does from now on is expected."""
        if self.state != "closed":
            self.state = "closing"

    # -----------------------------------------------------------------------------------------
    # nats-py's callbacks

    def _on_error(self, error: Exception) -> None:
        self._last_error = error
        if self.state == "connecting":
            self.failures += 1
            budget = None if self.connect_attempts is None else self.connect_attempts * max(len(self.servers), 1)
            if budget is not None and self.failures >= budget:
                # Raised out of nats-py's connect loop, which then stops trying.
                raise Unreachable(self._unreachable(error)) from error
            if self.failures == 1:
                tries = "keeps trying" if budget is None else f"tries {self.connect_attempts} times in all"
                log.warning(
                    "agent %s: cannot connect to %s (%s); it %s",
                    self.agent,
                    self.urls,
                    describe(error),
                    tries,
                )
        elif self.state == "reconnecting":
            if isinstance(error, nats.errors.SlowConsumerError):
                return
            self.failures += 1
            if self.reconnect_attempts is not None and self.failures >= self.reconnect_attempts:
                self._give_up(error)
            else:
                log.debug("agent %s: reconnect attempt %d failed: %s", self.agent, self.failures, describe(error))
        elif self.state == "connected":
            if isinstance(error, nats.errors.SlowConsumerError):
                # One per dropped message: the first and then at powers of two.
                self._slow_consumer_drops += 1
                n = self._slow_consumer_drops
                if n & (n - 1) == 0:
                    log.warning(
                        "agent %s: slow consumer: messages dropped for a full subscription buffer (%d so far)",
                        self.agent,
                        n,
                    )
            elif isinstance(error, (OSError, nats.errors.UnexpectedEOF, nats.errors.StaleConnectionError)):
                # The connection going: said once, by the disconnect.
                log.debug("agent %s: connection error: %s", self.agent, describe(error))
            else:
                log.warning("agent %s: NATS: %s", self.agent, describe(error))
        else:
            log.debug("agent %s: while closing: %s", self.agent, describe(error))

    def _on_disconnected(self) -> None:
        if self.state != "connected":
            return
        self.state = "reconnecting"
        self.failures = 0
        why = f" ({describe(self._last_error)})" if self._last_error is not None else ""
        self._last_error = None
        if self.reconnect_attempts == 0 or not self._allow_reconnect:
            self._give_up(None)
            return
        log.warning("agent %s: disconnected from %s%s; reconnecting", self.agent, self._url or self.urls, why)

    async def _reconnected(self) -> None:
        if self.state != "reconnecting":
            return
        self.state = "connected"
        tries = self.failures + 1
        self.failures = 0
        if self._nc is not None:
            self._url = self._connected_url(self._nc)
        log.warning(
            "agent %s: reconnected to %s (after %d attempt%s)",
            self.agent,
            self._url or self.urls,
            tries,
            "" if tries == 1 else "s",
        )
        await self._on_reconnected()

    def _give_up(self, error: BaseException | None) -> None:
        why = f" (last: {describe(error)})" if error is not None else ""
        tries = f"after {self.failures} attempt{'' if self.failures == 1 else 's'}" if self.failures else "at once"
        self.lost = Unreachable(
            f"agent {self.agent} lost its connection to {self._url or self.urls} and gave up reconnecting {tries}{why}"
        )
        self.state = "closed"
        log.error("%s", self.lost.reason)
        nc = self._nc
        if nc is not None:
            # Closed from a task of its own: this runs inside nats-py's reconnecting task,
            # which closing cancels.
            self._closer = asyncio.get_running_loop().create_task(self._close(nc))
        else:
            self.closed.set()

    async def _close(self, nc: NATS) -> None:
        try:
            await nc.close()
        except Exception as e:  # noqa: BLE001 - it is given up either way
            log.debug("agent %s: close after giving up: %s", self.agent, describe(e))
        finally:
            self.closed.set()

    def _unreachable(self, error: BaseException) -> str:
        if self.connect_attempts is None or self.failures <= 1:
            tries = ""
        else:
            tries = f" after {self.failures} attempts"
        return f"agent {self.agent} cannot reach the bus at {self.urls}{tries} ({describe(error)}). {HINT}"

    def _connected_url(self, nc: NATS) -> str | None:
        url = nc.connected_url
        if url is None:
            return None
        return without_credentials(url.geturl())
