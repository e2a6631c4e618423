//! The cluster scenarios, on three nodes with the inbox stream replicated three times:
//!
//! - `leader-kill`: the node leading the inbox stream killed with SIGKILL, restarted;
//! - `pause-node`: that node stopped (SIGSTOP) for seconds, then resumed: a hung machine;
//! - `partition`: one node's routes cut by proxies (the inbox leader moved there first, when
//!   the election obliges), then healed: the node and its clients are alone while the other
//!   two elect and go on.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chorus_broker_adapter::{Broker, JetStream};
use chorus_nats_server::{Cluster, ClusterBuilder};
use chorus_sdk::Agent;
use chorus_sdk::durable::{IDEMPOTENCY_BUCKET, INBOX_STREAM, InboxLimits};

use super::{
    CLUSTER_READY, Harness, Scale, Scenario, checker, connect, coordinator, let_traffic_run,
    senders, shutdown, worker_options,
};
use crate::coordinator::RunningCoordinator;
use crate::ledger::Class;
use crate::proxy::Proxy;
use crate::report::ScenarioReport;
use crate::traffic::Traffic;
use crate::{ChaosOptions, WAIT};

/// The worker's ack wait: how soon deliveries held by a node's lost clients come back.
const ACK_WAIT: Duration = Duration::from_secs(2);
/// The node the partition scenario isolates.
const ISOLATED: usize = 2;
/// Leader stepdowns tried to move the inbox stream's leader onto the isolated node.
const STEPDOWN_ATTEMPTS: usize = 4;
/// How often a leader is looked for.
const LEADER_POLL: Duration = Duration::from_millis(100);
/// How long one look may take: a request lost with a killed node is not waited out.
const LEADER_ASK: Duration = Duration::from_secs(1);

/// Points a proxy at its target.
type SetTarget = Box<dyn Fn(&str) + Send + Sync>;

/// A cluster with its coordinator, worker and checker.
struct Bus {
    cluster: Arc<Mutex<Cluster>>,
    urls: Vec<String>,
    coordinator: Box<dyn RunningCoordinator>,
    worker: Agent,
    _checker: Broker,
    js: JetStream,
    inbox: String,
}

impl Bus {
    async fn start(
        h: &mut Harness,
        opts: &ChaosOptions,
        builder: ClusterBuilder,
    ) -> anyhow::Result<Bus> {
        let cluster = tokio::task::spawn_blocking(move || builder.start()).await??;
        let urls = cluster.urls();
        // The worker first: its replicated inbox can be made once JetStream has a meta leader.
        let worker = connect(
            worker_options(&urls)
                .inbox_limits(InboxLimits::default().replicas(3))
                .durable_ack_wait(ACK_WAIT),
            CLUSTER_READY,
        )
        .await?;
        crate::worker::serve(&worker, &h.probe, Duration::ZERO).await?;
        let coordinator = coordinator(opts, &urls).await?;
        let (checker, js) = checker(&urls).await?;
        h.nats_server = checker.server_version();
        let inbox = worker.subjects().stream_name(INBOX_STREAM);
        let deadline = Instant::now() + CLUSTER_READY;
        loop {
            if let Ok((_, current)) = js.stream_replicas(&inbox).await
                && current == 3
            {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the inbox stream never had three current replicas"
            );
            tokio::time::sleep(LEADER_POLL).await;
        }
        Ok(Bus {
            cluster: Arc::new(Mutex::new(cluster)),
            urls,
            coordinator,
            worker,
            _checker: checker,
            js,
            inbox,
        })
    }

