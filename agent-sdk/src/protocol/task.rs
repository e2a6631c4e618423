//! The task protocol's rules, with no I/O: which state may follow which, and the kinds of
//! message a task is made of (one subject each, `<root>.task.<task-id>.<kind>`).
//!
//! ```text
//! submitted ──> accepted ──> working <──> input_required
//!     │            │           │              │
//!     └────────────┴───────────┴──────────────┴──> completed | failed | cancelled | expired
//! submitted ──> rejected
//! working, submitted ──> submitted     (a new attempt: retried, reassigned, escalated)
//! ```
//!
//! - `completed` only from `working` (a result needs someone who worked on it).
//! - `rejected` only from `submitted` (refusing work already taken is a failure).
//! - `failed`, `cancelled` and `expired` from any live state.
//! - Terminal states are final: nothing follows them.
//! - `working` may follow `working` (a handoff to another agent).
//! - `submitted` may follow `working` or `submitted`: the requester starts a new attempt, on
//!   the same agent or another, after a result failed its verification or an agent refused.

use std::fmt;

use super::envelope::TaskState;

impl TaskState {
    /// The state a task means by this value: protocol 1's `queued` is `accepted`, `running`
    /// is `working`; the rest are themselves.
    pub fn normalized(self) -> TaskState {
        match self {
            TaskState::Queued => TaskState::Accepted,
            TaskState::Running => TaskState::Working,
            other => other,
        }
    }

    /// Whether nothing may follow this state.
    pub fn is_terminal(self) -> bool {
        matches!(
            self.normalized(),
            TaskState::Completed
                | TaskState::Failed
                | TaskState::Cancelled
                | TaskState::Rejected
                | TaskState::Expired
        )
    }

    /// Whether a task in this state may move to `next` (the table in this module's doc).
    pub fn can_become(self, next: TaskState) -> bool {
        use TaskState as S;
        let (from, to) = (self.normalized(), next.normalized());
        match (from, to) {
            _ if from.is_terminal() => false,
            (_, S::Unknown) | (S::Unknown, _) => false,
            (S::Submitted | S::Working, S::Submitted) => true,
            (S::Submitted, S::Accepted | S::Rejected) => true,
            (S::Accepted, S::Working) => true,
            (S::Working, S::Working | S::InputRequired | S::Completed) => true,
            (S::InputRequired, S::Working) => true,
            (_, S::Failed | S::Cancelled | S::Expired) => true,
            _ => false,
        }
    }
}

/// A move the table refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a task that is {from} cannot become {to}")]
pub struct IllegalTransition {
    /// The state it is in.
    pub from: TaskState,
    /// The state asked for.
    pub to: TaskState,
}

/// Checks one move against the table; a new task (no state yet) may only be `submitted`.
///
/// # Errors
/// [`IllegalTransition`] when the table does not allow the move (a new task may only become
/// `submitted`).
pub fn transition(from: Option<TaskState>, to: TaskState) -> Result<(), IllegalTransition> {
    let legal = match from {
        None => to == TaskState::Submitted,
        Some(from) => from.can_become(to),
    };
    if legal {
        Ok(())
    } else {
        Err(IllegalTransition {
            from: from.unwrap_or(TaskState::Unknown),
            to,
        })
    }
}

/// The kinds of message a task is made of; each has its own subject under the task's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskMessage {
    /// A change of state (the first is the submission itself, carrying the input). Written
    /// only on the subject's expected last sequence, so two writers cannot both move it.
    Status,
    /// Progress: a fraction, a message, optional partial data.
    Progress,
    /// One piece of a streamed result, numbered from 1.
    Chunk,
    /// The requester's answer to an `input_required` question.
    Input,
    /// The requester asks for the work to stop.
    Cancel,
    /// One attempt's result, when the requester verifies results before accepting them (the
    /// submission expects `confirm`): `done` with the output, or `failure` with the code.
    Report,
}

