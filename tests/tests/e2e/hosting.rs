//! Agents hosted by the bus (issue 36), through the user's entry points: `chorus host` on two
//! "machines" (two host processes), an in-process coordinator, and `chorus deploy`, `scale`,
//! `terminate`, `deployments`, `hosts` and `logs`, against a real nats-server. The hosted
//! agents are `chorus agent` processes: real SDK agents.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use chorus_host::protocol::DeploymentView;
use chorus_nats_server::NatsServer;
use chorus_sdk::{Agent, Call, SdkError};
use chorus_tests::{Processes, agent, chorus_binary, eventually, server, within};
use serde_json::Value;

/// Hosts report this often here, and the coordinator gives a silent host this long.
const REPORT: &str = "200ms";
const GRACE_MS: u64 = 3_000;
/// Deploy and scale wait this long for their confirmations.
const DEPLOY_WAIT: Duration = Duration::from_secs(60);

struct Bus {
    server: NatsServer,
    chorus: PathBuf,
    dir: tempfile::TempDir,
    _coordinator: chorus_coordinator::Coordinator,
}

impl Bus {
    async fn start() -> Bus {
        let server = server();
        let config = chorus_coordinator::CoordinatorConfig {
            servers: server.url().to_owned(),
            metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            reap_interval_ms: 50,
            host_grace_ms: GRACE_MS,
            reconcile_interval_ms: 200,
            ..chorus_coordinator::CoordinatorConfig::default()
        };
        let coordinator = within(
            chorus_tests::WAIT,
            "coordinator start",
            chorus_coordinator::Coordinator::start(config, false),
        )
        .await
        .expect("coordinator starts");
        Bus {
            server,
            chorus: chorus_binary(),
            dir: tempfile::tempdir().expect("temp dir"),
            _coordinator: coordinator,
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.chorus);
        cmd.env("CHORUS_NATS_URL", self.server.url())
            .env("CHORUS_CONFIG_DIR", self.dir.path())
            .env_remove("CHORUS_CONTEXT");
        cmd
    }

    /// `chorus host --name NAME`, its logs in the test's folder, `chorus` on its `PATH` (as
    /// installing it puts it on a user's), for the `chorus agent` processes it runs.
    fn host(&self, name: &str, extra: &[&str]) -> Child {
        let examples = self.chorus.parent().expect("the binary's folder");
        let path = std::env::join_paths(std::iter::once(examples.to_owned()).chain(
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
        ))
        .expect("PATH");
        self.command()
            .env("PATH", path)
            .args([
                "host",
                "--name",
                name,
                "--report-interval",
                REPORT,
                "--stop-grace",
                "2s",
                // The agents are this test's builds, in the builder's folders: run as the
                // builder, unsandboxed (`agents_run_as_an_unprivileged_user_...` checks
                // the defaults).
                "--user",
                &chorus_host::process::user::current_user(),
                "--sandbox",
                "none",
            ])
            .arg("--log-dir")
            .arg(self.dir.path().join(name))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chorus host starts")
    }

    /// Runs `chorus ARGS` to its end (bounded by `limit`).
    async fn run(&self, args: &[&str], limit: Duration) -> Output {
        let mut cmd = tokio::process::Command::from(self.command());
        cmd.args(args).kill_on_drop(true);
        within(limit, &format!("chorus {}", args.join(" ")), cmd.output())
            .await
            .expect("chorus runs")
    }

