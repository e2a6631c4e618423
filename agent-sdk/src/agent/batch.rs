//! Automatic batching: a publisher that gathers events and one-way commands into batches of
//! up to N messages or T milliseconds and sends each batch at once: events handed to the
//! connection together and flushed once, commands through [`Agent::send_batch`] (core ones
//! flushed once, durable ones with their acks awaited together). Each message is still its
//! own envelope to its receiver; what a batch saves is the round trips, not the envelopes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use chorus_broker_adapter::Report;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout_at};
use tokio_util::sync::CancellationToken;

use super::Agent;
use crate::durable::Receipt;
use crate::durable::send::Sender;
use crate::error::SdkError;
use crate::outbound::{Call, Publish};
use crate::stats::AgentCounters;

/// The most messages one batch may be set to hold.
pub const MAX_BATCH_MESSAGES: usize = 10_000;
/// The longest a batch may be set to wait for more messages.
pub const MAX_BATCH_DELAY: Duration = Duration::from_secs(60);

/// How a [`Batcher`] gathers: a batch is sent when it holds `max_messages`, or `max_delay`
/// after its first message, whichever comes first (and at once on [`Batcher::flush`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    max_messages: usize,
    max_delay: Duration,
}

impl Default for Batching {
    /// 100 messages or 5 ms.
    fn default() -> Self {
        Batching {
            max_messages: 100,
            max_delay: Duration::from_millis(5),
        }
    }
}

impl Batching {
    /// 100 messages or 5 ms.
    pub fn new() -> Self {
        Self::default()
    }

    /// The most messages a batch holds (1 to [`MAX_BATCH_MESSAGES`]).
    pub fn max_messages(mut self, n: usize) -> Self {
        self.max_messages = n;
        self
    }

    /// The longest a batch waits after its first message (above zero, at most
    /// [`MAX_BATCH_DELAY`]).
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    pub(crate) fn check(&self) -> Result<(), SdkError> {
        if !(1..=MAX_BATCH_MESSAGES).contains(&self.max_messages) {
            return Err(SdkError::InvalidCall(format!(
                "batching: max_messages is between 1 and {MAX_BATCH_MESSAGES}, not {}",
                self.max_messages
            )));
        }
        if self.max_delay.is_zero() || self.max_delay > MAX_BATCH_DELAY {
            return Err(SdkError::InvalidCall(format!(
                "batching: max_delay is above zero and at most {} s, not {:?}",
                MAX_BATCH_DELAY.as_secs(),
                self.max_delay
            )));
        }
        Ok(())
    }

    /// Messages queued before a producer waits: two batches' worth, within bounds.
    fn capacity(&self) -> usize {
        (self.max_messages * 2).clamp(64, 2 * MAX_BATCH_MESSAGES)
    }
}

/// A message queued in a [`Batcher`]: resolves once its batch was sent, with what sending it
/// gave (for an event, that the server has it; for a command, its [`Receipt`]). Dropping it
/// does not take the message back.
#[derive(Debug)]
#[must_use = "a queued message is sent either way; await it to learn how sending went"]
pub struct Queued<T> {
    answer: oneshot::Receiver<Result<T, SdkError>>,
}

impl<T> Future for Queued<T> {
    type Output = Result<T, SdkError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.answer)
            .poll(cx)
            .map(|answer| answer.unwrap_or(Err(SdkError::ShuttingDown)))
    }
}

enum Item {
    Event(Publish, oneshot::Sender<Result<(), SdkError>>),
    /// Boxed: a call is several times an event's size.
    Command(Box<Call>, oneshot::Sender<Result<Receipt, SdkError>>),
    /// Send what is gathered now, then answer.
    Flush(oneshot::Sender<()>),
}

