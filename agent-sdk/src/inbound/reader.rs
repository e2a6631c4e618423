//! Core subscriptions: one reader per subscription takes messages off it as fast as they come
//! and queues them (bounded); a dispatcher starts each through the pipeline as a handler slot
//! frees up, the most urgent first (`backlog`: by priority, with a bound on how long a lower one
//! waits). A full queue drops an event (counted) or answers a request with 5019 at once, so a
//! burst never grows memory and never goes unreported.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize};

use chorus_broker_adapter::{Message, Subscription};
use opentelemetry::trace::SpanKind;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::admit::{Refused, reply_encoding};
use super::backlog::{Backlog, CLASSES, class};
use super::outcome::{Failure, Outcome, Retry};
use super::pipeline::{Pipeline, Target, Via};
use super::reply;
use crate::handler::EventHandler;
use crate::handler::endpoint::Endpoint;
use crate::protocol::codec::Encoding;
use crate::protocol::envelope::{Envelope, Priority};
use crate::protocol::status::StatusCode;
use crate::sequence::Gaps;
use std::sync::atomic::Ordering;

/// A message waiting for a handler slot, decoded when it was queued (its priority read there,
/// and the decoding not done again).
struct Waiting {
    msg: Message,
    decoded: Result<(Envelope, Encoding), Refused>,
    /// Its priority class (`backlog::class`), counted in [`Dispatcher::waiting`].
    class: usize,
}

/// One subscription's messages waiting for a handler slot: the reader adds, the dispatcher
/// takes.
struct Queue {
    backlog: std::sync::Mutex<Backlog<Box<Waiting>>>,
    /// How many wait, read without the lock (the reader's fast path checks it per message).
    waiting: AtomicUsize,
    /// Wakes the dispatcher when a message is queued or the reader has ended.
    ready: Notify,
    /// The reader has ended: once the queue is empty, so is the dispatcher.
    ended: AtomicBool,
}

