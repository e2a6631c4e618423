//! The coordinator against a real server: registry and discovery, liveness, NATS service
//! discovery, broadcast reports, retries and dead letters, two coordinators at once, metrics.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chorus_coordinator::service::DLQ_CONSUMER;
use chorus_coordinator::service::dlq::DeadLetterQueue;
use chorus_coordinator::service::registry::RegistryEvent;
use chorus_sdk::durable::{ADVISORY_STREAM, DeadLetterReason, INBOX_STREAM};
use chorus_sdk::{
    Availability, BroadcastTarget, Call, Context, HandlerError, Outcome, RetryPolicies,
    RetryPolicy, StatusCode,
};
use chorus_tests::{
    CrashableAgent, WAIT, agent, agent_options, coordinator, crashing_consumer, eventually,
    http_get, metric_sum, raw_broker, server, within,
};
use futures::StreamExt;

const HEARTBEAT: Duration = Duration::from_millis(300);

async fn ids_for(client: &chorus_sdk::Agent, capability: &str) -> Vec<String> {
    client
        .discover_capability(capability)
        .await
        .expect("discovery answers")
        .into_iter()
        .map(|r| r.manifest.agent)
        .collect()
}

#[tokio::test]
async fn discovery_is_least_loaded_first_and_a_crashed_agent_drops_out_within_three_heartbeats() {
    let server = server();
    let coordinator = coordinator(&server, false).await;
    let client = agent(&server, "client").await;
    let mut registry_events = client.subscribe("registry.left").await.expect("subscribe");
    let mut joins = client
        .subscribe("registry.joined")
        .await
        .expect("subscribe");

    let serve_ocr = |load: f32| {
        move |a: chorus_sdk::Agent| async move {
            a.on_capability("ocr", |_ctx: Context, (): ()| async {
                Ok::<_, HandlerError>(())
            })
            .await
            .expect("serve");
            a.set_load(load, Availability::Available);
        }
    };
    let mut busy = CrashableAgent::start(
        agent_options(&server, "ocr-busy").heartbeat_interval(HEARTBEAT),
        serve_ocr(0.7),
    );
    let idle = agent_options(&server, "ocr-idle")
        .heartbeat_interval(HEARTBEAT)
        .connect()
        .await
        .expect("connect");
    serve_ocr(0.2)(idle.clone()).await;

    let order = eventually(WAIT, "both ocr agents discovered", || async {
        let ids = ids_for(&client, "ocr").await;
        (ids.len() == 2).then_some(ids)
    })
    .await;
    assert_eq!(order, ["ocr-idle", "ocr-busy"], "least loaded first");
    let joined = within(WAIT, "joined event", joins.next())
        .await
        .expect("event");
    assert_eq!(
        joined.envelope.status,
        Some(chorus_sdk::StatusCode::CONNECTED)
    );
    // Load changes are seen at the next heartbeat and reorder the answer.
    idle.set_load(0.9, Availability::Available);
    eventually(WAIT, "order follows load", || async {
        (ids_for(&client, "ocr").await == ["ocr-busy", "ocr-idle"]).then_some(())
    })
    .await;
    // A query can leave out agents above a load.
    let light = client
        .discover(&chorus_sdk::DiscoverQuery {
            capability: Some("ocr".into()),
            max_load: Some(0.8),
            ..Default::default()
        })
        .await
        .expect("discover");
    assert_eq!(light.len(), 1);
    assert_eq!(light[0].manifest.agent, "ocr-busy");

    // Kill one without a goodbye.
    busy.crash();
    let killed_at = Instant::now();
    eventually(WAIT, "crashed agent gone from discovery", || async {
        (ids_for(&client, "ocr").await == ["ocr-idle"]).then_some(())
    })
    .await;
    let gone_after = killed_at.elapsed();
    println!("crashed agent left discovery after {gone_after:?} (heartbeat {HEARTBEAT:?})");
    // A lower bound, not a deadline: its last heartbeat came at most one interval before the
    // crash, and it is declared gone only after three intervals without one. (The measured
    // figure is printed above; a loaded machine only makes it longer.)
    assert!(
        gone_after + Duration::from_millis(50) >= HEARTBEAT * 2,
        "declared gone after {gone_after:?}, before three intervals of silence"
    );
    let event = within(WAIT, "left event", registry_events.next())
        .await
        .expect("event");
    let left: RegistryEvent = event.payload_as().expect("payload");
    assert_eq!(
        (left.agent.as_str(), left.reason.as_str()),
        ("ocr-busy", "missed heartbeats")
    );
    assert_eq!(
        event.envelope.status,
        Some(chorus_sdk::StatusCode::UNEXPECTED_DISCONNECT)
    );

    // A clean shutdown leaves at once, with a goodbye.
    idle.shutdown().await;
    let event = within(WAIT, "goodbye event", registry_events.next())
        .await
        .expect("event");
    let left: RegistryEvent = event.payload_as().expect("payload");
    assert_eq!(
        (left.agent.as_str(), left.reason.as_str()),
        ("ocr-idle", "goodbye")
    );
    assert_eq!(
        event.envelope.status,
        Some(chorus_sdk::StatusCode::DISCONNECTED)
    );
    assert!(ids_for(&client, "ocr").await.is_empty());
    coordinator.shutdown().await;
}

