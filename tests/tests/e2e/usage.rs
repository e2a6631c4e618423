//! Usage accounting (issue 36): what an agent handled is counted per customer and session in its
//! pipeline, reported to the usage stream, and summed by the coordinator for `chorus usage`,
//! exactly, and the same after the coordinator restarts.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use chorus_sdk::usage::UsageSummary;
use chorus_sdk::{Call, Context, HandlerError};
use chorus_tests::{
    agent, agent_options, chorus_binary, coordinator, eventually, http_get, metric_sum, server,
    within,
};

/// (customer, session, requests, of which failing).
const TRAFFIC: [(&str, &str, u64, u64); 3] = [
    ("acme", "s1", 7, 0),
    ("acme", "s2", 3, 1),
    ("globex", "s3", 4, 0),
];
const COMMANDS: u64 = 5;
const EVENTS: u64 = 2;

fn usage(server: &chorus_nats_server::NatsServer, by: &str) -> UsageSummary {
    let out = Command::new(chorus_binary())
        .args(["usage", "--by", by, "--since", "10m", "--json"])
        .env("CHORUS_NATS_URL", server.url())
        .env("CHORUS_CONFIG_DIR", std::env::temp_dir())
        .env_remove("CHORUS_CONTEXT")
        .output()
        .expect("chorus usage runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("a summary")
}

fn lines(summary: &UsageSummary, keys: &[&str]) -> BTreeMap<Vec<String>, (u64, u64)> {
    summary
        .lines
        .iter()
        .map(|l| {
            (
                keys.iter().map(|k| l.group[*k].clone()).collect(),
                (l.handled, l.failed),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_counted_per_customer_and_session_exactly_and_survives_a_coordinator_restart() {
    let server = server();
    let first = coordinator(&server, true).await;
    let calc = agent_options(&server, "usage-calc")
        .usage_interval(Duration::from_millis(200))
        .connect()
        .await
        .expect("agent");
    calc.on_command("add", |_ctx: Context, (a, b): (i64, i64)| async move {
        if a < 0 {
            return Err(HandlerError::invalid_argument("negative"));
        }
        Ok::<_, HandlerError>(a + b)
    })
    .await
    .expect("add");
    calc.on_command("note", |_ctx: Context, _: String| async move {
        Ok::<_, HandlerError>(())
    })
    .await
    .expect("note");
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    calc.on_event("usage.ping", move |_ctx: Context, _: String| {
        let _ = seen_tx.send(());
        async { Ok(()) }
    })
    .await
    .expect("events");

    let caller = agent(&server, "usage-caller").await;
    for (customer, session, requests, failing) in TRAFFIC {
        for i in 0..requests {
            let a = if i < failing { -1 } else { 1 };
            let call = Call::agent("usage-calc", "add")
                .payload(&(a, 2))
                .expect("payload")
                .customer(customer)
                .session(session);
            let _ = caller.call(call).await;
        }
    }
    for _ in 0..COMMANDS {
        let call = Call::agent("usage-calc", "note")
            .payload(&"hello")
            .expect("payload")
            .command()
            .customer("acme")
            .session("s1");
        caller.send(call).await.expect("sent");
    }
    for _ in 0..EVENTS {
        caller
            .publish("usage.ping", &"ping")
            .await
            .expect("published");
    }
    within(Duration::from_secs(10), "events handled", async {
        for _ in 0..EVENTS {
            seen_rx.recv().await;
        }
    })
    .await;
    // The commands are handled too before the agent stops: it reports the rest at shutdown.
    eventually(Duration::from_secs(10), "commands handled", || async {
        let stats = calc.stats();
        (stats.handled_ok + stats.handler_errors >= 7 + 3 + 4 + COMMANDS + EVENTS).then_some(())
    })
    .await;
    calc.shutdown().await;
    caller.shutdown().await;

    // The coordinator counts the reports it sees stored into its metrics.
    let metrics = first.metrics_addr().expect("metrics listener");
    let scraped = |labels: &'static [&'static str]| async move {
        let (_, text) = http_get(metrics, "/metrics").await;
        metric_sum(&text, "chorus_usage_messages_total", labels)
    };
    eventually(Duration::from_secs(10), "usage metrics", || async {
        let got = scraped(&[
            "agent=\"usage-calc\"",
            "customer=\"acme\"",
            "kind=\"request\"",
            "outcome=\"ok\"",
        ])
        .await;
        (got == Some(9.0)).then_some(())
    })
    .await;
    assert_eq!(
        scraped(&[
            "agent=\"usage-calc\"",
            "customer=\"acme\"",
            "kind=\"request\"",
            "outcome=\"failed\""
        ])
        .await,
        Some(1.0)
    );
    assert_eq!(
        scraped(&[
            "agent=\"usage-calc\"",
            "customer=\"globex\"",
            "outcome=\"ok\""
        ])
        .await,
        Some(4.0)
    );

    // The coordinator restarts: the counts come from the stream, not its memory.
    first.shutdown().await;
    let _second = coordinator(&server, false).await;

    let by_session = usage(&server, "customer,session");
    let got = lines(&by_session, &["customer", "session"]);
    let key = |c: &str, s: &str| vec![c.to_owned(), s.to_owned()];
    assert_eq!(got[&key("acme", "s1")], (7 + COMMANDS, 0), "{got:?}");
    assert_eq!(got[&key("acme", "s2")], (3, 1), "{got:?}");
    assert_eq!(got[&key("globex", "s3")], (4, 0), "{got:?}");
    assert_eq!(
        got[&key("", "")],
        (EVENTS, 0),
        "events carry no customer: {got:?}"
    );
    assert_eq!(got.len(), 4, "{got:?}");

    let by_customer = usage(&server, "customer,kind");
    let got = lines(&by_customer, &["customer", "kind"]);
    let key = |c: &str, k: &str| vec![c.to_owned(), k.to_owned()];
    assert_eq!(got[&key("acme", "request")], (10, 1));
    assert_eq!(got[&key("acme", "command")], (COMMANDS, 0));
    assert_eq!(got[&key("globex", "request")], (4, 0));
    assert_eq!(got[&key("", "event")], (EVENTS, 0));
    let bytes: u64 = by_customer.lines.iter().map(|l| l.bytes_in).sum();
    assert!(bytes > 0, "payload bytes are counted");
}

/// Agentify's usage tracking counts the time spent per action (`duration`): a request's
/// handler run, and a task's run from its acceptance to its end, summed per customer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_counts_the_time_spent_handling_each_customers_work() {
    let server = server();
    let _coordinator = coordinator(&server, false).await;
    let worker = agent_options(&server, "usage-timer")
        .usage_interval(Duration::from_millis(200))
        .connect()
        .await
        .expect("agent");
    worker
        .on_command("slow", |_ctx: Context, (): ()| async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("slow");
    worker
        .on_task(
            "brew",
            |_task: chorus_sdk::TaskContext, (): ()| async move {
                tokio::time::sleep(Duration::from_millis(80)).await;
                Ok::<_, HandlerError>("brewed")
            },
        )
        .await
        .expect("brew");
    let caller = agent(&server, "usage-timer-caller").await;
    for _ in 0..3 {
        let call = Call::agent("usage-timer", "slow")
            .payload(&())
            .expect("payload")
            .customer("initech");
        caller.call(call).await.expect("answered");
    }
    let task = caller
        .submit(
            Call::agent("usage-timer", "brew")
                .payload(&())
                .expect("payload")
                .customer("initech"),
        )
        .await
        .expect("submitted");
    within(Duration::from_secs(10), "the task", task.result())
        .await
        .expect("a result");
    // Shutdown reports what is left.
    worker.shutdown().await;
    let summary = usage(&server, "customer,kind");
    let line = |kind: &str| {
        summary
            .lines
            .iter()
            .find(|l| l.group["customer"] == "initech" && l.group["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind} line: {summary:?}"))
            .clone()
    };
    let requests = line("request");
    let tasks = line("task");
    println!(
        "handling time: 3 requests {} µs, 1 task {} µs",
        requests.handling_us, tasks.handling_us
    );
    assert_eq!((requests.handled, tasks.handled), (3, 1));
    // At least the handlers' sleeps; an upper bound only against a unit mix-up (ms for µs).
    assert!(
        (150_000..30_000_000).contains(&requests.handling_us),
        "{requests:?}"
    );
    assert!(
        (80_000..10_000_000).contains(&tasks.handling_us),
        "{tasks:?}"
    );
}
