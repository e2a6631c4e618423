//! On-demand durable inboxes against a real server: an idle agent holds no consumer, a stored
//! command's bell opens the consumer of its lane, a quiet one is released, a lost bell is made
//! up by the agent's own look, and instances sharing an inbox lose nothing across releases.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_broker_adapter::ErrorKind;
use chorus_sdk::durable::{INBOX_STREAM, InboxConsumers, InboxLimits, inbox_stream};
use chorus_sdk::{Agent, AgentOptions, Call, Context, DeliveryClass, HandlerError, Priority};
use chorus_tests::{WAIT, agent, agent_options, eventually, server};

const RELEASE_AFTER: Duration = Duration::from_millis(400);

fn on_demand(server: &chorus_tests::NatsServer, recheck: Duration) -> AgentOptions {
    agent_options(server, "worker")
        .durable_inbox(true)
        .inbox_consumers(InboxConsumers::OnDemand {
            release_after: RELEASE_AFTER,
            recheck,
        })
}

fn work(n: u32, priority: Priority) -> Call {
    Call::agent("worker", "work")
        .command()
        .delivery(DeliveryClass::AtLeastOnce)
        .priority(priority)
        .payload(&n)
        .expect("payload")
}

async fn record_work(agent: &Agent, seen: Arc<Mutex<Vec<u32>>>) {
    agent
        .on_command("work", move |_ctx: Context, n: u32| {
            seen.lock().expect("lock").push(n);
            async move { Ok::<_, HandlerError>(()) }
        })
        .await
        .expect("register");
}

/// A worker connected with `options` that records the `work` commands it handles.
async fn recording_worker(options: AgentOptions) -> (Agent, Arc<Mutex<Vec<u32>>>) {
    let worker = options.connect().await.expect("connect");
    let seen = Arc::new(Mutex::new(Vec::new()));
    record_work(&worker, Arc::clone(&seen)).await;
    (worker, seen)
}

/// Whether consumer `name` of the inbox exists now.
async fn consumer_exists(agent: &Agent, name: &str) -> bool {
    let js = agent.broker().jetstream(WAIT);
    let inbox = agent.subjects().stream_name(INBOX_STREAM);
    match js.consumer_state(&inbox, name).await {
        Ok(_) => true,
        Err(err) if err.kind() == ErrorKind::NotFound => false,
        Err(err) => panic!("consumer {name}: {err}"),
    }
}

async fn seen_count(seen: &Mutex<Vec<u32>>, n: usize, what: &str) {
    eventually(WAIT, what, || async {
        (seen.lock().expect("lock").len() >= n).then_some(())
    })
    .await;
}

#[tokio::test]
async fn an_idle_agent_holds_no_consumer_until_a_command_rings_and_releases_it_when_quiet() {
    let server = server();
    let (worker, seen) = recording_worker(on_demand(&server, Duration::from_secs(60))).await;
    // Started with an empty inbox: nothing on the server but its subscriptions.
    assert!(!consumer_exists(&worker, "worker").await);
    assert!(!consumer_exists(&worker, "worker_high").await);

    let sender = agent(&server, "producer").await;
    for n in 0..3 {
        sender
            .send_durable(work(n, Priority::Normal))
            .await
            .expect("stored");
    }
    seen_count(&seen, 3, "three normal commands handled").await;
    assert_eq!(*seen.lock().expect("lock"), vec![0, 1, 2], "in order");
    assert_eq!(
        worker.stats().inbox_consumers_opened,
        1,
        "the normal lane only"
    );
    assert!(
        !consumer_exists(&worker, "worker_high").await,
        "no bell rang for the high lane"
    );

    // Quiet for the release time with nothing pending: deleted.
    eventually(WAIT, "the normal consumer released", || async {
        (worker.stats().inbox_consumers_released == 1 && !consumer_exists(&worker, "worker").await)
            .then_some(())
    })
    .await;

    // An urgent command rings the high lane's bell: its consumer opens, then goes again.
    sender
        .send_durable(work(99, Priority::High))
        .await
        .expect("stored");
    seen_count(&seen, 4, "the high-priority command handled").await;
    assert_eq!(worker.stats().inbox_consumers_opened, 2);
    eventually(WAIT, "the high consumer released", || async {
        (worker.stats().inbox_consumers_released == 2
            && !consumer_exists(&worker, "worker_high").await)
            .then_some(())
    })
    .await;
    assert!(chorus_tests::inbox_settled(&worker, "worker").await);
    worker.shutdown().await;
}

