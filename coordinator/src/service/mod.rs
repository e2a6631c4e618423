//! The coordinator service (`chorus serve`): registry and discovery, broadcast, the
//! dead-letter queue and metrics.
//!
//! It holds no state it cannot rebuild: the registry is a key-value bucket, dead letters and
//! captured advisories are streams, and the in-memory view of who is live is rebuilt from the
//! bucket and the next round of heartbeats. Several coordinators can run side by side:
//! discovery and broadcast requests go to one of them (a queue group), advisories are shared
//! through one durable consumer, and registry writes are conditional.

mod broadcast;
pub mod dlq;
pub mod metrics;
pub mod registry;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use agent_sdk::codec;
use agent_sdk::durable::{self, ADVISORY_STREAM, CONFIG_BUCKET, RETRY_KEY};
use agent_sdk::metrics::MetricsServer;
use agent_sdk::{Envelope, Kind, Performative, StatusCode, Subjects};
use broker_adapter::{
    Broker, BrokerOptions, ConsumerSpec, JetStream, KvSpec, Message, Subscription,
};
use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::CoordinatorConfig;
use metrics::metrics;
use registry::Registry;

/// The `from` of messages the coordinator sends.
pub const COORDINATOR_ID: &str = "coordinator";
/// Name of the durable consumer the coordinators share on the advisory stream.
pub const DLQ_CONSUMER: &str = "chorus-dlq";
/// Suffix of the registry bucket's name.
pub const REGISTRY_BUCKET: &str = "registry";

/// What every task of one coordinator shares.
pub(crate) struct Shared {
    pub(crate) config: CoordinatorConfig,
    pub(crate) subjects: Subjects,
    pub(crate) broker: Broker,
    pub(crate) js: JetStream,
    pub(crate) registry: Registry,
    stop: CancellationToken,
    tracker: TaskTracker,
    work: Arc<Semaphore>,
}

impl CoordinatorConfig {
    /// The default broadcast timeout.
    pub fn broadcast_timeout(&self) -> Duration {
        Duration::from_millis(self.broadcast_timeout_ms)
    }
}

/// Publishes a reply to `request` (or a bare refusal when it did not decode).
pub(crate) async fn reply(
    broker: &Broker,
    reply_to: &str,
    request: Option<&Envelope>,
    status: StatusCode,
    payload: Option<Bytes>,
) {
    let mut env = match request {
        Some(r) => r.reply(COORDINATOR_ID, status),
        None => {
            let mut e = Envelope::new(Kind::Response, Performative::Refuse, COORDINATOR_ID);
            e.status = Some(status);
            e
        }
    };
    if let Some(p) = payload {
        env.payload = p;
    } else if !status.is_success() {
        env.reason = Some(status.description().unwrap_or_default().to_owned());
    }
    match codec::encode(&env, codec::Encoding::MsgPack) {
        Ok(bytes) => {
            if let Err(e) = broker.publish(reply_to, bytes).await {
                tracing::debug!(error = %e, "reply not sent");
            }
        }
        Err(e) => tracing::error!(error = %e, "reply does not encode"),
    }
}

#[derive(Clone, Copy)]
enum Route {
    Heartbeat,
    Goodbye,
    Discover,
    Broadcast,
}

/// A running coordinator.
#[derive(Debug)]
pub struct Coordinator {
    shared: Arc<SharedHandle>,
    metrics_server: Option<MetricsServer>,
}

/// Keeps `Shared` out of the public `Debug`.
struct SharedHandle(Arc<Shared>);

impl std::fmt::Debug for SharedHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Coordinator({})", self.0.subjects.root())
    }
}

