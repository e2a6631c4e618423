//! The `chorus` binary against a real server: `up --once`, `request`, `send`, `listen`.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn chorus(server: &str, args: &[&str]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .arg("--server")
        .arg(server)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run chorus");
    // Its output is read while it runs (a large one would otherwise fill the pipe and stop
    // it), on a thread; every wait has a deadline.
    let pid = child.id().to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(out) => out.expect("output"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid]).status();
            let partial = rx
                .recv_timeout(Duration::from_secs(10))
                .ok()
                .and_then(Result::ok)
                .map(|out| text(&out))
                .unwrap_or_default();
            panic!("chorus {args:?} did not finish within 60 s: {partial}");
        }
    }
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[test]
fn up_once_runs_the_demo_against_a_running_server_and_exits_cleanly() {
    let server = chorus_tests::server();
    let out = chorus(server.url(), &["up", "--once"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("using the NATS server at"), "{t}");
    assert!(t.contains("[AIXP] result (5002 ok)"), "{t}");
    assert!(t.contains("refused with 5018 invalid_argument"), "{t}");
    assert!(t.contains("5010 loop_detected"), "{t}");
    assert!(t.contains("chorus up: stopped"), "{t}");
}

#[test]
fn client_commands_report_codes_and_exit_status() {
    let server = chorus_tests::server();
    // Nobody serves: exit code 4 (the bus answered with a failure) and the no-responders code.
    let out = chorus(
        server.url(),
        &["request", "--to", "nobody", "--command", "x"],
    );
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    assert!(text(&out).contains("5012 no_responders"));

    // Bad JSON is refused before anything is sent.
    let out = chorus(server.url(), &["send", "--topic", "t", "{not json"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("payload is not JSON"), "{}", text(&out));

    // Publishing an event works without listeners.
    let out = chorus(server.url(), &["send", "--topic", "task.done", "\"ok\""]);
    assert!(out.status.success(), "{}", text(&out));

    // No server at all: a clear error, not a hang.
    let out = chorus("nats://127.0.0.1:1", &["send", "--topic", "t"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("cannot reach the bus"),
        "{}",
        text(&out)
    );
}

/// `CHORUS_SERVE__*` variables win over the config file: a root set in both is the
/// environment's, and an invalid value from the environment stops the start, naming the key,
/// though the file's value is valid.
#[test]
fn serve_takes_environment_variables_over_the_config_file() {
    use std::io::{BufRead, BufReader};
    let server = chorus_tests::server();
    let file = server.dir().join("chorus.toml");
    std::fs::write(
        &file,
        "root = \"filed\"\nmetrics_addr = \"127.0.0.1:0\"\n[retry.default]\nmax_attempts = 3\n",
    )
    .expect("write config");
    let serve = |env: &[(&str, &str)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_chorus"));
        cmd.args(["--server", server.url(), "serve", "--config"])
            .arg(&file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.spawn().expect("run chorus serve")
    };
    let mut child = serve(&[("CHORUS_SERVE__ROOT", "fromenv")]);
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("chorus serve: coordinator") {
                let _ = tx.send(line);
            }
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(60));
    let _ = child.kill();
    let _ = child.wait();
    let line = line.expect("chorus serve started");
    assert!(line.contains("root \"fromenv\""), "{line}");

    let mut child = serve(&[("CHORUS_SERVE__RETRY__DEFAULT__MAX_ATTEMPTS", "0")]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chorus serve with an invalid value did not stop within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("max_attempts"), "{}", text(&out));
}

/// The coordinator's own series, scraped from a `chorus serve` process of its own: no other
/// test shares its registry, so every count is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_exports_exact_counts_of_its_own_broadcasts_and_agents() {
    use chorus_sdk::{BroadcastTarget, Context, HandlerError, Outcome};
    use chorus_tests::{WAIT, agent, agent_options, eventually, http_get, metric_sum, within};
    use std::io::{BufRead, BufReader};
    let server = chorus_tests::server();
    let mut child = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args(["--server", server.url(), "serve"])
        .env("CHORUS_SERVE__METRICS_ADDR", "127.0.0.1:0")
        .env("CHORUS_SERVE__REAP_INTERVAL_MS", "50")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run chorus serve");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split_once("metrics on http://").map(|(_, r)| r) {
                let _ = tx.send(rest.trim_end_matches("/metrics").to_owned());
            }
        }
    });
    let addr: std::net::SocketAddr = match rx.recv_timeout(WAIT) {
        Ok(addr) => addr.parse().expect("metrics address"),
        Err(e) => {
            let _ = child.kill();
            panic!("chorus serve did not start within {WAIT:?}: {e}");
        }
    };
    let mut agents = Vec::new();
    for (id, fails) in [("gauge-ok", false), ("gauge-fails", true)] {
        let a = agent_options(&server, id)
            .group("gauge")
            .connect()
            .await
            .expect("connect");
        a.on_command("ping", move |_ctx: Context, (): ()| async move {
            if fails {
                Err(HandlerError::failed("no"))
            } else {
                Ok(())
            }
        })
        .await
        .expect("register");
        agents.push(a);
    }
    let client = agent(&server, "gauge-client").await;
    let gauge = |text: &str, state: &str| {
        metric_sum(
            text,
            "chorus_coordinator_agents",
            &[format!("state=\"{state}\"").as_str()],
        )
    };
    // The three agents (the client heartbeats too), as the registry's sweep reports them. An
    // agent counts as live from its first heartbeat and as registered once its bucket entry is
    // written, so one sweep may see it live and not yet registered: wait for both.
    let before = eventually(WAIT, "three live and registered agents", || async {
        let (_, text) = http_get(addr, "/metrics").await;
        (gauge(&text, "live") == Some(3.0) && gauge(&text, "registered") == Some(3.0))
            .then_some(text)
    })
    .await;
    assert_eq!(
        metric_sum(&before, "chorus_coordinator_broadcasts_total", &[]).unwrap_or(0.0),
        0.0
    );
    let report = within(
        WAIT,
        "broadcast",
        client.broadcast(
            &BroadcastTarget::Group("gauge".into()),
            "ping",
            &(),
            Duration::from_secs(5),
        ),
    )
    .await
    .expect("report");
    assert_eq!(
        (
            report.count(Outcome::Delivered),
            report.count(Outcome::Failed)
        ),
        (1, 1)
    );
    let (_, after) = http_get(addr, "/metrics").await;
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        metric_sum(&after, "chorus_coordinator_broadcasts_total", &[]),
        Some(1.0)
    );
    for (outcome, n) in [("delivered", 1.0), ("failed", 1.0)] {
        assert_eq!(
            metric_sum(
                &after,
                "chorus_coordinator_broadcast_recipients_total",
                &[format!("outcome=\"{outcome}\"").as_str()]
            ),
            Some(n),
            "{outcome}"
        );
    }
    assert_eq!(
        metric_sum(
            &after,
            "chorus_coordinator_broadcast_recipients_total",
            &[r#"outcome="timed_out""#]
        )
        .unwrap_or(0.0),
        0.0
    );
    drop(agents);
}