#[tokio::test]
async fn a_lane_with_its_consumer_open_is_sent_no_bell_per_command() {
    let server = server();
    let (worker, seen) = recording_worker(on_demand(&server, Duration::from_secs(60))).await;
    let sender = agent(&server, "producer").await;
    sender
        .send_durable(work(0, Priority::Normal))
        .await
        .expect("stored");
    // Its bell opened the normal lane's consumer, which stays open while commands come.
    seen_count(&seen, 1, "the first command handled").await;
    let before = worker.broker().received();
    const MORE: u32 = 200;
    for n in 1..=MORE {
        sender
            .send_durable(work(n, Priority::Normal))
            .await
            .expect("stored");
    }
    seen_count(&seen, 1 + MORE as usize, "the others handled").await;
    let more = u64::from(MORE);
    let received = worker.broker().received() - before;
    // One delivery each (and a few replies and pull statuses); a bell each would double it.
    assert!(
        (more..more + more / 2).contains(&received),
        "{received} messages reached the agent for {more} commands"
    );
    assert_eq!(worker.stats().inbox_consumers_opened, 1);
    worker.shutdown().await;
}

#[tokio::test]
async fn a_lost_bell_is_made_up_by_the_agents_own_look_within_the_recheck_time() {
    let server = server();
    let sender = agent(&server, "producer").await;
    // The sender creates the inbox stream with its first durable send.
    sender
        .send_durable(work(0, Priority::Normal))
        .await
        .expect("stored");
    let (worker, seen) = recording_worker(on_demand(&server, Duration::from_secs(1))).await;
    // Stored before it started: found by its first look.
    seen_count(&seen, 1, "the command stored before the start handled").await;
    eventually(WAIT, "released", || async {
        (worker.stats().inbox_consumers_released == 1).then_some(())
    })
    .await;

    // The stream stops ringing bells, as a bell lost with a connection would be.
    let js = sender.broker().jetstream(WAIT);
    let mut silent = inbox_stream(sender.subjects(), &InboxLimits::default());
    silent.republish_headers = None;
    js.ensure_stream(&silent).await.expect("bells off");
    sender
        .send_durable(work(1, Priority::Normal))
        .await
        .expect("stored");
    let started = std::time::Instant::now();
    seen_count(&seen, 2, "the command without a bell handled").await;
    let waited = started.elapsed();
    println!("a command without a bell waited {waited:?} (recheck 1 s, jittered 0.75-1.25)");
    assert!(
        waited >= Duration::from_millis(100),
        "found by the look, not by a bell ({waited:?})"
    );
    assert_eq!(worker.stats().inbox_consumers_opened, 2);
    worker.shutdown().await;
}

#[tokio::test]
async fn instances_sharing_an_on_demand_inbox_lose_nothing_across_releases() {
    let server = server();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut instances = Vec::new();
    for _ in 0..2 {
        let instance = on_demand(&server, Duration::from_secs(2))
            .connect()
            .await
            .expect("connect");
        record_work(&instance, Arc::clone(&seen)).await;
        instances.push(instance);
    }
    let sender = agent(&server, "producer").await;
    const BURST: u32 = 300;
    for round in 0..3u32 {
        let calls = (0..BURST)
            .map(|n| work(round * BURST + n, Priority::Normal))
            .collect();
        let receipts = sender.send_batch(calls).await;
        assert!(receipts.iter().all(Result::is_ok), "every command stored");
        let expected = ((round + 1) * BURST) as usize;
        eventually(WAIT, "the burst handled", || async {
            let unique: HashSet<u32> = seen.lock().expect("lock").iter().copied().collect();
            (unique.len() >= expected).then_some(())
        })
        .await;
        // Quiet until one instance has let the consumer go, then the next burst.
        let released = || {
            instances
                .iter()
                .map(|i| i.stats().inbox_consumers_released)
                .sum::<u64>()
        };
        eventually(WAIT, "the consumer released", || async {
            (released() > u64::from(round) && !consumer_exists(&instances[0], "worker").await)
                .then_some(())
        })
        .await;
    }
    let handled: HashSet<u32> = seen.lock().expect("lock").iter().copied().collect();
    assert_eq!(
        handled,
        (0..3 * BURST).collect::<HashSet<u32>>(),
        "lost none"
    );
    let opened: u64 = instances
        .iter()
        .map(|i| i.stats().inbox_consumers_opened)
        .sum();
    let released: u64 = instances
        .iter()
        .map(|i| i.stats().inbox_consumers_released)
        .sum();
    println!(
        "3 bursts of {BURST} to 2 instances: {} calls, opened {opened}, released {released}",
        seen.lock().expect("lock").len()
    );
    assert!(opened >= 3, "each burst opened the consumer ({opened})");
    assert!(released >= 3, "each quiet released it ({released})");
    assert!(chorus_tests::inbox_settled(&instances[0], "worker").await);
    for instance in instances {
        instance.shutdown().await;
    }
}

