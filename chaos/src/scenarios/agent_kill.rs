//! `agent-kill`: the worker vanishes mid-handler (its runtime dropped where it stands, its
//! connection closed, nothing acked on its way out) and a new instance takes over, several
//! times. At-least-once messages it was running come back (duplicates allowed); exactly-once
//! ones it was running are not run again but dead-lettered as `uncertain`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_sdk::AgentOptions;

use super::server_kill::durable_server;
use super::{
    Harness, Scale, Scenario, checker, coordinator, let_traffic_run, senders, shutdown,
    worker_options,
};
use crate::ChaosOptions;
use crate::ledger::{Class, Probe};
use crate::report::ScenarioReport;
use crate::traffic::Traffic;
use crate::worker::Isolated;

/// The worker's ack wait: how soon a dead instance's deliveries go to the next one.
const ACK_WAIT: Duration = Duration::from_secs(1);
/// Each handler run's work, so that a kill finds runs in progress.
const WORK_TIME: Duration = Duration::from_millis(5);

/// A worker instance on a runtime of its own.
async fn instance(
    options: &AgentOptions,
    probe: &Arc<Probe>,
    n: usize,
) -> anyhow::Result<Isolated> {
    let (options, probe) = (options.clone(), Arc::clone(probe));
    Isolated::start(&format!("worker-{n}"), move || async move {
        let agent = options.connect().await?;
        crate::worker::serve(&agent, &probe, WORK_TIME).await?;
        Ok(agent)
    })
    .await
}

pub(crate) async fn run(scale: &Scale, opts: &ChaosOptions) -> anyhow::Result<ScenarioReport> {
    let mut h = Harness::new(Scenario::AgentKill);
    let server = durable_server().await?;
    let urls = vec![server.url().to_owned()];
    let coordinator = coordinator(opts, &urls).await?;
    let options = worker_options(&urls).durable_ack_wait(ACK_WAIT);
    let mut current = instance(&options, &h.probe, 1).await?;
    let (checker_broker, js) = checker(&urls).await?;
    h.nats_server = checker_broker.server_version();
    let traffic = Traffic::start(
        senders(&urls, scale.senders).await?,
        &scale.plan(),
        &h.ledger,
    );

    let_traffic_run(scale.phase).await;
    for kill in 1..=scale.faults {
        let (runs, handled) = (h.probe.runs(), h.probe.handled());
        current.crash().await;
        let crashed = Instant::now();
        current = instance(&options, &h.probe, kill + 1).await?;
        h.fault_ends.push(Instant::now());
        h.note(format!(
            "kill {kill}: after {runs} runs begun and {handled} messages handled; instance {} serving {:.0} ms later",
            kill + 1,
            crashed.elapsed().as_secs_f64() * 1e3
        ));
        let_traffic_run(scale.phase).await;
    }
    let senders = traffic.stop().await;
    let report = h
        .finish(&js, scale, &[Class::AtLeastOnce, Class::ExactlyOnce])
        .await;
    current.crash().await;
    shutdown(senders).await;
    coordinator.shutdown().await;
    drop(server);
    report
}
