//! The coordinator's tasks, one spawn function each. Every task runs in the coordinator's
//! [`TaskTracker`](tokio_util::task::TaskTracker) and ends when its stop token is cancelled.

use chorus_sdk::Report;
use std::sync::Arc;
use std::time::Duration;

use chorus_broker_adapter::{ConsumerSpec, Kv};
use chorus_sdk::durable::ADVISORY_STREAM;
use futures::StreamExt;

use super::metrics::{CONNECTION_EVENTS, metrics};
use super::{DLQ_CONSUMER, Shared, dlq};
use crate::error::{Error, ErrorKind, Result};

/// Reaper ticks between two refreshes of the dead-letter depth and connection gauges.
pub const GAUGE_REFRESH_TICKS: u64 = 5;
/// How soon advisories a killed coordinator had taken come back to the others; each takes a
/// few milliseconds to process.
pub const ADVISORY_ACK_WAIT: Duration = Duration::from_secs(5);
/// Advisories handed out and not yet acknowledged, across the coordinators.
pub const ADVISORY_MAX_ACK_PENDING: i64 = 64;
/// Advisories fetched per pull.
pub const ADVISORY_PULL_BATCH: usize = 64;

pub(super) fn broker_error(
    what: &'static str,
) -> impl FnOnce(chorus_broker_adapter::Error) -> Error {
    Error::wrap(ErrorKind::Broker, what)
}

/// Follows registry changes made by other coordinators.
pub(super) async fn spawn_registry_watch(shared: &Arc<Shared>, kv: &Kv) -> Result<()> {
    let mut watch = kv
        .watch()
        .await
        .map_err(broker_error("cannot watch the registry"))?;
    let s = Arc::clone(shared);
    shared.tracker.spawn(async move {
        loop {
            tokio::select! {
                change = watch.next() => match change {
                    Some(Ok(entry)) => s.registry.apply_kv(entry),
                    Some(Err(e)) => tracing::debug!(error = %Report(&e), "registry watch"),
                    None => break,
                },
                _ = s.stop.cancelled() => break,
            }
        }
    });
    Ok(())
}

/// The registry's writer: makes the writes heartbeats ask for,
/// [`REGISTRY_WRITES_IN_FLIGHT`](super::registry::REGISTRY_WRITES_IN_FLIGHT) at a time, until
/// the coordinator stops.
pub(super) fn spawn_registry_writer(shared: &Arc<Shared>) {
    let Some(mut queued) = shared.registry.writes() else {
        return;
    };
    let s = Arc::clone(shared);
    shared.tracker.spawn(async move {
        let registry = &s.registry;
        let mut running = futures::stream::FuturesUnordered::new();
        loop {
            let room = running.len() < super::registry::REGISTRY_WRITES_IN_FLIGHT;
            tokio::select! {
                write = queued.recv(), if room => match write {
                    Some(write) => running.push(registry.store(write)),
                    None => break,
                },
                Some(()) = running.next(), if !running.is_empty() => {}
                _ = s.stop.cancelled() => break,
            }
        }
    });
}

/// The reaper: declares silent agents gone, and keeps the dead-letter depth and connection
/// gauges.
pub(super) fn spawn_reaper(shared: &Arc<Shared>) {
    let s = Arc::clone(shared);
    shared.tracker.spawn(async move {
        let mut tick = tokio::time::interval(s.config.reap_interval());
        let mut ticks = 0u64;
        // The last protocol level announced, how many agents were live then, and when.
        let mut announced: Option<(u16, usize, tokio::time::Instant)> = None;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = s.stop.cancelled() => break,
            }
            s.registry.reap().await;
            let (level, live) = s.registry.wire_level();
            if wire_announcement_due(announced, level, live)
                && announce_wire(&s, level, s.config.heartbeat_floor(live)).await
            {
                announced = Some((level, live, tokio::time::Instant::now()));
            }
            if ticks.is_multiple_of(GAUGE_REFRESH_TICKS) {
                dlq::refresh_depth(&s.js, &s.subjects).await;
                refresh_connection_gauges(&s);
            }
            ticks += 1;
        }
    });
}

/// Whether to announce the protocol level now: at once when it changed (a protocol-1 agent
/// joined, or the last one left), soon when more agents are live (a newcomer learns it), and
/// every `WIRE_ANNOUNCE_INTERVAL` in any case. Every live agent gets a copy of each
/// announcement, so the two waits grow with the fleet, by a second per
/// [`WIRE_COPIES_PER_SECOND`] live agents: at 100,000 agents announcing every second for
/// newcomers made 100,000 copies a second, and the server's work for them held up everything
/// else the coordinator sent (docs/SCALE.md).
fn wire_announcement_due(
    last: Option<(u16, usize, tokio::time::Instant)>,
    level: u16,
    live: usize,
) -> bool {
    let Some((last_level, last_live, at)) = last else {
        return true;
    };
    let since = at.elapsed();
    let spread =
        Duration::from_secs(u64::try_from(live / WIRE_COPIES_PER_SECOND).unwrap_or(u64::MAX));
    last_level != level
        || (live > last_live && since >= WIRE_NEWCOMER_DELAY.max(spread))
        || since >= chorus_sdk::registry::WIRE_ANNOUNCE_INTERVAL.max(spread)
}

