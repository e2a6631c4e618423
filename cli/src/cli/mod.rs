//! The `chorus` subcommands, one file each: its arguments (a clap `Args` struct) and a `run`
//! that takes them and the connection settings every command shares ([`ConnectionArgs`]).

mod agent;
mod agents;
mod api_key;
mod audit;
mod bench;
mod broadcast;
mod certs;
mod chaos;
mod context;
mod credits;
mod creds;
mod demo_agent;
mod dlq;
mod host;
mod hosting;
mod listen;
mod mcp;
mod metrics_http;
mod negotiate;
mod notify;
mod request;
mod send;
mod serve;
mod tap;
mod task;
mod up;
mod usage;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use chorus_coordinator::config::DEFAULT_SERVERS;
use chorus_sdk::security::ConnectionSecurity;
use chorus_sdk::{Agent, AgentOptions, BrokerOptions, Call, SdkError, Subjects};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "chorus",
    version = chorus_coordinator::VERSION,
    about = "Chorus: a message bus for AI agents, on NATS"
)]
pub(crate) struct Cli {
    /// NATS server URL(s), comma-separated [default: nats://127.0.0.1:4222, or the config
    /// file's for `serve`].
    #[arg(long, global = true, env = "CHORUS_NATS_URL", help_heading = CONNECTION)]
    server: Option<String>,
    /// CA certificate (PEM) of a TLS-secured server.
    #[arg(long, global = true, env = "CHORUS_TLS_CA", help_heading = CONNECTION)]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), for mutual TLS.
    #[arg(
        long,
        global = true,
        env = "CHORUS_TLS_CERT",
        requires = "tls_key",
        help_heading = CONNECTION
    )]
    tls_cert: Option<PathBuf>,
    /// Client key (PEM).
    #[arg(
        long,
        global = true,
        env = "CHORUS_TLS_KEY",
        requires = "tls_cert",
        help_heading = CONNECTION
    )]
    tls_key: Option<PathBuf>,
    /// File with the nkey seed to authenticate with (`chorus creds`).
    #[arg(long, global = true, env = "CHORUS_NKEY_FILE", help_heading = CONNECTION)]
    nkey_file: Option<PathBuf>,
    /// The agent id the CLI connects as (the name of its `chorus creds --cli` entry)
    /// [default: cli-<pid>]. With --nkey-file, the CLI also signs what it sends with that key.
    #[arg(long = "id", global = true, env = "CHORUS_ID", help_heading = CONNECTION)]
    agent_id: Option<String>,
    /// Subject root shared by every agent of one bus [default: chorus].
    #[arg(long, global = true, env = "CHORUS_ROOT", help_heading = CONNECTION)]
    root: Option<String>,
    /// The JetStream domain of the bus's streams, for a CLI on a leaf node without JetStream
    /// of its own whose hub runs JetStream in that domain (docs/OPERATIONS.md, "Sites and leaf
    /// nodes") [default: the server's own JetStream].
    #[arg(long, global = true, env = "CHORUS_JS_DOMAIN", help_heading = CONNECTION)]
    js_domain: Option<String>,
    /// Saved connection settings to use (`chorus context`) [default: the selected one]; a
    /// flag or variable above wins over the context's.
    #[arg(long, global = true, env = "CHORUS_CONTEXT", help_heading = CONNECTION)]
    context: Option<String>,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The help heading of the flags every command shares.
const CONNECTION: &str = "Connection (every command)";

impl Cli {
    /// The connection settings given on the command line or in the environment.
    fn given(&self) -> context::Saved {
        context::Saved {
            server: self.server.clone(),
            tls_ca: self.tls_ca.clone(),
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            nkey_file: self.nkey_file.clone(),
            id: self.agent_id.clone(),
            root: self.root.clone(),
            js_domain: self.js_domain.clone(),
        }
    }

