//! Delivery guarantees against a real server: offline inboxes, at-least-once through a crash,
//! exactly-once through duplicates and lost acks, a server killed mid-stream, a burst at a
//! slow subscriber, priority, long handlers.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_sdk::codec::{self, Encoding};
use agent_sdk::durable::DeadLetterReason;
use agent_sdk::{
    Agent, AgentOptions, Call, Context, DeliveryClass, Envelope, HandlerError, Kind, Performative,
    Priority,
};
use bytes::Bytes;
use chorus::service::dlq::DeadLetterQueue;
use chorus_tests::{
    CrashableAgent, WAIT, agent, agent_options, eventually, raw_broker, rss_bytes, server,
};

fn work(n: u32) -> Call {
    Call::agent("worker", "work")
        .command()
        .delivery(DeliveryClass::AtLeastOnce)
        .payload(&n)
        .expect("payload")
}

/// A `work` handler recording every call.
async fn record_work(agent: Agent, seen: Arc<Mutex<Vec<u32>>>, pause: Duration) {
    agent
        .on_command("work", move |_ctx: Context, n: u32| {
            seen.lock().expect("lock").push(n);
            async move {
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
                Ok::<_, HandlerError>(())
            }
        })
        .await
        .expect("register");
}

fn durable_worker(server: &chorus_tests::NatsServer) -> AgentOptions {
    agent_options(server, "worker")
        .durable_inbox(true)
        .durable_ack_wait(Duration::from_secs(1))
}

#[tokio::test]
async fn a_thousand_commands_for_an_offline_agent_arrive_in_order_and_expired_ones_are_dead_lettered()
 {
    let server = server();
    let sender = agent(&server, "producer").await;
    let mut calls = Vec::new();
    for n in 0..1_000u32 {
        if n % 10 == 0 {
            // An urgent-but-perishable one before every tenth: it will be too late.
            calls.push(work(1_000_000 + n).ttl(Duration::from_millis(100)));
        }
        calls.push(work(n));
    }
    let receipts = sender.send_batch(calls).await;
    assert!(receipts.iter().all(Result::is_ok), "every command stored");
    // Let the perishable ones' TTL pass while the worker is still offline.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let seen = Arc::new(Mutex::new(Vec::new()));
    let worker = durable_worker(&server).connect().await.expect("connect");
    record_work(worker.clone(), Arc::clone(&seen), Duration::ZERO).await;
    eventually(WAIT, "1,000 commands handled", || async {
        (seen.lock().expect("lock").len() >= 1_000).then_some(())
    })
    .await;
    let dlq = DeadLetterQueue::new(sender.broker().clone(), sender.subjects().clone());
    let expired = eventually(WAIT, "100 expired dead letters", || async {
        let e = dlq.list(1_000).await.expect("list");
        (e.len() >= 100).then_some(e)
    })
    .await;
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(
        seen,
        (0..1_000).collect::<Vec<u32>>(),
        "all 1,000, in send order, none expired"
    );
    assert_eq!(expired.len(), 100);
    assert!(
        expired
            .iter()
            .all(|e| e.letter.reason == DeadLetterReason::Expired)
    );
    assert_eq!(worker.stats().expired, 100);
}

#[tokio::test]
async fn at_least_once_through_a_crashed_agent_handles_everything_sent() {
    let server = server();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let first_seen = Arc::clone(&seen);
    let mut first = CrashableAgent::start(durable_worker(&server).max_in_flight(64), move |a| {
        record_work(a, first_seen, Duration::from_millis(2))
    });
    let sender = agent(&server, "producer").await;
    const SENT: u32 = 2_000;
    let receipts = sender.send_batch((0..SENT).map(work).collect()).await;
    assert!(receipts.iter().all(Result::is_ok));
    eventually(WAIT, "a quarter handled", || async {
        (seen.lock().expect("lock").len() >= 500).then_some(())
    })
    .await;
    first.crash();
    let handled_before_crash = seen.lock().expect("lock").len();

    let second = durable_worker(&server).connect().await.expect("restart");
    record_work(second.clone(), Arc::clone(&seen), Duration::ZERO).await;
    let unique = eventually(Duration::from_secs(60), "every message handled", || async {
        let unique: HashSet<u32> = seen.lock().expect("lock").iter().copied().collect();
        (unique.len() == SENT as usize).then_some(unique)
    })
    .await;
    let handled = seen.lock().expect("lock").len();
    let duplicates = handled - unique.len();
    println!(
        "at-least-once: sent {SENT}, handled {} unique ({handled} calls, {handled_before_crash} before the crash), duplicates {duplicates}, redelivered {}",
        unique.len(),
        second.stats().redelivered
    );
    assert_eq!(
        unique,
        (0..SENT).collect::<HashSet<u32>>(),
        "sent = handled"
    );
    assert!(
        second.stats().redelivered as usize >= duplicates,
        "every duplicate is a counted redelivery"
    );
}

