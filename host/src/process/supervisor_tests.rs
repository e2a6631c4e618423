//! The supervisor against real processes (`/bin/sh -c` agents), logs in temp dirs, every wait
//! with a deadline.

use std::path::Path;
use std::time::{Duration, SystemTime};

use tokio::sync::broadcast;
use tokio::time::Instant;

use super::*;
use crate::process::ENV_AGENT_ID;

/// Longest any one wait of these tests may take.
const DEADLINE: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(10);

fn manifest(toml: &str) -> Manifest {
    Manifest::from_toml(toml).expect("a valid manifest")
}

/// A manifest running `script` with `/bin/sh -c`, plus more TOML after `[run]`'s table.
fn sh(id: &str, script: &str, more: &str) -> Manifest {
    let script = script.replace('\\', "\\\\").replace('"', "\\\"");
    manifest(&format!(
        "id = \"{id}\"\n[run]\ncommand = \"/bin/sh\"\nargs = [\"-c\", \"{script}\"]\n{more}"
    ))
}

fn config(dir: &Path) -> SupervisorConfig {
    let mut config = SupervisorConfig::new("host-a", dir.join("logs"));
    config.stop_grace = Duration::from_secs(3);
    config
}

/// Polls `check` until it gives a value, or fails the test after [`DEADLINE`].
async fn eventually<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(POLL).await;
    }
}

/// The state of `agent_id` once it is finished.
async fn finished(supervisor: &Supervisor, agent_id: &str) -> ReplicaStatus {
    eventually(&format!("{agent_id} to finish"), || {
        supervisor
            .status(agent_id)
            .filter(|status| status.state.is_finished())
    })
    .await
}

/// Events until (and with) the first that `last` accepts.
async fn events_until(
    events: &mut broadcast::Receiver<ReplicaEvent>,
    last: impl Fn(&ReplicaEvent) -> bool,
) -> Vec<ReplicaEvent> {
    let mut seen = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    loop {
        let event = tokio::time::timeout_at(deadline, events.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out; events so far: {seen:?}"))
            .expect("no event lost");
        let done = last(&event);
        seen.push(event);
        if done {
            return seen;
        }
    }
}

async fn log_has(supervisor: &Supervisor, agent_id: &str, text: &str) {
    eventually(&format!("{text:?} in the log of {agent_id}"), || {
        supervisor
            .logs(agent_id, 1000)
            .ok()
            .filter(|lines| lines.iter().any(|line| line.contains(text)))
    })
    .await;
}

/// Whether a process is gone (or only a zombie left for its new parent to reap).
/// Whether `seen` holds a restart.
fn restarted(seen: &[ReplicaEvent]) -> bool {
    seen.iter()
        .any(|e| matches!(e, ReplicaEvent::Restarting { .. }))
}

fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

#[tokio::test]
async fn a_replica_gets_its_identity_in_its_environment() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut config = config(dir.path());
    config.env = vec![(
        "CHORUS_NATS_URL".to_owned(),
        "nats://127.0.0.1:4222".to_owned(),
    )];
    let supervisor = Supervisor::new(config);
    let manifest = sh(
        "echo",
        "echo id=$CHORUS_AGENT_ID dep=$CHORUS_DEPLOYMENT replica=$CHORUS_REPLICA host=$CHORUS_HOST; \
         echo customer=$CHORUS_CUSTOMER nkey=$CHORUS_NKEY_FILE bus=$CHORUS_NATS_URL own=$OWN cwd=$(pwd); \
         echo leaked=$CARGO_MANIFEST_DIR; echo to-stderr >&2",
        &format!(
            "working_dir = \"{}\"\nenv = {{ OWN = \"mine\" }}\n[restart]\npolicy = \"never\"\n",
            dir.path().display()
        ),
    );
    let mut manifest = manifest;
    manifest.customer = Some("acme".to_owned());
    manifest.credentials.nkey_file = Some(dir.path().join("agent.nk"));
    let status = supervisor.run(&manifest, 2).await.expect("started");
    assert_eq!(status.agent_id, "echo-2");
    assert_eq!((status.deployment.as_str(), status.replica), ("echo", 2));
    assert_eq!(status.state, ReplicaState::Running);
    assert!(status.pid.is_some() && status.started.is_some());
    assert_eq!(
        status.limits,
        Enforcement::None,
        "no launcher: nothing limited"
    );

    let end = finished(&supervisor, "echo-2").await;
    assert_eq!(
        end.state,
        ReplicaState::Stopped,
        "exit 0 under never is a stop"
    );
    assert_eq!(
        end.last_exit.as_deref(),
        Some("exit code 0; stderr: to-stderr")
    );
    let lines = supervisor.logs("echo-2", 100).expect("logs");
    let text = lines.join("\n");
    assert!(
        text.contains(" out id=echo-2 dep=echo replica=2 host=host-a"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            " out customer=acme nkey={} bus=nats://127.0.0.1:4222 own=mine cwd={}",
            dir.path().join("agent.nk").display(),
            dir.path().display()
        )),
        "{text}"
    );
    assert!(text.contains(" out leaked="), "{text}");
    assert!(
        !text.contains("leaked=/"),
        "the host's own environment is not passed on: {text}"
    );
    assert!(text.contains(" err to-stderr"), "{text}");
    assert!(text.contains(" host started pid "), "{text}");
    assert!(text.contains(" host exited: exit code 0"), "{text}");
    assert_eq!(ENV_AGENT_ID, "CHORUS_AGENT_ID");
}

