//! Resident memory of Chorus processes: an idle agent (`chorus listen`) and a coordinator
//! holding a thousand agents (`chorus serve`), each in its own process started from the
//! `chorus` executable the benchmark was given.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use chorus_sdk::{AgentOptions, DiscoverQuery};

use crate::scenarios::{REGISTRATION_DEADLINE, publish_fake_heartbeats};

/// How long a started process has to print its first line.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// Idleness (heartbeats, pings) an agent goes through before its memory is read: a fixed
/// duration is the point here, not a wait for an event.
const IDLE_BEFORE_READING: Duration = Duration::from_millis(500);
/// How often the coordinator's registry is checked while the agents register.
const REGISTRY_POLL: Duration = Duration::from_millis(100);
/// The subject root of the coordinator measured, apart from any other on the server.
const MEMORY_ROOT: &str = "benchmem";

/// Resident memory of a process, in bytes.
pub(crate) fn rss_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// RSS of an idle agent: `chorus listen` in its own process (one agent, one subscription).
pub(crate) async fn idle_agent_rss(program: &Path, url: &str) -> anyhow::Result<u64> {
    // It prints "listening on ..." to stderr once subscribed.
    let child = start(
        program,
        &["--server", url, "listen", "bench.idle.>"],
        &[],
        true,
    )
    .await?;
    idle_rss(child).await
}

/// RSS of a started agent once it has idled a moment; the agent is stopped after.
async fn idle_rss(mut child: tokio::process::Child) -> anyhow::Result<u64> {
    tokio::time::sleep(IDLE_BEFORE_READING).await;
    let rss = resident_bytes(&mut child).await;
    let _ = child.kill().await;
    rss
}

/// RSS of an idle agent built on the SDK alone, as a user's agent is: the `event_listener`
/// example (one agent, one subscription, heartbeats on), built by [`build_example`] beside the
/// `chorus` executable (`<target>/<profile>/examples/event_listener`). `chorus listen` carries
/// the whole CLI, the coordinator and this benchmark in its executable, whose pages the kernel
/// maps as it runs.
pub(crate) async fn idle_sdk_agent_rss(program: &Path, url: &str) -> anyhow::Result<u64> {
    let example = build_example(program, "chorus-sdk", &[], "event_listener").await?;
    // It prints "event_listener: listening on ..." to stdout once subscribed.
    idle_rss(start(&example, &[], &[("CHORUS_NATS_URL", url)], false).await?).await
}

/// How long building an example may take (the SDK is built already when `chorus` is, so this
/// is mostly linking; a first build of a cold cache takes minutes).
const BUILD_TIMEOUT: Duration = Duration::from_secs(900);

/// Builds the example `name` of `package` (with `features`) with the profile and into the
/// target directory of `program` (`<target>/<profile>/chorus`), so that the figure is of
/// today's code, and returns its path. Cargo runs in the current directory, which must be in the Chorus workspace (as
/// `chorus bench` is run from a clone); where it cannot run, an example built before is used,
/// and without one the error says how to build it.
pub(crate) async fn build_example(
    program: &Path,
    package: &str,
    features: &[&str],
    name: &str,
) -> anyhow::Result<PathBuf> {
    let profile_dir = program
        .parent()
        .ok_or_else(|| anyhow::anyhow!("{} has no directory", program.display()))?;
    let example = profile_dir.join("examples").join(name);
    let profile = match profile_dir.file_name().and_then(|p| p.to_str()) {
        Some("debug") => "dev",
        Some(p) => p,
        None => anyhow::bail!(
            "{} is not in a cargo profile's directory",
            program.display()
        ),
    };
    let target = profile_dir
        .parent()
        .ok_or_else(|| anyhow::anyhow!("{} is not in a target directory", program.display()))?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let built = tokio::time::timeout(
        BUILD_TIMEOUT,
        tokio::process::Command::new(cargo)
            .args(["build", "--quiet", "-p", package, "--example", name])
            .args(features.iter().flat_map(|f| ["--features", f]))
            .args(["--profile", profile, "--target-dir"])
            .arg(target)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .output(),
    )
    .await;
    let why = match built {
        Ok(Ok(out)) if out.status.success() => return Ok(example),
        Ok(Ok(out)) => {
            let said = String::from_utf8_lossy(&out.stderr);
            let last = said.lines().rev().find(|l| !l.trim().is_empty());
            format!("cargo build {} ({})", out.status, last.unwrap_or("").trim())
        }
        Ok(Err(e)) => format!("cargo could not run ({e})"),
        Err(_) => format!("cargo build took over {} s", BUILD_TIMEOUT.as_secs()),
    };
    if example.exists() {
        eprintln!("chorus bench: {why}; measuring the {name} built before");
        return Ok(example);
    }
    anyhow::bail!(
        "{why}; run chorus bench from a Chorus clone, or build it beside chorus: cargo build --profile {profile} -p {package} --example {name}{}",
        features
            .iter()
            .map(|f| format!(" --features {f}"))
            .collect::<String>()
    )
}

