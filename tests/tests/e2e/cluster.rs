//! Chorus on a 3-node NATS cluster: messages cross nodes, durable streams are replicated 3
//! times, and killing (SIGKILL) the node an agent is on while at-least-once traffic flows
//! loses nothing that was acknowledged.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_sdk::durable::InboxLimits;
use chorus_sdk::{AgentOptions, Context, HandlerError};
use chorus_tests::{Cluster, WAIT, eventually, within};

fn distinct(seen: &Mutex<Vec<u32>>) -> usize {
    seen.lock()
        .expect("lock")
        .iter()
        .collect::<std::collections::HashSet<_>>()
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_under_at_least_once_traffic_loses_no_acknowledged_message() {
    let mut cluster = Cluster::start();
    let urls = cluster.urls();
    let replicated = InboxLimits::default().replicas(3);
    // The worker knows every node, as a deployed agent does; the node it is on is the one
    // killed below, and the sender is on another, so every message crosses nodes.
    // JetStream needs its meta leader before a replicated stream can be made.
    let worker = eventually(Duration::from_secs(60), "replicated inbox ready", || {
        let servers = urls.clone();
        let limits = replicated.clone();
        async move {
            AgentOptions::new("worker")
                .servers(servers)
                .durable_inbox(true)
                .inbox_limits(limits)
                .durable_ack_wait(Duration::from_secs(2))
                .connect()
                .await
                .ok()
        }
    })
    .await;
    let seen = Arc::new(Mutex::new(Vec::<u32>::new()));
    {
        let seen = Arc::clone(&seen);
        worker
            .on_command("work", move |_ctx: Context, n: u32| {
                seen.lock().expect("lock").push(n);
                async { Ok::<_, HandlerError>(()) }
            })
            .await
            .expect("register");
        worker
            .on_command("where", |ctx: Context, (): ()| async move {
                Ok::<_, HandlerError>(ctx.agent_id().to_owned())
            })
            .await
            .expect("register");
    }
    let worker_node = worker.broker().server_name();
    let doomed: usize = worker_node
        .strip_prefix('n')
        .and_then(|i| i.parse().ok())
        .unwrap_or_else(|| panic!("the worker is on an unknown node {worker_node:?}"));
    let sender = AgentOptions::new("sender")
        .servers([urls[(doomed + 1) % urls.len()].clone()])
        .connect()
        .await
        .expect("sender");
    // Core request-reply across nodes.
    let answer: String = within(
        WAIT,
        "cross-node request",
        sender.request("worker", "where", &()),
    )
    .await
    .expect("reply across nodes");
    assert_eq!(answer, "worker");
    // The inbox stream is replicated on all three nodes.
    let js = sender.broker().jetstream(WAIT);
    let inbox = sender
        .subjects()
        .stream_name(chorus_sdk::durable::INBOX_STREAM);
    let (configured, current) = eventually(WAIT, "three current replicas", || async {
        let r = js.stream_replicas(&inbox).await.ok()?;
        (r.1 == 3).then_some(r)
    })
    .await;
    assert_eq!(
        (configured, current),
        (3, 3),
        "the inbox is replicated on all three nodes"
    );

    const SENT: u32 = 4_000;
    let (publisher, acked) = chorus_tests::publish_tracking_acks(sender, "worker", SENT, 200);
    eventually(Duration::from_secs(60), "a third acked", || async {
        (acked.count() >= 1_300).then_some(())
    })
    .await;
    // Kill the node the worker is connected to.
    cluster.nodes[doomed].kill();
    let acked_at_kill = acked.count();
    let handled_at_kill = distinct(&seen);
    // Work goes on while the node is down: the worker moves to another node and keeps
    // handling. A stall says what it saw.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let handled_while_down = loop {
        let n = distinct(&seen);
        if n >= handled_at_kill + 500 {
            break n;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no progress while node {doomed} is down: handled {n} ({handled_at_kill} at the kill), \
             acked {} ({acked_at_kill} at the kill), worker connected {} to {}, reconnects {}",
            acked.count(),
            worker.broker().is_connected(),
            worker.broker().server_name(),
            worker.broker().stats().reconnects,
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let sender = within(Duration::from_secs(180), "publisher", publisher)
        .await
        .expect("publisher task");
    let acked_while_down = acked.count();
    cluster.nodes[doomed]
        .restart()
        .expect("node restarts with its store");
    let report = chorus_tests::settle_and_count(
        &acked,
        &seen,
        &js,
        &inbox,
        "worker",
        Duration::from_secs(120),
    )
    .await;
    println!(
        "cluster: sent {SENT}, acked {} ({acked_at_kill} before node {doomed} was killed, {acked_while_down} before it came back), handled {} unique ({handled_at_kill} at the kill, {handled_while_down} while it was down), lost {}, duplicated {}, settled {}; worker reconnects {}",
        report.acked,
        report.handled,
        report.lost,
        report.duplicated,
        report.settled,
        worker.broker().stats().reconnects
    );
    assert_eq!(report.lost, 0, "acknowledged and never handled: {report:?}");
    assert!(
        report.settled,
        "the worker's consumer never drained: {report:?}"
    );
    assert!(
        acked_while_down > acked_at_kill,
        "no acks while node {doomed} was down"
    );
    assert!(
        worker.broker().stats().reconnects >= 1,
        "the worker moved to another node"
    );
    sender.shutdown().await;
    worker.shutdown().await;
}
