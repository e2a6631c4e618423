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
    let nats = ensure_nats(conn.url(), &config).await?;
    match &nats {
        LocalNats::Existing(url) => println!("chorus up: using the NATS server at {url}"),
        LocalNats::Started(server) => println!(
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
    let coordinator = Coordinator::start(coordinator_config, true).await?;
    println!(
        "chorus up: coordinator running; metrics at http://{}/metrics",
        coordinator
            .metrics_addr()
            .map(|a| a.to_string())
            .unwrap_or_default()
    );
    let say: fn(&str) = |line| println!("{line}");
    let demo = Demo::start(nats.url(), say).await?;
    println!("chorus up: agents online: {}", demo.agent_ids().join(", "));
    let mut failed = false;
    loop {
        match demo.run(say).await {
            Ok(_) => println!("chorus up: scenarios complete"),
            Err(err) => {
                eprintln!("chorus up: scenario failed: {err}");
                failed = true;
            }
        }
        if once {
            break;
        }
        println!(
            "chorus up: running again in {interval:?}; try `chorus listen` or `chorus request --capability ocr ...` in another terminal; Ctrl-C to stop"
        );
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = crate::shutdown_signal() => break,
        }
    }
    println!("chorus up: stopping agents");
    demo.shutdown().await;
    coordinator.shutdown().await;
    drop(nats);
    println!("chorus up: stopped");
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