#[tokio::test]
async fn a_crash_loop_backs_off_then_fails_with_the_exit_and_stderr() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    let mut events = supervisor.events();
    let manifest = sh(
        "crash",
        "echo boom >&2; exit 3",
        "[restart]\npolicy = \"on-failure\"\nmax_restarts = 3\nwindow = \"10m\"\n\
         initial_backoff = \"20ms\"\nmax_backoff = \"80ms\"\n",
    );
    let started = Instant::now();
    supervisor.run(&manifest, 1).await.expect("started");
    let seen = events_until(&mut events, |event| {
        matches!(event, ReplicaEvent::Failed { .. })
    })
    .await;
    let elapsed = started.elapsed();

    let delays: Vec<Duration> = seen
        .iter()
        .filter_map(|event| match event {
            ReplicaEvent::Restarting { delay, .. } => Some(*delay),
            _ => None,
        })
        .collect();
    let ms = Duration::from_millis;
    assert_eq!(delays, vec![ms(20), ms(40), ms(80)], "doubling, capped");
    assert!(
        elapsed >= ms(140),
        "never faster than the backoff: {elapsed:?}"
    );
    let starts = seen
        .iter()
        .filter(|e| matches!(e, ReplicaEvent::Started { .. }))
        .count();
    assert_eq!(
        starts, 4,
        "the first start and exactly max_restarts restarts"
    );
    let exits: Vec<_> = seen
        .iter()
        .filter_map(|event| match event {
            ReplicaEvent::Exited { code, signal, .. } => Some((*code, *signal)),
            _ => None,
        })
        .collect();
    assert_eq!(exits, vec![(Some(3), None); 4]);
    let reason = "crashed 4 times within 10m; last: exit code 3; stderr: boom";
    assert_eq!(
        seen.last(),
        Some(&ReplicaEvent::Failed {
            agent_id: "crash".into(),
            deployment: "crash".into(),
            reason: reason.into()
        })
    );
    let status = supervisor.status("crash").expect("known");
    assert_eq!(
        status.state,
        ReplicaState::Failed {
            reason: reason.into()
        }
    );
    assert_eq!(status.restarts, 3);
    assert_eq!(status.pid, None);
    assert!(
        matches!(
            supervisor.restart("crash", "x").await,
            Err(ProcessError::NotRunning { .. })
        ),
        "nothing to restart"
    );
}

#[tokio::test]
async fn never_fails_a_non_zero_exit_with_its_reason() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    let mut events = supervisor.events();
    let manifest = sh(
        "once",
        "echo boom >&2; exit 3",
        "[restart]\npolicy = \"never\"\n",
    );
    supervisor.run(&manifest, 1).await.expect("started");
    let seen = events_until(&mut events, |event| {
        matches!(event, ReplicaEvent::Failed { .. })
    })
    .await;
    assert!(!restarted(&seen));
    let status = supervisor.status("once").expect("known");
    assert_eq!(
        status.state,
        ReplicaState::Failed {
            reason: "exit code 3; stderr: boom".into()
        }
    );
}

