//! docs/SECURITY.md "Running with security on", followed as written: the `sh` block's commands
//! are read from the document at test time and run with the real `chorus` binary, `nats.conf`
//! is what the block's comment says (the printed tls block and the users.conf entries), the
//! coordinator runs as `chorus serve` with the document's config file, the agents connect as
//! the Rust snippet does, and the CLI runs the document's example. Then a spoofed `from`, a
//! replay across a restart and a forged broadcast are each refused with their code.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;

use chorus_broker_adapter::TlsOptions;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::security::{Identity, SignaturePolicy};
use chorus_sdk::{
    AgentOptions, BrokerOptions, Context, Credentials, Envelope, HandlerError, Kind, Performative,
    StatusCode,
};
use chorus_tests::{Processes, WAIT, chorus_binary, eventually, within};

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// The first fenced block of language `lang` in `section`.
fn fenced<'a>(section: &'a str, lang: &str) -> &'a str {
    let open = format!("```{lang}\n");
    let start = section
        .find(&open)
        .unwrap_or_else(|| panic!("no {lang} block"))
        + open.len();
    let len = section[start..].find("```").expect("block end");
    &section[start..start + len]
}

/// The `nats.conf` user entries `chorus creds` printed, by the last word of their comment
/// (`# the coordinator`, `# agent ocr-agent`, `# CLI user ops`): name to nkey.
fn entry_keys(users: &str) -> BTreeMap<String, String> {
    let mut keys = BTreeMap::new();
    let mut name = None;
    for line in users.lines() {
        if let Some(comment) = line.trim().strip_prefix('#') {
            name = comment.split_whitespace().last().map(str::to_owned);
        } else if let (Some(n), Some(rest)) = (name.take(), line.split("nkey: \"").nth(1)) {
            keys.insert(n, rest.split('"').next().expect("key").to_owned());
        }
    }
    keys
}

/// Agent options as the document's snippet builds them, for agent `id`.
fn snippet_options(
    dir: &Path,
    url: &str,
    id: &str,
    keys: &BTreeMap<String, String>,
) -> AgentOptions {
    let seed = std::fs::read_to_string(dir.join(format!(".keys/{id}.nk"))).expect("seed");
    AgentOptions::new(id)
        .broker(
            BrokerOptions::new([url])
                .credentials(Credentials::NKeySeed(seed.trim().into()))
                .tls(
                    TlsOptions::required()
                        .ca_file(dir.join(".tls/ca.pem"))
                        .client_cert(dir.join(".tls/client.pem"), dir.join(".tls/client-key.pem")),
                ),
        )
        .identity(Identity::generate())
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..Default::default()
        })
        .persist_seen_ids(true)
        .trust("coordinator", keys["coordinator"].clone())
        .trust("ops", keys["ops"].clone())
}

