"""Contract-net (docs/PROTOCOL.md section 7.10): a requester calls for proposals from every
live holder of a capability (or the bidders it names), each answers with a proposal (price,
ETA, confidence, free terms) or a refusal before a deadline, the requester may counter them,
its policy picks one, the winner gets the work as a task, the other proposers are told they
lost, and a settlement event records what was agreed.

A bidder serves ``@agent.bid("translate")`` (and ``@agent.counter("translate")`` to answer
counter-offers) beside the task capability that does the work once awarded
(:meth:`~chorus_sdk.Agent.on_task_capability`, which also announces the capability, so
discovery finds the bidder). The requester runs ``await agent.negotiate("translate", work)``. The wire form is the Rust SDK's, so either
side may be in either language."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Union

import nats.errors

from .codec import DecodeError, Json, Struct, decode_payload, encode_struct
from .codec import F32
from .context import Context, Reply
from .credits import LedgerEntry
from .envelope import CONTENT_TYPE_MSGPACK, Envelope, Expect, Kind, Performative, uuid7
from .status import ChorusError, NoResponders, Refused, StatusCode, Timeout, label
from .subjects import SubjectError, Subjects, validate_dotted, validate_token
from .tasks import TaskHandle, submit

if TYPE_CHECKING:
    from .handlers import Handlers

log = logging.getLogger("chorus_sdk")

#: How long bidders have to answer by default, in seconds.
DEFAULT_BID_DEADLINE = 2.0
#: The longest deadline a round takes, in seconds.
MAX_BID_DEADLINE = 3600.0
#: The topic of the settlement event a round ends with (``<root>.evt.negotiation.settled``).
SETTLED_TOPIC = "negotiation.settled"
#: The envelope header naming the round an awarded task came from.
ROUND_HEADER = "chorus-round"
#: The most bidders a round names.
MAX_BIDDERS = 1000
#: How many outcomes a :class:`RoundResults` keeps unread before it drops the oldest.
ROUND_RESULTS_CAPACITY = 1024
#: Why a losing proposer lost.
LOST_REASON = "another proposal was awarded"


def bid_subject(subjects: Subjects, agent: str, capability: str) -> str:
    """``<root>.agent.<agent>.bid.<capability>``: where ``agent`` hears calls for proposals for
    ``capability`` and the outcomes of the rounds it proposed in. Raises
    :class:`~chorus_sdk.SubjectError` for a bad agent id or capability."""
    validate_token("agent id", agent)
    validate_dotted("capability", capability)
    return f"{subjects.root}.agent.{agent}.bid.{capability}"


# ---------------------------------------------------------------------------------------------
# Proposals


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_json(value: Any, depth: int = 0) -> None:
    """Raises :class:`ValueError` unless ``value`` is a JSON value (as ``terms`` must be)."""
    if depth > 64:
        raise ValueError("terms nest deeper than 64 levels")
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ValueError(f"terms: the integer {value} does not fit 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"terms: {value} is no JSON number")
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_json(item, depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"terms: map keys are strings, not {type(k).__name__}")
            _check_json(v, depth + 1)
        return
    raise ValueError(f"terms are JSON values (maps, lists, strings, numbers, booleans, null), not {type(value).__name__}")


@dataclass(frozen=True)
class Proposal:
    """What a bidder offers: ``price`` (what it asks, in the requester's unit), ``eta_ms``
    (how long until the work is done), ``confidence`` (how sure it is of a good result, 0 to
    1) and free-form ``terms`` (any JSON value), each ``None`` when not said.

    Raises :class:`ValueError` for a price that is no finite number, an ETA that is no
    integer from 0 to 2**64 - 1, a confidence outside 0 to 1, or terms that are no JSON value.
    On the wire the price is a 64-bit float and the confidence a 32-bit one, as the Rust SDK
    writes them."""

    price: float | None = None
    eta_ms: int | None = None
    confidence: float | None = None
    terms: Any = None

    def __post_init__(self) -> None:
        if self.price is not None:
            if not _is_number(self.price) or not math.isfinite(self.price):
                raise ValueError(f"a proposal's price is a finite number, not {self.price!r}")
            object.__setattr__(self, "price", float(self.price))
        if self.eta_ms is not None:
            if not isinstance(self.eta_ms, int) or isinstance(self.eta_ms, bool) or not 0 <= self.eta_ms < 2**64:
                raise ValueError(f"a proposal's eta_ms is an integer from 0 to 2**64 - 1, not {self.eta_ms!r}")
        if self.confidence is not None:
            if not _is_number(self.confidence) or not 0.0 <= self.confidence <= 1.0:
                raise ValueError(f"a proposal's confidence is a number from 0 to 1, not {self.confidence!r}")
            object.__setattr__(self, "confidence", float(self.confidence))
        _check_json(self.terms)

    @classmethod
    def at(cls, price: float, **kw: Any) -> Proposal:
        """A proposal at ``price`` (as the Rust SDK's ``Proposal::at``), with any other field
        given by keyword."""
        return cls(price=price, **kw)

    def members(self) -> list[tuple[str, Any]]:
        """Its fields as the wire map's members, those not said left out."""
        out: list[tuple[str, Any]] = []
        if self.price is not None:
            out.append(("price", float(self.price)))
        if self.eta_ms is not None:
            out.append(("eta_ms", self.eta_ms))
        if self.confidence is not None:
            out.append(("confidence", F32(self.confidence)))
        if self.terms is not None:
            out.append(("terms", Json(self.terms)))
        return out

    def encode(self) -> bytes:
        """The proposal as MessagePack, as the Rust SDK writes it."""
        return encode_struct(self.members())

    def to_value(self) -> dict[str, Any]:
        """The proposal as a plain map of what it says (for JSON, printing)."""
        return {k: (float(v) if isinstance(v, float) else v.value if isinstance(v, Json) else v) for k, v in self.members()}

    @classmethod
    def from_value(cls, value: Any) -> Proposal:
        """A proposal from its decoded wire map (unknown keys ignored, as the Rust SDK does).
        Raises :class:`ValueError` when it is no map or a field has the wrong type."""
        if not isinstance(value, dict):
            raise ValueError(f"a proposal is a map, not {type(value).__name__}")
        price = value.get("price")
        if price is not None and not _is_number(price):
            raise ValueError(f"price: a number, not {type(price).__name__}")
        return cls(price=price, eta_ms=value.get("eta_ms"), confidence=value.get("confidence"), terms=value.get("terms"))


def _as_proposal(value: Any, what: str) -> Proposal:
    """What a bid or counter handler returned, as a proposal: a :class:`Proposal`, or a map of
    its fields; anything else fails the handler (5017)."""
    if isinstance(value, Proposal):
        return value
    try:
        return Proposal.from_value(value)
    except ValueError as e:
        raise ChorusError(StatusCode.HANDLER_FAILED, f"{what} returned no proposal: {e}") from e


@dataclass(frozen=True)
class CounterOffer:
    """What a requester puts to a proposer instead of accepting its proposal as it is: its
    ``offer``, beside the ``previous`` proposal it answers (the payload of a counter)."""

    offer: Proposal
    previous: Proposal

    def encode(self) -> bytes:
        """The counter-offer as MessagePack, as the Rust SDK writes it."""
        return encode_struct([("offer", Struct(self.offer.members())), ("previous", Struct(self.previous.members()))])

    @classmethod
    def from_value(cls, value: Any) -> CounterOffer:
        """A counter-offer from its decoded wire map; raises :class:`ValueError` when it is
        no map, or ``offer`` or ``previous`` is missing or no proposal."""
        if not isinstance(value, dict):
            raise ValueError(f"a counter-offer is a map, not {type(value).__name__}")
        missing = [k for k in ("offer", "previous") if k not in value]
        if missing:
            raise ValueError(f"a counter-offer has no {' or '.join(missing)}")
        return cls(Proposal.from_value(value["offer"]), Proposal.from_value(value["previous"]))


# ---------------------------------------------------------------------------------------------
# Bids and policies


class Answer(str, Enum):
    """What one bidder answered."""

    #: A proposal.
    PROPOSED = "proposed"
    #: A refusal, with its code and reason.
    REFUSED = "refused"
    #: No answer before the deadline (or nobody listening).
    SILENT = "silent"


@dataclass(frozen=True)
class Bid:
    """One bidder's part in a round: its ``answer``, with its ``proposal`` when it proposed,
    or the ``status`` and ``reason`` of its refusal."""

    agent: str
    answer: Answer
    proposal: Proposal | None = None
    status: int | None = None
    reason: str | None = None

    def to_value(self) -> dict[str, Any]:
        """The bid as a plain map, as ``chorus negotiate --json`` prints it."""
        out: dict[str, Any] = {"agent": self.agent, "answer": self.answer.value}
        if self.proposal is not None:
            out["proposal"] = self.proposal.to_value()
        if self.answer is Answer.REFUSED:
            out["status"], out["reason"] = self.status, self.reason
        return out

    def summary(self) -> str:
        """``<agent> proposed``, ``<agent> refused (<code> <label>)`` or ``<agent> was silent``."""
        if self.answer is Answer.PROPOSED:
            return f"{self.agent} proposed"
        if self.answer is Answer.REFUSED:
            status = int(self.status or 0)
            return f"{self.agent} refused ({status} {label(status)})"
        return f"{self.agent} was silent"


#: A function that picks a bid: the index of the winner among the bids it is given (every one
#: a proposal), or ``None`` to award nothing.
PickFn = Callable[[Sequence[Bid]], Union[int, None]]


def _key(value: float | None, negate: bool = False) -> float:
    if value is None:
        return math.inf
    return -value if negate else value


class Policy:
    """How the requester picks among the proposals: :attr:`CHEAPEST` (the lowest price, the
    default), :attr:`FASTEST` (the shortest ETA), :attr:`MOST_CONFIDENT` (the highest
    confidence), or :meth:`pick` (a function of its own). A proposal without the value ranked
    on comes last; equal ones keep the order asked."""

    CHEAPEST: ClassVar[Policy]
    FASTEST: ClassVar[Policy]
    MOST_CONFIDENT: ClassVar[Policy]

    _NAMES: ClassVar[dict[str, str]] = {
        "cheapest": "cheapest",
        "fastest": "fastest",
        "most_confident": "most_confident",
        "confident": "most_confident",
    }

    def __init__(self, name: str, pick: PickFn | None = None) -> None:
        self.name = name
        self._pick = pick

    def __repr__(self) -> str:
        return f"Policy.{self.name.upper()}" if self._pick is None else "Policy.pick(...)"

    @classmethod
    def pick(cls, f: PickFn) -> Policy:
        """A policy that picks with ``f``: it gets the proposals (as :class:`Bid`) and returns
        the index of the winner, or ``None`` (or an index out of range) to award nothing."""
        if not callable(f):
            raise ValueError("Policy.pick takes a function of the bids")
        return cls("pick", f)

    @classmethod
    def of(cls, policy: Policy | str) -> Policy:
        """``policy`` as a :class:`Policy`: one already, or its name (``cheapest``,
        ``fastest``, ``most_confident`` or ``confident``); :class:`ValueError` for another."""
        if isinstance(policy, Policy):
            return policy
        name = cls._NAMES.get(policy) if isinstance(policy, str) else None
        if name is None:
            raise ValueError(f"policy {policy!r}: cheapest, fastest or most_confident (or Policy.pick)")
        return {"cheapest": cls.CHEAPEST, "fastest": cls.FASTEST, "most_confident": cls.MOST_CONFIDENT}[name]

    def rank(self, bids: Sequence[Bid]) -> list[int]:
        """The order of ``bids`` (all proposals) from best to worst; empty when a pick
        function picks none."""
        order = list(range(len(bids)))
        if self._pick is not None:
            first = self._pick(bids)
            if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < len(bids):
                return []
            # The chosen one first, then the rest as they came.
            return [first] + [i for i in order if i != first]

        def key(i: int) -> float:
            p = bids[i].proposal
            if p is None:
                return math.inf
            if self.name == "cheapest":
                return _key(p.price)
            if self.name == "fastest":
                return _key(None if p.eta_ms is None else float(p.eta_ms))
            return _key(p.confidence, negate=True)

        # Stable: equal keys keep the order the bids came in.
        return sorted(order, key=key)


Policy.CHEAPEST = Policy("cheapest")
Policy.FASTEST = Policy("fastest")
Policy.MOST_CONFIDENT = Policy("most_confident")

#: How a requester counters: for each proposal, its own offer, or ``None`` to take it as it
#: is (a plain function or a coroutine function).
CounterFn = Callable[[Bid], Union[Proposal, None, Awaitable[Union[Proposal, None]]]]


# ---------------------------------------------------------------------------------------------
# Outcomes


@dataclass
class Award:
    """How a round ended: who won with what, every bid (in the order asked, as they stood
    after any counters), and the winner's task."""

    round: uuid.UUID
    capability: str
    winner: str
    proposal: Proposal
    bids: list[Bid]
    task: TaskHandle
    #: Counter-offers put to proposers.
    countered: int = 0


class NoAward(Refused):
    """A round that awarded nothing (5019): no proposal (all refused or silent), a policy that
    picked none, or no proposer took the work. The reason says what each bidder answered;
    :attr:`bids` has their answers."""

    def __init__(self, round: uuid.UUID, capability: str, bids: list[Bid]) -> None:
        summary = ", ".join(b.summary() for b in bids)
        super().__init__(StatusCode.UNAVAILABLE, f"no proposal for {capability} was awarded: {summary}")
        self.round = round
        self.capability = capability
        self.bids = bids


def _uuid(value: Any, what: str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, (bytes, bytearray)) and len(value) == 16:
        return uuid.UUID(bytes=bytes(value))
    if isinstance(value, str):
        return uuid.UUID(value)
    raise ValueError(f"{what}: a UUID, not {type(value).__name__}")


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what}: a count, not {value!r}")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what}: a string, not {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Settlement:
    """The payload of the settlement event (``negotiation.settled``) that ends an awarded
    round."""

    round: uuid.UUID
    capability: str
    requester: str
    winner: str
    proposal: Proposal
    task: uuid.UUID
    #: Bidders asked.
    asked: int
    #: Proposals received.
    proposals: int
    #: Refusals received.
    refusals: int
    #: Counter-offers put to proposers.
    countered: int = 0
    #: The customer the work is for, if the round named one.
    customer: str | None = None
    #: Whether the price was recorded in the credits ledger (by this settlement or an earlier
    #: one of the same round); false without a price.
    credited: bool = False

    def encode(self) -> bytes:
        """The settlement as MessagePack, as the Rust SDK writes it (ids as 16 bytes)."""
        return encode_struct([
            ("round", self.round),
            ("capability", self.capability),
            ("requester", self.requester),
            ("winner", self.winner),
            ("proposal", Struct(self.proposal.members())),
            ("task", self.task),
            ("asked", self.asked),
            ("proposals", self.proposals),
            ("refusals", self.refusals),
            ("countered", self.countered),
            *([("customer", self.customer)] if self.customer is not None else []),
            ("credited", self.credited),
        ])

    @classmethod
    def from_value(cls, value: Any) -> Settlement:
        """A settlement from the event's decoded payload (``ctx.data()``); raises
        :class:`ValueError` when it is not one."""
        if not isinstance(value, dict):
            raise ValueError(f"a settlement is a map, not {type(value).__name__}")
        try:
            return cls(
                round=_uuid(value["round"], "round"),
                capability=_text(value["capability"], "capability"),
                requester=_text(value["requester"], "requester"),
                winner=_text(value["winner"], "winner"),
                proposal=Proposal.from_value(value["proposal"]),
                task=_uuid(value["task"], "task"),
                asked=_count(value["asked"], "asked"),
                proposals=_count(value["proposals"], "proposals"),
                refusals=_count(value["refusals"], "refusals"),
                countered=_count(value.get("countered", 0), "countered"),
                customer=None if value.get("customer") is None else _text(value["customer"], "customer"),
                credited=value.get("credited") is True,
            )
        except KeyError as e:
            raise ValueError(f"a settlement has no {e.args[0]}") from e


@dataclass(frozen=True)
class RoundResult:
    """What a bidder learns of a round it proposed in: whether it ``won`` (it is then given
    the work as a task)."""

    round: uuid.UUID
    capability: str
    won: bool


class RoundResults:
    """The outcomes of the rounds an agent proposes in, from when this was made
    (:meth:`~chorus_sdk.Agent.round_results`): ``async for result in results`` or
    ``await results.get(timeout)``. It keeps up to :data:`ROUND_RESULTS_CAPACITY` unread
    outcomes, dropping the oldest past that (counted in :attr:`missed`); :meth:`close` stops
    it."""

    def __init__(self, bidding: Bidding) -> None:
        self._bidding = bidding
        self._items: deque[RoundResult] = deque()
        self._ready = asyncio.Event()
        self.missed = 0

    def _put(self, result: RoundResult) -> None:
        if len(self._items) >= ROUND_RESULTS_CAPACITY:
            self._items.popleft()
            self.missed += 1
        self._items.append(result)
        self._ready.set()

    def get_nowait(self) -> RoundResult | None:
        """The next outcome if one is waiting, else ``None``."""
        if not self._items:
            return None
        item = self._items.popleft()
        if not self._items:
            self._ready.clear()
        return item

    async def get(self, timeout: float | None = None) -> RoundResult:
        """The next outcome; raises :class:`~chorus_sdk.Timeout` when none comes within
        ``timeout`` seconds."""
        while True:
            item = self.get_nowait()
            if item is not None:
                return item
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                raise Timeout(f"no round outcome within {timeout} s") from None

    def __aiter__(self) -> RoundResults:
        return self

    async def __anext__(self) -> RoundResult:
        return await self.get()

    def close(self) -> None:
        """Stops collecting outcomes."""
        self._bidding.listeners.discard(self)


# ---------------------------------------------------------------------------------------------
# The bidder's side

#: A bid handler: the call for proposals (``ctx.data()`` is the work) to a proposal, or a
#: :class:`~chorus_sdk.ChorusError` raised to refuse with its code.
BidHandler = Callable[[Context], Awaitable[Any]]
#: A counter handler: the counter-offer to a new proposal (the offer itself to accept it), or a
#: :class:`~chorus_sdk.ChorusError` raised to refuse it (the earlier proposal stands).
CounterHandler = Callable[[Context, CounterOffer], Awaitable[Any]]


@dataclass
class Bidding:
    """An agent's bid and counter handlers by capability, and who listens to the outcomes."""

    bids: dict[str, BidHandler] = field(default_factory=dict)
    counters: dict[str, CounterHandler] = field(default_factory=dict)
    #: Held weakly: a listener nobody keeps is forgotten.
    listeners: weakref.WeakSet[RoundResults] = field(default_factory=weakref.WeakSet)
    #: The capabilities whose bid subject is subscribed.
    subscribed: set[str] = field(default_factory=set)

    def results(self) -> RoundResults:
        """A new listener to the outcomes."""
        results = RoundResults(self)
        self.listeners.add(results)
        return results

    def endpoint(self, capability: str) -> Callable[[Context], Awaitable[Any]] | None:
        """The handler of ``capability``'s bid subject, while it has a bid handler."""
        if capability not in self.bids:
            return None

        async def serve(ctx: Context) -> Any:
            return await self.serve(capability, ctx)

        return serve

    async def serve(self, capability: str, ctx: Context) -> Any:
        """One message on a bid subject: a call for proposals, a counter-offer, or the outcome
        of a round this agent proposed in (as the Rust SDK's bid endpoint)."""
        env = ctx.envelope
        performative = env.performative
        if performative is Performative.NEGOTIATE:
            bid = self.bids.get(capability)
            if bid is None:
                raise ChorusError(StatusCode.UNKNOWN_COMMAND, f"no bids taken for {capability}")
            proposal = _as_proposal(await bid(ctx), f"the bid handler for {capability}")
            return Reply(proposal.encode(), CONTENT_TYPE_MSGPACK)
        if performative is Performative.PROPOSE:
            counter = self.counters.get(capability)
            if counter is None:
                raise ChorusError(StatusCode.UNKNOWN_COMMAND, f"no counter-offers taken for {capability}: the proposal stands")
            try:
                offer = CounterOffer.from_value(ctx.data())
            except ValueError as e:
                raise ChorusError(StatusCode.DATA_FORMAT, f"payload: {e}") from e
            proposal = _as_proposal(await counter(ctx, offer), f"the counter handler for {capability}")
            return Reply(proposal.encode(), CONTENT_TYPE_MSGPACK)
        if performative in (Performative.REFUSE, Performative.AGREE):
            if env.correlation_id is not None:
                result = RoundResult(env.correlation_id, capability, performative is Performative.AGREE)
                for listener in list(self.listeners):
                    listener._put(result)
            return None
        raise ChorusError(
            StatusCode.INVALID_ARGUMENT,
            f"a bid subject takes calls for proposals (negotiate) and outcomes, not {performative.value}",
        )


# ---------------------------------------------------------------------------------------------
# The requester's side


def _refused(agent: str, status: int, reason: str) -> Bid:
    return Bid(agent, Answer.REFUSED, status=int(status), reason=reason)


async def _ask(
    agent: Handlers,
    round_id: uuid.UUID,
    capability: str,
    bidder: str,
    performative: Performative,
    payload: bytes,
    content_type: str,
    deadline: float,
) -> Bid:
    """One bidder's answer to a call for proposals or a counter-offer, within the deadline."""
    try:
        subject = bid_subject(agent.subjects, bidder, capability)
    except SubjectError as e:
        return _refused(str(bidder), StatusCode.INVALID_ARGUMENT, str(e))
    wait_ms = max(1, int(deadline * 1000))
    env = Envelope.new(Kind.REQUEST, performative, agent.id)
    env.hop_limit = agent.hop_limit
    env.correlation_id = round_id
    env.to = [bidder]
    env.capability = capability
    env.ttl_ms = wait_ms
    env.expect = Expect(Performative.INFORM, wait_ms)
    env.payload, env.content_type = payload, content_type
    try:
        reply = await agent.exchange(subject, env, wait_ms / 1000)
    except Refused as e:
        return _refused(bidder, e.status, e.reason)
    except (ChorusError, nats.errors.Error) as e:
        # Timeout, nobody listening, a reply that does not decode, no connection: silent.
        log.debug("agent %s: round %s: %s was silent: %s", agent.id, round_id, bidder, e)
        return Bid(bidder, Answer.SILENT)
    try:
        if reply.content_encoding is not None:
            raise ValueError(f"unsupported content encoding {reply.content_encoding!r}")
        proposal = Proposal.from_value(decode_payload(reply.payload, reply.content_type))
    except (DecodeError, ValueError) as e:
        return _refused(bidder, StatusCode.DATA_FORMAT, f"the proposal does not decode: {e}")
    return Bid(bidder, Answer.PROPOSED, proposal)


async def _tell(agent: Handlers, round_id: uuid.UUID, capability: str, bidder: str, won: bool) -> None:
    """Tells a proposer the round's outcome, one way: nothing is awaited."""
    try:
        subject = bid_subject(agent.subjects, bidder, capability)
        env = Envelope.new(Kind.COMMAND, Performative.AGREE if won else Performative.REFUSE, agent.id)
        env.correlation_id = round_id
        env.to = [bidder]
        env.capability = capability
        env.reason = None if won else LOST_REASON
        await agent.nc.publish(subject, agent.encode_for(subject, env))
    except (ChorusError, SubjectError, nats.errors.Error) as e:
        log.debug("agent %s: round %s: outcome not sent to %s: %s", agent.id, round_id, bidder, e)


async def _award(
    agent: Handlers,
    round_id: uuid.UUID,
    winner: str,
    capability: str,
    payload: bytes,
    content_type: str,
    task_deadline: float | None,
    customer: str | None = None,
) -> TaskHandle:
    """Submits the work to ``winner``'s own access point as a task with the round's header,
    and returns its handle once taken (as :meth:`~chorus_sdk.Agent.submit` does)."""
    return await submit(
        agent,
        agent._task_worker.store,
        Reply(payload, content_type),
        to=winner,
        name=None,
        capability=capability,
        deadline=task_deadline,
        timeout=agent.request_timeout,
        headers={ROUND_HEADER: str(round_id)},
        customer=customer,
    )


def _seconds(what: str, value: Any, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if not _is_number(value) or not 0 < value <= MAX_BID_DEADLINE:
        raise ValueError(f"{what} is a number of seconds above 0 and at most {MAX_BID_DEADLINE:.0f}, not {value!r}")
    return float(value)


async def negotiate(
    agent: Handlers,
    capability: str,
    payload: Any = None,
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
    """Runs a contract-net round for ``agent``; see :meth:`chorus_sdk.Agent.negotiate`."""
    validate_dotted("capability", capability)
    wait = _seconds("deadline", deadline)
    assert wait is not None
    work_deadline = _seconds("task_deadline", task_deadline, optional=True)
    ranking = Policy.of(policy)
    if counter is not None and not callable(counter):
        raise ValueError("counter is a function of a bid returning a Proposal or None")
    if not isinstance(counter_rounds, int) or isinstance(counter_rounds, bool) or counter_rounds < 1:
        raise ValueError(f"counter_rounds is 1 or more, not {counter_rounds!r}")
    work = Envelope.new(Kind.REQUEST, Performative.NEGOTIATE, agent.id)
    agent.set_payload(work, payload, content_type)
    if isinstance(bidders, str):
        raise TypeError("bidders is a list of agent ids, not one string")
    named = list(bidders or [])
    if len(named) > MAX_BIDDERS:
        raise ValueError(f"a round names at most {MAX_BIDDERS} bidders, not {len(named)}")
    if named:
        asked = named
    else:
        found = await agent.discover(capability=capability)
        asked = []
        for record in found:
            manifest = record.get("manifest") if isinstance(record, dict) else None
            name = manifest.get("agent") if isinstance(manifest, dict) else None
            if isinstance(name, str) and name != agent.id and name not in asked:
                asked.append(name)
    if not asked:
        raise NoResponders(f"no bidders for {capability}")
    round_id = uuid7()
    bids = list(
        await asyncio.gather(
            *(_ask(agent, round_id, capability, b, Performative.NEGOTIATE, work.payload, work.content_type, wait) for b in asked)
        )
    )
    countered = 0
    if counter is not None:
        for _ in range(counter_rounds):
            offers: list[tuple[int, CounterOffer]] = []
            for i, bid in enumerate(bids):
                if bid.proposal is None:
                    continue
                offer = counter(bid)
                if inspect.isawaitable(offer):
                    offer = await offer
                if offer is None:
                    continue
                if not isinstance(offer, Proposal):
                    raise ValueError(f"counter returned {type(offer).__name__}: a Proposal or None")
                offers.append((i, CounterOffer(offer, bid.proposal)))
            if not offers:
                break
            answers = await asyncio.gather(
                *(
                    _ask(agent, round_id, capability, bids[i].agent, Performative.PROPOSE, o.encode(), CONTENT_TYPE_MSGPACK, wait)
                    for i, o in offers
                )
            )
            for (i, _), answer in zip(offers, answers):
                countered += 1
                if answer.answer is Answer.PROPOSED:
                    bids[i] = answer
                else:
                    log.debug("agent %s: round %s: counter-offer to %s not taken (%s): the proposal stands", agent.id, round_id, bids[i].agent, answer.summary())
    proposals = [b for b in bids if b.proposal is not None]
    winner: Bid | None = None
    task: TaskHandle | None = None
    for i in ranking.rank(proposals):
        candidate = proposals[i]
        try:
            task = await _award(agent, round_id, candidate.agent, capability, work.payload, work.content_type, work_deadline, customer)
        except ChorusError as e:
            log.info("agent %s: round %s: award not taken by %s (%s); trying the next proposal", agent.id, round_id, candidate.agent, e)
            continue
        winner = candidate
        break
    if winner is None or task is None or winner.proposal is None:
        # Every proposer lost.
        for bid in proposals:
            await _tell(agent, round_id, capability, bid.agent, False)
        raise NoAward(round_id, capability, bids)
    for bid in proposals:
        await _tell(agent, round_id, capability, bid.agent, bid.agent == winner.agent)
    credited = False
    if winner.proposal.price is not None:
        entry = LedgerEntry(
            round=round_id,
            capability=capability,
            payer=agent.id,
            payee=winner.agent,
            price=winner.proposal.price,
            task=task.id,
            settled_ms=int(time.time() * 1000),
            customer=customer,
        )
        try:
            await (await agent.ledger()).record(entry)
            credited = True
        except (ValueError, nats.errors.Error) as e:
            log.warning("agent %s: round %s: price not recorded in the credits ledger: %s", agent.id, round_id, e)
    settlement = Settlement(
        round=round_id,
        capability=capability,
        requester=agent.id,
        winner=winner.agent,
        proposal=winner.proposal,
        task=task.id,
        asked=len(bids),
        proposals=len(proposals),
        refusals=sum(1 for b in bids if b.answer is Answer.REFUSED),
        countered=countered,
        customer=customer,
        credited=credited,
    )
    try:
        await agent.publish(SETTLED_TOPIC, Reply(settlement.encode(), CONTENT_TYPE_MSGPACK))
    except (ChorusError, nats.errors.Error) as e:
        log.warning("agent %s: round %s: settlement not published: %s", agent.id, round_id, e)
    return Award(round_id, capability, winner.agent, winner.proposal, bids, task, countered)


__all__ = [
    "Answer",
    "Award",
    "Bid",
    "Bidding",
    "CounterOffer",
    "DEFAULT_BID_DEADLINE",
    "NoAward",
    "Policy",
    "Proposal",
    "ROUND_HEADER",
    "RoundResult",
    "RoundResults",
    "SETTLED_TOPIC",
    "Settlement",
    "bid_subject",
    "negotiate",
]