#[tokio::test]
async fn on_failure_stops_after_a_clean_exit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    let mut events = supervisor.events();
    let manifest = sh(
        "clean",
        "echo done",
        "[restart]\npolicy = \"on-failure\"\ninitial_backoff = \"10ms\"\n",
    );
    supervisor.run(&manifest, 1).await.expect("started");
    let seen = events_until(&mut events, |event| {
        matches!(event, ReplicaEvent::Stopped { .. })
    })
    .await;
    assert!(!restarted(&seen), "{seen:?}");
    let status = supervisor.status("clean").expect("known");
    assert_eq!((status.state, status.restarts), (ReplicaState::Stopped, 0));
    log_has(&supervisor, "clean", " out done").await;
    assert!(supervisor.forget("clean"));
    assert!(supervisor.status("clean").is_none());
    assert!(
        supervisor.logs("clean", 10).is_ok(),
        "the logs outlive the replica"
    );
}

#[tokio::test]
async fn always_restarts_a_clean_exit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    let mut events = supervisor.events();
    let manifest = sh(
        "again",
        "exit 0",
        "[restart]\npolicy = \"always\"\nmax_restarts = 1\ninitial_backoff = \"10ms\"\nmax_backoff = \"10ms\"\n",
    );
    supervisor.run(&manifest, 1).await.expect("started");
    events_until(&mut events, |event| {
        matches!(event, ReplicaEvent::Failed { .. })
    })
    .await;
    let status = supervisor.status("again").expect("known");
    assert_eq!(status.restarts, 1);
    assert_eq!(
        status.state,
        ReplicaState::Failed {
            reason: "crashed 2 times within 10m; last: exit code 0".into()
        }
    );
}

#[tokio::test]
async fn stop_ends_a_replica_and_its_children_without_a_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    let mut events = supervisor.events();
    // A child of its own in the background, whose pid it prints.
    let manifest = sh(
        "sleeper",
        "sleep 60 & echo child=$!; wait",
        "[restart]\npolicy = \"always\"\ninitial_backoff = \"10ms\"\n",
    );
    let status = supervisor.run(&manifest, 1).await.expect("started");
    let pid = status.pid.expect("a pid");
    log_has(&supervisor, "sleeper", "child=").await;
    let grandchild: u32 = supervisor
        .logs("sleeper", 100)
        .expect("logs")
        .iter()
        .find_map(|line| {
            line.split("child=")
                .nth(1)
                .and_then(|n| n.trim().parse().ok())
        })
        .expect("the child's pid");

    let running = supervisor.status("sleeper").expect("known");
    if Path::new("/proc/self/stat").exists() {
        assert!(
            running.rss_bytes.is_some_and(|bytes| bytes > 0),
            "{running:?}"
        );
        assert!(running.cpu_seconds.is_some());
    }

    let asked = Instant::now();
    tokio::time::timeout(DEADLINE, supervisor.stop("sleeper"))
        .await
        .expect("stop returns")
        .expect("stopped");
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "SIGTERM was enough: {:?}",
        asked.elapsed()
    );
    let status = supervisor.status("sleeper").expect("known");
    assert_eq!((status.state, status.pid), (ReplicaState::Stopped, None));
    assert!(gone(pid), "the agent is gone");
    eventually("the agent's own child to go", || {
        gone(grandchild).then_some(())
    })
    .await;
    let seen = events_until(&mut events, |event| {
        matches!(event, ReplicaEvent::Stopped { .. })
    })
    .await;
    assert!(!restarted(&seen), "{seen:?}");
    supervisor
        .stop("sleeper")
        .await
        .expect("stopping twice is fine");
    assert!(matches!(
        supervisor.stop("nobody").await,
        Err(ProcessError::NotFound { .. })
    ));

    // The same replica can be run again once stopped.
    supervisor.run(&manifest, 1).await.expect("runs again");
    assert!(matches!(
        supervisor.run(&manifest, 1).await,
        Err(ProcessError::AlreadyRunning { .. })
    ));
    supervisor.shutdown().await;
}

