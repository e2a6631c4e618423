//! The launcher: `chorus host-exec <spec> -- <command> <args>`, the process that becomes the
//! agent.
//!
//! What the host cannot do between `fork` and `exec` without `unsafe` (the workspace forbids
//! it), the launcher does in its own process, which then executes the agent in place (same pid,
//! same process group, limits and parent-death signal kept):
//!
//! 1. `PR_SET_PDEATHSIG` = `SIGKILL`: the agent is killed when its host dies, even by
//!    `kill -9`, so a host never leaves orphans. The signal fires when the *thread* that
//!    spawned the launcher exits, not the process: the supervisor spawns from tokio worker
//!    threads, which live as long as the runtime, so in practice it fires when the host exits.
//!    If the host died before the signal was set, the launcher sees another parent and stops.
//! 2. the limits ([`super::limits`]): joins the replica's prepared cgroup v2 after writing
//!    `memory.max` and `cpu.max`, or caps the address space with `setrlimit(RLIMIT_AS)`.
//! 3. the user ([`super::user`]): a host started by root drops the agent to its unprivileged
//!    user here, after joining the cgroup (which needs the host's rights), for good.
//! 4. `exec` of the agent's command, inside a bubblewrap sandbox when the host has one
//!    ([`sandbox_args`]).
//!
//! The `chorus` binary has a hidden `host-exec` subcommand that calls [`exec`] with the
//! arguments after it.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use nix::sys::signal::Signal;

use super::limits;

/// The `chorus` subcommand that runs the launcher.
pub const HOST_EXEC: &str = "host-exec";

const MEMORY_BYTES: &str = "--memory-bytes";
const CPU_MILLIS: &str = "--cpu-millis";
const CGROUP: &str = "--cgroup";
const PARENT_PID: &str = "--parent-pid";
const UID: &str = "--uid";
const GID: &str = "--gid";
const SANDBOX: &str = "--sandbox";
const WRITABLE: &str = "--writable";
/// Between the spec and the agent's command.
const END_OF_SPEC: &str = "--";

/// What the launcher applies before it executes the agent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchSpec {
    /// The memory limit: written to the cgroup's `memory.max` when `cgroup` is set, else set
    /// as `RLIMIT_AS`.
    pub memory_bytes: Option<u64>,
    /// The CPU limit in thousandths of a core: written to the cgroup's `cpu.max` when `cgroup`
    /// is set; ignored otherwise (an rlimit cannot throttle CPU).
    pub cpu_millis: Option<u64>,
    /// The replica's prepared cgroup v2 to join.
    pub cgroup: Option<PathBuf>,
    /// The host's pid: if the launcher's parent is another process by the time the
    /// parent-death signal is set, the host is already gone and the agent is not started.
    pub parent_pid: Option<u32>,
    /// The user and group the agent runs as, dropped to after the limits; `None`: the host's.
    pub user: Option<(u32, u32)>,
    /// The bubblewrap binary to run the agent inside ([`sandbox_args`]); `None`: no sandbox.
    pub sandbox: Option<PathBuf>,
    /// The one folder a sandboxed agent may write besides its own `/tmp`: its working folder.
    pub writable: Option<PathBuf>,
}

/// A launcher's arguments that do not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum LaunchSpecError {
    /// An option without its value.
    #[error("{option} needs a value")]
    MissingValue {
        /// The option.
        option: String,
    },
    /// An option's value is not what it takes.
    #[error("{option} takes {expected}, not {value:?}")]
    InvalidValue {
        /// The option.
        option: String,
        /// What it takes.
        expected: &'static str,
        /// What was given.
        value: String,
    },
    /// No command after the spec.
    #[error("no command to run after the launch options")]
    NoCommand,
}

