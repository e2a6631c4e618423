//! One replica's process: the command line and environment it is started with, the start
//! itself (in a process group of its own, output pumped into its log), signals to its group,
//! and what it uses, read from `/proc`.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::launch::{HOST_EXEC, LaunchSpec};
use super::logs::{SharedLog, StderrTail, Stream, read_bounded_line};
use super::{
    ENV_AGENT_ID, ENV_CUSTOMER, ENV_DEPLOYMENT, ENV_HOST, ENV_NKEY_FILE, ENV_REPLICA, INHERITED_ENV,
};
use crate::manifest::Manifest;

/// How long the output of an exited replica is still read before its pumps are stopped (a
/// grandchild outside its process group may hold the pipes open).
const PUMP_DRAIN: Duration = Duration::from_secs(1);
/// Read buffer of each output pump.
const PUMP_BUFFER: usize = 8 * 1024;

/// Everything needed to start one replica's process, worked out once per
/// `Supervisor::run` and used for every restart.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    /// The command as the manifest names it, for errors.
    pub(crate) command: String,
    program: OsString,
    args: Vec<OsString>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) cwd: Option<PathBuf>,
    /// Resolve the command before starting the launcher, so a missing one is a spawn error
    /// rather than a crash of the launcher.
    check_command: bool,
    /// The user and group it is started as without the launcher (the launcher switches
    /// itself); `None`: the host's.
    user: Option<(u32, u32)>,
}

/// The environment of a replica: the inherited basics, the manifest's `run.env`, the host's
/// `env` (the bus address and such, which a manifest cannot override), and the replica's
/// identity. Later entries win.
pub(crate) fn agent_env(
    host: &str,
    host_env: &[(String, String)],
    manifest: &Manifest,
    replica: u32,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = INHERITED_ENV
        .iter()
        .filter_map(|name| {
            std::env::var(name)
                .ok()
                .map(|value| ((*name).to_owned(), value))
        })
        .collect();
    env.extend(manifest.run.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.extend(host_env.iter().cloned());
    env.push((ENV_AGENT_ID.to_owned(), manifest.replica_id(replica)));
    env.push((ENV_DEPLOYMENT.to_owned(), manifest.id.clone()));
    env.push((ENV_REPLICA.to_owned(), replica.to_string()));
    env.push((ENV_HOST.to_owned(), host.to_owned()));
    if let Some(nkey) = &manifest.credentials.nkey_file {
        env.push((
            ENV_NKEY_FILE.to_owned(),
            nkey.to_string_lossy().into_owned(),
        ));
    }
    if let Some(customer) = &manifest.customer {
        env.push((ENV_CUSTOMER.to_owned(), customer.clone()));
    }
    env
}

/// A command in a process group of its own (signals go to the whole group: its own children
/// stop with it), with exactly `env`, stdin empty, stdout and stderr piped, killed if its
/// handle is dropped without stopping it (a runtime torn down): how an agent and its health
/// checks are started.
pub(crate) fn group_command(
    program: impl AsRef<std::ffi::OsStr>,
    args: &[impl AsRef<std::ffi::OsStr>],
    env: &[(String, String)],
    cwd: Option<&Path>,
    user: Option<(u32, u32)>,
) -> Command {
    let mut command = Command::new(program);
    if let Some((uid, gid)) = user {
        // As root, `uid` also drops the supplementary groups before the program runs.
        command.uid(uid).gid(gid);
    }
    command
        .args(args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    command
}

impl Launch {
    /// The command line of a replica: the manifest's command itself, or the launcher
    /// (`<launcher> host-exec <spec> -- <command> <args>`) when there is one.
    pub(crate) fn new(
        manifest: &Manifest,
        env: Vec<(String, String)>,
        launcher: Option<(&Path, &LaunchSpec)>,
    ) -> Launch {
        let command = manifest.run.command.clone();
        let own_args = manifest.run.args.iter().map(OsString::from);
        let (program, args) = match launcher {
            Some((launcher, spec)) => {
                let mut args = vec![OsString::from(HOST_EXEC)];
                args.extend(spec.to_args());
                args.push("--".into());
                args.push(command.clone().into());
                args.extend(own_args);
                (launcher.as_os_str().to_owned(), args)
            }
            None => (command.clone().into(), own_args.collect()),
        };
        Launch {
            command,
            program,
            args,
            env,
            cwd: manifest.run.working_dir.clone(),
            check_command: launcher.is_some(),
            user: None,
        }
    }

    /// Started directly (without the launcher) as `user`, when it is set.
    pub(crate) fn run_by(mut self, user: Option<(u32, u32)>) -> Launch {
        self.user = user;
        self
    }

    /// Starts the process in a process group of its own, stdin empty, stdout and stderr pumped
    /// into `log` (stderr's last lines also into `tail`) by tasks of `tracker`.
    pub(crate) fn spawn(
        &self,
        log: &SharedLog,
        tail: &StderrTail,
        line_bytes: usize,
        tracker: &TaskTracker,
    ) -> io::Result<Running> {
        if self.check_command {
            resolve(&self.command, &self.env, self.cwd.as_deref())?;
        }
        let mut command = group_command(
            &self.program,
            &self.args,
            &self.env,
            self.cwd.as_deref(),
            self.user,
        );
        // Forked from the calling thread, a tokio worker that lives as long as the runtime: the
        // launcher's parent-death signal fires when that thread exits (see `launch`).
        let mut child = command.spawn()?;
        let pid = child
            .id()
            .ok_or_else(|| io::Error::other("the process exited before its pid was read"))?;
        let mut pumps = Vec::with_capacity(2);
        if let Some(stdout) = child.stdout.take() {
            pumps.push(tracker.spawn(pump(stdout, Stream::Out, log.clone(), None, line_bytes)));
        }
        if let Some(stderr) = child.stderr.take() {
            pumps.push(tracker.spawn(pump(
                stderr,
                Stream::Err,
                log.clone(),
                Some(tail.clone()),
                line_bytes,
            )));
        }
        Ok(Running {
            child,
            pid,
            since: Instant::now(),
            started: SystemTime::now(),
            pumps,
        })
    }
}

/// Finds `command` as `exec` would: a path (relative to `cwd`), or a name on the `PATH` of
/// `env`. Fails with `NotFound` (or `PermissionDenied` for a file that cannot be executed).
fn resolve(command: &str, env: &[(String, String)], cwd: Option<&Path>) -> io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |path: &Path| {
        std::fs::metadata(path)
            .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
    };
    if command.contains('/') {
        let path = match cwd {
            Some(cwd) => cwd.join(command),
            None => PathBuf::from(command),
        };
        if executable(&path) {
            return Ok(path);
        }
        let kind = if path.exists() {
            io::ErrorKind::PermissionDenied
        } else {
            io::ErrorKind::NotFound
        };
        return Err(io::Error::new(
            kind,
            format!("{} is not an executable file", path.display()),
        ));
    }
    let path_var = env
        .iter()
        .rev()
        .find(|(name, _)| name == "PATH")
        .map(|(_, value)| value.as_str())
        .unwrap_or_default();
    std::env::split_paths(path_var)
        .map(|dir| dir.join(command))
        .find(|candidate| executable(candidate))
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{command} is not on PATH ({path_var})"),
            )
        })
}

