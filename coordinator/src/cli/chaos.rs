//! `chorus chaos`: Chorus under injected faults, with Jepsen-style counts per scenario and
//! delivery class.

use std::process::ExitCode;
use std::sync::Arc;

use chorus_chaos::{ChaosOptions, ProcessLauncher, Scenario};

use super::exit;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The CI form: shorter phases, fewer faults, less traffic (well under four minutes).
    #[arg(long)]
    short: bool,
    /// Only these scenarios, comma-separated (server-kill, agent-kill, slow-backlog,
    /// coordinator-kill, hostile, clock-skew, leader-kill, pause-node, partition).
    #[arg(long, value_delimiter = ',')]
    only: Vec<Scenario>,
    /// Seconds of traffic before, between and after faults [default: 1.5 short, 5 full].
    #[arg(long)]
    seconds: Option<f64>,
    /// Sending agents [default: 3 short, 4 full].
    #[arg(long)]
    senders: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let Args {
        short,
        only,
        seconds,
        senders,
        json,
    } = args;
    // Each scenario starts its own servers, and a coordinator as `chorus serve` from this
    // executable, so `--server` plays no part.
    let opts = ChaosOptions {
        only,
        seconds,
        senders,
        ..ChaosOptions::new(
            short,
            Arc::new(ProcessLauncher::new(std::env::current_exe()?)),
        )
    };
    let progress: fn(&str) = |s| eprintln!("chaos: {s}");
    let started = std::time::Instant::now();
    let reports = chorus_chaos::run(&opts, progress).await;
    let ok = reports.iter().all(|r| r.ok());
    if json {
        super::print_json(&serde_json::json!({
            "short": short,
            "ok": ok,
            "seconds": started.elapsed().as_secs_f64(),
            "scenarios": reports,
        }))?;
    } else {
        let version = reports
            .iter()
            .map(|r| r.nats_server.as_str())
            .find(|v| !v.is_empty())
            .unwrap_or("?");
        outln!(
            "nats-server {version}, {} form, {:.0} s{}",
            if short { "short" } else { "full" },
            started.elapsed().as_secs_f64(),
            if ok { "" } else { "; GUARANTEES BROKEN" }
        );
        out!("{}", chorus_chaos::table(&reports));
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(exit::GUARANTEE_BROKEN)
    })
}
