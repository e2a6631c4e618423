"""Messages taken from the connection as they are read, for the agent's hot paths: its
inbound subscriptions and the replies to its requests.

nats-py hands a subscription's messages to its callback through a queue and a task of the
subscription's own, and a request's reply through its shared inbox's subscription (its queue
and task again), a future and ``asyncio.wait_for``: a turn of the event loop or two per
message before the SDK sees it. Here a message is taken in the connection's read loop, as
nats-py does for the one reply of an old-style request (a subscription made with
``future=``): it calls ``set_result`` with every message of such a subscription, at once.
The SDK's receiver starts the message's own task there, and a reply wakes its request.

That path is nats-py's own and has stood unchanged from 2.7 to 2.16; with a nats-py this SDK
was not tested with, each subscription is an ordinary one with a callback instead (the same
messages, a turn later)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, Callable, cast

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ._connection import log

try:
    from nats.aio.client import __version__ as _NATS_VERSION
except ImportError:  # pragma: no cover - every nats-py this SDK allows has it
    _NATS_VERSION = "0"


def _tested(version: str) -> bool:
    """Whether ``version`` of nats-py is one whose read loop this module was tested with."""
    try:
        parts = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return (2, 7) <= parts < (2, 17)


#: Whether messages are taken in the read loop (a nats-py this SDK was tested with).
DIRECT = _tested(_NATS_VERSION)

#: The status header of the server's answer when nobody serves a request's subject.
_STATUS = "Status"
_NO_RESPONDERS = "503"


class _Taker:
    """What nats-py takes for a subscription's future: it is never done, and each message
    it is given goes to ``deliver`` at once. An error there is logged, never raised into the
    connection's read loop."""

    __slots__ = ("_deliver", "_subject")

    def __init__(self, subject: str, deliver: Callable[[Msg], None]) -> None:
        self._subject = subject
        self._deliver = deliver

    def __bool__(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def set_result(self, msg: Msg) -> None:
        try:
            self._deliver(msg)
        except Exception:  # noqa: BLE001 - the read loop must go on
            log.exception("a message on %s was not taken", self._subject)


async def subscribe(nc: NATS, subject: str, deliver: Callable[[Msg], None], queue: str = "") -> Subscription:
    """Subscribes to ``subject`` (in ``queue`` if given), each message passed to ``deliver``
    as it is read: ``deliver`` must not block, it starts whatever work the message needs."""
    if DIRECT:
        return await nc.subscribe(subject, queue=queue, future=cast(Any, _Taker(subject, deliver)))

    async def callback(msg: Msg) -> None:
        deliver(msg)

    return await nc.subscribe(subject, queue=queue, cb=callback)


def _expire(reply: asyncio.Future[Msg]) -> None:
    if not reply.done():
        reply.set_exception(nats.errors.TimeoutError())


class Replies:
    """The replies to one agent's requests: one inbox subscription of its own
    (``<inbox prefix>.<nuid>.*``, made at the first request), each request waiting on a token
    of its own under it. Raises what nats-py's ``request`` raises: ``TimeoutError`` past the
    timeout, ``NoRespondersError`` when nobody serves the subject, the connection's errors."""

    def __init__(self) -> None:
        self._nc: NATS | None = None
        self._prefix: str | None = None
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._next = 0
        self._starting: asyncio.Lock | None = None
        self.subscription: Subscription | None = None

    async def _start(self, nc: NATS) -> str:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._prefix is None or self._nc is not nc:
                prefix = nc.new_inbox() + "."
                self.subscription = await subscribe(nc, prefix + "*", partial(self._take, prefix))
                self._nc, self._prefix = nc, prefix
            return self._prefix

    def stop(self) -> list[Subscription]:
        """Lets the inbox go (its subscription, to unsubscribe, is returned): the next
        request makes another. Requests still waiting time out."""
        subscription, self.subscription = self.subscription, None
        self._nc = self._prefix = None
        return [subscription] if subscription is not None else []

    def _take(self, prefix: str, msg: Msg) -> None:
        if prefix is not self._prefix:
            # An inbox let go: its late replies are nobody's.
            return
        reply = self._waiting.get(msg.subject[len(prefix) :])
        if reply is not None and not reply.done():
            reply.set_result(msg)

    async def request(self, nc: NATS, subject: str, data: bytes, timeout: float) -> Msg:
        """Publishes ``data`` on ``subject`` and returns its reply within ``timeout`` seconds."""
        if nc.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        prefix = self._prefix
        if prefix is None or self._nc is not nc:
            prefix = await self._start(nc)
        self._next += 1
        token = str(self._next)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Msg] = loop.create_future()
        self._waiting[token] = reply
        try:
            await nc.publish(subject, data, reply=prefix + token)
            timer = loop.call_later(timeout, _expire, reply)
            try:
                msg = await reply
            finally:
                timer.cancel()
        finally:
            del self._waiting[token]
        headers = msg.headers
        if headers and headers.get(_STATUS) == _NO_RESPONDERS:
            raise nats.errors.NoRespondersError
        return msg

    @property
    def waiting(self) -> int:
        """Requests waiting for their reply."""
        return len(self._waiting)
