"""Subjects (docs/PROTOCOL.md section 2): every name is checked before it becomes a subject."""

from __future__ import annotations

import re
from dataclasses import dataclass

# The bus's own agents: the coordinator (it never registers: its id is refused by the registry)
# and the web console, which cancels tasks for the operators it lets in (as in Rust,
# ``chorus_sdk::registry``).
COORDINATOR_ID = "coordinator"
CONSOLE_ID = "chorus-console"

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The last token of an agent's notification subjects (section 7.14): under its command
# wildcard, so the subscriptions it has carry notifications, and never a command name.
NOTIFY_TOKEN = "$notify"
MAX_DOTTED_TOKENS = 16


class SubjectError(ValueError):
    """A name that cannot be a subject token (answered as 5018 where a peer sent it)."""


def validate_token(what: str, name: str) -> str:
    """An agent id, command or group name: one token of 1-64 ``A-Z a-z 0-9 _ -``."""
    if not isinstance(name, str) or not _TOKEN.fullmatch(name):
        raise SubjectError(f"{what} {name!r} must be 1 to 64 characters from A-Z a-z 0-9 _ -")
    return name


def validate_dotted(what: str, name: str, pattern: bool = False) -> str:
    """A capability, topic or root: 1 to 16 tokens joined by ``.``; a pattern may use ``*``
    for a token and ``>`` as the last."""
    tokens = name.split(".") if isinstance(name, str) else []
    if not 1 <= len(tokens) <= MAX_DOTTED_TOKENS:
        raise SubjectError(f"{what} {name!r} must be 1 to {MAX_DOTTED_TOKENS} tokens joined by '.'")
    for i, token in enumerate(tokens):
        if pattern and (token == "*" or (token == ">" and i == len(tokens) - 1)):
            continue
        if not _TOKEN.fullmatch(token):
            raise SubjectError(f"{what} {name!r}: token {token!r} must be 1 to 64 characters from A-Z a-z 0-9 _ -")
    return name


@dataclass(frozen=True)
class Implied:
    """What a subject carries of an envelope's addressing; the compact form leaves these out."""

    topic: str | None = None
    capability: str | None = None
    agent: str | None = None
    name: str | None = None


#: What a subject that carries nothing of an envelope implies (one, shared).
NOTHING_IMPLIED = Implied()


