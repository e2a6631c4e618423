"""Chorus for Python: agents on NATS that talk to Chorus agents in any language.

>>> async with Agent("greeter") as agent:          # doctest: +SKIP
...     @agent.command("hello")
...     async def hello(ctx):
...         return f"hello, {ctx.data()}"
"""

__version__ = "0.1.0"

from .agent import Agent, Stats  # noqa: E402
from .batch import MAX_BATCH_DELAY, MAX_BATCH_MESSAGES, Batcher, Batching  # noqa: E402
from .config import ConfigError  # noqa: E402
from .codec import DecodeError, Encoding, decode, decode_payload, encode, encode_payload  # noqa: E402
from .context import MAX_HEADER_NAME_BYTES, MAX_HEADERS, MAX_HEADERS_BYTES, Context, Reply  # noqa: E402
from .outbound import CallOptions  # noqa: E402
from .multicast import MAX_MULTICAST_RECIPIENTS, Collect, MulticastCounts, MulticastOutcome, MulticastRecipient, MulticastReport  # noqa: E402
from .notify import NotifyRecipient, NotifyReport, NotifyTarget  # noqa: E402
from .durable import InboxOptions, RetryPolicies, RetryPolicy  # noqa: E402
from .envelope import (  # noqa: E402
    Delivery,
    Envelope,
    Kind,
    Performative,
    Priority,
    TaskState,
)
from .encryption import EncryptionKey, Rekey  # noqa: E402
from .negotiate import Answer, Award, Bid, CounterOffer, NoAward, Policy, Proposal, RoundResult, RoundResults, Settlement  # noqa: E402
from .payloads import PayloadLimits  # noqa: E402
from .access import RateLimit  # noqa: E402
from .routing import BreakerPolicy, CircuitOpen, CircuitState, Routing  # noqa: E402
from .identity import Identity  # noqa: E402
from .signing import Verifier  # noqa: E402
from .status import ChorusError, NoResponders, Refused, StatusCode, Timeout, Unreachable  # noqa: E402
from .subjects import SubjectError, Subjects  # noqa: E402
from .schema import Schema, SchemaError  # noqa: E402
from .tasks import Attempt, Supervisor, TaskContext, TaskHandle, TaskReport, TaskResult, TaskStopped, TaskUpdate, Verification  # noqa: E402
from .usage import UsageKind, UsageReport, UsageRow  # noqa: E402

__all__ = [
    "Batcher",
    "Batching",
    "MAX_BATCH_DELAY",
    "MAX_BATCH_MESSAGES",
    "ConfigError",
    "CallOptions",
    "Collect",
    "MAX_MULTICAST_RECIPIENTS",
    "MulticastCounts",
    "MulticastOutcome",
    "MulticastRecipient",
    "MulticastReport",
    "NotifyRecipient",
    "NotifyReport",
    "NotifyTarget",
    "Answer",
    "Award",
    "Bid",
    "CounterOffer",
    "NoAward",
    "Policy",
    "Proposal",
    "RoundResult",
    "RoundResults",
    "Settlement",
    "Routing",
    "RateLimit",
    "Rekey",
    "CircuitState",
    "CircuitOpen",
    "BreakerPolicy",
    "Agent",
    "ChorusError",
    "Context",
    "MAX_HEADERS",
    "MAX_HEADER_NAME_BYTES",
    "MAX_HEADERS_BYTES",
    "DecodeError",
    "Delivery",
    "Encoding",
    "EncryptionKey",
    "Envelope",
    "Identity",
    "InboxOptions",
    "Kind",
    "NoResponders",
    "PayloadLimits",
    "Performative",
    "Priority",
    "Refused",
    "Reply",
    "RetryPolicies",
    "RetryPolicy",
    "StatusCode",
    "Stats",
    "SubjectError",
    "Subjects",
    "Attempt",
    "Schema",
    "SchemaError",
    "Supervisor",
    "TaskContext",
    "TaskHandle",
    "TaskReport",
    "TaskResult",
    "Verification",
    "TaskState",
    "TaskStopped",
    "TaskUpdate",
    "Timeout",
    "Unreachable",
    "UsageKind",
    "UsageReport",
    "UsageRow",
    "Verifier",
    "__version__",
    "decode",
    "decode_payload",
    "encode",
    "encode_payload",
]