/// `OTEL_EXPORTER_OTLP_ENDPOINT` switches the OTLP exporter on: a stand-in collector receives
/// the demo's spans over OTLP/HTTP. Needs the `otlp` feature (on in a workspace test run, where
/// chorus-tests enables it); without it the test is listed as ignored, not left out.
#[cfg_attr(
    not(feature = "otlp"),
    ignore = "the OTLP exporter is built only with --features otlp"
)]
#[test]
fn up_exports_spans_over_otlp_when_an_endpoint_is_configured() {
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};
    let collector = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("http://{}", collector.local_addr().expect("addr"));
    let received: Arc<Mutex<Vec<u8>>> = Arc::default();
    {
        let received = Arc::clone(&received);
        std::thread::spawn(move || {
            for stream in collector.incoming() {
                let Ok(mut stream) = stream else { continue };
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                let mut buf = vec![0u8; 1 << 20];
                let mut got = Vec::new();
                // Read the request: headers, then as much body as Content-Length says.
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
                    if let Some(head_end) = text.find("\r\n\r\n") {
                        let len = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if got.len() >= head_end + 4 + len {
                            break;
                        }
                    }
                }
                received.lock().expect("lock").extend_from_slice(&got);
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
            }
        });
    }
    let server = chorus_tests::server();
    // From the repository's root: the calculator runs hosted, in a process of its own, and
    // its spans come from there.
    let out = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args([
            "--server",
            server.url(),
            "up",
            "--once",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .output()
        .expect("run chorus up");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = String::from_utf8_lossy(&received.lock().expect("lock")).into_owned();
    assert!(
        got.starts_with("POST /v1/traces"),
        "collector saw: {:.200}",
        got
    );
    assert!(
        got.contains("chorus.handle calculation"),
        "spans of the demo's calculator exported"
    );
}

#[test]
fn creds_makes_its_output_directory_and_writes_a_seed_only_its_owner_reads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = dir.path().join(".keys");
    let out = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args(["creds", "alice", "--calls", "agent:bob", "--out"])
        .arg(&keys)
        .output()
        .expect("run chorus creds");
    assert!(out.status.success(), "{}", text(&out));
    let entry = String::from_utf8_lossy(&out.stdout);
    assert!(entry.contains("nkey:"), "{entry}");
    let seed = keys.join("alice.nk");
    let written = std::fs::read_to_string(&seed).expect("seed written");
    assert!(written.starts_with("SU"), "an nkey user seed: {written}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&seed)
            .expect("metadata")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    // A second run never overwrites the secret.
    let again = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args(["creds", "alice", "--out"])
        .arg(&keys)
        .output()
        .expect("run chorus creds");
    assert!(!again.status.success(), "{}", text(&again));
    assert_eq!(std::fs::read_to_string(&seed).expect("seed"), written);
}

/// Runs `chorus creds <args>` and returns the entry it printed.
fn creds(keys: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .arg("creds")
        .args(args)
        .arg("--out")
        .arg(keys)
        .output()
        .expect("run chorus creds");
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A server whose users are the `chorus creds` entries given, the coordinator connected with
/// its seed (`keys/coordinator.nk` under `dir`), and `echo` connected with `keys/echo.nk`,
/// answering `hello` with `hi <sender>`.
struct SecuredBus {
    server: chorus_tests::NatsServer,
    coordinator: chorus_coordinator::Coordinator,
    echo: chorus_sdk::Agent,
}

impl SecuredBus {
    async fn start(dir: &std::path::Path, entries: &[&str]) -> SecuredBus {
        use chorus_broker_adapter::{BrokerOptions, Credentials};
        use chorus_sdk::{Context, HandlerError};
        let keys = dir.join("keys");
        let conf = dir.join("secure.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: \"127.0.0.1:-1\"\njetstream {{ store_dir: \"{}\" }}\nauthorization {{\n  users = [\n{}\n  ]\n}}\n",
                dir.join("js").display(),
                entries.join("\n"),
            ),
        )
        .expect("write conf");
        let server = chorus_tests::ServerBuilder::default()
            .config(&conf)
            .start()
            .expect("secured server");
        let coordinator = chorus_coordinator::Coordinator::start(
            chorus_coordinator::CoordinatorConfig {
                servers: server.url().to_owned(),
                metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                reap_interval_ms: 50,
                security: chorus_sdk::security::ConnectionSecurity {
                    nkey_seed_file: Some(keys.join("coordinator.nk")),
                    ..Default::default()
                },
                ..chorus_coordinator::CoordinatorConfig::default()
            },
            false,
        )
        .await
        .expect("coordinator connects with its key");
        let seed = std::fs::read_to_string(keys.join("echo.nk")).expect("echo seed");
        let echo = chorus_tests::agent_options(&server, "echo")
            .broker(
                BrokerOptions::new([server.url()])
                    .credentials(Credentials::NKeySeed(seed.trim().to_owned())),
            )
            .connect()
            .await
            .expect("echo connects with its key");
        echo.on_command("hello", |ctx: Context, (): ()| async move {
            Ok::<_, HandlerError>(format!("hi {}", ctx.from()))
        })
        .await
        .expect("register");
        SecuredBus {
            server,
            coordinator,
            echo,
        }
    }
}

/// SECURITY.md: on a server whose users are the entries `chorus creds` prints, the CLI
/// connects as its own user (`chorus creds ops --cli`, then `--id ops --nkey-file`), and
/// `chorus agents` and `chorus request` work without a single permission violation; without
/// `--id` it is nobody the server's permissions know and its request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_works_as_its_own_user_on_a_server_with_nkeys_and_permissions() {
    use chorus_tests::{WAIT, eventually};
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = dir.path().join("keys");
    let coordinator_entry = creds(&keys, &["coordinator", "--coordinator"]);
    let echo_entry = creds(&keys, &["echo", "--serves", "echo"]);
    let cli_entry = creds(&keys, &["ops", "--cli", "--calls", "agent:echo"]);
    assert!(cli_entry.contains("# CLI user ops"), "{cli_entry}");
    assert!(!cli_entry.contains("heartbeat"), "{cli_entry}");
    let SecuredBus {
        server,
        coordinator,
        echo,
    } = SecuredBus::start(dir.path(), &[&coordinator_entry, &echo_entry, &cli_entry]).await;
    let cli_seed = keys.join("ops.nk");
    let cli_seed = cli_seed.to_str().expect("utf-8 path");
    let as_ops = ["--id", "ops", "--nkey-file", cli_seed];

    // `chorus agents` lists echo (once the coordinator has its heartbeat).
    let listed = eventually(WAIT, "echo listed by chorus agents", || async {
        let args = [&as_ops[..], &["agents"]].concat();
        let out = chorus(server.url(), &args);
        (out.status.success() && String::from_utf8_lossy(&out.stdout).contains("echo"))
            .then(|| text(&out))
    })
    .await;
    assert!(listed.contains("1 live agent(s)"), "{listed}");

    // `chorus request` reaches echo as ops, and the reply reaches the CLI's inbox.
    let args = [
        &as_ops[..],
        &["request", "--to", "echo", "--command", "hello"],
    ]
    .concat();
    let out = chorus(server.url(), &args);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("hi ops"),
        "{}",
        text(&out)
    );

    // The same from the environment.
    let out = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args(["--server", server.url()])
        .args(["request", "--to", "echo", "--command", "hello"])
        .env("CHORUS_ID", "ops")
        .env("CHORUS_NKEY_FILE", cli_seed)
        .output()
        .expect("run chorus");
    assert!(out.status.success(), "{}", text(&out));

    // The same from a saved context, from another directory.
    let config_dir = dir.path().join("config");
    let with_config = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_chorus"))
            .args(args)
            .env("CHORUS_CONFIG_DIR", &config_dir)
            .current_dir(&keys)
            .output()
            .expect("run chorus")
    };
    let out = with_config(&[
        "--server",
        server.url(),
        "--id",
        "ops",
        "--nkey-file",
        "ops.nk",
        "context",
        "save",
        "secure",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let out = with_config(&[
        "--context",
        "secure",
        "request",
        "--to",
        "echo",
        "--command",
        "hello",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("hi ops"));

    // A subject the user may not use is named, with the user, at once (not after the
    // request's timeout), and the exit code says "refused".
    let ops_key = cli_entry
        .split("nkey: \"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("ops key");
    let started = std::time::Instant::now();
    let args = [
        &as_ops[..],
        &[
            "request",
            "--to",
            "vault",
            "--command",
            "open",
            "--timeout",
            "30s",
        ],
    ]
    .concat();
    let out = chorus(server.url(), &args);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(4), "{t}");
    assert!(t.contains("permission denied"), "{t}");
    assert!(t.contains("Publish to \"chorus.agent.vault.open\""), "{t}");
    assert!(t.contains(ops_key) && t.contains("--id ops"), "{t}");
    assert!(started.elapsed() < Duration::from_secs(10), "{t}");
    // An event, which nobody answers, is refused the same way (ops may publish events under
    // the bus's root, not under another).
    let args = [
        &as_ops[..],
        &["--root", "other", "send", "--topic", "plans", "1"],
    ]
    .concat();
    let out = chorus(server.url(), &args);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(4), "{t}");
    assert!(t.contains("Publish to \"other.evt.plans\""), "{t}");

    // Without --id the CLI is `cli-<pid>`, whose inbox the ops user may not read: the
    // refused subscription is named.
    let out = chorus(
        server.url(),
        &[
            "--nkey-file",
            cli_seed,
            "request",
            "--to",
            "echo",
            "--command",
            "hello",
        ],
    );
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("permission denied") && t.contains(ops_key),
        "{t}"
    );

    echo.shutdown().await;
    coordinator.shutdown().await;
}