    /// The connection settings: those given, over the context's (but for `serve`, which
    /// reads its own config file, and `context`, which manages them).
    fn connection(&self) -> anyhow::Result<ConnectionArgs> {
        let given = self.given();
        let settings = match self.command {
            Command::Serve(_) | Command::Context(_) => given,
            _ => context::active(self.context.as_deref())?.under(given),
        };
        Ok(ConnectionArgs {
            permissions: Arc::default(),
            server: settings.server,
            id: settings.id,
            root: settings.root,
            js_domain: settings.js_domain,
            security: ConnectionSecurity {
                tls_ca: settings.tls_ca,
                tls_cert: settings.tls_cert,
                tls_key: settings.tls_key,
                nkey_seed_file: settings.nkey_file,
            },
        })
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the coordinator: registry and discovery, broadcast, dead letters, metrics.
    Serve(serve::Args),
    /// List live agents (optionally only those offering a capability), least loaded first.
    Agents(agents::Args),
    /// Send a command to all live agents, a group or a capability's holders, and print the
    /// per-recipient report.
    Broadcast(broadcast::Args),
    /// Benchmark Chorus against raw async-nats, side by side, and print the table.
    Bench(bench::Args),
    /// Inject faults (server, node, agent and coordinator kills, pauses, partitions, hostile
    /// input, slow handlers, skewed clocks) under traffic, on servers it starts itself, and
    /// count what was lost.
    Chaos(chaos::Args),
    /// Create an agent's NATS identity (an nkey seed file) and print the `nats.conf`
    /// authorization entry that confines it to its own subjects.
    Creds(creds::Args),
    /// Create a gateway API key (a file of its own, mode 0600) and print the
    /// `[[gateway.api_keys]]` block, with its SHA-256 only, for the coordinator's configuration.
    ApiKey(api_key::Args),
    /// Generate a development CA, server and client certificates for NATS with TLS.
    Certs(certs::Args),
    /// Inspect and act on the dead-letter queue.
    Dlq(dlq::Args),
    /// Who asked for what, and what came of it: hosting commands, the gateway's writes, the
    /// web console's actions, from the audit stream.
    Audit(audit::Args),
    /// Submit, list, show, watch and cancel tasks (long work with progress), and respond to a
    /// task's question (`respond`).
    Task(task::Args),
    /// The credits ledger: what each agent earned and spent in negotiations settled at a
    /// price (`--by customer`: spent per customer; `--rounds`: the rounds themselves).
    Credits(credits::Args),
    /// Run a contract-net round: call for proposals on a capability, award the best by a
    /// policy, and print the bids and the winner's task.
    Negotiate(negotiate::Args),
    /// Run SDK agents that answer a capability with what they were sent and who answered, as
    /// a host runs them (one, or many on one connection): for trying hosting and measuring scale.
    Agent(agent::Args),
    /// Run one of the demo's agents (`chorus up`) on its own, as a host runs it from its
    /// manifest in deploy/demo/.
    DemoAgent(demo_agent::Args),
    /// Run this machine's host: start, limit, log, restart and stop agent processes from
    /// manifests, as the coordinator asks (docs/HOSTING.md).
    Host(host::Args),
    /// Deploy an agent from its manifest onto the hosts, and wait for each replica to run.
    Deploy(hosting::DeployArgs),
    /// Set how many replicas of a deployed agent run.
    Scale(hosting::ScaleArgs),
    /// Stop a deployed agent's replicas and forget its deployment.
    Terminate(hosting::TerminateArgs),
    /// List deployed agents: replicas wanted, where each runs, which failed and why.
    Deployments(hosting::ListArgs),
    /// List the hosts: live, silent or gone, their slots and the agents they run.
    Hosts(hosting::ListArgs),
    /// Print the last lines of a hosted agent's output, from its host.
    Logs(hosting::LogsArgs),
    /// What the agents handled, per customer, session, agent, endpoint or kind, over a window
    /// (`--by customer --since 1h`), from the usage every agent reports.
    Usage(usage::Args),
    /// Start a local NATS server (if none answers) and the demo agents, and show them talking.
    Up(up::Args),
    /// Push a notification to an agent (--to), or to a group, a capability's holders or every
    /// live agent through the coordinator; nothing is answered.
    Notify(notify::Args),
    /// Publish an event (--topic), or send a command to an agent (--to, --command) and print
    /// its result.
    Send(send::Args),
    /// Send a request to an agent (--to, --command) or a capability (--capability) and print
    /// the reply.
    Request(request::Args),
    /// Print events on topics matching a pattern (`*` one token, `>` the rest).
    Listen(listen::Args),
    /// Show every message on the bus as it passes, decoded: commands, requests, replies,
    /// events, heartbeats, with ids, correlation, hops, status and trace id.
    Tap(tap::Args),
    /// Save, select and list connection settings (server, TLS, credentials, id, root), as
    /// `nats context` does.
    Context(context::Args),
    /// MCP both ways: `serve --stdio` offers the bus's agents as tools to a local MCP host;
    /// `bridge` offers an MCP server's tools on the bus as capabilities.
    Mcp(mcp::Args),
    /// Print a completion script for a shell: `chorus completions bash > /etc/bash_completion.d/chorus`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
}

/// `chorus host-exec ...`, which a host starts its agents through: read before anything else
/// (no runtime, no logging), since it becomes the agent.
pub(crate) use host::exec as host_exec;

/// Runs the parsed command; the exit code says how it went.
pub(crate) async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let conn = cli.connection()?;
    let given = cli.given();
    let one_shot = !matches!(
        cli.command,
        Command::Serve(_)
            | Command::Up(_)
            | Command::Bench(_)
            | Command::Chaos(_)
            | Command::Mcp(_)
            | Command::Host(_)
            | Command::Agent(_)
            | Command::DemoAgent(_)
    );
    let command = dispatch(cli.command, &conn, given);
    if !one_shot {
        return command.await;
    }
    // A refused publish or subscription is reported beside the command's traffic, not as
    // its answer: whichever comes first ends the command.
    tokio::select! {
        outcome = command => outcome,
        text = conn.permissions.refused() => Err(conn.permission_denied(&text)),
    }
}