/// ocr-agent: its `ocr` command asks the `nlp.analyze` capability and reports the answer.
async fn ocr_agent(options: AgentOptions) -> chorus_sdk::Agent {
    let agent = within(WAIT, "ocr-agent connect", options.connect())
        .await
        .expect("ocr-agent connects over mutual TLS with its nkey");
    let caller = agent.clone();
    agent
        .on_command("ocr", move |ctx: Context, text: String| {
            let caller = caller.clone();
            async move {
                let words: u32 = caller.request_capability("nlp.analyze", &text).await?;
                Ok::<_, HandlerError>(format!("{words} words for {}", ctx.from()))
            }
        })
        .await
        .expect("register ocr");
    agent
        .on_command("reload", |_ctx: Context, (): ()| async move {
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("register reload");
    agent
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
    let chorus = chorus_binary();
    let work = tempfile::tempdir().expect("tempdir");
    let dir = work.path();
    let mut procs = Processes::default();

    // The shell steps, as written, with `chorus` on the PATH.
    let steps = fenced(section, "sh");
    let path = std::env::join_paths(
        std::iter::once(chorus.parent().expect("bin dir").to_owned()).chain(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        )),
    )
    .expect("PATH");
    let out = Command::new("sh")
        .args(["-e", "-c", steps])
        .current_dir(dir)
        .env("PATH", path)
        .output()
        .expect("run the steps");
    assert!(out.status.success(), "{steps}\n{}", text(&out));
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();

    // nats.conf: the tls block `chorus certs` printed, and the users.conf entries.
    let tls_block: String = printed
        .split_once("nats.conf:\n")
        .expect("chorus certs printed a nats.conf block")
        .1
        .lines()
        .scan(false, |done, line| {
            if *done {
                return None;
            }
            *done = line.trim() == "}";
            Some(format!("{line}\n"))
        })
        .collect();
    assert!(tls_block.contains("verify: true"), "{tls_block}");
    let users = std::fs::read_to_string(dir.join("users.conf")).expect("users.conf");
    let keys = entry_keys(&users);
    for who in ["coordinator", "ocr-agent", "nlp-agent", "ops"] {
        assert!(keys.contains_key(who), "no entry for {who}: {users}");
    }
    let conf = dir.join("nats.conf");
    std::fs::write(
        &conf,
        format!(
            "listen: \"127.0.0.1:-1\"\njetstream {{ store_dir: \"{}\" }}\n{tls_block}authorization {{\n  users = [\n{users}\n  ]\n}}\n",
            dir.join("js").display()
        ),
    )
    .expect("write nats.conf");
    let server = chorus_tests::ServerBuilder::default()
        .config(&conf)
        .current_dir(dir)
        .start()
        .expect("the secured server starts");
    let url = server.url().replacen("nats://", "tls://", 1);

    // The coordinator: `chorus serve` with the document's config file, its placeholder filled.
    let toml =
        fenced(section, "toml").replace("<the nkey of ops's entry in users.conf>", &keys["ops"]);
    std::fs::write(dir.join("chorus.toml"), toml).expect("write chorus.toml");
    let mut serve = Command::new(&chorus)
        .args(["--server", &url, "serve", "--config", "chorus.toml"])
        .current_dir(dir)
        .env("CHORUS_SERVE__METRICS_ADDR", "127.0.0.1:0")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run chorus serve");
    let stdout = serve.stdout.take().expect("stdout");
    procs.0.push(serve);
    let (line_tx, line_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line_tx.send(line).is_err() {
                break;
            }
        }
    });
    let ready = line_rx
        .recv_timeout(WAIT)
        .unwrap_or_else(|e| panic!("chorus serve did not start: {e}\n{}", server.log()));
    assert!(ready.starts_with("chorus serve: coordinator"), "{ready}");

    // The agents, as the snippet builds them.
    let snippet = fenced(section, "rust");
    for fragment in [
        ".credentials(Credentials::NKeySeed(",
        "TlsOptions::required()",
        ".ca_file(\".tls/ca.pem\")",
        ".client_cert(\".tls/client.pem\", \".tls/client-key.pem\")",
        ".identity(Identity::generate())",
        "require_signed: true",
        ".persist_seen_ids(true)",
        ".trust(\"coordinator\",",
        ".trust(\"ops\",",
    ] {
        assert!(snippet.contains(fragment), "the snippet lost {fragment}");
    }
    let mut ocr = ocr_agent(snippet_options(dir, &url, "ocr-agent", &keys)).await;
    let nlp = within(
        WAIT,
        "nlp-agent connect",
        snippet_options(dir, &url, "nlp-agent", &keys).connect(),
    )
    .await
    .expect("nlp-agent connects over mutual TLS with its nkey");
    nlp.on_capability("nlp.analyze", |_ctx: Context, text: String| async move {
        Ok::<_, HandlerError>(u32::try_from(text.split_whitespace().count()).unwrap_or(0))
    })
    .await
    .expect("register nlp.analyze");
    nlp.on_command("reload", |_ctx: Context, (): ()| async move {
        Ok::<_, HandlerError>(())
    })
    .await
    .expect("register reload");

    // The CLI, as the document's example: `chorus --id ops ... agents`, then a request.
    let example = section
        .split('`')
        .find(|s| s.starts_with("chorus --id ops") && s.ends_with(" agents"))
        .expect("the CLI example");
    let cli_args: Vec<&str> = example.split_whitespace().skip(1).collect();
    let cli = |extra: &[&str]| {
        let args: Vec<&str> = cli_args[..cli_args.len() - 1]
            .iter()
            .chain(extra)
            .copied()
            .collect();
        let out = Command::new(&chorus)
            .args(&args)
            .current_dir(dir)
            .env("CHORUS_NATS_URL", &url)
            .output()
            .expect("run chorus");
        (out.status.success(), text(&out))
    };
    let listed = eventually(WAIT, "both agents listed by chorus agents", || async {
        let (ok, out) = tokio::task::block_in_place(|| cli(&["agents"]));
        (ok && out.contains("ocr-agent") && out.contains("nlp-agent")).then_some(out)
    })
    .await;
    assert!(listed.contains("2 live agent(s)"), "{listed}");
    // ocr-agent verifies ops's signature, asks nlp-agent (which verifies ocr-agent's), answers.
    let request = [
        "request",
        "--to",
        "ocr-agent",
        "--command",
        "ocr",
        "\"one two three\"",
    ];
    let answered = eventually(WAIT, "chorus request answered", || async {
        let (ok, out) = tokio::task::block_in_place(|| cli(&request));
        ok.then_some(out)
    })
    .await;
    assert!(answered.contains("3 words for ops"), "{answered}");

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

    // A replay across a restart: ops's signed request, accepted, ocr-agent restarted (a new
    // process would run the snippet again), the same bytes again.
    let (subject, captured) = ocr_request("ops", Some(&ops_key));
    let first = ask(subject.clone(), captured.clone()).await;
    assert_eq!(first.status, Some(StatusCode::OK), "{first:?}");
    within(WAIT, "ocr-agent shutdown", ocr.shutdown()).await;
    ocr = ocr_agent(snippet_options(dir, &url, "ocr-agent", &keys)).await;
    let replay = ask(subject, captured).await;
    assert_eq!(replay.status, Some(StatusCode::REPLAY), "{replay:?}");
    assert_eq!(ocr.stats().security_refused, 1);
    assert_eq!(ocr.stats().handled_ok, 0);

    // A forged broadcast claiming to be ocr-agent, refused by the coordinator: unsigned (5014)
    // and signed by another key (5004). A real one, from ops through the CLI, reaches both.
    let handled_before = ocr.stats().handled_ok + nlp.stats().handled_ok;
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
    assert_eq!(
        ocr.stats().handled_ok + nlp.stats().handled_ok,
        handled_before,
        "a forged broadcast was delivered"
    );
    let broadcast = eventually(WAIT, "a broadcast delivered to both agents", || async {
        let (ok, out) =
            tokio::task::block_in_place(|| cli(&["broadcast", "--all", "--command", "reload"]));
        (ok && out.contains("2 delivered")).then_some(out)
    })
    .await;
    assert!(
        broadcast.contains("ocr-agent") && broadcast.contains("nlp-agent"),
        "{broadcast}"
    );

    drop(raw);
    within(WAIT, "nlp-agent shutdown", nlp.shutdown()).await;
    within(WAIT, "ocr-agent shutdown", ocr.shutdown()).await;
    drop(procs);
    drop(server);
}
