//! What every part of an agent shares, sending or not: who it is, the subjects of its bus, its
//! connection, its JetStream context and its counters. The sending half (`outbound`) holds it
//! beside what only sending needs; parts that never send (exactly-once records, seen ids,
//! the `$SRV` answers) hold only this.

use std::sync::Arc;

use chorus_broker_adapter::{Broker, JetStream};

use crate::stats::AgentCounters;
use crate::subject::Subjects;

/// One agent's identity, subjects, connection and counters.
pub(crate) struct Link {
    /// The agent's id.
    pub(crate) id: String,
    /// The subjects of its bus.
    pub(crate) subjects: Subjects,
    /// Its connection.
    pub(crate) broker: Broker,
    /// Its JetStream context.
    pub(crate) js: JetStream,
    /// What it counted.
    pub(crate) counters: Arc<AgentCounters>,
    /// Set once the inbox stream is known to exist (before the first durable send).
    pub(crate) inbox_ready: tokio::sync::OnceCell<()>,
}

impl Link {
    /// Counts one message refused or ignored for want of a proof of its sender
    /// (`AgentStats::security_refused`).
    pub(crate) fn count_security_refusal(&self) {
        AgentCounters::bump(&self.counters.security_refused);
    }
}