#[tokio::test]
async fn exactly_once_runs_the_handler_once_despite_duplicate_publishes_and_lost_acks() {
    let server = server();
    let runs: Arc<Mutex<HashMap<u32, usize>>> = Arc::new(Mutex::new(HashMap::new()));
    let worker = durable_worker(&server)
        .skip_acks(100)
        .connect()
        .await
        .expect("connect");
    {
        let runs = Arc::clone(&runs);
        worker
            .on_command("work", move |_ctx: Context, n: u32| {
                *runs.lock().expect("lock").entry(n).or_default() += 1;
                async { Ok::<_, HandlerError>(()) }
            })
            .await
            .expect("register");
    }
    let sender = agent(&server, "producer").await;
    let ids: Vec<uuid::Uuid> = (0..1_000).map(|_| uuid::Uuid::now_v7()).collect();
    let batch = |ids: &[uuid::Uuid]| {
        ids.iter()
            .enumerate()
            .map(|(n, id)| work(n as u32).id(*id).delivery(DeliveryClass::ExactlyOnce))
            .collect::<Vec<_>>()
    };
    let first = sender.send_batch(batch(&ids)).await;
    let second = sender.send_batch(batch(&ids)).await;
    assert!(first.iter().all(|r| r.as_ref().is_ok_and(|r| !r.duplicate)));
    assert!(
        second.iter().all(|r| r.as_ref().is_ok_and(|r| r.duplicate)),
        "the server recognised every second copy by its id"
    );
    // 100 acks were withheld: those deliveries come back after the ack wait and must not run.
    eventually(
        Duration::from_secs(30),
        "withheld acks redelivered",
        || async { (worker.stats().duplicates_suppressed >= 100).then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let runs = runs.lock().expect("lock").clone();
    let total: usize = runs.values().sum();
    println!(
        "exactly-once: published 2,000 (1,000 dropped as duplicates by the server), {} redeliveries suppressed, handler runs {total}",
        worker.stats().duplicates_suppressed
    );
    assert_eq!(runs.len(), 1_000);
    assert_eq!(total, 1_000, "each message handled exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_server_mid_stream_loses_no_acknowledged_message() {
    let mut server = chorus_tests::ServerBuilder::default()
        .sync_always(true)
        .start()
        .expect("server");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let worker = durable_worker(&server).connect().await.expect("connect");
    record_work(worker.clone(), Arc::clone(&seen), Duration::ZERO).await;
    let sender = agent(&server, "producer").await;

    const SENT: u32 = 10_000;
    let (publisher, acked) = chorus_tests::publish_tracking_acks(sender, "worker", SENT, 250);
    eventually(Duration::from_secs(60), "3,000 acked", || async {
        (acked.count() >= 3_000).then_some(())
    })
    .await;
    server.kill();
    let killed_at = acked.count();
    server.restart().expect("restart with the same store");
    chorus_tests::within(Duration::from_secs(120), "publisher", publisher)
        .await
        .expect("publisher task");
    let report = chorus_tests::await_acked_handled(&acked, &seen, Duration::from_secs(120)).await;
    println!(
        "server SIGKILL: sent {SENT}, acked {} ({killed_at} before the kill), handled {} unique, lost {}, duplicated {}",
        report.acked, report.handled, report.lost, report.duplicated
    );
    assert_eq!(report.lost, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_200k_events_at_a_slow_subscriber_keeps_memory_bounded_and_counts_every_drop() {
    let server = server();
    let handled = Arc::new(AtomicUsize::new(0));
    let slow = agent_options(&server, "slow")
        .queue_capacity(1_000)
        .max_in_flight(4)
        .connect()
        .await
        .expect("connect");
    {
        let handled = Arc::clone(&handled);
        slow.on_event("burst.>", move |_ctx: Context, _n: u32| {
            let handled = Arc::clone(&handled);
            async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                handled.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        })
        .await
        .expect("subscribe");
    }
    let raw = raw_broker(&server).await;
    let mut env = Envelope::new(Kind::Event, Performative::Inform, "firehose");
    env.topic = Some("burst.x".into());
    env.payload = codec::encode_payload(&7u32, "application/msgpack").expect("payload");
    let bytes: Bytes = codec::encode(&env, Encoding::MsgPack).expect("encode");
    let subject = slow.subjects().event("burst.x").expect("subject");

    const BURST: usize = 200_000;
    let rss_before = rss_bytes();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(rss_before));
    let sampler = tokio::spawn({
        let peak = Arc::clone(&peak);
        async move {
            loop {
                peak.fetch_max(rss_bytes(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let started = Instant::now();
    for _ in 0..BURST {
        raw.publish(&subject, bytes.clone()).await.expect("publish");
    }
    raw.flush().await.expect("flush");
    let accounted = eventually(
        Duration::from_secs(60),
        "every event handled or counted",
        || async {
            let s = slow.stats();
            let done = handled.load(Ordering::SeqCst) as u64;
            let total = done + s.dropped;
            (total == BURST as u64 && s.received == done).then_some(total)
        },
    )
    .await;
    sampler.abort();
    let stats = slow.stats();
    let growth = peak.load(Ordering::Relaxed).saturating_sub(rss_before);
    println!(
        "burst: {BURST} events in {:?}; handled {}, dropped {} (reported by the SDK); RSS {} MiB before, peak growth {} MiB",
        started.elapsed(),
        handled.load(Ordering::SeqCst),
        stats.dropped,
        rss_before >> 20,
        growth >> 20
    );
    assert_eq!(accounted, BURST as u64, "handled + dropped = sent, exactly");
    assert!(stats.dropped > 0, "the slow subscriber did drop");
    assert!(growth < 128 << 20, "memory grew {} MiB", growth >> 20);
}

#[tokio::test]
async fn a_high_priority_command_is_not_stuck_behind_a_low_priority_backlog() {
    let server = server();
    let handled_at: Arc<Mutex<HashMap<u32, Instant>>> = Arc::new(Mutex::new(HashMap::new()));
    let worker = durable_worker(&server)
        .ordering_lanes(1)
        .connect()
        .await
        .expect("connect");
    {
        let handled_at = Arc::clone(&handled_at);
        worker
            .on_command("work", move |_ctx: Context, n: u32| {
                handled_at.lock().expect("lock").insert(n, Instant::now());
                async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Ok::<_, HandlerError>(())
                }
            })
            .await
            .expect("register");
    }
    let sender = agent(&server, "producer").await;
    let backlog: Vec<Call> = (0..200).map(work).collect();
    assert!(sender.send_batch(backlog).await.iter().all(Result::is_ok));
    eventually(WAIT, "backlog started", || async {
        (!handled_at.lock().expect("lock").is_empty()).then_some(())
    })
    .await;
    let sent_at = Instant::now();
    sender
        .send(
            work(9_999)
                .priority(Priority::High)
                .delivery(DeliveryClass::AtLeastOnce),
        )
        .await
        .expect("urgent");
    let urgent_at = eventually(WAIT, "urgent handled", || async {
        handled_at.lock().expect("lock").get(&9_999).copied()
    })
    .await;
    let waited = urgent_at - sent_at;
    let backlog_done = handled_at.lock().expect("lock").len() - 1;
    println!(
        "priority: urgent handled after {waited:?} with {} of 200 backlog still waiting",
        200 - backlog_done
    );
    assert!(
        waited < Duration::from_millis(500),
        "urgent waited {waited:?}"
    );
    assert!(backlog_done < 150, "the backlog was still there");
}

#[tokio::test]
async fn a_handler_longer_than_the_ack_wait_is_not_redelivered() {
    let server = server();
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = agent_options(&server, "worker")
        .durable_inbox(true)
        .durable_ack_wait(Duration::from_millis(600))
        .connect()
        .await
        .expect("connect");
    {
        let runs = Arc::clone(&runs);
        worker
            .on_command("work", move |_ctx: Context, _n: u32| {
                runs.fetch_add(1, Ordering::SeqCst);
                async {
                    tokio::time::sleep(Duration::from_millis(2_000)).await;
                    Ok::<_, HandlerError>(())
                }
            })
            .await
            .expect("register");
    }
    let sender = agent(&server, "producer").await;
    sender.send_durable(work(1)).await.expect("stored");
    eventually(WAIT, "handled", || async {
        (worker.stats().handled_ok == 1).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "progress acks kept it from being redelivered"
    );
    assert_eq!(worker.stats().redelivered, 0);
}

#[tokio::test]
async fn an_exactly_once_request_retried_with_the_same_id_gets_the_stored_reply() {
    let server = server();
    let runs = Arc::new(AtomicUsize::new(0));
    let bank = agent(&server, "bank").await;
    {
        let runs = Arc::clone(&runs);
        bank.on_command("transfer", move |_ctx: Context, cents: u64| {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            async move { Ok::<_, HandlerError>(format!("transfer #{n} of {cents}")) }
        })
        .await
        .expect("register");
    }
    let client = agent(&server, "client").await;
    let id = uuid::Uuid::now_v7();
    let call = || {
        Call::agent("bank", "transfer")
            .payload(&500u64)
            .expect("payload")
            .id(id)
            .delivery(DeliveryClass::ExactlyOnce)
    };
    let first: String = client
        .call(call())
        .await
        .expect("first")
        .payload_as()
        .expect("str");
    // The caller did not see the answer (say it timed out) and retries with the same id.
    let second: String = client
        .call(call())
        .await
        .expect("retry")
        .payload_as()
        .expect("str");
    assert_eq!(first, "transfer #1 of 500");
    assert_eq!(second, first, "the stored reply, not a second transfer");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(bank.stats().duplicates_suppressed, 1);
    // A new id is a new transfer.
    let third: String = client
        .call(
            Call::agent("bank", "transfer")
                .payload(&500u64)
                .expect("payload")
                .delivery(DeliveryClass::ExactlyOnce),
        )
        .await
        .expect("third")
        .payload_as()
        .expect("str");
    assert_eq!(third, "transfer #2 of 500");
}