    fn manifest(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, text).expect("manifest written");
        path
    }

    async fn deployments(&self) -> Vec<DeploymentView> {
        let out = self
            .run(&["deployments", "--json"], Duration::from_secs(30))
            .await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("deployments as JSON")
    }

    async fn hosts(&self) -> Vec<Value> {
        let out = self
            .run(&["hosts", "--json"], Duration::from_secs(30))
            .await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("hosts as JSON")
    }

    /// Waits until both named hosts are live.
    async fn hosts_live(&self, names: &[&str]) {
        eventually(chorus_tests::WAIT, "hosts live", || async {
            let hosts = self.hosts().await;
            names
                .iter()
                .all(|n| {
                    hosts
                        .iter()
                        .any(|h| h["report"]["name"] == *n && h["state"] == "live")
                })
                .then_some(())
        })
        .await;
    }
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn echo_manifest(id: &str, extra: &str) -> String {
    format!(
        "id = \"{id}\"\ncapabilities = [\"{id}\"]\n{extra}\n\n[run]\ncommand = \"chorus\"\nargs = [\"agent\", \"--capability\", \"{id}\"]\n\n[restart]\ninitial_backoff = \"100ms\"\nmax_backoff = \"1s\"\n"
    )
}

/// Asks capability `capability` (at `agent` when given): who answered, and its pid.
async fn ask(
    caller: &Agent,
    capability: &str,
    at: Option<&str>,
) -> Result<(String, u32), SdkError> {
    let call = match at {
        Some(agent) => Call::capability_at(agent, capability),
        None => Call::capability(capability),
    };
    let reply = caller
        .call(call.payload(&"ping")?.timeout(Duration::from_secs(2)))
        .await?;
    let body: Value = reply.payload_as()?;
    let pid = body["pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
        .unwrap_or(0);
    Ok((reply.envelope.from.to_string(), pid))
}

/// The host of `deployment`'s first placed replica.
fn first_host(views: &[DeploymentView], deployment: &str) -> Option<String> {
    views
        .iter()
        .find(|d| d.deployment == deployment)
        .and_then(|d| d.placed.first())
        .map(|p| p.host.clone())
}

fn alive(pid: u32) -> bool {
    // A zombie (exited, not yet reaped) is not alive.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z'))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_scales_shares_load_survives_a_crash_and_its_hosts_death_and_terminates() {
    let bus = Bus::start().await;
    let mut hosts = Processes::default();
    hosts.0.push(bus.host("h1", &[]));
    hosts.0.push(bus.host("h2", &[]));
    bus.hosts_live(&["h1", "h2"]).await;
    // The manifest docs/HOSTING.md deploys.
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/echo.toml");

    // Deployed: chorus deploy waits for the replica's deploy_confirm.
    let out = bus
        .run(
            &["deploy", manifest.to_str().expect("utf-8 path")],
            DEPLOY_WAIT,
        )
        .await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("echo running on h"),
        "{}",
        text(&out)
    );

    // Scaled to 3: the replicas spread over both hosts and share the capability's load.
    let out = bus.run(&["scale", "echo", "3"], DEPLOY_WAIT).await;
    assert!(out.status.success(), "{}", text(&out));
    let view = bus
        .deployments()
        .await
        .into_iter()
        .find(|d| d.deployment == "echo")
        .expect("echo");
    let placed: BTreeMap<String, String> = view
        .placed
        .iter()
        .map(|p| (p.agent.clone(), p.host.clone()))
        .collect();
    assert_eq!(
        placed.keys().cloned().collect::<Vec<_>>(),
        ["echo", "echo-2", "echo-3"]
    );
    assert_eq!(
        placed.values().collect::<BTreeSet<_>>().len(),
        2,
        "spread: {placed:?}"
    );
    let caller = agent(&bus.server, "hosting-caller").await;
    let mut answered: BTreeMap<String, u32> = BTreeMap::new();
    for _ in 0..60 {
        let (from, pid) = ask(&caller, "echo", None).await.expect("echo answers");
        answered.insert(from, pid);
    }
    assert_eq!(
        answered.len(),
        3,
        "every replica took a share: {answered:?}"
    );

    // One replica killed: its host starts it again (a new process, the same agent).
    let victim = answered["echo-2"];
    let status = Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let restarted = eventually(Duration::from_secs(30), "echo-2 back", || async {
        match ask(&caller, "echo", Some("echo-2")).await {
            Ok((_, pid)) if pid != victim => Some(pid),
            _ => None,
        }
    })
    .await;
    assert_ne!(restarted, victim);
    let hosts_now = bus.hosts().await;
    let restarts = hosts_now
        .iter()
        .flat_map(|h| {
            h["report"]["replicas"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .find(|r| r["agent_id"] == "echo-2")
        .map(|r| r["restarts"].as_u64().unwrap_or(0));
    assert_eq!(restarts, Some(1), "{hosts_now:?}");

    // Its output is kept by its host.
    let out = bus
        .run(&["logs", "echo-2", "-n", "50"], Duration::from_secs(30))
        .await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("echo-2 serving echo"),
        "{}",
        text(&out)
    );

    // The host with two replicas killed: they die with it, and after the grace they run on
    // the other host.
    let mut pids: BTreeMap<String, u32> = BTreeMap::new();
    for replica in ["echo", "echo-2", "echo-3"] {
        pids.insert(
            replica.into(),
            ask(&caller, "echo", Some(replica))
                .await
                .expect("answers")
                .1,
        );
    }
    let (doomed, survivor) = if placed.values().filter(|h| *h == "h1").count() == 2 {
        (0, "h2")
    } else {
        (1, "h1")
    };
    let doomed_name = if doomed == 0 { "h1" } else { "h2" };
    hosts.0[doomed].kill().expect("kill -9 the host");
    let _ = hosts.0[doomed].wait();
    let orphans: Vec<u32> = placed
        .iter()
        .filter(|(_, h)| *h == doomed_name)
        .map(|(a, _)| pids[a])
        .collect();
    assert_eq!(orphans.len(), 2);
    eventually(
        Duration::from_secs(10),
        "the host's agents die with it",
        || async { orphans.iter().all(|pid| !alive(*pid)).then_some(()) },
    )
    .await;
    eventually(
        Duration::from_secs(30),
        "replicas moved to the survivor",
        || async {
            let view = bus
                .deployments()
                .await
                .into_iter()
                .find(|d| d.deployment == "echo")?;
            (view.placed.len() == 3 && view.placed.iter().all(|p| p.host == survivor)).then_some(())
        },
    )
    .await;
    for replica in ["echo", "echo-2", "echo-3"] {
        eventually(
            Duration::from_secs(30),
            "every replica answers again",
            || async { ask(&caller, "echo", Some(replica)).await.ok() },
        )
        .await;
    }

    // Terminated: every replica stops, nobody serves the capability.
    let mut last_pids = Vec::new();
    for replica in ["echo", "echo-2", "echo-3"] {
        last_pids.push(
            ask(&caller, "echo", Some(replica))
                .await
                .expect("answers")
                .1,
        );
    }
    let out = bus
        .run(&["terminate", "echo"], Duration::from_secs(30))
        .await;
    assert!(out.status.success(), "{}", text(&out));
    eventually(Duration::from_secs(10), "hosted processes gone", || async {
        last_pids.iter().all(|pid| !alive(*pid)).then_some(())
    })
    .await;
    assert!(matches!(
        ask(&caller, "echo", None).await,
        Err(SdkError::NoResponders(_))
    ));
    assert!(
        bus.deployments()
            .await
            .iter()
            .all(|d| d.deployment != "echo")
    );
    caller.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn co_location_places_beside_the_target_and_refuses_when_its_host_is_full() {
    let bus = Bus::start().await;
    let mut hosts = Processes::default();
    hosts.0.push(bus.host("small", &["--max-agents", "2"]));
    hosts.0.push(bus.host("large", &["--max-agents", "50"]));
    bus.hosts_live(&["small", "large"]).await;
    let pin = |host: &str| format!("[placement]\nhosts = [\"{host}\"]");
    let orchestrator = bus.manifest("orch", &echo_manifest("orch", &pin("small")));
    let out = bus
        .run(
            &["deploy", orchestrator.to_str().expect("utf-8")],
            DEPLOY_WAIT,
        )
        .await;
    assert!(out.status.success(), "{}", text(&out));

    // Beside it: on the small host, though the large one is emptier.
    let helper = bus.manifest(
        "helper",
        &echo_manifest("helper", "[placement]\nco_locate_with = \"orch\""),
    );
    let out = bus
        .run(&["deploy", helper.to_str().expect("utf-8")], DEPLOY_WAIT)
        .await;
    assert!(out.status.success(), "{}", text(&out));
    let views = bus.deployments().await;
    let host_of = |id: &str| first_host(&views, id);
    assert_eq!(host_of("helper").as_deref(), Some("small"));

    // The small host is now full: a second helper beside orch is refused, with the reason.
    let second = bus.manifest(
        "helper2",
        &echo_manifest("helper2", "[placement]\nco_locate_with = \"orch\""),
    );
    let out = bus
        .run(&["deploy", second.to_str().expect("utf-8")], DEPLOY_WAIT)
        .await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("host small, where orch runs, is full: 2 of 2 agents placed"),
        "{}",
        text(&out)
    );

    // A target no host runs is refused before anything starts.
    let stray = bus.manifest(
        "stray",
        &echo_manifest("stray", "[placement]\nco_locate_with = \"nobody\""),
    );
    let out = bus
        .run(&["deploy", stray.to_str().expect("utf-8")], DEPLOY_WAIT)
        .await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no host runs an agent \"nobody\""),
        "{}",
        text(&out)
    );
    assert!(
        bus.deployments()
            .await
            .iter()
            .all(|d| d.deployment != "stray")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_manifests_are_refused_naming_the_field_and_a_crash_loop_ends_in_deploy_failure() {
    let bus = Bus::start().await;
    let mut hosts = Processes::default();
    hosts.0.push(bus.host("h1", &[]));
    bus.hosts_live(&["h1"]).await;

    for (name, body, says) in [
        (
            "unknown",
            "id = \"x\"\ncolour = \"red\"\n[run]\ncommand = \"true\"\n",
            "colour",
        ),
        (
            "nocommand",
            "id = \"x\"\n[run]\nargs = [\"a\"]\n",
            "command",
        ),
        (
            "memory",
            "id = \"x\"\n[run]\ncommand = \"true\"\n[resources]\nmemory_mb = 0\n",
            "resources.memory_mb",
        ),
    ] {
        let path = bus.manifest(name, body);
        let out = bus
            .run(
                &["deploy", path.to_str().expect("utf-8")],
                Duration::from_secs(30),
            )
            .await;
        assert!(!out.status.success(), "{name}: {}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(says),
            "{name}: {}",
            text(&out)
        );
    }
    assert!(bus.deployments().await.is_empty());

    // A command that crashes at once: restarted no faster than its backoff, then given up.
    let crash = bus.manifest(
        "crash",
        "id = \"crasher\"\n[run]\ncommand = \"/bin/sh\"\nargs = [\"-c\", \"echo boom >&2; exit 3\"]\n\
         [restart]\nmax_restarts = 2\ninitial_backoff = \"200ms\"\nmax_backoff = \"400ms\"\n",
    );
    let started = std::time::Instant::now();
    let out = bus
        .run(&["deploy", crash.to_str().expect("utf-8")], DEPLOY_WAIT)
        .await;
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("crasher failed: h1: crashed 3 times"),
        "{}",
        text(&out)
    );
    assert!(
        stderr.contains("exit code 3") && stderr.contains("boom"),
        "{}",
        text(&out)
    );
    // Two restarts, 200 ms then 400 ms apart at least.
    assert!(
        started.elapsed() >= Duration::from_millis(600),
        "{:?}",
        started.elapsed()
    );
    // The coordinator records it from the host's next report.
    let view = eventually(Duration::from_secs(10), "the failure recorded", || async {
        bus.deployments()
            .await
            .into_iter()
            .find(|d| d.deployment == "crasher" && !d.failed.is_empty())
    })
    .await;
    assert_eq!(view.failed.len(), 1, "{view:?}");
    assert!(
        view.placed.is_empty(),
        "a failed replica is not running: {view:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_deployment_runs_its_replicas_in_one_process_on_one_connection() {
    let bus = Bus::start().await;
    let mut hosts = Processes::default();
    hosts.0.push(bus.host("h1", &[]));
    bus.hosts_live(&["h1"]).await;
    let manifest = bus.manifest(
        "many",
        &echo_manifest("many", "replicas = 3").replace("[run]\n", "[run]\nshared = true\n"),
    );
    let out = bus
        .run(&["deploy", manifest.to_str().expect("utf-8")], DEPLOY_WAIT)
        .await;
    assert!(out.status.success(), "{}", text(&out));
    let caller = agent(&bus.server, "shared-caller").await;
    let pids = |n: u32| {
        let caller = caller.clone();
        async move {
            let mut pids = BTreeSet::new();
            for replica in 1..=n {
                let id = if replica == 1 {
                    "many".to_owned()
                } else {
                    format!("many-{replica}")
                };
                let (from, pid) = ask(&caller, "many", Some(&id)).await.ok()?;
                assert_eq!(from, id);
                pids.insert(pid);
            }
            Some(pids)
        }
    };
    let first = eventually(Duration::from_secs(20), "three agents answer", || pids(3)).await;
    assert_eq!(first.len(), 1, "one process serves the three: {first:?}");

    // Scaled: the process starts again serving five.
    let out = bus.run(&["scale", "many", "5"], DEPLOY_WAIT).await;
    assert!(out.status.success(), "{}", text(&out));
    let second = eventually(Duration::from_secs(20), "five agents answer", || async {
        pids(5).await.filter(|p| p.len() == 1 && *p != first)
    })
    .await;
    let hosts_now = bus.hosts().await;
    let shared = &hosts_now[0]["report"]["shared"];
    assert_eq!(
        shared.as_array().map(Vec::len),
        Some(1),
        "one process: {hosts_now:?}"
    );
    assert_eq!(
        shared[0]["replicas"],
        serde_json::json!([1, 2, 3, 4, 5]),
        "{hosts_now:?}"
    );
    let reported: BTreeSet<u64> = shared[0]["process"]["pid"].as_u64().into_iter().collect();
    assert_eq!(
        u64::from(*second.first().expect("pid")),
        *reported.first().expect("pid")
    );
    let out = bus.run(&["logs", "many-4"], Duration::from_secs(30)).await;
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("many,many-2,many-3,many-4,many-5 serving many"),
        "{}",
        text(&out)
    );
    caller.shutdown().await;
}

/// docs/HOSTING.md, "In five commands", run as written: with a bus running and `chorus` on the
/// PATH, its block of commands in one shell, from the repository's root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_five_commands_of_the_hosting_guide_run_as_written() {
    let bus = Bus::start().await;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let guide = std::fs::read_to_string(root.join("docs/HOSTING.md")).expect("docs/HOSTING.md");
    let section = guide
        .split("## In five commands")
        .nth(1)
        .expect("the section");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("its sh block");
    assert!(block.contains("chorus deploy deploy/echo.toml"), "{block}");
    let path = std::env::join_paths(
        std::iter::once(bus.chorus.parent().expect("folder").to_owned()).chain(
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
        ),
    )
    .expect("PATH");
    // A host started by root runs its agents as nobody, who cannot reach a build under
    // root's home: the test's `chorus` is linked into a folder anyone may read, as an
    // installed one is.
    let bin = bus.dir.path().join("bin");
    std::fs::create_dir_all(&bin).expect("bin folder");
    {
        use std::os::unix::fs::PermissionsExt;
        for folder in [bus.dir.path(), bin.as_path()] {
            std::fs::set_permissions(folder, std::fs::Permissions::from_mode(0o755))
                .expect("chmod");
        }
    }
    let installed = bin.join("chorus");
    if std::fs::hard_link(&bus.chorus, &installed).is_err() {
        std::fs::copy(&bus.chorus, &installed).expect("chorus copied");
    }
    let path = std::env::join_paths(
        std::iter::once(bin.clone()).chain(std::env::split_paths(&path).skip(1)),
    )
    .expect("PATH");
    let script = format!("set -euo pipefail\n{block}\nkill %1\nwait\n");
    let mut shell = tokio::process::Command::new("bash");
    shell
        .args(["-c", &script])
        .current_dir(&root)
        .env("PATH", path)
        .env("HOME", bus.dir.path())
        .env_remove("XDG_STATE_HOME")
        .env("CHORUS_NATS_URL", bus.server.url())
        .env("CHORUS_CONFIG_DIR", bus.dir.path())
        .env_remove("CHORUS_CONTEXT")
        .kill_on_drop(true);
    let out = within(
        Duration::from_secs(180),
        "the guide's commands",
        shell.output(),
    )
    .await
    .expect("bash runs");
    assert!(out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for agent in ["echo", "echo-2", "echo-3"] {
        assert!(
            stderr.contains(&format!("{agent} running on h1")),
            "{}",
            text(&out)
        );
    }
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("echo-2 serving echo"),
        "{}",
        text(&out)
    );
    assert!(
        stderr.contains("deployment echo terminated"),
        "{}",
        text(&out)
    );
}

