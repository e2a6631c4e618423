//! `chorus up`: a local NATS server (if none answers), a coordinator and the demo agents,
//! acting out the scenarios once or until Ctrl-C.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use chorus::demo::Demo;
use chorus::duration::parse_duration;
use chorus::local::{LocalNats, ensure_nats};
use chorus::{Coordinator, CoordinatorConfig};

use super::ConnectionArgs;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The NATS config to start the local server with.
    #[arg(long, default_value = "nats.conf")]
    config: PathBuf,
    /// Run the scenarios once and exit, instead of repeating them until Ctrl-C.
    #[arg(long)]
    once: bool,
    /// Time between scenario runs.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    interval: Duration,
    /// Where the coordinator serves /metrics.
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_addr: SocketAddr,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let Args {
        config,
        once,
        interval,
        metrics_addr,
    } = args;
    let _otel = chorus::otel::from_env()?;
    // Caught from here on: a signal during a round or the shutdown is not lost.
    let mut signals = crate::Signals::new()?;
    let nats = ensure_nats(conn.url(), &config).await?;
    match &nats {
        LocalNats::Existing(url) => outln!("chorus up: using the NATS server at {url}"),
        LocalNats::Started(server) => outln!(
            "chorus up: started nats-server with {} at {} (monitoring {})",
            config.display(),
            server.url(),
            server.monitor_url().unwrap_or("off")
        ),
    }
    let coordinator_config = CoordinatorConfig {
        servers: nats.url().to_owned(),
        metrics_addr,
        ..CoordinatorConfig::default()
    };
    if let LocalNats::Existing(url) = &nats
        && bus_answers(conn).await
    {
        anyhow::bail!(
            "a Chorus bus is already running at {url} (its coordinator answers): use it from \
             here (`chorus agents`, `chorus listen`, `chorus request`), or stop the other \
             `chorus up` first"
        );
    }
    let coordinator = Coordinator::start(coordinator_config, true)
        .await
        .map_err(|e| taken_port_hint(e, metrics_addr))?;
    outln!(
        "chorus up: coordinator running; metrics at http://{}/metrics",
        coordinator
            .metrics_addr()
            .map(|a| a.to_string())
            .unwrap_or_default()
    );
    let say: fn(&str) = |line| outln!("{line}");
    let demo = Demo::start(nats.url(), say).await?;
    outln!("chorus up: agents online: {}", demo.agent_ids().join(", "));
    let mut failed = false;
    loop {
        // A signal stops the round where it is.
        let round = tokio::select! {
            round = demo.run(say) => round,
            _ = signals.recv() => break,
        };
        match round {
            Ok(_) => outln!("chorus up: scenarios complete"),
            Err(err) => {
                eprintln!("chorus up: scenario failed: {err}");
                failed = true;
            }
        }
        if once {
            break;
        }
        outln!(
            "chorus up: running again in {interval:?}; try `chorus listen` or `chorus request --capability ocr ...` in another terminal; Ctrl-C to stop"
        );
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = signals.recv() => break,
        }
    }
    outln!("chorus up: stopping agents (Ctrl-C again to force)");
    let stop = async {
        demo.shutdown().await;
        coordinator.shutdown().await;
    };
    tokio::select! {
        _ = stop => {}
        _ = signals.recv() => {
            eprintln!("chorus up: forced to stop");
            drop(nats);
            return Ok(ExitCode::from(130));
        }
        _ = tokio::time::sleep(SHUTDOWN_LIMIT) => {
            eprintln!("chorus up: agents did not stop within {SHUTDOWN_LIMIT:?}; stopping anyway");
        }
    }
    drop(nats);
    outln!("chorus up: stopped");
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The longest a graceful stop may take before `chorus up` stops anyway.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(10);

/// Whether a coordinator already answers discovery on the bus.
async fn bus_answers(conn: &ConnectionArgs) -> bool {
    let Ok(agent) = conn.agent().await else {
        return false;
    };
    let found = tokio::time::timeout(
        Duration::from_secs(2),
        agent.discover(&agent_sdk::DiscoverQuery::default()),
    )
    .await;
    agent.shutdown().await;
    matches!(found, Ok(Ok(_)))
}

/// A coordinator that cannot bind its metrics address is told which flag moves it.
fn taken_port_hint(err: chorus::Error, addr: SocketAddr) -> anyhow::Error {
    let in_use = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|io| io.kind() == std::io::ErrorKind::AddrInUse);
    if in_use {
        anyhow::anyhow!(
            "the metrics address {addr} is taken (another `chorus up` or `chorus serve`?): \
             pass --metrics-addr with another, or 127.0.0.1:0 for any free port"
        )
    } else {
        anyhow::Error::new(err)
    }
}
