//! `chorus serve` killed with SIGKILL while messages are failing, then started again: every
//! message that exhausted its deliveries is in the dead-letter queue exactly once.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chorus_coordinator::service::dlq::DeadLetterQueue;
use chorus_sdk::Call;
use chorus_sdk::durable::{ADVISORY_STREAM, DeadLetterReason};
use chorus_tests::{WAIT, agent, crashing_consumer, eventually, server};

/// Starts `chorus serve` and waits (with a deadline) for the line saying it runs.
fn serve(url: &str) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args(["--server", url, "serve"])
        .env("CHORUS_SERVE__METRICS_ADDR", "127.0.0.1:0")
        .env("CHORUS_SERVE__REAP_INTERVAL_MS", "50")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run chorus serve");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("chorus serve: coordinator") {
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(WAIT).is_err() {
        let _ = child.kill();
        panic!("chorus serve did not start within {WAIT:?}");
    }
    child
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_mid_failure_loses_no_dead_letter_and_writes_none_twice() {
    let server = server();
    let mut coordinator = serve(server.url());
    let sender = agent(&server, "sender").await;
    let _crasher = crashing_consumer(&server, "crasher", 2).await;
    let dlq = DeadLetterQueue::new(sender.broker().clone(), sender.subjects().clone());
    let js = sender.broker().jetstream(WAIT);
    let advisories = sender.subjects().stream_name(ADVISORY_STREAM);

    let mut ids = Vec::new();
    let send = |n: u32| {
        let sender = sender.clone();
        async move {
            sender
                .send_durable(Call::agent("crasher", "work").payload(&n).expect("payload"))
                .await
                .expect("stored")
                .id
        }
    };
    for n in 0..10 {
        ids.push(send(n).await);
    }
    // Kill it as soon as it has started writing dead letters.
    eventually(WAIT, "first dead letter", || async {
        (dlq.depth().await.expect("depth") >= 1).then_some(())
    })
    .await;
    coordinator.kill().expect("SIGKILL");
    coordinator.wait().expect("reaped");
    let at_kill = dlq.depth().await.expect("depth");

    // More failures while no coordinator runs: their advisories wait in the stream.
    for n in 10..30 {
        ids.push(send(n).await);
    }
    eventually(
        Duration::from_secs(60),
        "all 30 advisories captured",
        || async {
            let state = js.stream_state(&advisories).await.expect("advisories");
            (state.messages >= 30).then_some(())
        },
    )
    .await;
    let while_down = dlq.depth().await.expect("depth");
    assert_eq!(
        while_down, at_kill,
        "nothing is dead-lettered while the coordinator is down"
    );

    let mut coordinator = serve(server.url());
    let entries = eventually(Duration::from_secs(60), "30 dead letters", || async {
        let e = dlq.list(1_000).await.expect("list");
        (e.len() >= 30).then_some(e)
    })
    .await;
    // A second write would come from an advisory processed again; once the shared consumer
    // has every advisory acked and nothing pending, none is left to process.
    eventually(WAIT, "every advisory processed and acked", || async {
        let c = js
            .consumer_state(&advisories, chorus_coordinator::service::DLQ_CONSUMER)
            .await
            .ok()?;
        (c.pending == 0 && c.ack_pending == 0).then_some(())
    })
    .await;
    assert_eq!(
        dlq.depth().await.expect("depth"),
        30,
        "no dead letter written twice"
    );
    let mut seen: HashMap<uuid::Uuid, usize> = HashMap::new();
    for e in &entries {
        assert_eq!(e.letter.reason, DeadLetterReason::MaxDeliveries);
        *seen.entry(e.letter.message_id.expect("id")).or_default() += 1;
    }
    for id in &ids {
        assert_eq!(
            seen.get(id),
            Some(&1),
            "message {id} in the DLQ exactly once"
        );
    }
    println!(
        "dead letters: {at_kill} before the SIGKILL, {while_down} while down, 30 after restart; 30 distinct"
    );
    let _ = coordinator.kill();
    let _ = coordinator.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_in_flight_broadcast_finish_then_exits_cleanly() {
    use chorus_sdk::{BroadcastTarget, Context, HandlerError, Outcome};
    let server = server();
    let mut coordinator = serve(server.url());
    let slow = chorus_tests::agent_options(&server, "slowpoke")
        .group("slow")
        .connect()
        .await
        .expect("connect");
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel();
    slow.on_command("work", move |_ctx: Context, (): ()| {
        let started_tx = started_tx.clone();
        async move {
            let _ = started_tx.send(());
            tokio::time::sleep(Duration::from_millis(800)).await;
            Ok::<_, HandlerError>(())
        }
    })
    .await
    .expect("register");
    let client = agent(&server, "client").await;
    eventually(WAIT, "slowpoke registered", || async {
        let found = client
            .discover(&chorus_sdk::DiscoverQuery {
                group: Some("slow".into()),
                ..Default::default()
            })
            .await
            .map(|v| v.len())
            .unwrap_or(0);
        (found == 1).then_some(())
    })
    .await;
    let pending = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .broadcast(
                    &BroadcastTarget::Group("slow".into()),
                    "work",
                    &(),
                    Duration::from_secs(5),
                )
                .await
        }
    });
    chorus_tests::within(WAIT, "fan-out reached the agent", started_rx.recv())
        .await
        .expect("started");
    let status = Command::new("kill")
        .args(["-TERM", &coordinator.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(status.success());
    let report = chorus_tests::within(WAIT, "report of the in-flight broadcast", pending)
        .await
        .expect("task")
        .expect("the broadcast in flight at SIGTERM still gets its report");
    assert_eq!(report.count(Outcome::Delivered), 1);
    let exit = eventually(WAIT, "chorus serve exits", || {
        let done = coordinator.try_wait().expect("wait");
        async move { done }
    })
    .await;
    assert!(exit.success(), "chorus serve exited with {exit}");
}
