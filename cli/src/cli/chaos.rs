//! `chorus chaos`: Chorus under injected faults, with Jepsen-style counts per scenario and
//! delivery class; or, with `--soak`, a long run with periodic faults that samples the memory
//! and descriptors of every process and flags growth.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use chorus_chaos::{ChaosOptions, ProcessLauncher, Scenario, SoakOptions};
use chorus_cli::duration::{parse_duration, parse_timeout};

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
    /// Sending agents [default: 3 short, 4 full, 3 soak].
    #[arg(long)]
    senders: Option<usize>,
    /// Print JSON instead of a table (with --soak, every sample too).
    #[arg(long)]
    json: bool,
    /// A soak instead of the scenarios: steady traffic for this long (e.g. 30m) with periodic
    /// faults, sampling the memory and descriptors of every process and flagging growth.
    #[arg(long, value_parser = parse_timeout, conflicts_with_all = ["short", "only", "seconds"])]
    soak: Option<Duration>,
    /// Soak: messages a second, all kinds together (60 % durable commands, 30 % events, 10 %
    /// requests) [default: 300].
    #[arg(long, requires = "soak", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    rate: Option<u32>,
    /// Soak: time between faults (server kill, worker crash, coordinator kill, in turn); 0s
    /// for none [default: a fifth of the soak, between 30s and 5m].
    #[arg(long, requires = "soak", value_parser = parse_duration)]
    fault_every: Option<Duration>,
    /// Soak: time between samples [default: 1/120 of the soak, between 1s and 5s].
    #[arg(long, requires = "soak", value_parser = parse_timeout)]
    sample_every: Option<Duration>,
    /// Soak: samples left out at the start and after each restart [default: 20 % of the
    /// soak, at least 1m unless that is more than half of it].
    #[arg(long, requires = "soak", value_parser = parse_duration)]
    warmup: Option<Duration>,
}

/// The soak's options (those of the scenarios have no part in it).
#[derive(Debug)]
struct Soak {
    duration: Duration,
    rate: Option<u32>,
    senders: Option<usize>,
    fault_every: Option<Duration>,
    sample_every: Option<Duration>,
    warmup: Option<Duration>,
    json: bool,
}

pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let Args {
        short,
        only,
        seconds,
        senders,
        json,
        soak,
        rate,
        fault_every,
        sample_every,
        warmup,
    } = args;
    if let Some(duration) = soak {
        return run_soak(Soak {
            duration,
            rate,
            senders,
            fault_every,
            sample_every,
            warmup,
            json,
        })
        .await;
    }
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

/// `chorus chaos --soak`: its own server, a `chorus serve` child from this executable, the
/// agents in this process.
async fn run_soak(args: Soak) -> anyhow::Result<ExitCode> {
    let mut opts = SoakOptions::new(
        args.duration,
        Arc::new(ProcessLauncher::new(std::env::current_exe()?)),
    );
    if let Some(rate) = args.rate {
        opts.rate = rate;
    }
    if let Some(senders) = args.senders.filter(|n| *n > 0) {
        opts.senders = senders;
    }
    opts.fault_every = args.fault_every;
    opts.sample_every = args.sample_every;
    opts.warmup = args.warmup;
    let progress: fn(&str) = |s| eprintln!("chaos: {s}");
    let report = chorus_chaos::soak(&opts, progress).await?;
    let ok = report.ok();
    if args.json {
        super::print_json(&serde_json::json!({ "ok": ok, "soak": report }))?;
    } else {
        out!("{}", report.table());
        if !ok {
            outln!("GUARANTEES BROKEN or GROWTH FLAGGED");
        }
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(exit::GUARANTEE_BROKEN)
    })
}