    fn cluster(&self) -> std::sync::MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The inbox stream's leader (node index and name), once it has one (up to `limit`),
    /// other than `not` if given.
    async fn leader(&self, not: Option<&str>, limit: Duration) -> anyhow::Result<(usize, String)> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Ok(Some(name))) =
                tokio::time::timeout(LEADER_ASK, self.js.stream_leader(&self.inbox)).await
                && Some(name.as_str()) != not
                && let Some(i) = self.cluster().index_of(&name)
            {
                return Ok((i, name));
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the inbox stream had no leader{} within {limit:?}",
                not.map(|n| format!(" other than {n}")).unwrap_or_default()
            );
            tokio::time::sleep(LEADER_POLL).await;
        }
    }

    /// Where each agent is connected, for the notes.
    fn placement(&self, senders: &[Agent]) -> String {
        let mut out = format!("worker on {}", self.worker.broker().server_name());
        for s in senders {
            out.push_str(&format!(", {} on {}", s.id(), s.broker().server_name()));
        }
        out
    }

    /// The replicas of the inbox stream and of the exactly-once records, for the notes.
    async fn replication(&self) -> String {
        let replicas = |stream: String| async move {
            match self.js.stream_replicas(&stream).await {
                Ok((configured, current)) => format!("{configured} ({current} current)"),
                Err(e) => format!("unknown ({e})"),
            }
        };
        let records = format!(
            "KV_{}",
            self.worker.subjects().bucket_name(IDEMPOTENCY_BUCKET)
        );
        format!(
            "replicas: inbox stream {}, exactly-once records bucket {}",
            replicas(self.inbox.clone()).await,
            replicas(records).await
        )
    }

    async fn stop(self, senders: Vec<Agent>) {
        shutdown(senders.into_iter().chain([self.worker])).await;
        self.coordinator.shutdown().await;
        let cluster = self.cluster;
        // Killing three processes and removing their stores blocks a moment.
        let _ = tokio::task::spawn_blocking(move || drop(cluster)).await;
    }
}

/// Runs a blocking step on node `i` off the runtime.
async fn on_node<T: Send + 'static>(
    cluster: &Arc<Mutex<Cluster>>,
    i: usize,
    step: impl FnOnce(&mut chorus_nats_server::NatsServer) -> T + Send + 'static,
) -> anyhow::Result<T> {
    let cluster = Arc::clone(cluster);
    tokio::task::spawn_blocking(move || {
        let mut guard = cluster.lock().unwrap_or_else(|p| p.into_inner());
        guard.nodes.get_mut(i).map(step)
    })
    .await?
    .with_context(|| format!("no node {i}"))
}

pub(crate) async fn leader_kill(
    scale: &Scale,
    opts: &ChaosOptions,
) -> anyhow::Result<ScenarioReport> {
    let mut h = Harness::new(Scenario::LeaderKill);
    let bus = Bus::start(&mut h, opts, Cluster::builder()).await?;
    let senders = senders(&bus.urls, scale.senders).await?;
    h.note(bus.placement(&senders));
    let traffic = Traffic::start(senders, &scale.plan(), &h.ledger);
    let_traffic_run(scale.phase).await;
    for kill in 1..=scale.faults {
        let (i, leader) = bus.leader(None, WAIT).await?;
        let (acked, handled) = (h.ledger.acked(), h.probe.handled());
        on_node(&bus.cluster, i, |n| n.kill()).await?;
        let killed = Instant::now();
        // The outage itself.
        tokio::time::sleep(scale.down).await;
        on_node(&bus.cluster, i, |n| n.restart()).await??;
        let back = killed.elapsed();
        h.fault_ends.push(Instant::now());
        let next = bus.leader(None, WAIT).await.map(|(_, n)| n);
        h.note(format!(
            "kill {kill}: leader {leader} killed ({acked} acked, {handled} handled before), back after {:.1} s; {} leads",
            back.as_secs_f64(),
            next.unwrap_or_else(|_| "nobody".into()),
        ));
        let_traffic_run(scale.phase).await;
    }
    let senders = traffic.stop().await;
    h.note(bus.replication().await);
    let report = h
        .finish(&bus.js, scale, &[Class::AtLeastOnce, Class::ExactlyOnce])
        .await;
    bus.stop(senders).await;
    report
}

