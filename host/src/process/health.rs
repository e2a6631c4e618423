//! Health by command (`health.check = "command"`): the host runs the manifest's command every
//! `interval`, each run bounded by `timeout`; exit code 0 is a pass. `failures` failed checks
//! in a row, or no pass within `start_grace` of the start, and the replica is restarted, the
//! last check's output (or exit) in the reason.

use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::time::{Instant, MissedTickBehavior};

use super::ENV_AGENT_PID;
use super::child::{describe_exit, group_command, signal_group};
use crate::duration::format_duration;
use crate::manifest::{Health, HealthCheck};

/// Output of one check kept for the reason of a failure: the tail of it.
const OUTPUT_KEPT: usize = 4 * 1024;
/// Time a timed-out check's process group has to go after its SIGKILL.
const CHECK_KILL_WAIT: Duration = Duration::from_secs(1);

/// A replica's health command and its rules.
#[derive(Debug, Clone)]
pub(crate) struct Probe {
    program: String,
    args: Vec<String>,
    interval: Duration,
    timeout: Duration,
    failures: u32,
    start_grace: Duration,
    env: Vec<(String, String)>,
    cwd: Option<PathBuf>,
    /// The user and group it runs as (the agent's); `None`: the host's.
    user: Option<(u32, u32)>,
}

impl Probe {
    /// The probe of a manifest's `health`, when it checks by command (with the agent's
    /// environment and folder).
    pub(crate) fn of(
        health: &Health,
        env: &[(String, String)],
        cwd: Option<PathBuf>,
    ) -> Option<Probe> {
        if health.check != HealthCheck::Command {
            return None;
        }
        let (program, args) = health.command.split_first()?;
        Some(Probe {
            program: program.clone(),
            args: args.to_vec(),
            interval: health.interval,
            timeout: health.timeout,
            failures: health.failures.max(1),
            start_grace: health.start_grace,
            env: env.to_vec(),
            cwd,
            user: None,
        })
    }

    /// Run as `user`, the agent's, when it is set.
    pub(crate) fn run_by(mut self, user: Option<(u32, u32)>) -> Probe {
        self.user = user;
        self
    }

    /// Checks the replica `pid` until it is found unhealthy, and returns why; reports every
    /// check's result to `report`. Runs until dropped otherwise.
    pub(crate) async fn watch(&self, pid: u32, report: impl Fn(bool)) -> String {
        let started = Instant::now();
        let mut ticks = tokio::time::interval_at(started + self.interval, self.interval);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut passed = false;
        let mut failed = 0u32;
        loop {
            ticks.tick().await;
            match self.check(pid).await {
                Ok(()) => {
                    passed = true;
                    failed = 0;
                    report(true);
                }
                Err(why) => {
                    report(false);
                    if passed {
                        failed += 1;
                        if failed >= self.failures {
                            return format!("health check failed {failed} times: {why}");
                        }
                    } else if started.elapsed() >= self.start_grace {
                        return format!(
                            "health check did not pass within {} of the start: {why}",
                            format_duration(self.start_grace)
                        );
                    }
                }
            }
        }
    }

    /// One check: `Err` says why it failed (its last line of output, else its exit).
    async fn check(&self, pid: u32) -> Result<(), String> {
        let mut command = group_command(
            &self.program,
            &self.args,
            &self.env,
            self.cwd.as_deref(),
            self.user,
        );
        command.env(ENV_AGENT_PID, pid.to_string());
        let mut child = command
            .spawn()
            .map_err(|err| format!("cannot run {}: {err}", self.program))?;
        let Some(check_pid) = child.id() else {
            return Err(String::from("the check exited before its pid was read"));
        };
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let run = async {
            let (out, err, status) =
                tokio::join!(read_tail(stdout), read_tail(stderr), child.wait());
            (out, err, status)
        };
        let Ok((out, err, status)) = tokio::time::timeout(self.timeout, run).await else {
            signal_group(check_pid, Signal::SIGKILL);
            // Reaped here so no zombie is left; bounded, as a stuck process may not go at once.
            let _ = tokio::time::timeout(CHECK_KILL_WAIT, child.wait()).await;
            return Err(format!("timed out after {}", format_duration(self.timeout)));
        };
        // A check's own background children go with it.
        signal_group(check_pid, Signal::SIGKILL);
        let status = status.map_err(|err| format!("cannot wait for the check: {err}"))?;
        if status.success() {
            return Ok(());
        }
        let said = last_line(&err).or_else(|| last_line(&out));
        Err(match said {
            Some(line) => format!("{} ({line})", describe_exit(&status)),
            None => describe_exit(&status),
        })
    }
}

