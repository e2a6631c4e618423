//! The senders: agents sending numbered commands in batches, at a steady pace, each result
//! recorded in the [`Ledger`] as it comes, until told to stop.

use chorus_sdk::Report;
use std::sync::Arc;
use std::time::Duration;

use chorus_sdk::{Agent, Call};
use tokio_util::sync::CancellationToken;

use crate::ledger::{Class, Ledger};

/// How long a stopped sender may take to finish the batch it is sending: a durable publish
/// whose ack is lost waits for the SDK's JetStream timeout, up to three times.
const STOP_DEADLINE: Duration = Duration::from_secs(45);

/// Where a class of traffic goes.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    pub(crate) class: Class,
    pub(crate) agent: String,
    pub(crate) command: String,
}

impl Route {
    pub(crate) fn new(class: Class, agent: &str, command: &str) -> Route {
        Route {
            class,
            agent: agent.to_owned(),
            command: command.to_owned(),
        }
    }
}

/// What each sender sends.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// Taken in turn, message by message.
    pub(crate) routes: Vec<Route>,
    /// Messages per batch.
    pub(crate) batch: usize,
    /// The pause after each batch: the offered rate is `batch / pace` per sender.
    pub(crate) pace: Duration,
}

/// Senders at work; [`stop`](Traffic::stop) ends them and hands them back.
#[derive(Debug)]
pub(crate) struct Traffic {
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<Agent>>,
}

impl Traffic {
    /// Starts one task per sender.
    pub(crate) fn start(senders: Vec<Agent>, plan: &Plan, ledger: &Arc<Ledger>) -> Traffic {
        let stop = CancellationToken::new();
        let tasks = senders
            .into_iter()
            .map(|agent| {
                let plan = plan.clone();
                let ledger = Arc::clone(ledger);
                let stop = stop.clone();
                tokio::spawn(async move {
                    send_until(&agent, &plan, &ledger, &stop).await;
                    agent
                })
            })
            .collect();
        Traffic { stop, tasks }
    }

    /// Stops every sender after its current batch and waits for them (up to
    /// [`STOP_DEADLINE`]; a sender still stuck then is aborted, its last sends left unknown).
    pub(crate) async fn stop(mut self) -> Vec<Agent> {
        self.stop.cancel();
        let mut agents = Vec::new();
        for mut task in std::mem::take(&mut self.tasks) {
            match tokio::time::timeout(STOP_DEADLINE, &mut task).await {
                Ok(Ok(agent)) => agents.push(agent),
                Ok(Err(e)) => tracing::warn!(error = %Report(&e), "a sender task failed"),
                Err(_) => {
                    tracing::warn!("a sender did not stop within {STOP_DEADLINE:?}; aborted");
                    task.abort();
                }
            }
        }
        agents
    }
}

impl Drop for Traffic {
    /// Traffic left without [`stop`](Traffic::stop) (a scenario that failed midway) ends
    /// at once.
    fn drop(&mut self) {
        self.stop.cancel();
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn send_until(agent: &Agent, plan: &Plan, ledger: &Ledger, stop: &CancellationToken) {
    if plan.routes.is_empty() {
        return;
    }
    let mut turn = 0usize;
    while !stop.is_cancelled() {
        let mut ids = Vec::with_capacity(plan.batch);
        let mut calls = Vec::with_capacity(plan.batch);
        for _ in 0..plan.batch {
            let route = &plan.routes[turn % plan.routes.len()];
            turn += 1;
            let id = ledger.issue(route.class);
            match Call::agent(route.agent.as_str(), route.command.as_str())
                .delivery(route.class.delivery())
                .payload(&id)
            {
                Ok(call) => {
                    ids.push(id);
                    calls.push(call);
                }
                // A u64 always encodes; were it not to, the send is unknown, not lost.
                Err(_) => ledger.record(id, false),
            }
        }
        let results = agent.send_batch(calls).await;
        for (id, result) in ids.into_iter().zip(results) {
            ledger.record(id, result.is_ok());
        }
        tokio::select! {
            _ = tokio::time::sleep(plan.pace) => {}
            _ = stop.cancelled() => break,
        }
    }
}
