//! A lane's consumer: opened when commands wait (rung by the stream's bells or found by a
//! look) or held always, its deliveries taken in pulls, and released after a quiet spell.

use crate::Report;
use std::sync::Arc;
use std::time::Duration;

use chorus_broker_adapter::{Deliveries, Subscription};
use tokio::sync::mpsc::error::TrySendError;

use crate::durable::INBOX_STREAM;
use crate::stats::AgentCounters;

use super::*;

impl DurableInbox {
    /// One look at the stream for commands stored for this agent: which lanes (normal, high)
    /// have some. One request for both lanes.
    pub(super) async fn look(&self) -> Result<[bool; 2], chorus_broker_adapter::Error> {
        let link = &self.link;
        let stream = link.subjects.stream_name(INBOX_STREAM);
        let filter = link.subjects.durable_agent_all(&link.id).map_err(|e| {
            chorus_broker_adapter::Error::new(
                chorus_broker_adapter::ErrorKind::InvalidInput,
                e.to_string(),
            )
        })?;
        let mut waiting = [false, false];
        for (subject, count) in link.js.subject_counts(&stream, &filter).await? {
            if count > 0 {
                let high = subject.split('.').rev().nth(1) == Some("high");
                waiting[usize::from(high)] = true;
            }
        }
        Ok(waiting)
    }

    /// The agent's own looks for stored commands, in case bells were lost: every `recheck`
    /// (jittered), after the connection came back or dropped messages, when a lane asks
    /// (`look_soon`), and while looks fail (JetStream out of reach: a leaf node cut
    /// off from its hub, a cluster without a leader). A lane found with commands is rung as a
    /// bell would. The only place an on-demand inbox looks again after a failure.
    pub(super) fn spawn_looker(self: &Arc<Self>, rings: Rings, recheck: Duration) {
        let inbox = Arc::clone(self);
        let mut events = Some(self.link.broker.events());
        self.tracker.spawn(async move {
            let mut look_in = recheck;
            // Looks that failed in a row: the next waits twice as long as the last, from
            // `FIRST_LOOK_RETRY` up to `LOOK_RETRY`.
            let mut failed = 0u32;
            loop {
                let next_look = tokio::time::Instant::now()
                    + look_in.mul_f64(0.75 + 0.5 * crate::retry::random_fraction());
                loop {
                    tokio::select! {
                        () = inbox.stop.cancelled() => return,
                        () = tokio::time::sleep_until(next_look) => break,
                        () = inbox.look_soon.notified() => break,
                        look = bells_may_be_lost(&mut events) => if look {
                            break;
                        },
                    }
                }
                look_in = match inbox.look().await {
                    Ok(waiting) => {
                        for (ring, waiting) in rings.iter().zip(waiting) {
                            if waiting && let Err(TrySendError::Closed(())) = ring.try_send(()) {
                                return;
                            }
                        }
                        failed = 0;
                        recheck
                    }
                    Err(err) => {
                        tracing::debug!(agent = %inbox.link.id, error = %Report(&err), "durable inbox: stored commands not looked for; looking again soon");
                        failed = failed.saturating_add(1);
                        look_retry(failed).min(recheck)
                    }
                };
            }
        });
    }

