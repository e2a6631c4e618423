//! Status codes: the AIXP range 5001-5009 kept with its meanings, extended from 5010 for what
//! it lacks. `docs/PROTOCOL.md` carries the same table; a test keeps the two in step.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A protocol status code. Unknown codes (from a newer peer) are kept as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StatusCode(pub u16);

macro_rules! status_codes {
    ($( $(#[$doc:meta])* $name:ident = $code:literal, $label:literal, $desc:literal; )*) => {
        impl StatusCode {
            $( $(#[$doc])* pub const $name: StatusCode = StatusCode($code); )*

            /// Every code this version defines, in order.
            pub const ALL: &'static [StatusCode] = &[$(StatusCode::$name),*];

            /// A short stable label (used in logs and metric labels), or `"unknown"`.
            pub fn label(self) -> &'static str {
                match self.0 { $($code => $label,)* _ => "unknown" }
            }

            /// What the code means, or `None` for a code this version does not know.
            pub fn description(self) -> Option<&'static str> {
                match self.0 { $($code => Some($desc),)* _ => None }
            }
        }
    };
}

status_codes! {
    /// The agent connected (AIXP).
    CONNECTED = 5001, "connected", "Success: agent connected";
    /// The message was received and processed: the success code of every reply (AIXP).
    OK = 5002, "ok", "Success: data received and processed";
    /// The agent disconnected in an orderly way (AIXP).
    DISCONNECTED = 5003, "disconnected", "Agent disconnected";
    /// Identity problem: unknown sender, bad credentials, a sender field naming another agent,
    /// a signature that does not verify against the sender's key (AIXP).
    IDENTITY = 5004, "identity", "Agent identification issue (not found or invalid credentials)";
    /// Communication problem: the request timed out (AIXP; rate limits have 5013).
    TIMEOUT = 5005, "timeout", "Agent communication issue (timeout)";
    /// The message does not decode, has an unsupported encoding or major version, or is too
    /// large (AIXP).
    DATA_FORMAT = 5006, "data_format", "Data format and compatibility issue (unsupported format or incompatible version)";
    /// The sender lacks a permission the handler requires (AIXP).
    ACCESS = 5007, "access", "Access and privilege issue (insufficient access or maximum agents reached)";
    /// A connection limit was reached (AIXP).
    CONNECTION_LIMIT = 5008, "connection_limit", "Connection limit issue (agent connection limit exceeded)";
    /// The agent went away without saying goodbye (AIXP).
    UNEXPECTED_DISCONNECT = 5009, "unexpected_disconnect", "Unexpected agent disconnection";
    /// The hop count passed the hop limit: refused to break a loop.
    LOOP_DETECTED = 5010, "loop_detected", "Loop detected: hop limit exceeded";
    /// The message's TTL or deadline passed before it was handled.
    EXPIRED = 5011, "expired", "Message expired before it was handled";
    /// Nobody serves the subject (no agent, no capability holder).
    NO_RESPONDERS = 5012, "no_responders", "No agent is serving this subject";
    /// The sender exceeded its request rate.
    RATE_LIMITED = 5013, "rate_limited", "Rate limit exceeded";
    /// Authentication missing or invalid (no token, no signature where one is required).
    UNAUTHORIZED = 5014, "unauthorized", "Unauthorized: missing or invalid authentication";
    /// A message id seen before, or a timestamp outside the accepted window.
    REPLAY = 5015, "replay", "Replayed or stale message refused";
    /// The agent has no handler for the command or capability named.
    UNKNOWN_COMMAND = 5016, "unknown_command", "No handler for this command";
    /// The handler ran and reported a failure of its own.
    HANDLER_FAILED = 5017, "handler_failed", "The handler failed";
    /// The payload decoded but is not valid for the handler (wrong shape or values).
    INVALID_ARGUMENT = 5018, "invalid_argument", "Invalid argument for this command";
    /// The agent is shutting down or overloaded and takes no new work; retry elsewhere.
    UNAVAILABLE = 5019, "unavailable", "Agent unavailable (shutting down or overloaded)";
    /// The work was cancelled before it finished.
    CANCELLED = 5020, "cancelled", "Cancelled";
    /// Accepted and in progress; a final report follows (progress reports carry it).
    ACCEPTED = 5021, "accepted", "Accepted, in progress";
    /// An unexpected error inside Chorus itself.
    INTERNAL = 5022, "internal", "Internal error";
    /// Exactly-once: an earlier run of this message was interrupted (its instance died
    /// mid-handler), so whether it took effect is unknown; it is not run again.
    UNCERTAIN = 5023, "uncertain", "Outcome uncertain: an earlier run was interrupted";
    /// A task cannot make this move from the state it is in (taken by another agent
    /// already, finished, cancelled).
    TASK_STATE = 5024, "task_state", "Not allowed in the task's current state";
    /// A task's result failed the requester's verification on every attempt allowed.
    UNVERIFIED = 5025, "unverified", "The result failed verification on every attempt";
}

impl StatusCode {
    /// Whether this code reports success (5001, 5002, 5021).
    pub fn is_success(self) -> bool {
        matches!(
            self,
            StatusCode::CONNECTED | StatusCode::OK | StatusCode::ACCEPTED
        )
    }
}

impl fmt::Display for StatusCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.0, self.label())
    }
}