/// An opt-in publisher that gathers events and one-way commands into batches
/// ([`Agent::batcher`]). Its messages are sent when a batch is full, when its delay has
/// passed, on [`flush`](Batcher::flush), on [`close`](Batcher::close), when it is dropped and
/// when its agent shuts down; after that, queuing is refused with
/// [`SdkError::ShuttingDown`].
///
/// ```no_run
/// # async fn run(agent: chorus_sdk::Agent) -> Result<(), chorus_sdk::SdkError> {
/// use std::time::Duration;
/// use chorus_sdk::{Batching, Publish};
/// let batcher = agent.batcher(Batching::new().max_messages(500).max_delay(Duration::from_millis(2)))?;
/// let mut queued = Vec::new();
/// for i in 0..10_000u32 {
///     queued.push(batcher.publish(Publish::topic("ticks").payload(&i)?).await?);
/// }
/// for sent in queued {
///     sent.await?;
/// }
/// batcher.close().await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Batcher {
    queue: mpsc::Sender<Item>,
    task: JoinHandle<()>,
}

impl Agent {
    /// A publisher that gathers this agent's events and one-way commands into batches as
    /// `batching` says ([`Batcher`]).
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] when `batching` is out of bounds; [`SdkError::ShuttingDown`]
    /// when the agent is stopping.
    pub fn batcher(&self, batching: Batching) -> Result<Batcher, SdkError> {
        self.start_batcher(batching)
    }

    /// A batcher by the agent's own batching: `[batching]` in its configuration file
    /// ([`AgentOptions::batching`](crate::AgentOptions::batching)), else [`Batching::new`]'s
    /// 100 messages or 5 ms.
    ///
    /// # Errors
    /// [`SdkError::ShuttingDown`] when the agent is stopping.
    pub fn default_batcher(&self) -> Result<Batcher, SdkError> {
        self.start_batcher(self.inner.batching)
    }

    fn start_batcher(&self, batching: Batching) -> Result<Batcher, SdkError> {
        batching.check()?;
        let inner = &self.inner;
        if inner.stop.is_cancelled() {
            return Err(SdkError::ShuttingDown);
        }
        let (queue, items) = mpsc::channel(batching.capacity());
        // On the agent's tracker: shutting down waits until what was queued is sent.
        // It holds the agent's sending half only: a batcher does not keep its agent alive.
        let sender = Sender::new(Arc::clone(&inner.out));
        let task = inner
            .tracker
            .spawn(run(sender, items, batching, inner.stop.clone()));
        Ok(Batcher { queue, task })
    }
}

impl Batcher {
    /// Queues an event; waits only while the queue is full.
    ///
    /// # Errors
    /// [`SdkError::ShuttingDown`] when the batcher or its agent has stopped. How sending
    /// went is the [`Queued`]'s.
    pub async fn publish(&self, event: Publish) -> Result<Queued<()>, SdkError> {
        let (tx, answer) = oneshot::channel();
        self.queue
            .send(Item::Event(event, tx))
            .await
            .map_err(|_| SdkError::ShuttingDown)?;
        Ok(Queued { answer })
    }

    /// Queues a one-way command (in the delivery class it asks for, as
    /// [`Agent::send`] sends it); waits only while the queue is full.
    ///
    /// # Errors
    /// [`SdkError::ShuttingDown`] when the batcher or its agent has stopped. How sending
    /// went is the [`Queued`]'s.
    pub async fn send(&self, call: Call) -> Result<Queued<Receipt>, SdkError> {
        let (tx, answer) = oneshot::channel();
        self.queue
            .send(Item::Command(Box::new(call), tx))
            .await
            .map_err(|_| SdkError::ShuttingDown)?;
        Ok(Queued { answer })
    }

    /// Sends what is gathered now, and returns once it is sent.
    ///
    /// # Errors
    /// [`SdkError::ShuttingDown`] when the batcher or its agent has stopped.
    pub async fn flush(&self) -> Result<(), SdkError> {
        let (tx, done) = oneshot::channel();
        self.queue
            .send(Item::Flush(tx))
            .await
            .map_err(|_| SdkError::ShuttingDown)?;
        done.await.map_err(|_| SdkError::ShuttingDown)
    }