/// RSS of `chorus serve` in its own process once it holds `agents` registered agents.
pub(crate) async fn coordinator_rss(
    program: &Path,
    url: &str,
    agents: usize,
) -> anyhow::Result<u64> {
    // It prints its metrics address to stdout once serving.
    let mut child = start(
        program,
        &["--server", url, "--root", MEMORY_ROOT, "serve"],
        &[("CHORUS_SERVE__METRICS_ADDR", "127.0.0.1:0")],
        false,
    )
    .await?;
    let publisher = AgentOptions::new("bench-registrar")
        .servers([url])
        .root(MEMORY_ROOT)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .connect()
        .await?;
    publish_fake_heartbeats(&publisher, agents).await?;
    let deadline = Instant::now() + REGISTRATION_DEADLINE;
    while Instant::now() < deadline && child.try_wait()?.is_none() {
        if publisher
            .discover(&DiscoverQuery::default())
            .await
            .map(|v| v.len())
            .unwrap_or(0)
            >= agents
        {
            break;
        }
        tokio::time::sleep(REGISTRY_POLL).await;
    }
    let registered = publisher
        .discover(&DiscoverQuery::default())
        .await
        .map(|v| v.len())
        .unwrap_or(0);
    let rss = resident_bytes(&mut child).await;
    publisher.shutdown().await;
    let _ = child.kill().await;
    let rss = rss?;
    anyhow::ensure!(
        registered >= agents,
        "only {registered} of {agents} agents were registered within {REGISTRATION_DEADLINE:?}"
    );
    Ok(rss)
}

/// Starts `program` with `args` and `env` and waits (up to [`START_TIMEOUT`]) for its first line, on
/// stderr or stdout as `ready_on_stderr` says: its sign that it is up. The other stream is
/// kept for [`resident_bytes`] to report why it exited, if it did.
async fn start(
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    ready_on_stderr: bool,
) -> anyhow::Result<tokio::process::Child> {
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let ready: Box<dyn tokio::io::AsyncRead + Unpin + Send> = if ready_on_stderr {
        Box::new(
            child
                .stderr
                .take()
                .ok_or_else(|| anyhow::anyhow!("no stderr"))?,
        )
    } else {
        Box::new(
            child
                .stdout
                .take()
                .ok_or_else(|| anyhow::anyhow!("no stdout"))?,
        )
    };
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(ready));
    tokio::time::timeout(START_TIMEOUT, lines.next_line()).await??;
    Ok(child)
}

/// Resident memory of a child that must still be running: an error, with what it printed,
/// if it has exited (a reading of zero would pass any memory goal).
async fn resident_bytes(child: &mut tokio::process::Child) -> anyhow::Result<u64> {
    if let Some(status) = child.try_wait()? {
        let mut said = String::new();
        if let Some(mut stderr) = child.stderr.take() {
            let _ = tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut said).await;
        }
        anyhow::bail!("it exited ({status}): {}", said.trim());
    }
    child
        .id()
        .and_then(rss_of)
        .ok_or_else(|| anyhow::anyhow!("its resident memory could not be read"))
}
