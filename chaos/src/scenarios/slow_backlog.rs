//! `slow-backlog`: a 100 ms handler behind a backlog far longer than its 600 ms ack wait.
//! Every delivery the worker holds, running or waiting its turn, must be kept alive: no
//! message redelivered, no handler run twice, in any class.

use std::time::Duration;

use chorus_sdk::Call;

use super::{
    Harness, Scale, Scenario, WORKER, checker, connect, coordinator, senders, shutdown,
    worker_options,
};
use crate::ledger::Class;
use crate::report::ScenarioReport;
use crate::worker::WORK;
use crate::{ChaosOptions, WAIT};

const ACK_WAIT: Duration = Duration::from_millis(600);
const WORK_TIME: Duration = Duration::from_millis(100);
/// Senders, each one ordering lane of the worker (two lanes at most).
const SENDERS: usize = 2;

pub(crate) async fn run(scale: &Scale, opts: &ChaosOptions) -> anyhow::Result<ScenarioReport> {
    let mut h = Harness::new(Scenario::SlowBacklog);
    let server = super::server_kill::durable_server().await?;
    let urls = vec![server.url().to_owned()];
    let coordinator = coordinator(opts, &urls).await?;
    let worker = connect(worker_options(&urls).durable_ack_wait(ACK_WAIT), WAIT).await?;
    crate::worker::serve(&worker, &h.probe, WORK_TIME).await?;
    h.nats_server = worker.broker().server_version();
    let (_checker, js) = checker(&urls).await?;
    let senders = senders(&urls, SENDERS).await?;
    // Everything stored at once, so the whole backlog waits behind the handler.
    let mut backlog = 0;
    for sender in &senders {
        let mut ids = Vec::new();
        let mut calls = Vec::new();
        for i in 0..scale.backlog * 2 {
            let class = if i % 2 == 0 {
                Class::AtLeastOnce
            } else {
                Class::ExactlyOnce
            };
            let id = h.ledger.issue(class);
            ids.push(id);
            calls.push(
                Call::agent(WORKER, WORK)
                    .delivery(class.delivery())
                    .payload(&id)?,
            );
        }
        backlog += calls.len();
        for (id, result) in ids.into_iter().zip(sender.send_batch(calls).await) {
            h.ledger.record(id, result.is_ok());
        }
    }
    let lane_time = WORK_TIME * u32::try_from(backlog).unwrap_or(u32::MAX) / SENDERS as u32;
    h.note(format!(
        "{backlog} commands stored at once: about {:.1} s of work per lane against a {} ms ack wait",
        lane_time.as_secs_f64(),
        ACK_WAIT.as_millis()
    ));
    let report = h
        .finish(&js, scale, &[Class::AtLeastOnce, Class::ExactlyOnce])
        .await;
    let redelivered = worker.stats().redelivered;
    shutdown(senders.into_iter().chain([worker])).await;
    coordinator.shutdown().await;
    drop(server);
    let mut report = report?;
    let duplicated: u64 = report.rows.iter().map(|r| r.duplicated).sum();
    report.checks.push(crate::report::Check::new(
        duplicated == 0,
        format!("no handler run twice in any class: {duplicated} duplicates"),
    ));
    report.checks.push(crate::report::Check::new(
        redelivered == 0,
        format!("nothing redelivered: {redelivered}"),
    ));
    Ok(report.finish())
}