/// Reads a stream to its end, keeping its last [`OUTPUT_KEPT`] bytes.
async fn read_tail<R: AsyncRead + Unpin>(reader: Option<R>) -> Vec<u8> {
    let mut kept = Vec::new();
    let Some(mut reader) = reader else {
        return kept;
    };
    let mut buf = [0u8; 1024];
    loop {
        match reader.read(&mut buf).await {
            Ok(0) | Err(_) => return kept,
            Ok(n) => {
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > 2 * OUTPUT_KEPT {
                    kept.drain(..kept.len() - OUTPUT_KEPT);
                }
            }
        }
    }
}

fn last_line(bytes: &[u8]) -> Option<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .rev()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    fn probe(script: &str, failures: u32, start_grace: Duration) -> Probe {
        Probe {
            program: String::from("/bin/sh"),
            args: vec![String::from("-c"), script.to_owned()],
            interval: Duration::from_millis(30),
            timeout: Duration::from_millis(500),
            failures,
            start_grace,
            env: Vec::new(),
            cwd: None,
            user: None,
        }
    }

    #[tokio::test]
    async fn failures_after_a_pass_restart_with_the_last_output() {
        let dir = tempfile::tempdir().expect("temp dir");
        let flag = dir.path().join("passed-once");
        // Passes once, then fails every time, saying why.
        let script = format!(
            "if [ -e {0} ]; then echo \"not ready: $CHORUS_AGENT_PID\" >&2; exit 1; else touch {0}; fi",
            flag.display()
        );
        let reports = Mutex::new(Vec::new());
        let why = tokio::time::timeout(
            Duration::from_secs(10),
            probe(&script, 3, Duration::from_secs(60)).watch(4242, |ok| {
                reports.lock().expect("reports").push(ok);
            }),
        )
        .await
        .expect("the probe gives up within the deadline");
        assert_eq!(
            why,
            "health check failed 3 times: exit code 1 (not ready: 4242)"
        );
        assert_eq!(
            *reports.lock().expect("reports"),
            vec![true, false, false, false]
        );
    }

    #[tokio::test]
    async fn no_pass_within_the_grace_is_a_failure() {
        let started = Instant::now();
        let why = tokio::time::timeout(
            Duration::from_secs(10),
            probe("exit 7", 100, Duration::from_millis(100)).watch(1, |_| {}),
        )
        .await
        .expect("the probe gives up within the deadline");
        assert_eq!(
            why,
            "health check did not pass within 100ms of the start: exit code 7"
        );
        assert!(started.elapsed() >= Duration::from_millis(100));
    }

    #[tokio::test]
    async fn a_slow_check_times_out() {
        let slow = Probe {
            timeout: Duration::from_millis(50),
            interval: Duration::from_millis(60),
            ..probe("sleep 5", 1, Duration::ZERO)
        };
        let started = std::time::Instant::now();
        let why = tokio::time::timeout(Duration::from_secs(10), slow.watch(1, |_| {}))
            .await
            .expect("the probe gives up within the deadline");
        assert!(why.ends_with("timed out after 50ms"), "{why}");
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "the check was killed, not waited for"
        );
    }

    #[tokio::test]
    async fn a_missing_program_says_so() {
        let missing = Probe {
            program: String::from("/no/such/check"),
            ..probe("", 1, Duration::ZERO)
        };
        let why = tokio::time::timeout(Duration::from_secs(10), missing.watch(1, |_| {}))
            .await
            .expect("gives up");
        assert!(why.contains("cannot run /no/such/check"), "{why}");
    }

    #[test]
    fn only_command_checks_have_a_probe() {
        let health = Health::default();
        assert!(
            Probe::of(&health, &[], None).is_none(),
            "heartbeat is the bus's"
        );
        let command = Health {
            check: HealthCheck::Command,
            command: vec![String::from("true")],
            ..Health::default()
        };
        assert!(Probe::of(&command, &[], None).is_some());
    }
}