#[test]
fn a_zero_timeout_and_a_dead_letter_id_of_zero_are_usage_errors() {
    // Refused while the arguments are read, before any connection: a usage error (exit 2).
    let unreachable = "nats://127.0.0.1:1";
    for args in [
        &[
            "request",
            "--to",
            "calculator",
            "--command",
            "calculation",
            "--timeout",
            "0s",
        ][..],
        &[
            "broadcast",
            "--all",
            "--command",
            "status",
            "--timeout",
            "0ms",
        ][..],
    ] {
        let out = chorus(unreachable, args);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {t}");
        assert!(t.contains("above zero"), "{args:?}: {t}");
    }
    let out = chorus(unreachable, &["dlq", "show", "0"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(t.contains("not in 1.."), "{t}");
}

#[test]
fn a_dead_letter_that_is_not_there_is_named_in_plain_words() {
    let server = chorus_tests::server();
    // `chorus serve` would make the streams; `up --once` does, and leaves its dead letters.
    let up = chorus(server.url(), &["up", "--once"]);
    assert!(up.status.success(), "{}", text(&up));
    for args in [
        &["dlq", "show", "999999"][..],
        &["dlq", "replay", "999999"][..],
    ] {
        let out = chorus(server.url(), args);
        let t = text(&out);
        assert!(!out.status.success(), "{args:?}: {t}");
        assert!(
            t.contains("no dead letter 999999 in the queue"),
            "{args:?}: {t}"
        );
        assert!(
            !t.contains("10003") && !t.contains("code 400"),
            "{args:?}: {t}"
        );
    }
}

#[test]
fn a_bus_that_is_not_there_is_met_with_what_to_do() {
    // Port 1 on loopback: nothing listens, the connection is refused at once.
    let out = chorus("nats://127.0.0.1:1", &["agents"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(3), "unreachable: {t}");
    assert!(
        t.contains("cannot reach the bus at nats://127.0.0.1:1"),
        "{t}"
    );
    assert!(t.contains("`scripts/up` starts a local bus"), "{t}");
    assert!(t.contains("--server"), "{t}");
}

/// Issue 19, defect 1: a signal that arrives while a round of scenarios runs stops `chorus up`
/// at once (it used to be lost, or to kill the process without a clean stop).
#[test]
fn up_stops_cleanly_on_a_signal_during_a_round() {
    let server = chorus_tests::server();
    let mut up = up_running(server.url());
    // The first round starts right after this line.
    up.wait_for("agents online");
    let (status, out) = up.stop("TERM");
    assert!(status.success(), "{status:?}: {out}");
    assert!(out.contains("chorus up: stopped"), "{out}");
    assert!(
        !out.contains("scenarios complete"),
        "the round went on after the signal: {out}"
    );
}

/// Issue 19, defect 2: a second `chorus up` on a bus that already runs says so and leaves the
/// first alone; a metrics address that is taken is named with the flag that moves it.
#[test]
fn a_second_up_says_the_bus_runs_and_a_taken_port_names_its_flag() {
    let server = chorus_tests::server();
    let mut first = up_running(server.url());
    first.wait_for("scenarios complete");
    let second = chorus(
        server.url(),
        &["up", "--once", "--metrics-addr", "127.0.0.1:0"],
    );
    let t = text(&second);
    assert!(!second.status.success(), "{t}");
    assert!(t.contains("a Chorus bus is already running"), "{t}");
    // The first is unharmed: it still stops cleanly.
    let (status, out) = first.stop("INT");
    assert!(status.success(), "{status:?}: {out}");

    let other = chorus_tests::server();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = chorus(other.url(), &["up", "--once", "--metrics-addr", &addr]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("is taken") && t.contains("--metrics-addr"),
        "{t}"
    );
}

/// Issue 19, defect 5: a payload too large for an argument comes from a file (`@file`) or
/// standard input (`-`); one over the server's `max_payload` goes by reference (PROTOCOL.md
/// section 7.11); one over the payload limit is refused before sending, with both sizes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_come_from_files_and_stdin_and_an_oversized_one_is_refused_with_its_size() {
    use chorus_sdk::Context;
    let server = chorus_tests::server();
    let sink = chorus_tests::agent(&server, "sink").await;
    sink.on_command("take", |_ctx: Context, text: String| async move {
        Ok(text.len())
    })
    .await
    .expect("register");
    let dir = tempfile::tempdir().expect("tempdir");
    let json_of = |bytes: usize| format!("\"{}\"", "x".repeat(bytes));
    let medium = dir.path().join("500k.json");
    std::fs::write(&medium, json_of(500_000)).expect("write");
    let large = dir.path().join("5m.json");
    std::fs::write(&large, json_of(5_000_000)).expect("write");
    let over = chorus_sdk::payload::DEFAULT_MAX_PAYLOAD_BYTES;
    let huge = dir.path().join("over-the-limit.json");
    std::fs::write(&huge, json_of(over)).expect("write");
    let url = server.url().to_owned();
    let run = move |payload: String, stdin: Option<String>| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut child = Command::new(env!("CARGO_BIN_EXE_chorus"))
                .args([
                    "--server",
                    &url,
                    "request",
                    "--to",
                    "sink",
                    "--command",
                    "take",
                ])
                .arg(payload)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run chorus");
            let mut input = child.stdin.take().expect("stdin");
            if let Some(text) = stdin {
                input.write_all(text.as_bytes()).expect("write stdin");
            }
            drop(input);
            let deadline = Instant::now() + Duration::from_secs(60);
            while child.try_wait().expect("wait").is_none() {
                assert!(Instant::now() < deadline, "chorus request did not finish");
                std::thread::sleep(Duration::from_millis(20));
            }
            child.wait_with_output().expect("output")
        })
    };
    let from_file = run(format!("@{}", medium.display()), None)
        .await
        .expect("join");
    assert!(from_file.status.success(), "{}", text(&from_file));
    assert_eq!(String::from_utf8_lossy(&from_file.stdout).trim(), "500000");
    let from_stdin = run("-".into(), Some(json_of(500_000))).await.expect("join");
    assert!(from_stdin.status.success(), "{}", text(&from_stdin));
    assert_eq!(String::from_utf8_lossy(&from_stdin.stdout).trim(), "500000");
    // 5 MB: over the server's 1 MiB, so by reference through the object store.
    let by_reference = run(format!("@{}", large.display()), None)
        .await
        .expect("join");
    assert!(by_reference.status.success(), "{}", text(&by_reference));
    assert_eq!(
        String::from_utf8_lossy(&by_reference.stdout).trim(),
        "5000000"
    );
    let too_large = run(format!("@{}", huge.display()), None)
        .await
        .expect("join");
    let t = text(&too_large);
    assert!(!too_large.status.success(), "{t}");
    assert!(
        t.contains(&format!("the payload is {} bytes", over + 2))
            && t.contains(&format!("at most {over} bytes")),
        "{t}"
    );
    let missing = run("@/nonexistent/payload.json".into(), None)
        .await
        .expect("join");
    assert!(!missing.status.success());
    assert!(
        text(&missing).contains("cannot read the payload from /nonexistent/payload.json"),
        "{}",
        text(&missing)
    );
}

