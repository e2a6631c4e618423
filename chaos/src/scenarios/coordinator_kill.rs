//! `coordinator-kill`: poison commands while the coordinator is killed and, after a while,
//! another is started. Three kinds of poison: refused at once and failing until the retry
//! policy gives up (both dead-lettered by the worker), and never answered by a crashing
//! consumer (dead-lettered by the coordinator from the server's max-deliveries advisories,
//! which wait in their stream while no coordinator runs). Each must be dead-lettered exactly
//! once; the good traffic beside them must not suffer.

use std::time::{Duration, Instant};

use chorus_broker_adapter::{ConsumerSpec, JetStream};
use chorus_sdk::Subjects;
use chorus_sdk::durable::{INBOX_STREAM, InboxLimits, inbox_stream};
use chorus_sdk::retry::{RetryPolicies, RetryPolicy};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::server_kill::durable_server;
use super::{
    Harness, Scale, Scenario, WORKER, checker, connect, coordinator, let_traffic_run, senders,
    shutdown, worker_options,
};
use crate::ledger::Class;
use crate::report::ScenarioReport;
use crate::traffic::{Plan, Route, Traffic};
use crate::worker::{FAIL, REFUSE, WORK};
use crate::{ChaosOptions, WAIT};

/// The agent whose every delivery is taken and dropped unanswered.
const CRASHER: &str = "crasher";
/// Its consumer's ack wait and deliveries before the server gives up.
const CRASHER_ACK_WAIT: Duration = Duration::from_millis(500);
const CRASHER_MAX_DELIVER: i64 = 3;

/// Fast retries, so that poison runs out of attempts within the scenario.
fn fast_retries() -> RetryPolicies {
    RetryPolicies {
        default: RetryPolicy {
            max_attempts: 3,
            initial_backoff_ms: 200,
            multiplier: 2.0,
            max_backoff_ms: 1_000,
            ..RetryPolicy::default()
        },
        rules: Vec::new(),
    }
}

/// A consumer of `crasher`'s inbox that takes every delivery and never answers, as an agent
/// that crashes on every message would; runs until `stop`.
async fn crashing_consumer(
    js: &JetStream,
    subjects: &Subjects,
    stop: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    js.ensure_stream_exists(&inbox_stream(subjects, &InboxLimits::default()))
        .await?;
    let mut spec = ConsumerSpec::new(CRASHER);
    spec.filter_subjects = vec![subjects.durable_inbox(CRASHER, false)?];
    spec.ack_wait = CRASHER_ACK_WAIT;
    spec.max_deliver = CRASHER_MAX_DELIVER;
    let consumer = js
        .ensure_consumer(&subjects.stream_name(INBOX_STREAM), &spec)
        .await?;
    let mut deliveries = consumer.messages(100).await?;
    Ok(tokio::spawn(async move {
        loop {
            tokio::select! {
                next = deliveries.next() => match next {
                    Some(delivery) => drop(delivery),
                    None => break,
                },
                _ = stop.cancelled() => break,
            }
        }
    }))
}

pub(crate) async fn run(scale: &Scale, opts: &ChaosOptions) -> anyhow::Result<ScenarioReport> {
    let mut h = Harness::new(Scenario::CoordinatorKill);
    let server = durable_server().await?;
    let urls = vec![server.url().to_owned()];
    let first = coordinator(opts, &urls).await?;
    let worker = connect(worker_options(&urls).retry_policies(fast_retries()), WAIT).await?;
    crate::worker::serve(&worker, &h.probe, Duration::ZERO).await?;
    h.nats_server = worker.broker().server_version();
    let (_checker, js) = checker(&urls).await?;
    let stop_crasher = CancellationToken::new();
    let crasher = crashing_consumer(&js, worker.subjects(), stop_crasher.clone()).await?;
    let plan = Plan {
        routes: vec![
            Route::new(Class::AtLeastOnce, WORKER, WORK),
            Route::new(Class::ExactlyOnce, WORKER, WORK),
            Route::new(Class::Poison, WORKER, REFUSE),
            Route::new(Class::AtLeastOnce, WORKER, WORK),
            Route::new(Class::ExactlyOnce, WORKER, WORK),
            Route::new(Class::Poison, WORKER, FAIL),
            Route::new(Class::AtLeastOnce, WORKER, WORK),
            Route::new(Class::ExactlyOnce, WORKER, WORK),
            Route::new(Class::Poison, CRASHER, WORK),
        ],
        ..scale.plan()
    };
    let traffic = Traffic::start(senders(&urls, scale.senders).await?, &plan, &h.ledger);

    let_traffic_run(scale.phase).await;
    let dead_before = super::super::dlq::letters(&js, worker.subjects())
        .await
        .map_or(0, |l| l.len());
    first.kill().await;
    let killed = Instant::now();
    // No coordinator for a while: retries go on, advisories wait in their stream.
    let_traffic_run(scale.phase).await;
    let second = coordinator(opts, &urls).await?;
    h.fault_ends.push(Instant::now());
    h.note(format!(
        "coordinator killed with {dead_before} dead letters written; another serving {:.1} s later",
        killed.elapsed().as_secs_f64()
    ));
    let_traffic_run(scale.phase).await;
    let senders = traffic.stop().await;
    let report = h
        .finish(
            &js,
            scale,
            &[Class::AtLeastOnce, Class::ExactlyOnce, Class::Poison],
        )
        .await;
    stop_crasher.cancel();
    let _ = tokio::time::timeout(WAIT, crasher).await;
    shutdown(senders.into_iter().chain([worker])).await;
    second.shutdown().await;
    drop(server);
    report
}