#[tokio::test]
async fn a_replica_ignoring_sigterm_is_killed_after_the_grace() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut config = config(dir.path());
    config.stop_grace = Duration::from_millis(300);
    let supervisor = Supervisor::new(config);
    let mut events = supervisor.events();
    let manifest = sh("stubborn", "trap '' TERM; echo ready; sleep 60", "");
    supervisor.run(&manifest, 1).await.expect("started");
    log_has(&supervisor, "stubborn", " out ready").await;

    let asked = Instant::now();
    tokio::time::timeout(DEADLINE, supervisor.stop("stubborn"))
        .await
        .expect("stop returns")
        .expect("stopped");
    let took = asked.elapsed();
    assert!(
        took >= Duration::from_millis(300),
        "the grace was given: {took:?}"
    );
    assert!(took < Duration::from_secs(3), "then SIGKILL: {took:?}");
    let seen = events_until(&mut events, |event| {
        matches!(event, ReplicaEvent::Stopped { .. })
    })
    .await;
    assert!(
        seen.iter().any(|e| matches!(
            e,
            ReplicaEvent::Exited {
                signal: Some(9),
                ..
            }
        )),
        "{seen:?}"
    );
    let status = supervisor.status("stubborn").expect("known");
    assert_eq!(status.last_exit.as_deref(), Some("stopped"));
}

#[tokio::test]
async fn stop_during_the_backoff_cancels_the_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    let manifest = sh(
        "slow",
        "exit 1",
        "[restart]\ninitial_backoff = \"1h\"\nmax_backoff = \"1h\"\n",
    );
    supervisor.run(&manifest, 1).await.expect("started");
    eventually("the backoff", || {
        supervisor.status("slow").filter(|s| {
            matches!(
                s.state,
                ReplicaState::BackingOff {
                    attempt: 1,
                    delay_ms: 3_600_000
                }
            )
        })
    })
    .await;
    tokio::time::timeout(DEADLINE, supervisor.stop("slow"))
        .await
        .expect("stop returns at once")
        .expect("stopped");
    let status = supervisor.status("slow").expect("known");
    assert_eq!((status.state, status.restarts), (ReplicaState::Stopped, 0));
}

#[tokio::test]
async fn logs_rotate_and_read_back_in_order() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut config = config(dir.path());
    config.log_limits = LogLimits::new(300, 2, 32);
    let log_dir = config.log_dir.clone();
    let supervisor = Supervisor::new(config);
    let manifest = sh(
        "chatty",
        "i=0; while [ $i -lt 200 ]; do echo line $i; i=$((i+1)); done; \
         echo 0123456789012345678901234567890123456789 >&2",
        "[restart]\npolicy = \"never\"\n",
    );
    supervisor.run(&manifest, 1).await.expect("started");
    finished(&supervisor, "chatty").await;

    let live = log_dir.join("chatty.log");
    for name in ["chatty.log", "chatty.log.1", "chatty.log.2"] {
        let size = std::fs::metadata(log_dir.join(name)).expect("kept").len();
        assert!(size > 0 && size <= 300, "{name}: {size} bytes");
    }
    assert!(
        !log_dir.join("chatty.log.3").exists(),
        "2 rotated files kept"
    );
    assert!(live.exists());

    let lines = supervisor.logs("chatty", 1000).expect("logs");
    let numbers: Vec<u32> = lines
        .iter()
        .filter_map(|line| line.split(" out line ").nth(1).and_then(|n| n.parse().ok()))
        .collect();
    assert!(
        !numbers.is_empty() && numbers.len() < 200,
        "older lines dropped: {numbers:?}"
    );
    assert!(
        numbers.windows(2).all(|w| w[1] == w[0] + 1),
        "in order: {numbers:?}"
    );
    assert_eq!(numbers.last(), Some(&199));
    let cut = lines
        .iter()
        .find(|line| line.contains(" err "))
        .expect("the stderr line");
    assert!(
        cut.ends_with(" err 01234567890123456789012345678901 [truncated]"),
        "{cut}"
    );
    let last = supervisor.logs("chatty", 2).expect("logs");
    assert_eq!(last.len(), 2);
    assert!(last[1].contains(" host exited: exit code 0"), "{last:?}");
}

