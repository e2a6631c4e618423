//! `chorus`: run the local bus and demo, and talk to any running bus.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use agent_sdk::{Agent, AgentOptions, Call, SdkError};
use chorus::Coordinator;
use chorus::demo::Demo;
use chorus::duration::parse_duration;
use chorus::local::{LocalNats, ensure_nats};
use clap::{Parser, Subcommand};
use futures::StreamExt;

#[derive(Debug, Parser)]
#[command(
    name = "chorus",
    version,
    about = "Chorus: a message bus for AI agents, on NATS"
)]
struct Cli {
    /// NATS server URL(s), comma-separated [default: nats://127.0.0.1:4222, or the config
    /// file's for `serve`].
    #[arg(long, global = true, env = "CHORUS_NATS_URL")]
    server: Option<String>,
    /// CA certificate (PEM) of a TLS-secured server [env: CHORUS_TLS_CA].
    #[arg(long, global = true, env = "CHORUS_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), for mutual TLS [env: CHORUS_TLS_CERT].
    #[arg(long, global = true, env = "CHORUS_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Client key (PEM) [env: CHORUS_TLS_KEY].
    #[arg(long, global = true, env = "CHORUS_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// File with the nkey seed to authenticate with (`chorus creds`) [env: CHORUS_NKEY_FILE].
    #[arg(long, global = true, env = "CHORUS_NKEY_FILE")]
    nkey_file: Option<PathBuf>,
    /// Subject root shared by every agent of one bus.
    #[arg(long, global = true, env = "CHORUS_ROOT", default_value = "chorus")]
    root: String,
    #[command(subcommand)]
    command: Command,
}