/// Agentify's host requirements: a manifest that needs a GPU goes to a host that has one free,
/// and is refused with the reason when none has; one that prefers a region goes to a host
/// there. A manifest's `customer` reaches its agent, which discovery by customer finds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_and_a_preferred_region_choose_the_host_and_the_customer_reaches_the_agent() {
    let bus = Bus::start().await;
    let mut hosts = Processes::default();
    hosts
        .0
        .push(bus.host("plain", &["--region", "us-east", "--max-agents", "10"]));
    hosts.0.push(bus.host(
        "gpu",
        &["--gpus", "1", "--region", "eu-west", "--max-agents", "10"],
    ));
    bus.hosts_live(&["plain", "gpu"]).await;
    let listed = bus.hosts().await;
    let gpu_host = listed
        .iter()
        .find(|h| h["report"]["name"] == "gpu")
        .expect("the gpu host");
    assert_eq!(gpu_host["report"]["capacity"]["gpus"], 1);
    assert_eq!(gpu_host["report"]["capacity"]["region"], "eu-west");

    let bus = &bus;
    let deploy = |name: &str, extra: &str| {
        let path = bus.manifest(name, &echo_manifest(name, extra));
        async move {
            bus.run(&["deploy", path.to_str().expect("utf-8")], DEPLOY_WAIT)
                .await
        }
    };
    // The plain host comes first by name and is as empty: the GPU decides.
    let out = deploy("vision", "customer = \"acme\"\n[resources]\ngpus = 1").await;
    assert!(out.status.success(), "{}", text(&out));
    let out = deploy("vision2", "[resources]\ngpus = 1").await;
    assert!(!out.status.success(), "{}", text(&out));
    let refusal = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(refusal.contains("gpu: needs 1 GPU, 0 free"), "{refusal}");
    assert!(refusal.contains("plain: needs 1 GPU, 0 free"), "{refusal}");
    // A preferred region wins over spreading by name.
    let out = deploy("summarizer", "[placement]\npreferred_region = \"eu-west\"").await;
    assert!(out.status.success(), "{}", text(&out));
    let views = bus.deployments().await;
    let host_of = |id: &str| first_host(&views, id);
    assert_eq!(host_of("vision").as_deref(), Some("gpu"));
    assert_eq!(host_of("summarizer").as_deref(), Some("gpu"));

    // The hosted agent knows its customer: discovery for acme finds it, for globex not.
    let caller = agent(&bus.server, "region-caller").await;
    let for_customer = |customer: &'static str| {
        let caller = caller.clone();
        async move {
            caller
                .discover(&chorus_sdk::DiscoverQuery {
                    capability: Some("vision".into()),
                    customer: Some(customer.into()),
                    ..Default::default()
                })
                .await
                .expect("discovery answers")
        }
    };
    let found = eventually(
        chorus_tests::WAIT,
        "the vision agent registered",
        || async {
            let found = for_customer("acme").await;
            (!found.is_empty()).then_some(found)
        },
    )
    .await;
    assert_eq!(found[0].manifest.customer.as_deref(), Some("acme"));
    assert!(for_customer("globex").await.is_empty());
}

