//! The subject builder: every subject Chorus uses comes from here.
//!
//! ```text
//! <root>.agent.<agent-id>.<command>   commands and requests to one agent
//! <root>.agent.<agent-id>.$notify    notifications to one agent (no reply)
//! <root>.cap.<capability...>          capability access points (queue group per capability)
//! <root>.agent.<agent-id>.cap.<capability...>  one holder's own access point to a capability
//! <root>.agent.<agent-id>.bid.<capability...>  calls for proposals to one bidder (contract-net)
//! <root>.evt.<topic...>               events; subscribers may use * and >
//! <root>.inbox.<agent-id>.<lane>.<command>  durable commands (JetStream; lane high or normal)
//! <root>.bcast.all|group.<g>|cap.<c>  broadcast through the coordinator
//! <root>.sys.hb|bye.<agent-id>        heartbeats and goodbyes
//! <root>.sys.discover                 discovery queries
//! <root>.dlq.<reason>.<agent-id>      dead letters
//! <root>.task.<task-id>.<kind>        a task's messages: status, progress, chunk, input, cancel, report
//! _INBOX.<agent-id>.>                 replies to one agent (its own inbox prefix)
//! ```
//!
//! Agent ids and command names are single tokens of `[A-Za-z0-9_-]`, at most 64 characters.
//! Capabilities and topics are one or more such tokens joined by dots, so Agentify's dotted
//! address `agent.calculator.calculation` maps to agent `calculator`, command `calculation`:
//! `chorus.agent.calculator.calculation`, and a dotted capability `text.ocr` to
//! `chorus.cap.text.ocr`.

use std::fmt;
use std::sync::Arc;

pub use crate::protocol::implied::Implied;
use crate::registry::BroadcastTarget;

/// Default subject root.
pub const DEFAULT_ROOT: &str = "chorus";
/// The last token of an agent's notification subjects, `<root>.agent.<agent>.$notify` and
/// `<root>.inbox.<agent>.<lane>.$notify`: under the agent's command wildcard, so its existing
/// subscription (and its inbox's consumers) carry notifications too, and never a command
/// name (`$` is not allowed in one), so no command can shadow it.
pub const NOTIFY_TOKEN: &str = "$notify";
/// Longest token accepted.
pub const MAX_TOKEN_LEN: usize = 64;
/// Most tokens in a capability or topic.
pub const MAX_TOKENS: usize = 16;

/// A name that cannot become part of a subject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {value:?}: {why}")]
pub struct SubjectError {
    what: &'static str,
    value: String,
    why: &'static str,
}

fn check_token(what: &'static str, value: &str, token: &str) -> Result<(), SubjectError> {
    let err = |why| {
        Err(SubjectError {
            what,
            value: value.to_owned(),
            why,
        })
    };
    if token.is_empty() {
        return err("empty token");
    }
    if token.len() > MAX_TOKEN_LEN {
        return err("token longer than 64 characters");
    }
    if !token
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return err("only letters, digits, '_' and '-' are allowed in a token");
    }
    Ok(())
}

/// Checks a single-token name: an agent id, a command name, a group name.
///
/// # Errors
/// [`SubjectError`] when `value` is not a single token of 1 to 64 letters, digits, `_` or `-`.
pub fn validate_token(what: &'static str, value: &str) -> Result<(), SubjectError> {
    check_token(what, value, value)
}

/// Checks a dotted name: a capability or a topic (no wildcards).
///
/// # Errors
/// [`SubjectError`] when `value` is not 1 to 16 dot-separated tokens of 1 to 64 letters, digits,
/// `_` or `-` (no wildcards).
pub fn validate_dotted(what: &'static str, value: &str) -> Result<(), SubjectError> {
    let mut n = 0;
    for token in value.split('.') {
        check_token(what, value, token)?;
        n += 1;
    }
    if n > MAX_TOKENS {
        return Err(SubjectError {
            what,
            value: value.to_owned(),
            why: "more than 16 tokens",
        });
    }
    Ok(())
}