class Subjects:
    """The subjects of one bus (one root)."""

    def __init__(self, root: str = "chorus") -> None:
        self.root = validate_dotted("subject root", root)
        self._implied: dict[str, Implied] = {}
        # The command of each inbound command subject seen (``command_of``), as ``_implied``.
        self._commands: dict[str, str] = {}
        # Command subjects made (``command``), by agent and command.
        self._command_subjects: dict[tuple[str, str], str] = {}
        self._prefix = self.root + "."

    def command(self, agent: str, command: str) -> str:
        # Kept once made (a request's subject, each call): only checked names get a slot.
        key = (agent, command)
        try:
            found = self._command_subjects.get(key)
        except TypeError:
            # Unhashable: not a name, which validate_token says.
            found = None
        if found is None:
            validate_token("agent id", agent)
            validate_token("command name", command)
            found = f"{self.root}.agent.{agent}.{command}"
            if len(self._command_subjects) >= 4096:
                self._command_subjects.clear()
            self._command_subjects[key] = found
        return found

    def notification(self, agent: str) -> str:
        """``<root>.agent.<agent>.$notify``: notifications to one agent (section 7.14)."""
        return f"{self.root}.agent.{validate_token('agent id', agent)}.{NOTIFY_TOKEN}"

    def durable_notification(self, agent: str, high: bool) -> str:
        """``<root>.inbox.<agent>.<lane>.$notify``: durable notifications in an agent's inbox."""
        validate_token("agent id", agent)
        return f"{self.root}.inbox.{agent}.{'high' if high else 'normal'}.{NOTIFY_TOKEN}"

    def is_notification(self, subject: str) -> bool:
        """Whether ``subject`` is one of an agent's notification subjects, core or durable."""
        return self.command_of(subject) == NOTIFY_TOKEN

    def command_of(self, subject: str) -> str:
        """The command of an agent's command subject, core (:meth:`command_name`) or durable
        (:meth:`durable_command`); ``""`` for another subject. Worked out once per subject
        (the inbound pipeline asks it several times per message)."""
        found = self._commands.get(subject)
        if found is None:
            found = self.command_name(subject) or self.durable_command(subject) or ""
            if len(self._commands) >= 4096:
                self._commands.clear()
            self._commands[subject] = found
        return found

    def agent_inbound(self, agent: str) -> str:
        return f"{self.root}.agent.{validate_token('agent id', agent)}.*"

    def capability(self, capability: str) -> str:
        return f"{self.root}.cap.{validate_dotted('capability', capability)}"

    def capability_at(self, agent: str, capability: str) -> str:
        validate_token("agent id", agent)
        return f"{self.root}.agent.{agent}.cap.{validate_dotted('capability', capability)}"

    def event(self, topic: str) -> str:
        return f"{self.root}.evt.{validate_dotted('topic', topic)}"

    def event_pattern(self, pattern: str) -> str:
        return f"{self.root}.evt.{validate_dotted('topic pattern', pattern, pattern=True)}"

    def bell_source(self) -> str:
        """What the inbox stream republishes as bells: every durable command."""
        return f"{self.root}.inbox.*.*.*"

    def bell_destination(self) -> str:
        """Where a stored command's bell goes: `_INBOX.<agent>.bell.<root>.<lane>.<command>`."""
        return "_INBOX.{{wildcard(1)}}.bell." + self.root + ".{{wildcard(2)}}.{{wildcard(3)}}"

    def lane_bells(self, agent: str, high: bool) -> str:
        """`_INBOX.<agent>.bell.<root>.<lane>.*`: the bells of one lane of an agent's durable inbox."""
        validate_token("agent id", agent)
        return f"_INBOX.{agent}.bell.{self.root}.{'high' if high else 'normal'}.*"

    def durable_agent_all(self, agent: str) -> str:
        """`<root>.inbox.<agent>.>`: both lanes of one agent's durable inbox."""
        validate_token("agent id", agent)
        return f"{self.root}.inbox.{agent}.>"

    def durable_inbox(self, agent: str, high: bool, command: str | None = None) -> str:
        validate_token("agent id", agent)
        lane = "high" if high else "normal"
        tail = validate_token("command name", command) if command is not None else "*"
        return f"{self.root}.inbox.{agent}.{lane}.{tail}"

    def heartbeat(self, agent: str) -> str:
        return f"{self.root}.sys.hb.{validate_token('agent id', agent)}"

    def goodbye(self, agent: str) -> str:
        return f"{self.root}.sys.bye.{validate_token('agent id', agent)}"

    @property
    def discover(self) -> str:
        return f"{self.root}.sys.discover"

    @property
    def wire(self) -> str:
        return f"{self.root}.sys.wire"

    def broadcast(self, group: str | None = None, capability: str | None = None) -> str:
        if group is not None:
            return f"{self.root}.bcast.group.{validate_token('group', group)}"
        if capability is not None:
            return f"{self.root}.bcast.cap.{validate_dotted('capability', capability)}"
        return f"{self.root}.bcast.all"

    def reply_prefix(self, agent: str) -> str:
        return f"_INBOX.{validate_token('agent id', agent)}"

    def stream_name(self, suffix: str) -> str:
        return f"{self.root.replace('.', '_').upper()}_{suffix}"

    def bucket_name(self, suffix: str) -> str:
        return f"{self.root.replace('.', '_')}_{suffix}"

    def command_name(self, subject: str) -> str | None:
        """The command of ``<root>.agent.<agent>.<command>``."""
        prefix = f"{self.root}.agent."
        if not subject.startswith(prefix):
            return None
        parts = subject[len(prefix):].split(".")
        return parts[1] if len(parts) == 2 else None

    def durable_command(self, subject: str) -> str | None:
        """The command of ``<root>.inbox.<agent>.<lane>.<command>``."""
        prefix = f"{self.root}.inbox."
        if not subject.startswith(prefix):
            return None
        parts = subject[len(prefix):].split(".")
        if len(parts) == 3 and parts[1] in ("high", "normal"):
            return parts[2]
        return None

    def implied(self, subject: str) -> Implied:
        """What ``subject`` carries (nothing for a reply inbox or another root's subject)."""
        if not subject.startswith(self._prefix):
            # A reply inbox (a new subject per request) carries nothing: not worth a cache slot.
            return NOTHING_IMPLIED
        found = self._implied.get(subject)
        if found is None:
            found = self._implied_of(subject)
            if len(self._implied) >= 4096:
                self._implied.clear()
            self._implied[subject] = found
        return found

    def _implied_of(self, subject: str) -> Implied:
        prefix = self.root + "."
        if not subject.startswith(prefix):
            return Implied()
        rest = subject[len(prefix):]
        if rest.startswith("evt."):
            return Implied(topic=rest[4:])
        if rest.startswith("cap."):
            return Implied(capability=rest[4:])
        if rest.startswith("agent."):
            parts = rest[6:].split(".", 1)
            if len(parts) == 2 and "." not in parts[1]:
                return Implied(agent=parts[0], name=parts[1])
            return Implied()
        command = self.durable_command(subject)
        if command is not None:
            return Implied(agent=rest.split(".")[1], name=command)
        return Implied()
