//! The demo behind `chorus up`: small agents acting out the source documents' own scenarios.
//!
//! - AIXP: an OCR agent reads a scanned document and hands the text to an NLP agent, which
//!   answers with a word count, the most common word and a sentiment.
//! - Agentify: an orchestrator asks the calculator agent (`agent.calculator.calculation`) to
//!   compute, including a division by zero that comes back as a coded error.
//! - Events: the orchestrator announces a finished task; three watchers each receive it.
//! - Loop protection: two agents that relay to each other forever are stopped at the hop limit.
//! - Coordinator: discovery of the OCR capability, a broadcast to the watcher group with its
//!   per-recipient report, and a poison durable command retried and then dead-lettered.
//! - Tasks: a writer streams a draft chunk by chunk, a long research task reports progress
//!   and is cancelled, and a summary that fails the orchestrator's check (a JSON Schema) is
//!   reassigned from the fast summarizer to the careful one.
//! - Contract-net: both summarizers bid for a summary; the most confident wins the task.
//! - Python (with `chorus up --python`): the orchestrator asks a Python agent, which asks the
//!   Rust calculator in turn, and follows a task the Python agent streams.

//!
//! - [`model`]: what the agents exchange and what a run reports;
//! - `skills`: the agents' own work (text analysis, arithmetic), tested without a server;
//! - `agents`: [`Demo::start`], the agents and their handlers, each a [`Role`] that runs in this
//!   process or on its own under a host (`chorus demo-agent NAME`);
//! - `scenarios`: [`Demo::run`], the scenarios in order;
//! - `python`: the Python agent's process and its scenario.

mod agents;
pub mod model;
mod python;
mod scenarios;
mod skills;

use chorus_sdk::Agent;
use tokio::sync::{Mutex, mpsc};

pub use agents::{AGENTS, Role};
pub use model::{
    Analysis, Calculation, DemoReport, OcrReport, Posting, ScannedDocument, Seen, Summary,
    TaskScenes,
};
pub use python::{PYTHON_AGENT, PythonAgent};

const WATCHERS: [&str; 3] = ["audit", "dashboard", "notifier"];
/// Where a watcher tells the orchestrator of an event it got (a [`Seen`]).
const SEEN_TOPIC: &str = "demo.seen";
const RELAY_HOP_LIMIT: u8 = 8;
/// The demo's orchestrator, which sends the poison posting.
const ORCHESTRATOR: &str = "orchestrator";
/// Attempts the ledger makes before a poison posting is dead-lettered.
pub const LEDGER_ATTEMPTS: u32 = 3;

/// The running demo agents.
#[derive(Debug)]
pub struct Demo {
    agents: Vec<Agent>,
    orchestrator: Agent,
    /// What the watchers said they got, as the orchestrator heard it.
    events: Mutex<mpsc::UnboundedReceiver<Seen>>,
}

impl Demo {
    /// The agents' ids.
    pub fn agent_ids(&self) -> Vec<String> {
        self.agents.iter().map(|a| a.id().to_owned()).collect()
    }

    /// Shuts every demo agent down gracefully.
    pub async fn shutdown(self) {
        for agent in &self.agents {
            agent.shutdown().await;
        }
    }
}