/// The least time between two announcements made for newcomers.
const WIRE_NEWCOMER_DELAY: Duration = Duration::from_secs(1);

/// About how many copies of its announcements the coordinator has the server make a second,
/// at most, when the level does not change: the waits between them are a second per this
/// many live agents, when that is longer.
const WIRE_COPIES_PER_SECOND: usize = 1_000;

/// Publishes the bus's protocol level and heartbeat floor on `<root>.sys.wire`, in the named
/// form every agent reads, signed when the coordinator has a key. Whether it went out.
async fn announce_wire(shared: &Shared, major: u16, heartbeat_ms: Option<u64>) -> bool {
    use chorus_sdk::codec::{self, Encoding};
    use chorus_sdk::envelope::CONTENT_TYPE_MSGPACK;
    use chorus_sdk::registry::WireLevel;
    use chorus_sdk::{Envelope, Kind, Performative};
    let subject = shared.subjects.wire();
    let mut env = Envelope::new(Kind::Event, Performative::Inform, super::COORDINATOR_ID);
    let Ok(payload) = codec::encode_payload(
        &WireLevel {
            major,
            heartbeat_ms,
        },
        CONTENT_TYPE_MSGPACK,
    ) else {
        return false;
    };
    env.payload = payload;
    let sent = shared
        .wire_numbers
        .publish(&subject, &mut env, |env| {
            let mut env = env.clone();
            if let Some(identity) = &shared.identity {
                identity.sign(&subject, &mut env);
            }
            let bytes = codec::encode(&env, Encoding::MsgPack);
            async {
                let bytes = bytes.map_err(|e| e.to_string())?;
                shared
                    .broker
                    .publish(&subject, bytes)
                    .await
                    .map_err(|e| Report(&e).to_string())
            }
        })
        .await;
    match sent {
        Ok(()) => {
            shared.registry.said(WireLevel {
                major,
                heartbeat_ms,
            });
            true
        }
        Err(err) => {
            tracing::debug!(error = %err, "protocol level not announced");
            false
        }
    }
}

fn refresh_connection_gauges(shared: &Shared) {
    let st = shared.broker.stats();
    let counters = &metrics().connection_events;
    let counts = [
        st.disconnects,
        st.reconnects,
        st.slow_consumer_drops,
        st.permission_violations,
    ];
    for (event, n) in CONNECTION_EVENTS.into_iter().zip(counts) {
        // The broker's counts only grow: the counter catches up with them.
        let c = counters.with_label_values(&[event]);
        c.inc_by(n.saturating_sub(c.get()));
    }
}

/// Turns the captured advisories into dead letters; the consumer is shared by coordinators.
pub(super) async fn spawn_dead_letter_worker(shared: &Arc<Shared>) -> Result<()> {
    let advisories = shared.subjects.stream_name(ADVISORY_STREAM);
    let mut spec = ConsumerSpec::new(DLQ_CONSUMER);
    spec.ack_wait = ADVISORY_ACK_WAIT;
    spec.max_ack_pending = ADVISORY_MAX_ACK_PENDING;
    spec.description = "Chorus coordinators: advisories to dead letters".into();
    let consumer = shared
        .js
        .ensure_consumer(&advisories, &spec)
        .await
        .map_err(broker_error("cannot set up the advisory consumer"))?;
    let mut deliveries = consumer
        .messages(ADVISORY_PULL_BATCH)
        .await
        .map_err(broker_error("cannot pull advisories"))?;
    let s = Arc::clone(shared);
    shared.tracker.spawn(async move {
        loop {
            let next = tokio::select! {
                next = deliveries.next() => next,
                _ = s.stop.cancelled() => break,
            };
            match next {
                Some(Ok(delivery)) => dlq::on_advisory(&s, &delivery).await,
                Some(Err(e)) => tracing::debug!(error = %Report(&e), "advisory pull interrupted"),
                None => break,
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    /// Announced `ago` with `live` agents at level 2.
    fn last(live: usize, ago: Duration) -> Option<(u16, usize, Instant)> {
        Some((2, live, Instant::now() - ago))
    }

    #[tokio::test(start_paused = true)]
    async fn announcements_for_newcomers_and_the_periodic_one_wait_longer_as_the_fleet_grows() {
        let s = Duration::from_secs;
        // The first, and a change of level, at once whatever the fleet.
        assert!(wire_announcement_due(None, 2, 100_000));
        assert!(wire_announcement_due(last(100_000, s(0)), 1, 100_000));
        // A small fleet: newcomers within a second, and every 15 s.
        assert!(!wire_announcement_due(
            last(10, Duration::from_millis(500)),
            2,
            11
        ));
        assert!(wire_announcement_due(last(10, s(1)), 2, 11));
        assert!(!wire_announcement_due(last(10, s(14)), 2, 10));
        assert!(wire_announcement_due(last(10, s(15)), 2, 10));
        // 100,000 agents: a second per 1,000 of them, for newcomers and the periodic one.
        assert!(!wire_announcement_due(last(90_000, s(99)), 2, 100_000));
        assert!(wire_announcement_due(last(90_000, s(100)), 2, 100_000));
        assert!(!wire_announcement_due(last(100_000, s(99)), 2, 100_000));
        assert!(wire_announcement_due(last(100_000, s(100)), 2, 100_000));
    }
}
