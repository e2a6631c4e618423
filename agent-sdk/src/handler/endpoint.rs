//! The commands and capabilities an agent serves: each an [`Endpoint`] with its handler, the
//! permissions it requires and the counts `$SRV.STATS` reports, kept in one [`Endpoints`]
//! table that the inbound pipeline, the durable inbox and presence all read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use super::{EventHandler, Handler};
use crate::registry::{EndpointInfo, EndpointRole};
use crate::stats::AgentCounters;
use crate::sync::{lock, read, write};

/// What an endpoint serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndpointKind {
    /// A command of this agent (`<root>.agent.<id>.<command>`).
    Command,
    /// A capability's access point, shared by its queue group.
    Capability,
    /// A subject of the bus's own (the coordinator's discovery and broadcast).
    Service,
}

/// A command or capability an agent serves.
pub(crate) struct Endpoint {
    pub(crate) name: String,
    pub(crate) subject: String,
    pub(crate) queue_group: Option<String>,
    pub(crate) kind: EndpointKind,
    pub(crate) handler: Arc<dyn Handler>,
    /// Permissions a sender must hold to be served here.
    pub(crate) required: RwLock<Vec<String>>,
    /// What the manifest says of it (`EndpointInfo`).
    said: RwLock<Said>,
    requests: AtomicU64,
    errors: AtomicU64,
    processing_ns: AtomicU64,
    /// How long it takes lately (the ETA of its capability).
    pub(crate) handling: crate::stats::Ewma,
    last_error: Mutex<String>,
}

/// What an endpoint says of itself in the manifest: [`Agent::describe`](crate::Agent::describe)
/// sets the description, a task handler marks it a task.
#[derive(Debug, Clone, Default, PartialEq)]
struct Said {
    description: Option<String>,
    input_schema: Option<serde_json::Value>,
    reply: Option<String>,
    task: bool,
}

/// What an endpoint does, as [`Agent::describe`](crate::Agent::describe) announces it in the
/// manifest: a sentence or two, the JSON Schema its payload follows, and how its reply reads
/// when it is not plain JSON. The gateway's MCP server lists it as a tool with these.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Description {
    text: String,
    input_schema: Option<serde_json::Value>,
    reply: Option<String>,
}

/// The longest description, in bytes.
pub const MAX_DESCRIPTION_BYTES: usize = 1024;
/// The largest input schema, in bytes of JSON: the manifest goes out in every heartbeat.
pub const MAX_INPUT_SCHEMA_BYTES: usize = 16 * 1024;

impl Description {
    /// What the command or capability does.
    pub fn new(text: impl Into<String>) -> Self {
        Description {
            text: text.into(),
            ..Description::default()
        }
    }

    /// The JSON Schema (a JSON object) its payload follows.
    #[must_use]
    pub fn input_schema(mut self, schema: serde_json::Value) -> Self {
        self.input_schema = Some(schema);
        self
    }

    /// How its reply's payload reads when not as plain JSON:
    /// [`REPLY_MCP_TOOL_RESULT`](crate::registry::REPLY_MCP_TOOL_RESULT), an MCP tool result.
    #[must_use]
    pub fn reply_format(mut self, format: impl Into<String>) -> Self {
        self.reply = Some(format.into());
        self
    }

    /// Checks it: a description of at most [`MAX_DESCRIPTION_BYTES`], a schema that is a JSON
    /// object of at most [`MAX_INPUT_SCHEMA_BYTES`] and compiles as JSON Schema.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.text.len() > MAX_DESCRIPTION_BYTES {
            return Err(format!(
                "a description is at most {MAX_DESCRIPTION_BYTES} bytes, this one {}",
                self.text.len()
            ));
        }
        if let Some(schema) = &self.input_schema {
            if !schema.is_object() {
                return Err("an input schema is a JSON object".to_owned());
            }
            let size = serde_json::to_vec(schema).map_or(usize::MAX, |b| b.len());
            if size > MAX_INPUT_SCHEMA_BYTES {
                return Err(format!(
                    "an input schema is at most {MAX_INPUT_SCHEMA_BYTES} bytes of JSON, this one {size}"
                ));
            }
            crate::schema::Schema::compile(schema).map_err(|e| format!("the input schema: {e}"))?;
        }
        if let Some(reply) = &self.reply
            && reply != crate::registry::REPLY_MCP_TOOL_RESULT
        {
            return Err(format!(
                "reply format {reply:?}: the one known is {}",
                crate::registry::REPLY_MCP_TOOL_RESULT
            ));
        }
        Ok(())
    }
}