/// Output into a pipe whose reader is gone (`chorus ... | head`) ends the command quietly with
/// SIGPIPE's status, instead of a panic.
#[test]
fn output_to_a_closed_pipe_ends_quietly() {
    let server = chorus_tests::server();
    let mut child = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args(["--server", server.url(), "dlq", "ls"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run chorus");
    // The reader goes away before anything is written.
    drop(child.stdout.take());
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        assert!(Instant::now() < deadline, "chorus dlq ls did not finish");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(141), "{stderr}");
}

/// `--json` on the client commands: each prints JSON a script can parse, with the facts the
/// text form shows; and the exit codes tell success, an unreachable bus and a refusal apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_commands_print_json_a_script_can_read() {
    use chorus_sdk::{Context, HandlerError};
    let server = chorus_tests::server();
    let _coordinator = chorus_tests::coordinator(&server, false).await;
    let calc = chorus_tests::agent_options(&server, "calc")
        .capability("math")
        .durable_inbox(true)
        .connect()
        .await
        .expect("connect");
    calc.on_command("add", |_ctx: Context, (a, b): (i64, i64)| async move {
        Ok(a + b)
    })
    .await
    .expect("register");
    calc.on_command("poison", |_ctx: Context, (): ()| async move {
        Err::<(), _>(HandlerError::invalid_argument("never"))
    })
    .await
    .expect("register");
    let url = server.url().to_owned();
    let run = move |args: Vec<String>| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            chorus(&url, &args)
        })
    };
    let argv = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let json_of = |out: &Output| -> serde_json::Value {
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(out)))
    };

    let out = run(argv(&[
        "request",
        "--json",
        "--to",
        "calc",
        "--command",
        "add",
        "[2,3]",
    ]))
    .await
    .expect("join");
    assert!(out.status.success(), "{}", text(&out));
    let reply = json_of(&out);
    assert_eq!(reply["status"], 5002);
    assert_eq!(reply["label"], "ok");
    assert_eq!(reply["from"], "calc");
    assert_eq!(reply["payload"], 5);

    let out = run(argv(&[
        "request",
        "--json",
        "--to",
        "calc",
        "--command",
        "add",
        "\"x\"",
    ]))
    .await
    .expect("join");
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    let refused = json_of(&out);
    assert_eq!(refused["status"], 5006);
    assert!(refused["reason"].as_str().is_some_and(|r| !r.is_empty()));
    // Who refused is said, in JSON and in the text form, and the code once.
    assert_eq!(refused["from"], "calc", "{refused}");
    let out = run(argv(&["request", "--to", "calc", "--command", "poison"]))
        .await
        .expect("join");
    let said = text(&out);
    assert_eq!(out.status.code(), Some(4), "{said}");
    assert!(
        said.contains("status 5018 invalid_argument from calc: never"),
        "{said}"
    );
    assert_eq!(said.matches("5018").count(), 1, "{said}");

    let agents = eventually_json(&run, argv(&["agents", "--json"]), |v| {
        v.as_array()
            .is_some_and(|a| a.iter().any(|r| r["manifest"]["agent"] == "calc"))
    })
    .await;
    let record = agents
        .as_array()
        .and_then(|a| a.iter().find(|r| r["manifest"]["agent"] == "calc"))
        .expect("calc listed");
    assert_eq!(record["manifest"]["capabilities"][0]["name"], "math");

    let out = run(argv(&[
        "send",
        "--json",
        "--to",
        "calc",
        "--command",
        "poison",
        "--durable",
    ]))
    .await
    .expect("join");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(json_of(&out)["stored_for"], "calc");
    let listed = eventually_json(&run, argv(&["dlq", "ls", "--json"]), |v| {
        v.as_array().is_some_and(|a| a.len() == 1)
    })
    .await;
    let entry = &listed[0];
    assert_eq!(entry["reason"], "refused");
    assert_eq!(entry["status"], 5018);
    assert_eq!(entry["agent"], "calc");
    let id = entry["id"].as_u64().expect("id").to_string();
    let out = run(argv(&["dlq", "show", "--json", &id]))
        .await
        .expect("join");
    let shown = json_of(&out);
    assert_eq!(shown["detail"], "never");
    assert_eq!(shown["envelope"]["name"], "poison");
    assert_eq!(shown["envelope"]["id"], entry["message_id"]);

    let out = run(argv(&[
        "broadcast",
        "--json",
        "--capability",
        "math",
        "--command",
        "add",
        "[1,1]",
    ]))
    .await
    .expect("join");
    assert!(out.status.success(), "{}", text(&out));
    let report = json_of(&out);
    assert_eq!(report["recipients"][0]["agent"], "calc");
    assert_eq!(report["recipients"][0]["outcome"], "delivered");
}

/// Runs `args` until its JSON output satisfies `ready` (the registry and the dead-letter
/// queue fill a moment after the fact), failing after 20 s.
async fn eventually_json<F>(
    run: &impl Fn(Vec<String>) -> tokio::task::JoinHandle<Output>,
    args: Vec<String>,
    ready: F,
) -> serde_json::Value
where
    F: Fn(&serde_json::Value) -> bool,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = run(args.clone()).await.expect("join");
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout)
            && ready(&v)
        {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{args:?} never ready: {}",
            text(&out)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Issue 19, item 8: `chorus tap --json` shows every kind of message the demo sends, each line
/// parseable JSON with its ids.
#[test]
fn tap_shows_every_kind_of_message_while_the_demo_runs() {
    use std::io::{BufRead, BufReader};
    let server = chorus_tests::server();
    let mut tap = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args(["--server", server.url(), "tap", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run chorus tap");
    // Subscribed once it says so on stderr.
    let stderr = tap.stderr.take().expect("stderr");
    let (ready_tx, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.starts_with("tapping") {
                let _ = ready_tx.send(());
            }
        }
    });
    if ready.recv_timeout(Duration::from_secs(60)).is_err() {
        let _ = tap.kill();
        panic!("chorus tap did not start");
    }
    let stdout = tap.stdout.take().expect("stdout");
    let (tx, lines) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let demo = chorus(
        server.url(),
        &["up", "--once", "--metrics-addr", "127.0.0.1:0"],
    );
    assert!(demo.status.success(), "{}", text(&demo));
    let wanted = ["command", "request", "response", "event", "heartbeat"];
    let mut kinds = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && !wanted.iter().all(|k| kinds.contains(*k)) {
        if let Ok(line) = lines.recv_timeout(Duration::from_millis(200)) {
            let v: serde_json::Value =
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            assert!(
                v["id"].is_string() && v["correlation_id"].is_string(),
                "{line}"
            );
            assert!(v["from"].is_string() && v["subject"].is_string(), "{line}");
            kinds.insert(v["kind"].as_str().unwrap_or_default().to_owned());
        }
    }
    let _ = tap.kill();
    let _ = tap.wait();
    for kind in wanted {
        assert!(kinds.contains(kind), "no {kind} seen; saw {kinds:?}");
    }
}

/// Issue 19, item 13: completions for each shell, the git revision in `--version`, logs
/// without colour codes when not at a terminal, and JSON logs on request.
#[test]
fn completions_version_and_log_formats() {
    let run = |args: &[&str], envs: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_chorus"))
            .args(args)
            .envs(envs.iter().copied())
            .output()
            .expect("run chorus");
        (out.status, text(&out))
    };
    for shell in ["bash", "zsh", "fish"] {
        let (status, t) = run(&["completions", shell], &[]);
        assert!(status.success(), "{shell}: {t}");
        for sub in ["request", "dlq", "tap", "chaos"] {
            assert!(t.contains(sub), "{shell} completions lack {sub}");
        }
    }
    let (status, t) = run(&["completions", "tcsh"], &[]);
    assert_eq!(status.code(), Some(2), "{t}");

    let (_, version) = run(&["--version"], &[]);
    let revision = version
        .trim()
        .rsplit_once('(')
        .map(|(_, r)| r.trim_end_matches(')'))
        .unwrap_or_default();
    assert!(
        revision == "unknown"
            || (revision.len() == 12 && revision.chars().all(|c| c.is_ascii_hexdigit())),
        "{version}"
    );

    // A connection that fails logs a warning: plain text when not at a terminal, JSON lines
    // when asked.
    let server = chorus_tests::server();
    let args = ["--server", server.url(), "dlq", "show", "7"];
    let (_, plain) = run(&args, &[("RUST_LOG", "debug")]);
    assert!(!plain.contains('\u{1b}'), "colour codes: {plain:?}");
    let (_, json) = run(
        &args,
        &[("RUST_LOG", "debug"), ("CHORUS_LOG_FORMAT", "json")],
    );
    let logs: Vec<&str> = json.lines().filter(|l| l.starts_with('{')).collect();
    assert!(!logs.is_empty(), "no JSON log lines: {json}");
    for line in logs {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{line}");
    }
}

