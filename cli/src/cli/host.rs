//! `chorus host`: run this machine's host, the supervisor that starts, limits, logs, restarts
//! and stops agent processes from manifests, as the coordinator (or an allowed operator) asks
//! over the bus (docs/HOSTING.md). And `chorus host-exec`, hidden: what the host starts each
//! agent through, to set its limits and tie its life to the host's before it becomes the agent.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use chorus_cli::duration::parse_duration;
use chorus_host::process::{AllowedPrograms, LogLimits, RunAs, SupervisorConfig};
use chorus_host::protocol::{COORDINATOR, Capacity};
use chorus_host::service::{
    DEFAULT_MAX_AGENTS, DEFAULT_REPORT_INTERVAL, HOSTING_PERMISSION, Host, HostOptions,
};
use chorus_sdk::security::SignaturePolicy;

use super::ConnectionArgs;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// This host's name, unique on the bus (its agent is `host-<name>`) [default: the
    /// machine's host name].
    #[arg(long)]
    name: Option<String>,
    /// Agents this host runs at most.
    #[arg(long, default_value_t = DEFAULT_MAX_AGENTS)]
    max_agents: u32,
    /// Memory it may give its agents, MiB (what manifests ask for is counted against it;
    /// 0: not counted).
    #[arg(long, default_value_t = 0)]
    memory_mb: u64,
    /// CPU cores it may give its agents (0: not counted).
    #[arg(long, default_value_t = 0.0)]
    cpus: f64,
    /// GPUs it has for its agents: a manifest's `resources.gpus` are counted against them (0:
    /// it takes no agent that needs one). Placement counts them; the agents' processes see
    /// the machine's devices as they are.
    #[arg(long, default_value_t = 0)]
    gpus: u32,
    /// The region it is in (one name), for manifests that prefer one
    /// (`placement.preferred_region`).
    #[arg(long)]
    region: Option<String>,
    /// Where its agents' output is kept, one file per agent, rotated [default: the user's
    /// state folder, chorus/hosts/<name>/logs].
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// Where agents built from a repository (a manifest's `[build]`) are cloned and built
    /// [default: beside the log folder, `<log dir>.builds`].
    #[arg(long)]
    build_dir: Option<PathBuf>,
    /// Size at which an agent's log file is rotated, bytes.
    #[arg(long, default_value_t = chorus_host::process::DEFAULT_LOG_FILE_BYTES)]
    log_file_bytes: u64,
    /// Rotated log files kept per agent, besides the live one.
    #[arg(long, default_value_t = chorus_host::process::DEFAULT_LOG_FILES)]
    log_files: u32,
    /// Senders allowed to command this host, besides the coordinator (repeatable): an agent
    /// id, such as an operator's `--id`.
    #[arg(long = "allow", value_name = "ID")]
    allow: Vec<String>,
    /// Public keys of senders that never register, `ID=KEY` (the coordinator's, on a bus that
    /// signs: `chorus creds` writes it to `coordinator.pub`); a KEY naming a file is read.
    #[arg(long = "trust", value_name = "ID=KEY")]
    trust: Vec<String>,
    /// How often the host writes its report for the coordinator.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    report_interval: Duration,
    /// How long an agent has to stop after SIGTERM before it is killed.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    stop_grace: Duration,
    /// Start agents directly, without limits, and without tying their life to the host's
    /// (they may outlive a killed host).
    #[arg(long)]
    no_launcher: bool,
    /// The user agents run as, with their health commands and builds. A host started by root
    /// runs them as `nobody` unless told another; `--user root` runs them as root. A host
    /// started by another user runs them as itself and refuses any other.
    #[arg(long, value_name = "NAME")]
    user: Option<String>,
    /// Programs manifests may start (repeatable): a path (`/usr/bin/python3`), a folder ending
    /// in `/` (`/opt/agents/`), or a name found on the PATH (`python3`). Without one any
    /// program may; with one, a manifest naming another (or with a `[build]`) is refused and
    /// its replicas reported failed, saying why.
    #[arg(long = "allow-program", value_name = "PROGRAM")]
    allow_program: Vec<String>,
    /// Whether each agent runs in a bubblewrap sandbox (`bwrap`): the machine's files
    /// read-only but its working folder, and its own process namespace, so it
    /// sees no other agent. `auto`: when bwrap is installed.
    #[arg(long, value_enum, default_value_t = Sandbox::Auto)]
    sandbox: Sandbox,
    /// More environment for every agent (`chorus up` passes its OTLP endpoint on).
    #[arg(skip)]
    pub(crate) env: Vec<(String, String)>,
}

