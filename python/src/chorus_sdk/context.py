"""What a handler gets: the message, its payload, and sends that keep the conversation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._host import Host
from .codec import decode_payload, typed
from .envelope import Envelope



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

    async def publish(self, topic: str, payload: Any = None, **kw: Any) -> None:
        await self.agent.publish(topic, payload, parent=self.envelope, **kw)

    async def send(self, agent: str, command: str, payload: Any = None, **kw: Any) -> int:
        return await self.agent.send(agent, command, payload, parent=self.envelope, **kw)