#[tokio::test]
async fn a_missing_command_is_a_spawn_error_naming_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    let manifest = manifest("id = \"ghost\"\n[run]\ncommand = \"/no/such/agent-binary\"\n");
    let err = supervisor
        .run(&manifest, 1)
        .await
        .expect_err("no such command");
    assert!(
        matches!(&err, ProcessError::Spawn { command, source }
            if command == "/no/such/agent-binary" && source.kind() == std::io::ErrorKind::NotFound),
        "{err:?}"
    );
    assert!(err.to_string().contains("/no/such/agent-binary"), "{err}");
    assert!(supervisor.replicas().is_empty(), "not retried, not kept");
    assert!(matches!(
        supervisor.run(&manifest, 1).await,
        Err(ProcessError::Spawn { .. })
    ));
    assert!(matches!(
        supervisor.run(&manifest, 0).await,
        Err(ProcessError::InvalidReplica { replica: 0, .. })
    ));
}

#[tokio::test]
async fn a_failing_health_command_restarts_the_replica() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    let mut events = supervisor.events();
    // Healthy once after each start (the check removes the mark), then failing.
    let manifest = sh(
        "sick",
        "touch healthy; sleep 60",
        &format!(
            "working_dir = \"{}\"\n[restart]\nmax_restarts = 1\ninitial_backoff = \"10ms\"\nmax_backoff = \"20ms\"\n\
             [health]\ncheck = \"command\"\ncommand = [\"/bin/sh\", \"-c\", \"test -e healthy && rm healthy || {{ echo no mark >&2; exit 1; }}\"]\n\
             interval = \"50ms\"\ntimeout = \"40ms\"\nfailures = 2\nstart_grace = \"5s\"\n",
            dir.path().display()
        ),
    );
    supervisor.run(&manifest, 1).await.expect("started");
    eventually("a passing check", || {
        supervisor
            .status("sick")
            .filter(|s| s.healthy == Some(true))
    })
    .await;
    let seen = events_until(&mut events, |event| {
        matches!(event, ReplicaEvent::Failed { .. })
    })
    .await;
    assert_eq!(
        seen.iter()
            .filter(|e| matches!(e, ReplicaEvent::Restarting { .. }))
            .count(),
        1,
        "{seen:?}"
    );
    let status = supervisor.status("sick").expect("known");
    assert_eq!(status.restarts, 1);
    assert_eq!(
        status.state,
        ReplicaState::Failed {
            reason: "crashed 2 times within 10m; last: health check failed 2 times: exit code 1 (no mark)".into()
        }
    );
}

#[tokio::test]
async fn restart_kills_and_starts_again_under_the_policy() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    let manifest = sh(
        "beat",
        "sleep 60",
        "[restart]\ninitial_backoff = \"10ms\"\n",
    );
    let first = supervisor.run(&manifest, 1).await.expect("started").pid;
    let mut events = supervisor.events();
    supervisor
        .restart("beat", "no heartbeat for 30s")
        .await
        .expect("asked");
    let seen = events_until(&mut events, |event| {
        matches!(event, ReplicaEvent::Started { .. })
    })
    .await;
    assert!(
        seen.iter()
            .any(|e| matches!(e, ReplicaEvent::Restarting { attempt: 1, .. })),
        "{seen:?}"
    );
    let status = eventually("the new process", || {
        supervisor
            .status("beat")
            .filter(|s| s.state == ReplicaState::Running)
    })
    .await;
    assert_ne!(status.pid, first);
    assert_eq!(status.restarts, 1);
    assert_eq!(status.last_exit.as_deref(), Some("no heartbeat for 30s"));
    assert!(matches!(
        supervisor.restart("nobody", "x").await,
        Err(ProcessError::NotFound { .. })
    ));
    supervisor.shutdown().await;
}