impl LaunchSpec {
    /// The spec as launcher options (without the `--` that ends them).
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args = Vec::new();
        if let Some(bytes) = self.memory_bytes {
            args.extend([MEMORY_BYTES.into(), bytes.to_string().into()]);
        }
        if let Some(millis) = self.cpu_millis {
            args.extend([CPU_MILLIS.into(), millis.to_string().into()]);
        }
        if let Some(cgroup) = &self.cgroup {
            args.extend([CGROUP.into(), cgroup.clone().into_os_string()]);
        }
        if let Some(pid) = self.parent_pid {
            args.extend([PARENT_PID.into(), pid.to_string().into()]);
        }
        if let Some((uid, gid)) = self.user {
            args.extend([UID.into(), uid.to_string().into()]);
            args.extend([GID.into(), gid.to_string().into()]);
        }
        if let Some(sandbox) = &self.sandbox {
            args.extend([SANDBOX.into(), sandbox.clone().into_os_string()]);
        }
        if let Some(dir) = &self.writable {
            args.extend([WRITABLE.into(), dir.clone().into_os_string()]);
        }
        args
    }

    /// Parses launcher arguments: options, then (after an optional `--`) the command and its
    /// arguments, which are returned as they are.
    ///
    /// # Errors
    ///
    /// An option without a value or with one that does not parse, or no command.
    pub fn from_args(args: Vec<OsString>) -> Result<(LaunchSpec, Vec<OsString>), LaunchSpecError> {
        let mut spec = LaunchSpec::default();
        let mut args = args.into_iter();
        let mut command = Vec::new();
        while let Some(arg) = args.next() {
            let option = arg.to_string_lossy().into_owned();
            let mut value = || {
                args.next().ok_or_else(|| LaunchSpecError::MissingValue {
                    option: option.clone(),
                })
            };
            match arg.to_str() {
                Some(MEMORY_BYTES) => spec.memory_bytes = Some(number(&option, &value()?)?),
                Some(CPU_MILLIS) => spec.cpu_millis = Some(number(&option, &value()?)?),
                Some(PARENT_PID) => {
                    spec.parent_pid =
                        Some(number(&option, &value()?)?.try_into().map_err(|_| {
                            LaunchSpecError::InvalidValue {
                                option: option.clone(),
                                expected: "a process id",
                                value: String::from("out of range"),
                            }
                        })?);
                }
                Some(CGROUP) => spec.cgroup = Some(PathBuf::from(value()?)),
                Some(UID) => {
                    let uid = id(&option, &value()?)?;
                    spec.user = Some((uid, spec.user.map_or(uid, |(_, gid)| gid)));
                }
                Some(GID) => {
                    let gid = id(&option, &value()?)?;
                    spec.user = Some((spec.user.map_or(gid, |(uid, _)| uid), gid));
                }
                Some(SANDBOX) => spec.sandbox = Some(PathBuf::from(value()?)),
                Some(WRITABLE) => spec.writable = Some(PathBuf::from(value()?)),
                Some(END_OF_SPEC) => {
                    command.extend(args.by_ref());
                }
                _ => {
                    command.push(arg);
                    command.extend(args.by_ref());
                }
            }
        }
        if command.is_empty() {
            return Err(LaunchSpecError::NoCommand);
        }
        Ok((spec, command))
    }
}

fn id(option: &str, value: &OsStr) -> Result<u32, LaunchSpecError> {
    number(option, value)?
        .try_into()
        .map_err(|_| LaunchSpecError::InvalidValue {
            option: option.to_owned(),
            expected: "a user or group id",
            value: value.to_string_lossy().into_owned(),
        })
}

/// What bubblewrap is given before the agent's command: the machine's files read-only (`/tmp`
/// too: a program may live there), the agent's working folder (`writable`) writable, a `/dev`
/// and `/proc` of its own, its own process, IPC and host-name namespaces (it sees and signals
/// no other agent), the network shared (it must reach the bus), and death with the launcher.
pub fn sandbox_args(writable: Option<&std::path::Path>) -> Vec<OsString> {
    let mut args: Vec<OsString> = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        .into_iter()
        .map(OsString::from)
        .collect();
    if let Some(dir) = writable {
        args.extend([
            OsString::from("--bind"),
            dir.as_os_str().to_owned(),
            dir.as_os_str().to_owned(),
        ]);
    }
    args.extend(
        [
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--die-with-parent",
            "--",
        ]
        .into_iter()
        .map(OsString::from),
    );
    args
}

fn number(option: &str, value: &OsStr) -> Result<u64, LaunchSpecError> {
    value
        .to_str()
        .and_then(|text| text.parse().ok())
        .ok_or_else(|| LaunchSpecError::InvalidValue {
            option: option.to_owned(),
            expected: "a whole number",
            value: value.to_string_lossy().into_owned(),
        })
}

