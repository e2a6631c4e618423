//! Memory and CPU limits of agent processes, where the operating system allows them.
//!
//! Two mechanisms, chosen per host when the supervisor starts:
//!
//! - **cgroups v2** (Linux with the unified hierarchy mounted at `/sys/fs/cgroup`): each replica
//!   gets a cgroup `<host's cgroup>/chorus-<agent id>`, with `memory.max` (bytes; the kernel
//!   reclaims, then kills the replica when it goes past) and `cpu.max` (`<quota> 100000`: the
//!   replica gets at most `cores` CPUs' worth of time per 100 ms). The limits cover the
//!   agent's own children too. The `memory` and `cpu` controllers must be enabled in the host
//!   cgroup's `cgroup.subtree_control`; the host tries to enable them, first moving itself into
//!   a leaf `<host's cgroup>/host` (a cgroup holding processes cannot enable controllers for
//!   its children). Under systemd, run the host with `Delegate=yes`.
//! - **`setrlimit(RLIMIT_AS)`** everywhere else: the memory limit becomes a cap on the agent's
//!   virtual address space (an allocation past it fails). It is coarser than a cgroup: it
//!   counts reserved, not resident, memory (runtimes that reserve large heaps up front may not
//!   start under a tight limit) and each process separately. **CPU cannot be limited by an
//!   rlimit** (`RLIMIT_CPU` kills a process after a total of CPU seconds, it does not throttle),
//!   so without cgroups v2 a CPU limit is not enforced, and the replica's status says so.
//!
//! The limits are applied by the launcher ([`super::launch`]) in the agent's process before it
//! executes the agent: the workspace forbids the `unsafe` a `pre_exec` hook would need.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

pub use chorus_hosting::replica::Enforcement;

/// Where the unified cgroup hierarchy is mounted, under the filesystem root.
const CGROUP_MOUNT: &str = "sys/fs/cgroup";
/// The file a process's cgroups are listed in, under the filesystem root.
const SELF_CGROUP: &str = "proc/self/cgroup";
/// The leaf the host moves itself into so its own cgroup may enable controllers.
const HOST_LEAF: &str = "host";
/// Prefix of every replica's cgroup.
const AGENT_CGROUP_PREFIX: &str = "chorus-";
/// The period `cpu.max` quotas are given against, in microseconds (the kernel's default).
pub const CPU_PERIOD_MICROS: u64 = 100_000;
/// The smallest quota the kernel accepts, in microseconds.
const CPU_MIN_QUOTA_MICROS: u64 = 1_000;

/// The cgroup v2 setup of a host: where its agents' cgroups go and which controllers they get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupHost {
    /// The host's own cgroup directory: agents' cgroups are made in it.
    pub parent: PathBuf,
    /// The `memory` controller is enabled for the host's child cgroups.
    pub memory: bool,
    /// The `cpu` controller is enabled for the host's child cgroups.
    pub cpu: bool,
}

impl CgroupHost {
    /// Finds the host's cgroup v2 under the filesystem `root` (`/` on a real machine) and
    /// enables the `memory` and `cpu` controllers for its children where it can, moving the
    /// process `pid` (the host) into a leaf first. `None` without cgroups v2 (for example a
    /// machine with cgroups v1, like the one these tests are written on), or when no controller
    /// can be had.
    pub fn setup(root: &Path, pid: u32) -> Option<CgroupHost> {
        let mount = root.join(CGROUP_MOUNT);
        if !mount.join("cgroup.controllers").is_file() {
            return None;
        }
        let own = own_cgroup(&fs::read_to_string(root.join(SELF_CGROUP)).ok()?)?;
        let parent = mount.join(own.trim_start_matches('/'));
        let available = read_controllers(&parent.join("cgroup.controllers"));
        let wanted: Vec<&str> = ["memory", "cpu"]
            .into_iter()
            .filter(|c| available.iter().any(|a| a == c))
            .collect();
        let mut enabled = read_controllers(&parent.join("cgroup.subtree_control"));
        let missing: Vec<&str> = wanted
            .iter()
            .copied()
            .filter(|c| !enabled.iter().any(|e| e == c))
            .collect();
        if !missing.is_empty() {
            // A cgroup with processes in it cannot enable controllers for its children:
            // move the host into a leaf of its own first (its agents go beside it).
            let procs = fs::read_to_string(parent.join("cgroup.procs")).unwrap_or_default();
            if !procs.trim().is_empty() {
                let leaf = parent.join(HOST_LEAF);
                let moved = make_dir(&leaf)
                    .and_then(|()| fs::write(leaf.join("cgroup.procs"), pid.to_string()));
                if let Err(err) = moved {
                    tracing::debug!(error = %err, "cannot move the host into a leaf cgroup");
                }
            }
            let all = missing
                .iter()
                .map(|c| format!("+{c}"))
                .collect::<Vec<_>>()
                .join(" ");
            let control = parent.join("cgroup.subtree_control");
            if fs::write(&control, &all).is_err() {
                for controller in &missing {
                    if let Err(err) = fs::write(&control, format!("+{controller}")) {
                        tracing::debug!(controller, error = %err, "cannot enable a cgroup controller");
                    }
                }
            }
            enabled = read_controllers(&control);
        }
        let memory = enabled.iter().any(|c| c == "memory");
        let cpu = enabled.iter().any(|c| c == "cpu");
        (memory || cpu).then_some(CgroupHost {
            parent,
            memory,
            cpu,
        })
    }