impl Args {
    /// A host on this machine named `name`, its agents' logs in `log_dir`, the defaults
    /// otherwise (`chorus up` runs one for the demo agents).
    pub(crate) fn local(name: &str, log_dir: PathBuf) -> Args {
        Args {
            name: Some(name.to_owned()),
            max_agents: DEFAULT_MAX_AGENTS,
            memory_mb: 0,
            cpus: 0.0,
            gpus: 0,
            region: None,
            log_dir: Some(log_dir),
            build_dir: None,
            log_file_bytes: chorus_host::process::DEFAULT_LOG_FILE_BYTES,
            log_files: chorus_host::process::DEFAULT_LOG_FILES,
            allow: Vec::new(),
            trust: Vec::new(),
            report_interval: DEFAULT_REPORT_INTERVAL,
            stop_grace: chorus_host::process::DEFAULT_STOP_GRACE,
            no_launcher: false,
            // The demo's host runs its agents as whoever runs `chorus up`, as they are.
            user: Some(chorus_host::process::user::current_user()),
            allow_program: Vec::new(),
            sandbox: Sandbox::None,
            env: Vec::new(),
        }
    }
}

/// Whether a host's agents run in a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Sandbox {
    /// bubblewrap when `bwrap` is on the PATH, none otherwise.
    Auto,
    /// bubblewrap; the host does not start without it.
    Bwrap,
    /// None.
    None,
}

/// The `bwrap` on the PATH, if any.
fn find_bwrap() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("bwrap"))
        .find(|candidate| candidate.is_file())
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let (host, name, log_dir) = start(args, conn).await?;
    eprintln!(
        "chorus host {name}: taking commands as host-{name}, agents' logs in {}",
        log_dir.display()
    );
    let mut signals = crate::Signals::new()?;
    signals.recv().await;
    eprintln!("chorus host {name}: stopping its agents");
    host.shutdown().await;
    Ok(ExitCode::SUCCESS)
}

/// Starts the host `args` describe on the bus `conn` reaches; returns it, its name and where
/// its agents' logs go.
pub(crate) async fn start(
    args: Args,
    conn: &ConnectionArgs,
) -> anyhow::Result<(Host, String, PathBuf)> {
    let name = match args.name {
        Some(name) => name,
        None => machine_name()?,
    };
    chorus_sdk::subject::validate_token("host name", &name)?;
    if let Some(region) = &args.region {
        chorus_sdk::subject::validate_token("region", region)?;
    }
    let log_dir = match args.log_dir {
        Some(dir) => dir,
        None => state_dir()?
            .join("chorus")
            .join("hosts")
            .join(&name)
            .join("logs"),
    };
    std::fs::create_dir_all(&log_dir)
        .with_context(|| format!("cannot make the log folder {}", log_dir.display()))?;
    let chorus =
        std::env::current_exe().context("cannot find the chorus binary to launch agents with")?;
    // What every agent needs to reach the bus as this host does; and a manifest that runs
    // `chorus` runs this host's own.
    let mut env = vec![
        ("CHORUS_NATS_URL".to_owned(), conn.url().to_owned()),
        ("CHORUS_ROOT".to_owned(), conn.root().to_owned()),
    ];
    if let Some(path) = path_with(&chorus) {
        env.push(("PATH".to_owned(), path));
    }
    env.extend(args.env);
    let launcher = (!args.no_launcher).then_some(chorus);
    for (var, path) in [
        ("CHORUS_TLS_CA", &conn.security.tls_ca),
        ("CHORUS_TLS_CERT", &conn.security.tls_cert),
        ("CHORUS_TLS_KEY", &conn.security.tls_key),
    ] {
        if let Some(path) = path {
            env.push((var.to_owned(), path.display().to_string()));
        }
    }
    let run_as = RunAs::of_this_process(args.user.as_deref())?;
    if run_as.is_root() {
        tracing::warn!(
            "agents run as root (--user root): every manifest deployed here runs with the machine's full rights"
        );
    }
    let sandbox = match (args.sandbox, find_bwrap()) {
        (Sandbox::None, _) => None,
        (_, Some(_)) if args.no_launcher => {
            if args.sandbox == Sandbox::Bwrap {
                bail!("--sandbox bwrap needs the launcher: drop --no-launcher");
            }
            None
        }
        (_, Some(bwrap)) => Some(bwrap),
        (Sandbox::Bwrap, None) => {
            bail!(
                "--sandbox bwrap: bubblewrap (bwrap) is not on the PATH; install it (Debian: apt-get install bubblewrap) or pass --sandbox none"
            )
        }
        (Sandbox::Auto, None) => None,
    };
    let isolation = match &sandbox {
        Some(_) => "sandboxed by bubblewrap",
        None => "not sandboxed",
    };
    let agents_line = format!("agents run as {}, {isolation}", run_as.name());
    let supervisor = SupervisorConfig {
        run_as,
        sandbox,
        host: name.clone(),
        env,
        log_dir: log_dir.clone(),
        log_limits: LogLimits {
            file_bytes: args.log_file_bytes,
            files: args.log_files,
            ..LogLimits::default()
        },
        launcher,
        stop_grace: args.stop_grace,
    };
    let options = HostOptions {
        name: name.clone(),
        capacity: Capacity {
            agents: args.max_agents,
            memory_mb: args.memory_mb,
            cpu: args.cpus,
            gpus: args.gpus,
            region: args.region.clone(),
        },
        report_interval: if args.report_interval.is_zero() {
            DEFAULT_REPORT_INTERVAL
        } else {
            args.report_interval
        },
        bucket_replicas: 1,
        build_dir: args.build_dir.clone(),
        allowed_programs: AllowedPrograms::new(args.allow_program.clone()),
    };
    let broker = conn.broker_options()?;
    let identity = conn.security.identity()?;
    let mut trusted = Vec::new();
    for entry in &args.trust {
        trusted.push(trust_entry(entry)?);
    }
    let mut allowed = vec![COORDINATOR.to_owned()];
    allowed.extend(args.allow);
    if identity.is_none() {
        tracing::warn!(
            "no --nkey-file: commands are taken from {} by their `from` alone, unverified; \
             on a shared bus run hosts with credentials (docs/HOSTING.md)",
            allowed.join(", ")
        );
    }
    let root = conn.root().to_owned();
    let host = Host::start(
        move |mut options| {
            options = options.broker(broker).root(root);
            for id in &allowed {
                options = options.grant(id.clone(), [HOSTING_PERMISSION]);
            }
            for (id, key) in trusted {
                options = options.trust(id, key);
            }
            match identity {
                Some(identity) => options
                    .identity(identity)
                    .verify_signatures(SignaturePolicy {
                        require_signed: true,
                        ..SignaturePolicy::default()
                    }),
                None => options.trust_unverified_senders(true),
            }
        },
        options,
        supervisor,
    )
    .await?;
    eprintln!("chorus host {name}: {agents_line}");
    Ok((host, name, log_dir))
}