/// Issue 19, item 10: the DLQ at scale: 3,000 dead letters listed a page at a time with
/// dates and ages, filtered by agent, reason and age, purged by filter only when confirmed,
/// and replayed by filter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_queue_at_scale_filters_pages_and_asks_before_purging() {
    use chorus_sdk::StatusCode;
    use chorus_sdk::durable::{DeadLetter, DeadLetterReason, write_dead_letter};
    const LETTERS: u64 = 3_000;
    let server = chorus_tests::server();
    let _coordinator = chorus_tests::coordinator(&server, false).await;
    let broker = chorus_tests::raw_broker(&server).await;
    let js = broker.jetstream(chorus_tests::WAIT);
    let subjects = chorus_sdk::Subjects::new("chorus").expect("subjects");
    let now = chorus_sdk::envelope::now_ms();
    for n in 0..LETTERS {
        let (agent, reason) = match n % 3 {
            0 => ("billing", DeadLetterReason::Refused),
            1 => ("billing", DeadLetterReason::Expired),
            _ => ("search", DeadLetterReason::Refused),
        };
        let letter = DeadLetter {
            reason,
            status: StatusCode::INVALID_ARGUMENT,
            detail: format!("letter {n}"),
            agent: agent.into(),
            subject: format!("chorus.inbox.{agent}.n.work"),
            envelope: bytes::Bytes::from_static(b"{}"),
            headers: Vec::new(),
            message_id: None,
            attempts: 1,
            stored_ms: now,
            dead_lettered_ms: now,
            source: Some(("CHORUS_INBOX".into(), n + 1)),
            omitted: None,
        };
        write_dead_letter(&js, &subjects, &letter, broker.max_payload())
            .await
            .expect("write");
    }
    let url = server.url().to_owned();
    let run = move |args: Vec<String>| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            chorus(&url, &args)
        })
    };
    let argv = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let json = |out: &Output| -> Vec<serde_json::Value> {
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(out)))
    };

    // A filtered page, and the next one.
    let started = Instant::now();
    let out = run(argv(&[
        "dlq", "ls", "--json", "--agent", "billing", "--reason", "expired", "--limit", "500",
    ]))
    .await
    .expect("join");
    let took = started.elapsed();
    let page = json(&out);
    assert_eq!(page.len(), 500, "{}", text(&out));
    assert!(
        page.iter()
            .all(|e| e["agent"] == "billing" && e["reason"] == "expired")
    );
    let hint = String::from_utf8_lossy(&out.stderr).into_owned();
    let last = page[499]["id"].as_u64().expect("id");
    assert!(
        hint.contains(&format!("next page: --after {last}")),
        "{hint}"
    );
    let rest = run(argv(&[
        "dlq",
        "ls",
        "--json",
        "--agent",
        "billing",
        "--reason",
        "expired",
        "--limit",
        "5000",
        "--after",
        &last.to_string(),
    ]))
    .await
    .expect("join");
    let rest = json(&rest);
    assert_eq!(rest.len(), 500, "the other half of the 1,000 expired ones");
    assert!(rest.iter().all(|e| e["id"].as_u64() > Some(last)));
    println!("dlq ls of 500 of {LETTERS} filtered entries took {took:?}");

    // Dates and ages in the text form; the age filters.
    let out = run(argv(&["dlq", "ls", "--limit", "1"]))
        .await
        .expect("join");
    let t = text(&out);
    assert!(t.contains("dead at (UTC)"), "{t}");
    let first_row = t.lines().nth(1).unwrap_or_default().to_owned();
    assert!(
        first_row.contains("-") && first_row.contains(':'),
        "a date: {first_row}"
    );
    let old = run(argv(&["dlq", "ls", "--json", "--older-than", "1h"]))
        .await
        .expect("join");
    assert!(json(&old).is_empty());

    // Purge asks, and with no terminal to ask at, refuses without --yes.
    let out = run(argv(&["dlq", "purge", "--agent", "search"]))
        .await
        .expect("join");
    assert!(!out.status.success());
    assert!(text(&out).contains("pass --yes"), "{}", text(&out));
    let out = run(argv(&["dlq", "purge", "--agent", "search", "--yes"]))
        .await
        .expect("join");
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("purged 1000 dead letter(s)"),
        "{}",
        text(&out)
    );
    let left = run(argv(&["dlq", "ls", "--json", "--limit", "5000"]))
        .await
        .expect("join");
    let left = json(&left);
    assert_eq!(left.len(), 2_000);
    assert!(left.iter().all(|e| e["agent"] == "billing"));

    // Replay of a filtered set: the expired ones go back to their (core) subject.
    let out = run(argv(&["dlq", "replay", "--all", "--reason", "expired"]))
        .await
        .expect("join");
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("1000 replayed"), "{}", text(&out));
    let left = run(argv(&["dlq", "ls", "--json", "--limit", "5000"]))
        .await
        .expect("join");
    assert!(json(&left).iter().all(|e| e["reason"] == "refused"));
}