async fn dispatch(
    command: Command,
    conn: &ConnectionArgs,
    given: context::Saved,
) -> anyhow::Result<ExitCode> {
    match command {
        Command::Serve(args) => serve::run(args, conn).await,
        Command::Agents(args) => agents::run(args, conn).await,
        Command::Broadcast(args) => broadcast::run(args, conn).await,
        Command::Bench(args) => bench::run(args, conn).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::Creds(args) => creds::run(args, conn),
        Command::ApiKey(args) => api_key::run(args),
        Command::Certs(args) => certs::run(args),
        Command::Dlq(args) => dlq::run(args, conn).await,
        Command::Audit(args) => audit::run(args, conn).await,
        Command::Task(args) => task::run(args, conn).await,
        Command::Negotiate(args) => negotiate::run(args, conn).await,
        Command::Credits(args) => credits::run(args, conn).await,
        Command::Host(args) => host::run(args, conn).await,
        Command::Agent(args) => agent::run(args, conn).await,
        Command::DemoAgent(args) => demo_agent::run(args, conn).await,
        Command::Deploy(args) => hosting::deploy(args, conn).await,
        Command::Scale(args) => hosting::scale(args, conn).await,
        Command::Terminate(args) => hosting::terminate(args, conn).await,
        Command::Deployments(args) => hosting::deployments(args, conn).await,
        Command::Hosts(args) => hosting::hosts(args, conn).await,
        Command::Logs(args) => hosting::logs(args, conn).await,
        Command::Usage(args) => usage::run(args, conn).await,
        Command::Up(args) => up::run(args, conn).await,
        Command::Notify(args) => notify::run(args, conn).await,
        Command::Send(args) => send::run(args, conn).await,
        Command::Request(args) => request::run(args, conn).await,
        Command::Listen(args) => listen::run(args, conn).await,
        Command::Tap(args) => tap::run(args, conn).await,
        Command::Mcp(args) => mcp::run(args, conn).await,
        Command::Context(args) => context::run(args, given),
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut cmd, "chorus", &mut out);
            out!("{}", String::from_utf8_lossy(&out));
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// How every command reaches the bus: the server, the subject root, and the TLS and nkey
/// settings.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionArgs {
    /// `--server`, if given (`serve` then prefers it over its config file's).
    pub(crate) server: Option<String>,
    /// `--id`, if given: the identity one-shot commands connect as.
    pub(crate) id: Option<String>,
    /// `--root`, if given.
    pub(crate) root: Option<String>,
    /// `--js-domain`, if given.
    pub(crate) js_domain: Option<String>,
    /// `--tls-ca`, `--tls-cert`, `--tls-key`, `--nkey-file`.
    pub(crate) security: ConnectionSecurity,
    /// The permission refusals the server reported to this command's connections.
    pub(crate) permissions: Arc<PermissionWatch>,
}

