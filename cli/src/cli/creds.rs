//! `chorus creds`: an agent's nkey seed file and the `nats.conf` entry that confines it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::ConnectionArgs;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The agent id (or `coordinator` with --coordinator).
    agent: String,
    /// The entry for the coordinator's user instead of an agent's.
    #[arg(long, conflicts_with = "cli")]
    coordinator: bool,
    /// The entry for a `chorus` CLI user instead of an agent's: the CLI connects with
    /// `--id <agent> --nkey-file <agent>.nk`, calls, sends, broadcasts and listens, and never
    /// registers (no heartbeat, no command subject). --calls, --publishes and --listens narrow
    /// it as for an agent.
    #[arg(long, conflicts_with = "serves")]
    cli: bool,
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
    /// It submits, works on or watches tasks (`chorus task`).
    #[arg(long)]
    tasks: bool,
    /// It reads, replays and purges dead letters (`chorus dlq`): for an operator.
    #[arg(long)]
    dlq: bool,
    /// It may watch all traffic, every agent's messages and replies (`chorus tap`): for an
    /// operator.
    #[arg(long)]
    tap: bool,
    /// It registers this Synadia Agent Protocol agent, `<agent>.<owner>.<session>` (a gateway
    /// identity with an `[[gateway.sap]]` binding; repeat for several).
    #[arg(long, value_name = "AGENT.OWNER.SESSION")]
    sap: Vec<String>,
    /// The entry of a gateway identity (`[[gateway.identities]]` with its own
    /// `nkey_seed_file`): its durable inbox, and the A2A push configs its callers register,
    /// kept under its own name.
    #[arg(long, conflicts_with = "cli")]
    gateway: bool,
    /// The entry of a machine that runs agents (`chorus host --name NAME` connects as the
    /// agent `host-NAME`: give that id): its report in the hosts bucket under its own name,
    /// and the heartbeats of the agents it runs.
    #[arg(long, conflicts_with = "cli")]
    host: bool,
    /// Directory for the seed file `<agent>.nk` (written with mode 0600) and the public key
    /// `<agent>.pub`.
    #[arg(long, default_value = ".")]
    out: PathBuf,
}

/// Mode of the seed file: readable by its owner only.
#[cfg(unix)]
const SECRET_MODE: u32 = 0o600;

pub(crate) fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let subjects = conn.subjects()?;
    let identity = chorus_sdk::security::Identity::generate();
    let seed = identity.seed()?;
    // As `chorus certs --out` does, the directory is made if it does not exist yet.
    std::fs::create_dir_all(&args.out)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", args.out.display()))?;
    let path = args.out.join(format!("{}.nk", args.agent));
    write_secret(&path, &seed)?;
    // The public key beside it, for whoever trusts this identity's signatures
    // (`AgentOptions::trust`, the coordinator's `trusted_keys`).
    let public = args.out.join(format!("{}.pub", args.agent));
    std::fs::write(&public, format!("{}\n", identity.public_key()))
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", public.display()))?;
    let entry = if args.coordinator {
        chorus_coordinator::creds::coordinator_entry(&subjects, &identity.public_key())
    } else {
        let role = chorus_coordinator::creds::Role {
            agent: args.agent.clone(),
            serves: args.serves,
            calls: args.calls,
            publishes: args.publishes,
            listens: args.listens,
            durable: args.durable,
            tasks: args.tasks,
            dlq: args.dlq,
            tap: args.tap,
            cli: args.cli,
            sap: args.sap,
            host: args.host,
            gateway: args.gateway,
        };
        chorus_coordinator::creds::authorization_entry(&subjects, &role, &identity.public_key())?
    };
    if args.cli {
        eprintln!(
            "seed written to {} (keep it secret; use it as `chorus --id {} --nkey-file {}`), \
             public key to {}",
            path.display(),
            args.agent,
            path.display(),
            public.display()
        );
    } else {
        eprintln!(
            "seed written to {} (keep it secret; the agent connects with it), public key to {}",
            path.display(),
            public.display()
        );
    }
    outln!("{entry}");
    Ok(ExitCode::SUCCESS)
}

/// Writes a secret readable by its owner only; an existing file is never overwritten.
pub(super) fn write_secret(path: &Path, secret: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(SECRET_MODE);
    }
    let mut file = options
        .open(path)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", path.display()))?;
    file.write_all(secret.as_bytes())?;
    file.write_all(b"\n")?;
    Ok(())
}
