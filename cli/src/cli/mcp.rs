//! `chorus mcp serve --stdio | bridge`: MCP both ways. `serve --stdio` offers the bus's agents
//! as tools to a desktop MCP host that starts it as a local command (the gateway's MCP server
//! on standard input and output); `bridge` starts an MCP server and offers each of its tools
//! on the bus as a capability of an agent of its own (docs/INTEROP.md, "MCP").

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chorus_cli::duration::parse_duration;
use chorus_cli::mcp_client::{McpClient, McpError, Tool};
use chorus_sdk::registry::REPLY_MCP_TOOL_RESULT;
use chorus_sdk::{AgentOptions, Context, Description, HandlerError, StatusCode};
use clap::Subcommand;
use serde_json::Value;

use super::ConnectionArgs;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Serve the bus's agents as MCP tools on standard input and output (MCP's stdio
    /// transport), for a desktop MCP host that starts it as a local command. Logs go to
    /// standard error.
    Serve {
        /// Speak MCP on standard input and output (the one transport of this command; the
        /// gateway serves Streamable HTTP at /mcp).
        #[arg(long, required = true)]
        stdio: bool,
        /// The agent id it acts as on the bus [default: --id, or mcp-stdio].
        #[arg(long)]
        identity: Option<String>,
        /// A coordinator config file whose `[gateway]` limits apply (request timeout, largest
        /// message, `[gateway.mcp]`); its listener and credentials are not used.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Start an MCP server (the command after `--`, speaking MCP on its standard input and
    /// output), or connect to one (--url, Streamable HTTP), and offer each of its tools on the
    /// bus as capability `<prefix>.<tool>` of agent --agent. Its death (or three missed pings)
    /// withdraws them (the agent says goodbye); it is restarted (or reconnected) with backoff,
    /// at most --max-restarts times in a row.
    #[command(group(clap::ArgGroup::new("mcp_server").required(true).args(["url", "command"])))]
    Bridge {
        /// The agent id the tools are offered under.
        #[arg(long)]
        agent: String,
        /// The capabilities' prefix [default: the agent id].
        #[arg(long)]
        prefix: Option<String>,
        /// How long one tool call may take.
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        timeout: Duration,
        /// Tool calls at once (beyond it, callers are refused 5019 and may retry elsewhere).
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Failed calls in a row (timeouts, protocol errors, the server gone) that open the
        /// bridge's breaker: calls are then refused 5019 at once for --breaker-open.
        #[arg(long, default_value_t = 5)]
        breaker_failures: u32,
        /// How long an open breaker refuses calls before one is let through.
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        breaker_open: Duration,
        /// Restarts of a server that keeps dying before the bridge gives up (a server that ran
        /// a minute starts the count again).
        #[arg(long, default_value_t = 5)]
        max_restarts: u32,
        /// The agent's heartbeat interval (the registry drops it after three missed).
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        heartbeat: Duration,
        /// The MCP server's Streamable HTTP endpoint (`https://host/mcp`), instead of a command.
        #[arg(long)]
        url: Option<String>,
        /// With --url: a CA file (PEM) to trust besides the system's.
        #[arg(long, requires = "url")]
        ca_file: Option<PathBuf>,
        /// The MCP server's command and arguments.
        #[arg(last = true, num_args = 1..)]
        command: Vec<String>,
    },
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    match args.action {
        Action::Serve {
            stdio: _,
            identity,
            config,
        } => serve(conn, identity, config).await,
        Action::Bridge {
            agent,
            prefix,
            timeout,
            concurrency,
            breaker_failures,
            breaker_open,
            max_restarts,
            heartbeat,
            url,
            ca_file,
            command,
        } => {
            let server = match url {
                Some(url) => Server::Url { url, ca_file },
                None => Server::Command(command),
            };
            let bridge = Bridge {
                prefix: prefix.unwrap_or_else(|| agent.clone()),
                agent,
                timeout,
                concurrency,
                breaker: (breaker_failures.max(1), breaker_open),
                max_restarts,
                heartbeat,
                server,
            };
            bridge.run(conn).await
        }
    }
}

async fn serve(
    conn: &ConnectionArgs,
    identity: Option<String>,
    config: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    let mut gateway = match &config {
        Some(path) => {
            chorus_coordinator::config::CoordinatorConfig::load(Some(path.as_path()))?.gateway
        }
        None => chorus_gateway::GatewayConfig::default(),
    };
    let id = identity
        .or_else(|| conn.id.clone())
        .unwrap_or_else(|| "mcp-stdio".to_owned());
    chorus_sdk::subject::validate_token("identity", &id)?;
    gateway.listen = None;
    gateway.identities = vec![chorus_gateway::config::EdgeIdentity {
        id,
        nkey_seed_file: None,
        tenant: None,
    }];
    let mut bus = chorus_gateway::Bus::new(conn.url());
    bus.root = conn.root().to_owned();
    bus.security = conn.security.clone();
    chorus_gateway::Gateway::serve_mcp_stdio(
        &bus,
        &gateway,
        tokio::io::stdin(),
        tokio::io::stdout(),
    )
    .await?;
    Ok(ExitCode::SUCCESS)
}