    /// Makes (or reuses) the cgroup of `agent_id` and says what it will enforce for the limits
    /// asked for. The limits themselves are written by the launcher ([`apply_cgroup`]).
    ///
    /// # Errors
    ///
    /// The directory cannot be made (permissions, no delegation): the caller falls back to
    /// `setrlimit`.
    pub fn prepare(
        &self,
        agent_id: &str,
        memory: bool,
        cpu: bool,
    ) -> io::Result<(PathBuf, Enforcement)> {
        let dir = self.parent.join(format!("{AGENT_CGROUP_PREFIX}{agent_id}"));
        make_dir(&dir)?;
        Ok((
            dir,
            Enforcement::CgroupV2 {
                memory: memory && self.memory,
                cpu: cpu && self.cpu,
            },
        ))
    }
}

/// What this machine lets a host enforce, looked up under the filesystem `root` (`/` on a real
/// machine): `CgroupV2` with the controllers the host can give its agents, else `Rlimit`.
/// Like [`CgroupHost::setup`], it may enable controllers and move the calling process.
pub fn detect(root: &Path) -> Enforcement {
    match CgroupHost::setup(root, std::process::id()) {
        Some(host) => Enforcement::CgroupV2 {
            memory: host.memory,
            cpu: host.cpu,
        },
        None => Enforcement::Rlimit { memory: true },
    }
}

/// The host's cgroup v2 path (`/a/b`) from the text of `/proc/self/cgroup` (the `0::` line).
fn own_cgroup(text: &str) -> Option<String> {
    text.lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(|path| path.trim().to_owned())
}

/// The controller names in a `cgroup.controllers` or `cgroup.subtree_control` file; a `+` left
/// by a write on a plain file (a test's fake tree) is ignored.
fn read_controllers(path: &Path) -> Vec<String> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .map(|c| c.trim_start_matches('+').to_owned())
        .collect()
}

fn make_dir(path: &Path) -> io::Result<()> {
    match fs::create_dir(path) {
        Err(err) if err.kind() != io::ErrorKind::AlreadyExists => Err(err),
        _ => Ok(()),
    }
}

/// `cpu.max` for a CPU limit in thousandths of a core: `"<quota> 100000"`, the quota never
/// below the kernel's minimum.
pub fn cpu_max(cpu_millis: u64) -> String {
    let quota = cpu_millis
        .saturating_mul(CPU_PERIOD_MICROS / 1000)
        .max(CPU_MIN_QUOTA_MICROS);
    format!("{quota} {CPU_PERIOD_MICROS}")
}

/// Writes the limits into the cgroup `dir` and moves the process `pid` into it: what the
/// launcher does for itself before executing the agent. An absent limit is written as `max`,
/// so a reused cgroup does not keep an old one.
///
/// # Errors
///
/// A file of the cgroup cannot be written; the error names it.
pub fn apply_cgroup(
    dir: &Path,
    memory_bytes: Option<u64>,
    cpu_millis: Option<u64>,
    pid: u32,
) -> io::Result<()> {
    if let Some(bytes) = memory_bytes {
        write_named(&dir.join("memory.max"), &bytes.to_string())?;
    }
    if let Some(millis) = cpu_millis {
        write_named(&dir.join("cpu.max"), &cpu_max(millis))?;
    }
    write_named(&dir.join("cgroup.procs"), &pid.to_string())
}

fn write_named(path: &Path, value: &str) -> io::Result<()> {
    fs::write(path, value).map_err(|err| {
        io::Error::new(
            err.kind(),
            format!("cannot write {value:?} to {}: {err}", path.display()),
        )
    })
}

/// Removes a replica's cgroup once its processes are gone (the kernel refuses while any is
/// left; that is only logged).
pub fn remove_cgroup(dir: &Path) {
    if let Err(err) = fs::remove_dir(dir)
        && err.kind() != io::ErrorKind::NotFound
    {
        tracing::debug!(cgroup = %dir.display(), error = %err, "cannot remove an agent's cgroup");
    }
}

