//! The commands and capabilities an agent serves: each an [`Endpoint`] with its handler, the
//! permissions it requires and the counts `$SRV.STATS` reports, kept in one [`Endpoints`]
//! table that the inbound pipeline, the durable inbox and presence all read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use super::Handler;
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
    requests: AtomicU64,
    errors: AtomicU64,
    processing_ns: AtomicU64,
    last_error: Mutex<String>,
}

/// What `$SRV.STATS` reports of one endpoint.
pub(crate) struct EndpointStats {
    pub(crate) requests: u64,
    pub(crate) errors: u64,
    pub(crate) processing_ns: u64,
    pub(crate) last_error: String,
}

impl Endpoint {
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
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            processing_ns: AtomicU64::new(0),
            last_error: Mutex::new(String::new()),
        }
    }

    /// Counts one handled request, how long it took and its error, if any.
    pub(crate) fn record(&self, took: Duration, error: Option<&str>) {
        AgentCounters::bump(&self.requests);
        self.processing_ns.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        if let Some(error) = error {
            AgentCounters::bump(&self.errors);
            error.clone_into(&mut lock(&self.last_error));
        }
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
}

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

    /// All endpoints, in registration order.
    pub(crate) fn all(&self) -> Vec<Arc<Endpoint>> {
        lock(&self.all).clone()
    }
}