impl Coordinator {
    /// Connects, makes sure the streams and buckets exist, publishes the retry policies and
    /// starts every task. `serve_metrics` starts the `/metrics` listener on the configured
    /// address.
    pub async fn start(
        config: CoordinatorConfig,
        serve_metrics: bool,
    ) -> anyhow::Result<Coordinator> {
        config.validate()?;
        let subjects = Subjects::new(&config.root)?;
        let broker = config
            .security
            .apply(
                BrokerOptions::new([config.servers.as_str()])
                    .name("chorus-coordinator")
                    .inbox_prefix("_INBOX.coordinator"),
            )?
            .connect()
            .await
            .map_err(|e| {
                anyhow::anyhow!("coordinator cannot reach NATS at {}: {e}", config.servers)
            })?;
        let js = broker.jetstream(Duration::from_secs(10));
        js.ensure_stream(&durable::inbox_stream(&subjects, &config.inbox))
            .await?;
        js.ensure_stream(&durable::dlq_stream(&subjects, config.replicas))
            .await?;
        js.ensure_stream(&durable::advisory_stream(&subjects, config.replicas))
            .await?;
        let mut registry_spec = KvSpec::new(subjects.bucket_name(REGISTRY_BUCKET));
        registry_spec.replicas = config.replicas;
        registry_spec.description = "Chorus agent registry".into();
        let kv = js.ensure_kv(&registry_spec).await?;
        let mut config_spec = KvSpec::new(subjects.bucket_name(CONFIG_BUCKET));
        config_spec.replicas = config.replicas;
        config_spec.description = "Chorus configuration shared with agents".into();
        let config_kv = js.ensure_kv(&config_spec).await?;
        config_kv
            .put(RETRY_KEY, Bytes::from(serde_json::to_vec(&config.retry)?))
            .await?;

        let registry = Registry::new(
            subjects.clone(),
            broker.clone(),
            kv.clone(),
            config.missed_heartbeats,
        );
        for entry in kv.entries().await? {
            registry.apply_kv(entry);
        }
        let shared = Arc::new(Shared {
            config,
            subjects,
            broker,
            js,
            registry,
            stop: CancellationToken::new(),
            tracker: TaskTracker::new(),
            work: Arc::new(Semaphore::new(512)),
        });

        // Registry changes made by other coordinators.
        let mut watch = kv.watch().await?;
        let s = Arc::clone(&shared);
        shared.tracker.spawn(async move {
            loop {
                tokio::select! {
                    change = watch.next() => match change {
                        Some(Ok(entry)) => s.registry.apply_kv(entry),
                        Some(Err(e)) => tracing::debug!(error = %e, "registry watch"),
                        None => break,
                    },
                    _ = s.stop.cancelled() => break,
                }
            }
        });

        let subs = [
            (
                shared
                    .broker
                    .subscribe(&shared.subjects.heartbeats())
                    .await?,
                Route::Heartbeat,
            ),
            (
                shared.broker.subscribe(&shared.subjects.goodbyes()).await?,
                Route::Goodbye,
            ),
            (
                shared
                    .broker
                    .queue_subscribe(
                        &shared.subjects.discover(),
                        &shared.subjects.coordinator_group(),
                    )
                    .await?,
                Route::Discover,
            ),
            (
                shared
                    .broker
                    .queue_subscribe(
                        &shared.subjects.broadcasts(),
                        &shared.subjects.coordinator_group(),
                    )
                    .await?,
                Route::Broadcast,
            ),
        ];
        for (sub, route) in subs {
            spawn_reader(&shared, sub, route);
        }
        shared.broker.sync(Duration::from_secs(10)).await?;

        // The reaper, and the gauges it and the DLQ poller keep.
        let s = Arc::clone(&shared);
        shared.tracker.spawn(async move {
            let mut tick = tokio::time::interval(s.config.reap_interval());
            let mut polls = 0u64;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = s.stop.cancelled() => break,
                }
                s.registry.reap().await;
                if polls.is_multiple_of(5) {
                    dlq::refresh_depth(&s.js, &s.subjects).await;
                    let st = s.broker.stats();
                    let g = &metrics().connection_events;
                    for (event, n) in [
                        ("disconnects", st.disconnects),
                        ("reconnects", st.reconnects),
                        ("slow_consumer_drops", st.slow_consumer_drops),
                        ("permission_violations", st.permission_violations),
                    ] {
                        g.with_label_values(&[event])
                            .set(i64::try_from(n).unwrap_or(i64::MAX));
                    }
                }
                polls += 1;
            }
        });

        // Dead letters from the captured advisories; the consumer is shared by coordinators.
        let advisories = shared.subjects.stream_name(ADVISORY_STREAM);
        let mut spec = ConsumerSpec::new(DLQ_CONSUMER);
        // Advisories a killed coordinator had taken come back to the others this soon; each
        // takes a few milliseconds to process.
        spec.ack_wait = Duration::from_secs(5);
        spec.max_ack_pending = 64;
        spec.description = "Chorus coordinators: advisories to dead letters".into();
        let consumer = shared.js.ensure_consumer(&advisories, &spec).await?;
        let mut deliveries = consumer.messages(64).await?;
        let s = Arc::clone(&shared);
        shared.tracker.spawn(async move {
            loop {
                let next = tokio::select! {
                    next = deliveries.next() => next,
                    _ = s.stop.cancelled() => break,
                };
                match next {
                    Some(Ok(delivery)) => dlq::on_advisory(&s, &delivery).await,
                    Some(Err(e)) => tracing::debug!(error = %e, "advisory pull interrupted"),
                    None => break,
                }
            }
        });

        let ready = Arc::new(AtomicBool::new(true));
        let metrics_server = if serve_metrics {
            let broker = shared.broker.clone();
            let ready = Arc::clone(&ready);
            let readiness: agent_sdk::metrics::Readiness = Arc::new(move || {
                if !ready.load(Ordering::Relaxed) {
                    Err("shutting down".to_owned())
                } else if !broker.is_connected() {
                    Err("not connected to NATS".to_owned())
                } else {
                    Ok(())
                }
            });
            Some(
                MetricsServer::start(shared.config.metrics_addr, readiness)
                    .await
                    .map_err(|e| {
                        anyhow::anyhow!(
                            "cannot listen for metrics on {}: {e}",
                            shared.config.metrics_addr
                        )
                    })?,
            )
        } else {
            None
        };
        let _ = metrics();
        tracing::info!(root = shared.subjects.root(), "coordinator started");
        Ok(Coordinator {
            shared: Arc::new(SharedHandle(shared)),
            metrics_server,
        })
    }

    /// Where `/metrics` listens, if it does.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_server.as_ref().map(MetricsServer::local_addr)
    }

    /// Agents the registry considers live and matching `query`, least loaded first.
    pub fn discover(&self, query: &agent_sdk::DiscoverQuery) -> Vec<agent_sdk::AgentRecord> {
        self.shared.0.registry.discover(query)
    }

    /// Stops taking work, finishes what is in flight (up to the configured deadline) and
    /// drains the connection. Returns whether everything finished in time.
    pub async fn shutdown(mut self) -> bool {
        let shared = Arc::clone(&self.shared.0);
        shared.stop.cancel();
        shared.tracker.close();
        let finished =
            tokio::time::timeout(shared.config.shutdown_timeout(), shared.tracker.wait())
                .await
                .is_ok();
        if let Err(e) = shared.broker.drain().await {
            tracing::debug!(error = %e, "drain at shutdown");
        }
        if let Some(server) = self.metrics_server.take() {
            server.stop().await;
        }
        tracing::info!(finished, "coordinator stopped");
        finished
    }
}

fn spawn_reader(shared: &Arc<Shared>, mut sub: Subscription, route: Route) {
    let s = Arc::clone(shared);
    shared.tracker.spawn(async move {
        while let Some(msg) = sub.next_until(s.stop.cancelled()).await {
            let Ok(permit) = Arc::clone(&s.work).acquire_owned().await else {
                break;
            };
            let task = Arc::clone(&s);
            s.tracker.spawn(async move {
                handle(&task, &msg, route).await;
                drop(permit);
            });
        }
    });
}

async fn handle(shared: &Shared, msg: &Message, route: Route) {
    match route {
        Route::Heartbeat => shared.registry.on_heartbeat(msg).await,
        Route::Goodbye => shared.registry.on_goodbye(msg).await,
        Route::Discover => shared.registry.on_discover(msg).await,
        Route::Broadcast => broadcast::on_broadcast(shared, msg).await,
    }
}