const DEFAULT_URL: &str = "nats://127.0.0.1:4222";

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the coordinator: registry and discovery, broadcast, dead letters, metrics.
    Serve {
        /// A TOML config file (see docs/COORDINATOR.md); `CHORUS_SERVE__*` variables override it.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// List live agents (optionally only those offering a capability), least loaded first.
    Agents {
        /// Only agents offering this capability.
        #[arg(long)]
        capability: Option<String>,
        /// Only agents in this group.
        #[arg(long)]
        group: Option<String>,
    },
    /// Send a command to all live agents, a group or a capability's holders, and print the
    /// per-recipient report.
    Broadcast {
        /// Every live agent.
        #[arg(long, conflicts_with_all = ["group", "capability"])]
        all: bool,
        /// A group.
        #[arg(long)]
        group: Option<String>,
        /// Holders of a capability.
        #[arg(long)]
        capability: Option<String>,
        /// The command.
        #[arg(long)]
        command: String,
        /// The payload, as JSON (default: null).
        json: Option<String>,
        /// How long each recipient has to answer.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        timeout: Duration,
    },
    /// Benchmark Chorus against raw async-nats, side by side, and print the table.
    Bench {
        /// Smaller counts (a minute instead of several).
        #[arg(long)]
        quick: bool,
        /// Rounds per scenario (raw and Chorus alternate; medians are reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Only scenarios whose name contains this (events, latency, throughput, durable,
        /// fan-out, discovery, memory).
        #[arg(long)]
        only: Option<String>,
    },
    /// Create an agent's NATS identity (an nkey seed file) and print the `nats.conf`
    /// authorization entry that confines it to its own subjects.
    Creds {
        /// The agent id (or `coordinator` with --coordinator).
        agent: String,
        /// The entry for the coordinator's user instead of an agent's.
        #[arg(long)]
        coordinator: bool,
        /// Capabilities the agent serves.
        #[arg(long)]
        serves: Vec<String>,
        /// What it may call: agent:<id> or cap:<capability> (default: anything).
        #[arg(long)]
        calls: Vec<String>,
        /// Event topic patterns it may publish (default: any).
        #[arg(long)]
        publishes: Vec<String>,
        /// Event topic patterns it may subscribe to (default: any).
        #[arg(long)]
        listens: Vec<String>,
        /// It has a durable inbox.
        #[arg(long)]
        durable: bool,
        /// Directory for the seed file `<agent>.nk` (written with mode 0600).
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
    /// Generate a development CA, server and client certificates for NATS with TLS.
    Certs {
        /// Directory to write ca.pem, server.pem, server-key.pem, client.pem, client-key.pem.
        #[arg(long, default_value = ".tls")]
        out: PathBuf,
        /// Names and addresses the server certificate is for.
        #[arg(long = "host", default_values = ["localhost", "127.0.0.1"])]
        hosts: Vec<String>,
        /// The client certificate's common name.
        #[arg(long, default_value = "chorus-client")]
        client: String,
    },
    /// Inspect and act on the dead-letter queue.
    Dlq {
        #[command(subcommand)]
        action: DlqAction,
    },
    /// Start a local NATS server (if none answers) and the demo agents, and show them talking.
    Up {
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
        metrics_addr: std::net::SocketAddr,
    },
    /// Publish an event (--topic), or send a command to an agent (--to, --command) and print
    /// its result.
    Send {
        /// Topic of the event to publish.
        #[arg(long, conflicts_with_all = ["to", "command"], required_unless_present = "to")]
        topic: Option<String>,
        /// Agent to send a command to.
        #[arg(long, requires = "command")]
        to: Option<String>,
        /// The command's name.
        #[arg(long, requires = "to")]
        command: Option<String>,
        /// The payload, as JSON (default: null).
        json: Option<String>,
        /// How long to wait for a command's result (with --durable: how long it may wait in
        /// the inbox before it expires).
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        timeout: Duration,
        /// Store the command in the agent's durable inbox instead of waiting for a result.
        #[arg(long, requires = "to")]
        durable: bool,
    },
    /// Send a request to an agent (--to, --command) or a capability (--capability) and print
    /// the reply.
    Request {
        /// Agent to ask.
        #[arg(long, requires = "command", conflicts_with = "capability")]
        to: Option<String>,
        /// The command's name.
        #[arg(long, requires = "to")]
        command: Option<String>,
        /// Capability to ask (any one agent serving it answers).
        #[arg(long, required_unless_present = "to")]
        capability: Option<String>,
        /// The payload, as JSON (default: null).
        json: Option<String>,
        /// How long to wait for the reply.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        timeout: Duration,
    },
    /// Print events on topics matching a pattern (`*` one token, `>` the rest).
    Listen {
        /// Topic pattern.
        #[arg(default_value = ">")]
        pattern: String,
        /// Exit after this many events.
        #[arg(long)]
        count: Option<usize>,
    },
}

#[derive(Debug, Subcommand)]
enum DlqAction {
    /// List dead letters, oldest first.
    Ls {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Show one dead letter in full.
    Show {
        /// Its id (from `ls`).
        id: u64,
    },
    /// Publish dead letters to their original subject again and remove them from the queue.
    Replay {
        /// The id to replay.
        #[arg(required_unless_present = "all")]
        id: Option<u64>,
        /// Replay every dead letter.
        #[arg(long, conflicts_with = "id")]
        all: bool,
    },
    /// Remove every dead letter.
    Purge,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo narrates what happens; its agents' warnings (a dead letter is expected) are
    // noise there unless asked for with RUST_LOG.
    let default_filter = if matches!(cli.command, Command::Up { .. }) {
        "error"
    } else {
        "warn"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(cli).await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("chorus: {}", chorus::error_chain(&err));
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let url = cli.server.clone().unwrap_or_else(|| DEFAULT_URL.to_owned());
    let security = chorus::config::ConnectionSecurity {
        tls_ca: cli.tls_ca.clone(),
        tls_cert: cli.tls_cert.clone(),
        tls_key: cli.tls_key.clone(),
        nkey_seed_file: cli.nkey_file.clone(),
    };
    SECURITY.set(security.clone()).ok();
    match cli.command {
        Command::Up {
            config,
            once,
            interval,
            metrics_addr,
        } => up(&url, &config, once, interval, metrics_addr).await,
        Command::Serve { config } => {
            let mut cfg = chorus::CoordinatorConfig::load(config.as_deref())?;
            if let Some(server) = cli.server {
                cfg.servers = server;
            }
            if cli.root != agent_sdk::subject::DEFAULT_ROOT {
                cfg.root = cli.root.clone();
            }
            if security != chorus::config::ConnectionSecurity::default() {
                cfg.security = security.clone();
            }
            let _otel = chorus::otel::from_env()?;
            let coordinator = Coordinator::start(cfg.clone(), true).await?;
            println!(
                "chorus serve: coordinator for root {:?} on {}; metrics on http://{}/metrics",
                cfg.root,
                cfg.servers,
                coordinator
                    .metrics_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_default()
            );
            shutdown_signal().await;
            println!("chorus serve: stopping");
            let finished = coordinator.shutdown().await;
            Ok(if finished {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Agents { capability, group } => {
            let agent = cli_agent(&url, &cli.root).await?;
            let query = agent_sdk::DiscoverQuery {
                capability,
                group,
                ..Default::default()
            };
            let found = agent.discover(&query).await;
            agent.shutdown().await;
            let found = found.map_err(|e| {
                anyhow::anyhow!("discovery failed (is `chorus serve` running?): {e}")
            })?;
            println!("{:<24} {:>5} {:<10} capabilities", "agent", "load", "state");
            for r in &found {
                let m = &r.manifest;
                let caps: Vec<&str> = m.capabilities.iter().map(|c| c.name.as_str()).collect();
                println!(
                    "{:<24} {:>5.2} {:<10} {}",
                    m.agent,
                    m.load,
                    format!("{:?}", m.availability).to_lowercase(),
                    caps.join(", ")
                );
            }
            eprintln!("{} live agent(s)", found.len());
            Ok(ExitCode::SUCCESS)
        }
        Command::Broadcast {
            all: _,
            group,
            capability,
            command,
            json,
            timeout,
        } => {
            let target = match (group, capability) {
                (Some(g), _) => agent_sdk::BroadcastTarget::Group(g),
                (_, Some(c)) => agent_sdk::BroadcastTarget::Capability(c),
                _ => agent_sdk::BroadcastTarget::All,
            };
            let agent = cli_agent(&url, &cli.root).await?;
            let payload = parse_json(json.as_deref())?;
            let report = agent.broadcast(&target, &command, &payload, timeout).await;
            agent.shutdown().await;
            let report = report.map_err(|e| {
                anyhow::anyhow!("broadcast failed (is `chorus serve` running?): {e}")
            })?;
            for r in &report.recipients {
                println!(
                    "{:<24} {:<10} {}{}",
                    r.agent,
                    format!("{:?}", r.outcome).to_lowercase(),
                    r.status,
                    r.reason
                        .as_deref()
                        .map(|x| format!(": {x}"))
                        .unwrap_or_default()
                );
            }
            eprintln!(
                "broadcast {}: {} delivered, {} failed, {} timed out",
                report.broadcast_id,
                report.count(agent_sdk::Outcome::Delivered),
                report.count(agent_sdk::Outcome::Failed),
                report.count(agent_sdk::Outcome::TimedOut)
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Dlq { action } => dlq(&url, &cli.root, action).await,
        Command::Certs { out, hosts, client } => {
            let files = chorus::certs::generate(&out, &hosts, &client)?;
            println!("CA:     {}", files.ca.display());
            println!(
                "server: {} (key {})",
                files.server_cert.display(),
                files.server_key.display()
            );
            println!(
                "client: {} (key {})",
                files.client_cert.display(),
                files.client_key.display()
            );
            println!(
                "nats.conf:\n  tls {{\n    cert_file: \"{}\"\n    key_file: \"{}\"\n    ca_file: \"{}\"\n    verify: true   # mutual TLS: clients must present a certificate from this CA\n  }}",
                files.server_cert.display(),
                files.server_key.display(),
                files.ca.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Creds {
            agent,
            coordinator,
            serves,
            calls,
            publishes,
            listens,
            durable,
            out,
        } => {
            let subjects = agent_sdk::Subjects::new(&cli.root)?;
            let identity = agent_sdk::security::Identity::generate();
            let seed = identity.seed().map_err(|e| anyhow::anyhow!(e))?;
            let path = out.join(format!("{agent}.nk"));
            write_secret(&path, &seed)?;
            let entry = if coordinator {
                chorus::creds::coordinator_entry(&subjects, &identity.public_key())
            } else {
                let role = chorus::creds::Role {
                    agent: agent.clone(),
                    serves,
                    calls,
                    publishes,
                    listens,
                    durable,
                };
                chorus::creds::authorization_entry(&subjects, &role, &identity.public_key())?
            };
            eprintln!(
                "seed written to {} (keep it secret; the agent connects with it)",
                path.display()
            );
            println!("{entry}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            quick,
            rounds,
            json,
            only,
        } => {
            let opts = chorus::bench::BenchOptions {
                url: cli.server.clone(),
                quick,
                rounds,
                only,
            };
            let progress: fn(&str) = |s| eprintln!("bench: {s}");
            let (rows, version) = chorus::bench::run(&opts, progress).await?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "nats_server": version,
                        "quick": quick,
                        "rounds": rounds,
                        "rows": rows,
                    })
                );
            } else {
                println!(
                    "nats-server {version}, {} round(s) per scenario{}",
                    rounds,
                    if quick { ", quick" } else { "" }
                );
                print!("{}", chorus::bench::table(&rows));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Send {
            topic,
            to,
            command,
            json,
            timeout,
            durable,
        } => {
            let agent = cli_agent(&url, &cli.root).await?;
            let payload = parse_json(json.as_deref())?;
            let code = match (topic, to, command) {
                (None, Some(to), Some(command)) if durable => {
                    let call = Call::agent(to.clone(), command)
                        .command()
                        .json_payload(&payload)?
                        .timeout(timeout);
                    let receipt = agent.send_durable(call).await?;
                    println!(
                        "stored for {to}: message {} at inbox sequence {}{}",
                        receipt.id,
                        receipt.stream_seq.unwrap_or_default(),
                        if receipt.duplicate {
                            " (already there)"
                        } else {
                            ""
                        }
                    );
                    ExitCode::SUCCESS
                }
                (Some(topic), _, _) => {
                    agent.publish(&topic, &payload).await?;
                    agent.broker().flush().await?;
                    println!("published to {topic}");
                    ExitCode::SUCCESS
                }
                (None, Some(to), Some(command)) => {
                    let call = Call::agent(to, command).command();
                    print_reply(&agent, call, &payload, timeout).await?
                }
                _ => anyhow::bail!("give --topic, or --to with --command"),
            };
            agent.shutdown().await;
            Ok(code)
        }
        Command::Request {
            to,
            command,
            capability,
            json,
            timeout,
        } => {
            let agent = cli_agent(&url, &cli.root).await?;
            let payload = parse_json(json.as_deref())?;
            let call = match (to, command, capability) {
                (Some(to), Some(command), _) => Call::agent(to, command),
                (_, _, Some(capability)) => Call::capability(capability),
                _ => anyhow::bail!("give --to with --command, or --capability"),
            };
            let code = print_reply(&agent, call, &payload, timeout).await?;
            agent.shutdown().await;
            Ok(code)
        }
        Command::Listen { pattern, count } => {
            let agent = cli_agent(&url, &cli.root).await?;
            let mut events = agent.subscribe(&pattern).await?;
            eprintln!("listening on {pattern} at {url} (Ctrl-C to stop)");
            let mut seen = 0;
            loop {
                tokio::select! {
                    event = events.next() => {
                        let Some(event) = event else { break };
                        let payload = event
                            .payload_as::<serde_json::Value>()
                            .map(|v| v.to_string())
                            .unwrap_or_else(|_| format!("<{} bytes of {}>", event.envelope.payload.len(), event.envelope.content_type));
                        println!("{} from {}: {payload}", event.topic(), event.envelope.from);
                        seen += 1;
                        if count.is_some_and(|n| seen >= n) {
                            break;
                        }
                    }
                    _ = shutdown_signal() => break,
                }
            }
            agent.shutdown().await;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The connection security given on the command line, for every command's connection.
static SECURITY: std::sync::OnceLock<chorus::config::ConnectionSecurity> =
    std::sync::OnceLock::new();

fn broker_options(server: &str) -> anyhow::Result<agent_sdk::BrokerOptions> {
    let options = agent_sdk::BrokerOptions::new([server]);
    match SECURITY.get() {
        Some(security) => security.apply(options),
        None => Ok(options),
    }
}

async fn cli_agent(server: &str, root: &str) -> anyhow::Result<Agent> {
    let id = format!("cli-{}", std::process::id());
    AgentOptions::new(id)
        .broker(broker_options(server)?)
        .root(root)
        .encoding(agent_sdk::Encoding::Json)
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the bus at {server}: {e}"))
}

fn parse_json(text: Option<&str>) -> anyhow::Result<serde_json::Value> {
    match text {
        None => Ok(serde_json::Value::Null),
        Some(t) => serde_json::from_str(t).map_err(|e| anyhow::anyhow!("payload is not JSON: {e}")),
    }
}

async fn print_reply(
    agent: &Agent,
    call: Call,
    payload: &serde_json::Value,
    timeout: Duration,
) -> anyhow::Result<ExitCode> {
    let call = call.json_payload(payload)?.timeout(timeout);
    match agent.call(call).await {
        Ok(reply) => {
            let value = reply
                .payload_as::<serde_json::Value>()
                .unwrap_or(serde_json::Value::Null);
            println!("{value}");
            eprintln!("status {} from {}", reply.status(), reply.envelope.from);
            Ok(ExitCode::SUCCESS)
        }
        Err(err @ (SdkError::Remote { .. } | SdkError::Timeout(_) | SdkError::NoResponders(_))) => {
            eprintln!("status {}: {err}", err.status());
            Ok(ExitCode::from(2))
        }
        Err(err) => Err(err.into()),
    }
}

async fn up(
    url: &str,
    config: &std::path::Path,
    once: bool,
    interval: Duration,
    metrics_addr: std::net::SocketAddr,
) -> anyhow::Result<ExitCode> {
    let _otel = chorus::otel::from_env()?;
    let nats = ensure_nats(url, config).await?;
    match &nats {
        LocalNats::Existing(url) => println!("chorus up: using the NATS server at {url}"),
        LocalNats::Started(server) => println!(
            "chorus up: started nats-server with {} at {} (monitoring {})",
            config.display(),
            server.url(),
            server.monitor_url().unwrap_or("off")
        ),
    }
    let coordinator_config = chorus::CoordinatorConfig {
        servers: nats.url().to_owned(),
        metrics_addr,
        ..chorus::CoordinatorConfig::default()
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
            _ = shutdown_signal() => break,
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

async fn dlq(url: &str, root: &str, action: DlqAction) -> anyhow::Result<ExitCode> {
    use chorus::service::dlq::{DeadLetterQueue, describe_envelope};
    let subjects = agent_sdk::Subjects::new(root)?;
    let broker = broker_options(url)?
        .name("chorus-dlq-cli")
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the bus at {url}: {e}"))?;
    let queue = DeadLetterQueue::new(broker.clone(), subjects);
    match action {
        DlqAction::Ls { limit } => {
            let entries = queue.list(limit).await?;
            println!(
                "{:>6}  {:<15} {:<22} {:<16} {:>8}  subject",
                "id", "reason", "status", "agent", "attempts"
            );
            for e in &entries {
                let l = &e.letter;
                println!(
                    "{:>6}  {:<15} {:<22} {:<16} {:>8}  {}",
                    e.id,
                    l.reason.as_str(),
                    l.status.to_string(),
                    l.agent,
                    l.attempts,
                    l.subject
                );
            }
            eprintln!(
                "{} dead letter(s) shown, {} in the queue",
                entries.len(),
                queue.depth().await?
            );
        }
        DlqAction::Show { id } => {
            let e = queue.show(id).await?;
            let l = &e.letter;
            println!("id:              {}", e.id);
            println!("reason:          {}", l.reason.as_str());
            println!("status:          {}", l.status);
            println!("detail:          {}", l.detail);
            println!("agent:           {}", l.agent);
            println!("subject:         {}", l.subject);
            println!("attempts:        {}", l.attempts);
            println!(
                "message id:      {}",
                l.message_id.map(|u| u.to_string()).unwrap_or_default()
            );
            println!("stored at (ms):  {}", l.stored_ms);
            println!("dead at (ms):    {}", l.dead_lettered_ms);
            println!("message:         {}", describe_envelope(&l.envelope));
        }
        DlqAction::Replay { id, all } => {
            let ids: Vec<u64> = if all {
                queue
                    .list(usize::MAX)
                    .await?
                    .into_iter()
                    .map(|e| e.id)
                    .collect()
            } else {
                id.into_iter().collect()
            };
            for id in &ids {
                match queue.replay(*id).await? {
                    Some(ack) => println!("replayed {id} as inbox message {}", ack.sequence),
                    None => println!("replayed {id} (core subject, no delivery guarantee)"),
                }
            }
            eprintln!("{} replayed", ids.len());
        }
        DlqAction::Purge => {
            let n = queue.purge().await?;
            println!("purged {n} dead letter(s)");
        }
    }
    let _ = broker.drain().await;
    Ok(ExitCode::SUCCESS)
}

/// Writes a secret readable by its owner only.
fn write_secret(path: &std::path::Path, secret: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options
        .open(path)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", path.display()))?;
    file.write_all(secret.as_bytes())?;
    file.write_all(b"\n")?;
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
