//! The soak's steady traffic: durable commands from the senders (at-least-once and
//! exactly-once in turn), numbered events from a publisher, requests to the worker from a
//! requester; each paced in ticks of [`TICK`], a tick missed (a send blocked by an outage)
//! skipped rather than caught up in a burst.

use chorus_sdk::Report;
use std::sync::Arc;
use std::time::Duration;

use chorus_sdk::{Agent, Call};
use tokio_util::sync::CancellationToken;

use super::tally::{Seen, Tally};
use crate::ledger::Class;
use crate::scenarios::WORKER;
use crate::worker::WORK;

/// The pacing step.
const TICK: Duration = Duration::from_millis(100);
/// How long a stopped load may take to finish what it is sending: a durable publish whose ack
/// is lost waits for the SDK's JetStream timeout, up to three times.
const STOP_DEADLINE: Duration = Duration::from_secs(45);
/// The topic of the soak's events.
pub(crate) const TOPIC: &str = "soak.ticks";
/// The command the worker echoes its argument back for.
pub(crate) const ECHO: &str = "echo";
/// How long the requester waits for a reply.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// A request's deadline beyond the requester's own timeout.
const REQUEST_MARGIN: Duration = Duration::from_secs(1);

/// Sends `rate` a second on average, in ticks.
struct Pace {
    tick: tokio::time::Interval,
    per_tick: f64,
    credit: f64,
}

impl Pace {
    fn new(rate: f64) -> Pace {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        Pace {
            tick,
            per_tick: rate.max(0.0) * TICK.as_secs_f64(),
            credit: 0.0,
        }
    }

    /// How many to send this tick, once it comes; `None` once `stop` is cancelled.
    async fn next(&mut self, stop: &CancellationToken) -> Option<usize> {
        tokio::select! {
            _ = self.tick.tick() => {}
            _ = stop.cancelled() => return None,
        }
        self.credit += self.per_tick;
        let n = self.credit.floor();
        self.credit -= n;
        Some(n as usize)
    }
}

/// Requests sent, answered with their own number, failed (timeouts, no responder while the
/// worker or the server is down) and answered wrongly.
#[derive(Debug, Default)]
pub(crate) struct Requests {
    pub(crate) sent: std::sync::atomic::AtomicU64,
    pub(crate) answered: std::sync::atomic::AtomicU64,
    pub(crate) failed: std::sync::atomic::AtomicU64,
    pub(crate) wrong: std::sync::atomic::AtomicU64,
}

/// The rates, per second.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rates {
    /// Durable commands, over all senders.
    pub(crate) durable: f64,
    pub(crate) events: f64,
    pub(crate) requests: f64,
}

/// The traffic at work; [`stop`](Load::stop) ends it and hands the agents back.
#[derive(Debug)]
pub(crate) struct Load {
    stop: CancellationToken,
    /// The senders', then the publisher's, then the requester's.
    tasks: Vec<tokio::task::JoinHandle<Agent>>,
}

/// The agents of a stopped [`Load`] (those whose task ended in time).
#[derive(Debug)]
pub(crate) struct Stopped {
    pub(crate) senders: Vec<Agent>,
    pub(crate) publisher: Option<Agent>,
    pub(crate) requester: Option<Agent>,
}

impl Stopped {
    pub(crate) fn all(self) -> impl Iterator<Item = Agent> {
        self.senders
            .into_iter()
            .chain(self.publisher)
            .chain(self.requester)
    }
}

impl Load {
    /// One task per sender, one for the publisher and one for the requester.
    pub(crate) fn start(
        senders: Vec<Agent>,
        publisher: Agent,
        requester: Agent,
        rates: Rates,
        tally: &Arc<Tally>,
        seen: &Arc<Seen>,
        requests: &Arc<Requests>,
    ) -> Load {
        let stop = CancellationToken::new();
        let per_sender = rates.durable / senders.len().max(1) as f64;
        let mut tasks: Vec<tokio::task::JoinHandle<Agent>> = senders
            .into_iter()
            .enumerate()
            .map(|(i, agent)| {
                let (tally, stop) = (Arc::clone(tally), stop.clone());
                tokio::spawn(async move {
                    durable(&agent, &tally, per_sender, i, &stop).await;
                    agent
                })
            })
            .collect();
        let (seen, stop_events) = (Arc::clone(seen), stop.clone());
        tasks.push(tokio::spawn(async move {
            events(&publisher, &seen, rates.events, &stop_events).await;
            publisher
        }));
        let (requests, stop_requests) = (Arc::clone(requests), stop.clone());
        tasks.push(tokio::spawn(async move {
            ask(&requester, &requests, rates.requests, &stop_requests).await;
            requester
        }));
        Load { stop, tasks }
    }

