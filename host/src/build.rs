//! Agents built from a repository (a manifest's `[build]`): the host clones the repository at
//! its branch into a folder of its own and runs the build command there, bounded in time, its
//! output kept beside the clone. One build per deployment and source: replicas share it, a
//! restart reuses it, and a new source (another repository, branch or command) builds again.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::AsyncReadExt;

use crate::manifest::{Build, Manifest};

/// The most output of a build kept in its log, bytes (the start, then the end).
pub const MAX_BUILD_LOG: usize = 256 * 1024;
/// The name of the file a finished build leaves in its folder: a clone without it is not used.
const BUILT_MARK: &str = ".chorus-built";

/// Which build of a deployment: a digest of what makes it.
pub fn key_of(build: &Build) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (&build.repository, &build.branch, &build.command).hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Where `manifest`'s build goes under `root`, and its log.
pub fn folder_of(root: &Path, manifest: &Manifest, build: &Build) -> (PathBuf, PathBuf) {
    let base = root.join(&manifest.id);
    let key = key_of(build);
    (base.join(&key), base.join(format!("{key}.log")))
}

/// `manifest` to run from the build in `dir`: its working folder and a relative command taken
/// inside the clone.
pub fn in_clone(manifest: &Manifest, dir: &Path) -> Manifest {
    let mut built = manifest.clone();
    built.run.working_dir = Some(match &manifest.run.working_dir {
        Some(sub) if sub.is_absolute() => sub.clone(),
        Some(sub) => dir.join(sub),
        None => dir.to_owned(),
    });
    let command = Path::new(&manifest.run.command);
    if command.is_relative() && manifest.run.command.contains('/') {
        let inside: PathBuf = command
            .components()
            .filter(|c| !matches!(c, std::path::Component::CurDir))
            .collect();
        built.run.command = dir.join(inside).display().to_string();
    }
    built
}

/// Builds `build` into `dir` (made afresh unless a finished build is there), its output in
/// `log`; within `build.timeout`. The clone and the build command run as the agents' user
/// (`run_as`), in a folder given to it.
///
/// # Errors
/// Why it failed, for a `deploy_failure`: the step (clone, build), its exit and its last line
/// of output, or the time it ran out of.
pub async fn run(
    build: &Build,
    dir: &Path,
    log: &Path,
    run_as: &crate::process::RunAs,
) -> Result<(), String> {
    if dir.join(BUILT_MARK).is_file() {
        return Ok(());
    }
    let steps = async {
        if dir.exists() {
            std::fs::remove_dir_all(dir)
                .map_err(|e| format!("cannot clear {}: {e}", dir.display()))?;
        }
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        run_as
            .hand_over(dir)
            .map_err(|e| format!("cannot give {} to {}: {e}", dir.display(), run_as.name()))?;
        let as_user = |cmd: &mut tokio::process::Command| {
            if let Some(user) = run_as.user() {
                cmd.uid(user.uid).gid(user.gid);
            }
            cmd.envs(run_as.env());
        };
        let mut output = Vec::new();
        let mut clone = tokio::process::Command::new("git");
        clone.args(["clone", "--quiet", "--depth", "1"]);
        if let Some(branch) = &build.branch {
            clone.args(["--branch", branch]);
        }
        clone
            .arg("--")
            .arg(&build.repository)
            .arg(dir)
            .env("GIT_TERMINAL_PROMPT", "0");
        as_user(&mut clone);
        step("clone", clone, &mut output).await?;
        if let Some(command) = &build.command {
            let mut sh = tokio::process::Command::new("sh");
            sh.arg("-c").arg(command).current_dir(dir);
            as_user(&mut sh);
            step("build", sh, &mut output).await?;
        }
        let _ = std::fs::write(log, bounded(&output));
        std::fs::write(dir.join(BUILT_MARK), key_of(build))
            .map_err(|e| format!("cannot mark the build done: {e}"))
    };
    match tokio::time::timeout(build.timeout, steps).await {
        Ok(done) => done,
        Err(_) => Err(format!(
            "the build did not finish within {}",
            crate::duration::format_duration(build.timeout)
        )),
    }
}

/// Runs one step to its end (killed with it if the build is dropped), its output added to
/// `output`.
async fn step(
    what: &str,
    mut cmd: tokio::process::Command,
    output: &mut Vec<u8>,
) -> Result<(), String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("{what}: cannot start: {e}"))?;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let (Some(mut stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(format!("{what}: no output pipes"));
    };
    let read = async {
        let (a, b) = tokio::join!(
            read_bounded(&mut stdout, &mut out),
            read_bounded(&mut stderr, &mut err)
        );
        a.and(b)
    };
    let (read, status) = tokio::join!(read, child.wait());
    let status = status.map_err(|e| format!("{what}: {e}"))?;
    let _ = read;
    output.extend_from_slice(format!("$ {what}\n").as_bytes());
    output.extend_from_slice(&out);
    output.extend_from_slice(&err);
    if status.success() {
        return Ok(());
    }
    let last = String::from_utf8_lossy(&err)
        .lines()
        .chain(String::from_utf8_lossy(&out).lines())
        .rfind(|l| !l.trim().is_empty())
        .map(|l| l.chars().take(300).collect::<String>())
        .unwrap_or_default();
    let exit = status
        .code()
        .map_or_else(|| "was killed".to_owned(), |c| format!("exited with {c}"));
    Err(format!("{what} {exit}: {last}"))
}

/// Reads all of `from`, keeping at most [`MAX_BUILD_LOG`] bytes of it.
async fn read_bounded(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    into: &mut Vec<u8>,
) -> std::io::Result<()> {
    let mut chunk = [0u8; 8192];
    loop {
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        let room = MAX_BUILD_LOG.saturating_sub(into.len());
        into.extend_from_slice(&chunk[..n.min(room)]);
    }
}

fn bounded(output: &[u8]) -> &[u8] {
    &output[..output.len().min(MAX_BUILD_LOG)]
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;

    #[test]
    fn a_built_agents_command_and_working_folder_are_found_in_its_clone() {
        // From a file, the working folder stays relative: it is inside the clone.
        let dir = tempfile::tempdir().expect("a folder");
        let path = dir.path().join("calc.toml");
        std::fs::write(
            &path,
            "id = \"calc\"\n[build]\nrepository = \"/srv/calc.git\"\n\
             [run]\ncommand = \"./target/calc\"\nworking_dir = \"agent\"\n",
        )
        .expect("written");
        let loaded = Manifest::load(&path).expect("valid");
        assert_eq!(loaded.run.working_dir, Some(PathBuf::from("agent")));
        let built = in_clone(&loaded, Path::new("/builds/calc/k"));
        assert_eq!(
            built.run.working_dir,
            Some(PathBuf::from("/builds/calc/k/agent"))
        );
        assert_eq!(built.run.command, "/builds/calc/k/target/calc");
        let on_path = Manifest::new("calc", "calc-agent");
        assert_eq!(
            in_clone(&on_path, Path::new("/b")).run.command,
            "calc-agent"
        );
    }
}