impl ConnectionArgs {
    /// The server URL(s): `--server`, or the local default.
    pub(crate) fn url(&self) -> &str {
        self.server.as_deref().unwrap_or(DEFAULT_SERVERS)
    }

    /// The subject root: `--root`, or the default.
    pub(crate) fn root(&self) -> &str {
        self.root
            .as_deref()
            .unwrap_or(chorus_sdk::subject::DEFAULT_ROOT)
    }

    /// The subjects under the root.
    pub(crate) fn subjects(&self) -> anyhow::Result<Subjects> {
        Ok(Subjects::new(self.root())?)
    }

    /// Broker options for the server, secured as asked.
    pub(crate) fn broker_options(&self) -> anyhow::Result<BrokerOptions> {
        check_server_urls(self.url())?;
        let mut options = self.security.apply(BrokerOptions::new([self.url()]))?;
        if let Some(domain) = &self.js_domain {
            chorus_sdk::subject::validate_token("JetStream domain", domain)?;
            options = options.jetstream_domain(domain.clone());
        }
        Ok(options)
    }

    /// A short-lived agent for one command, speaking JSON, as `--id` (default `cli-<pid>`).
    ///
    /// It does not register: no heartbeat (so no manifest in the registry, and nothing
    /// published on the heartbeat subject) and no service-discovery answers; it only calls,
    /// sends and listens. With an nkey seed it signs what it sends with that key.
    pub(crate) async fn agent(&self) -> anyhow::Result<Agent> {
        let id = self.agent_id();
        let server = self.url();
        let mut options = AgentOptions::new(id)
            .broker(self.broker_options()?)
            .root(self.root())
            .encoding(chorus_sdk::Encoding::Json)
            .heartbeat_interval(Duration::ZERO)
            .service_discovery(false);
        if let Some(identity) = self.security.identity()? {
            options = options.identity(identity);
        }
        let agent = match options.connect().await {
            Ok(agent) => agent,
            // A subject refused while connecting (the inbox) is a permission, not reach.
            Err(e) => {
                if let Some(refused) = find_cause::<chorus_broker_adapter::PermissionViolation>(&e)
                {
                    return Err(self.permission_denied(&refused.0));
                }
                return Err(Unreachable(format!(
                    "cannot reach the bus at {server}: {e}{}",
                    connect_hint(&e, server).await
                ))
                .into());
            }
        };
        self.permissions.watch(agent.broker());
        Ok(agent)
    }

