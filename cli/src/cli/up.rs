//! `chorus up`: a local NATS server (if none answers), a coordinator and the demo agents,
//! acting out the scenarios once or until Ctrl-C.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use chorus_cli::duration::parse_duration;
use chorus_cli::local::{LocalNats, ensure_nats};
use chorus_coordinator::{Coordinator, CoordinatorConfig};
use chorus_demo::{Demo, PYTHON_AGENT, PythonAgent};

use super::ConnectionArgs;
use super::demo_agent::{HostedDemo, manifests_in, python_manifest};
use super::metrics_http::{serve_metrics, taken_port_error};

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
    /// Where the coordinator serves /metrics (with --join: where the demo agents serve theirs).
    #[arg(long, env = "CHORUS_METRICS_ADDR", default_value = "127.0.0.1:9464")]
    metrics_addr: SocketAddr,
    /// The monitoring port of the NATS server `chorus up` starts [default: the config file's,
    /// 8222 in nats.conf]. Its client port is --server's (4222 by default).
    #[arg(long, env = "CHORUS_MONITOR_PORT")]
    monitor_port: Option<u16>,
    /// Run only the demo agents, on a bus that is already running (its NATS server and a
    /// coordinator): their metrics are served on --metrics-addr and announced to the
    /// coordinator's Prometheus service discovery (/sd/agents).
    #[arg(long)]
    join: bool,
    /// With --join: the URL Prometheus scrapes the demo's metrics at [default:
    /// http://<metrics-addr>/metrics; needed when --metrics-addr is 0.0.0.0].
    #[arg(long, requires = "join")]
    metrics_url: Option<String>,
    /// A Python interpreter with the Chorus Python SDK installed (`scripts/install-python-sdk`
    /// prints one): a Python agent joins the demo and talks with the Rust agents each round.
    #[arg(long, env = "CHORUS_PYTHON")]
    python: Option<PathBuf>,
    /// A coordinator config file (as `chorus serve --config` reads; see docs/COORDINATOR.md)
    /// for the coordinator `chorus up` starts, for example `deploy/gateway.toml` to open the
    /// HTTP gateway beside the demo. The NATS server and --metrics-addr still come from here.
    #[arg(long, conflicts_with = "join")]
    coordinator_config: Option<PathBuf>,
    /// A folder of agent manifests (docs/HOSTING.md) for the demo agents: a host in this
    /// process runs each, deployed through the coordinator [default: deploy/demo when it is
    /// here; without manifests the demo agents run in this process].
    #[arg(long, conflicts_with = "join")]
    manifests: Option<PathBuf>,
}

/// Where `chorus up` looks for the demo agents' manifests, from the repository's root.
const DEMO_MANIFESTS: &str = "deploy/demo";

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let Args {
        config,
        once,
        interval,
        metrics_addr,
        monitor_port,
        join,
        metrics_url,
        python,
        coordinator_config,
        manifests,
    } = args;
    let _otel = chorus_cli::otel::from_env()?;
    // Caught from here on: a signal during a round or the shutdown is not lost.
    let mut signals = crate::Signals::new()?;
    if join {
        let rounds = Rounds {
            once,
            interval,
            signals: &mut signals,
        };
        return run_joined(conn, metrics_addr, metrics_url, python, rounds).await;
    }
    let nats = ensure_nats(conn.url(), &config, monitor_port).await?;
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
        ..CoordinatorConfig::load(coordinator_config.as_deref())?
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
    if let Some(addr) = coordinator.gateway_addr() {
        outln!("chorus up: HTTP gateway at http://{addr} (docs/INTEROP.md)");
    }
    let mut manifests = match manifests {
        Some(dir) => Some((manifests_in(&dir)?, dir)),
        None if Path::new(DEMO_MANIFESTS).is_dir() => Some((
            manifests_in(Path::new(DEMO_MANIFESTS))?,
            DEMO_MANIFESTS.into(),
        )),
        None => None,
    };
    // The Python agent is hosted too where its manifest is, else started here.
    let mut python_hosted = false;
    if let (Some((list, dir)), Some(python)) = (&mut manifests, &python)
        && let Some(manifest) = python_manifest(dir, python)?
    {
        list.push(manifest);
        python_hosted = true;
    }
    let (demo, hosted) = match manifests {
        Some((manifests, dir)) => {
            let hosted = HostedDemo::start(conn, manifests).await?;
            outln!(
                "chorus up: agents online, hosted by `chorus host` (host-local) from {}: {}; their output in {} (`chorus logs AGENT`)",
                dir.display(),
                hosted.agent_ids().join(", "),
                hosted.log_dir().display()
            );
            (Demo::orchestrate(nats.url()).await?, Some(hosted))
        }
        None => {
            let say: fn(&str) = |line| outln!("{line}");
            let demo = Demo::start(nats.url(), say).await?;
            outln!(
                "chorus up: agents online, in this process (no {DEMO_MANIFESTS} here; --manifests DIR hosts them): {}",
                demo.agent_ids().join(", ")
            );
            (demo, None)
        }
    };
    let with_python = python.is_some();
    let python = if python_hosted {
        None
    } else {
        start_python(python.as_deref(), nats.url()).await?
    };
    let failed = Rounds {
        once,
        interval,
        signals: &mut signals,
    }
    .run(&demo, with_python)
    .await;
    let stop = async {
        if let Some(python) = python {
            python.stop().await;
        }
        demo.shutdown().await;
        if let Some(hosted) = hosted {
            hosted.stop().await;
        }
        coordinator.shutdown().await;
    };
    let forced = stop_gracefully(stop, &mut signals).await;
    // The server it started stops before it says so.
    drop(nats);
    Ok(finished(forced, failed))
}