/// This host's `PATH` with the folder of `chorus` (this program) first, so that agents find the
/// same `chorus` as their host; `None` when that folder cannot be told.
fn path_with(chorus: &std::path::Path) -> Option<String> {
    let folder = chorus.parent()?;
    let inherited = std::env::var_os("PATH").unwrap_or_default();
    let folders = std::iter::once(folder.to_path_buf()).chain(std::env::split_paths(&inherited));
    std::env::join_paths(folders).ok()?.into_string().ok()
}

/// `ID=KEY`, where KEY is a public key or a file holding one.
fn trust_entry(entry: &str) -> anyhow::Result<(String, String)> {
    let Some((id, key)) = entry.split_once('=') else {
        bail!("--trust {entry:?}: give ID=KEY (a public key, or a file holding one)");
    };
    let key = if std::path::Path::new(key).is_file() {
        std::fs::read_to_string(key)
            .with_context(|| format!("--trust {id}: cannot read {key}"))?
            .trim()
            .to_owned()
    } else {
        key.to_owned()
    };
    if !(key.len() == 56 && key.starts_with('U')) {
        bail!("--trust {id}: {key:?} is not a user public key (U..., 56 characters)");
    }
    Ok((id.to_owned(), key))
}

fn machine_name() -> anyhow::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|n| n.trim().to_owned())
        .unwrap_or_default();
    // A host name may hold dots; the host's name is one subject token.
    let name: String = name
        .split('.')
        .next()
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    if name.is_empty() {
        bail!("cannot tell this machine's name: give --name");
    }
    Ok(name)
}

fn state_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(home) => Ok(PathBuf::from(home).join(".local").join("state")),
        None => bail!("no place for agents' logs: give --log-dir, or set XDG_STATE_HOME or HOME"),
    }
}

/// `chorus host-exec SPEC... -- COMMAND ARGS...`: applies the limits in SPEC to this process,
/// ties its life to its parent's (the host's), and becomes COMMAND. Returns only on failure.
pub(crate) fn exec(args: Vec<OsString>) -> ExitCode {
    let err = chorus_host::process::launch::exec(args);
    eprintln!("chorus host-exec: {err}");
    ExitCode::from(127)
}
