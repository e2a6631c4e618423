//! docs/SECURITY.md "Running with security on", run as written in an empty directory: the
//! first `sh` block's commands with the real `chorus`, `secure.conf` (the `conf` block) under a
//! real `nats-server`, `chorus serve` with the `toml` block, ocr-agent as the Rust block (which
//! is `agent-sdk/examples/secure_ocr_agent.rs`, run as its built binary), nlp-agent as the
//! Python block (run with the interpreter `scripts/test` installs the SDK into), and the
//! operator's `sh` block and `tap` command, the dead letter replayed, the host and the admin's
//! deploy, then the gateway's block appended to `chorus.toml` with the keys `chorus api-key`
//! makes, the HTTP caller's `curl` (served by ocr-agent, which requires signatures, as web-ui)
//! and ops's console sign-in. The one change: the ports, `4222`, `8480` and `8490` in the
//! document, are ones the OS picks, so tests run side by side. Then a spoofed `from`, a replay across a
//! restart and a forged broadcast are each refused with their code.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chorus_broker_adapter::TlsOptions;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::security::Identity;
use chorus_sdk::{BrokerOptions, Credentials, Envelope, Kind, Performative, StatusCode};
use chorus_tests::{WAIT, chorus_binary, eventually, within};

/// The address the document uses; the test puts its own port in its place.
const DOC_ADDRESS: &str = "127.0.0.1:4222";
/// The gateway's and the console's addresses in step 8.
const DOC_GATEWAY: &str = "127.0.0.1:8480";
const DOC_CONSOLE: &str = "127.0.0.1:8490";

/// The value of cookie `name` set in response headers `head`.
fn cookie(head: &str, name: &str) -> Option<String> {
    head.lines()
        .filter_map(|l| l.split_once(": "))
        .filter(|(n, _)| n.eq_ignore_ascii_case("set-cookie"))
        .filter_map(|(_, c)| c.split(';').next()?.split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.trim().to_owned())
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// The `n`th fenced block (from 0) of language `lang` in `section`.
fn fenced<'a>(section: &'a str, lang: &str, n: usize) -> &'a str {
    let open = format!("```{lang}\n");
    let start = section
        .match_indices(&open)
        .nth(n)
        .unwrap_or_else(|| panic!("no {lang} block {n}"))
        .0
        + open.len();
    let len = section[start..].find("```").expect("block end");
    &section[start..start + len]
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A process of the walkthrough (an agent, the coordinator), its output lines kept.
struct Running {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    name: &'static str,
}

