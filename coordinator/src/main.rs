//! `chorus`: run the local bus and demo, and talk to any running bus.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use agent_sdk::{Agent, AgentOptions, Call, SdkError};
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
    /// NATS server URL(s), comma-separated.
    #[arg(
        long,
        global = true,
        env = "CHORUS_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    server: String,
    /// Subject root shared by every agent of one bus.
    #[arg(long, global = true, env = "CHORUS_ROOT", default_value = "chorus")]
    root: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
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
        /// How long to wait for a command's result.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        timeout: Duration,
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

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("chorus: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Up {
            config,
            once,
            interval,
        } => up(&cli.server, &config, once, interval).await,
        Command::Send {
            topic,
            to,
            command,
            json,
            timeout,
        } => {
            let agent = cli_agent(&cli.server, &cli.root).await?;
            let payload = parse_json(json.as_deref())?;
            let code = match (topic, to, command) {
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
            let agent = cli_agent(&cli.server, &cli.root).await?;
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
            let agent = cli_agent(&cli.server, &cli.root).await?;
            let mut events = agent.subscribe(&pattern).await?;
            eprintln!("listening on {pattern} at {} (Ctrl-C to stop)", cli.server);
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

async fn cli_agent(server: &str, root: &str) -> anyhow::Result<Agent> {
    let id = format!("cli-{}", std::process::id());
    AgentOptions::new(id)
        .servers([server])
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
) -> anyhow::Result<ExitCode> {
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
    drop(nats);
    println!("chorus up: stopped");
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
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
