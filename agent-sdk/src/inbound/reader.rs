//! Core subscriptions: one reader per subscription takes messages off it as fast as they come
//! and queues them (bounded); a dispatcher starts each through the pipeline as a handler slot
//! frees up. A full queue drops an event (counted) or answers a request with 5019 at once, so
//! a burst never grows memory and never goes unreported.

use std::sync::Arc;

use chorus_broker_adapter::{Message, Subscription};
use opentelemetry::trace::SpanKind;
use tokio::sync::Semaphore;
use tokio::sync::mpsc::error::TrySendError;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::admit::reply_encoding;
use super::outcome::{Failure, Outcome, Retry};
use super::pipeline::{Pipeline, Target, Via};
use super::reply;
use crate::handler::EventHandler;
use crate::handler::endpoint::Endpoint;
use crate::protocol::status::StatusCode;
use crate::sequence::Gaps;
use std::sync::atomic::Ordering;

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
                let endpoint = pipeline
                    .out
                    .link
                    .subjects
                    .command_name(subject)
                    .and_then(|name| pipeline.endpoints.command(name));
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
}

impl Dispatcher {
    /// Handlers running right now.
    pub(crate) fn busy(&self) -> usize {
        self.max_in_flight - self.in_flight.available_permits()
    }

    /// Reads `sub` until the agent stops, handling what arrives by `route`.
    pub(crate) fn spawn(self: &Arc<Self>, mut sub: Subscription, route: Route) {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Message>(self.queue_capacity);
        let this = Arc::clone(self);
        let reader_route = route.clone();
        self.tracker.spawn(async move {
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
                // behind the others, in order.
                if tx.capacity() == tx.max_capacity()
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
                match tx.try_send(msg) {
                    Ok(()) => {}
                    Err(TrySendError::Full(msg)) => this.overflow(msg, &reader_route).await,
                    Err(TrySendError::Closed(_)) => break,
                }
            }
        });
        let this = Arc::clone(self);
        self.tracker.spawn(async move {
            while let Some(msg) = rx.recv().await {
                let Ok(permit) = Arc::clone(&this.in_flight).acquire_owned().await else {
                    break;
                };
                let task = Arc::clone(&this);
                let route = route.clone();
                this.tracker.spawn(async move {
                    task.process(msg, &route).await;
                    drop(permit);
                });
            }
        });
    }

    /// One core message through the pipeline, and its reply if it is a request.
    async fn process(&self, msg: Message, route: &Route) {
        let pipeline = &self.pipeline;
        let (target, span) = route.target(pipeline, msg.subject());
        let decoded = pipeline.decode(msg.subject(), msg.payload());
        let processed = pipeline
            .run(&msg.shared_subject(), decoded, target, Via::core(span))
            .await;
        if let (Route::Event(_), Outcome::Failed(failure)) = (route, &processed.outcome)
            && failure.retry == Retry::Policy
        {
            tracing::warn!(agent = %pipeline.out.link.id, subject = msg.subject(), status = %failure.status, reason = %failure.reason, "event handler failed");
        }
        if let Some(reply_to) = msg.reply() {
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
        match (route, msg.reply()) {
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
