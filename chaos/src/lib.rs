//! `chorus chaos`: Chorus under injected faults, counted the way Jepsen counts.
//!
//! ```text
//! chorus chaos                                # every scenario, full form (a few minutes)
//! chorus chaos --short                        # the CI form, well under four minutes
//! chorus chaos --only server-kill,partition   # some scenarios
//! chorus chaos --short --json                 # for machines
//! chorus chaos --seconds 10 --senders 6       # longer phases, more traffic
//! chorus chaos --soak 30m                     # a soak: steady traffic, periodic faults,
//!                                             # memory and descriptors sampled, growth flagged
//! ```
//!
//! Each scenario starts its own `nats-server`s on loopback ports (the pinned binary, found as
//! [`chorus_nats_server::find_binary`] says: `$NATS_SERVER`, then `.tools/bin`, then `PATH`),
//! a coordinator, a worker agent with a durable inbox and several sender agents; sends
//! at-least-once and exactly-once commands while it injects its fault; stops the traffic,
//! waits (with a deadline) until the inbox has drained; and counts, per delivery class:
//! sent, acked, unknown (a send that failed or timed out: stored or not, nobody knows),
//! handled (distinct), duplicated (handler runs beyond the first), lost (acked, and neither
//! handled nor dead-lettered), unexpected (handled or dead-lettered, never sent), dead-lettered,
//! uncertain (exactly-once messages dead-lettered with reason `uncertain`, 5023, because a run
//! was interrupted) and recovered (from the end of a fault to the first message handled after
//! it).
//!
//! The guarantees each row is checked against: nothing acknowledged is lost and nothing
//! unexpected appears, in every scenario; at-least-once may duplicate; exactly-once never runs
//! a handler twice for one message, and a message whose run was interrupted is dead-lettered
//! as `uncertain` (counted there, not lost). Scenario checks add what the fault is about: no
//! connection reset by hostile input, no redelivery behind a slow handler, every poison
//! command dead-lettered exactly once, stale signatures refused with 5015.
//!
//! The scenarios (their `--only` keys): `server-kill`, `agent-kill`, `slow-backlog`,
//! `coordinator-kill`, `hostile`, `clock-skew`, `leader-kill`, `pause-node`, `partition`; see
//! [`Scenario`].
//!
//! The soak ([`soak`], `--soak <duration>`, not among the scenarios) runs one server, a
//! coordinator and the agents at a steady rate (durable commands of both classes, events,
//! requests) for as long as it is told, kills the server, crashes the worker and kills the
//! coordinator in turn every few minutes, samples the resident memory and open descriptors
//! of every process it can see, and flags growth beyond a warm-up; see [`SoakOptions`].
//!
//! The crate does not depend on the coordinator: `chorus chaos` passes a [`ProcessLauncher`]
//! of its own executable (`chorus serve` as a child process, killed with SIGKILL), and a test
//! binary can pass a launcher that runs the coordinator in its own process (on an
//! [`Isolated`] runtime, so that a kill drops it where it stands).
//!
//! Rooms: `scenarios` (one file each, and the harness they share), `traffic` (the senders),
//! `worker` (the handlers, and [`Isolated`]), `ledger` (what was sent and what became of it;
//! the count), `dlq` (dead letters read back, the inbox drained), `proxy` (a TCP proxy that
//! can be cut), `hostile` (a raw protocol client and its garbage), `coordinator` (launchers),
//! `report` (rows and the table), `soak` (the soak: its traffic, compact accounting, sampler
//! and growth fit).

mod coordinator;
mod dlq;
mod hostile;
mod ledger;
mod proxy;
mod report;
mod scenarios;
mod soak;
mod traffic;
mod worker;

use std::sync::Arc;
use std::time::Duration;

pub use coordinator::{CoordinatorLauncher, CoordinatorSpec, ProcessLauncher, RunningCoordinator};
pub use proxy::Proxy;
pub use report::{Check, Row, ScenarioReport, table};
pub use scenarios::{Scenario, UnknownScenario};
pub use soak::{
    EventCounts, FaultRecord, GrowthLimits, RequestCounts, Resource, Sample, Series, SoakFault,
    SoakOptions, SoakPlan, SoakReport, Trend, Verdict, soak,
};
pub use worker::Isolated;

/// The deadline of any single step that has no reason to pick another: a connection, a
/// process start, a server restart.
pub const WAIT: Duration = Duration::from_secs(20);

/// What to run.
#[derive(Debug, Clone)]
pub struct ChaosOptions {
    /// The CI form: shorter phases, fewer faults, less traffic.
    pub short: bool,
    /// Only these scenarios (none: all), in the order of [`Scenario::ALL`].
    pub only: Vec<Scenario>,
    /// Seconds of traffic before, between and after faults (default 1.5 short, 5 full).
    pub seconds: Option<f64>,
    /// Sending agents (default 3 short, 4 full).
    pub senders: Option<usize>,
    /// Starts the coordinator each scenario runs.
    pub coordinator: Arc<dyn CoordinatorLauncher>,
}

impl ChaosOptions {
    /// Options for every scenario in the short or full form, with `coordinator`.
    pub fn new(short: bool, coordinator: Arc<dyn CoordinatorLauncher>) -> Self {
        ChaosOptions {
            short,
            only: Vec::new(),
            seconds: None,
            senders: None,
            coordinator,
        }
    }
}

/// Runs the chosen scenarios one after the other, each against servers of its own, and
/// reports each; a scenario that cannot run is reported as failed and the rest still run.
pub async fn run(opts: &ChaosOptions, progress: fn(&str)) -> Vec<ScenarioReport> {
    let mut reports = Vec::new();
    for scenario in Scenario::ALL {
        if !opts.only.is_empty() && !opts.only.contains(&scenario) {
            continue;
        }
        reports.push(run_scenario(scenario, opts, progress).await);
    }
    reports
}

/// Runs one scenario.
pub async fn run_scenario(
    scenario: Scenario,
    opts: &ChaosOptions,
    progress: fn(&str),
) -> ScenarioReport {
    let scale = scenarios::Scale::new(opts);
    progress(&format!("{scenario}: {}", scenario.fault()));
    let report = scenario.run(&scale, opts).await;
    progress(&format!(
        "{scenario}: {} in {:.1} s",
        if report.ok() { "ok" } else { "FAILED" },
        report.seconds
    ));
    report
}
