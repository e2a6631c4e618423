//! The envelope's closed vocabularies: kinds, performatives, delivery classes, priorities and
//! task states, written as lowercase strings; a value a newer version adds reads as `Unknown`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A closed vocabulary written as lowercase strings on the wire. A value this version does
/// not know decodes as `Unknown` instead of failing, so newer peers can add values.
macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $( $(#[$vdoc:meta])* $variant:ident = $text:literal, )* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum $name {
            $( $(#[$vdoc])* $variant, )*
            /// A value from a newer protocol version.
            Unknown,
        }

        impl $name {
            /// Every known value.
            pub const ALL: &'static [$name] = &[$($name::$variant),*];

            /// The wire form.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)* $name::Unknown => "unknown" }
            }

            /// The compact form's code (protocol 2): 1, 2, 3, ... in the order of
            /// `docs/PROTOCOL.md`'s table, new values only ever added at the end; 0 is
            /// `Unknown`.
            pub fn code(self) -> u8 {
                Self::ALL
                    .iter()
                    .position(|v| *v == self)
                    .and_then(|i| u8::try_from(i + 1).ok())
                    .unwrap_or(0)
            }

            /// The value of a compact code; a code this version does not know is `Unknown`.
            pub fn from_code(code: u64) -> Self {
                usize::try_from(code)
                    .ok()
                    .and_then(|c| c.checked_sub(1))
                    .and_then(|i| Self::ALL.get(i))
                    .copied()
                    .unwrap_or($name::Unknown)
            }
        }

        impl FromStr for $name {
            type Err = std::convert::Infallible;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Ok(match s { $($text => $name::$variant,)* _ => $name::Unknown })
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(self.as_str()) }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                Ok(s.parse().unwrap_or($name::Unknown))
            }
        }
    };
}

string_enum! {
    /// What the message is, structurally: it decides how the receiver routes and answers it.
    Kind {
        /// Asks for a reply (request-reply, to an agent or a capability).
        Request = "request",
        /// The reply to a request or command.
        Response = "response",
        /// A fact published to a topic; no reply.
        Event = "event",
        /// Tells one agent to do something; a result is returned when a reply subject is given.
        Command = "command",
        /// Liveness and load of an agent.
        Heartbeat = "heartbeat",
        /// An error report that is not a reply (for example, a dead letter notice).
        Error = "error",
        /// A push to one agent (or, through the coordinator, each member of a group) that
        /// expects no reply and needs no topic subscription: it travels on the agent's own
        /// subjects (`docs/PROTOCOL.md` section 7.14).
        Notification = "notification",
    }
}

string_enum! {
    /// What the sender means by it (the speech act): Agentify's performatives with IACP's
    /// intents folded in.
    Performative {
        /// Please do this (Agentify request, IACP handoff/query requests).
        Request = "request",
        /// Here is information (results, events; IACP notify).
        Inform = "inform",
        /// A proposal in a negotiation.
        Propose = "propose",
        /// The receiver accepts and will do it.
        Agree = "agree",
        /// The receiver will not do it; the status code says why.
        Refuse = "refuse",
        /// Confirms something asserted earlier.
        Confirm = "confirm",
        /// The work was attempted and failed; the status code says why.
        Failure = "failure",
        /// The work is complete (task completion report).
        Done = "done",
        /// A question about state or capabilities (IACP query).
        Query = "query",
        /// Who can do X? (discovery).
        Discover = "discover",
        /// I can do X (answer to discover; capability manifest).
        Offer = "offer",
        /// Assigns a task to an agent.
        Assign = "assign",
        /// Cancels earlier work.
        Cancel = "cancel",
        /// Hands a task and its context to another agent (IACP handoff).
        Handoff = "handoff",
        /// A step in a negotiation (IACP negotiate).
        Negotiate = "negotiate",
        /// Progress of ongoing work.
        Progress = "progress",
        /// Liveness (IACP health).
        Health = "health",
    }
}

string_enum! {
    /// Scheduling priority; higher is served first where the transport allows it.
    Priority {
        /// Background work.
        Low = "low",
        /// The default.
        Normal = "normal",
        /// Ahead of normal work.
        High = "high",
        /// Ahead of everything else.
        Critical = "critical",
    }
}

string_enum! {
    /// Where a task (or other work a progress report is about) stands. The first five are
    /// protocol 1's progress states; the rest were added with tasks. A task uses A2A's
    /// vocabulary: submitted, accepted, working, input-required, then one of the terminal
    /// states completed, failed, cancelled, rejected or expired. It reads `queued` as
    /// `accepted` and `running` as `working` ([`TaskState::normalized`]); the legal moves are
    /// [`TaskState::can_become`]'s table.
    TaskState {
        /// Accepted, not started (protocol 1; a task says `accepted`).
        Queued = "queued",
        /// Being worked on (protocol 1; a task says `working`).
        Running = "running",
        /// Finished successfully.
        Completed = "completed",
        /// Finished with a failure; the status code says why.
        Failed = "failed",
        /// Cancelled before it finished.
        Cancelled = "cancelled",
        /// Recorded by the requester; nobody has taken it yet.
        Submitted = "submitted",
        /// An agent took it and will work on it.
        Accepted = "accepted",
        /// Being worked on.
        Working = "working",
        /// Waiting for the requester's answer to a question.
        InputRequired = "input_required",
        /// The agent asked would not take it; the status code says why.
        Rejected = "rejected",
        /// Its deadline passed before it finished.
        Expired = "expired",
    }
}

/// The name protocol 1 gave [`TaskState`].
pub type ProgressState = TaskState;

string_enum! {
    /// The delivery guarantee a sender asked for (see `docs/PROTOCOL.md`, delivery classes).
    DeliveryClass {
        /// Core NATS: delivered zero or one time; nothing is stored.
        AtMostOnce = "at_most_once",
        /// JetStream: stored until handled; redelivered until acknowledged, so a handler may
        /// see it more than once.
        AtLeastOnce = "at_least_once",
        /// At least once, plus deduplication on both ends: the handler runs once per message id.
        ExactlyOnce = "exactly_once",
    }
}

// The enum comes from a macro, so `#[derive(Default)]` cannot mark the variant.
#[allow(clippy::derivable_impls)]
impl Default for DeliveryClass {
    fn default() -> Self {
        DeliveryClass::AtMostOnce
    }
}

// The enum comes from a macro, so `#[derive(Default)]` cannot mark the variant.
#[allow(clippy::derivable_impls)]
impl Default for Priority {
    fn default() -> Self {
        Priority::Normal
    }
}

impl Priority {
    /// Its rank in a receiver's queue, 0 taken first: critical 0, high 1, normal 2, low 3; a
    /// priority from a newer version ranks as normal (section 7.9, "Priority").
    pub fn rank(self) -> usize {
        match self {
            Priority::Critical => 0,
            Priority::High => 1,
            Priority::Low => 3,
            _ => 2,
        }
    }
}
