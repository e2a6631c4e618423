//! `chorus chaos` as a user runs it: its own servers, and its coordinators as `chorus serve`
//! child processes killed with SIGKILL (the in-process form of every scenario runs in
//! `tests/tests/chaos.rs`).

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs `chorus` with `args`, within `limit`.
fn chorus(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run chorus");
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chorus {args:?} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn chaos_kills_a_child_coordinator_and_every_poison_command_is_dead_lettered_once() {
    let out = chorus(
        &["chaos", "--short", "--only", "coordinator-kill", "--json"],
        Duration::from_secs(180),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(report["ok"], true, "{report:#}");
    let scenarios = report["scenarios"].as_array().expect("scenarios");
    assert_eq!(scenarios.len(), 1);
    let rows = scenarios[0]["rows"].as_array().expect("rows");
    let poison = rows
        .iter()
        .find(|r| r["class"] == "poison")
        .unwrap_or_else(|| panic!("no poison row: {report:#}"));
    assert!(poison["acked"].as_u64().is_some_and(|n| n > 0), "{poison}");
    assert_eq!(poison["dead_lettered"], poison["acked"], "{poison}");
    for row in rows {
        assert_eq!(row["lost"], 0, "{row}");
    }
}

#[test]
fn an_unknown_scenario_is_a_usage_error_that_names_the_known_ones() {
    let out = chorus(&["chaos", "--only", "meteor"], Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no scenario \"meteor\""), "{stderr}");
    assert!(stderr.contains("server-kill"), "{stderr}");
}

#[test]
fn soak_options_are_checked_before_anything_runs() {
    for (args, says) in [
        (&["chaos", "--soak", "banana"][..], "banana"),
        (&["chaos", "--soak", "0s"][..], "no time"),
        (
            &["chaos", "--soak", "1m", "--only", "server-kill"][..],
            "--only",
        ),
        (&["chaos", "--rate", "50"][..], "--soak"),
    ] {
        let out = chorus(args, Duration::from_secs(30));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
