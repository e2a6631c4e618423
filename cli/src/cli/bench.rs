//! `chorus bench`: each scenario against raw async-nats and against Chorus, side by side.

use std::process::ExitCode;
use std::sync::Arc;

use std::net::SocketAddr;

use chorus_bench::{BenchOptions, CoordinatorLauncher, RunningCoordinator, WithGateway};
use chorus_coordinator::{Coordinator, CoordinatorConfig};
use chorus_gateway::GatewayConfig;
use chorus_gateway::config::{ApiKey, EdgeIdentity};
use futures::future::BoxFuture;

use super::ConnectionArgs;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Smaller counts (a minute instead of several).
    #[arg(long)]
    quick: bool,
    /// Rounds per scenario (raw and Chorus alternate; medians are reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Only scenarios whose name contains this (events, latency, tasks, throughput, durable,
    /// fan-out, secure, gateway, routing, discovery, memory).
    #[arg(long)]
    only: Option<String>,
    /// The envelope form Chorus's agents write: `compact` (protocol 2, what agents write on a
    /// bus whose agents all read it) or `named` (protocol 1).
    #[arg(long, value_enum, default_value_t = Wire::Compact)]
    wire: Wire,
    /// A Python with a2a-sdk's server installed (`scripts/install-python-sdk` prints one): the
    /// gateway scenario also times A2A calls to the official a2a-sdk server beside the
    /// gateway's A2A binding.
    #[arg(long, env = "CHORUS_PYTHON")]
    python: Option<std::path::PathBuf>,
}

/// `--wire`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Wire {
    Compact,
    Named,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let Args {
        quick,
        rounds,
        json,
        only,
        wire,
        python,
    } = args;
    if cfg!(debug_assertions) {
        eprintln!(
            "chorus bench: this is a debug build; its figures say little about Chorus. For \
             figures: cargo build --release -p chorus-cli && target/release/chorus bench"
        );
    }
    let opts = BenchOptions {
        url: conn.server.clone(),
        quick,
        rounds,
        only,
        wire: match wire {
            Wire::Compact => chorus_sdk::Encoding::Compact,
            Wire::Named => chorus_sdk::Encoding::MsgPack,
        },
        program: std::env::current_exe()?,
        coordinator: Arc::new(InProcess),
        python,
    };
    let progress: fn(&str) = |s| eprintln!("bench: {s}");
    let (rows, version) = chorus_bench::run(&opts, progress).await?;
    if json {
        outln!(
            "{}",
            serde_json::json!({
                "nats_server": version,
                "quick": quick,
                "rounds": rounds,
                "wire": format!("{wire:?}").to_lowercase(),
                "rows": rows,
            })
        );
    } else {
        outln!(
            "nats-server {version}, {} round(s) per scenario{}",
            rounds,
            if quick { ", quick" } else { "" }
        );
        out!("{}", chorus_bench::table(&rows));
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs the discovery scenario's coordinator in this process.
#[derive(Debug)]
struct InProcess;

impl CoordinatorLauncher for InProcess {
    fn start<'a>(
        &'a self,
        url: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn RunningCoordinator>>> {
        Box::pin(async move {
            let config = CoordinatorConfig {
                servers: url.to_owned(),
                metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                ..CoordinatorConfig::default()
            };
            let coordinator = Coordinator::start(config, false).await?;
            Ok(Box::new(Started(coordinator)) as Box<dyn RunningCoordinator>)
        })
    }

    fn start_with_gateway<'a>(
        &'a self,
        url: &'a str,
        tls: bool,
    ) -> BoxFuture<'a, anyhow::Result<WithGateway>> {
        Box::pin(async move {
            // HTTPS: a CA and a certificate for 127.0.0.1 of this run, in a directory that
            // lives while the gateway does (the files are read at its start).
            let certs = match tls {
                true => {
                    let dir = tempfile::tempdir()?;
                    let made = chorus_cli::certs::generate(
                        dir.path(),
                        &["127.0.0.1".into()],
                        "bench-client",
                    )?;
                    Some((dir, made))
                }
                false => None,
            };
            use sha2::Digest;
            // A key of this run only: the gateway listens on loopback while the scenario runs.
            let key = format!(
                "bench-{}{}",
                uuid::Uuid::now_v7().simple(),
                uuid::Uuid::now_v7().simple()
            );
            let config = CoordinatorConfig {
                servers: url.to_owned(),
                metrics_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
                gateway: GatewayConfig {
                    listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
                    identities: vec![EdgeIdentity {
                        id: "bench-edge".into(),
                        nkey_seed_file: None,
                        tenant: None,
                    }],
                    api_keys: vec![ApiKey {
                        identity: "bench-edge".into(),
                        sha256: hex::encode(sha2::Sha256::digest(key.as_bytes())),
                        scopes: Vec::new(),
                    }],
                    // The scenario measures latency, not the gateway's rate limit.
                    rate_per_second: 1e9,
                    rate_burst: 1e9,
                    tls: certs
                        .as_ref()
                        .map(|(_, made)| chorus_gateway::config::GatewayTls {
                            cert_file: made.server_cert.clone(),
                            key_file: made.server_key.clone(),
                            client_ca_file: None,
                        }),
                    ..GatewayConfig::default()
                },
                ..CoordinatorConfig::default()
            };
            let coordinator = Coordinator::start(config, false).await?;
            let addr = coordinator
                .gateway_addr()
                .ok_or_else(|| anyhow::anyhow!("the gateway did not start"))?;
            let ca_pem = match &certs {
                Some((_, made)) => Some(std::fs::read(&made.ca)?),
                None => None,
            };
            Ok(WithGateway {
                coordinator: Box::new(Started(coordinator)),
                addr,
                api_key: key,
                ca_pem,
            })
        })
    }
}

struct Started(Coordinator);

impl RunningCoordinator for Started {
    fn registered(&self) -> usize {
        self.0.discover(&chorus_sdk::DiscoverQuery::default()).len()
    }

    fn shutdown(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            self.0.shutdown().await;
        })
    }
}