/// Copies one output stream into the log, line by line.
async fn pump<R: AsyncRead + Unpin>(
    reader: R,
    stream: Stream,
    log: SharedLog,
    tail: Option<StderrTail>,
    line_bytes: usize,
) {
    let mut reader = BufReader::with_capacity(PUMP_BUFFER, reader);
    let mut line = Vec::new();
    loop {
        match read_bounded_line(&mut reader, line_bytes, &mut line).await {
            Ok(Some(truncated)) => {
                log.write(stream, &line, truncated);
                if let Some(tail) = &tail {
                    tail.push(String::from_utf8_lossy(&line).into_owned());
                }
            }
            Ok(None) => break,
            Err(err) => {
                tracing::debug!(error = %err, "an agent's output stream failed");
                break;
            }
        }
    }
}

/// A started replica process.
#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) child: Child,
    pub(crate) pid: u32,
    /// When it started, for its uptime.
    pub(crate) since: Instant,
    /// When it started, for its status.
    pub(crate) started: SystemTime,
    pumps: Vec<JoinHandle<()>>,
}

impl Running {
    /// Waits for the exit, bounded by `bound`; `None` if it did not exit in time.
    pub(crate) async fn wait_for(&mut self, bound: Duration) -> Option<ExitStatus> {
        match tokio::time::timeout(bound, self.child.wait()).await {
            Ok(Ok(status)) => Some(status),
            Ok(Err(err)) => {
                tracing::warn!(pid = self.pid, error = %err, "cannot wait for an agent process");
                None
            }
            Err(_) => None,
        }
    }

    /// SIGTERM to the group, `grace` to exit, then SIGKILL and `kill_wait` more.
    pub(crate) async fn terminate(
        &mut self,
        grace: Duration,
        kill_wait: Duration,
    ) -> Option<ExitStatus> {
        signal_group(self.pid, Signal::SIGTERM);
        if let Some(status) = self.wait_for(grace).await {
            return Some(status);
        }
        signal_group(self.pid, Signal::SIGKILL);
        self.wait_for(kill_wait).await
    }