/// Where the bridged server is.
enum Server {
    /// Started here, speaking on its standard input and output.
    Command(Vec<String>),
    /// Reached over Streamable HTTP.
    Url {
        url: String,
        ca_file: Option<PathBuf>,
    },
}

impl Server {
    fn name(&self) -> String {
        match self {
            Server::Command(command) => command.first().cloned().unwrap_or_default(),
            Server::Url { url, .. } => url.clone(),
        }
    }
}

struct Bridge {
    agent: String,
    prefix: String,
    timeout: Duration,
    concurrency: usize,
    breaker: (u32, Duration),
    max_restarts: u32,
    heartbeat: Duration,
    server: Server,
}

/// A server that ran this long is healthy: its restart count starts again.
const STABLE: Duration = Duration::from_secs(60);
/// The longest wait between restarts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

impl Bridge {
    async fn run(&self, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
        let mut signals = crate::Signals::new()?;
        let program = self.server.name();
        let mut restarts = 0;
        let mut backoff = Duration::from_secs(1);
        loop {
            let started = Instant::now();
            let outcome = tokio::select! {
                outcome = self.serve_once(conn, &program) => outcome,
                _ = signals.recv() => return Ok(ExitCode::SUCCESS),
            };
            if let Err(e) = outcome {
                eprintln!("chorus mcp bridge: {e:#}");
            }
            if started.elapsed() >= STABLE {
                restarts = 0;
                backoff = Duration::from_secs(1);
            }
            restarts += 1;
            if restarts > self.max_restarts {
                anyhow::bail!(
                    "the MCP server ({program}) stopped {restarts} times in a row; giving up (--max-restarts {})",
                    self.max_restarts
                );
            }
            eprintln!(
                "chorus mcp bridge: restarting the MCP server in {backoff:?} ({restarts} of at most {})",
                self.max_restarts
            );
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                _ = signals.recv() => return Ok(ExitCode::SUCCESS),
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One life of the server: started, its tools offered, until it exits (its agent then
    /// says goodbye) or this future is dropped (the agent stops, and the child process is
    /// killed when the last handle to it goes).
    async fn serve_once(&self, conn: &ConnectionArgs, program: &str) -> anyhow::Result<()> {
        let name = "chorus-mcp-bridge";
        let client = match &self.server {
            Server::Command(command) => {
                let (program, args) = command
                    .split_first()
                    .ok_or_else(|| anyhow::anyhow!("give the MCP server's command after --"))?;
                Arc::new(McpClient::start(program, args, name, self.timeout).await?)
            }
            Server::Url { url, ca_file } => {
                McpClient::connect(url, ca_file.as_deref(), name, self.timeout, self.heartbeat)
                    .await?
            }
        };
        let tools = client.tools(self.timeout).await?;
        let agent = AgentOptions::new(self.agent.as_str())
            .broker(conn.broker_options()?)
            .root(conn.root())
            .heartbeat_interval(self.heartbeat)
            .max_in_flight(self.concurrency)
            .connect()
            .await?;
        let breaker = Arc::new(Breaker::new(self.breaker.0, self.breaker.1));
        let mut offered = Vec::new();
        for tool in &tools {
            let capability = format!("{}.{}", self.prefix, tool.name);
            if let Err(e) = chorus_sdk::subject::validate_dotted("capability", &capability) {
                eprintln!("chorus mcp bridge: tool {:?} not offered: {e}", tool.name);
                continue;
            }
            let call = ToolCall {
                client: Arc::clone(&client),
                tool: tool.name.clone(),
                timeout: self.timeout,
                breaker: Arc::clone(&breaker),
            };
            agent
                .on_capability(&capability, move |_ctx: Context, arguments: Value| {
                    let call = call.clone();
                    async move { call.run(arguments).await }
                })
                .await?;
            describe(&agent, &capability, tool);
            offered.push(capability);
        }
        println!(
            "chorus mcp bridge: {} offers {} tool(s) of {program}: {}",
            self.agent,
            offered.len(),
            offered.join(", ")
        );
        client.exited().await;
        eprintln!("chorus mcp bridge: the MCP server ({program}) is gone; its tools are withdrawn");
        // The goodbye takes the capabilities off the registry at once.
        agent.shutdown().await;
        client.stop().await;
        Ok(())
    }
}

/// The tool's description and schema in the agent's manifest, where they are valid.
fn describe(agent: &chorus_sdk::Agent, capability: &str, tool: &Tool) {
    let text = tool
        .description
        .clone()
        .unwrap_or_else(|| format!("The MCP tool {}, bridged.", tool.name));
    let text: String = text
        .char_indices()
        .take_while(|(i, _)| *i < chorus_sdk::MAX_DESCRIPTION_BYTES - 4)
        .map(|(_, c)| c)
        .collect();
    let with_schema = Description::new(text.clone())
        .input_schema(tool.input_schema.clone())
        .reply_format(REPLY_MCP_TOOL_RESULT);
    if let Err(e) = agent.describe(capability, with_schema) {
        eprintln!("chorus mcp bridge: {capability}: {e}; offered without its schema");
        let _ = agent.describe(
            capability,
            Description::new(text).reply_format(REPLY_MCP_TOOL_RESULT),
        );
    }
}

/// A breaker over the server's health: `failures` failed calls in a row open it for `open`.
struct Breaker {
    failures: u32,
    open: Duration,
    in_a_row: AtomicU32,
    open_until: Mutex<Option<Instant>>,
}

impl Breaker {
    fn new(failures: u32, open: Duration) -> Breaker {
        Breaker {
            failures,
            open,
            in_a_row: AtomicU32::new(0),
            open_until: Mutex::new(None),
        }
    }

    /// Whether a call may go through now (after the open period, one does).
    fn admit(&self) -> bool {
        let mut until = self
            .open_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match *until {
            Some(t) if Instant::now() < t => false,
            Some(_) => {
                // Half-open: this call tries; another failure opens it again.
                *until = None;
                self.in_a_row.store(self.failures - 1, Ordering::Relaxed);
                true
            }
            None => true,
        }
    }

    fn record(&self, healthy: bool) {
        if healthy {
            self.in_a_row.store(0, Ordering::Relaxed);
            return;
        }
        if self.in_a_row.fetch_add(1, Ordering::Relaxed) + 1 >= self.failures {
            *self
                .open_until
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(Instant::now() + self.open);
        }
    }
}

#[derive(Clone)]
struct ToolCall {
    client: Arc<McpClient>,
    tool: String,
    timeout: Duration,
    breaker: Arc<Breaker>,
}

impl ToolCall {
    /// Calls the tool: its result is the reply (an MCP tool result); a tool error is a
    /// refusal 5017 with its text; no answer in time 5005; the server gone or its breaker
    /// open 5019.
    async fn run(&self, arguments: Value) -> Result<Value, HandlerError> {
        if !self.breaker.admit() {
            return Err(HandlerError::new(
                StatusCode::UNAVAILABLE,
                format!(
                    "the bridge's breaker for the MCP server is open: {} failed calls in a row",
                    self.breaker.failures
                ),
            ));
        }
        let arguments = match arguments {
            Value::Null => Value::Object(serde_json::Map::new()),
            a => a,
        };
        let outcome = self.client.call(&self.tool, arguments, self.timeout).await;
        self.breaker
            .record(matches!(outcome, Ok(_) | Err(McpError::Refused { .. })));
        match outcome {
            Ok(result) if result["isError"] == Value::Bool(true) => {
                let text: Vec<&str> = result["content"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c["text"].as_str())
                    .collect();
                Err(HandlerError::failed(format!(
                    "the tool {} failed: {}",
                    self.tool,
                    text.join(" ")
                )))
            }
            Ok(result) => Ok(result),
            Err(McpError::Refused { code, message, .. }) => Err(HandlerError::invalid_argument(
                format!("the MCP server refused the call ({code}): {message}"),
            )),
            Err(McpError::Timeout(_)) => Err(HandlerError::new(
                StatusCode::TIMEOUT,
                format!(
                    "the tool {} did not answer within {:?}",
                    self.tool, self.timeout
                ),
            )),
            Err(e @ (McpError::Exited | McpError::Io(_))) => {
                Err(HandlerError::new(StatusCode::UNAVAILABLE, e.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_opens_after_failures_in_a_row_and_lets_one_through_later() {
        let breaker = Breaker::new(3, Duration::from_millis(0));
        assert!(breaker.admit());
        breaker.record(false);
        breaker.record(true);
        breaker.record(false);
        breaker.record(false);
        assert!(breaker.open_until.lock().expect("lock").is_none());
        breaker.record(false);
        assert!(breaker.open_until.lock().expect("lock").is_some());
        // Open for no time: the next call is let through, and one more failure opens it again.
        assert!(breaker.admit());
        breaker.record(false);
        assert!(breaker.open_until.lock().expect("lock").is_some());
        let held = Breaker::new(1, Duration::from_secs(60));
        held.record(false);
        assert!(!held.admit());
    }
}