#[tokio::test]
async fn a_command_the_consumer_gave_up_on_keeps_it_so_it_is_not_delivered_all_over_again() {
    let server = server();
    // Never acked: every delivery runs out its ack wait, until `max_deliver` (the retry
    // policy's attempts) makes the server give up. No coordinator runs to dead-letter it, so
    // it stays stored.
    let (worker, seen) = recording_worker(
        on_demand(&server, Duration::from_secs(60))
            .durable_ack_wait(Duration::from_millis(300))
            .skip_acks(u64::MAX),
    )
    .await;
    let sender = agent(&server, "producer").await;
    sender
        .send_durable(work(7, Priority::Normal))
        .await
        .expect("stored");
    let attempts = chorus_sdk::retry::RetryPolicies::default().max_attempts() as usize;
    seen_count(&seen, attempts, "every attempt the policy allows").await;
    // Quiet periods pass (release after 400 ms) with the command still stored: the consumer
    // stays, and no new one starts its count again.
    tokio::time::sleep(RELEASE_AFTER * 6).await;
    assert_eq!(
        seen.lock().expect("lock").len(),
        attempts,
        "delivered {attempts} times, no more"
    );
    assert!(
        consumer_exists(&worker, "worker").await,
        "kept while the command is stored"
    );
    assert_eq!(worker.stats().inbox_consumers_released, 0);
    worker.shutdown().await;
}

/// The coordinator's inbox settings are the bus's: an agent with a durable inbox and limits
/// of its own, connecting later, leaves the existing streams as they are (PROTOCOL.md section
/// 7.12; it once updated them to its own, replicas and ages included).
#[tokio::test]
async fn an_agent_leaves_the_coordinators_streams_as_they_are() {
    let server = server();
    let mut hour = InboxLimits::default();
    hour.max_age_secs = 3_600;
    let mut minute = InboxLimits::default();
    minute.max_age_secs = 60;
    let config = chorus_coordinator::CoordinatorConfig {
        servers: server.url().to_owned(),
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        inbox: hour,
        ..chorus_coordinator::CoordinatorConfig::default()
    };
    let coordinator = chorus_coordinator::Coordinator::start(config, false)
        .await
        .expect("coordinator");
    let worker = agent_options(&server, "worker")
        .durable_inbox(true)
        .inbox_limits(minute)
        .connect()
        .await
        .expect("worker connects");
    worker
        .on_command("work", |_ctx: Context, (): ()| async {
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("register");
    let raw = chorus_tests::raw_broker(&server).await;
    let name = chorus_sdk::Subjects::default().stream_name(INBOX_STREAM);
    let info = raw
        .request(
            &format!("$JS.API.STREAM.INFO.{name}"),
            None,
            bytes::Bytes::new(),
            WAIT,
        )
        .await
        .expect("stream info");
    let info: serde_json::Value = serde_json::from_slice(info.payload()).expect("json");
    // Nanoseconds: the coordinator's hour, not the worker's minute.
    assert_eq!(info["config"]["max_age"], 3_600_000_000_000u64, "{info}");
    worker.shutdown().await;
    coordinator.shutdown().await;
}