    /// After the exit: kills what is left of the process group (the agent's own children) and
    /// lets the pumps write the last output, for at most [`PUMP_DRAIN`].
    pub(crate) async fn finish(&mut self) {
        // The group outlives its leader while any member lives; the kill follows the reaping at
        // once, so the id cannot have been taken by another group in between in practice.
        signal_group(self.pid, Signal::SIGKILL);
        let deadline = Instant::now() + PUMP_DRAIN;
        for pump in &mut self.pumps {
            if tokio::time::timeout_at(deadline, &mut *pump).await.is_err() {
                pump.abort();
                // Aborted: its result (cancelled) says nothing more.
                let _ = pump.await;
            }
        }
        self.pumps.clear();
    }
}

/// Sends `signal` to the process group `pid` leads; false when the group is gone.
pub(crate) fn signal_group(pid: u32, signal: Signal) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    killpg(Pid::from_raw(raw), signal).is_ok()
}

/// An exit as people read it: `exit code 3`, `signal 9 (SIGKILL)`.
pub(crate) fn describe_exit(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => match Signal::try_from(signal) {
            Ok(name) => format!("signal {signal} ({name})"),
            Err(_) => format!("signal {signal}"),
        },
        (None, None) => String::from("unknown exit"),
    }
}

/// Memory (`VmRSS`) and CPU time (user + system) of a process, from `/proc`; `None` where
/// `/proc` is absent or the process is gone.
pub(crate) fn usage(pid: u32) -> (Option<u64>, Option<f64>) {
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    let rss = std::fs::read_to_string(proc_dir.join("status"))
        .ok()
        .and_then(|text| parse_vm_rss(&text));
    let cpu = std::fs::read_to_string(proc_dir.join("stat"))
        .ok()
        .and_then(|text| parse_cpu_ticks(&text))
        .and_then(|ticks| clock_ticks().map(|per_second| ticks as f64 / per_second as f64));
    (rss, cpu)
}

/// `VmRSS:    1234 kB` in bytes.
fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?;
    let mut parts = line.split_whitespace();
    let kib: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => Some(kib.saturating_mul(1024)),
        Some(_) => None,
    }
}

/// `utime + stime` (fields 14 and 15) of a `/proc/<pid>/stat` line, in clock ticks. The
/// command name (field 2) may hold spaces and parentheses, so fields are counted after its last
/// `)`.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace();
    // After the name come the state (field 3) and then 4..; utime is the 12th of them.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime.saturating_add(stime))
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`), read once.
fn clock_ticks() -> Option<u64> {
    static TICKS: OnceLock<Option<u64>> = OnceLock::new();
    *TICKS.get_or_init(|| {
        nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .and_then(|ticks| u64::try_from(ticks).ok())
            .filter(|ticks| *ticks > 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_is_read_in_bytes() {
        let status = "Name:\tsleep\nVmPeak:\t  8000 kB\nVmRSS:\t    1536 kB\nThreads: 1\n";
        assert_eq!(parse_vm_rss(status), Some(1536 * 1024));
        assert_eq!(parse_vm_rss("Name:\tkthreadd\n"), None);
    }

    #[test]
    fn cpu_ticks_are_counted_after_the_name() {
        let stat =
            "42 (a (weird) name) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 123 4096 300";
        assert_eq!(parse_cpu_ticks(stat), Some(300));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn this_process_has_usage() {
        let (rss, cpu) = usage(std::process::id());
        if Path::new("/proc/self/stat").exists() {
            assert!(rss.is_some_and(|bytes| bytes > 0));
            assert!(cpu.is_some_and(|secs| secs >= 0.0));
        }
        assert_eq!(usage(u32::MAX), (None, None), "no such process");
    }

    #[test]
    fn commands_are_resolved_like_exec() {
        let env = vec![("PATH".to_owned(), "/nonexistent:/bin:/usr/bin".to_owned())];
        assert!(resolve("sh", &env, None).is_ok());
        assert!(resolve("/bin/sh", &[], None).is_ok());
        let missing = resolve("no-such-agent", &env, None).expect_err("missing");
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
        assert!(missing.to_string().contains("no-such-agent"), "{missing}");
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("data"), "x").expect("write");
        let not_exec = resolve("./data", &env, Some(dir.path())).expect_err("not executable");
        assert_eq!(not_exec.kind(), io::ErrorKind::PermissionDenied);
    }
}
