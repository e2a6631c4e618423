"""What an agent serves: commands, capabilities, events and tasks, registered before or
after it connects (a late one is subscribed and announced at once), and the durable inbox its
commands start."""

from __future__ import annotations

import inspect
import json
from typing import Any, Awaitable, Callable, TypeVar


from .context import Context
from .durable import DurableInbox
from .subjects import validate_dotted, validate_token
from .tasks import TaskHandler
from .negotiate import CounterOffer, RoundResults

from ._state import EventHandler, Handler, log
from .presence import Presence


# The limits of a description (as the Rust SDK's `Description`).
MAX_DESCRIPTION_BYTES = 1024
MAX_INPUT_SCHEMA_BYTES = 16 * 1024
# A reply format: the payload is an MCP tool result (`content`, `structuredContent`, `isError`).
REPLY_MCP_TOOL_RESULT = "mcp.tool_result"

# What the decorators take: a handler, as a coroutine function or a plain one.
H = TypeVar("H", bound=Callable[[Context], Any])
# A counter handler, as a coroutine function or a plain one.
CH = TypeVar("CH", bound=Callable[[Context, CounterOffer], Any])


class Handlers(Presence):
    """The serving layer of an agent."""

    # -----------------------------------------------------------------------------------------
    # Handlers

    def on_command(self, name: str, handler: Handler) -> None:
        """Handles requests and commands sent to ``<root>.agent.<id>.<name>``, and durable
        commands stored for this agent under that name."""
        self._commands[validate_token("command name", name)] = handler
        self._changed()

    def on_capability(self, capability: str, handler: Handler) -> None:
        """Serves a capability's access point (``<root>.cap.<capability>``, in its queue group)
        and this agent's own (``<root>.agent.<id>.cap.<capability>``)."""
        self._capabilities[validate_dotted("capability", capability)] = handler
        self._changed(capability=capability)

    def on_event(self, pattern: str, handler: EventHandler) -> None:
        """Runs ``handler`` for every event whose topic matches ``pattern`` (``*`` a token,
        ``>`` the rest)."""
        self.subjects.event_pattern(pattern)
        self._events[pattern] = handler
        self._changed(pattern=pattern)

    def on_notification(self, name: str, handler: EventHandler) -> None:
        """Runs ``handler`` for notifications called ``name`` (``"*"``: every one without a
        handler of its own): pushes to this agent that expect no reply (section 7.14), sent
        with :meth:`notify` to it or to a group it belongs to. They come on the agent's own
        subjects (``<root>.agent.<id>.$notify``, under the subscription its commands use), so
        no topic subscription is needed; durable ones come through its durable inbox, retried
        and dead-lettered by the retry policy when the handler raises. Nothing is ever
        answered; what the handler returns is dropped; a notification no handler takes is
        counted (``stats.notifications_unhandled``) and dropped.

        Raises :class:`~chorus_sdk.SubjectError` when ``name`` is neither ``"*"`` nor a valid
        notification name (one token, as a command name)."""
        if name != "*":
            validate_token("notification name", name)
        self._notifications[name] = handler
        self._changed()

    def notification(self, name: str = "*") -> Callable[[H], H]:
        """Decorator form of :meth:`on_notification`: ``@agent.notification("disk-full")``, or
        ``@agent.notification()`` for every notification without a handler of its own."""

        def register(f: H) -> H:
            self.on_notification(name, _as_async(f))
            return f

        return register

    def command(self, name: str) -> Callable[[H], H]:
        """Decorator form of :meth:`on_command`: ``@agent.command("add")`` (on a coroutine
        function or a plain one)."""

        def register(f: H) -> H:
            self.on_command(name, _as_async(f))
            return f

        return register

    def capability(self, capability: str) -> Callable[[H], H]:
        """Decorator form of :meth:`on_capability`."""

        def register(f: H) -> H:
            self.on_capability(capability, _as_async(f))
            return f

        return register

    def event(self, pattern: str) -> Callable[[H], H]:
        """Decorator form of :meth:`on_event`."""

        def register(f: H) -> H:
            self.on_event(pattern, _as_async(f))
            return f

        return register

    def on_task(self, name: str, handler: TaskHandler) -> None:
        """Serves task ``name`` (section 7.4): a submission to ``<root>.agent.<id>.<name>`` is
        taken (answered 5002) and ``handler`` runs with a :class:`TaskContext`; what it returns
        completes the task, a :class:`ChorusError` it raises fails it with that code."""
        self.on_command(name, self._task_worker.endpoint(_as_async(handler), "command", name))
        self._endpoints.setdefault(("command", name), {})["task"] = True

    def on_task_capability(self, capability: str, handler: TaskHandler) -> None:
        """Serves tasks submitted to a capability."""
        self.on_capability(capability, self._task_worker.endpoint(_as_async(handler), "capability", capability))
        self._endpoints.setdefault(("capability", capability), {})["task"] = True

    def describe(
        self,
        name: str,
        description: str,
        input_schema: dict[str, Any] | None = None,
        reply_format: str | None = None,
    ) -> None:
        """Describes command or capability ``name`` in the manifest (``endpoints``, section
        7.7), for callers that list tools (MCP hosts through the gateway): what it does, the
        JSON Schema its payload follows, how its reply reads (``"mcp.tool_result"``: an MCP
        tool result). Register its handler first; announced at once.

        Raises :class:`ValueError` when there is no such command or capability, the
        description is over 1,024 bytes, the schema is no JSON object or over 16 KiB as JSON,
        or the reply format is not ``mcp.tool_result``."""
        if len(description.encode()) > MAX_DESCRIPTION_BYTES:
            raise ValueError(f"describe {name}: a description is at most {MAX_DESCRIPTION_BYTES} bytes")
        if input_schema is not None:
            if not isinstance(input_schema, dict):
                raise ValueError(f"describe {name}: an input schema is a JSON object")
            size = len(json.dumps(input_schema, separators=(",", ":")).encode())
            if size > MAX_INPUT_SCHEMA_BYTES:
                raise ValueError(f"describe {name}: an input schema is at most {MAX_INPUT_SCHEMA_BYTES} bytes of JSON, this one {size}")
        if reply_format is not None and reply_format != REPLY_MCP_TOOL_RESULT:
            raise ValueError(f"describe {name}: reply format {reply_format!r}: the one known is {REPLY_MCP_TOOL_RESULT}")
        kinds = [k for k, served in (("command", self._commands), ("capability", self._capabilities)) if name in served]
        if not kinds:
            raise ValueError(f"describe {name}: no command or capability {name} here (register its handler first)")
        for kind in kinds:
            said = self._endpoints.setdefault((kind, name), {})
            said.update(description=description, input_schema=input_schema, reply=reply_format)
        self._changed()

    def require(self, name: str, permissions: list[str] | tuple[str, ...]) -> None:
        """Requires ``permissions`` of senders of command or capability ``name`` (registered
        before): a request or command from a sender not granted all of them is refused with
        5007 and a reason naming what is missing. Grants apply to senders whose signature
        verified (``identity`` on their side, a ``verifier`` here) unless the agent was built
        with ``trust_unverified_senders=True``.

        Raises :class:`ValueError` when no command or capability handler is registered under
        ``name``."""
        if isinstance(permissions, str):
            raise TypeError("permissions are a list of strings, not one string")
        if name not in self._commands and name not in self._capabilities:
            raise ValueError(f"no command or capability handler is registered under {name!r}")
        self._required[name] = list(permissions)

    def grant(self, agent: str, permissions: list[str] | tuple[str, ...]) -> None:
        """Grants ``agent`` more permissions at run time (besides the ``grants`` option)."""
        self.access.grant(agent, permissions)

    def task(self, name: str) -> Callable[[TaskHandler], TaskHandler]:
        """Decorator form of :meth:`on_task`: ``@agent.task("draft")``."""

        def register(f: TaskHandler) -> TaskHandler:
            self.on_task(name, f)
            return f

        return register

    def _changed(self, capability: str | None = None, pattern: str | None = None) -> None:
        """A handler registered while connected: subscribe what it needs and announce it."""
        if self._nc is None or not self._nc.is_connected:
            return

        async def apply() -> None:
            if capability is not None:
                await self._subscribe_capability(capability)
            if pattern is not None:
                await self._subscribe_event(pattern)
            if (self._commands or self._notifications) and self.durable_inbox:
                await self._start_durable()
            await self._heartbeat()

        self.spawn(apply())


    # -----------------------------------------------------------------------------------------
    # Contract-net bidding (section 7.10)

    def on_bid(self, capability: str, handler: Callable[[Context], Any]) -> None:
        """Bids for work on ``capability`` (contract-net): each call for proposals to
        ``<root>.agent.<id>.bid.<capability>`` runs ``handler`` (``ctx.data()`` is the work),
        which returns a :class:`~chorus_sdk.Proposal` (or a map of its fields), or raises a
        :class:`ChorusError` to refuse with its code. Serve the work itself with
        :meth:`on_task_capability`: a won round arrives as a task. Raises
        :class:`~chorus_sdk.SubjectError` for a bad capability name."""
        capability = validate_dotted("capability", capability)
        self._bidding.bids[capability] = _as_async(handler)
        if self._nc is not None and self._nc.is_connected:
            self.spawn(self._subscribe_bid(capability))

    def bid(self, capability: str) -> Callable[[H], H]:
        """Decorator form of :meth:`on_bid`: ``@agent.bid("translate")``."""

        def register(f: H) -> H:
            self.on_bid(capability, f)
            return f

        return register

    def on_counter(self, capability: str, handler: Callable[[Context, CounterOffer], Any]) -> None:
        """Answers counter-offers to this agent's proposals for ``capability``: ``handler``
        gets the context and the :class:`~chorus_sdk.CounterOffer` (the requester's offer
        beside the proposal it answers) and returns a new proposal (the offer itself to accept
        it, or something between), or raises a :class:`ChorusError` to refuse it, in which
        case the earlier proposal stands. Without one, counter-offers are refused with 5016."""
        capability = validate_dotted("capability", capability)
        if inspect.iscoroutinefunction(handler):
            self._bidding.counters[capability] = handler
            return
        plain = handler

        async def call(ctx: Context, offer: CounterOffer) -> Any:
            return plain(ctx, offer)

        self._bidding.counters[capability] = call

    def counter(self, capability: str) -> Callable[[CH], CH]:
        """Decorator form of :meth:`on_counter`: ``@agent.counter("translate")``."""

        def register(f: CH) -> CH:
            self.on_counter(capability, f)
            return f

        return register

    def round_results(self) -> RoundResults:
        """The outcomes of the rounds this agent proposes in, from now on: lost (told by the
        requester) or won (``async for result in agent.round_results()``)."""
        return self._bidding.results()

    # -----------------------------------------------------------------------------------------
    # Durable inbox

    async def _start_durable(self) -> None:
        if self._durable is None:
            self._durable = DurableInbox(self, self.inbox_options)
        try:
            await self._durable.start()
        except Exception as e:  # noqa: BLE001 - a bus without JetStream still serves core traffic
            log.warning("agent %s: durable inbox not started: %s", self.id, e)



C = TypeVar("C", bound=Context)


def _as_async(f: Callable[[C], Any]) -> Callable[[C], Awaitable[Any]]:
    """A handler written as a plain function runs as a coroutine."""
    if inspect.iscoroutinefunction(f):
        return f

    async def call(ctx: C) -> Any:
        return f(ctx)

    return call