/// Issue 19, item 14: a TLS failure names the flags that fix it, and exits as unreachable (3).
#[test]
fn a_tls_failure_names_the_tls_flags() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs =
        chorus_cli::certs::generate(dir.path(), &["localhost".into(), "127.0.0.1".into()], "cli")
            .expect("dev certificates");
    let conf = dir.path().join("tls.conf");
    std::fs::write(
        &conf,
        format!(
            "listen: \"127.0.0.1:-1\"\ntls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n  timeout: 2\n}}\n",
            certs.server_cert.display(),
            certs.server_key.display(),
            certs.ca.display()
        ),
    )
    .expect("write");
    let server = chorus_tests::ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("TLS server");
    // No CA given: the server's certificate is not trusted.
    let out = chorus(server.url(), &["agents"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(3), "{t}");
    assert!(
        t.contains("TLS could not be set up") && t.contains("--tls-ca"),
        "{t}"
    );
    // The CA, but no client certificate for a server that verifies clients.
    let ca = certs.ca.display().to_string();
    let out = chorus(server.url(), &["--tls-ca", &ca, "agents"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(3), "{t}");
    assert!(t.contains("--tls-cert and --tls-key"), "{t}");
}

/// `chorus context`: saved settings are used by later commands, a flag wins over them, and
/// a missing or invalid context is refused with what to do.
#[test]
fn contexts_save_select_and_lose_to_a_flag() {
    let server = chorus_tests::server();
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_chorus"))
            .args(args)
            .env("CHORUS_CONFIG_DIR", dir.path())
            .env_remove("CHORUS_NATS_URL")
            .output()
            .expect("run chorus")
    };
    // Nothing saved yet.
    let out = run(&["context", "ls"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("no contexts saved"), "{}", text(&out));
    let out = run(&["context", "save", "empty"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("nothing to save"), "{}", text(&out));
    let out = run(&["--server", server.url(), "context", "save", "../up"]);
    assert!(
        text(&out).contains("invalid context name"),
        "{}",
        text(&out)
    );

    // Saved and selected: `agents` reaches the test server with no --server.
    let out = run(&[
        "--server",
        server.url(),
        "context",
        "save",
        "local",
        "--select",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let out = run(&[
        "--server",
        "nats://127.0.0.1:1",
        "context",
        "save",
        "nowhere",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let out = run(&["send", "--topic", "hello", "1"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = run(&["context", "ls", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(rows[0]["name"], "local");
    assert_eq!(rows[0]["selected"], true);
    assert_eq!(rows[0]["settings"]["server"], server.url());
    assert_eq!(rows[1]["name"], "nowhere");
    assert_eq!(rows[1]["selected"], false);
    let out = run(&["context", "show"]);
    assert!(text(&out).contains(server.url()), "{}", text(&out));

    // --context picks another for one command (unreachable: exit 3); a flag wins over it.
    let out = run(&["--context", "nowhere", "send", "--topic", "hello", "1"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("127.0.0.1:1"), "{}", text(&out));
    let out = run(&[
        "--context",
        "nowhere",
        "--server",
        server.url(),
        "send",
        "--topic",
        "hello",
        "1",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let out = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args(["send", "--topic", "hello", "1"])
        .env("CHORUS_CONFIG_DIR", dir.path())
        .env("CHORUS_CONTEXT", "nowhere")
        .output()
        .expect("run chorus");
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));

    // An unknown context names the saved ones.
    let out = run(&["--context", "prod", "send", "--topic", "hello", "1"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("no context \"prod\" (saved: local, nowhere)"),
        "{}",
        text(&out)
    );
    // Removing the selected one unselects it: the default server again.
    let out = run(&["context", "rm", "local"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = run(&["context", "show"]);
    assert!(text(&out).contains("no context selected"), "{}", text(&out));
}

/// Every flag is listed once in `--help`, the connection flags under their own heading, each
/// with its environment variable.
#[test]
fn help_lists_each_flag_once_with_its_environment_variable() {
    for command in [
        &["--help"][..],
        &["request", "--help"],
        &["dlq", "ls", "--help"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_chorus"))
            .args(command)
            .output()
            .expect("run chorus");
        let help = text(&out);
        assert!(help.contains("Connection (every command):"), "{help}");
        for (flag, var) in [
            ("--server", "CHORUS_NATS_URL"),
            ("--tls-ca", "CHORUS_TLS_CA"),
            ("--tls-cert", "CHORUS_TLS_CERT"),
            ("--tls-key", "CHORUS_TLS_KEY"),
            ("--nkey-file", "CHORUS_NKEY_FILE"),
            ("--id", "CHORUS_ID"),
            ("--root", "CHORUS_ROOT"),
            ("--context", "CHORUS_CONTEXT"),
        ] {
            let lines: Vec<&str> = help
                .lines()
                .filter(|l| l.trim_start().starts_with(&format!("{flag} ")))
                .collect();
            assert_eq!(lines.len(), 1, "{flag} in {command:?}: {help}");
            assert_eq!(
                lines[0].matches(&format!("[env: {var}")).count(),
                1,
                "{flag}: {help}"
            );
        }
    }
}

/// docs/OPERATIONS.md's exit-code table is the CLI's: every code in it is met by a command
/// here (5, `chaos`, by the unit test that holds the constants to the same table), and every
/// command here exits with a code the table gives, for the reason it gives.
#[test]
fn exit_codes_are_the_operations_table() {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/OPERATIONS.md"
    ))
    .expect("docs/OPERATIONS.md");
    let table: std::collections::BTreeMap<i32, String> = doc
        .lines()
        .skip_while(|l| !l.starts_with("| exit code |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let mut cells = l.trim_matches('|').split('|').map(str::trim);
            Some((cells.next()?.parse().ok()?, cells.next()?.to_owned()))
        })
        .collect();
    assert!(table.len() >= 7, "{table:?}");

    let server = chorus_tests::server();
    // An HTTP port (a metrics endpoint) where the bus is expected.
    let http = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let http_url = format!("nats://{}", http.local_addr().expect("addr"));
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut socket in http.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = socket.read(&mut buf);
            let _ = socket.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
        }
    });
    let url = server.url();
    // (server, arguments, expected code, what the output must say)
    let cases: &[(&str, &[&str], i32, &str)] = &[
        (url, &["send", "--topic", "t", "\"ok\""], 0, ""),
        (
            url,
            &["send", "--topic", "t", "@/nonexistent/payload.json"],
            1,
            "cannot read the payload",
        ),
        (
            url,
            &["send", "--topic", "t", "{not json"],
            2,
            "the payload is not JSON",
        ),
        (url, &["send", "--topic", "a..b", "1"], 2, "invalid topic"),
        (url, &["listen", "a..b"], 2, "invalid topic pattern"),
        (url, &["tap", "a..b"], 2, "invalid topic pattern"),
        (
            url,
            &["task", "show", "not-a-task"],
            2,
            "no task with id \"not-a-task\"",
        ),
        (
            url,
            &["task", "ls", "--state", "sleeping"],
            2,
            "is not a task state",
        ),
        (
            url,
            &["request"],
            2,
            "<--to <TO>|--capability <CAPABILITY>>",
        ),
        (url, &["--no-such-flag"], 2, "unexpected argument"),
        (
            "http://127.0.0.1:9464",
            &["agents"],
            2,
            "a NATS server URL starts with nats://",
        ),
        (
            "nats://127.0.0.1:1",
            &["agents"],
            3,
            "nothing listens there",
        ),
        (&http_url, &["agents"], 3, "an HTTP server answers"),
        (
            url,
            &["request", "--to", "nobody", "--command", "x"],
            4,
            "5012 no_responders",
        ),
        (
            url,
            &["negotiate", "--capability", "nobody", "1"],
            4,
            "no agent is serving",
        ),
    ];
    let mut met = std::collections::BTreeSet::new();
    for (server, args, code, says) in cases {
        let out = chorus(server, args);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(*code), "chorus {args:?}: {t}");
        assert!(t.contains(says), "chorus {args:?} should say {says:?}: {t}");
        assert!(!t.contains("panicked"), "{t}");
        assert!(table.contains_key(code), "exit {code} is not in the table");
        met.insert(*code);
    }
    // 141 and 5 are met by `output_to_a_closed_pipe_ends_quietly` and the chaos runs.
    met.extend([5, 141]);
    let unmet: Vec<_> = table.keys().filter(|c| !met.contains(c)).collect();
    assert!(
        unmet.is_empty(),
        "codes in the table no case meets: {unmet:?}"
    );
}

/// `chorus up` against `server`, its rounds a minute apart, its metrics on a free port.
fn up_running(server: &str) -> Running {
    Running::start(&[
        "--server",
        server,
        "up",
        "--interval",
        "60s",
        "--metrics-addr",
        "127.0.0.1:0",
    ])
}

/// A `chorus` command left running, its standard output and error read line by line.
struct Running {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn start(args: &[&str]) -> Running {
        Running::start_in(args, None)
    }

    fn start_in(args: &[&str], dir: Option<&std::path::Path>) -> Running {
        use std::io::{BufRead, BufReader};
        let mut command = Command::new(env!("CARGO_BIN_EXE_chorus"));
        command
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(dir) = dir {
            command.current_dir(dir);
        }
        let mut child = command.spawn().expect("run chorus");
        let (tx, lines) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        let out = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if out.send(line).is_err() {
                    break;
                }
            }
        });
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Running {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits (up to 60 s) for a line containing `text`.
    fn wait_for(&mut self, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    let found = line.contains(text);
                    self.seen.push(line);
                    if found {
                        return;
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let _ = self.child.kill();
        panic!("no line with {text:?} within 60 s: {:?}", self.seen);
    }

    /// Whether a line containing `text` comes within `limit`.
    fn saw_within(&mut self, text: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let found = line.contains(text);
                    self.seen.push(line);
                    if found {
                        return true;
                    }
                }
                Err(_) => return false,
            }
        }
        false
    }

    /// Sends `signal` (`INT`, `TERM`) and waits (up to 20 s) for the end: its status and every
    /// line printed.
    fn stop(mut self, signal: &str) -> (std::process::ExitStatus, String) {
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(sent.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                // The readers end with the process's pipes.
                while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
                    self.seen.push(line);
                }
                return (status, self.seen.join("\n"));
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "chorus still running 20 s after SIG{signal}: {:?}",
                    self.seen
                );
            }
            self.seen.extend(self.lines.try_iter());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Issue 32, defect 5: while the server is away `chorus listen` says once that it is
/// reconnecting and once that it is back, with no log lines between, and still prints events.
#[test]
fn listen_says_once_that_it_lost_the_bus_and_once_that_it_is_back() {
    let mut server = chorus_tests::server();
    let url = server.url().to_owned();
    let mut listen = Running::start(&["--server", &url, "listen", "news.>"]);
    listen.wait_for("listening on news.>");
    server.kill();
    listen.wait_for("lost the bus");
    // A while away: every failed attempt would once have printed its own ERROR line.
    let away_until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < away_until {
        listen.seen.extend(listen.lines.try_iter());
        std::thread::sleep(Duration::from_millis(50));
    }
    server.restart().expect("the server restarts on its port");
    listen.wait_for("reconnected to the bus");
    // The subscription is restored with the connection: an event sent now is printed (sent
    // again, within a deadline, should the first beat the restored subscription).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = chorus(&url, &["send", "--topic", "news.today", "\"back\""]);
        assert!(out.status.success(), "{}", text(&out));
        if listen.saw_within("news.today from", Duration::from_secs(2)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no event after the restart: {:?}",
            listen.seen
        );
    }
    let (_, out) = listen.stop("INT");
    assert_eq!(out.matches("lost the bus").count(), 1, "{out}");
    assert_eq!(out.matches("reconnected to the bus").count(), 1, "{out}");
    assert!(!out.contains("ERROR") && !out.contains("WARN"), "{out}");
}

/// A port no one holds now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Issue 32, defect 3: `chorus up` (and so `scripts/up`) starts its server on --server's port
/// and --monitor-port, not the config file's; a port something else holds is named with the
/// flag that moves it.
#[test]
fn up_starts_its_server_on_the_ports_it_is_given_and_names_a_taken_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("nats.conf");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/../nats.conf"), &conf)
        .expect("copy nats.conf");
    let conf = conf.to_str().expect("utf-8 path");
    let (client, monitor) = (free_port(), free_port());
    let url = format!("nats://127.0.0.1:{client}");
    let monitor_flag = monitor.to_string();
    let up = [
        "up",
        "--once",
        "--config",
        conf,
        "--metrics-addr",
        "127.0.0.1:0",
        "--monitor-port",
        &monitor_flag,
    ];
    let out = chorus(&url, &up);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains(&format!("at {url} (monitoring http://127.0.0.1:{monitor}")),
        "{t}"
    );
    assert!(t.contains("scenarios complete"), "{t}");

    // The client port held by something that is not NATS.
    let holder = std::net::TcpListener::bind(("127.0.0.1", client)).expect("hold the port");
    let out = chorus(&url, &up);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains(&format!("127.0.0.1:{client} is taken")) && t.contains("--server"),
        "{t}"
    );
    drop(holder);

    // The monitoring port held.
    let holder = std::net::TcpListener::bind(("127.0.0.1", monitor)).expect("hold the port");
    let out = chorus(&url, &up);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("monitoring port")
            && t.contains("--monitor-port")
            && t.contains("CHORUS_MONITOR_PORT"),
        "{t}"
    );
    drop(holder);
}

/// Issue 32, defect 1: on a server whose users are all `chorus creds` entries, an operator
/// (`chorus creds ops --cli --durable --tasks --dlq --tap`) runs every client command the docs
/// give it, `dlq` and `tap` included, whose replies come to its own inbox prefix; so does the
/// coordinator's seed with `dlq`; a CLI user without `--dlq` or `--tap` is refused those, the
/// subject named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_runs_dlq_tap_tasks_and_durable_sends_on_a_secured_bus() {
    use chorus_tests::{WAIT, eventually};
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = dir.path().join("keys");
    let entries = [
        creds(&keys, &["coordinator", "--coordinator"]),
        creds(&keys, &["echo", "--serves", "echo", "--durable"]),
        creds(
            &keys,
            &["ops", "--cli", "--durable", "--tasks", "--dlq", "--tap"],
        ),
        creds(&keys, &["viewer", "--cli"]),
    ];
    let refs: Vec<&str> = entries.iter().map(String::as_str).collect();
    let SecuredBus {
        server,
        coordinator,
        echo,
    } = SecuredBus::start(dir.path(), &refs).await;
    let as_user = |user: &str| {
        let seed = keys.join(format!("{user}.nk"));
        vec![
            "--server".to_owned(),
            server.url().to_owned(),
            "--id".to_owned(),
            user.to_owned(),
            "--nkey-file".to_owned(),
            seed.to_str().expect("utf-8 path").to_owned(),
        ]
    };
    let run = |user: &str, args: &[&str]| {
        let mut all = as_user(user);
        all.extend(args.iter().map(|a| (*a).to_owned()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let out = Command::new(env!("CARGO_BIN_EXE_chorus"))
            .args(&all)
            .output()
            .expect("run chorus");
        (out.status.code(), text(&out))
    };
    eventually(WAIT, "echo listed", || async {
        let (code, t) = run("ops", &["agents"]);
        (code == Some(0) && t.contains("echo")).then_some(())
    })
    .await;

    // tap, as ops, sees ops's own request and echo's reply.
    let mut tap_args = as_user("ops");
    tap_args.extend([
        "tap".to_owned(),
        "agent.echo.>".to_owned(),
        "--count".to_owned(),
        "2".to_owned(),
    ]);
    let tap_args: Vec<&str> = tap_args.iter().map(String::as_str).collect();
    let mut tap = Running::start(&tap_args);
    tap.wait_for("tapping chorus.agent.echo.>");
    // Traffic outside the pattern, a request and its reply, is not shown and not counted.
    let (code, t) = run("ops", &["agents"]);
    assert_eq!(code, Some(0), "{t}");
    let (code, t) = run("ops", &["request", "--to", "echo", "--command", "hello"]);
    assert_eq!(code, Some(0), "{t}");
    tap.wait_for("response");
    let (status, tapped) = tap.stop("INT");
    assert!(status.success(), "{tapped}");
    assert!(tapped.contains("chorus.agent.echo.hello"), "{tapped}");
    assert!(
        !tapped.contains("from coordinator") && !tapped.contains("coordinator ->"),
        "{tapped}"
    );

    for args in [
        &["send", "--durable", "--to", "echo", "--command", "hello"][..],
        &["task", "ls"],
        &["dlq", "ls"],
    ] {
        let (code, t) = run("ops", args);
        assert_eq!(code, Some(0), "ops: chorus {args:?}: {t}");
        assert!(!t.contains("permission denied"), "{t}");
    }
    // The coordinator's seed, as SECURITY.md once said for dlq.
    let (code, t) = run("coordinator", &["dlq", "ls"]);
    assert_eq!(code, Some(0), "{t}");

    // A CLI user without those rights is refused them, by name.
    let (code, t) = run("viewer", &["dlq", "ls"]);
    assert_eq!(code, Some(4), "{t}");
    assert!(
        t.contains("permission denied") && t.contains("$JS.API"),
        "{t}"
    );
    let (code, t) = run("viewer", &["tap", "--count", "1"]);
    assert_eq!(code, Some(4), "{t}");
    assert!(
        t.contains("permission denied") && t.contains("Subscription to"),
        "{t}"
    );

    echo.shutdown().await;
    coordinator.shutdown().await;
}

/// Runs `script` with `sh` in `dir`, `chorus` first on the PATH and `envs` set, within 60 s.
fn sh_in(dir: &std::path::Path, script: &str, envs: &[(&str, &str)]) -> Output {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_chorus"))
        .parent()
        .expect("bin dir")
        .to_owned();
    let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .expect("PATH");
    let mut child = Command::new("sh")
        .args(["-c", script])
        .current_dir(dir)
        .env("PATH", path)
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run sh");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{script:?} did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// The README's tour, each line as written (the ports aside: the bus runs on free ones),
/// against `chorus up`: every command succeeds but the one the README shows refused, which
/// prints the line the README gives under it; `ID` is the id the line before printed.
#[test]
fn the_readme_tour_runs_as_written() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    let tour = &readme[readme.find("## A short tour").expect("the tour")..];
    let start = tour.find("```sh\n").expect("its block") + "```sh\n".len();
    let block = &tour[start..start + tour[start..].find("```").expect("block end")];

    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("nats.conf");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/../nats.conf"), &conf)
        .expect("copy nats.conf");
    let url = format!("nats://127.0.0.1:{}", free_port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let monitor = free_port().to_string();
    let conf = conf.to_str().expect("utf-8 path");
    // From the repository's root, as `scripts/up` runs it: the demo agents hosted.
    let mut up = Running::start_in(
        &[
            "--server",
            &url,
            "up",
            "--config",
            conf,
            "--interval",
            "2s",
            "--metrics-addr",
            &metrics,
            "--monitor-port",
            &monitor,
        ],
        Some(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/.."
        ))),
    );
    up.wait_for("scenarios complete");

    let envs = [("CHORUS_NATS_URL", url.as_str())];
    let mut lines = block.lines().peekable();
    let mut last_printed = String::new();
    let mut ran = 0;
    while let Some(line) = lines.next() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with("alias ") {
            continue;
        }
        let command = line.split(" #").next().expect("a command").trim();
        let command = command
            .replace(" ID", &format!(" {}", last_printed.trim()))
            .replace("127.0.0.1:9464", &metrics);
        let out = sh_in(dir.path(), &command, &envs);
        let said = text(&out);
        // A line under the command that starts `#   ` is what it prints.
        match lines.peek().map(|l| l.trim()) {
            Some(shown) if shown.starts_with("#   ") => {
                let shown = shown.trim_start_matches('#').trim();
                assert_eq!(out.status.code(), Some(4), "{command}: {said}");
                assert!(
                    said.contains(shown),
                    "{command} should print {shown:?}: {said}"
                );
                lines.next();
            }
            _ => assert!(out.status.success(), "{command}: {said}"),
        }
        assert!(!said.contains("panicked"), "{command}: {said}");
        if command.contains("--policy confident") {
            // The README: the most confident summarizer wins.
            assert!(said.contains("awarded to summarizer-careful"), "{said}");
        }
        last_printed = String::from_utf8_lossy(&out.stdout).into_owned();
        ran += 1;
    }
    assert!(ran >= 15, "{ran} commands ran");
    let (status, out) = up.stop("INT");
    assert!(status.success(), "{out}");
}