/// Agentify's build configuration: a manifest's `[build]` has its host clone the repository
/// and run the build command before the agent starts from the clone; a build that fails ends
/// in a `deploy_failure` naming the step, its exit and its last line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_built_from_a_repository_runs_from_its_clone_and_a_failed_build_is_reported() {
    let bus = Bus::start().await;
    // A repository whose build writes the agent's program: `chorus agent` serving `built`.
    let repo = bus.dir.path().join("agent-repo");
    std::fs::create_dir(&repo).expect("repository folder");
    std::fs::write(
        repo.join("make-agent.sh"),
        "mkdir -p bin\nprintf '#!/bin/sh\\nexec chorus agent --capability built\\n' > bin/agent\nchmod +x bin/agent\necho built the agent\n",
    )
    .expect("build script");
    for args in [
        vec!["init", "--quiet"],
        vec!["add", "make-agent.sh"],
        vec![
            "-c",
            "user.name=chorus",
            "-c",
            "user.email=chorus@localhost",
            "commit",
            "--quiet",
            "-m",
            "an agent",
        ],
    ] {
        let status = Command::new("git")
            .args(&args)
            .current_dir(&repo)
            .status()
            .expect("git runs");
        assert!(status.success(), "git {args:?}");
    }
    let mut hosts = Processes::default();
    hosts.0.push(bus.host("builder", &[]));
    bus.hosts_live(&["builder"]).await;
    let manifest = |id: &str, command: &str| {
        format!(
            "id = \"{id}\"\ncapabilities = [\"built\"]\n\n[build]\nrepository = \"{}\"\ncommand = \"{command}\"\ntimeout = \"1m\"\n\n[run]\ncommand = \"./bin/agent\"\n\n[restart]\ninitial_backoff = \"100ms\"\nmax_backoff = \"1s\"\n",
            repo.display()
        )
    };
    let path = bus.manifest("built", &manifest("built", "sh make-agent.sh"));
    let out = bus
        .run(&["deploy", path.to_str().expect("utf-8")], DEPLOY_WAIT)
        .await;
    assert!(out.status.success(), "{}", text(&out));
    let caller = agent(&bus.server, "build-caller").await;
    let (answered_by, _) = eventually(chorus_tests::WAIT, "the built agent answers", || async {
        ask(&caller, "built", None).await.ok()
    })
    .await;
    assert_eq!(answered_by, "built");
    // The build's output is kept beside its clone.
    let builds = bus.dir.path().join("builder.builds").join("built");
    let logs: Vec<String> = std::fs::read_dir(&builds)
        .expect("the builds folder")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
        .map(|e| std::fs::read_to_string(e.path()).expect("a log"))
        .collect();
    assert!(
        logs.iter().any(|l| l.contains("built the agent")),
        "{logs:?}"
    );

    // A build that fails: refused with its reason, and nothing runs.
    let broken = bus.manifest(
        "broken",
        &manifest("broken", "echo no compiler here >&2; exit 3"),
    );
    let out = bus
        .run(&["deploy", broken.to_str().expect("utf-8")], DEPLOY_WAIT)
        .await;
    assert!(!out.status.success(), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        said.contains("build failed: build exited with 3: no compiler here"),
        "{}",
        text(&out)
    );
}