impl Queue {
    fn new(capacity: usize) -> Self {
        Queue {
            backlog: std::sync::Mutex::new(Backlog::new(capacity)),
            waiting: AtomicUsize::new(0),
            ready: Notify::new(),
            ended: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Backlog<Box<Waiting>>> {
        // The lock is held for a push or a pop, which cannot panic half-way.
        self.backlog
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues `waiting` (the caller checked there is room: only the reader adds).
    fn push(&self, priority: Priority, waiting: Box<Waiting>) -> Result<(), Box<Waiting>> {
        let mut backlog = self.lock();
        backlog.push(priority, waiting)?;
        self.waiting.store(backlog.len(), Ordering::Release);
        drop(backlog);
        self.ready.notify_one();
        Ok(())
    }

    fn pop(&self) -> Option<Box<Waiting>> {
        let mut backlog = self.lock();
        let next = backlog.pop();
        self.waiting.store(backlog.len(), Ordering::Release);
        next
    }
}

/// What a subscription carries.
#[derive(Clone)]
pub(crate) enum Route {
    /// Everything under `<root>.agent.<id>.*`, dispatched by command name.
    Commands,
    /// One capability's access point.
    Capability(Arc<Endpoint>),
    /// Events matching a pattern.
    Event(Arc<dyn EventHandler>),
}

impl Route {
    fn target(&self, pipeline: &Pipeline, subject: &str) -> (Target, SpanKind) {
        match self {
            Route::Commands => {
                let name = pipeline.out.link.subjects.command_name(subject);
                if name == Some(crate::subject::NOTIFY_TOKEN) {
                    return (Target::Notification, SpanKind::Consumer);
                }
                let endpoint = name.and_then(|name| pipeline.endpoints.command(name));
                let target =
                    endpoint.map_or_else(|| Target::Unknown(subject.to_owned()), Target::Endpoint);
                (target, SpanKind::Server)
            }
            Route::Capability(endpoint) => {
                (Target::Endpoint(Arc::clone(endpoint)), SpanKind::Server)
            }
            Route::Event(handler) => (Target::Event(Arc::clone(handler)), SpanKind::Consumer),
        }
    }
}

/// Runs the core subscriptions of one agent within its handler slots.
pub(crate) struct Dispatcher {
    pub(crate) pipeline: Arc<Pipeline>,
    /// Handler slots (`max_in_flight`).
    pub(crate) in_flight: Arc<Semaphore>,
    pub(crate) max_in_flight: usize,
    /// Messages waiting for a slot, per subscription.
    pub(crate) queue_capacity: usize,
    pub(crate) tracker: TaskTracker,
    pub(crate) stop: CancellationToken,
    /// Messages waiting for a slot in every queue, per priority class, most urgent first
    /// (counted on the slow path only: a message that finds a slot free is never queued).
    pub(crate) waiting: [AtomicUsize; CLASSES],
}

impl Dispatcher {
    /// Handlers running right now.
    pub(crate) fn busy(&self) -> usize {
        self.max_in_flight - self.in_flight.available_permits()
    }

    /// Messages waiting for a slot, per priority.
    pub(crate) fn waiting(&self) -> crate::registry::Waiting {
        let n = |class: usize| {
            u32::try_from(self.waiting[class].load(Ordering::Relaxed)).unwrap_or(u32::MAX)
        };
        crate::registry::Waiting {
            critical: n(0),
            high: n(1),
            normal: n(2),
            low: n(3),
        }
    }

    /// Reads `sub` until the agent stops, handling what arrives by `route`.
    pub(crate) fn spawn(self: &Arc<Self>, mut sub: Subscription, route: Route) {
        let queue = Arc::new(Queue::new(self.queue_capacity));
        let this = Arc::clone(self);
        let reader_route = route.clone();
        let reader_queue = Arc::clone(&queue);
        self.tracker.spawn(async move {
            let queue = reader_queue;
            // Events are checked for gaps as they arrive, in order, before anything is queued.
            let mut gaps = matches!(reader_route, Route::Event(_)).then(Gaps::default);
            // One message's run on the reader: every call makes the same future type, so the
            // box of one that finished here holds the next (no allocation per message).
            let start = |msg: Message, permit: tokio::sync::OwnedSemaphorePermit| {
                let task = Arc::clone(&this);
                let route = reader_route.clone();
                async move {
                    task.process(msg, &route).await;
                    drop(permit);
                }
            };
            let mut spare = None;
            while let Some(msg) = sub.next_until(this.stop.cancelled()).await {
                if let Some(gaps) = &mut gaps {
                    let missed = gaps.observe(msg.subject(), msg.payload());
                    if missed > 0 {
                        this.pipeline
                            .counters()
                            .lost
                            .fetch_add(missed, Ordering::Relaxed);
                    }
                }
                // The common case, nothing queued and a slot free: start the handler here,
                // saving the hop through the queue and the dispatcher. Otherwise queue it
                // by its priority.
                let waiting = queue.waiting.load(Ordering::Acquire);
                if waiting == 0
                    && let Ok(permit) = Arc::clone(&this.in_flight).try_acquire_owned()
                {
                    let run = start(msg, permit);
                    // A handler that finishes without waiting (most do: a computation and a
                    // reply handed to the connection) is done here, with no task to spawn
                    // and wake. One that waits goes on as a task of its own, in its box.
                    // Signature checks are CPU work better spread over the cores, so a
                    // verifying agent always spawns.
                    if this.pipeline.verifies() {
                        this.tracker.spawn(run);
                    } else {
                        let mut run = match spare.take() {
                            Some(mut boxed) => {
                                std::pin::Pin::set(&mut boxed, run);
                                boxed
                            }
                            None => Box::pin(run),
                        };
                        if futures::poll!(run.as_mut()).is_pending() {
                            this.tracker.spawn(run);
                        } else {
                            spare = Some(run);
                        }
                    }
                    continue;
                }
                // Only this reader adds, so a queue with room now still has it below; a full
                // one refuses the message before it is decoded.
                if waiting >= this.queue_capacity {
                    this.overflow(msg, &reader_route).await;
                    continue;
                }
                // Decoded here, once, for its priority; bytes that do not decode wait as
                // normal, to be refused in their turn.
                let decoded = this.pipeline.decode(msg.subject(), msg.payload());
                let priority = decoded
                    .as_ref()
                    .map_or(Priority::Normal, |(env, _)| env.priority);
                let class = class(priority);
                // Counted before it can be taken, so the count never goes below zero.
                this.waiting[class].fetch_add(1, Ordering::Relaxed);
                let waiting = Box::new(Waiting {
                    msg,
                    decoded,
                    class,
                });
                if let Err(refused) = queue.push(priority, waiting) {
                    this.waiting[class].fetch_sub(1, Ordering::Relaxed);
                    this.overflow(refused.msg, &reader_route).await;
                }
            }
            queue.ended.store(true, Ordering::Release);
            queue.ready.notify_one();
        });
        let this = Arc::clone(self);
        self.tracker.spawn(async move {
            loop {
                // Read before the count: once the reader has ended, the count is final.
                let ended = queue.ended.load(Ordering::Acquire);
                if queue.waiting.load(Ordering::Acquire) == 0 {
                    if ended {
                        break;
                    }
                    queue.ready.notified().await;
                    continue;
                }
                // The slot first, then the message: the most urgent one waiting when the slot
                // frees up, not when the last one was taken.
                let Ok(permit) = Arc::clone(&this.in_flight).acquire_owned().await else {
                    break;
                };
                let Some(waiting) = queue.pop() else {
                    continue;
                };
                this.waiting[waiting.class].fetch_sub(1, Ordering::Relaxed);
                let task = Arc::clone(&this);
                let route = route.clone();
                this.tracker.spawn(async move {
                    let Waiting { msg, decoded, .. } = *waiting;
                    task.process_decoded(msg, decoded, &route).await;
                    drop(permit);
                });
            }
        });
    }

    /// One core message through the pipeline, and its reply if it is a request.
    async fn process(&self, msg: Message, route: &Route) {
        let decoded = self.pipeline.decode(msg.subject(), msg.payload());
        self.process_decoded(msg, decoded, route).await;
    }

    /// [`process`](Self::process) of a message already decoded.
    async fn process_decoded(
        &self,
        msg: Message,
        decoded: Result<(Envelope, Encoding), Refused>,
        route: &Route,
    ) {
        let pipeline = &self.pipeline;
        let (target, span) = route.target(pipeline, msg.subject());
        let notification = matches!(target, Target::Notification);
        let processed = pipeline
            .run(&msg.shared_subject(), decoded, target, Via::core(span))
            .await;
        if let (Route::Event(_), Outcome::Failed(failure)) = (route, &processed.outcome)
            && failure.retry == Retry::Policy
        {
            tracing::warn!(agent = %pipeline.out.link.id, subject = msg.subject(), status = %failure.status, reason = %failure.reason, "event handler failed");
        }
        if let (true, Outcome::Failed(failure)) = (notification, &processed.outcome)
            && failure.retry == Retry::Policy
        {
            tracing::warn!(agent = %pipeline.out.link.id, subject = msg.subject(), status = %failure.status, reason = %failure.reason, "notification handler failed");
        }
        // A notification is never answered, whatever it carries.
        if let Some(reply_to) = msg.reply().filter(|_| !notification) {
            reply::send(
                &pipeline.out,
                reply_to,
                processed.request.as_deref(),
                processed.encoding,
                processed.outcome.into_result(),
            )
            .await;
        }
    }

    /// A message that found its queue full.
    async fn overflow(&self, msg: Message, route: &Route) {
        let counters = self.pipeline.counters();
        // A notification is dropped like an event, never answered.
        let reply = msg.reply().filter(|_| {
            !self
                .pipeline
                .out
                .link
                .subjects
                .is_notification(msg.subject())
        });
        match (route, reply) {
            (Route::Event(_), _) | (_, None) => {
                // Missed, as surely as an event that never arrived (a gap counts those).
                counters.lost.fetch_add(1, Ordering::Relaxed);
                let n = counters
                    .dropped
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    + 1;
                if n.is_power_of_two() {
                    tracing::warn!(agent = %self.pipeline.out.link.id, subject = msg.subject(), dropped_total = n, "slow subscriber: messages dropped on a full queue");
                }
            }
            (_, Some(reply_to)) => {
                let n = counters
                    .shed
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    + 1;
                if n.is_power_of_two() {
                    tracing::warn!(agent = %self.pipeline.out.link.id, shed_total = n, "overloaded: requests refused with 5019");
                }
                let failure = Failure::refused(
                    StatusCode::UNAVAILABLE,
                    "overloaded: the agent's queue is full",
                );
                let encoding = reply_encoding(msg.payload(), self.pipeline.out.wire.encoding());
                reply::send(
                    &self.pipeline.out,
                    reply_to,
                    None,
                    encoding,
                    Err(failure.to_handler_error()),
                )
                .await;
            }
        }
    }
}
