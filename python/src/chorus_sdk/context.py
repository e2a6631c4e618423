"""What a handler gets: the message, its payload, and sends that keep the conversation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ._host import Host
from .codec import decode_payload, typed
from .envelope import Envelope
from .status import ChorusError, StatusCode

#: The most application headers a message may carry (``MAX_HEADERS`` in the Rust SDK).
MAX_HEADERS = 64
#: The longest application header name, in bytes (UTF-8).
MAX_HEADER_NAME_BYTES = 128
#: The most bytes a message's application headers may take, names and values together.
MAX_HEADERS_BYTES = 16 * 1024


def check_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of a message's application headers once they are checked against the limits the
    Rust SDK sets: at most :data:`MAX_HEADERS`, each name a string of 1 to
    :data:`MAX_HEADER_NAME_BYTES` bytes without control characters, each value a string, and
    at most :data:`MAX_HEADERS_BYTES` bytes of names and values in all. Raises
    :class:`ChorusError` 5018 (invalid argument) saying which limit a header breaks."""
    if not headers:
        return {}
    if not isinstance(headers, Mapping):
        raise ChorusError(StatusCode.INVALID_ARGUMENT, f"application headers are a dict of strings, not {type(headers).__name__}")
    if len(headers) > MAX_HEADERS:
        raise ChorusError(StatusCode.INVALID_ARGUMENT, f"{len(headers)} application headers: at most {MAX_HEADERS} are allowed")
    total = 0
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ChorusError(StatusCode.INVALID_ARGUMENT, f"application header {name!r}: names and values are strings")
        size = len(name.encode("utf-8"))
        if not 1 <= size <= MAX_HEADER_NAME_BYTES:
            raise ChorusError(
                StatusCode.INVALID_ARGUMENT, f"application header name {name!r}: 1 to {MAX_HEADER_NAME_BYTES} bytes, not {size}"
            )
        if any(ch < " " or "\x7f" <= ch <= "\x9f" for ch in name):
            raise ChorusError(StatusCode.INVALID_ARGUMENT, f"application header name {name!r} holds a control character")
        total += size + len(value.encode("utf-8"))
    if total > MAX_HEADERS_BYTES:
        raise ChorusError(StatusCode.INVALID_ARGUMENT, f"application headers of {total} bytes: at most {MAX_HEADERS_BYTES} are allowed")
    return dict(headers)



@dataclass
class Reply:
    """A handler's answer as raw bytes with their content type (a handler that returns any
    other value has it encoded in the request's content type, MessagePack or JSON)."""

    payload: bytes
    content_type: str = "application/octet-stream"


class Context:
    """The message a handler is running for. Messages sent through it (``request``,
    ``publish``, ``send``) are forwards: they keep the conversation, count one more hop, and
    carry the parent's deadline and trace (docs/PROTOCOL.md section 7.3)."""

    def __init__(self, agent: Host, envelope: Envelope, subject: str, attempt: int = 1) -> None:
        self.agent = agent
        self.envelope = envelope
        self.subject = subject
        self.attempt = attempt

    @property
    def sender(self) -> str:
        """The agent that sent the message."""
        return self.envelope.from_

    @property
    def session(self) -> str | None:
        """The session the message belongs to (the envelope's ``session_id``): what this
        handler sends through the context, and its reply, carry it on."""
        return self.envelope.session_id

    @property
    def customer(self) -> str | None:
        """The customer the message is for (the envelope's ``customer_id``), carried on as
        :attr:`session` is."""
        return self.envelope.customer_id

    @property
    def headers(self) -> Mapping[str, str]:
        """The message's application headers (the envelope's ``headers``, set by the sender
        with ``headers=``), read-only; empty when it set none. They are this message's only:
        the reply and the messages sent through this context do not carry them on (as
        ``Context::headers`` in the Rust SDK)."""
        return MappingProxyType(self.envelope.headers)

    @property
    def topic(self) -> str | None:
        """An event's topic (``doc.created``), the part of the subject after ``<root>.evt.``:
        which one of a pattern's matched (as ``Event::topic`` in the Rust SDK); ``None`` for
        a message that is not an event."""
        if self.envelope.topic is not None:
            return self.envelope.topic
        return self.agent.subjects.implied(self.subject).topic

    @property
    def payload(self) -> bytes:
        return self.envelope.payload

    @property
    def content_type(self) -> str:
        return self.envelope.content_type

    def data(self, cls: type[Any] | None = None) -> Any:
        """The payload's value, read by its content type (MessagePack or JSON), as a ``cls``
        when given (a dataclass, a pydantic model, or a plain type); raises
        :class:`~chorus_sdk.codec.DecodeError` (answered 5006) when it does not read or fit."""
        if not self.envelope.payload:
            return typed(None, cls) if cls is not None and cls is not type(None) else None
        return typed(decode_payload(self.envelope.payload, self.envelope.content_type), cls)

    async def request(self, agent: str, command: str, payload: Any = None, **kw: Any) -> Any:
        return await self.agent.request(agent, command, payload, parent=self.envelope, **kw)

    async def request_capability(self, capability: str, payload: Any = None, **kw: Any) -> Any:
        return await self.agent.request_capability(capability, payload, parent=self.envelope, **kw)

    async def multicast(self, to: list[str], command: str, payload: Any = None, **kw: Any) -> Any:
        """A multicast (``Agent.multicast``) as a forward of this message: every copy carries
        its conversation (the report's ``multicast_id``), one more hop and its deadline."""
        return await self.agent.multicast(to, command, payload, parent=self.envelope, **kw)

    async def publish(self, topic: str, payload: Any = None, **kw: Any) -> None:
        await self.agent.publish(topic, payload, parent=self.envelope, **kw)

    async def notify(self, to: Any, name: str, payload: Any = None, **kw: Any) -> Any:
        """A notification (``Agent.notify``) as a forward of this message: its conversation,
        one more hop, its deadline (``Context::notify`` in Rust)."""
        return await self.agent.notify(to, name, payload, parent=self.envelope, **kw)

    async def send(self, agent: str, command: str, payload: Any = None, **kw: Any) -> int:
        return await self.agent.send(agent, command, payload, parent=self.envelope, **kw)
