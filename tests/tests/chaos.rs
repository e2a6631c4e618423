//! `chorus chaos --short`, every scenario, each its own test: nothing acknowledged is lost and
//! nothing unexpected appears under any fault; exactly-once never runs a handler twice (an
//! interrupted run is dead-lettered as `uncertain` instead); and each scenario's own checks
//! hold (see `chorus_chaos`). The coordinator runs in this process on a runtime of its own,
//! so that killing it drops it where it stands, as `kill -9` of `chorus serve` would.

use std::sync::Arc;
use std::time::Duration;

use agent_sdk::durable::InboxLimits;
use chorus_chaos::{
    ChaosOptions, CoordinatorLauncher, CoordinatorSpec, Isolated, RunningCoordinator, Scenario,
};
use futures::future::BoxFuture;

/// The longest one scenario's short form may take, setup and draining included.
const SCENARIO_LIMIT: Duration = Duration::from_secs(200);

/// Starts each coordinator in this process, on an isolated runtime.
#[derive(Debug)]
struct InProcess;

impl CoordinatorLauncher for InProcess {
    fn start<'a>(
        &'a self,
        spec: &'a CoordinatorSpec,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn RunningCoordinator>>> {
        Box::pin(async move {
            let config = chorus::CoordinatorConfig {
                servers: spec.servers.join(","),
                metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                replicas: spec.replicas,
                inbox: InboxLimits {
                    replicas: spec.replicas,
                    ..InboxLimits::default()
                },
                ..chorus::CoordinatorConfig::default()
            };
            let isolated = Isolated::start("coordinator", move || async move {
                Ok(chorus::Coordinator::start(config, false).await?)
            })
            .await?;
            Ok(Box::new(Started(isolated)) as Box<dyn RunningCoordinator>)
        })
    }
}

#[derive(Debug)]
struct Started(Isolated);

impl RunningCoordinator for Started {
    fn kill(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move { self.0.crash().await })
    }

    /// At the end of a scenario, when nothing depends on its goodbye: the same as a kill.
    fn shutdown(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move { self.0.crash().await })
    }
}

async fn holds(scenario: Scenario) {
    chorus_tests::init_tracing();
    let opts = ChaosOptions::new(true, Arc::new(InProcess));
    let report = chorus_tests::within(
        SCENARIO_LIMIT,
        scenario.name(),
        chorus_chaos::run_scenario(scenario, &opts, |s| eprintln!("chaos: {s}")),
    )
    .await;
    println!("{}", chorus_chaos::table(std::slice::from_ref(&report)));
    for row in &report.rows {
        assert_eq!(
            row.lost, 0,
            "{scenario}, {}: acknowledged and lost: {row:?}",
            row.class
        );
        assert_eq!(
            row.unexpected, 0,
            "{scenario}, {}: never sent, yet handled or dead-lettered: {row:?}",
            row.class
        );
        if row.class == "exactly-once" {
            assert_eq!(
                row.duplicated, 0,
                "{scenario}: an exactly-once handler ran twice for one message: {row:?}"
            );
        }
    }
    assert!(
        report.ok(),
        "{scenario}: {:?}\n{}",
        report.failures(),
        chorus_chaos::table(std::slice::from_ref(&report))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_kill() {
    holds(Scenario::ServerKill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_kill() {
    holds(Scenario::AgentKill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_backlog() {
    holds(Scenario::SlowBacklog).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_kill() {
    holds(Scenario::CoordinatorKill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile() {
    holds(Scenario::Hostile).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_skew() {
    holds(Scenario::ClockSkew).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill() {
    holds(Scenario::LeaderKill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_node() {
    holds(Scenario::PauseNode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition() {
    holds(Scenario::Partition).await;
}