/// What `$SRV.STATS` reports of one endpoint.
pub(crate) struct EndpointStats {
    pub(crate) requests: u64,
    pub(crate) errors: u64,
    pub(crate) processing_ns: u64,
    pub(crate) last_error: String,
}

impl Endpoint {
    /// Whether it runs as a task (its messages are counted as tasks in usage).
    pub(crate) fn is_task(&self) -> bool {
        read(&self.said).task
    }

    pub(crate) fn new(
        name: String,
        subject: String,
        queue_group: Option<String>,
        kind: EndpointKind,
        handler: Arc<dyn Handler>,
    ) -> Self {
        Endpoint {
            name,
            subject,
            queue_group,
            kind,
            handler,
            required: RwLock::new(Vec::new()),
            said: RwLock::new(Said::default()),
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            processing_ns: AtomicU64::new(0),
            handling: crate::stats::Ewma::default(),
            last_error: Mutex::new(String::new()),
        }
    }

    /// Counts one handled request, how long it took and its error, if any.
    /// A task's handler only accepts it (`task`): its runs are timed where they end, not here.
    pub(crate) fn record(&self, took: Duration, error: Option<&str>, task: bool) {
        AgentCounters::bump(&self.requests);
        if !task {
            self.handling.record(took);
        }
        self.processing_ns.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        if let Some(error) = error {
            AgentCounters::bump(&self.errors);
            error.clone_into(&mut lock(&self.last_error));
        }
    }

    /// Whether the manifest lists it: a command or a capability, not a service subject.
    fn listed(&self) -> bool {
        matches!(self.kind, EndpointKind::Command | EndpointKind::Capability)
    }

    pub(crate) fn stats(&self) -> EndpointStats {
        EndpointStats {
            requests: self.requests.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            processing_ns: self.processing_ns.load(Ordering::Relaxed),
            last_error: lock(&self.last_error).clone(),
        }
    }
}

/// Every endpoint of one agent: commands by name (for dispatch), and all of them in the
/// order they were registered (for the manifest and service discovery).
#[derive(Default)]
pub(crate) struct Endpoints {
    commands: RwLock<HashMap<String, Arc<Endpoint>>>,
    /// Serves every command that has no endpoint of its own (a gateway's edge identity).
    other_commands: RwLock<Option<Arc<Endpoint>>>,
    all: Mutex<Vec<Arc<Endpoint>>>,
    /// Notification handlers by name; [`ANY_NOTIFICATION`] takes those without one.
    notifications: RwLock<HashMap<String, Arc<dyn EventHandler>>>,
    /// How long any of them takes lately (the agent's ETA).
    pub(crate) handling: crate::stats::Ewma,
}

/// The name under which a notification handler takes every notification that has no
/// handler of its own.
pub const ANY_NOTIFICATION: &str = "*";

impl Endpoints {
    /// Adds (or replaces) a command endpoint; returns whether one was replaced.
    pub(crate) fn add_command(&self, endpoint: Arc<Endpoint>) -> bool {
        let name = endpoint.name.clone();
        let previous = write(&self.commands).insert(name.clone(), Arc::clone(&endpoint));
        let mut all = lock(&self.all);
        all.retain(|e| e.kind != EndpointKind::Command || e.name != name);
        all.push(endpoint);
        previous.is_some()
    }

    /// Adds a capability or service endpoint.
    pub(crate) fn add(&self, endpoint: Arc<Endpoint>) {
        lock(&self.all).push(endpoint);
    }

    /// Sets the endpoint of every command without one of its own; it is not listed in the
    /// manifest or `$SRV` (it is no command of its own). Returns whether one was replaced.
    pub(crate) fn set_other_commands(&self, endpoint: Arc<Endpoint>) -> bool {
        write(&self.other_commands).replace(endpoint).is_some()
    }