#[tokio::test]
async fn agents_answer_nats_service_discovery() {
    let server = server();
    let worker = agent(&server, "svc-worker").await;
    worker
        .on_command("echo", |_ctx: Context, s: String| async move {
            Ok::<_, HandlerError>(s)
        })
        .await
        .expect("register");
    worker
        .on_capability("text.upper", |_ctx: Context, s: String| async move {
            Ok::<_, HandlerError>(s.to_uppercase())
        })
        .await
        .expect("serve");
    let client = agent(&server, "svc-client").await;
    for _ in 0..3 {
        let _: String = client
            .request("svc-worker", "echo", "hi")
            .await
            .expect("echo");
    }
    let raw = raw_broker(&server).await;
    let ask = |subject: &'static str| {
        let raw = raw.clone();
        async move {
            let msg = raw
                .request(subject, None, bytes::Bytes::new(), WAIT)
                .await
                .unwrap_or_else(|e| panic!("{subject}: {e}"));
            serde_json::from_slice::<serde_json::Value>(msg.payload()).expect("json")
        }
    };
    let ping = ask("$SRV.PING.svc-worker").await;
    assert_eq!(ping["type"], "io.nats.micro.v1.ping_response");
    assert_eq!(ping["name"], "svc-worker");
    let info = ask("$SRV.INFO.svc-worker").await;
    assert_eq!(info["type"], "io.nats.micro.v1.info_response");
    let endpoints: Vec<&str> = info["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .filter_map(|e| e["subject"].as_str())
        .collect();
    assert!(
        endpoints.contains(&"chorus.agent.svc-worker.echo"),
        "{endpoints:?}"
    );
    assert!(
        endpoints.contains(&"chorus.cap.text.upper"),
        "{endpoints:?}"
    );
    let stats = ask("$SRV.STATS.svc-worker").await;
    let echo = stats["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .find(|e| e["name"] == "echo")
        .expect("echo endpoint")
        .clone();
    assert_eq!(echo["num_requests"], 3);
    assert_eq!(echo["num_errors"], 0);
}

#[tokio::test]
async fn a_broadcast_to_fifty_agents_with_five_silent_reports_45_delivered_and_5_timed_out() {
    let server = server();
    let coordinator = coordinator(&server, false).await;
    let mut fleet = Vec::new();
    for i in 0..50 {
        let silent = i % 10 == 3;
        let a = agent_options(&server, &format!("fleet-{i:02}"))
            .group("fleet")
            .connect()
            .await
            .expect("connect");
        a.on_command("reload", move |_ctx: Context, (): ()| async move {
            if silent {
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("register");
        fleet.push(a);
    }
    let client = agent(&server, "operator").await;
    eventually(WAIT, "50 fleet agents registered", || async {
        let n = client
            .discover(&chorus_sdk::DiscoverQuery {
                group: Some("fleet".into()),
                ..Default::default()
            })
            .await
            .map(|v| v.len())
            .unwrap_or(0);
        (n == 50).then_some(())
    })
    .await;
    // Long enough that 45 answering agents on a loaded machine are not counted as silent.
    const PER_RECIPIENT: Duration = Duration::from_secs(5);
    let started = Instant::now();
    let report = client
        .broadcast(
            &BroadcastTarget::Group("fleet".into()),
            "reload",
            &(),
            PER_RECIPIENT,
        )
        .await
        .expect("report");
    let took = started.elapsed();
    println!("broadcast to 50 took {took:?} (timeout per recipient {PER_RECIPIENT:?})");
    assert!(
        took >= PER_RECIPIENT,
        "the report came before the silent agents' timeout ran out: {took:?}"
    );
    assert_eq!(report.recipients.len(), 50);
    assert_eq!(report.count(Outcome::Delivered), 45);
    assert_eq!(report.count(Outcome::TimedOut), 5);
    assert_eq!(report.count(Outcome::Failed), 0);
    let silent: Vec<&str> = report
        .recipients
        .iter()
        .filter(|r| r.outcome == Outcome::TimedOut)
        .map(|r| r.agent.as_str())
        .collect();
    assert_eq!(
        silent,
        ["fleet-03", "fleet-13", "fleet-23", "fleet-33", "fleet-43"]
    );
    coordinator.shutdown().await;
}

pub(crate) fn fast_policy(attempts: u32) -> RetryPolicies {
    RetryPolicies {
        default: RetryPolicy {
            max_attempts: attempts,
            initial_backoff_ms: 200,
            multiplier: 2.0,
            max_backoff_ms: 10_000,
            jitter: 0.0,
            ..RetryPolicy::default()
        },
        rules: Vec::new(),
    }
}

#[tokio::test]
async fn a_failing_durable_command_is_tried_max_attempts_times_with_backoff_then_dead_lettered_once_and_replays()
 {
    let server = server();
    let coordinator = coordinator(&server, false).await;
    let attempts = Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
    let fixed = Arc::new(AtomicBool::new(false));
    let worker = agent_options(&server, "payments")
        .durable_inbox(true)
        .retry_policies(fast_policy(4))
        .connect()
        .await
        .expect("connect");
    {
        let attempts = Arc::clone(&attempts);
        let fixed = Arc::clone(&fixed);
        worker
            .on_command("charge", move |_ctx: Context, cents: u32| {
                attempts.lock().expect("lock").push(Instant::now());
                let ok = fixed.load(Ordering::SeqCst);
                async move {
                    if ok {
                        Ok(cents)
                    } else {
                        Err(HandlerError::failed("card declined"))
                    }
                }
            })
            .await
            .expect("register");
    }
    let sender = agent(&server, "shop").await;
    let receipt = sender
        .send_durable(
            Call::agent("payments", "charge")
                .command()
                .payload(&4200u32)
                .expect("payload"),
        )
        .await
        .expect("stored");
    let dlq = DeadLetterQueue::new(sender.broker().clone(), sender.subjects().clone());
    let entry = eventually(WAIT, "dead letter", || async {
        dlq.list(10).await.expect("list").into_iter().next()
    })
    .await;
    let times = attempts.lock().expect("lock").clone();
    assert_eq!(times.len(), 4, "tried exactly max_attempts times");
    let gaps: Vec<u128> = times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    println!("attempt gaps (ms): {gaps:?}, expected 200, 400, 800");
    for (gap, expected) in gaps.iter().zip([200u128, 400, 800]) {
        // A lower bound only: a loaded machine makes a gap longer, never shorter.
        assert!(
            *gap >= expected - 5,
            "gap {gap} ms shorter than the backoff {expected} ms"
        );
    }
    let letter = &entry.letter;
    assert_eq!(letter.reason, DeadLetterReason::MaxAttempts);
    assert_eq!(letter.status, StatusCode::HANDLER_FAILED);
    assert_eq!(letter.detail, "card declined");
    assert_eq!(letter.attempts, 4);
    assert_eq!(letter.agent, "payments");
    assert_eq!(letter.message_id, Some(receipt.id));

    // The original is gone from the inbox and from the consumer; no fifth attempt comes.
    let js = sender.broker().jetstream(WAIT);
    let inbox = sender.subjects().stream_name(INBOX_STREAM);
    eventually(WAIT, "inbox empty", || async {
        let state = js.stream_state(&inbox).await.expect("state");
        (state.messages == 0 && chorus_tests::consumer_idle(&js, &inbox, "payments").await)
            .then_some(())
    })
    .await;
    // No message left in the inbox and none pending or awaiting an ack: no fifth attempt can come.
    assert_eq!(attempts.lock().expect("lock").len(), 4);
    assert_eq!(
        dlq.depth().await.expect("depth"),
        1,
        "exactly one dead letter"
    );

    // Replay, with the cause fixed: delivered again and handled.
    fixed.store(true, Ordering::SeqCst);
    let ack = dlq
        .replay(entry.id)
        .await
        .expect("replay")
        .expect("durable replay");
    assert!(!ack.duplicate);
    eventually(WAIT, "replayed command handled", || async {
        (attempts.lock().expect("lock").len() == 5).then_some(())
    })
    .await;
    eventually(WAIT, "replayed command acked", || async {
        let state = js.stream_state(&inbox).await.expect("state");
        (state.messages == 0).then_some(())
    })
    .await;
    assert_eq!(dlq.depth().await.expect("depth"), 0);
    coordinator.shutdown().await;
}

#[tokio::test]
async fn a_poison_command_is_dead_lettered_at_once_not_retried() {
    let server = server();
    let worker = agent_options(&server, "strict")
        .durable_inbox(true)
        .retry_policies(fast_policy(5))
        .connect()
        .await
        .expect("connect");
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    worker
        .on_command("parse", move |_ctx: Context, _n: u32| {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>(HandlerError::invalid_argument("not a valid order")) }
        })
        .await
        .expect("register");
    let sender = agent(&server, "client").await;
    sender
        .send_durable(
            Call::agent("strict", "parse")
                .payload(&1u32)
                .expect("payload"),
        )
        .await
        .expect("stored");
    // Undecodable arguments are poison too.
    sender
        .send_durable(
            Call::agent("strict", "parse")
                .payload("not a number")
                .expect("payload"),
        )
        .await
        .expect("stored");
    let dlq = DeadLetterQueue::new(sender.broker().clone(), sender.subjects().clone());
    let entries = eventually(WAIT, "two dead letters", || async {
        let e = dlq.list(10).await.expect("list");
        (e.len() == 2).then_some(e)
    })
    .await;
    let statuses: Vec<StatusCode> = entries.iter().map(|e| e.letter.status).collect();
    assert_eq!(
        statuses,
        [StatusCode::INVALID_ARGUMENT, StatusCode::DATA_FORMAT]
    );
    assert!(
        entries
            .iter()
            .all(|e| e.letter.reason == DeadLetterReason::Refused && e.letter.attempts == 1)
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the handler ran once; the bad payload never reached it"
    );
}

#[tokio::test]
async fn two_coordinators_write_each_dead_letter_once_and_fan_out_each_broadcast_once() {
    let server = server();
    let c1 = coordinator(&server, false).await;
    let c2 = coordinator(&server, false).await;

    // Broadcast: each of five agents handles it exactly once.
    let counts: Vec<Arc<AtomicUsize>> = (0..5).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    let mut pair = Vec::new();
    for (i, count) in counts.iter().enumerate() {
        let a = agent_options(&server, &format!("pair-{i}"))
            .group("pair")
            .connect()
            .await
            .expect("connect");
        let count = Arc::clone(count);
        a.on_command("tick", move |_ctx: Context, (): ()| {
            count.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, HandlerError>(()) }
        })
        .await
        .expect("register");
        pair.push(a);
    }
    let client = agent(&server, "client").await;
    eventually(WAIT, "pair registered with both", || async {
        let ok = c1
            .discover(&chorus_sdk::DiscoverQuery {
                group: Some("pair".into()),
                ..Default::default()
            })
            .len()
            == 5
            && c2
                .discover(&chorus_sdk::DiscoverQuery {
                    group: Some("pair".into()),
                    ..Default::default()
                })
                .len()
                == 5;
        ok.then_some(())
    })
    .await;
    for _ in 0..4 {
        let report = client
            .broadcast(
                &BroadcastTarget::Group("pair".into()),
                "tick",
                &(),
                Duration::from_secs(2),
            )
            .await
            .expect("report");
        assert_eq!(report.count(Outcome::Delivered), 5);
    }
    // A second fan-out of the same broadcast would be work in flight on the other
    // coordinator; shutting both down waits for all of it (a broadcast in progress still gets
    // its replies), so after this every copy either side sent has been handled.
    assert!(c1.shutdown().await, "c1 finished its work");
    assert!(c2.shutdown().await, "c2 finished its work");
    let ticks: Vec<usize> = counts.iter().map(|c| c.load(Ordering::SeqCst)).collect();
    assert_eq!(
        ticks,
        [4, 4, 4, 4, 4],
        "four broadcasts, each fanned out once"
    );
    let c1 = coordinator(&server, false).await;
    let c2 = coordinator(&server, false).await;

    // Dead letters from advisories: ten messages that reach MaxDeliver.
    let sender = agent(&server, "sender").await;
    let js = sender.broker().jetstream(WAIT);
    js.ensure_stream(&chorus_sdk::durable::inbox_stream(
        sender.subjects(),
        &Default::default(),
    ))
    .await
    .expect("inbox");
    let _crasher = crashing_consumer(&server, "crasher", 2).await;
    let mut ids = Vec::new();
    for n in 0..10u32 {
        let r = sender
            .send_durable(Call::agent("crasher", "work").payload(&n).expect("payload"))
            .await
            .expect("stored");
        ids.push(r.id);
    }
    let dlq = DeadLetterQueue::new(sender.broker().clone(), sender.subjects().clone());
    let entries = eventually(Duration::from_secs(60), "ten dead letters", || async {
        let e = dlq.list(100).await.expect("list");
        (e.len() >= 10).then_some(e)
    })
    .await;
    // A would-be duplicate comes from an advisory processed twice; once the coordinators'
    // shared consumer has every advisory acked and nothing pending, none is left to process.
    let advisories = sender.subjects().stream_name(ADVISORY_STREAM);
    eventually(WAIT, "every advisory processed and acked", || async {
        let c = js.consumer_state(&advisories, DLQ_CONSUMER).await.ok()?;
        (c.pending == 0 && c.ack_pending == 0).then_some(())
    })
    .await;
    let entries_after = dlq.list(100).await.expect("list");
    assert_eq!(entries_after.len(), 10, "no dead letter written twice");
    let mut seen: HashMap<uuid::Uuid, usize> = HashMap::new();
    for e in &entries {
        assert_eq!(e.letter.reason, DeadLetterReason::MaxDeliveries);
        assert_eq!(e.letter.attempts, 2);
        *seen.entry(e.letter.message_id.expect("id")).or_default() += 1;
    }
    for id in &ids {
        assert_eq!(
            seen.get(id),
            Some(&1),
            "message {id} dead-lettered exactly once"
        );
    }
    c1.shutdown().await;
    c2.shutdown().await;
}

#[tokio::test]
async fn metrics_pass_promtool_and_move_with_traffic() {
    let server = server();
    let coordinator = coordinator(&server, true).await;
    let addr = coordinator.metrics_addr().expect("metrics listener");
    assert_eq!(http_get(addr, "/healthz").await.0, 200);
    assert_eq!(http_get(addr, "/readyz").await.0, 200);

    let echo = agent(&server, "metrics-echo").await;
    echo.on_command("echo", |_ctx: Context, s: String| async move {
        Ok::<_, HandlerError>(s)
    })
    .await
    .expect("register");
    let client = agent(&server, "metrics-client").await;
    let _: String = client
        .request("metrics-echo", "echo", "warm-up")
        .await
        .expect("echo");
    // The coordinator's series appear with a broadcast (for promtool to check their format).
    client
        .broadcast(
            &BroadcastTarget::All,
            "echo",
            "hello",
            Duration::from_secs(5),
        )
        .await
        .expect("broadcast");
    let (_, before) = http_get(addr, "/metrics").await;

    for _ in 0..25 {
        let _: String = client
            .request("metrics-echo", "echo", "x")
            .await
            .expect("echo");
    }
    let err = client
        .request::<_, String>("metrics-echo", "nope", "x")
        .await
        .expect_err("nobody handles nope");
    assert_eq!(err.status(), StatusCode::UNKNOWN_COMMAND, "{err}");
    let (status, after) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200);

    let promtool = std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let mut child = std::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("{promtool} not runnable (scripts/install-promtool installs it): {e}")
        });
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(after.as_bytes()).expect("write metrics");
    }
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let ok = [
        r#"agent="metrics-echo""#,
        r#"kind="request""#,
        r#"status="ok""#,
    ];
    let handled_before = metric_sum(&before, "chorus_agent_messages_total", &ok).unwrap_or(0.0);
    let handled_after = metric_sum(&after, "chorus_agent_messages_total", &ok).expect("series");
    assert_eq!(
        handled_after,
        handled_before + 25.0,
        "{handled_before} -> {handled_after}"
    );
    // Every series checked here carries this test's own agents' labels: the registry is shared
    // by every test in this binary. The coordinator's own series (broadcasts, recipients,
    // registry gauges) have no agent label; cli/tests/cli.rs checks them against a
    // `chorus serve` process of its own.
    let unknown = [r#"agent="metrics-echo""#, r#"status="unknown_command""#];
    assert_eq!(
        metric_sum(&before, "chorus_agent_messages_total", &unknown).unwrap_or(0.0),
        0.0
    );
    assert_eq!(
        metric_sum(&after, "chorus_agent_messages_total", &unknown),
        Some(1.0),
        "the one unknown command"
    );
    let lat = [r#"agent="metrics-client""#, r#"status="ok""#];
    let n_before =
        metric_sum(&before, "chorus_agent_request_duration_seconds_count", &lat).unwrap_or(0.0);
    let n_after =
        metric_sum(&after, "chorus_agent_request_duration_seconds_count", &lat).expect("series");
    assert_eq!(n_after, n_before + 25.0, "{n_before} -> {n_after}");
    let received = [r#"agent="metrics-echo""#, r#"direction="received""#];
    let r_before = metric_sum(&before, "chorus_agent_traffic_total", &received).unwrap_or(0.0);
    let r_after = metric_sum(&after, "chorus_agent_traffic_total", &received).expect("series");
    assert_eq!(
        r_after,
        r_before + 26.0,
        "25 requests and an unknown command received"
    );
    assert!(
        metric_sum(
            &after,
            "chorus_agent_connection_events_total",
            &[r#"agent="metrics-client""#]
        )
        .is_some(),
        "the client's connection events are exported"
    );
    coordinator.shutdown().await;
}

/// COORDINATOR.md: a durable command no handler is registered for is not poison at once:
/// another instance of the agent (a newer version in a rolling deploy) may know it, so it is
/// retried like a failure and dead-lettered as `refused` with 5016 when the attempts run out;
/// an instance that learns the command before then handles it.
#[tokio::test]
async fn a_durable_unknown_command_is_retried_then_dead_lettered_and_a_later_handler_takes_it() {
    let server = server();
    // Three attempts, 1.5 s and 3 s apart: time enough to register a handler in between.
    let mut policy = fast_policy(3);
    policy.default.initial_backoff_ms = 1_500;
    let worker = agent_options(&server, "rolling")
        .durable_inbox(true)
        .retry_policies(policy)
        .connect()
        .await
        .expect("connect");
    worker
        .on_command("known", |_ctx: Context, (): ()| async {
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("register");
    let sender = agent(&server, "deployer").await;
    let receipt = sender
        .send_durable(
            Call::agent("rolling", "unheard-of")
                .payload(&1u32)
                .expect("payload"),
        )
        .await
        .expect("stored");
    let dlq = DeadLetterQueue::new(sender.broker().clone(), sender.subjects().clone());
    let entry = eventually(WAIT, "the dead letter", || async {
        dlq.list(10).await.expect("list").into_iter().next()
    })
    .await;
    assert_eq!(entry.letter.reason, DeadLetterReason::Refused);
    assert_eq!(entry.letter.status, StatusCode::UNKNOWN_COMMAND);
    assert_eq!(
        entry.letter.attempts, 3,
        "retried until the policy's attempts ran out"
    );
    assert_eq!(entry.letter.message_id, Some(receipt.id));
    assert_eq!(worker.stats().unknown_command, 3);

    // Learned while its retries are still running: the next attempt is handled.
    let handled = Arc::new(AtomicUsize::new(0));
    let sent = sender
        .send_durable(
            Call::agent("rolling", "late")
                .payload(&2u32)
                .expect("payload"),
        )
        .await
        .expect("stored");
    eventually(WAIT, "the first attempt refused as unknown", || async {
        (worker.stats().unknown_command >= 4).then_some(())
    })
    .await;
    {
        let handled = Arc::clone(&handled);
        worker
            .on_command("late", move |_ctx: Context, n: u32| {
                handled.fetch_add(1, Ordering::SeqCst);
                async move { Ok::<_, HandlerError>(n) }
            })
            .await
            .expect("register");
    }
    eventually(WAIT, "the retried command handled", || async {
        (handled.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    assert_eq!(
        dlq.depth().await.expect("depth"),
        1,
        "only the first is dead"
    );
    assert!(
        dlq.list(10)
            .await
            .expect("list")
            .iter()
            .all(|e| e.letter.message_id != Some(sent.id))
    );
}

/// COORDINATOR.md's broadcast: a recipient that answers with an error is `failed` with its
/// code; one the registry still lists but nobody is subscribed for is `failed` with 5012 and
/// its copy is dead-lettered as `undeliverable`; a capability target reaches only the holders.
#[tokio::test]
async fn broadcast_reports_failures_dead_letters_undeliverable_copies_and_targets_capabilities() {
    let server = server();
    let coordinator = coordinator(&server, false).await;
    let serve = |fails: bool| {
        move |a: chorus_sdk::Agent| async move {
            a.on_command("probe", move |_ctx: Context, (): ()| async move {
                if fails {
                    Err(HandlerError::failed("probe failed"))
                } else {
                    Ok(())
                }
            })
            .await
            .expect("register");
            a.on_capability("probing", |_ctx: Context, (): ()| async {
                Ok::<_, HandlerError>(())
            })
            .await
            .expect("serve");
        }
    };
    let ok = agent_options(&server, "mixed-ok")
        .group("mixed")
        .connect()
        .await
        .expect("connect");
    serve(false)(ok.clone()).await;
    let failing = agent_options(&server, "mixed-fails")
        .group("mixed")
        .connect()
        .await
        .expect("connect");
    serve(true)(failing.clone()).await;
    // Not a holder of the capability, in the group.
    let plain = agent_options(&server, "mixed-plain")
        .group("mixed")
        .connect()
        .await
        .expect("connect");
    plain
        .on_command("probe", |_ctx: Context, (): ()| async {
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("register");
    // A crashed agent with a long heartbeat interval: still listed, nobody listening.
    let mut ghost = CrashableAgent::start(
        agent_options(&server, "mixed-ghost")
            .group("mixed")
            .heartbeat_interval(Duration::from_secs(60)),
        serve(false),
    );
    let client = agent(&server, "prober").await;
    // An agent's first heartbeat, sent as it connects, holds no capability yet: wait for the
    // one that does, or the ghost could crash before the registry hears it offers `probing`.
    eventually(
        WAIT,
        "four agents in the group, three offering probing",
        || async {
            let client = &client;
            let count = move |query: chorus_sdk::DiscoverQuery| async move {
                let found = client.discover(&query).await;
                found.map(|v| v.len()).unwrap_or(0)
            };
            let group = count(chorus_sdk::DiscoverQuery {
                group: Some("mixed".into()),
                ..Default::default()
            });
            let holders = count(chorus_sdk::DiscoverQuery::capability("probing"));
            (group.await == 4 && holders.await == 3).then_some(())
        },
    )
    .await;
    ghost.crash();
    // Until the server has dropped the ghost's subscription, a copy could still reach it.
    let raw = raw_broker(&server).await;
    let ghost_subject = client
        .subjects()
        .command("mixed-ghost", "probe")
        .expect("subject");
    eventually(WAIT, "the ghost's subscription gone", || async {
        let r = raw
            .request(&ghost_subject, None, bytes::Bytes::new(), WAIT)
            .await;
        matches!(r, Err(e) if e.kind() == chorus_broker_adapter::ErrorKind::NoResponders)
            .then_some(())
    })
    .await;

    let report = client
        .broadcast(
            &BroadcastTarget::Group("mixed".into()),
            "probe",
            &(),
            Duration::from_secs(5),
        )
        .await
        .expect("report");
    let line = |id: &str| {
        report
            .recipients
            .iter()
            .find(|r| r.agent == id)
            .unwrap_or_else(|| panic!("{id} not in the report: {report:?}"))
            .clone()
    };
    assert_eq!(report.recipients.len(), 4, "{report:?}");
    assert_eq!(line("mixed-ok").outcome, Outcome::Delivered);
    assert_eq!(line("mixed-plain").outcome, Outcome::Delivered);
    let failed = line("mixed-fails");
    assert_eq!(
        (failed.outcome, failed.status),
        (Outcome::Failed, StatusCode::HANDLER_FAILED)
    );
    assert_eq!(failed.reason.as_deref(), Some("probe failed"));
    let gone = line("mixed-ghost");
    assert_eq!(
        (gone.outcome, gone.status),
        (Outcome::Failed, StatusCode::NO_RESPONDERS)
    );
    let dlq = DeadLetterQueue::new(client.broker().clone(), client.subjects().clone());
    let letters = dlq.list(10).await.expect("list");
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].letter.reason, DeadLetterReason::Undeliverable);
    assert_eq!(letters[0].letter.agent, "mixed-ghost");
    assert_eq!(letters[0].letter.status, StatusCode::NO_RESPONDERS);

    // A capability target: only the live holders of `probing`, not the plain agent.
    let report = client
        .broadcast(
            &BroadcastTarget::Capability("probing".into()),
            "probe",
            &(),
            Duration::from_secs(5),
        )
        .await
        .expect("report");
    let mut reached: Vec<&str> = report.recipients.iter().map(|r| r.agent.as_str()).collect();
    reached.sort_unstable();
    assert_eq!(
        reached,
        ["mixed-fails", "mixed-ghost", "mixed-ok"],
        "{report:?}"
    );
    assert_eq!(report.count(Outcome::Delivered), 1);
    coordinator.shutdown().await;
}

/// COORDINATOR.md: "A coordinator killed mid-work leaves its advisories to be redelivered to
/// another within 5 s", and an advisory is acked only after its dead letter is stored, whose
/// message id makes a repeated write a no-op. A stand-in for the killed coordinator takes two
/// advisories from the shared consumer: it dies holding the first, and after writing the
/// dead letter of the second but before acking it. A real coordinator then gets both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_coordinators_advisories_come_back_to_another_and_each_dead_letter_is_written_once()
 {
    use chorus_sdk::durable::{DeadLetter, advisory_stream, write_dead_letter};
    let server = server();
    let sender = agent(&server, "sender").await;
    let subjects = sender.subjects().clone();
    let js = sender.broker().jetstream(WAIT);
    let advisories = subjects.stream_name(ADVISORY_STREAM);
    let inbox = subjects.stream_name(INBOX_STREAM);
    js.ensure_stream(&advisory_stream(&subjects, 1))
        .await
        .expect("advisory stream");
    js.ensure_stream(&chorus_sdk::durable::dlq_stream(&subjects, 1))
        .await
        .expect("dlq stream");
    // The coordinators' shared consumer, as they make it.
    let mut spec = chorus_broker_adapter::ConsumerSpec::new(DLQ_CONSUMER);
    spec.ack_wait = Duration::from_secs(5);
    spec.max_ack_pending = 64;
    spec.description = "Chorus coordinators: advisories to dead letters".into();
    let standin = raw_broker(&server).await;
    let standin_js = standin.jetstream(WAIT);
    let consumer = standin_js
        .ensure_consumer(&advisories, &spec)
        .await
        .expect("dlq consumer");
    let mut deliveries = consumer.messages(64).await.expect("messages");

    let _crasher = crashing_consumer(&server, "crasher", 2).await;
    let mut ids = Vec::new();
    for n in 0..2u32 {
        ids.push(
            sender
                .send_durable(Call::agent("crasher", "work").payload(&n).expect("payload"))
                .await
                .expect("stored")
                .id,
        );
    }
    let held = within(WAIT, "the stand-in takes both advisories", async {
        let mut held = Vec::new();
        while held.len() < 2 {
            match deliveries.next().await {
                Some(Ok(d)) => held.push(d),
                Some(Err(e)) => panic!("advisory pull: {e}"),
                None => panic!("advisory stream ended"),
            }
        }
        held
    })
    .await;
    let taken_at = Instant::now();
    // The second: its dead letter written as the coordinator writes it, then no ack.
    let advisory: serde_json::Value = serde_json::from_slice(held[1].payload()).expect("json");
    let seq = advisory["stream_seq"].as_u64().expect("stream_seq");
    let original = js.get_message(&inbox, seq).await.expect("original");
    let letter = DeadLetter {
        reason: DeadLetterReason::MaxDeliveries,
        status: StatusCode::TIMEOUT,
        detail: "written by the coordinator that was killed".into(),
        agent: "crasher".into(),
        subject: original.subject.clone(),
        envelope: original.payload.clone(),
        headers: Vec::new(),
        message_id: chorus_sdk::codec::decode(&original.payload)
            .ok()
            .map(|(e, _)| e.id),
        attempts: 2,
        stored_ms: original.stored_ms,
        dead_lettered_ms: chorus_sdk::envelope::now_ms(),
        source: Some((inbox.clone(), seq)),
        omitted: None,
    };
    write_dead_letter(&js, &subjects, &letter, sender.broker().max_payload())
        .await
        .expect("first write");
    // Killed: its deliveries and its connection gone, nothing acked.
    drop(held);
    drop(deliveries);
    drop(standin);

    let dlq = DeadLetterQueue::new(sender.broker().clone(), sender.subjects().clone());
    assert_eq!(dlq.depth().await.expect("depth"), 1);
    let other = coordinator(&server, false).await;
    let entries = eventually(
        Duration::from_secs(5) + WAIT,
        "both dead letters from the other coordinator",
        || async {
            let e = dlq.list(10).await.expect("list");
            (e.len() >= 2).then_some(e)
        },
    )
    .await;
    let came_back_after = taken_at.elapsed();
    eventually(WAIT, "every advisory processed and acked", || async {
        let c = js.consumer_state(&advisories, DLQ_CONSUMER).await.ok()?;
        (c.pending == 0 && c.ack_pending == 0).then_some(())
    })
    .await;
    println!(
        "advisories held by the killed coordinator came back to another after {came_back_after:?} (ack wait 5 s)"
    );
    // An ordering: the other could take them only once the ack wait ran out.
    assert!(
        came_back_after >= Duration::from_millis(4_900),
        "redelivered before the ack wait: {came_back_after:?}"
    );
    let entries_after = dlq.list(10).await.expect("list");
    assert_eq!(entries_after.len(), 2, "no dead letter written twice");
    let mut got: Vec<uuid::Uuid> = entries
        .iter()
        .map(|e| e.letter.message_id.expect("id"))
        .collect();
    got.sort();
    ids.sort();
    assert_eq!(got, ids);
    assert_eq!(
        js.stream_state(&inbox).await.expect("inbox").messages,
        0,
        "both originals removed from the inbox"
    );
    other.shutdown().await;
}

/// Issue 32, item 10: every event the coordinator publishes carries `seq` (PROTOCOL.md section
/// 7.9), numbered from 1 on each subject under one epoch: the registry's `joined` and `left`
/// and its protocol-level announcements on `sys.wire`.
#[tokio::test]
async fn every_event_the_coordinator_publishes_is_numbered() {
    let server = server();
    let raw = raw_broker(&server).await;
    let mut all = raw.subscribe("chorus.>").await.expect("subscribe");
    raw.flush().await.expect("flush");
    let coordinator = coordinator(&server, false).await;
    let subjects = chorus_sdk::Subjects::new("chorus").expect("root");
    // Two agents come and go: two joins, two departures, and the level announced.
    for id in ["numbered-a", "numbered-b"] {
        let a = agent(&server, id).await;
        eventually(WAIT, "listed", || async {
            coordinator
                .discover(&chorus_sdk::DiscoverQuery::default())
                .iter()
                .any(|r| r.manifest.agent == id)
                .then_some(())
        })
        .await;
        a.shutdown().await;
    }
    let mut by_subject: HashMap<String, Vec<chorus_sdk::envelope::Sequence>> = HashMap::new();
    let wanted = |m: &HashMap<String, Vec<_>>| {
        m.get("chorus.evt.registry.joined").map_or(0, Vec::len) >= 2
            && m.get("chorus.evt.registry.left").map_or(0, Vec::len) >= 2
            && m.get("chorus.sys.wire").map_or(0, Vec::len) >= 1
    };
    let deadline = Instant::now() + WAIT;
    while !wanted(&by_subject) {
        let left = deadline
            .checked_duration_since(Instant::now())
            .unwrap_or_else(|| panic!("coordinator events seen: {by_subject:?}"));
        let Ok(Some(msg)) = tokio::time::timeout(left, all.next()).await else {
            panic!("coordinator events seen: {by_subject:?}");
        };
        let implied = subjects.implied(msg.subject());
        let Ok((env, _)) = chorus_sdk::codec::decode_on(msg.payload(), &implied) else {
            continue;
        };
        if env.from == "coordinator" && env.kind == chorus_sdk::Kind::Event {
            let seq = env
                .seq
                .unwrap_or_else(|| panic!("an unnumbered event on {}", msg.subject()));
            by_subject
                .entry(msg.subject().to_owned())
                .or_default()
                .push(seq);
        }
    }
    for (subject, seqs) in &by_subject {
        let numbers: Vec<u64> = seqs.iter().map(|s| s.n).collect();
        let expected: Vec<u64> = (1..=seqs.len() as u64).collect();
        assert_eq!(numbers, expected, "{subject}");
        assert!(
            seqs.iter().all(|s| s.epoch == seqs[0].epoch),
            "{subject}: {seqs:?}"
        );
    }
    coordinator.shutdown().await;
}

/// The heartbeat interval a heartbeat announces, and when it arrived.
async fn next_beat(beats: &mut chorus_broker_adapter::Subscription) -> (u64, Instant) {
    let msg = within(WAIT, "a heartbeat", beats.next())
        .await
        .expect("heartbeats");
    let (env, _) = chorus_sdk::codec::decode(msg.payload()).expect("an envelope");
    let manifest: chorus_sdk::registry::Manifest =
        chorus_sdk::codec::decode_payload(&env.payload, &env.content_type).expect("a manifest");
    (manifest.heartbeat_ms, Instant::now())
}

/// In a large fleet the coordinator paces heartbeats (docs/COORDINATOR.md): its announcement
/// on `sys.wire` carries a floor of a second per `max_heartbeats_per_second` live agents,
/// agents beat no more often than that whatever their own interval, and each beat announces
/// the interval it keeps, so the registry counts them live through the longer silences.
#[tokio::test]
async fn the_coordinator_paces_heartbeats_and_paced_agents_stay_live() {
    let server = server();
    // One heartbeat a second for the whole fleet: two agents live, a floor of 2 s.
    let config = chorus_coordinator::CoordinatorConfig {
        max_heartbeats_per_second: 1,
        ..chorus_tests::coordinator_config(&server)
    };
    let coordinator = chorus_tests::start_coordinator(config, false).await;
    let raw = raw_broker(&server).await;
    let mut beats = raw
        .subscribe("chorus.sys.hb.paced")
        .await
        .expect("subscribe");
    raw.sync(WAIT).await.expect("sync");
    // Both agents beat every 300 ms of their own accord.
    let beating = |id: &str| {
        within(
            WAIT,
            "connect",
            agent_options(&server, id)
                .heartbeat_interval(HEARTBEAT)
                .connect(),
        )
    };
    let paced = beating("paced").await.expect("paced");
    paced
        .on_capability("pacing", |_ctx: Context, (): ()| async move {
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("serve");
    let client = beating("client").await.expect("client");

    // Its beats come every 300 ms until it hears the floor.
    let deadline = Instant::now() + WAIT;
    let (mut every, mut at) = next_beat(&mut beats).await;
    while every != 2_000 {
        assert!(
            Instant::now() < deadline,
            "no heartbeat announced the 2 s floor; the last said {every} ms"
        );
        (every, at) = next_beat(&mut beats).await;
    }
    assert_eq!(paced.manifest().heartbeat_ms, 2_000);
    // Then every 2 s, and the registry finds it all along: three of its own 300 ms intervals
    // would have declared it gone long before.
    for _ in 0..2 {
        let mut looked = 0;
        let next = loop {
            tokio::select! {
                beat = next_beat(&mut beats) => break beat,
                () = tokio::time::sleep(Duration::from_millis(200)) => {
                    let found = ids_for(&client, "pacing").await;
                    assert_eq!(found, ["paced"], "a paced agent dropped out of discovery");
                    looked += 1;
                }
            }
        };
        let gap = next.1 - at;
        assert!(
            gap >= Duration::from_millis(1_900),
            "a paced agent beat after {gap:?}, within its 2 s floor"
        );
        assert!(
            looked >= 5,
            "discovery asked only {looked} times in {gap:?}"
        );
        assert_eq!(next.0, 2_000);
        at = next.1;
    }
    let record = client
        .discover_capability("pacing")
        .await
        .expect("discovery")
        .remove(0);
    assert_eq!(record.manifest.heartbeat_ms, 2_000);

    // A newcomer is told the floor at its first heartbeat, in a notification of its own, and
    // not left to beat every 300 ms until the next announcement (100 s away at 100,000
    // agents); its next heartbeat keeps it.
    let mut told = raw
        .subscribe("chorus.agent.newcomer.$notify")
        .await
        .expect("subscribe");
    let mut newcomer_beats = raw
        .subscribe("chorus.sys.hb.newcomer")
        .await
        .expect("subscribe");
    raw.sync(WAIT).await.expect("sync");
    let newcomer = beating("newcomer").await.expect("newcomer");
    // Its command subscription carries notifications.
    newcomer
        .on_command("ping", |_ctx: Context, (): ()| async move {
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("serve");
    let msg = within(WAIT, "the floor told", told.next())
        .await
        .expect("notifications");
    let (env, _) = chorus_sdk::codec::decode(msg.payload()).expect("an envelope");
    assert_eq!(
        (env.from.as_str(), env.name.as_deref()),
        ("coordinator", Some(chorus_sdk::registry::WIRE_NOTIFICATION))
    );
    let level: chorus_sdk::registry::WireLevel =
        chorus_sdk::codec::decode_payload(&env.payload, &env.content_type).expect("a level");
    assert_eq!(level.heartbeat_ms, Some(2_000), "{level:?}");
    let (first, _) = next_beat(&mut newcomer_beats).await;
    assert_eq!(first, 300, "the first heartbeat, sent as it connects");
    let mut later = Vec::new();
    while later.last().is_none_or(|&every| every < 2_000) {
        assert!(later.len() < 4, "the newcomer kept beating fast: {later:?}");
        later.push(next_beat(&mut newcomer_beats).await.0);
    }
    assert!(newcomer.manifest().heartbeat_ms >= 2_000);
    coordinator.shutdown().await;
}
