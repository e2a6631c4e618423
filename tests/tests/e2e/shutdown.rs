//! Graceful shutdown: accepted work finishes and is answered; new work is not taken.

use std::time::Duration;

use chorus_sdk::{Call, Context, HandlerError, SdkError};
use chorus_tests::{WAIT, agent, agent_options, server, within};

#[tokio::test]
async fn shutdown_finishes_an_accepted_request_and_takes_no_new_ones() {
    let server = server();
    let worker = agent(&server, "worker").await;
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel();
    worker
        .on_command("long", move |_ctx: Context, ms: u64| {
            let started_tx = started_tx.clone();
            async move {
                let _ = started_tx.send(());
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok::<_, HandlerError>(format!("slept {ms} ms"))
            }
        })
        .await
        .expect("register");
    let client = agent(&server, "client").await;
    let in_flight = tokio::spawn({
        let client = client.clone();
        async move { client.request::<_, String>("worker", "long", &300u64).await }
    });
    within(WAIT, "handler start", started_rx.recv())
        .await
        .expect("started");

    let report = within(WAIT, "shutdown", worker.shutdown()).await;
    assert!(report.completed);
    assert_eq!(report.abandoned, 0);

    let reply = within(WAIT, "in-flight reply", in_flight)
        .await
        .expect("task")
        .expect("the accepted request was answered");
    assert_eq!(reply, "slept 300 ms");

    let err = client
        .request::<_, String>("worker", "long", &1u64)
        .await
        .expect_err("nobody serves after shutdown");
    assert!(matches!(err, SdkError::NoResponders(_)), "{err}");
}

#[tokio::test]
async fn shutdown_reports_handlers_that_outlive_its_deadline() {
    let server = server();
    let worker = within(
        WAIT,
        "connect",
        agent_options(&server, "stubborn")
            .shutdown_timeout(Duration::from_millis(100))
            .connect(),
    )
    .await
    .expect("connect");
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel();
    worker
        .on_command("forever", move |_ctx: Context, (): ()| {
            let started_tx = started_tx.clone();
            async move {
                let _ = started_tx.send(());
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok::<_, HandlerError>(())
            }
        })
        .await
        .expect("register");
    let client = agent(&server, "client").await;
    let pending = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .call(
                    Call::agent("stubborn", "forever")
                        .payload(&())
                        .expect("payload")
                        .timeout(Duration::from_secs(2)),
                )
                .await
        }
    });
    within(WAIT, "handler start", started_rx.recv())
        .await
        .expect("started");
    let report = within(WAIT, "shutdown", worker.shutdown()).await;
    assert!(!report.completed);
    assert!(report.abandoned >= 1);
    let outcome = within(WAIT, "caller", pending).await.expect("task");
    // The abandoned handler never answers: the caller runs into its own 2 s timeout.
    let err = outcome.expect_err("an abandoned handler sent no reply");
    assert!(matches!(err, SdkError::Timeout(_)), "{err}");
}