    /// The agent id one-shot commands connect as: `--id`, or `cli-<pid>`.
    fn agent_id(&self) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("cli-{}", std::process::id()))
    }

    /// Who the server sees on this command's connections, for an error message: the nkey
    /// user and the agent id.
    fn user(&self) -> String {
        let id = self.agent_id();
        match (&self.security.nkey_seed_file, self.security.identity()) {
            (Some(file), Ok(Some(identity))) => format!(
                "user {} (--nkey-file {}, --id {id})",
                identity.public_key(),
                file.display()
            ),
            _ => format!(
                "the connection without credentials (no --nkey-file; agent id {id}), which \
                 the server gives its default permissions"
            ),
        }
    }

    /// A permission refusal the server reported, as the command's error.
    fn permission_denied(&self, text: &str) -> anyhow::Error {
        // nats-server says `Permissions Violation for Publish to "subject"` (or Subscription).
        let what = text
            .split_once(" for ")
            .map_or(text, |(_, rest)| rest)
            .trim();
        PermissionDenied(format!(
            "permission denied: the server refused {what} for {}; the user's permissions in \
             the server's authorization block do not allow that subject (`chorus creds NAME \
             --cli` prints an entry for a CLI user: docs/SECURITY.md)",
            self.user()
        ))
        .into()
    }

    /// After a publish that gets no answer (an event): waits briefly for the server's report
    /// of a refusal, which comes after the flush that follows the publish.
    pub(crate) async fn settle_permissions(&self) -> anyhow::Result<()> {
        match tokio::time::timeout(PERMISSION_SETTLE, self.permissions.refused()).await {
            Ok(text) => Err(self.permission_denied(&text)),
            Err(_) => Ok(()),
        }
    }

    /// A plain connection (no agent) for operator commands, named `name`.
    ///
    /// Its replies come to the inbox prefix of its id (`_INBOX.<id>`, as an agent's do), which
    /// the id's `chorus creds` entry grants: a random `_INBOX.…` subject would be refused on a
    /// server with permissions.
    pub(crate) async fn broker(&self, name: &str) -> anyhow::Result<chorus_broker_adapter::Broker> {
        let url = self.url();
        let inbox = self.subjects()?.inbox_prefix(&self.agent_id())?;
        let broker = match self
            .broker_options()?
            .name(name)
            .inbox_prefix(inbox)
            .connect()
            .await
        {
            Ok(broker) => broker,
            Err(e) => {
                let hint = broker_hint(Some(&e), &e, url).await;
                return Err(
                    Unreachable(format!("cannot reach the bus at {url}: {e}{hint}")).into(),
                );
            }
        };
        self.permissions.watch(&broker);
        Ok(broker)
    }
}

/// Refuses a server URL of another protocol before dialling it: `http://` is the coordinator's
/// metrics or the gateway, not NATS.
fn check_server_urls(urls: &str) -> Result<(), Usage> {
    for url in urls.split(',').map(str::trim) {
        if let Some((scheme, _)) = url.split_once("://")
            && !["nats", "tls", "ws", "wss"].contains(&scheme.to_ascii_lowercase().as_str())
        {
            return Err(Usage(format!(
                "--server {url}: a NATS server URL starts with nats://, tls://, ws:// or wss:// \
                 (an {scheme}:// address is something else, such as the coordinator's metrics \
                 or the HTTP gateway)"
            )));
        }
    }
    Ok(())
}

/// Says once, in plain words on standard error, when `broker` loses the bus at `url` and once
/// when it is back, for as long as the returned handle is kept (`listen`, `tap`).
pub(crate) fn connection_notices(
    broker: &chorus_broker_adapter::Broker,
    url: &str,
) -> tokio_util::task::AbortOnDropHandle<()> {
    use chorus_broker_adapter::ConnectionEvent;
    use tokio::sync::broadcast::error::RecvError;
    let mut events = broker.events();
    let url = url.to_owned();
    tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
        let mut away = false;
        loop {
            match events.recv().await {
                Ok(ConnectionEvent::Disconnected) if !away => {
                    away = true;
                    eprintln!("chorus: lost the bus at {url}; reconnecting (Ctrl-C to stop)");
                }
                Ok(ConnectionEvent::Reconnected) if away => {
                    away = false;
                    eprintln!("chorus: reconnected to the bus at {url}");
                }
                Ok(_) | Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => break,
            }
        }
    }))
}

/// How long a command waits, after a publish with no answer, for the server to report that
/// it refused it.
const PERMISSION_SETTLE: Duration = Duration::from_millis(250);