#[tokio::test]
async fn shutdown_stops_every_replica_and_refuses_more() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    let manifest = sh("many", "sleep 60", "");
    let pids: Vec<u32> = [
        supervisor.run(&manifest, 1).await.expect("started"),
        supervisor.run(&manifest, 2).await.expect("started"),
    ]
    .iter()
    .filter_map(|status| status.pid)
    .collect();
    tokio::time::timeout(DEADLINE, supervisor.shutdown())
        .await
        .expect("shutdown returns");
    let states: Vec<_> = supervisor
        .replicas()
        .into_iter()
        .map(|s| (s.agent_id, s.state))
        .collect();
    assert_eq!(
        states,
        vec![
            ("many".to_owned(), ReplicaState::Stopped),
            ("many-2".to_owned(), ReplicaState::Stopped)
        ]
    );
    assert!(pids.iter().all(|pid| gone(*pid)));
    assert!(matches!(
        supervisor.run(&manifest, 1).await,
        Err(ProcessError::ShuttingDown)
    ));
}

#[tokio::test]
async fn logs_of_unknown_or_bad_ids_are_errors() {
    let dir = tempfile::tempdir().expect("temp dir");
    let supervisor = Supervisor::new(config(dir.path()));
    assert!(matches!(
        supervisor.logs("nobody", 10),
        Err(ProcessError::NotFound { .. })
    ));
    assert!(matches!(
        supervisor.logs("../etc/passwd", 10),
        Err(ProcessError::InvalidAgentId { .. })
    ));
}

#[tokio::test]
async fn through_a_launcher_the_spec_and_command_are_passed() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("temp dir");
    // A stand-in for `chorus host-exec`: records its arguments, then runs what follows `--`.
    let launcher = dir.path().join("fake-chorus");
    let recorded = dir.path().join("args");
    std::fs::write(
        &launcher,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$@\" > {}\nwhile [ \"$1\" != -- ]; do shift; done\nshift\nexec \"$@\"\n",
            recorded.display()
        ),
    )
    .expect("write");
    std::fs::set_permissions(&launcher, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut config = config(dir.path());
    config.launcher = Some(launcher);
    let supervisor = Supervisor::new(config);
    let manifest = sh(
        "limited",
        "echo id=$CHORUS_AGENT_ID",
        "[resources]\nmemory_mb = 64\ncpu = 0.5\n[restart]\npolicy = \"never\"\n",
    );
    let status = supervisor.run(&manifest, 1).await.expect("started");
    let cgroups = supervisor.inner.cgroups.clone();
    match &cgroups {
        // This machine (cgroups v1) takes this branch: memory by rlimit, CPU not limited.
        None => assert_eq!(status.limits, Enforcement::Rlimit { memory: true }),
        Some(host) => assert_eq!(
            status.limits,
            Enforcement::CgroupV2 {
                memory: host.memory,
                cpu: host.cpu
            }
        ),
    }
    finished(&supervisor, "limited").await;
    log_has(&supervisor, "limited", " out id=limited").await;
    let args = std::fs::read_to_string(&recorded).expect("the launcher ran");
    let args: Vec<&str> = args.lines().collect();
    assert_eq!(args[0], "host-exec");
    let at = args.iter().position(|a| *a == "--").expect("the separator");
    assert_eq!(
        &args[at + 1..],
        &["/bin/sh", "-c", "echo id=$CHORUS_AGENT_ID"]
    );
    let spec_args = args[1..at]
        .iter()
        .map(std::ffi::OsString::from)
        .collect::<Vec<_>>();
    let mut with_command = spec_args;
    with_command.extend(["--".into(), "x".into()]);
    let (spec, _) = LaunchSpec::from_args(with_command).expect("a spec the launcher reads");
    assert_eq!(spec.parent_pid, Some(std::process::id()));
    if cgroups.is_none() {
        assert_eq!(spec.memory_bytes, Some(64 * 1024 * 1024));
        assert_eq!((spec.cpu_millis, spec.cgroup), (None, None));
    }

    let missing = manifest_with_command("gone", "no-such-agent-anywhere");
    let err = supervisor
        .run(&missing, 1)
        .await
        .expect_err("resolved before the launcher");
    assert!(
        matches!(&err, ProcessError::Spawn { command, .. } if command == "no-such-agent-anywhere"),
        "{err:?}"
    );
}

fn manifest_with_command(id: &str, command: &str) -> Manifest {
    manifest(&format!("id = \"{id}\"\n[run]\ncommand = \"{command}\"\n"))
}