    /// The command endpoint called `name`, else the one serving all other commands.
    pub(crate) fn command(&self, name: &str) -> Option<Arc<Endpoint>> {
        read(&self.commands)
            .get(name)
            .cloned()
            .or_else(|| read(&self.other_commands).clone())
    }

    /// The first endpoint (command or capability) called `name`.
    pub(crate) fn named(&self, name: &str) -> Option<Arc<Endpoint>> {
        lock(&self.all).iter().find(|e| e.name == name).cloned()
    }

    /// Sets what the commands and capabilities called `name` say of themselves; false when
    /// there is none.
    pub(crate) fn describe(&self, name: &str, description: &Description) -> bool {
        let mut found = false;
        for e in lock(&self.all)
            .iter()
            .filter(|e| e.listed() && e.name == name)
        {
            let mut said = write(&e.said);
            said.description = Some(description.text.clone());
            said.input_schema.clone_from(&description.input_schema);
            said.reply.clone_from(&description.reply);
            found = true;
        }
        found
    }

    /// Marks the `kind` endpoint called `name` a task.
    pub(crate) fn mark_task(&self, name: &str, kind: EndpointKind) {
        for e in lock(&self.all)
            .iter()
            .filter(|e| e.kind == kind && e.name == name)
        {
            write(&e.said).task = true;
        }
    }

    /// What the manifest says of the commands and capabilities that say something.
    pub(crate) fn info(&self) -> Vec<EndpointInfo> {
        let mut info: Vec<EndpointInfo> = lock(&self.all)
            .iter()
            .filter(|e| e.listed())
            .filter_map(|e| {
                let said = read(&e.said).clone();
                if said == Said::default() {
                    return None;
                }
                Some(EndpointInfo {
                    name: e.name.clone(),
                    kind: if e.kind == EndpointKind::Command {
                        EndpointRole::Command
                    } else {
                        EndpointRole::Capability
                    },
                    description: said.description,
                    input_schema: said.input_schema,
                    task: said.task,
                    reply: said.reply,
                })
            })
            .collect();
        info.sort_by(|a, b| (a.kind as u8, &a.name).cmp(&(b.kind as u8, &b.name)));
        info.dedup_by(|a, b| a.kind == b.kind && a.name == b.name);
        info
    }

    /// All endpoints, in registration order.
    pub(crate) fn all(&self) -> Vec<Arc<Endpoint>> {
        lock(&self.all).clone()
    }

    /// Adds (or replaces) the handler of notification `name` ([`ANY_NOTIFICATION`] for
    /// every one without its own); returns whether one was replaced.
    pub(crate) fn add_notification(&self, name: &str, handler: Arc<dyn EventHandler>) -> bool {
        write(&self.notifications)
            .insert(name.to_owned(), handler)
            .is_some()
    }

    /// The handler of notification `name`, else the one taking every other notification.
    pub(crate) fn notification(&self, name: &str) -> Option<Arc<dyn EventHandler>> {
        let handlers = read(&self.notifications);
        handlers
            .get(name)
            .or_else(|| handlers.get(ANY_NOTIFICATION))
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptions_are_checked_before_they_are_announced() {
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "number"}}});
        assert_eq!(
            Description::new("adds").input_schema(schema).check(),
            Ok(())
        );
        assert!(
            Description::new("x".repeat(MAX_DESCRIPTION_BYTES + 1))
                .check()
                .is_err()
        );
        assert!(
            Description::new("a list")
                .input_schema(serde_json::json!([1]))
                .check()
                .is_err()
        );
        assert!(
            Description::new("bad")
                .input_schema(serde_json::json!({"type": 12}))
                .check()
                .is_err_and(|e| e.contains("does not compile"))
        );
        let huge = serde_json::json!({"description": "x".repeat(MAX_INPUT_SCHEMA_BYTES)});
        assert!(Description::new("huge").input_schema(huge).check().is_err());
        assert!(Description::new("odd").reply_format("xml").check().is_err());
    }
}
