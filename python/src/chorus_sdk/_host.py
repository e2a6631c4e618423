"""What the SDK's parts (the durable inbox, exactly-once records, tasks, a handler's context)
need of the agent they serve, as a structural type: they depend on this, not on the ``Agent``
class, so no module imports the agent back."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from .envelope import Envelope

if TYPE_CHECKING:
    from nats.aio.client import Client

    from .codec import Encoding
    from .replay import ReplayProof
    from .signing import Verifier
    from .subjects import Subjects


class Host(Protocol):
    """An agent, as its parts see it."""

    id: str
    instance: str
    subjects: Subjects
    request_timeout: float
    max_message_bytes: int | None
    stats: Any
    #: Checks signatures, when the agent verifies them.
    verifier: Verifier | None
    #: Called after the connection comes back (bells may have been lost meanwhile).
    reconnect_hooks: list[Callable[[], None]]

    @property
    def nc(self) -> Client: ...

    @property
    def stopping(self) -> bool: ...

    async def until_stopping(self) -> None:
        """Returns once the agent starts shutting down."""
        ...

    def encode_for(self, subject: str, env: Envelope, encoding: Encoding | None = None) -> bytes:
        """``env`` signed (when the agent signs) and encoded for ``subject``."""
        ...

    def set_payload(self, env: Envelope, payload: Any, content_type: str | None) -> None:
        """Puts a payload value (bytes, a ``Reply``, or a value to encode) into ``env``."""
        ...

    def reply_payload(self, request: Envelope | None, value: Any) -> tuple[bytes, str]: ...

    def spawn(self, coro: Awaitable[Any], name: str = ...) -> asyncio.Task[Any]:
        """Runs ``coro`` as a task the agent waits for at shutdown."""
        ...

    async def exchange(self, subject: str, env: Envelope, wait: float, encoding: Encoding | None = None) -> Envelope:
        """Sends a request envelope and returns its reply; raises on a failure code."""
        ...

    async def handle(
        self,
        env: Envelope,
        subject: str,
        route: str,
        name: str,
        attempt: int = 1,
        stored: int | None = None,
        replay: ReplayProof | str | None = None,
    ) -> Any: ...

    # Sends, with the keyword options of the agent's own methods.
    @property
    def request(self) -> Callable[..., Awaitable[Any]]: ...

    @property
    def request_capability(self) -> Callable[..., Awaitable[Any]]: ...

    @property
    def multicast(self) -> Callable[..., Awaitable[Any]]: ...

    @property
    def publish(self) -> Callable[..., Awaitable[None]]: ...

    @property
    def send(self) -> Callable[..., Awaitable[int]]: ...

    @property
    def notify(self) -> Callable[..., Awaitable[Any]]: ...


__all__ = ["Host"]