/// Checks a topic pattern: a dotted name whose tokens may also be `*`, and whose last may be `>`.
///
/// # Errors
/// [`SubjectError`] when `value` has more than 16 tokens, or one that is neither `*`, a last `>`,
/// nor 1 to 64 letters, digits, `_` or `-`.
pub fn validate_pattern(value: &str) -> Result<(), SubjectError> {
    let tokens: Vec<&str> = value.split('.').collect();
    for (i, token) in tokens.iter().enumerate() {
        let last = i + 1 == tokens.len();
        if *token == "*" || (*token == ">" && last) {
            continue;
        }
        check_token("topic pattern", value, token)?;
    }
    if tokens.len() > MAX_TOKENS {
        return Err(SubjectError {
            what: "topic pattern",
            value: value.to_owned(),
            why: "more than 16 tokens",
        });
    }
    Ok(())
}

/// Builds subjects under one root. Cheap to clone.
#[derive(Clone, PartialEq, Eq)]
pub struct Subjects {
    root: Arc<str>,
}

impl fmt::Debug for Subjects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Subjects({})", self.root)
    }
}

impl Default for Subjects {
    fn default() -> Self {
        Subjects {
            root: Arc::from(DEFAULT_ROOT),
        }
    }
}

impl Subjects {
    /// What `subject` carries of an envelope's addressing (nothing, for a reply inbox or a
    /// subject of another root).
    pub fn implied<'a>(&self, subject: &'a str) -> Implied<'a> {
        let Some(rest) = subject
            .strip_prefix(&*self.root)
            .and_then(|r| r.strip_prefix('.'))
        else {
            return Implied::default();
        };
        let mut implied = Implied::default();
        if let Some(topic) = rest.strip_prefix("evt.") {
            implied.topic = Some(topic);
        } else if let Some(capability) = rest.strip_prefix("cap.") {
            implied.capability = Some(capability);
        } else if let Some(tail) = rest.strip_prefix("agent.") {
            if let Some((agent, command)) = tail.split_once('.')
                && !command.contains('.')
            {
                implied.agent = Some(agent);
                implied.name = Some(command);
            }
        } else if let (Some(agent), Some(command)) =
            (self.durable_agent(subject), self.durable_command(subject))
        {
            implied.agent = Some(agent);
            implied.name = Some(command);
        }
        implied
    }

    /// Subjects under `root` (a dotted name, for example `chorus` or `acme.chorus`).
    ///
    /// # Errors
    /// [`SubjectError`] when `root` is not 1 to 16 dot-separated tokens of 1 to 64 letters, digits,
    /// `_` or `-`.
    pub fn new(root: &str) -> Result<Self, SubjectError> {
        validate_dotted("subject root", root)?;
        Ok(Subjects {
            root: Arc::from(root),
        })
    }

    /// The root.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// `<root>.agent.<agent>.<command>`.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` or `command` is not a single token of 1 to 64 letters, digits,
    /// `_` or `-`.
    pub fn command(&self, agent: &str, command: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        validate_token("command name", command)?;
        Ok(format!("{}.agent.{agent}.{command}", self.root))
    }

    /// `<root>.agent.<agent>.*`: everything addressed to one agent.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn agent_inbound(&self, agent: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        Ok(format!("{}.agent.{agent}.*", self.root))
    }

    /// `<root>.agent.<agent>.$notify`: notifications to one agent (carried by its command
    /// subscription, `<root>.agent.<agent>.*`).
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn notification(&self, agent: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        Ok(format!("{}.agent.{agent}.{NOTIFY_TOKEN}", self.root))
    }

    /// `<root>.inbox.<agent>.<lane>.$notify`: durable notifications in an agent's inbox.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn durable_notification(&self, agent: &str, high: bool) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        let lane = if high { "high" } else { "normal" };
        Ok(format!("{}.inbox.{agent}.{lane}.{NOTIFY_TOKEN}", self.root))
    }

    /// Whether `subject` is one of an agent's notification subjects, core or durable.
    pub fn is_notification(&self, subject: &str) -> bool {
        self.command_name(subject)
            .or_else(|| self.durable_command(subject))
            == Some(NOTIFY_TOKEN)
    }

    /// The command name in a subject built by [`command`](Subjects::command), if it is one.
    pub fn command_name<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject.strip_prefix(&*self.root)?.strip_prefix(".agent.")?;
        let (_agent, command) = rest.split_once('.')?;
        (!command.contains('.')).then_some(command)
    }

    /// `<root>.cap.<capability>`: a capability's access point. Agents serving it join a queue
    /// group of the same name, so each request goes to one of them.
    ///
    /// # Errors
    /// [`SubjectError`] when `capability` is not 1 to 16 dot-separated tokens of 1 to 64 letters,
    /// digits, `_` or `-`.
    pub fn capability(&self, capability: &str) -> Result<String, SubjectError> {
        validate_dotted("capability", capability)?;
        Ok(format!("{}.cap.{capability}", self.root))
    }

    /// `<root>.agent.<agent-id>.cap.<capability...>`: one agent's own access point to a
    /// capability it serves, for a caller that must reach that holder and no other (a task
    /// retried on the same agent, or reassigned to another).
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`,
    /// or `capability` is not 1 to 16 such tokens joined by dots.
    pub fn capability_at(&self, agent: &str, capability: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        validate_dotted("capability", capability)?;
        Ok(format!("{}.agent.{agent}.cap.{capability}", self.root))
    }

    /// `<root>.agent.<agent-id>.bid.<capability...>`: where an agent hears calls for proposals
    /// for a capability, and the outcome of the rounds it proposed in (contract-net).
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`,
    /// or `capability` is not 1 to 16 such tokens joined by dots.
    pub fn bid(&self, agent: &str, capability: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        validate_dotted("capability", capability)?;
        Ok(format!("{}.agent.{agent}.bid.{capability}", self.root))
    }

    /// `<root>.agent.<agent-id>.cap.>`: every capability access point of one agent.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn capabilities_at(&self, agent: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        Ok(format!("{}.agent.{agent}.cap.>", self.root))
    }

    /// `<root>.evt.<topic>`: where an event on `topic` is published.
    ///
    /// # Errors
    /// [`SubjectError`] when `topic` is not 1 to 16 dot-separated tokens of 1 to 64 letters,
    /// digits, `_` or `-` (no wildcards).
    pub fn event(&self, topic: &str) -> Result<String, SubjectError> {
        validate_dotted("topic", topic)?;
        // Built to its exact length: handed to the client as it is, no copy or regrowth.
        let mut subject = String::with_capacity(self.root.len() + 5 + topic.len());
        subject.push_str(&self.root);
        subject.push_str(".evt.");
        subject.push_str(topic);
        Ok(subject)
    }

    /// `<root>.evt.<pattern>`: what to subscribe to for a topic pattern with `*` and `>`.
    ///
    /// # Errors
    /// [`SubjectError`] when `pattern` is not what [`validate_pattern`] accepts.
    pub fn event_pattern(&self, pattern: &str) -> Result<String, SubjectError> {
        validate_pattern(pattern)?;
        Ok(format!("{}.evt.{pattern}", self.root))
    }

    /// The topic of an event subject.
    pub fn topic_of<'a>(&self, subject: &'a str) -> Option<&'a str> {
        subject.strip_prefix(&*self.root)?.strip_prefix(".evt.")
    }

    /// Where a broadcast to `target` is sent: `<root>.bcast.all`, `<root>.bcast.group.<g>` or
    /// `<root>.bcast.cap.<capability>`.
    ///
    /// # Errors
    /// [`SubjectError`] when a group is not a single token of 1 to 64 letters, digits, `_` or `-`,
    /// or a capability not 1 to 16 such tokens joined by dots.
    pub fn broadcast(&self, target: &BroadcastTarget) -> Result<String, SubjectError> {
        Ok(match target {
            BroadcastTarget::All => format!("{}.bcast.all", self.root),
            BroadcastTarget::Group(g) => {
                validate_token("group", g)?;
                format!("{}.bcast.group.{g}", self.root)
            }
            BroadcastTarget::Capability(c) => {
                validate_dotted("capability", c)?;
                format!("{}.bcast.cap.{c}", self.root)
            }
        })
    }

    /// The broadcast target a subject built by [`broadcast`](Subjects::broadcast) names.
    pub fn broadcast_target(&self, subject: &str) -> Option<BroadcastTarget> {
        let rest = subject.strip_prefix(&*self.root)?.strip_prefix(".bcast.")?;
        if rest == "all" {
            return Some(BroadcastTarget::All);
        }
        if let Some(g) = rest.strip_prefix("group.") {
            return validate_token("group", g)
                .ok()
                .map(|_| BroadcastTarget::Group(g.to_owned()));
        }
        let c = rest.strip_prefix("cap.")?;
        validate_dotted("capability", c)
            .ok()
            .map(|_| BroadcastTarget::Capability(c.to_owned()))
    }

    /// `<root>.bcast.>`: every broadcast, for the coordinator.
    pub fn broadcasts(&self) -> String {
        format!("{}.bcast.>", self.root)
    }

    /// `<root>.sys.hb.<agent>`: an agent's heartbeats (with its manifest).
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn heartbeat(&self, agent: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        Ok(format!("{}.sys.hb.{agent}", self.root))
    }

    /// `<root>.sys.hb.*`: every heartbeat.
    pub fn heartbeats(&self) -> String {
        format!("{}.sys.hb.*", self.root)
    }

    /// `<root>.sys.bye.<agent>`: an agent leaving in good order.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn goodbye(&self, agent: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        Ok(format!("{}.sys.bye.{agent}", self.root))
    }

    /// `<root>.sys.bye.*`: every goodbye.
    pub fn goodbyes(&self) -> String {
        format!("{}.sys.bye.*", self.root)
    }

    /// `<root>.sys.wire`: the coordinator's announcement of the protocol every live agent
    /// reads ([`WireLevel`](crate::registry::WireLevel)).
    pub fn wire(&self) -> String {
        format!("{}.sys.wire", self.root)
    }

    /// `<root>.sys.discover`: discovery queries to the coordinator.
    pub fn discover(&self) -> String {
        format!("{}.sys.discover", self.root)
    }

    /// The queue group coordinators share work in.
    pub fn coordinator_group(&self) -> String {
        format!("{}.coordinator", self.root)
    }

    /// `<root>.inbox.<agent>.<lane>.<command>`: a durable command, stored until the agent takes
    /// it. `lane` is `high` for high and critical priority, `normal` otherwise: each lane has its
    /// own consumer, so urgent commands do not wait behind a backlog.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` or `command` is not a single token of 1 to 64 letters, digits,
    /// `_` or `-`.
    pub fn durable(&self, agent: &str, command: &str, high: bool) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        validate_token("command name", command)?;
        let lane = if high { "high" } else { "normal" };
        Ok(format!("{}.inbox.{agent}.{lane}.{command}", self.root))
    }

    /// `<root>.inbox.<agent>.<lane>.*`: one priority lane of an agent's durable inbox.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn durable_inbox(&self, agent: &str, high: bool) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        let lane = if high { "high" } else { "normal" };
        Ok(format!("{}.inbox.{agent}.{lane}.*", self.root))
    }

    /// `<root>.inbox.>`: every durable inbox (the inbox stream's subjects).
    pub fn durable_all(&self) -> String {
        format!("{}.inbox.>", self.root)
    }

    /// The agent a durable subject is for.
    pub fn durable_agent<'a>(&self, subject: &'a str) -> Option<&'a str> {
        self.durable_command(subject)?;
        let rest = subject.strip_prefix(&*self.root)?.strip_prefix(".inbox.")?;
        rest.split('.').next()
    }

    /// The command name of a durable subject.
    pub fn durable_command<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject.strip_prefix(&*self.root)?.strip_prefix(".inbox.")?;
        let mut parts = rest.split('.');
        let (_agent, lane, command) = (parts.next()?, parts.next()?, parts.next()?);
        (parts.next().is_none() && (lane == "high" || lane == "normal")).then_some(command)
    }

    /// A JetStream stream name for this root: `CHORUS_<SUFFIX>` (root upper-cased, dots as `_`).
    pub fn stream_name(&self, suffix: &str) -> String {
        format!("{}_{suffix}", self.root.replace('.', "_").to_uppercase())
    }

    /// A key-value bucket name for this root: `chorus_<suffix>`.
    pub fn bucket_name(&self, suffix: &str) -> String {
        format!("{}_{suffix}", self.root.replace('.', "_"))
    }

    /// `<root>.sys.<what>`: registry, heartbeats, discovery and control subjects.
    ///
    /// # Errors
    /// [`SubjectError`] when `what` is not 1 to 16 dot-separated tokens of 1 to 64 letters, digits,
    /// `_` or `-`.
    pub fn system(&self, what: &str) -> Result<String, SubjectError> {
        validate_dotted("system subject", what)?;
        Ok(format!("{}.sys.{what}", self.root))
    }

    /// `<root>.dlq.<what>`: dead-letter subjects.
    ///
    /// # Errors
    /// [`SubjectError`] when `what` is not 1 to 16 dot-separated tokens of 1 to 64 letters, digits,
    /// `_` or `-`.
    pub fn dead_letter(&self, what: &str) -> Result<String, SubjectError> {
        validate_dotted("dead-letter subject", what)?;
        Ok(format!("{}.dlq.{what}", self.root))
    }

    /// `_INBOX.<agent>`: the agent's own reply prefix; the server can restrict the agent to
    /// subscribe only under it.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn inbox_prefix(&self, agent: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        Ok(format!("_INBOX.{agent}"))
    }

    /// `_INBOX.<agent>.>`: every reply subject under the agent's own prefix.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn inbox_all(&self, agent: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        Ok(format!("_INBOX.{agent}.>"))
    }

    /// `<root>.>`: every subject of the bus.
    pub fn everything(&self) -> String {
        format!("{}.>", self.root)
    }

    /// `<root>.agent.*.*`: every command and request to any agent.
    pub fn commands_all(&self) -> String {
        format!("{}.agent.*.*", self.root)
    }

    /// `<root>.cap.>`: every capability's access point.
    pub fn capabilities_all(&self) -> String {
        format!("{}.cap.>", self.root)
    }

    /// What the inbox stream republishes as bells: `<root>.inbox.*.*.*`, every durable
    /// command (agent, lane, command).
    pub fn bell_source(&self) -> String {
        format!("{}.inbox.*.*.*", self.root)
    }

    /// Where the bell of a stored durable command goes: `_INBOX.<agent>.bell.<root>.<lane>.<command>`,
    /// as a subject transform of [`bell_source`](Self::bell_source). Under the agent's own
    /// reply prefix, so the rights it already has to hear its replies cover its bells.
    pub fn bell_destination(&self) -> String {
        format!(
            "_INBOX.{{{{wildcard(1)}}}}.bell.{}.{{{{wildcard(2)}}}}.{{{{wildcard(3)}}}}",
            self.root
        )
    }

    /// `_INBOX.<agent>.bell.<root>.<lane>.*`: the bells of one lane (`high` or `normal`) of
    /// one agent's durable inbox.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn lane_bells(&self, agent: &str, high: bool) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        let lane = if high { "high" } else { "normal" };
        Ok(format!("_INBOX.{agent}.bell.{}.{lane}.*", self.root))
    }

    /// `<root>.inbox.<agent>.>`: both lanes of one agent's durable inbox.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn durable_agent_all(&self, agent: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        Ok(format!("{}.inbox.{agent}.>", self.root))
    }

    /// The server's max-deliveries and terminated advisories about the consumers of this
    /// root's stream `suffix` (the dead-letter queue captures them).
    pub fn consumer_advisories(&self, suffix: &str) -> Vec<String> {
        let stream = self.stream_name(suffix);
        vec![
            format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.*"),
            format!("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{stream}.*"),
        ]
    }

    /// The NATS service-discovery subjects (`$SRV`, ADR-32) an agent answers on: every
    /// service, services named `agent`, and this one instance.
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` or `instance` is not a single token of 1 to 64 letters,
    /// digits, `_` or `-`.
    pub fn service_discovery(
        &self,
        agent: &str,
        instance: &str,
    ) -> Result<[String; 3], SubjectError> {
        validate_token("agent id", agent)?;
        validate_token("instance", instance)?;
        Ok([
            "$SRV.*".to_owned(),
            format!("$SRV.*.{agent}"),
            format!("$SRV.*.{agent}.{instance}"),
        ])
    }

    /// `<root>.task.<task-id>.<kind>`: one kind of message of one task (the task stream's).
    pub fn task(&self, task: &uuid::Uuid, kind: crate::protocol::task::TaskMessage) -> String {
        format!("{}.task.{task}.{kind}", self.root)
    }

    /// `<root>.task.<task-id>.*`: every message of one task.
    pub fn task_all(&self, task: &uuid::Uuid) -> String {
        format!("{}.task.{task}.*", self.root)
    }

    /// `<root>.task.*.<kind>`: one kind of message of every task (`status` lists tasks).
    pub fn tasks_of_kind(&self, kind: crate::protocol::task::TaskMessage) -> String {
        format!("{}.task.*.{kind}", self.root)
    }

    /// `<root>.task.>`: every message of every task (what an agent that uses tasks writes).
    pub fn tasks_all(&self) -> String {
        format!("{}.task.>", self.root)
    }

    /// The task id and message kind of a task subject.
    pub fn task_of(
        &self,
        subject: &str,
    ) -> Option<(uuid::Uuid, crate::protocol::task::TaskMessage)> {
        let rest = subject.strip_prefix(&*self.root)?.strip_prefix(".task.")?;
        let (id, kind) = rest.split_once('.')?;
        Some((
            uuid::Uuid::try_parse(id).ok()?,
            crate::protocol::task::TaskMessage::parse(kind)?,
        ))
    }

    /// `<root>.usage.<agent>`: the agent's usage reports (PROTOCOL.md section 7.13).
    ///
    /// # Errors
    /// [`SubjectError`] when `agent` is not a single token of 1 to 64 letters, digits, `_` or `-`.
    pub fn usage(&self, agent: &str) -> Result<String, SubjectError> {
        validate_token("agent id", agent)?;
        Ok(format!("{}.usage.{agent}", self.root))
    }

    /// `<root>.usage.>`: every agent's usage reports (the usage stream's subjects).
    pub fn usage_all(&self) -> String {
        format!("{}.usage.>", self.root)
    }

    /// `<root>.dlq.>`: every dead letter (the dead-letter stream's subjects).
    pub fn dead_letters(&self) -> String {
        format!("{}.dlq.>", self.root)
    }

    /// The reason token of a dead-letter subject `<root>.dlq.<reason>.<agent>`.
    pub fn dead_letter_reason<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject.strip_prefix(&*self.root)?.strip_prefix(".dlq.")?;
        rest.split('.').next().filter(|r| !r.is_empty())
    }

    /// `$JS.ACK.<stream>.>`: acknowledgements of deliveries from this root's stream `suffix`.
    pub fn stream_acks(&self, suffix: &str) -> String {
        format!("$JS.ACK.{}.>", self.stream_name(suffix))
    }

    /// `$KV.<bucket>.<key_prefix>.>`: the keys under one prefix of this root's bucket `suffix`.
    ///
    /// # Errors
    /// [`SubjectError`] when `key_prefix` is not 1 to 16 dot-separated tokens of 1 to 64 letters,
    /// digits, `_` or `-`.
    pub fn bucket_keys(&self, suffix: &str, key_prefix: &str) -> Result<String, SubjectError> {
        validate_dotted("key prefix", key_prefix)?;
        Ok(format!("$KV.{}.{key_prefix}.>", self.bucket_name(suffix)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_the_documented_subjects() {
        let s = Subjects::default();
        assert_eq!(
            s.command("calculator", "calculation").as_deref(),
            Ok("chorus.agent.calculator.calculation")
        );
        assert_eq!(
            s.capability("text.ocr").as_deref(),
            Ok("chorus.cap.text.ocr")
        );
        assert_eq!(s.event("doc.ready").as_deref(), Ok("chorus.evt.doc.ready"));
        assert_eq!(
            s.event_pattern("doc.*.>").as_deref(),
            Ok("chorus.evt.doc.*.>")
        );
        assert_eq!(s.agent_inbound("a-1").as_deref(), Ok("chorus.agent.a-1.*"));
        assert_eq!(s.inbox_prefix("a-1").as_deref(), Ok("_INBOX.a-1"));
        assert_eq!(s.command_name("chorus.agent.a-1.add"), Some("add"));
        assert_eq!(s.topic_of("chorus.evt.doc.ready"), Some("doc.ready"));
        assert_eq!(
            s.broadcast(&BroadcastTarget::All).as_deref(),
            Ok("chorus.bcast.all")
        );
        for t in [
            BroadcastTarget::All,
            BroadcastTarget::Group("night-shift".into()),
            BroadcastTarget::Capability("text.ocr".into()),
        ] {
            let subject = s.broadcast(&t).expect("subject");
            assert_eq!(s.broadcast_target(&subject), Some(t));
        }
        assert_eq!(
            s.durable("a-1", "scan", false).as_deref(),
            Ok("chorus.inbox.a-1.normal.scan")
        );
        assert_eq!(
            s.durable("a-1", "scan", true).as_deref(),
            Ok("chorus.inbox.a-1.high.scan")
        );
        assert_eq!(
            s.durable_command("chorus.inbox.a-1.high.scan"),
            Some("scan")
        );
        assert_eq!(s.durable_command("chorus.inbox.a-1.scan"), None);
        assert_eq!(s.stream_name("DLQ"), "CHORUS_DLQ");
        let custom = Subjects::new("acme.bus").expect("valid root");
        assert_eq!(custom.stream_name("DLQ"), "ACME_BUS_DLQ");
        assert_eq!(custom.bucket_name("registry"), "acme_bus_registry");
        assert_eq!(custom.event("x").as_deref(), Ok("acme.bus.evt.x"));
        assert_eq!(custom.everything(), "acme.bus.>");
        assert_eq!(custom.dead_letters(), "acme.bus.dlq.>");
        assert_eq!(
            custom.dead_letter_reason("acme.bus.dlq.expired.a-1"),
            Some("expired")
        );
        assert_eq!(custom.dead_letter_reason("acme.bus.evt.x"), None);
        assert_eq!(s.inbox_all("a-1").as_deref(), Ok("_INBOX.a-1.>"));
        assert_eq!(s.bell_source(), "chorus.inbox.*.*.*");
        assert_eq!(
            s.bell_destination(),
            "_INBOX.{{wildcard(1)}}.bell.chorus.{{wildcard(2)}}.{{wildcard(3)}}"
        );
        assert_eq!(
            s.lane_bells("a-1", true).as_deref(),
            Ok("_INBOX.a-1.bell.chorus.high.*")
        );
        assert_eq!(
            s.lane_bells("a-1", false).as_deref(),
            Ok("_INBOX.a-1.bell.chorus.normal.*")
        );
        assert_eq!(
            s.durable_agent_all("a-1").as_deref(),
            Ok("chorus.inbox.a-1.>")
        );
        assert_eq!(s.stream_acks("INBOX"), "$JS.ACK.CHORUS_INBOX.>");
        assert_eq!(
            s.bucket_keys("idempotency", "a-1").as_deref(),
            Ok("$KV.chorus_idempotency.a-1.>")
        );
    }

    #[test]
    fn refuses_tokens_that_would_break_subjects() {
        let s = Subjects::default();
        for bad in ["", "a b", "a.b", "a*", ">", "é", &"x".repeat(65)] {
            assert!(s.command(bad, "run").is_err(), "agent {bad:?}");
            assert!(s.command("a", bad).is_err(), "command {bad:?}");
        }
        for bad in ["", "a..b", ".a", "a.", "a.*", "a.>", "a b"] {
            assert!(s.event(bad).is_err(), "topic {bad:?}");
            assert!(s.capability(bad).is_err(), "capability {bad:?}");
        }
        assert!(s.event_pattern("a.>.b").is_err());
        assert!(s.event(&vec!["t"; 17].join(".")).is_err());
        assert!(Subjects::new("bad root").is_err());
    }

    #[test]
    fn a_task_subject_names_its_task_and_kind_and_nothing_else_parses_as_one() {
        use crate::protocol::task::TaskMessage;
        let s = Subjects::new("acme.bus").expect("valid root");
        let id = uuid::Uuid::now_v7();
        for kind in TaskMessage::ALL {
            let subject = s.task(&id, kind);
            assert_eq!(subject, format!("acme.bus.task.{id}.{kind}"));
            assert_eq!(s.task_of(&subject), Some((id, kind)));
        }
        assert_eq!(s.task_all(&id), format!("acme.bus.task.{id}.*"));
        assert_eq!(
            s.tasks_of_kind(TaskMessage::Status),
            "acme.bus.task.*.status"
        );
        for other in [
            format!("acme.bus.task.{id}.verdict"),
            "acme.bus.task.not-a-uuid.status".to_owned(),
            format!("chorus.task.{id}.status"),
            format!("acme.bus.agent.{id}.status"),
        ] {
            assert_eq!(s.task_of(&other), None, "{other}");
        }
    }
}