/// Caps the calling process's address space at `bytes` (soft and hard limit): the memory limit
/// where cgroups v2 is not available.
///
/// # Errors
///
/// The kernel refuses (a hard limit may only be lowered by an unprivileged process).
pub fn limit_address_space(bytes: u64) -> io::Result<()> {
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_AS, bytes, bytes).map_err(
        |errno| io::Error::other(format!("cannot set RLIMIT_AS to {bytes} bytes: {errno}")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake filesystem root with cgroups v2 mounted and the host in `/chorus.service`.
    fn fake_root(controllers: &str, subtree: &str, procs: &str) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("temp dir");
        let mount = root.path().join(CGROUP_MOUNT);
        let own = mount.join("chorus.service");
        fs::create_dir_all(&own).expect("cgroup dirs");
        fs::create_dir_all(root.path().join("proc/self")).expect("proc dir");
        fs::write(
            mount.join("cgroup.controllers"),
            "cpuset cpu io memory pids",
        )
        .expect("write");
        fs::write(root.path().join(SELF_CGROUP), "0::/chorus.service\n").expect("write");
        fs::write(own.join("cgroup.controllers"), controllers).expect("write");
        fs::write(own.join("cgroup.subtree_control"), subtree).expect("write");
        fs::write(own.join("cgroup.procs"), procs).expect("write");
        root
    }

    #[test]
    fn no_unified_hierarchy_means_rlimit() {
        let root = tempfile::tempdir().expect("temp dir");
        assert_eq!(CgroupHost::setup(root.path(), 1), None);
        assert_eq!(detect(root.path()), Enforcement::Rlimit { memory: true });
    }

    #[test]
    fn enabled_controllers_are_used_as_they_are() {
        let root = fake_root("cpu memory pids", "cpu memory", "");
        let host = CgroupHost::setup(root.path(), 42).expect("cgroups v2");
        assert!(host.memory && host.cpu);
        assert_eq!(
            host.parent,
            root.path().join(CGROUP_MOUNT).join("chorus.service")
        );
        assert!(!host.parent.join(HOST_LEAF).exists(), "nothing to move");
        assert_eq!(
            detect(root.path()),
            Enforcement::CgroupV2 {
                memory: true,
                cpu: true
            }
        );
    }

    #[test]
    fn missing_controllers_are_enabled_after_moving_the_host_into_a_leaf() {
        let root = fake_root("cpu memory", "", "42\n");
        let host = CgroupHost::setup(root.path(), 42).expect("cgroups v2");
        assert!(host.memory && host.cpu);
        let leaf = host.parent.join(HOST_LEAF);
        assert_eq!(
            fs::read_to_string(leaf.join("cgroup.procs")).expect("moved"),
            "42"
        );
        let control = fs::read_to_string(host.parent.join("cgroup.subtree_control")).expect("read");
        assert_eq!(control, "+memory +cpu");
    }

    #[test]
    fn only_available_controllers_are_asked_for() {
        let root = fake_root("pids cpu", "", "");
        let host = CgroupHost::setup(root.path(), 42).expect("cgroups v2");
        assert!(!host.memory && host.cpu);
        let root = fake_root("pids", "", "");
        assert_eq!(
            CgroupHost::setup(root.path(), 42),
            None,
            "no controller to limit with"
        );
    }

    #[test]
    fn a_replica_cgroup_is_made_and_its_limits_written() {
        let root = fake_root("cpu memory", "cpu memory", "");
        let host = CgroupHost::setup(root.path(), 42).expect("cgroups v2");
        let (dir, enforcement) = host.prepare("echo-2", true, false).expect("prepare");
        assert_eq!(dir, host.parent.join("chorus-echo-2"));
        assert_eq!(
            enforcement,
            Enforcement::CgroupV2 {
                memory: true,
                cpu: false
            }
        );
        host.prepare("echo-2", true, true)
            .expect("an existing cgroup is reused");

        apply_cgroup(&dir, Some(256 * 1024 * 1024), Some(1500), 777).expect("apply");
        let read = |name: &str| fs::read_to_string(dir.join(name)).expect("written");
        assert_eq!(read("memory.max"), "268435456");
        assert_eq!(read("cpu.max"), "150000 100000");
        assert_eq!(read("cgroup.procs"), "777");

        remove_cgroup(&dir);
        assert!(
            dir.exists(),
            "a cgroup with files (processes) is left alone"
        );
    }

    #[test]
    fn a_failed_write_names_the_file() {
        let root = tempfile::tempdir().expect("temp dir");
        let gone = root.path().join("no-such-cgroup");
        let err = apply_cgroup(&gone, Some(1), None, 1).expect_err("no directory");
        assert!(err.to_string().contains("memory.max"), "{err}");
    }

    #[test]
    fn cpu_quotas_follow_the_cores() {
        assert_eq!(cpu_max(1000), "100000 100000");
        assert_eq!(cpu_max(250), "25000 100000");
        assert_eq!(cpu_max(2000), "200000 100000");
        assert_eq!(
            cpu_max(0),
            "1000 100000",
            "never below the kernel's minimum"
        );
    }

    #[test]
    fn the_own_cgroup_is_the_unified_line() {
        let text = "12:memory:/x\n0::/user.slice/session-1.scope\n";
        assert_eq!(
            own_cgroup(text).as_deref(),
            Some("/user.slice/session-1.scope")
        );
        assert_eq!(own_cgroup("9:name=systemd:/\n"), None);
    }

    #[test]
    fn enforcement_is_json_with_a_kind() {
        let json = serde_json::to_value(Enforcement::CgroupV2 {
            memory: true,
            cpu: false,
        })
        .expect("json");
        assert_eq!(
            json,
            serde_json::json!({"kind": "cgroup_v2", "memory": true, "cpu": false})
        );
        let none = serde_json::to_value(Enforcement::None).expect("json");
        assert_eq!(none, serde_json::json!({"kind": "none"}));
    }
}
