//! `chorus chaos --short`, every scenario, each its own test: nothing acknowledged is lost and
//! nothing unexpected appears under any fault; exactly-once never runs a handler twice (an
//! interrupted run is dead-lettered as `uncertain` instead); and each scenario's own checks
//! hold (see `chorus_chaos`). The coordinator runs in this process on a runtime of its own,
//! so that killing it drops it where it stands, as `kill -9` of `chorus serve` would.

use std::sync::Arc;
use std::time::Duration;

use chorus_chaos::{ChaosOptions, Scenario};
use chorus_tests::InProcessCoordinator;

/// The longest one scenario's short form may take, setup and draining included.
const SCENARIO_LIMIT: Duration = Duration::from_secs(200);

async fn holds(scenario: Scenario) {
    chorus_tests::init_tracing();
    let opts = ChaosOptions::new(true, Arc::new(InProcessCoordinator));
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
