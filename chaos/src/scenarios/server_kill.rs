//! `server-kill`: the only server, with fsync per write, killed with SIGKILL mid-traffic and
//! restarted on its store, several times. Every acknowledged message must be handled after
//! all; senders see the outage as unknown sends.

use std::time::{Duration, Instant};

use chorus_nats_server::{NatsServer, ServerBuilder};

use super::{
    Harness, Scale, Scenario, checker, connect, coordinator, let_traffic_run, senders, shutdown,
    worker_options,
};
use crate::ledger::Class;
use crate::report::ScenarioReport;
use crate::traffic::Traffic;
use crate::{ChaosOptions, WAIT};

/// Starts a single server with `sync_interval: always` (blocking: run off the runtime).
pub(crate) async fn durable_server() -> anyhow::Result<NatsServer> {
    Ok(
        tokio::task::spawn_blocking(|| ServerBuilder::default().sync_always(true).start())
            .await??,
    )
}

pub(crate) async fn run(scale: &Scale, opts: &ChaosOptions) -> anyhow::Result<ScenarioReport> {
    let mut h = Harness::new(Scenario::ServerKill);
    let mut server = durable_server().await?;
    let urls = vec![server.url().to_owned()];
    let coordinator = coordinator(opts, &urls).await?;
    let worker = connect(worker_options(&urls), WAIT).await?;
    crate::worker::serve(&worker, &h.probe, Duration::ZERO).await?;
    h.nats_server = worker.broker().server_version();
    let (_checker, js) = checker(&urls).await?;
    let traffic = Traffic::start(
        senders(&urls, scale.senders).await?,
        &scale.plan(),
        &h.ledger,
    );

    let_traffic_run(scale.phase).await;
    for kill in 1..=scale.faults {
        let (acked, handled) = (h.ledger.acked(), h.probe.handled());
        server = tokio::task::spawn_blocking(move || {
            server.kill();
            server
        })
        .await?;
        let down = Instant::now();
        // The outage itself.
        tokio::time::sleep(scale.down).await;
        server = tokio::task::spawn_blocking(move || server.restart().map(|()| server)).await??;
        h.fault_ends.push(Instant::now());
        h.note(format!(
            "kill {kill}: {acked} acked and {handled} handled before it; back after {:.1} s",
            down.elapsed().as_secs_f64()
        ));
        let_traffic_run(scale.phase).await;
    }
    let senders = traffic.stop().await;
    let stats = worker.broker().stats();
    h.note(format!(
        "worker: {} reconnects, {} redelivered",
        stats.reconnects,
        worker.stats().redelivered
    ));
    let report = h
        .finish(&js, scale, &[Class::AtLeastOnce, Class::ExactlyOnce])
        .await;
    shutdown(senders.into_iter().chain([worker])).await;
    coordinator.shutdown().await;
    drop(server);
    report
}