#[test]
fn the_policy_decides_what_follows_an_exit() {
    use Decision::*;
    use RestartPolicy::*;
    let cases = [
        (Always, Exit::Code(0), Restart),
        (Always, Exit::Code(1), Restart),
        (OnFailure, Exit::Code(0), Stop),
        (OnFailure, Exit::Code(3), Restart),
        (OnFailure, Exit::Signal(9), Restart),
        (OnFailure, Exit::Unhealthy("x".into()), Restart),
        (OnFailure, Exit::SpawnFailed("x".into()), Restart),
        (Never, Exit::Code(0), Stop),
        (Never, Exit::Code(3), Fail),
        (Never, Exit::Signal(11), Fail),
        (Never, Exit::Unhealthy("x".into()), Fail),
        (Always, Exit::Stopped, Stop),
        (Never, Exit::Stopped, Stop),
    ];
    for (policy, exit, decision) in cases {
        assert_eq!(decide(policy, &exit), decision, "{policy:?} after {exit:?}");
    }
}

#[test]
fn limits_go_to_a_cgroup_where_the_host_has_one() {
    let root = tempfile::tempdir().expect("temp dir");
    let host = CgroupHost {
        parent: root.path().to_owned(),
        memory: true,
        cpu: false,
    };
    let resources = Resources {
        memory_mb: Some(128),
        cpu: Some(1.5),
        gpus: None,
    };
    let plan = plan_limits(Some(&host), "calc-2", &resources);
    assert_eq!(
        plan.enforcement,
        Enforcement::CgroupV2 {
            memory: true,
            cpu: false
        }
    );
    assert_eq!(
        plan.cgroup.as_deref(),
        Some(root.path().join("chorus-calc-2").as_path())
    );
    assert!(root.path().join("chorus-calc-2").is_dir());
    assert_eq!(plan.spec.memory_bytes, Some(128 * MIB));
    assert_eq!(plan.spec.cpu_millis, None, "no cpu controller: not written");

    let plan = plan_limits(None, "calc-2", &resources);
    assert_eq!(plan.enforcement, Enforcement::Rlimit { memory: true });
    assert_eq!(
        (plan.spec.memory_bytes, plan.spec.cgroup),
        (Some(128 * MIB), None)
    );

    let cpu_only = Resources {
        memory_mb: None,
        cpu: Some(0.25),
        gpus: None,
    };
    assert_eq!(
        plan_limits(None, "a", &cpu_only).enforcement,
        Enforcement::None,
        "rlimit cannot throttle CPU"
    );
    let cpu_host = CgroupHost { cpu: true, ..host };
    let plan = plan_limits(Some(&cpu_host), "a", &cpu_only);
    assert_eq!(
        plan.enforcement,
        Enforcement::CgroupV2 {
            memory: false,
            cpu: true
        }
    );
    assert_eq!(plan.spec.cpu_millis, Some(250));
    assert_eq!(
        plan_limits(Some(&cpu_host), "b", &Resources::default()).enforcement,
        Enforcement::None
    );
}

#[test]
fn a_status_is_json_for_the_bus() {
    let status = ReplicaStatus {
        agent_id: "calc-2".into(),
        deployment: "calc".into(),
        replica: 2,
        pid: Some(42),
        state: ReplicaState::BackingOff {
            attempt: 2,
            delay_ms: 1000,
        },
        restarts: 3,
        started: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
        rss_bytes: Some(1024),
        cpu_seconds: Some(0.5),
        limits: Enforcement::Rlimit { memory: true },
        last_exit: Some("exit code 3".into()),
        healthy: None,
    };
    let json = serde_json::to_value(&status).expect("json");
    assert_eq!(
        json["state"],
        serde_json::json!({"kind": "backing_off", "attempt": 2, "delay_ms": 1000})
    );
    assert_eq!(json["started"], "2023-11-14T22:13:20Z");
    assert_eq!(
        json["limits"],
        serde_json::json!({"kind": "rlimit", "memory": true})
    );
    let back: ReplicaStatus = serde_json::from_value(json).expect("reads back");
    assert_eq!(back, status);
}