    /// Takes one lane's deliveries until the agent stops: from its always-held consumer, or
    /// (on demand) from a consumer opened when commands wait and released when none do.
    /// `opened` is a consumer opened already; `waiting` says commands were found stored.
    pub(super) async fn take_deliveries(
        self: Arc<Self>,
        mut lane: LaneConsumer,
        mut opened: Option<Deliveries>,
        waiting: bool,
    ) {
        let link = &self.link;
        let stream = link.subjects.stream_name(INBOX_STREAM);
        let counters = self.pipeline.counters();
        let on_demand = self.consumers != InboxConsumers::Always;
        // On demand: whether the lane looks at its own commands before waiting for its bell.
        let mut look_now = waiting;
        // Opens that failed in a row: each waits twice as long as the one before, and the
        // last of them ends the try (on demand, until the next bell or look; always held,
        // for good), with an error that says why.
        let mut failed_opens = 0u32;
        loop {
            let mut deliveries = match opened.take() {
                Some(deliveries) => deliveries,
                None => {
                    if on_demand && !self.wait_for_commands(&mut lane, look_now).await {
                        return;
                    }
                    look_now = false;
                    match self.open(&lane.spec).await {
                        Ok(deliveries) => {
                            failed_opens = 0;
                            if on_demand {
                                AgentCounters::bump(&counters.inbox_consumers_opened);
                                // The consumer delivers what is stored: no bell for each.
                                lane.bells = None;
                            }
                            deliveries
                        }
                        Err(err) => {
                            failed_opens += 1;
                            if failed_opens >= MAX_OPEN_ATTEMPTS {
                                tracing::error!(agent = %link.id, consumer = %lane.spec.durable, error = %Report(&err), attempts = failed_opens, "durable inbox: consumer cannot be opened; {}", if on_demand { "trying again at the next bell or look" } else { "this lane takes no more deliveries" });
                                if !on_demand {
                                    return;
                                }
                                failed_opens = 0;
                                continue;
                            }
                            tracing::warn!(agent = %link.id, consumer = %lane.spec.durable, error = %Report(&err), "durable inbox: consumer not opened; trying again");
                            if !self.pause(REOPEN_DELAY * 2u32.pow(failed_opens - 1)).await {
                                return;
                            }
                            look_now = true;
                            continue;
                        }
                    }
                }
            };
            let release_after = match self.consumers {
                InboxConsumers::Always => None,
                InboxConsumers::OnDemand { release_after, .. } => Some(release_after),
            };
            match self
                .dispatch(&mut deliveries, &lane.senders, release_after)
                .await
            {
                Ended::Stopped => return,
                Ended::Closed => {
                    // Always held: opened again. On demand (another instance released it): a
                    // look decides.
                    tracing::debug!(agent = %link.id, consumer = %lane.spec.durable, "durable inbox: the server ended the pull");
                    look_now = true;
                }
                Ended::Quiet => {
                    drop(deliveries);
                    // Bells heard again before the state below is read: one from now on is
                    // for a command the state may not count yet, and opens the consumer again.
                    self.hear_bells(&mut lane).await;
                    if let Some(bell) = &mut lane.bell {
                        while bell.try_recv().is_ok() {}
                    }
                    look_now = match self.release(&stream, &lane).await {
                        Ok(true) => {
                            AgentCounters::bump(&counters.inbox_consumers_released);
                            false
                        }
                        // Something pending or held, or given up on: the consumer stays.
                        Ok(false) => true,
                        // Gone already (another instance released it): look.
                        Err(err) if err.kind() == chorus_broker_adapter::ErrorKind::NotFound => {
                            true
                        }
                        // Out of reach: the looker looks again until it answers.
                        Err(_) => {
                            self.look_soon.notify_one();
                            false
                        }
                    };
                }
            }
        }
    }

    /// Deletes the lane's consumer if it is idle: nothing pending, nothing awaiting an ack,
    /// and no command stored for the lane. Commands still stored that the consumer neither
    /// offers nor waits on are ones it gave up on (`max_deliver`), waiting for the coordinator
    /// to dead-letter them: the consumer stays, so a new one does not deliver them all over
    /// again. Whether it was deleted.
    pub(super) async fn release(
        &self,
        stream: &str,
        lane: &LaneConsumer,
    ) -> Result<bool, chorus_broker_adapter::Error> {
        let js = &self.link.js;
        let state = js.consumer_state(stream, &lane.spec.durable).await?;
        if state.pending > 0
            || state.ack_pending > 0
            || js.has_messages(stream, &lane.filter).await?
        {
            return Ok(false);
        }
        js.delete_consumer(stream, &lane.spec.durable).await?;
        Ok(true)
    }