/// The first permission refusal the server reported to any of a command's connections.
#[derive(Debug)]
pub(crate) struct PermissionWatch {
    first: tokio::sync::watch::Sender<Option<String>>,
    /// One reader per connection, aborted when the command's settings are dropped.
    readers: std::sync::Mutex<Vec<tokio_util::task::AbortOnDropHandle<()>>>,
}

impl Default for PermissionWatch {
    fn default() -> Self {
        PermissionWatch {
            first: tokio::sync::watch::Sender::new(None),
            readers: std::sync::Mutex::default(),
        }
    }
}

impl PermissionWatch {
    /// Reads `broker`'s connection events for permission refusals.
    fn watch(self: &Arc<Self>, broker: &chorus_broker_adapter::Broker) {
        use tokio::sync::broadcast::error::RecvError;
        let mut events = broker.events();
        let me = Arc::downgrade(self);
        let reader = tokio::spawn(async move {
            loop {
                match events.recv().await {
                    Ok(chorus_broker_adapter::ConnectionEvent::PermissionViolation(text)) => {
                        let Some(me) = me.upgrade() else { break };
                        me.first.send_if_modified(|first| {
                            first.is_none() && {
                                *first = Some(text);
                                true
                            }
                        });
                    }
                    Ok(_) | Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => break,
                }
            }
        });
        self.readers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(tokio_util::task::AbortOnDropHandle::new(reader));
    }

    /// The first refusal, once there is one.
    pub(crate) async fn refused(&self) -> String {
        let mut rx = self.first.subscribe();
        match rx.wait_for(Option::is_some).await {
            Ok(first) => first.clone().unwrap_or_default(),
            // The sender lives in `self`: it cannot close while this borrows it.
            Err(_) => std::future::pending().await,
        }
    }
}

/// The server refused a publish or subscription: exits with [`exit::REFUSED`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct PermissionDenied(pub(crate) String);

/// A value the command cannot use (a payload that is not JSON, a malformed topic, a server URL
/// of another protocol): exits with [`exit::USAGE`], as clap's own usage errors do.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Usage(pub(crate) String);

/// The exit code for a command's error: the one table, docs/OPERATIONS.md's, that a test holds
/// to the CLI.
pub(crate) fn exit_code(err: &anyhow::Error) -> u8 {
    let err: &(dyn std::error::Error + 'static) = err.as_ref();
    if find_cause::<Unreachable>(err).is_some() {
        return exit::UNREACHABLE;
    }
    if find_cause::<PermissionDenied>(err).is_some() {
        return exit::REFUSED;
    }
    if find_cause::<Usage>(err).is_some()
        || find_cause::<chorus_sdk::subject::SubjectError>(err).is_some()
    {
        return exit::USAGE;
    }
    match find_cause::<SdkError>(err) {
        Some(SdkError::Subject(_) | SdkError::InvalidCall(_)) => exit::USAGE,
        Some(
            SdkError::Remote { .. }
            | SdkError::Timeout(_)
            | SdkError::NoResponders(_)
            | SdkError::TaskState { .. }
            | SdkError::TaskNotFound(_)
            | SdkError::CircuitOpen { .. },
        ) => exit::REFUSED,
        _ => exit::FAILED,
    }
}

/// The bus could not be reached: exits with [`exit::UNREACHABLE`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Unreachable(pub(crate) String);

/// The exit codes, so a script can tell what went wrong (documented in docs/OPERATIONS.md):
/// 0 done, 1 failed on this side, 2 a usage error (a bad flag or value: clap's own code), and
/// these.
pub(crate) mod exit {
    /// Failed on this side: a file that cannot be read, a payload over the limit, an
    /// unexpected error.
    pub(crate) const FAILED: u8 = 1;
    /// A usage error: a bad flag or value (clap's own code for its errors).
    pub(crate) const USAGE: u8 = 2;
    /// The bus could not be reached (nothing listening, TLS or credentials refused).
    pub(crate) const UNREACHABLE: u8 = 3;
    /// The bus answered with a failure: a coded refusal or error, a timeout, no responders.
    pub(crate) const REFUSED: u8 = 4;
    /// `chorus chaos`: a guarantee did not hold under a fault (something acknowledged lost,
    /// an exactly-once handler run twice, a scenario's own check failed), or `--soak` flagged
    /// growth of a process's memory or descriptors.
    pub(crate) const GUARANTEE_BROKEN: u8 = 5;
}

/// Prints `value` as one line of JSON (the `--json` output of every command).
/// One line per recipient of a broadcast or notification: agent, outcome, code and reason.
pub(crate) fn print_recipients(recipients: &[chorus_sdk::registry::RecipientReport]) {
    for r in recipients {
        outln!(
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
}

pub(crate) fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    outln!("{}", serde_json::to_string(value)?);
    Ok(())
}

/// `err` and its causes, outermost first.
fn causes<'e>(
    err: &'e (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'e (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(err), |e| e.source())
}

/// The first cause of type `T` in `err`'s chain.
fn find_cause<'e, T: std::error::Error + 'static>(
    err: &'e (dyn std::error::Error + 'static),
) -> Option<&'e T> {
    causes(err).find_map(|c| c.downcast_ref::<T>())
}