/// How the scenarios repeat, and the signals that stop them.
struct Rounds<'a> {
    once: bool,
    interval: Duration,
    signals: &'a mut crate::Signals,
}

impl Rounds<'_> {
    /// Runs the scenarios (and the Python agent's, when one joined) once or until a signal;
    /// returns whether a round failed.
    async fn run(&mut self, demo: &Demo, with_python: bool) -> bool {
        let say: fn(&str) = |line| outln!("{line}");
        let mut failed = false;
        loop {
            // A signal stops the round where it is.
            let round = tokio::select! {
                round = async {
                    demo.run(say).await?;
                    if with_python {
                        demo.python_round(say).await?;
                    }
                    Ok::<_, chorus_sdk::SdkError>(())
                } => round,
                _ = self.signals.recv() => break,
            };
            match round {
                Ok(_) => outln!("chorus up: scenarios complete"),
                Err(err) => {
                    eprintln!("chorus up: scenario failed: {err}");
                    failed = true;
                }
            }
            if self.once {
                break;
            }
            outln!(
                "chorus up: running again in {:?}; try `chorus listen` or `chorus request --capability ocr ...` in another terminal; Ctrl-C to stop",
                self.interval
            );
            tokio::select! {
                _ = tokio::time::sleep(self.interval) => {}
                _ = self.signals.recv() => break,
            }
        }
        failed
    }
}

/// `chorus up --join`: the demo agents on a running bus, their metrics served and announced.
async fn run_joined(
    conn: &ConnectionArgs,
    metrics_addr: SocketAddr,
    metrics_url: Option<String>,
    python: Option<PathBuf>,
    mut rounds: Rounds<'_>,
) -> anyhow::Result<ExitCode> {
    if !bus_answers(conn).await {
        anyhow::bail!(
            "no Chorus bus answers at {}: start one (`scripts/up`, or `chorus serve` beside a \
             nats-server) before `chorus up --join`, or leave out --join to start one here",
            conn.url()
        );
    }
    let (server, url) = serve_metrics(metrics_addr, metrics_url).await?;
    let say: fn(&str) = |line| outln!("{line}");
    let demo = Demo::start_announcing(conn.url(), Some(&url), say).await?;
    outln!(
        "chorus up: demo agents joined the bus at {}: {}; metrics at {url}",
        conn.url(),
        demo.agent_ids().join(", ")
    );
    let python = start_python(python.as_deref(), conn.url()).await?;
    let failed = rounds.run(&demo, python.is_some()).await;
    let stop = async {
        if let Some(python) = python {
            python.stop().await;
        }
        demo.shutdown().await;
    };
    let forced = stop_gracefully(stop, rounds.signals).await;
    server.stop().await;
    Ok(finished(forced, failed))
}

/// Starts the demo's Python agent when `python` names an interpreter.
async fn start_python(
    python: Option<&std::path::Path>,
    server: &str,
) -> anyhow::Result<Option<PythonAgent>> {
    let Some(python) = python else {
        return Ok(None);
    };
    let agent = PythonAgent::start(python, server).await?;
    outln!(
        "chorus up: Python agent online: {PYTHON_AGENT} ({})",
        python.display()
    );
    Ok(Some(agent))
}

/// Runs `stop` within [`SHUTDOWN_LIMIT`]; a signal meanwhile forces it. Whether it was forced.
async fn stop_gracefully(
    stop: impl std::future::Future<Output = ()>,
    signals: &mut crate::Signals,
) -> bool {
    outln!("chorus up: stopping agents (Ctrl-C again to force)");
    tokio::select! {
        _ = stop => false,
        _ = signals.recv() => {
            eprintln!("chorus up: forced to stop");
            true
        }
        _ = tokio::time::sleep(SHUTDOWN_LIMIT) => {
            eprintln!("chorus up: agents did not stop within {SHUTDOWN_LIMIT:?}; stopping anyway");
            false
        }
    }
}

/// The exit status once stopped: 130 (128 + SIGINT) when forced, else whether a round failed.
fn finished(forced: bool, failed: bool) -> ExitCode {
    if forced {
        return ExitCode::from(130);
    }
    outln!("chorus up: stopped");
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
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
        agent.discover(&chorus_sdk::DiscoverQuery::default()),
    )
    .await;
    agent.shutdown().await;
    matches!(found, Ok(Ok(_)))
}

/// A coordinator that cannot bind its metrics address is told which flag moves it.
fn taken_port_hint(err: chorus_coordinator::Error, addr: SocketAddr) -> anyhow::Error {
    let in_use = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|io| io.kind() == std::io::ErrorKind::AddrInUse);
    if in_use {
        taken_port_error(addr)
    } else {
        anyhow::Error::new(err)
    }
}
