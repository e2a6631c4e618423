"""Status codes (docs/PROTOCOL.md section 8) and the exception that carries one."""

from __future__ import annotations

from enum import IntEnum


class StatusCode(IntEnum):
    """AIXP's codes 5001-5009 and Chorus's extensions. A code this version does not know is
    kept as a plain ``int`` and treated as a failure."""

    CONNECTED = 5001
    OK = 5002
    DISCONNECTED = 5003
    IDENTITY = 5004
    TIMEOUT = 5005
    DATA_FORMAT = 5006
    ACCESS = 5007
    CONNECTION_LIMIT = 5008
    UNEXPECTED_DISCONNECT = 5009
    LOOP_DETECTED = 5010
    EXPIRED = 5011
    NO_RESPONDERS = 5012
    RATE_LIMITED = 5013
    UNAUTHORIZED = 5014
    REPLAY = 5015
    UNKNOWN_COMMAND = 5016
    HANDLER_FAILED = 5017
    INVALID_ARGUMENT = 5018
    UNAVAILABLE = 5019
    CANCELLED = 5020
    ACCEPTED = 5021
    INTERNAL = 5022
    UNCERTAIN = 5023
    TASK_STATE = 5024
    UNVERIFIED = 5025

    @property
    def label(self) -> str:
        """The code's label in the spec (``invalid_argument``)."""
        return self.name.lower()


SUCCESS = frozenset({5001, 5002, 5021})

# Section 7.1: the performative of a reply follows from its status alone.
_REFUSED = frozenset({5006, 5007, 5010, 5011, 5014, 5016, 5024})


def is_success(code: int) -> bool:
    """Whether ``code`` is one of the success codes (5001, 5002, 5021)."""
    return code in SUCCESS


def label(code: int) -> str:
    """The label of ``code``, or its number for a code this version does not know."""
    try:
        return StatusCode(code).label
    except ValueError:
        return str(code)


def reply_performative(code: int) -> str:
    """The performative a reply with ``code`` carries (section 7.1's table)."""
    if code in SUCCESS:
        return "inform"
    if code in _REFUSED:
        return "refuse"
    return "failure"


class ChorusError(Exception):
    """A failure with its Chorus status code: raised by requests that fail, and raised by a
    handler to answer with that code (anything else a handler raises is answered 5017).

    What a call raises says what went wrong, so a caller can catch by meaning:
    :class:`Refused` (the other side answered with a failure code), :class:`Timeout` (no
    answer in time; also a :class:`TimeoutError`), :class:`NoResponders` (nobody serves the
    subject), :class:`Unreachable` (no connection to the bus). Each is a ``ChorusError`` with
    its code, so ``except ChorusError`` still catches them all; the cause, when there is one,
    is kept as ``__cause__``."""

    def __init__(self, status: int, reason: str = "") -> None:
        super().__init__(f"{status} {label(status)}: {reason}" if reason else f"{status} {label(status)}")
        self.status = int(status)
        self.reason = reason

    @property
    def code(self) -> StatusCode | int:
        """The status as a :class:`StatusCode` when this version knows it."""
        try:
            return StatusCode(self.status)
        except ValueError:
            return self.status


class Refused(ChorusError):
    """The other side answered with a failure code: a refusal (5006, 5007, 5010, ...) or a
    handler's failure (5017, 5018, ...). :attr:`status` is its code."""


class Timeout(ChorusError, TimeoutError):
    """No answer within the timeout (5005); also a :class:`TimeoutError`."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(StatusCode.TIMEOUT, reason)


class NoResponders(ChorusError):
    """Nobody serves the subject (5012): the server said so at once."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(StatusCode.NO_RESPONDERS, reason)


class Unreachable(ChorusError):
    """The bus cannot be reached: the agent is not connected, or its connection is gone
    (5019)."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(StatusCode.UNAVAILABLE, reason)