/// Runs the launcher with the arguments after `host-exec`: sets the parent-death signal,
/// applies the limits, and executes the agent in place. Returns only on failure, with the
/// error to print (the caller exits non-zero, which the host sees as the replica crashing, the
/// message on its stderr).
pub fn exec(args: Vec<OsString>) -> io::Error {
    let (spec, command) = match LaunchSpec::from_args(args) {
        Ok(parsed) => parsed,
        Err(err) => return io::Error::new(io::ErrorKind::InvalidInput, err),
    };
    if let Err(errno) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        return io::Error::other(format!("cannot set the parent-death signal: {errno}"));
    }
    if let Some(parent) = spec.parent_pid
        && u32::try_from(nix::unistd::getppid().as_raw()).ok() != Some(parent)
    {
        return io::Error::other(format!(
            "the host (pid {parent}) exited before the agent started"
        ));
    }
    let applied = match &spec.cgroup {
        Some(cgroup) => limits::apply_cgroup(
            cgroup,
            spec.memory_bytes,
            spec.cpu_millis,
            std::process::id(),
        ),
        None => spec
            .memory_bytes
            .map_or(Ok(()), limits::limit_address_space),
    };
    if let Err(err) = applied {
        return err;
    }
    if let Some((uid, gid)) = spec.user
        && let Err(err) = super::user::become_user(uid, gid)
    {
        return err;
    }
    let mut command = command.into_iter();
    let Some(program) = command.next() else {
        return io::Error::new(io::ErrorKind::InvalidInput, LaunchSpecError::NoCommand);
    };
    let who = spec
        .user
        .map_or_else(String::new, |(uid, _)| format!(" as user id {uid}"));
    let err = match &spec.sandbox {
        Some(bwrap) => Command::new(bwrap)
            .args(sandbox_args(spec.writable.as_deref()))
            .arg(&program)
            .args(command)
            .exec(),
        None => Command::new(&program).args(command).exec(),
    };
    io::Error::new(
        err.kind(),
        format!("cannot execute {}{who}: {err}", program.to_string_lossy()),
    )
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn a_spec_round_trips_through_its_args() {
        let spec = LaunchSpec {
            memory_bytes: Some(512 * 1024 * 1024),
            cpu_millis: Some(1500),
            cgroup: Some(PathBuf::from("/sys/fs/cgroup/chorus.service/chorus-echo")),
            parent_pid: Some(4242),
            user: Some((65534, 65533)),
            sandbox: Some(PathBuf::from("/usr/bin/bwrap")),
            writable: Some(PathBuf::from("/srv/agents/echo")),
        };
        let mut args = spec.to_args();
        args.extend(os(&["--", "/bin/sh", "-c", "echo --memory-bytes"]));
        let (parsed, command) = LaunchSpec::from_args(args).expect("parses");
        assert_eq!(parsed, spec);
        assert_eq!(command, os(&["/bin/sh", "-c", "echo --memory-bytes"]));

        let empty = LaunchSpec::default();
        assert!(empty.to_args().is_empty());
        let (parsed, command) = LaunchSpec::from_args(os(&["--", "agent"])).expect("parses");
        assert_eq!((parsed, command), (empty, os(&["agent"])));
    }

    #[test]
    fn the_command_may_follow_without_the_separator() {
        let (spec, command) =
            LaunchSpec::from_args(os(&["--cpu-millis", "250", "agent", "--", "x"]))
                .expect("parses");
        assert_eq!(spec.cpu_millis, Some(250));
        assert_eq!(command, os(&["agent", "--", "x"]));
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        assert_eq!(
            LaunchSpec::from_args(os(&["--memory-bytes"])),
            Err(LaunchSpecError::MissingValue {
                option: "--memory-bytes".into()
            })
        );
        let err = LaunchSpec::from_args(os(&["--memory-bytes", "lots", "--", "a"]))
            .expect_err("not a number");
        assert_eq!(
            err.to_string(),
            "--memory-bytes takes a whole number, not \"lots\""
        );
        assert_eq!(
            LaunchSpec::from_args(os(&["--cpu-millis", "1", "--"])),
            Err(LaunchSpecError::NoCommand)
        );
        assert!(LaunchSpec::from_args(os(&["--parent-pid", "99999999999", "a"])).is_err());
    }

    /// Set for a child copy of this test binary: the launcher's arguments, one a line.
    const CHILD_ARGS: &str = "CHORUS_TEST_LAUNCHER_ARGS";
    const DEADLINE: Duration = Duration::from_secs(10);

    /// Not a test of its own: in a child copy of the test binary (with [`CHILD_ARGS`] set) it
    /// is the launcher, as `chorus host-exec` would be. Does nothing otherwise.
    #[test]
    fn launcher_child() {
        let Ok(args) = std::env::var(CHILD_ARGS) else {
            return;
        };
        let err = exec(args.lines().map(OsString::from).collect());
        eprintln!("launcher: {err}");
        std::process::exit(127);
    }

    /// This test binary as a launcher with `args`.
    fn launcher(args: &[&str]) -> (PathBuf, [&'static str; 4], String) {
        let exe = std::env::current_exe().expect("the test binary");
        let filter = [
            "--exact",
            "process::launch::tests::launcher_child",
            "--nocapture",
            "--quiet",
        ];
        (exe, filter, args.join("\n"))
    }

    fn run_launcher(args: &[&str]) -> std::process::Output {
        let (exe, filter, joined) = launcher(args);
        Command::new(exe)
            .args(filter)
            .env(CHILD_ARGS, joined)
            .output()
            .expect("the launcher runs")
    }

    #[test]
    fn the_launcher_caps_memory_then_runs_the_command() {
        let output = run_launcher(&[
            "--memory-bytes",
            "536870912",
            "--",
            "/bin/sh",
            "-c",
            "grep 'Max address space' /proc/self/limits",
        ]);
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let limit = stdout
            .lines()
            .find(|line| line.starts_with("Max address space"))
            .unwrap_or_else(|| panic!("no limit line: {stdout} {stderr}"));
        let fields: Vec<&str> = limit.split_whitespace().collect();
        assert_eq!(
            &fields[3..],
            &["536870912", "536870912", "bytes"],
            "{limit}"
        );
        assert!(output.status.success(), "{stderr}");
    }

    #[test]
    fn the_launcher_stops_when_its_host_is_gone_already() {
        let output = run_launcher(&["--parent-pid", "1", "--", "/bin/echo", "started"]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(127), "{stderr}");
        assert!(
            stderr.contains("the host (pid 1) exited before the agent started"),
            "{stderr}"
        );
        assert!(!String::from_utf8_lossy(&output.stdout).contains("started\n"));
    }

    #[test]
    fn a_launched_agent_dies_with_its_host() {
        use std::io::BufRead;
        // `sh` plays the host: it starts the launcher in the background and says its pid
        // (which stays the agent's after the exec); then `sh` is killed with SIGKILL.
        let (exe, filter, joined) = launcher(&["--", "/bin/sleep", "60"]);
        let script = format!(
            "\"{}\" {} >/dev/null & echo pid=$!; wait",
            exe.display(),
            filter.join(" ")
        );
        let mut host = Command::new("/bin/sh")
            .args(["-c", &script])
            .env(CHILD_ARGS, joined)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("sh runs");
        let stdout = host.stdout.take().expect("piped");
        let pid: u32 = std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|line| {
                line.strip_prefix("pid=")
                    .and_then(|pid| pid.trim().parse().ok())
            })
            .expect("the launcher's pid");
        let deadline = Instant::now() + DEADLINE;
        let is_sleep = || {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmd| cmd.starts_with(b"/bin/sleep"))
        };
        while !is_sleep() {
            assert!(Instant::now() < deadline, "the agent never started");
            std::thread::sleep(Duration::from_millis(10));
        }
        host.kill().expect("kill -9 the host");
        host.wait().expect("reaped");
        let gone = || match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        };
        while !gone() {
            if Instant::now() >= deadline {
                let _ =
                    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL);
                panic!("the agent outlived its host");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn exec_refuses_a_bad_spec_without_running_anything() {
        let err = exec(os(&["--cpu-millis", "x", "--", "/bin/true"]));
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("--cpu-millis"), "{err}");
    }
}