pub(crate) async fn pause_node(
    scale: &Scale,
    opts: &ChaosOptions,
) -> anyhow::Result<ScenarioReport> {
    let mut h = Harness::new(Scenario::PauseNode);
    let bus = Bus::start(&mut h, opts, Cluster::builder()).await?;
    let senders = senders(&bus.urls, scale.senders).await?;
    h.note(bus.placement(&senders));
    let traffic = Traffic::start(senders, &scale.plan(), &h.ledger);
    let_traffic_run(scale.phase).await;
    let (i, leader) = bus.leader(None, WAIT).await?;
    on_node(&bus.cluster, i, |n| n.pause()).await??;
    let paused = Instant::now();
    // The hang itself.
    tokio::time::sleep(scale.pause).await;
    on_node(&bus.cluster, i, |n| n.resume()).await??;
    let lasted = paused.elapsed();
    h.fault_ends.push(Instant::now());
    let after = bus.leader(None, WAIT).await.map(|(_, n)| n);
    h.note(format!(
        "leader {leader} stopped for {:.1} s; {} leads after",
        lasted.as_secs_f64(),
        after.unwrap_or_else(|_| "nobody".into())
    ));
    // Traffic goes on as long as the recovery is judged: a sender whose publishes went to the
    // stopped leader waits out their timeout (JetStream's 10 s from the pause) before it
    // sends again, which the short form's two phases (3 s) could end before.
    let_traffic_run((scale.phase * 2).max(super::CLUSTER_RECOVERY_LIMIT)).await;
    let senders = traffic.stop().await;
    h.note(bus.replication().await);
    let report = h
        .finish(&bus.js, scale, &[Class::AtLeastOnce, Class::ExactlyOnce])
        .await;
    bus.stop(senders).await;
    report
}

pub(crate) async fn partition(
    scale: &Scale,
    opts: &ChaosOptions,
) -> anyhow::Result<ScenarioReport> {
    let mut h = Harness::new(Scenario::Partition);
    // One proxy per peer of the isolated node, on its route to that peer.
    let mut proxies: Vec<(usize, Proxy)> = Vec::new();
    for peer in (0..3).filter(|p| *p != ISOLATED) {
        proxies.push((peer, Proxy::bind().await?));
    }
    let routes: Vec<(usize, String, SetTarget)> = proxies
        .iter()
        .map(|(peer, p)| {
            let set: SetTarget = Box::new(p.target_setter());
            (*peer, p.addr(), set)
        })
        .collect();
    let builder = Cluster::builder().isolatable(ISOLATED, move |peer, real| {
        match routes.iter().find(|(p, _, _)| *p == peer) {
            Some((_, addr, set)) => {
                set(real);
                addr.clone()
            }
            None => real.to_owned(),
        }
    });
    let bus = Bus::start(&mut h, opts, builder).await?;
    let isolated = format!("n{ISOLATED}");
    let mut moved = false;
    for _ in 0..STEPDOWN_ATTEMPTS {
        let (_, leader) = bus.leader(None, WAIT).await?;
        if leader == isolated {
            moved = true;
            break;
        }
        if bus.js.stream_leader_stepdown(&bus.inbox).await.is_err() {
            continue;
        }
        // The old leader stays reported until the election ends.
        let _ = bus.leader(Some(&leader), WAIT).await;
    }
    let senders = senders(&bus.urls, scale.senders).await?;
    h.note(bus.placement(&senders));
    let traffic = Traffic::start(senders, &scale.plan(), &h.ledger);
    let_traffic_run(scale.phase).await;
    let (_, leader) = bus.leader(None, WAIT).await?;
    for (_, proxy) in &proxies {
        proxy.cut();
    }
    let cut = Instant::now();
    // The partition itself.
    tokio::time::sleep(scale.partition).await;
    for (_, proxy) in &proxies {
        proxy.heal();
    }
    h.fault_ends.push(Instant::now());
    let lasted = cut.elapsed();
    let after = bus.leader(None, WAIT).await.map(|(_, n)| n);
    h.note(format!(
        "{isolated} cut off for {:.1} s; inbox leader {leader} at the cut{}, {} after the heal",
        lasted.as_secs_f64(),
        if moved {
            " (moved there)"
        } else {
            " (could not be moved to the cut node)"
        },
        after.unwrap_or_else(|_| "nobody".into())
    ));
    let_traffic_run(scale.phase * 2).await;
    let senders = traffic.stop().await;
    h.note(bus.replication().await);
    let report = h
        .finish(&bus.js, scale, &[Class::AtLeastOnce, Class::ExactlyOnce])
        .await;
    bus.stop(senders).await;
    for (_, proxy) in proxies {
        proxy.close().await;
    }
    report
}