impl TaskMessage {
    /// Every kind.
    pub const ALL: [TaskMessage; 6] = [
        TaskMessage::Status,
        TaskMessage::Progress,
        TaskMessage::Chunk,
        TaskMessage::Input,
        TaskMessage::Cancel,
        TaskMessage::Report,
    ];

    /// The last token of its subject.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskMessage::Status => "status",
            TaskMessage::Progress => "progress",
            TaskMessage::Chunk => "chunk",
            TaskMessage::Input => "input",
            TaskMessage::Cancel => "cancel",
            TaskMessage::Report => "report",
        }
    }

    /// The kind a subject token names.
    pub fn parse(token: &str) -> Option<TaskMessage> {
        TaskMessage::ALL.into_iter().find(|k| k.as_str() == token)
    }
}

impl fmt::Display for TaskMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TaskState as S;

    const LIVE: [S; 5] = [
        S::Submitted,
        S::Accepted,
        S::Working,
        S::InputRequired,
        S::Running,
    ];
    const TERMINAL: [S; 5] = [
        S::Completed,
        S::Failed,
        S::Cancelled,
        S::Rejected,
        S::Expired,
    ];

    #[test]
    fn every_legal_move_of_the_table() {
        let legal = [
            (S::Submitted, S::Submitted),
            (S::Working, S::Submitted),
            (S::Submitted, S::Accepted),
            (S::Submitted, S::Rejected),
            (S::Submitted, S::Failed),
            (S::Submitted, S::Cancelled),
            (S::Submitted, S::Expired),
            (S::Accepted, S::Working),
            (S::Accepted, S::Failed),
            (S::Accepted, S::Cancelled),
            (S::Accepted, S::Expired),
            (S::Working, S::Working),
            (S::Working, S::InputRequired),
            (S::Working, S::Completed),
            (S::Working, S::Failed),
            (S::Working, S::Cancelled),
            (S::Working, S::Expired),
            (S::InputRequired, S::Working),
            (S::InputRequired, S::Failed),
            (S::InputRequired, S::Cancelled),
            (S::InputRequired, S::Expired),
        ];
        for from in S::ALL.iter().copied().chain([S::Unknown]) {
            for to in S::ALL.iter().copied().chain([S::Unknown]) {
                let expected = legal.contains(&(from.normalized(), to.normalized()));
                assert_eq!(
                    from.can_become(to),
                    expected,
                    "{from} -> {to} should be {}",
                    if expected { "legal" } else { "refused" }
                );
            }
        }
    }

    #[test]
    fn terminal_states_are_final() {
        for from in TERMINAL {
            assert!(from.is_terminal());
            for to in S::ALL {
                assert!(!from.can_become(*to), "{from} -> {to}");
            }
        }
        for state in LIVE {
            assert!(!state.is_terminal(), "{state}");
        }
    }

    #[test]
    fn protocol_one_names_read_as_the_task_states() {
        assert_eq!(S::Queued.normalized(), S::Accepted);
        assert_eq!(S::Running.normalized(), S::Working);
        assert!(S::Queued.can_become(S::Running));
        assert!(S::Running.can_become(S::Completed));
    }

    #[test]
    fn a_new_task_starts_submitted_and_nothing_else() {
        assert!(transition(None, S::Submitted).is_ok());
        for to in S::ALL.iter().filter(|s| **s != S::Submitted) {
            let err = transition(None, *to).expect_err("refused");
            assert_eq!(err.to, *to);
        }
        let err = transition(Some(S::Completed), S::Working).expect_err("refused");
        assert_eq!(
            err.to_string(),
            "a task that is completed cannot become working"
        );
    }

    #[test]
    fn message_kinds_round_trip_through_their_subject_token() {
        for kind in TaskMessage::ALL {
            assert_eq!(TaskMessage::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(TaskMessage::parse("verdict"), None);
    }
}