    /// Stops every loop after what it is sending and waits for them (up to
    /// [`STOP_DEADLINE`]; one still stuck then is aborted, its last sends left unknown).
    pub(crate) async fn stop(mut self) -> Stopped {
        self.stop.cancel();
        let mut agents = Vec::new();
        for mut task in std::mem::take(&mut self.tasks) {
            match tokio::time::timeout(STOP_DEADLINE, &mut task).await {
                Ok(Ok(agent)) => agents.push(Some(agent)),
                Ok(Err(e)) => {
                    tracing::warn!(error = %Report(&e), "a soak traffic task failed");
                    agents.push(None);
                }
                Err(_) => {
                    tracing::warn!("a soak traffic task did not stop within {STOP_DEADLINE:?}");
                    task.abort();
                    agents.push(None);
                }
            }
        }
        let requester = agents.pop().flatten();
        let publisher = agents.pop().flatten();
        Stopped {
            senders: agents.into_iter().flatten().collect(),
            publisher,
            requester,
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.cancel();
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Durable commands, at-least-once and exactly-once in turn (the `i`th sender starting with
/// the class `i` picks, so that the classes stay even).
async fn durable(agent: &Agent, tally: &Tally, rate: f64, i: usize, stop: &CancellationToken) {
    let mut pace = Pace::new(rate);
    let mut turn = i;
    while let Some(n) = pace.next(stop).await {
        if n == 0 {
            continue;
        }
        let mut ids = Vec::with_capacity(n);
        let mut calls = Vec::with_capacity(n);
        for _ in 0..n {
            let class = if turn.is_multiple_of(2) {
                Class::AtLeastOnce
            } else {
                Class::ExactlyOnce
            };
            turn += 1;
            let id = tally.issue(class);
            match Call::agent(WORKER, WORK)
                .delivery(class.delivery())
                .payload(&id)
            {
                Ok(call) => {
                    ids.push(id);
                    calls.push(call);
                }
                // A u64 always encodes; were it not to, the send is unknown, not lost.
                Err(_) => tally.record(id, false),
            }
        }
        let results = agent.send_batch(calls).await;
        for (id, result) in ids.into_iter().zip(results) {
            tally.record(id, result.is_ok());
        }
    }
}

/// Numbered events on [`TOPIC`].
async fn events(agent: &Agent, seen: &Seen, rate: f64, stop: &CancellationToken) {
    let mut pace = Pace::new(rate);
    while let Some(n) = pace.next(stop).await {
        for _ in 0..n {
            // Counted as sent whatever the outcome: the subscriber counts what it missed.
            let _ = agent.publish(TOPIC, &seen.issue()).await;
        }
    }
}

/// Numbered requests to the worker's [`ECHO`], each tick's at once.
async fn ask(agent: &Agent, requests: &Requests, rate: f64, stop: &CancellationToken) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut pace = Pace::new(rate);
    let deadline = REQUEST_TIMEOUT + REQUEST_MARGIN;
    while let Some(n) = pace.next(stop).await {
        let asks = (0..n).map(|_| {
            let number = requests.sent.fetch_add(1, Relaxed);
            async move {
                let answer = tokio::time::timeout(
                    deadline,
                    agent.request::<u64, u64>(WORKER, ECHO, &number),
                )
                .await;
                match answer {
                    Ok(Ok(back)) if back == number => requests.answered.fetch_add(1, Relaxed),
                    Ok(Ok(_)) => requests.wrong.fetch_add(1, Relaxed),
                    _ => requests.failed.fetch_add(1, Relaxed),
                }
            }
        });
        futures::future::join_all(asks).await;
    }
}