/// Issue 36: `chorus up` from the repository's root (as `scripts/up` runs it) starts the demo
/// agents through a host, from the manifests in `deploy/demo/`: each a `chorus demo-agent`
/// process of its own, deployed through the coordinator, its narration in its log; stopping
/// `chorus up` stops them and terminates their deployments.
#[test]
fn up_hosts_the_demo_agents_from_the_manifests_in_deploy_demo() {
    let server = chorus_tests::server();
    let url = server.url().to_owned();
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    // With a Python that has the SDK (scripts/test sets it), the Python agent is hosted too.
    let python = std::env::var("CHORUS_TEST_PYTHON").ok();
    let mut args = vec![
        "--server",
        &url,
        "up",
        "--interval",
        "60s",
        "--metrics-addr",
        "127.0.0.1:0",
    ];
    if let Some(python) = &python {
        args.extend(["--python", python.as_str()]);
    } else {
        eprintln!("CHORUS_TEST_PYTHON is not set (scripts/test sets it): no Python agent");
    }
    let mut up = Running::start_in(&args, Some(root));
    up.wait_for("scenarios complete");
    assert!(
        up.seen
            .iter()
            .any(|l| l.contains("hosted by `chorus host` (host-local) from deploy/demo")),
        "{:?}",
        up.seen
    );

    // Every manifest in deploy/demo is a deployment, each replica healthy on host `local`.
    let mut manifests: Vec<String> = std::fs::read_dir(root.join("deploy/demo"))
        .expect("deploy/demo")
        .filter_map(|e| {
            let path = e.ok()?.path();
            path.is_file()
                .then(|| path.file_stem()?.to_str().map(str::to_owned))?
        })
        .collect();
    assert_eq!(manifests.len(), chorus_demo::AGENTS.len());
    if python.is_some() {
        manifests.push(chorus_demo::PYTHON_AGENT.to_owned());
    }
    let out = chorus(&url, &["deployments", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let views: Vec<chorus_host::protocol::DeploymentView> =
        serde_json::from_slice(&out.stdout).expect("deployments as JSON");
    for name in &manifests {
        let view = views
            .iter()
            .find(|v| &v.deployment == name)
            .unwrap_or_else(|| panic!("no deployment {name}: {views:?}"));
        assert_eq!(view.placed.len(), 1, "{view:?}");
        assert!(
            view.placed[0].healthy && view.placed[0].host == "local",
            "{view:?}"
        );
    }

    // Each is a process of its own, `chorus demo-agent NAME`, its pid as the host reports it.
    let out = chorus(&url, &["hosts", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let hosts: serde_json::Value = serde_json::from_slice(&out.stdout).expect("hosts as JSON");
    let mut pids = std::collections::BTreeMap::new();
    replica_pids(&hosts, &mut pids);
    for name in &manifests {
        let pid = pids
            .get(name)
            .unwrap_or_else(|| panic!("no pid for {name}: {hosts}"));
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("its cmdline");
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let runs = if name == chorus_demo::PYTHON_AGENT {
            "-m chorus_sdk.demo".to_owned()
        } else {
            format!("demo-agent {name}")
        };
        assert!(cmdline.contains(&runs), "{name}: {cmdline}");
    }

    // What a hosted agent narrates is in its log, read through its host.
    let out = chorus(&url, &["logs", "ocr-agent"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("ocr-agent read \"invoice-7.png\""),
        "{}",
        text(&out)
    );

    // Each hosted agent serves its own metrics and announces them: Prometheus finds the
    // calculator through the coordinator's service discovery, and what it handled there.
    let coordinator: std::net::SocketAddr = up
        .seen
        .iter()
        .find_map(|l| l.split("coordinator running; metrics at http://").nth(1))
        .and_then(|rest| rest.split('/').next()?.parse().ok())
        .expect("the coordinator's metrics address");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let get = |addr, path| {
        runtime
            .block_on(chorus_tests::try_http_get(addr, path))
            .expect("GET")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let calculator: std::net::SocketAddr = loop {
        let (_, sd) = get(coordinator, "/sd/agents");
        let targets: Vec<serde_json::Value> = serde_json::from_str(&sd).expect("/sd/agents");
        let found = targets.iter().find_map(|t| {
            let agents = t["labels"]["chorus_agents"].as_str()?;
            agents
                .split(',')
                .any(|a| a == "calculator")
                .then(|| t["targets"][0].as_str()?.parse().ok())?
        });
        if let Some(addr) = found {
            break addr;
        }
        assert!(
            Instant::now() < deadline,
            "no calculator in /sd/agents: {sd}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let (status, metrics) = get(calculator, "/metrics");
    assert_eq!(status, 200, "{metrics}");
    assert!(
        metrics.contains("chorus_agent_messages_total{agent=\"calculator\""),
        "{metrics}"
    );

    let (status, out) = up.stop("INT");
    assert!(status.success(), "{out}");
    assert!(!out.contains("could not terminate"), "{out}");
    // The agents stopped with it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids
        .values()
        .any(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
    {
        assert!(
            Instant::now() < deadline,
            "demo agents still running: {pids:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every `agent_id` with a `pid` in `value` (a host report, as `chorus hosts --json` prints).
fn replica_pids(value: &serde_json::Value, pids: &mut std::collections::BTreeMap<String, u64>) {
    match value {
        serde_json::Value::Object(map) => {
            if let (Some(id), Some(pid)) = (
                map.get("agent_id").and_then(|v| v.as_str()),
                map.get("pid").and_then(serde_json::Value::as_u64),
            ) {
                pids.insert(id.to_owned(), pid);
            }
            map.values().for_each(|v| replica_pids(v, pids));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| replica_pids(v, pids)),
        _ => {}
    }
}
