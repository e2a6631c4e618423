//! Delivery guarantees against a real server: offline inboxes, at-least-once through a crash,
//! exactly-once through duplicates and lost acks, a server killed mid-stream, priority, long
//! handlers. (The burst at a slow subscriber has its own binary: tests/burst.rs.)

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chorus_coordinator::service::dlq::DeadLetterQueue;
use chorus_sdk::durable::DeadLetterReason;
use chorus_sdk::{
    Agent, AgentOptions, Call, Context, DeliveryClass, HandlerError, Priority, StatusCode,
};
use chorus_tests::{CrashableAgent, WAIT, agent, agent_options, eventually, server, within};

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

/// Waits (up to `limit`) until the server has nothing more to give agent `id`: nothing stored
/// for it, nothing delivered and awaiting an ack. What was handled by then is final, so a lost
/// message shows as a wrong count, not as a timeout.
async fn drained(agent: &Agent, id: &str, limit: Duration) {
    eventually(limit, "the durable inbox drained", || async {
        chorus_tests::inbox_settled(agent, id).await.then_some(())
    })
    .await;
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
    drained(&worker, "worker", WAIT).await;
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
    drained(&second, "worker", Duration::from_secs(60)).await;
    let unique: HashSet<u32> = seen.lock().expect("lock").iter().copied().collect();
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
    // Nothing more can come once the server has nothing pending for the worker and no delivery
    // awaiting its ack.
    drained(&sender, "worker", WAIT).await;
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
    const CHUNK: usize = 250;
    let (publisher, acked) = chorus_tests::publish_tracking_acks(sender, "worker", SENT, CHUNK);
    eventually(Duration::from_secs(60), "3,000 acked", || async {
        (acked.count() >= 3_000).then_some(())
    })
    .await;
    server.kill();
    let killed_at = acked.count();
    server.restart().expect("restart with the same store");
    let sender = chorus_tests::within(Duration::from_secs(120), "publisher", publisher)
        .await
        .expect("publisher task");
    let js = sender.broker().jetstream(WAIT);
    let inbox = sender
        .subjects()
        .stream_name(chorus_sdk::durable::INBOX_STREAM);
    let report = chorus_tests::settle_and_count(
        &acked,
        &seen,
        &js,
        &inbox,
        "worker",
        Duration::from_secs(120),
    )
    .await;
    let redelivered = worker.stats().redelivered;
    let resent = acked.resent();
    println!(
        "server SIGKILL: sent {SENT}, acked {} ({killed_at} before the kill), handled {} unique, lost {}, duplicated {}, redelivered {redelivered}, resent by the producer {resent}, settled {}",
        report.acked, report.handled, report.lost, report.duplicated, report.settled
    );
    assert_eq!(report.lost, 0, "acknowledged and never handled: {report:?}");
    // Every repeated handler run came from a delivery the agent counted as a redelivery
    // (though the restarted server may count it as a first delivery), or from a second copy a
    // producer's resend stored.
    assert!(
        redelivered + resent as u64 >= report.duplicated as u64,
        "redelivered {redelivered} + resent {resent} < duplicated {}",
        report.duplicated
    );
    assert!(
        report.settled,
        "the worker's consumer never drained: {report:?}"
    );
    // The bus went on taking work after the fault: acks kept coming, through the last batch.
    assert!(
        report.acked > killed_at + CHUNK,
        "only {} acks after the kill",
        report.acked - killed_at
    );
    let acked_set = acked.set();
    let last_batch = SENT - CHUNK as u32..SENT;
    assert!(
        last_batch.clone().all(|n| acked_set.contains(&n)),
        "the last batch ({last_batch:?}) was not acknowledged after the restart"
    );
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
    // An ordering, not a time: the urgent one overtook most of the backlog.
    assert!(
        backlog_done < 150,
        "the urgent command waited behind {backlog_done} of 200 (after {waited:?})"
    );
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
    // Its ack reached the server, so no redelivery can follow; one during the 2 s run would
    // have been counted already.
    drained(&sender, "worker", WAIT).await;
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

/// PROTOCOL.md, ordering: each sender's durable commands run one at a time in a lane chosen by
/// its id, 16 lanes by default, so up to 16 senders are served at once; a message that fails
/// is handled again after the ones behind it (retries do not block the lane).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_senders_run_in_parallel_lanes_and_a_retry_does_not_block_its_lane() {
    let server = server();
    const SENDERS: usize = 16;
    const EACH: u32 = 5;
    let handled: Arc<Mutex<HashMap<String, Vec<u32>>>> = Arc::default();
    let failed_once: Arc<Mutex<HashSet<String>>> = Arc::default();
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let worker = agent_options(&server, "worker")
        .durable_inbox(true)
        .retry_policies(chorus_sdk::RetryPolicies {
            // One retry, 2 s later: long after the four behind it are done.
            default: chorus_sdk::RetryPolicy {
                max_attempts: 3,
                initial_backoff_ms: 2_000,
                multiplier: 1.0,
                max_backoff_ms: 2_000,
                jitter: 0.0,
                ..chorus_sdk::RetryPolicy::default()
            },
            rules: Vec::new(),
        })
        .connect()
        .await
        .expect("connect");
    {
        let (handled, failed_once) = (Arc::clone(&handled), Arc::clone(&failed_once));
        let (running, peak) = (Arc::clone(&running), Arc::clone(&peak));
        worker
            .on_command("work", move |ctx: Context, n: u32| {
                let from = ctx.from().to_owned();
                let fail = n == 0 && failed_once.lock().expect("lock").insert(from.clone());
                if !fail {
                    handled
                        .lock()
                        .expect("lock")
                        .entry(from)
                        .or_default()
                        .push(n);
                }
                let (running, peak) = (Arc::clone(&running), Arc::clone(&peak));
                async move {
                    peak.fetch_max(running.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    if fail {
                        Err(HandlerError::failed("the first try fails"))
                    } else {
                        Ok(())
                    }
                }
            })
            .await
            .expect("register");
    }
    let mut senders = Vec::new();
    for i in 0..SENDERS {
        senders.push(agent(&server, &format!("sender-{i:02}")).await);
    }
    let sends = senders
        .iter()
        .map(|s| s.send_batch((0..EACH).map(work).collect()));
    for receipts in futures::future::join_all(sends).await {
        assert!(receipts.iter().all(Result::is_ok), "every command stored");
    }
    let handled = eventually(Duration::from_secs(60), "every command handled", || async {
        let h = handled.lock().expect("lock").clone();
        (h.len() == SENDERS && h.values().all(|v| v.len() == EACH as usize)).then_some(h)
    })
    .await;
    let peak = peak.load(Ordering::SeqCst);
    println!("lanes: {SENDERS} senders, at most {peak} handlers at once");
    for (sender, order) in &handled {
        assert_eq!(
            order,
            &[1, 2, 3, 4, 0],
            "{sender}: the failed first command came back after the ones behind it"
        );
    }
    assert!(peak >= 4, "senders were served one after another: {peak}");
    assert_eq!(worker.stats().retries, SENDERS as u64);
}

/// PROTOCOL.md, at most once: a receiver whose queue is full answers new requests with 5019 at
/// once, and counts them as shed; what it took is still answered.
#[tokio::test]
async fn requests_beyond_a_full_queue_are_shed_with_5019_at_once() {
    let server = server();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel();
    let busy = agent_options(&server, "busy")
        .queue_capacity(2)
        .max_in_flight(1)
        .connect()
        .await
        .expect("connect");
    {
        let gate = Arc::clone(&gate);
        busy.on_command("hold", move |_ctx: Context, n: u32| {
            let gate = Arc::clone(&gate);
            let _ = started_tx.send(n);
            async move {
                gate.acquire().await.expect("gate").forget();
                Ok::<_, HandlerError>(n)
            }
        })
        .await
        .expect("register");
    }
    let client = agent(&server, "client").await;
    let call = |n: u32| {
        let client = client.clone();
        tokio::spawn(async move {
            let result = client
                .request::<_, u32>("busy", "hold", &n)
                .await
                .map_err(|e| e.status());
            (result, Instant::now())
        })
    };
    let first = call(0);
    within(WAIT, "the first request handled", started_rx.recv())
        .await
        .expect("started");
    const MORE: u32 = 20;
    let more: Vec<_> = (1..=MORE).map(call).collect();
    // The queue holds two (`queue_capacity`) while the first runs: the other 18 are refused
    // at once (at least 17 is asked, so that one taken late by a slow reader still passes).
    eventually(WAIT, "17 requests shed", || async {
        (busy.stats().shed >= u64::from(MORE) - 3).then_some(())
    })
    .await;
    let opened_at = Instant::now();
    gate.add_permits(MORE as usize + 1);
    let mut outcomes = vec![within(WAIT, "first", first).await.expect("task")];
    for task in more {
        outcomes.push(within(WAIT, "request", task).await.expect("task"));
    }
    let shed: Vec<Instant> = outcomes
        .iter()
        .filter(|(r, _)| *r == Err(StatusCode::UNAVAILABLE))
        .map(|(_, at)| *at)
        .collect();
    let answered = outcomes.iter().filter(|(r, _)| r.is_ok()).count();
    println!(
        "shedding: {} requests, {answered} answered, {} shed with 5019",
        MORE + 1,
        shed.len()
    );
    assert_eq!(answered + shed.len(), MORE as usize + 1, "{outcomes:?}");
    assert!(!shed.is_empty(), "a full queue shed nothing");
    assert_eq!(busy.stats().shed, shed.len() as u64);
    assert!(
        shed.iter().all(|at| *at < opened_at),
        "every refusal came back at once, before the handler was free"
    );
}