/// Issue 56, hosts that do not hand out root: a host started by root runs its agents as
/// `nobody` unless told another user, inside a bubblewrap sandbox when bwrap is installed
/// (`scripts/test` installs it and says so in `CHORUS_TEST_BWRAP`): the agent writes only its
/// working folder and sees no other process. With `--allow-program`, a manifest naming
/// another program is refused, `chorus deploy` says why, and nothing of it runs. A `--user`
/// the machine does not have stops the host at start, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_host_runs_agents_as_nobody_sandboxed_and_only_the_programs_it_allows() {
    use std::os::unix::fs::PermissionsExt;
    let bus = Bus::start().await;
    let unknown = bus
        .command()
        .args(["host", "--name", "ghostly", "--user", "no-such-user-here"])
        .output()
        .expect("chorus host runs");
    assert!(!unknown.status.success(), "{}", text(&unknown));
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("no user \"no-such-user-here\""),
        "{}",
        text(&unknown)
    );
    if chorus_host::process::user::current_user() != "root" {
        // Only root switches users; anyone else is refused another user at start.
        let other = bus
            .command()
            .args(["host", "--name", "other", "--user", "nobody"])
            .output()
            .expect("chorus host runs");
        assert!(
            String::from_utf8_lossy(&other.stderr).contains("needs a host started by root"),
            "{}",
            text(&other)
        );
        return;
    }
    // The agent's folder, which nobody may write; its way there, which nobody may walk.
    let work = bus.dir.path().join("work");
    std::fs::create_dir_all(&work).expect("work folder");
    for (path, mode) in [(bus.dir.path(), 0o711), (work.as_path(), 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let escape = bus.dir.path().join("escaped");
    let mut hosts = Processes::default();
    hosts.0.push(
        bus.command()
            .args(["host", "--name", "safe", "--report-interval", REPORT])
            .args(["--stop-grace", "2s", "--allow-program", "/bin/sh"])
            .arg("--log-dir")
            .arg(bus.dir.path().join("safe"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chorus host starts"),
    );
    bus.hosts_live(&["safe"]).await;
    let script = format!(
        "id -u > uid; ls /proc | grep -c '^[0-9]' > processes; \
         (echo out > {escape}) 2>/dev/null; exec sleep 600",
        escape = escape.display()
    );
    let manifest = bus.manifest(
        "whoami",
        &format!(
            "id = \"whoami\"\n[run]\ncommand = \"/bin/sh\"\nargs = [\"-c\", {script:?}]\nworking_dir = {work:?}\n[health]\ncheck = \"none\"\n",
            work = work.display().to_string()
        ),
    );
    let out = bus
        .run(&["deploy", manifest.to_str().expect("utf-8")], DEPLOY_WAIT)
        .await;
    assert!(out.status.success(), "{}", text(&out));
    let uid = eventually(
        Duration::from_secs(20),
        "the agent says who it is",
        || async {
            let uid = std::fs::read_to_string(work.join("processes"))
                .ok()
                .and_then(|_| std::fs::read_to_string(work.join("uid")).ok())?;
            Some(uid.trim().to_owned())
        },
    )
    .await;
    let nobody = std::process::Command::new("id")
        .args(["-u", "nobody"])
        .output()
        .expect("id runs");
    assert_eq!(uid, String::from_utf8_lossy(&nobody.stdout).trim());
    assert!(!escape.exists(), "an agent wrote outside its folder");
    let processes: usize = std::fs::read_to_string(work.join("processes"))
        .expect("processes")
        .trim()
        .parse()
        .expect("a count");
    if std::env::var_os("CHORUS_TEST_BWRAP").is_some() {
        // In its own process namespace: bwrap's init, the shell, `ls` and `grep`.
        assert!(
            processes <= 6,
            "the sandboxed agent sees {processes} processes"
        );
    }

    // A program the host does not allow: refused, said, never run.
    let marker = work.join("python-ran");
    let refused = bus.manifest(
        "refused",
        &format!(
            "id = \"refused\"\n[run]\ncommand = \"python3\"\nargs = [\"-c\", {:?}]\n[health]\ncheck = \"none\"\n",
            format!("open({:?}, 'w')", marker.display().to_string())
        ),
    );
    let out = bus
        .run(&["deploy", refused.to_str().expect("utf-8")], DEPLOY_WAIT)
        .await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("run.command \"python3\" is not a program this host allows (/bin/sh)"),
        "{}",
        text(&out)
    );
    assert!(!marker.exists(), "a refused program ran");
    let out = bus.run(&["terminate", "whoami"], DEPLOY_WAIT).await;
    assert!(out.status.success(), "{}", text(&out));
}
