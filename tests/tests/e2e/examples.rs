//! The SDK's examples (`agent-sdk/examples/`), run as a user runs them against a bus: each
//! does what its doc comment says. (`cargo test --workspace --all-targets` builds them.)

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use chorus_sdk::{Call, DeliveryClass};
use chorus_tests::{WAIT, agent, server, within};

/// An example's binary, beside this test's own in the target directory.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir")
        .join("examples");
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is not built: `cargo build -p chorus-sdk --examples` (scripts/test builds it)",
        path.display()
    );
    path
}

fn start(name: &str, url: &str, args: &[&str]) -> Child {
    Command::new(example(name))
        .args(args)
        .env("CHORUS_NATS_URL", url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run example {name}: {e}"))
}

/// Waits (up to 60 s) for `child` to exit.
fn finish(mut child: Child) -> Output {
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("example did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[tokio::test]
async fn request_reply_prints_a_sum_and_a_coded_refusal() {
    let server = server();
    let out = tokio::task::spawn_blocking({
        let url = server.url().to_owned();
        move || finish(start("request_reply", &url, &[]))
    })
    .await
    .expect("join");
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("2 + 3 = 5"), "{text}");
    assert!(
        text.contains("refused with 5018 invalid_argument"),
        "{text}"
    );
}

#[tokio::test]
async fn calculator_answers_until_it_is_stopped() {
    let server = server();
    let child = start("calculator", server.url(), &[]);
    let client = agent(&server, "orchestrator").await;
    let sum: f64 = within(WAIT, "the calculator up", async {
        loop {
            let call = Call::agent("calculator", "calculation")
                .payload(&serde_json::json!({"operation": "add", "operands": [2.0, 3.0]}))
                .expect("payload");
            if let Ok(reply) = client.call(call).await {
                break reply.payload_as::<f64>().expect("a number");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(sum, 5.0);
    let refused = client
        .request::<_, f64>(
            "calculator",
            "calculation",
            &serde_json::json!({"operation": "divide", "operands": [1.0, 0.0]}),
        )
        .await
        .expect_err("division by zero");
    assert_eq!(refused.status(), chorus_sdk::StatusCode::INVALID_ARGUMENT);
    let stopped = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(stopped.success());
    let out = tokio::task::spawn_blocking(move || finish(child))
        .await
        .expect("join");
    assert!(out.status.success(), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("calculator: stopped"),
        "{}",
        stdout(&out)
    );
}

#[tokio::test]
async fn event_listener_prints_the_events_it_was_sent() {
    let server = server();
    let child = start("event_listener", server.url(), &["2"]);
    let publisher = agent(&server, "publisher").await;
    // Published until the listener has them both (it may not be subscribed yet at first).
    let out = within(WAIT, "the listener done", async {
        let mut child = Some(child);
        loop {
            publisher
                .publish("task.completed", &"first")
                .await
                .expect("publish");
            publisher
                .publish("task.completed", &"second")
                .await
                .expect("publish");
            tokio::time::sleep(Duration::from_millis(100)).await;
            if let Some(c) = child.as_mut()
                && c.try_wait().expect("wait").is_some()
            {
                break child
                    .take()
                    .expect("child")
                    .wait_with_output()
                    .expect("output");
            }
        }
    })
    .await;
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("task.completed from publisher: \"first\""),
        "{text}"
    );
    assert!(text.contains("2 event(s)"), "{text}");
}

#[tokio::test]
async fn durable_worker_takes_what_was_sent_while_it_was_offline() {
    let server = server();
    let sender = agent(&server, "shop").await;
    // Stored before the worker has ever run.
    for (account, amount) in [("acme", 250), ("globex", 40)] {
        sender
            .send(
                Call::agent("ledger-worker", "post")
                    .delivery(DeliveryClass::AtLeastOnce)
                    .payload(&serde_json::json!({"account": account, "amount": amount}))
                    .expect("payload"),
            )
            .await
            .expect("stored");
    }
    let out = tokio::task::spawn_blocking({
        let url = server.url().to_owned();
        move || finish(start("durable_worker", &url, &["2"]))
    })
    .await
    .expect("join");
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("posted 250 to acme (attempt 1)"), "{text}");
    assert!(text.contains("posted 40 to globex"), "{text}");
    assert!(text.contains("stopped after 2 posting(s)"), "{text}");
}

#[tokio::test]
async fn long_task_streams_a_draft_and_cancels_a_second() {
    let server = server();
    let out = tokio::task::spawn_blocking({
        let url = server.url().to_owned();
        move || finish(start("long_task", &url, &[]))
    })
    .await
    .expect("join");
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    for line in [
        "long_task: state submitted",
        "long_task: state accepted",
        "long_task: state working",
        "long_task: progress 100%",
        "long_task: chunk 1: a",
        "long_task: chunk 7: slowly",
        "long_task: state completed",
        "long_task: completed by writer: \"a short text about tasks, written slowly\"",
        "long_task: the second draft is cancelled (5020 cancelled)",
    ] {
        assert!(text.contains(line), "{line:?} in {text}");
    }
}