/// What to do about a failed connection to `url`, when the error's kind or cause says, or
/// what answers there when it is not NATS.
async fn connect_hint(err: &chorus_sdk::SdkError, url: &str) -> String {
    let broker = match err {
        chorus_sdk::SdkError::Broker(e) => Some(e),
        _ => None,
    };
    broker_hint(broker, err, url).await
}

/// [`connect_hint`] for the broker's error (`broker`, when the failure is one) within `err`.
async fn broker_hint(
    broker: Option<&chorus_broker_adapter::Error>,
    err: &(dyn std::error::Error + 'static),
    url: &str,
) -> String {
    use chorus_broker_adapter::ErrorKind;
    match broker.map(chorus_broker_adapter::Error::kind) {
        Some(ErrorKind::Refused) => {
            return "\n  the server refused these credentials: check --nkey-file \
                    (CHORUS_NKEY_FILE) and --id (CHORUS_ID)"
                .to_owned();
        }
        Some(ErrorKind::Tls) => {
            return "\n  TLS could not be set up: --tls-ca (CHORUS_TLS_CA) names the CA that \
                    signed the server's certificate; a server that asks for client \
                    certificates needs --tls-cert and --tls-key (CHORUS_TLS_CERT, \
                    CHORUS_TLS_KEY); a server without TLS needs neither"
                .to_owned();
        }
        _ => {}
    }
    let refused = causes(err)
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .any(|io| io.kind() == std::io::ErrorKind::ConnectionRefused);
    if refused {
        return "\n  nothing listens there: `scripts/up` starts a local bus, or name the \
                server with --server (CHORUS_NATS_URL)"
            .to_owned();
    }
    // Something may listen there without speaking NATS (a metrics or HTTP port): say what.
    match chorus_cli::probe::not_nats(url).await {
        Some(what) => format!("\n  {what}"),
        None => String::new(),
    }
}

/// A payload given on the command line (none: null): JSON text, `-` to read it from standard
/// input, or `@path` to read it from a file, as `curl` and the `nats` CLI take them (a large
/// payload does not fit in an argument).
fn parse_json(text: Option<&str>) -> anyhow::Result<serde_json::Value> {
    let text = match text {
        None => return Ok(serde_json::Value::Null),
        Some("-") => {
            let mut buf = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut buf)
                .map_err(|e| anyhow::anyhow!("cannot read the payload from standard input: {e}"))?;
            buf
        }
        Some(t) => match t.strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("cannot read the payload from {path}: {e}"))?,
            None => t.to_owned(),
        },
    };
    serde_json::from_str(&text).map_err(|e| {
        Usage(format!(
            "the payload is not JSON: {e} (a string is quoted: '\"text\"')"
        ))
        .into()
    })
}