impl Running {
    fn start(name: &'static str, mut command: Command) -> Running {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("run {name}: {e}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        for stream in [
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let lines = Arc::clone(&lines);
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    lines.lock().expect("lines").push(line);
                }
            });
        }
        Running { child, lines, name }
    }

    fn output(&self) -> String {
        self.lines.lock().expect("lines").join("\n")
    }

    fn count(&self, text: &str) -> usize {
        self.lines
            .lock()
            .expect("lines")
            .iter()
            .filter(|l| l.contains(text))
            .count()
    }

    /// Waits (up to [`WAIT`]) for `n` lines containing `text`.
    fn wait_for(&mut self, text: &str, n: usize) {
        let deadline = Instant::now() + WAIT;
        while self.count(text) < n {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("{} exited ({status}): {}", self.name, self.output());
            }
            assert!(
                Instant::now() < deadline,
                "{}: no {n} line(s) with {text:?} within {WAIT:?}: {}",
                self.name,
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Ctrl-C, and the process's end (within [`WAIT`]).
    fn stop(mut self) -> String {
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + WAIT;
        while self.child.try_wait().expect("wait").is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("{} did not stop on Ctrl-C: {}", self.name, self.output());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.output()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The built `secure_ocr_agent` example, beside this test's binary.
fn ocr_example() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary");
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir")
        .join("examples/secure_ocr_agent");
    assert!(
        path.is_file(),
        "{} is not built: `cargo build -p chorus-sdk --examples` (scripts/test builds it)",
        path.display()
    );
    path
}

fn start_ocr(dir: &Path, url: &str) -> Running {
    let mut command = Command::new(ocr_example());
    command.current_dir(dir).env("CHORUS_NATS_URL", url);
    let mut ocr = Running::start("ocr-agent", command);
    ocr.wait_for("ocr-agent: serving", 1);
    ocr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walkthrough_running_with_security_on_works_as_documented_and_refuses_each_attack() {
    chorus_tests::init_tracing();
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/SECURITY.md"))
        .expect("docs/SECURITY.md");
    let start = doc
        .find("## Running with security on")
        .expect("the section");
    let section = &doc[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let python = std::env::var_os("CHORUS_TEST_PYTHON").expect(
        "CHORUS_TEST_PYTHON names a Python with the SDK installed (scripts/test sets it: \
         scripts/install-python-sdk prints one)",
    );
    let chorus = chorus_binary();
    let work = tempfile::tempdir().expect("tempdir");
    let dir = work.path();
    let address = format!("127.0.0.1:{}", free_port());
    let url = format!("tls://{address}");
    let ported = |text: &str| text.replace(DOC_ADDRESS, &address);
    let path = std::env::join_paths(
        [
            chorus.parent().expect("bin dir").to_owned(),
            chorus_nats_server::find_binary()
                .expect("nats-server installed")
                .parent()
                .expect("its dir")
                .to_owned(),
        ]
        .into_iter()
        .chain(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        )),
    )
    .expect("PATH");
    let sh = |script: &str| {
        Command::new("sh")
            .args(["-e", "-c", script])
            .current_dir(dir)
            .env("PATH", &path)
            .env_remove("CHORUS_NATS_URL")
            .output()
            .expect("run sh")
    };

    // 1. Certificates, identities, the server's users.
    let steps = fenced(section, "sh", 0);
    let out = sh(steps);
    assert!(out.status.success(), "{steps}\n{}", text(&out));
    for file in [
        ".tls/nats-tls.conf",
        ".keys/ops.pub",
        ".keys/coordinator.pub",
        "authorization.conf",
    ] {
        assert!(dir.join(file).is_file(), "{file} not written");
    }

    // 2. The server, from secure.conf as the document gives it.
    std::fs::write(dir.join("secure.conf"), ported(fenced(section, "conf", 0)))
        .expect("write secure.conf");
    let out = sh("nats-server -t -c secure.conf");
    assert!(out.status.success(), "{}", text(&out));
    let server = chorus_tests::ServerBuilder::default()
        .config(dir.join("secure.conf"))
        .current_dir(dir)
        .start()
        .expect("nats-server -c secure.conf starts");

    // 3. The coordinator, `chorus serve --config chorus.toml` (its metrics on a free port).
    std::fs::write(dir.join("chorus.toml"), ported(fenced(section, "toml", 0)))
        .expect("write chorus.toml");
    assert!(section.contains("`chorus serve --config chorus.toml`"));
    let mut serve = Command::new(&chorus);
    serve
        .args(["serve", "--config", "chorus.toml"])
        .current_dir(dir)
        .env("CHORUS_SERVE__METRICS_ADDR", "127.0.0.1:0");
    let mut coordinator = Running::start("chorus serve", serve);
    coordinator.wait_for("chorus serve: coordinator", 1);

    // 4. The agents: the Rust block is the example's code, run as built; the Python block is
    //    saved as nlp_agent.py and run.
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../agent-sdk/examples/secure_ocr_agent.rs"
    ))
    .expect("the example");
    let code = &example[example.find("use chorus_sdk").expect("its code")..];
    assert_eq!(
        fenced(section, "rust", 0),
        code,
        "SECURITY.md's Rust block is agent-sdk/examples/secure_ocr_agent.rs below its comment"
    );
    let mut ocr = start_ocr(dir, &url);
    std::fs::write(dir.join("nlp_agent.py"), fenced(section, "python", 0)).expect("write");
    assert!(section.contains("`python nlp_agent.py`"));
    let mut nlp_command = Command::new(&python);
    // The file as written, with Ctrl-C as a terminal delivers it: a process started in the
    // background of a script (as CI may run the tests) inherits SIGINT ignored, and Python
    // keeps it so.
    nlp_command
        .args([
            "-c",
            "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); \
             runpy.run_path('nlp_agent.py', run_name='__main__')",
        ])
        .current_dir(dir)
        .env("CHORUS_NATS_URL", &url);
    let mut nlp = Running::start("nlp-agent", nlp_command);
    nlp.wait_for("nlp-agent: serving", 1);

    // 5. The operator's commands, once both agents are registered and know each other's keys
    //    (each learns the other's from the registry).
    let ops_env = [
        ("CHORUS_NATS_URL", url.as_str()),
        ("CHORUS_ID", "ops"),
        ("CHORUS_NKEY_FILE", ".keys/ops.nk"),
        ("CHORUS_TLS_CA", ".tls/ca.pem"),
        ("CHORUS_TLS_CERT", ".tls/client.pem"),
        ("CHORUS_TLS_KEY", ".tls/client-key.pem"),
    ];
    let as_ops = |args: &[&str]| {
        let out = Command::new(&chorus)
            .args(args)
            .current_dir(dir)
            .envs(ops_env)
            .output()
            .expect("run chorus");
        (out.status.success(), text(&out))
    };
    eventually(WAIT, "ocr-agent answers through nlp-agent", || async {
        let (ok, out) = tokio::task::block_in_place(|| {
            as_ops(&[
                "request",
                "--to",
                "ocr-agent",
                "--command",
                "ocr",
                "\"warm up\"",
            ])
        });
        (ok && out.contains("2 words for ops")).then_some(())
    })
    .await;
    let operator = ported(fenced(section, "sh", 1));
    let out = sh(&operator);
    let said = text(&out);
    assert!(out.status.success(), "{operator}\n{said}");
    assert!(said.contains("2 live agent(s)"), "{said}");
    assert!(said.contains("3 words for ops"), "{said}");
    assert!(said.contains("2 delivered"), "{said}");
    // `chorus hosts`, an operator's command, answered for ops's signature (no host runs here).
    assert!(said.contains("slots"), "{said}");
    assert!(!said.contains("permission denied"), "{said}");
    ocr.wait_for("ocr-agent: reload from coordinator", 1);
    nlp.wait_for("nlp-agent: reload from coordinator", 1);

    // `chorus tap`, as the document runs it beside a request.
    let tap_command = section
        .split('`')
        .find(|s| s.starts_with("chorus tap "))
        .expect("the tap command");
    let mut tap_args = tap_command
        .split_whitespace()
        .skip(1)
        .map(|a| a.trim_matches('\''));
    let mut tap = Command::new(&chorus);
    tap.args(tap_args.by_ref()).current_dir(dir).envs(ops_env);
    let mut tapping = Running::start("chorus tap", tap);
    tapping.wait_for("tapping chorus.agent.ocr-agent.>", 1);
    let (ok, out) = as_ops(&[
        "request",
        "--to",
        "ocr-agent",
        "--command",
        "ocr",
        "\"tapped\"",
    ]);
    assert!(ok, "{out}");
    tapping.wait_for("response", 1);
    let tapped = tapping.stop();
    assert!(
        tapped.contains("chorus.agent.ocr-agent.ocr") && tapped.contains("ops -> ocr-agent"),
        "{tapped}"
    );

    // Without --id the CLI is cli-<pid>, whose inbox no entry allows: refused, exit 4.
    let out = Command::new(&chorus)
        .args(["request", "--to", "ocr-agent", "--command", "ocr", "\"x\""])
        .current_dir(dir)
        .envs(ops_env.iter().filter(|(k, _)| *k != "CHORUS_ID").copied())
        .output()
        .expect("run chorus");
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    assert!(text(&out).contains("permission denied"), "{}", text(&out));

    // 6. A dead letter, replayed: the work sent before nlp-agent's index is ready is retried,
    //    dead-lettered, and once the index is ready, replayed by ops and handled once.
    let sh_ops = |script: &str| {
        Command::new("sh")
            .args(["-e", "-c", script])
            .current_dir(dir)
            .env("PATH", &path)
            .envs(ops_env)
            .output()
            .expect("run sh")
    };
    let send = fenced(section, "sh", 2);
    assert!(send.contains("--command index"), "{send}");
    let out = sh_ops(send);
    assert!(
        out.status.success(),
        "{send}
{}",
        text(&out)
    );
    eventually(Duration::from_secs(60), "the dead letter", || async {
        let (ok, out) =
            tokio::task::block_in_place(|| as_ops(&["dlq", "ls", "--agent", "nlp-agent"]));
        (ok && out.contains("max_attempts")).then_some(())
    })
    .await;
    let replay = fenced(section, "sh", 3);
    assert!(replay.contains("dlq replay"), "{replay}");
    let out = sh_ops(replay);
    assert!(
        out.status.success(),
        "{replay}
{}",
        text(&out)
    );
    nlp.wait_for("nlp-agent: indexed 'q3 report' for ops", 1);
    let (ok, out) = as_ops(&["dlq", "ls", "--agent", "nlp-agent"]);
    assert!(ok && !out.contains("max_attempts"), "{out}");
    assert_eq!(nlp.count("nlp-agent: indexed"), 1, "{}", nlp.output());

    // 7. An admin deploys: host-a started as the document says (with step 5's variables), the
    //    manifest saved as hello.toml, and ops's three commands, each run as written.
    let host_line = ported(fenced(section, "sh", 4));
    let host_line = host_line.trim();
    assert!(
        host_line.starts_with("chorus ") && !host_line.contains('\n'),
        "{host_line}"
    );
    let mut host_command = Command::new(&chorus);
    host_command
        .args(host_line.split_whitespace().skip(1))
        .current_dir(dir)
        .envs(ops_env);
    let host = Running::start("chorus host", host_command);
    std::fs::write(dir.join("hello.toml"), fenced(section, "toml", 1)).expect("write hello.toml");
    eventually(WAIT, "host a live", || async {
        let (ok, out) = tokio::task::block_in_place(|| as_ops(&["hosts"]));
        (ok && out.contains("a ") && out.contains("live")).then_some(())
    })
    .await;
    let admin = fenced(section, "sh", 5);
    let lines: Vec<&str> = admin.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 3, "{admin}");
    let run_line = |line: &str| {
        let args: Vec<&str> = line.split_whitespace().skip(1).collect();
        tokio::task::block_in_place(|| as_ops(&args))
    };
    let (ok, out) = run_line(lines[0]);
    assert!(
        ok && lines[0].contains("deploy"),
        "{}: {out}\n{}",
        lines[0],
        host.output()
    );
    let expected = if chorus_host::process::user::current_user() == "root" {
        "hello from nobody".to_owned()
    } else {
        format!("hello from {}", chorus_host::process::user::current_user())
    };
    eventually(WAIT, "the deployed agent's log", || async {
        let (ok, out) = run_line(lines[1]);
        (ok && out.contains(&expected)).then_some(())
    })
    .await;
    let (ok, out) = run_line(lines[2]);
    assert!(ok && lines[2].contains("terminate"), "{}: {out}", lines[2]);
    let (ok, out) = as_ops(&["deployments"]);
    assert!(ok && !out.contains("hello"), "{out}");
    drop(host);

    // 8. The gateway and the console: the coordinator stopped, the toml block appended, the
    //    keys made as written, and `chorus serve` started again; its listeners on free ports.
    let (api, console) = (free_port(), free_port());
    let ported = |text: &str| {
        text.replace(DOC_ADDRESS, &address)
            .replace(DOC_GATEWAY, &format!("127.0.0.1:{api}"))
            .replace(DOC_CONSOLE, &format!("127.0.0.1:{console}"))
    };
    coordinator.stop();
    let mut toml = std::fs::read_to_string(dir.join("chorus.toml")).expect("chorus.toml");
    toml.push('\n');
    toml.push_str(&ported(fenced(section, "toml", 2)));
    std::fs::write(dir.join("chorus.toml"), toml).expect("append to chorus.toml");
    let keys = fenced(section, "sh", 6);
    assert!(keys.contains("chorus api-key"), "{keys}");
    let out = sh(keys);
    assert!(out.status.success(), "{keys}\n{}", text(&out));
    let mut serve = Command::new(&chorus);
    serve
        .args(["serve", "--config", "chorus.toml"])
        .current_dir(dir)
        .env("CHORUS_SERVE__METRICS_ADDR", "127.0.0.1:0");
    coordinator = Running::start("chorus serve", serve);
    coordinator.wait_for("chorus serve: coordinator", 1);
    // The caller's request, as written, once the registry has told ocr-agent web-ui's key.
    let call = ported(fenced(section, "sh", 7));
    assert!(call.starts_with("curl "), "{call}");
    let answer = eventually(WAIT, "ocr-agent answers the gateway's caller", || async {
        let out = tokio::task::block_in_place(|| sh(&call));
        let said = text(&out);
        (out.status.success() && said.contains("words for")).then_some(said)
    })
    .await;
    let expected =
        r#"{"status":5002,"label":"ok","from":"ocr-agent","payload":"5 words for web-ui"}"#;
    assert!(section.contains(expected), "the document gives the answer");
    assert!(answer.contains(expected), "{answer}");
    // The console, signed in with ops's key as a browser does (the login form's token in its
    // cookie and the form).
    let console_addr: std::net::SocketAddr =
        format!("127.0.0.1:{console}").parse().expect("address");
    let read_key = |id: &str| {
        std::fs::read_to_string(dir.join(format!(".keys/{id}.key")))
            .expect("the key file")
            .trim()
            .to_owned()
    };
    let (ops_key_text, web_key_text) = (read_key("ops"), read_key("web-ui"));
    let (_, head, form) = chorus_tests::curl(console_addr, "GET", "/login", &[], 10).await;
    let token = cookie(&head, "chorus_console_login").expect("a login cookie");
    assert!(form.contains(&token), "the form carries its token");
    let login_body = format!("credential={}&csrf={token}&next=%2Fagents", ops_key_text);
    let (status, head, _) = chorus_tests::curl(
        console_addr,
        "POST",
        "/login",
        &[
            "-H".into(),
            format!("cookie: chorus_console_login={token}"),
            "-H".into(),
            "content-type: application/x-www-form-urlencoded".into(),
            "--data-binary".into(),
            login_body,
        ],
        10,
    )
    .await;
    assert_eq!(status, 303, "{head}");
    let session = cookie(&head, "chorus_console").expect("a session cookie");
    let signed_in = vec!["-H".to_owned(), format!("cookie: chorus_console={session}")];
    eventually(WAIT, "the console lists the agents", || async {
        let (status, _, page) =
            chorus_tests::curl(console_addr, "GET", "/agents", &signed_in, 10).await;
        (status == 200
            && ["ocr-agent", "nlp-agent", "web-ui"]
                .iter()
                .all(|a| page.contains(a)))
        .then_some(page)
    })
    .await;
    let (status, _, page) = chorus_tests::curl(console_addr, "GET", "/dlq", &signed_in, 10).await;
    assert!(
        status == 200
            && page.contains(r#"signed in as <b id="identity">ops</b>"#)
            && page.contains("0 dead letter(s) in the queue"),
        "{page}"
    );
    // Each key reaches what its scope names: web-ui's no console page, ops's no agent.
    let (status, _, _) = chorus_tests::curl(
        console_addr,
        "GET",
        "/agents",
        &["-H".into(), format!("x-api-key: {web_key_text}")],
        10,
    )
    .await;
    assert_eq!(status, 403, "web-ui's key on the console");
    let ops_call = call
        .replace(".keys/web-ui.key", ".keys/ops.key")
        .replace("curl -s", "curl -s -o /dev/null -w %{http_code}");
    let out = sh(&ops_call);
    assert_eq!(text(&out).trim(), "403", "{ops_call}");

    // An attacker with ops's credentials, on the wire.
    let ops_key = Identity::from_seed(
        std::fs::read_to_string(dir.join(".keys/ops.nk"))
            .expect("ops seed")
            .trim(),
    )
    .expect("ops identity");
    let raw = within(
        WAIT,
        "raw connect",
        BrokerOptions::new([url.as_str()])
            .credentials(Credentials::NKeySeed(
                std::fs::read_to_string(dir.join(".keys/ops.nk"))
                    .expect("seed")
                    .trim()
                    .into(),
            ))
            .tls(
                TlsOptions::required()
                    .ca_file(dir.join(".tls/ca.pem"))
                    .client_cert(dir.join(".tls/client.pem"), dir.join(".tls/client-key.pem")),
            )
            .inbox_prefix("_INBOX.ops")
            .connect(),
    )
    .await
    .expect("ops connects");
    let ask = |subject: String, env: Envelope| {
        let raw = &raw;
        async move {
            let reply = raw
                .request(
                    &subject,
                    None,
                    codec::encode(&env, Encoding::MsgPack).expect("encode"),
                    WAIT,
                )
                .await
                .expect("a reply");
            codec::decode(reply.payload()).expect("reply envelope").0
        }
    };
    let ocr_request = |from: &str, signer: Option<&Identity>| {
        let subject = "chorus.agent.ocr-agent.ocr".to_owned();
        let mut env = Envelope::new(Kind::Request, Performative::Request, from);
        env.to = vec!["ocr-agent".into()];
        env.name = Some("ocr".into());
        env.payload = codec::encode_payload(&"four little words here", "application/msgpack")
            .expect("payload");
        if let Some(identity) = signer {
            identity.sign(&subject, &mut env);
        }
        (subject, env)
    };

    // A spoofed `from`: ops claiming to be nlp-agent, signed with ops's key (5004), unsigned
    // (5014).
    let (subject, env) = ocr_request("nlp-agent", Some(&ops_key));
    let spoofed = ask(subject, env).await;
    assert_eq!(spoofed.status, Some(StatusCode::IDENTITY), "{spoofed:?}");
    let (subject, env) = ocr_request("nlp-agent", None);
    let unsigned = ask(subject, env).await;
    assert_eq!(
        unsigned.status,
        Some(StatusCode::UNAUTHORIZED),
        "{unsigned:?}"
    );

    // A replay across a restart: ops's signed request, accepted; ocr-agent stopped and run
    // again; the same bytes again.
    let (subject, captured) = ocr_request("ops", Some(&ops_key));
    let first = ask(subject.clone(), captured.clone()).await;
    assert_eq!(first.status, Some(StatusCode::OK), "{first:?}");
    ocr.stop();
    ocr = start_ocr(dir, &url);
    let replay = ask(subject, captured).await;
    assert_eq!(replay.status, Some(StatusCode::REPLAY), "{replay:?}");

    // A forged broadcast claiming to be ocr-agent, refused by the coordinator: unsigned (5014)
    // and signed by another key (5004). Then a real one from ops: each agent gets exactly one
    // copy more, so no forged copy reached it.
    let (ocr_before, nlp_before) = (
        ocr.count("reload from coordinator"),
        nlp.count("reload from coordinator"),
    );
    let forged = |signer: Option<&Identity>| {
        let subject = "chorus.bcast.all".to_owned();
        let mut env = Envelope::new(Kind::Request, Performative::Request, "ocr-agent");
        env.name = Some("reload".into());
        env.payload = codec::encode_payload(&(), "application/msgpack").expect("payload");
        if let Some(identity) = signer {
            identity.sign(&subject, &mut env);
        }
        (subject, env)
    };
    let (subject, env) = forged(None);
    let refused = ask(subject, env).await;
    assert_eq!(
        refused.status,
        Some(StatusCode::UNAUTHORIZED),
        "{refused:?}"
    );
    let (subject, env) = forged(Some(&ops_key));
    let refused = ask(subject, env).await;
    assert_eq!(refused.status, Some(StatusCode::IDENTITY), "{refused:?}");
    let broadcast = eventually(WAIT, "a broadcast delivered to both agents", || async {
        let (ok, out) =
            tokio::task::block_in_place(|| as_ops(&["broadcast", "--all", "--command", "reload"]));
        (ok && out.contains("2 delivered")).then_some(out)
    })
    .await;
    assert!(
        broadcast.contains("ocr-agent") && broadcast.contains("nlp-agent"),
        "{broadcast}"
    );
    ocr.wait_for("reload from coordinator", ocr_before + 1);
    nlp.wait_for("reload from coordinator", nlp_before + 1);
    assert_eq!(ocr.count("reload from coordinator"), ocr_before + 1);
    assert_eq!(nlp.count("reload from coordinator"), nlp_before + 1);

    drop(raw);
    // Both agents stop on Ctrl-C without a traceback or a panic.
    let nlp_said = nlp.stop();
    assert!(!nlp_said.contains("Traceback"), "{nlp_said}");
    let ocr_said = ocr.stop();
    assert!(!ocr_said.contains("panicked"), "{ocr_said}");
    coordinator.stop();
    drop(server);
}