    /// Waits until commands wait for this lane: its bell rings (the looker rings it too), or,
    /// with `look_now`, a look at the lane finds some. A look that fails asks the looker to
    /// look until one answers. `false` once the agent stops.
    pub(super) async fn wait_for_commands(
        &self,
        lane: &mut LaneConsumer,
        mut look_now: bool,
    ) -> bool {
        if lane.bells.is_none() {
            // The consumer went away while bells were not heard: hear them, then look.
            self.hear_bells(lane).await;
            look_now = true;
        }
        if look_now {
            let link = &self.link;
            let stream = link.subjects.stream_name(INBOX_STREAM);
            match link.js.has_messages(&stream, &lane.filter).await {
                Ok(true) => return true,
                Ok(false) => {}
                Err(err) => {
                    tracing::debug!(agent = %link.id, error = %Report(&err), "durable inbox: stored commands not looked for; the looker looks again");
                    self.look_soon.notify_one();
                }
            }
        }
        loop {
            tokio::select! {
                () = self.stop.cancelled() => return false,
                rung = next_bell(&mut lane.bell) => if rung {
                    return true;
                },
                heard = next_heard(&mut lane.bells) => if heard {
                    return true;
                },
            }
        }
    }

    /// Subscribes to the lane's bells, if it is not already. If that fails (the agent's
    /// connection is closing), the looker's looks still find what is stored.
    pub(super) async fn hear_bells(&self, lane: &mut LaneConsumer) {
        let (None, Some(subject)) = (&lane.bells, &lane.bell_subject) else {
            return;
        };
        match self.link.broker.subscribe(subject).await {
            Ok(sub) => lane.bells = Some(sub),
            Err(err) => {
                tracing::warn!(agent = %self.link.id, error = %Report(&err), "durable inbox: bells not heard; stored commands are found by looks");
            }
        }
    }
}

/// The wait before the next look after `failed` looks failed in a row: from
/// `FIRST_LOOK_RETRY` (JetStream just back, a leader being elected), twice as long each time,
/// up to `LOOK_RETRY`.
fn look_retry(failed: u32) -> Duration {
    FIRST_LOOK_RETRY
        .saturating_mul(1u32 << failed.saturating_sub(1).min(16))
        .min(LOOK_RETRY)
}

/// Sleeps until `at`; forever without one.
pub(super) async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Whether the next bell rang: `false` (and no more bells) if the bell listener ended; forever
/// without a bell.
async fn next_bell(bell: &mut Option<tokio::sync::mpsc::Receiver<()>>) -> bool {
    let Some(rx) = bell else {
        return std::future::pending().await;
    };
    if rx.recv().await.is_some() {
        return true;
    }
    *bell = None;
    false
}

/// Whether a bell was heard on `bells`; pending forever without a subscription, and `false`
/// (the subscription dropped) once it ends.
async fn next_heard(bells: &mut Option<Subscription>) -> bool {
    use futures::StreamExt;
    let Some(sub) = bells else {
        return std::future::pending().await;
    };
    if sub.next().await.is_some() {
        return true;
    }
    *bells = None;
    false
}

/// Whether the next connection event may have cost bells (a reconnect, dropped messages, or
/// events missed); forever once the events end.
async fn bells_may_be_lost(
    events: &mut Option<tokio::sync::broadcast::Receiver<chorus_broker_adapter::ConnectionEvent>>,
) -> bool {
    use chorus_broker_adapter::ConnectionEvent;
    use tokio::sync::broadcast::error::RecvError;
    let Some(rx) = events else {
        return std::future::pending().await;
    };
    match rx.recv().await {
        Ok(ConnectionEvent::Reconnected | ConnectionEvent::SlowConsumer { .. }) => true,
        Ok(_) => false,
        Err(RecvError::Lagged(_)) => true,
        Err(RecvError::Closed) => {
            *events = None;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_look_is_tried_again_sooner_first_then_every_five_seconds() {
        let waits: Vec<u128> = (1..=7).map(|n| look_retry(n).as_millis()).collect();
        assert_eq!(waits, [250, 500, 1000, 2000, 4000, 5000, 5000]);
        assert_eq!(look_retry(u32::MAX), LOOK_RETRY);
    }
}