/// Refuses a payload the SDK would not send, before sending it, naming both sizes (one over
/// the server's `max_payload` goes by reference through the object store, PROTOCOL.md
/// section 7.11, up to the payload limit).
fn check_payload_size(payload: &serde_json::Value) -> anyhow::Result<()> {
    let size = serde_json::to_vec(payload).map(|v| v.len()).unwrap_or(0);
    let limit = chorus_sdk::payload::DEFAULT_MAX_PAYLOAD_BYTES;
    if size > limit {
        anyhow::bail!(
            "the payload is {size} bytes; payloads of at most {limit} bytes are sent (larger \
             ones by reference through the object store)"
        );
    }
    Ok(())
}

/// A reply as `--json` prints it.
#[derive(Debug, serde::Serialize)]
struct ReplyLine<'a> {
    status: u16,
    label: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    from: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

/// Makes `call` and prints the reply's payload (stdout) and status (stderr), or with `json`
/// one JSON line holding both; a coded failure exits with [`exit::REFUSED`].
async fn print_reply(
    agent: &Agent,
    call: Call,
    payload: &serde_json::Value,
    timeout: Duration,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let call = call.json_payload(payload)?.timeout(timeout);
    match agent.call(call).await {
        Ok(reply) => {
            let value = reply
                .payload_as::<serde_json::Value>()
                .unwrap_or(serde_json::Value::Null);
            if json {
                print_json(&ReplyLine {
                    status: reply.status().0,
                    label: reply.status().label(),
                    from: Some(&reply.envelope.from),
                    payload: Some(value),
                    reason: None,
                })?;
            } else {
                outln!("{value}");
                eprintln!("status {} from {}", reply.status(), reply.envelope.from);
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(err @ (SdkError::Remote { .. } | SdkError::Timeout(_) | SdkError::NoResponders(_))) => {
            let (from, reason) = match &err {
                SdkError::Remote { reason, from, .. } => (from.as_deref(), reason.clone()),
                other => (None, other.to_string()),
            };
            if json {
                print_json(&ReplyLine {
                    status: err.status().0,
                    label: err.status().label(),
                    from,
                    payload: None,
                    reason: Some(reason),
                })?;
            } else {
                eprintln!("{}", refusal_line(err.status(), from, &reason));
            }
            Ok(ExitCode::from(exit::REFUSED))
        }
        Err(err) => Err(err.into()),
    }
}

/// A failure as the CLI prints it, the code once: `status 5018 invalid_argument from
/// calculator: division by zero`.
pub(crate) fn refusal_line(
    status: chorus_sdk::StatusCode,
    from: Option<&str>,
    reason: &str,
) -> String {
    let from = from.map(|f| format!(" from {f}")).unwrap_or_default();
    if reason.is_empty() {
        format!("status {status}{from}")
    } else {
        format!("status {status}{from}: {reason}")
    }
}

#[cfg(test)]
mod tests {
    use super::exit;

    /// The constants are the codes docs/OPERATIONS.md's table gives for these meanings.
    #[test]
    fn exit_codes_match_the_operations_table() {
        let doc = include_str!("../../../docs/OPERATIONS.md");
        let row = |code: u8| {
            doc.lines()
                .find(|l| l.starts_with(&format!("| {code} |")))
                .unwrap_or_else(|| panic!("no row for {code}"))
                .to_owned()
        };
        assert!(row(exit::FAILED).contains("failed on this side"));
        assert!(row(exit::USAGE).contains("usage error"));
        assert!(row(exit::UNREACHABLE).contains("could not be reached"));
        assert!(row(exit::REFUSED).contains("answered with a failure"));
        assert!(row(exit::GUARANTEE_BROKEN).contains("chorus chaos"));
    }

    #[test]
    fn a_server_url_of_another_protocol_is_a_usage_error() {
        assert!(super::check_server_urls("nats://a:1,tls://b:2,ws://c,wss://d,e:4222").is_ok());
        let err = super::check_server_urls("nats://a:1,http://b:9464").expect_err("http");
        assert!(err.0.contains("http://b:9464"), "{}", err.0);
    }
}
