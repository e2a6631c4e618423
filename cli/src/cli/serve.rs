//! `chorus serve`: run the coordinator until Ctrl-C or SIGTERM.

use std::path::PathBuf;
use std::process::ExitCode;

use chorus_coordinator::{Coordinator, CoordinatorConfig};

use super::ConnectionArgs;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// A TOML config file (see docs/COORDINATOR.md); `CHORUS_SERVE__*` variables override it.
    #[arg(long)]
    config: Option<PathBuf>,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let mut cfg = CoordinatorConfig::load(args.config.as_deref())?;
    // The command line wins over the file, but only where it was given.
    if let Some(server) = &conn.server {
        cfg.servers = server.clone();
    }
    if let Some(root) = &conn.root {
        cfg.root = root.clone();
    }
    if conn.security != chorus_sdk::security::ConnectionSecurity::default() {
        cfg.security = conn.security.clone();
    }
    let _otel = chorus_cli::otel::from_env()?;
    let coordinator = Coordinator::start(cfg.clone(), true).await?;
    outln!(
        "chorus serve: coordinator for root {:?} on {}; metrics on http://{}/metrics",
        cfg.root,
        cfg.servers,
        coordinator
            .metrics_addr()
            .map(|a| a.to_string())
            .unwrap_or_default()
    );
    crate::shutdown_signal().await;
    outln!("chorus serve: stopping");
    let finished = coordinator.shutdown().await;
    Ok(if finished {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
