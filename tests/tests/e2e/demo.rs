//! The demo `chorus up` runs, against a test server: every scenario does what it shows.

use chorus_demo::{Demo, LEDGER_ATTEMPTS};
use chorus_sdk::Outcome;
use chorus_sdk::StatusCode;
use chorus_sdk::durable::DeadLetterReason;
use chorus_tests::{WAIT, coordinator, server, within};

#[tokio::test]
async fn the_demo_scenarios_run_end_to_end() {
    let server = server();
    let coordinator = coordinator(&server, false).await;
    let quiet: fn(&str) = |_| {};
    let demo = within(WAIT, "demo start", Demo::start(server.url(), quiet))
        .await
        .expect("demo agents start");
    let report = within(WAIT, "demo run", demo.run(quiet))
        .await
        .expect("scenarios run");

    // AIXP: OCR hands the text to NLP, which analyses it.
    assert_eq!(report.ocr.analysed_by, "nlp-agent");
    assert_eq!(report.ocr.analysis.word_count, 18);
    assert_eq!(report.ocr.analysis.most_common_word, "the");
    assert_eq!(report.ocr.analysis.sentiment, "positive");
    // Agentify: results, and the division by zero refused with its code.
    let results: Vec<_> = report.calculations.iter().map(|(_, r)| *r).collect();
    assert_eq!(
        results,
        vec![Ok(10.0), Ok(42.0), Err(StatusCode::INVALID_ARGUMENT)]
    );
    // Fan-out: every watcher got the event.
    let mut receivers = report.event_receivers.clone();
    receivers.sort();
    assert_eq!(receivers, ["audit", "dashboard", "notifier"]);
    // The relay loop was cut.
    assert_eq!(report.loop_status, StatusCode::LOOP_DETECTED);

    // The coordinator's part: discovery, a broadcast report, a poison message dead-lettered
    // after its retries.
    assert_eq!(report.discovered, ["ocr-agent"]);
    assert_eq!(report.broadcast.count(Outcome::Delivered), 3);
    let letter = report
        .dead_letter
        .expect("the poison posting is dead-lettered");
    assert_eq!(letter.reason, DeadLetterReason::MaxAttempts);
    assert_eq!(letter.attempts, u64::from(LEDGER_ATTEMPTS));
    assert_eq!(letter.agent, "ledger");

    // Tasks: the streamed draft arrives whole and in order, the long task is cancelled while
    // it reports progress, and the sloppy summary is reassigned to the careful summarizer.
    let tasks = &report.tasks;
    assert_eq!(
        tasks.streamed.join(" "),
        "agents on the wire / each token finds its listener / the stream never gaps"
    );
    assert_eq!(tasks.cancelled, chorus_sdk::TaskState::Cancelled);
    assert!(tasks.research_progress >= 3);
    assert_eq!(
        tasks.summary_attempts,
        [
            ("summarizer-fast".to_owned(), Some(false)),
            ("summarizer-careful".to_owned(), Some(true))
        ]
    );
    assert_eq!(
        tasks.summary,
        "Agents hand long work to each other as tasks"
    );
    // Contract-net: the most confident of the two bidders wins.
    assert_eq!(tasks.negotiated, ("summarizer-careful".to_owned(), 2));

    // A second run works the same (the demo repeats until Ctrl-C).
    let again = within(WAIT, "demo rerun", demo.run(quiet))
        .await
        .expect("rerun");
    assert_eq!(again.event_receivers.len(), 3);
    assert!(again.dead_letter.is_some());
    // ... and leaves one dead letter of its own, not one per round; others' stay.
    let dlq = chorus_coordinator::service::dlq::DeadLetterQueue::new(
        chorus_tests::raw_broker(&server).await,
        chorus_sdk::Subjects::new("chorus").expect("root"),
    );
    let entries = within(WAIT, "dlq list", dlq.list(100)).await.expect("list");
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(
        entries[0].letter.message_id,
        again.dead_letter.as_ref().and_then(|l| l.message_id)
    );
    within(WAIT, "demo shutdown", demo.shutdown()).await;
    coordinator.shutdown().await;
}

#[test]
fn the_repository_nats_conf_passes_nats_server_t() {
    let binary = chorus_nats_server::find_binary().expect("nats-server installed");
    let conf = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../nats.conf");
    let out = std::process::Command::new(binary)
        .arg("-t")
        .arg("-c")
        .arg(&conf)
        .output()
        .expect("run nats-server -t");
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "nats-server -t refused nats.conf: {text}"
    );
    assert!(text.contains("is valid"), "{text}");
    let conf_text = std::fs::read_to_string(&conf).expect("read nats.conf");
    assert!(conf_text.contains("sync_interval: always"));
}
