//! `hostile`: while traffic flows, a raw protocol client sends the worker's command subject
//! and durable inbox malformed header blocks, garbage, MessagePack that is no envelope,
//! truncated envelopes and oversized ones. The worker must refuse each (counted as bad input,
//! dead-lettered where stored), keep its connection, and lose nothing acknowledged.

use std::time::{Duration, Instant};

use super::{
    Harness, Scale, Scenario, WORKER, checker, connect, coordinator, senders, shutdown,
    worker_options,
};
use crate::hostile::{RawClient, Sent, attack};
use crate::ledger::Class;
use crate::report::ScenarioReport;
use crate::traffic::Traffic;
use crate::worker::WORK;
use crate::{ChaosOptions, WAIT};

/// The pause between two rounds of hostile input.
const ROUND_PACE: Duration = Duration::from_millis(100);

pub(crate) async fn run(scale: &Scale, opts: &ChaosOptions) -> anyhow::Result<ScenarioReport> {
    let mut h = Harness::new(Scenario::Hostile);
    let server = super::server_kill::durable_server().await?;
    let urls = vec![server.url().to_owned()];
    let coordinator = coordinator(opts, &urls).await?;
    let worker = connect(worker_options(&urls), WAIT).await?;
    crate::worker::serve(&worker, &h.probe, Duration::ZERO).await?;
    h.nats_server = worker.broker().server_version();
    let (_checker, js) = checker(&urls).await?;
    let targets = vec![
        worker.subjects().command(WORKER, WORK)?,
        worker.subjects().durable(WORKER, WORK, false)?,
    ];
    let mut raw = RawClient::connect(server.url()).await?;
    let traffic = Traffic::start(
        senders(&urls, scale.senders).await?,
        &scale.plan(),
        &h.ledger,
    );

    let until = Instant::now() + scale.phase * 3;
    let mut sent = Sent::default();
    let mut round = 0;
    let mut refused = None;
    while Instant::now() < until {
        match attack(&mut raw, &targets, WORKER, round).await {
            Ok(s) => sent.add(s),
            Err(e) => {
                refused = Some(format!("{e:#}"));
                break;
            }
        }
        round += 1;
        tokio::time::sleep(ROUND_PACE).await;
    }
    let senders = traffic.stop().await;
    h.note(format!(
        "{} hostile messages in {round} rounds: {} with malformed header blocks, {} garbage, {} truncated envelopes, {} oversized",
        sent.total(),
        sent.malformed_headers,
        sent.garbage,
        sent.truncated,
        sent.oversized
    ));
    h.check(
        refused.is_none(),
        format!(
            "the server took every hostile message{}",
            refused.map(|e| format!(": {e}")).unwrap_or_default()
        ),
    );
    let report = h
        .finish(&js, scale, &[Class::AtLeastOnce, Class::ExactlyOnce])
        .await;
    let worker_links = worker.broker().stats();
    let bad_input = worker.stats().bad_input;
    let sender_resets: u64 = senders.iter().map(|s| s.broker().stats().disconnects).sum();
    shutdown(senders.into_iter().chain([worker])).await;
    coordinator.shutdown().await;
    drop(server);
    let mut report = report?;
    report.checks.push(crate::report::Check::new(
        worker_links.disconnects == 0 && worker_links.reconnects == 0,
        format!(
            "the worker's connection never reset: {} disconnects",
            worker_links.disconnects
        ),
    ));
    report.checks.push(crate::report::Check::new(
        sender_resets == 0,
        format!("no sender's connection reset: {sender_resets} disconnects"),
    ));
    report.checks.push(crate::report::Check::new(
        bad_input > 0,
        format!("the worker refused the garbage as bad input: {bad_input}"),
    ));
    Ok(report.finish())
}
