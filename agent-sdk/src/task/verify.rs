//! Verified results (AIXP's task completion): the requester checks each attempt's result
//! before accepting it, and on a failure starts another attempt as its policy says: on the
//! same agent, on another live holder of the capability that has not failed this task, or on a
//! supervisor, up to a limit. [`Agent::verify`](crate::Agent::verify) runs the loop.

use std::sync::Arc;

use super::TaskUpdate;
use crate::error::{Rejection, SdkError};

/// Attempts a verified task gets by default, the first included.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// A check of one result: `Ok` accepts it, `Err` says why not.
pub type CheckFn = dyn Fn(&TaskUpdate) -> Result<(), Rejection> + Send + Sync;

/// How a result is checked.
#[derive(Clone)]
pub(crate) enum Check {
    /// A function of the report.
    Function(Arc<CheckFn>),
    /// A JSON Schema the output (read as JSON) must meet.
    Schema(crate::schema::Schema),
    /// A supervisor agent asked with the output as the payload: a success answer passes it,
    /// a refusal fails it with its reason.
    Agent {
        /// The agent.
        agent: String,
        /// Its command.
        command: String,
    },
}

/// How a requester verifies a task's result and what it does when a result fails: retry on
/// the same agent, reassign to another holder, escalate to a supervisor, up to a number of
/// attempts.
///
/// ```
/// use chorus_sdk::task::Verification;
/// let schema = serde_json::json!({"type": "object", "required": ["summary"]});
/// let verification = Verification::schema(&schema)
///     .expect("a valid schema")
///     .max_attempts(3)
///     .escalate_to("editor-in-chief");
/// # drop(verification);
/// ```
#[derive(Clone)]
pub struct Verification {
    pub(crate) check: Check,
    pub(crate) max_attempts: u32,
    pub(crate) same_agent_retries: u32,
    pub(crate) reassign: bool,
    pub(crate) candidates: Vec<String>,
    pub(crate) supervisor: Option<String>,
}

impl std::fmt::Debug for Verification {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let check = match &self.check {
            Check::Function(_) => "function".to_owned(),
            Check::Schema(_) => "schema".to_owned(),
            Check::Agent { agent, command } => format!("agent {agent} {command}"),
        };
        f.debug_struct("Verification")
            .field("check", &check)
            .field("max_attempts", &self.max_attempts)
            .field("same_agent_retries", &self.same_agent_retries)
            .field("reassign", &self.reassign)
            .field("candidates", &self.candidates)
            .field("supervisor", &self.supervisor)
            .finish()
    }
}

impl Verification {
    fn new(check: Check) -> Self {
        Verification {
            check,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            same_agent_retries: 0,
            reassign: true,
            candidates: Vec::new(),
            supervisor: None,
        }
    }

    /// Checks each result with `check`.
    pub fn function(
        check: impl Fn(&TaskUpdate) -> Result<(), Rejection> + Send + Sync + 'static,
    ) -> Self {
        Verification::new(Check::Function(Arc::new(check)))
    }

    /// Checks that each result, read as JSON, meets `schema` (JSON Schema, the draft its
    /// `$schema` names, 2020-12 by default). A schema that does not compile is an error.
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] when `schema` does not compile.
    pub fn schema(schema: &serde_json::Value) -> Result<Self, SdkError> {
        let schema = crate::schema::Schema::compile(schema).map_err(SdkError::InvalidCall)?;
        Ok(Verification::new(Check::Schema(schema)))
    }

    /// Asks supervisor `agent` to judge each result with `command` (the output is the
    /// payload): its success answer accepts it, an error answer rejects it with the reason.
    pub fn agent(agent: impl Into<String>, command: impl Into<String>) -> Self {
        Verification::new(Check::Agent {
            agent: agent.into(),
            command: command.into(),
        })
    }

    /// At most `n` attempts in all, the first included (default 3; at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// An agent whose result failed gets `n` more tries before the task moves on (default 0).
    pub fn retries(mut self, n: u32) -> Self {
        self.same_agent_retries = n;
        self
    }

    /// Whether a failed task goes to another holder of its capability (default yes).
    pub fn reassign(mut self, on: bool) -> Self {
        self.reassign = on;
        self
    }

    /// The agents a failed task may be reassigned to, in order (default: the capability's
    /// live holders, from discovery). A task submitted to one agent needs this to be
    /// reassigned at all.
    pub fn candidates<I, S>(mut self, agents: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.candidates = agents.into_iter().map(Into::into).collect();
        self
    }

    /// The supervisor that gets the task when nobody else is left (it must serve the same
    /// task name or capability).
    pub fn escalate_to(mut self, agent: impl Into<String>) -> Self {
        self.supervisor = Some(agent.into());
        self
    }

    /// The verdict of a local check; `None` for a check that asks an agent.
    pub(crate) fn check_locally(&self, report: &TaskUpdate) -> Option<Result<(), String>> {
        match &self.check {
            Check::Function(f) => Some(f(report).map_err(|why| why.reason().to_owned())),
            Check::Schema(schema) => Some(match report.payload_as::<serde_json::Value>() {
                Ok(value) => {
                    let errors = schema.errors(&value, usize::MAX);
                    if errors.is_empty() {
                        Ok(())
                    } else {
                        Err(format!("does not meet the schema: {}", errors.join("; ")))
                    }
                }
                Err(e) => Err(format!("the output is not JSON: {e}")),
            }),
            Check::Agent { .. } => None,
        }
    }
}