    /// Sends what is queued and stops.
    pub async fn close(self) {
        let Batcher { queue, task } = self;
        drop(queue);
        if let Err(e) = task.await {
            tracing::debug!(error = %e, "batcher ended abnormally");
        }
    }
}

/// Gathers and sends batches until the queue closes (every handle dropped) or the agent
/// stops; either way, what was queued is sent first.
async fn run(
    sender: Sender,
    mut items: mpsc::Receiver<Item>,
    batching: Batching,
    stop: CancellationToken,
) {
    let mut stopping = false;
    loop {
        let first = tokio::select! {
            biased;
            () = stop.cancelled(), if !stopping => {
                // Nothing more is taken; what is queued still goes.
                items.close();
                stopping = true;
                continue;
            }
            item = items.recv() => item,
        };
        let Some(first) = first else { break };
        let mut batch = Vec::with_capacity(batching.max_messages.min(1024));
        let deadline = Instant::now() + batching.max_delay;
        let mut flushed = push(&mut batch, first);
        // Messages in the batch (a flush request is not one).
        let mut count = usize::from(!flushed);
        while !flushed && count < batching.max_messages {
            let next = tokio::select! {
                biased;
                () = stop.cancelled(), if !stopping => {
                    items.close();
                    stopping = true;
                    continue;
                }
                next = timeout_at(deadline, items.recv()) => next,
            };
            match next {
                Ok(Some(item)) => {
                    flushed = push(&mut batch, item);
                    count += usize::from(!flushed);
                }
                Ok(None) | Err(_) => break,
            }
        }
        send(&sender, batch).await;
    }
}

/// Adds `item` to `batch`; true when it asks for the batch to go now.
fn push(batch: &mut Vec<Item>, item: Item) -> bool {
    let flush = matches!(item, Item::Flush(_));
    batch.push(item);
    flush
}

/// Sends one batch: its events handed to the connection and flushed once, then its commands
/// together; each waiter learns how its own message went.
async fn send(sender: &Sender, batch: Vec<Item>) {
    let mut events = Vec::new();
    let mut calls = Vec::new();
    let mut command_waiters = Vec::new();
    let mut flushes = Vec::new();
    for item in batch {
        match item {
            Item::Event(event, tx) => events.push((event, tx)),
            Item::Command(call, tx) => {
                calls.push(*call);
                command_waiters.push(tx);
            }
            Item::Flush(tx) => flushes.push(tx),
        }
    }
    let count = events.len() + calls.len();
    if !events.is_empty() {
        let mut published = Vec::with_capacity(events.len());
        for (event, tx) in events {
            match sender.out.publish_with(event, None).await {
                Ok(()) => published.push(tx),
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        }
        // One flush for the batch's events: once it returns, the server has them.
        let flushed = sender.link.broker.flush().await;
        if let Err(e) = &flushed {
            tracing::debug!(agent = %sender.link.id, error = %Report(e), "batch flush failed");
        }
        for tx in published {
            let result = match &flushed {
                Ok(()) => Ok(()),
                Err(e) => Err(SdkError::Broker(chorus_broker_adapter::Error::new(
                    e.kind(),
                    format!("batch flush failed: {}", Report(e)),
                ))),
            };
            let _ = tx.send(result);
        }
    }
    if !calls.is_empty() {
        let results = sender.send_batch(calls).await;
        for (tx, result) in command_waiters.into_iter().zip(results) {
            let _ = tx.send(result);
        }
    }
    if count > 0 {
        let counters = &sender.link.counters;
        AgentCounters::bump(&counters.batches_sent);
        counters
            .batched_messages
            .fetch_add(count as u64, std::sync::atomic::Ordering::Relaxed);
    }
    for tx in flushes {
        let _ = tx.send(());
    }
}
