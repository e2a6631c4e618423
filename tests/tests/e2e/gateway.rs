//! The edge gateway, driven with `curl` as an edge caller would: discover, send, poll with a
//! long wait, reply, request-reply and Agentify's `/agent/message`, each with a valid API key
//! or JWT (HS256 and EdDSA); missing, unknown, invalid and expired credentials refused before
//! anything reaches an agent.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use chorus_gateway::GatewayConfig;
use chorus_gateway::config::{ApiKey, EdgeIdentity, JwtConfig};
use chorus_sdk::{Call, DeliveryClass, HandlerError};
use chorus_tests::{WAIT, agent, eventually, server, within};
use futures::StreamExt;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};
use sha2::Digest;

const API_KEY: &str = "k-web-ui-3f9a1c7e5b2d4a6f8e0c1b3d5f7a9c2e";
const SECRET: &str = "a-shared-hs256-secret-of-at-least-32-bytes";
const ISSUER: &str = "https://auth.example.test";
const AUDIENCE: &str = "chorus-gateway";

/// What a `curl` call returned: the HTTP status, the body as JSON (null if it is not) and
/// the response headers.
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) body: Value,
    pub(crate) headers: String,
}

/// Runs `curl` against the gateway: `method` on `path`, with `auth` as extra header
/// arguments and `body` as a JSON body.
/// An Agentify refusal's type, intent, code and recipients.
fn agentify_refusal(body: &Value) -> (&str, &str, u64, Value) {
    (
        body["type"].as_str().unwrap_or_default(),
        body["intent"].as_str().unwrap_or_default(),
        body["payload"]["code"].as_u64().unwrap_or_default(),
        body["to"].clone(),
    )
}

pub(crate) async fn curl(
    addr: SocketAddr,
    method: &str,
    path: &str,
    auth: &[&str],
    body: Option<&Value>,
) -> Answer {
    let mut args = Vec::new();
    for header in auth {
        args.extend(["-H".to_owned(), (*header).to_owned()]);
    }
    if let Some(body) = body {
        args.extend([
            "-H".to_owned(),
            "content-type: application/json".to_owned(),
            "--data-binary".to_owned(),
            body.to_string(),
        ]);
    }
    let (status, headers, body) = chorus_tests::curl(addr, method, path, &args, 25).await;
    Answer {
        status,
        body: serde_json::from_str(&body).unwrap_or(Value::Null),
        headers: headers.to_ascii_lowercase(),
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

fn hs256(sub: &str, exp: u64, secret: &str, audience: &str) -> String {
    let claims = json!({"sub": sub, "iss": ISSUER, "aud": audience, "exp": exp, "iat": now()});
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()),
    )
    .expect("sign HS256")
}

fn eddsa(sub: &str, exp: u64, private_pem: &str) -> String {
    let claims = json!({"sub": sub, "iss": ISSUER, "aud": AUDIENCE, "exp": exp});
    jsonwebtoken::encode(
        &Header::new(Algorithm::EdDSA),
        &claims,
        &EncodingKey::from_ed_pem(private_pem.as_bytes()).expect("Ed25519 PEM"),
    )
    .expect("sign EdDSA")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_callers_reach_the_bus_through_the_gateway_with_valid_credentials_only() {
    let server = server();
    let dir = tempfile::tempdir().expect("temp dir");
    let secret_file = dir.path().join("hs256.secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).expect("write secret");
    let ed = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("Ed25519 key");
    let public_file = dir.path().join("eddsa.pub.pem");
    std::fs::write(&public_file, ed.public_key_pem()).expect("write public key");
    let private_pem = ed.serialize_pem();

    let (coordinator, gw) = with_gateway(
        &server,
        GatewayConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            identities: vec![
                EdgeIdentity {
                    id: "web-ui".into(),
                    nkey_seed_file: None,
                    tenant: None,
                },
                EdgeIdentity {
                    id: "ops".into(),
                    nkey_seed_file: None,
                    tenant: None,
                },
            ],
            api_keys: vec![ApiKey {
                identity: "web-ui".into(),
                sha256: hex::encode(sha2::Sha256::digest(API_KEY.as_bytes())),
                scopes: Vec::new(),
            }],
            jwt: Some(JwtConfig {
                issuer: ISSUER.into(),
                audience: AUDIENCE.into(),
                hs256_secret_file: Some(secret_file),
                eddsa_public_key_file: Some(public_file),
                jwks_file: None,
                leeway_secs: 5,
                ..JwtConfig::default()
            }),
            ..GatewayConfig::default()
        },
    )
    .await;

    // A Rust agent on the bus: a calculator that counts what reaches it.
    let handled = Arc::new(AtomicU64::new(0));
    let calculator = within(
        WAIT,
        "calculator",
        chorus_tests::agent_options(&server, "calculator")
            .heartbeat_interval(Duration::from_millis(200))
            .capability("math.add")
            .durable_inbox(true)
            .connect(),
    )
    .await
    .expect("calculator connects");
    let h = Arc::clone(&handled);
    calculator
        .on_command("add", move |ctx: chorus_sdk::Context, v: Value| {
            let h = Arc::clone(&h);
            async move {
                h.fetch_add(1, Ordering::SeqCst);
                let (a, b) = (v["a"].as_i64(), v["b"].as_i64());
                match (a, b) {
                    (Some(a), Some(b)) => Ok(json!({"sum": a + b, "asked_by": ctx.from()})),
                    _ => Err(HandlerError::invalid_argument("a and b are integers")),
                }
            }
        })
        .await
        .expect("add");

    let key = format!("X-API-Key: {API_KEY}");
    let jwt = format!(
        "Authorization: Bearer {}",
        hs256("web-ui", now() + 300, SECRET, AUDIENCE)
    );
    let ed_jwt = format!(
        "Authorization: Bearer {}",
        eddsa("ops", now() + 300, &private_pem)
    );

    // Discover, with the API key: the calculator once it has registered with its command (its
    // first heartbeat, sent as it connects, has none).
    let found = eventually(
        WAIT,
        "calculator discovered through the gateway",
        || async {
            let a = curl(gw, "GET", "/v1/agents?capability=math.add", &[&key], None).await;
            assert_eq!(a.status, 200, "{}", a.body);
            let ids: Vec<String> = a.body["agents"]
                .as_array()
                .map(|v| {
                    v.iter()
                        .filter_map(|x| x["id"].as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            (ids.contains(&"calculator".to_owned())
                && a.body["agents"][0]["commands"] == json!(["add"]))
            .then_some(a.body)
        },
    )
    .await;
    assert_eq!(found["agents"][0]["commands"], json!(["add"]), "{found}");

    // Request-reply with an HS256 JWT: the reply comes from the calculator, asked by web-ui.
    let a = curl(
        gw,
        "POST",
        "/v1/requests",
        &[&jwt],
        Some(&json!({"to": "calculator", "command": "add", "payload": {"a": 2, "b": 3}})),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        a.body["payload"],
        json!({"sum": 5, "asked_by": "web-ui"}),
        "{}",
        a.body
    );
    assert_eq!(
        (a.body["status"].as_u64(), a.body["from"].as_str()),
        (Some(5002), Some("calculator"))
    );
    // A handler's refusal keeps its code, with the HTTP status that says the same.
    let a = curl(
        gw,
        "POST",
        "/v1/requests",
        &[&jwt],
        Some(&json!({"to": "calculator", "command": "add", "payload": {"a": "x"}})),
    )
    .await;
    assert_eq!(
        (a.status, a.body["status"].as_u64()),
        (400, Some(5018)),
        "{}",
        a.body
    );
    let a = curl(
        gw,
        "POST",
        "/v1/requests",
        &[&jwt],
        Some(&json!({"to": "nobody", "command": "add"})),
    )
    .await;
    assert_eq!(
        (a.status, a.body["status"].as_u64()),
        (404, Some(5012)),
        "{}",
        a.body
    );

    // Agentify's endpoint, with an EdDSA JWT for ops.
    let a = curl(
        gw,
        "POST",
        "/agent/message",
        &[&ed_jwt],
        Some(&json!({"type": "request", "sender": "agent.ops", "to": ["agent.calculator.add"], "intent": "calculate", "payload": {"a": 5, "b": 3}})),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["payload"]["sum"], json!(8), "{}", a.body);
    assert_eq!(
        (a.body["type"].as_str(), a.body["sender"].as_str()),
        (Some("inform"), Some("agent.calculator"))
    );
    // Its refusals are Agentify messages too: a `failure` with the Chorus code and label, a
    // `refuse` when access is denied, with the HTTP status of every route.
    let a = curl(
        gw,
        "POST",
        "/agent/message",
        &[&ed_jwt],
        Some(&json!({"id": "msg-1", "type": "request", "to": ["agent.nobody.add"], "intent": "calculate", "payload": {}})),
    )
    .await;
    assert_eq!(a.status, 404, "{}", a.body);
    assert_eq!(
        agentify_refusal(&a.body),
        ("failure", "no_responders", 5012, json!(["agent.ops"])),
        "{}",
        a.body
    );
    assert_eq!(a.body["correlation"]["reply_to"], "msg-1", "{}", a.body);
    let a = curl(
        gw,
        "POST",
        "/agent/message",
        &[],
        Some(&json!({"type": "request", "sender": "agent.ops", "to": ["agent.calculator.add"], "intent": "calculate", "payload": {}})),
    )
    .await;
    assert_eq!(a.status, 401, "{}", a.body);
    assert_eq!(
        agentify_refusal(&a.body),
        ("refuse", "permission_denied", 5014, json!(["agent.ops"])),
        "{}",
        a.body
    );

    // An agent that requires a token gets the caller's JWT in the envelope and checks it
    // itself (here: signed by the identity provider, for the identity the message is from);
    // a caller with an API key has no token to relay, and is refused by the agent with 5014.
    let vault = within(
        WAIT,
        "vault",
        chorus_tests::agent_options(&server, "vault")
            .require_token(|token, env| {
                let mut v = jsonwebtoken::Validation::new(Algorithm::HS256);
                v.set_issuer(&[ISSUER]);
                v.set_audience(&[AUDIENCE]);
                let claims = jsonwebtoken::decode::<Value>(
                    token,
                    &jsonwebtoken::DecodingKey::from_secret(SECRET.as_bytes()),
                    &v,
                )
                .map_err(|e| e.to_string())?
                .claims;
                (claims["sub"] == json!(env.from))
                    .then_some(())
                    .ok_or_else(|| "the token is for someone else".into())
            })
            .connect(),
    )
    .await
    .expect("vault connects");
    vault
        .on_command("open", |ctx: chorus_sdk::Context, (): ()| async move {
            Ok::<_, HandlerError>(format!("opened for {}", ctx.from()))
        })
        .await
        .expect("open");
    let open = json!({"to": "vault", "command": "open"});
    let a = curl(gw, "POST", "/v1/requests", &[&jwt], Some(&open)).await;
    assert_eq!(
        (a.status, &a.body["payload"]),
        (200, &json!("opened for web-ui")),
        "{}",
        a.body
    );
    let a = curl(gw, "POST", "/v1/requests", &[&key], Some(&open)).await;
    assert_eq!(
        (a.status, a.body["status"].as_u64()),
        (401, Some(5014)),
        "{}",
        a.body
    );
    assert!(
        a.body["reason"]
            .as_str()
            .is_some_and(|r| r.contains("requires a token")),
        "{}",
        a.body
    );

    // An event from the edge reaches a subscriber on the bus, from web-ui.
    let listener = agent(&server, "listener").await;
    let mut events = listener.subscribe("orders.>").await.expect("subscribe");
    let a = curl(
        gw,
        "POST",
        "/v1/messages",
        &[&key],
        Some(&json!({"topic": "orders.created", "payload": {"order": 42}})),
    )
    .await;
    assert_eq!(
        (a.status, a.body["kind"].as_str()),
        (202, Some("event")),
        "{}",
        a.body
    );
    let event = within(WAIT, "the edge's event", events.next())
        .await
        .expect("an event");
    assert_eq!(event.envelope.from, "web-ui");
    assert_eq!(
        event.payload_as::<Value>().expect("payload"),
        json!({"order": 42})
    );

    // A durable command from the edge is stored, then handled by the calculator.
    let before = handled.load(Ordering::SeqCst);
    let a = curl(gw, "POST", "/v1/messages", &[&key], Some(&json!({"to": "calculator", "command": "add", "payload": {"a": 1, "b": 1}, "delivery": "at_least_once"}))).await;
    assert_eq!(a.status, 202, "{}", a.body);
    assert_eq!(a.body["delivery"], json!("at_least_once"));
    assert!(a.body["stream_seq"].as_u64().is_some(), "{}", a.body);
    eventually(WAIT, "the durable command handled", || async {
        (handled.load(Ordering::SeqCst) > before).then_some(())
    })
    .await;

    // Poll: an empty inbox waits out wait_ms and returns nothing...
    let started = Instant::now();
    let a = curl(gw, "GET", "/v1/messages?wait_ms=300", &[&key], None).await;
    assert_eq!(
        (a.status, a.body["messages"].as_array().map(Vec::len)),
        (200, Some(0)),
        "{}",
        a.body
    );
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    // ...a long poll returns as soon as a command to web-ui arrives...
    let long_poll = tokio::spawn(async move {
        let started = Instant::now();
        let a = curl(
            gw,
            "GET",
            "/v1/messages?recipient=web-ui&wait_ms=20000",
            &[&format!("X-API-Key: {API_KEY}")],
            None,
        )
        .await;
        (a.status, a.body, started.elapsed())
    });
    let sender = agent(&server, "planner").await;
    sender
        .send(
            Call::agent("web-ui", "notify")
                .json_payload(&json!({"text": "hello"}))
                .expect("payload")
                .delivery(DeliveryClass::AtLeastOnce),
        )
        .await
        .expect("durable command to the edge identity");
    let (status, body, took) = within(WAIT, "long poll", long_poll)
        .await
        .expect("poll task");
    assert_eq!(status, 200, "{body}");
    let message = &body["messages"][0];
    assert_eq!(
        (message["from"].as_str(), message["command"].as_str()),
        (Some("planner"), Some("notify")),
        "{body}"
    );
    assert_eq!(
        (
            message["delivery"].as_str(),
            message["reply_expected"].as_bool()
        ),
        (Some("at_least_once"), Some(false))
    );
    assert_eq!(message["payload"], json!({"text": "hello"}));
    assert!(
        took < Duration::from_secs(15),
        "the long poll returned after {took:?}"
    );
    // ...and a request to web-ui is polled, answered over HTTP, and the answer reaches the caller.
    let ask = {
        let sender = sender.clone();
        tokio::spawn(async move {
            sender
                .call(
                    Call::agent("web-ui", "approve")
                        .json_payload(&json!({"amount": 10}))
                        .expect("payload")
                        .timeout(Duration::from_secs(15)),
                )
                .await
        })
    };
    let polled = eventually(WAIT, "the request polled", || async {
        let a = curl(gw, "GET", "/v1/messages?wait_ms=1000", &[&key], None).await;
        a.body["messages"]
            .as_array()
            .and_then(|m| m.first().cloned())
    })
    .await;
    assert_eq!(
        (
            polled["command"].as_str(),
            polled["reply_expected"].as_bool()
        ),
        (Some("approve"), Some(true)),
        "{polled}"
    );
    let a = curl(
        gw,
        "POST",
        "/v1/replies",
        &[&key],
        Some(&json!({"in_reply_to": polled["id"], "payload": {"approved": true}})),
    )
    .await;
    assert_eq!(a.status, 202, "{}", a.body);
    let reply = within(WAIT, "the edge's reply", ask)
        .await
        .expect("ask task")
        .expect("the reply");
    assert_eq!(
        reply.payload_as::<Value>().expect("payload"),
        json!({"approved": true})
    );
    assert_eq!(reply.envelope.from, "web-ui");
    // ops may not poll web-ui's inbox.
    let a = curl(gw, "GET", "/v1/messages?recipient=web-ui", &[&ed_jwt], None).await;
    assert_eq!(
        (a.status, a.body["status"].as_u64()),
        (403, Some(5007)),
        "{}",
        a.body
    );

    // Refused: no credentials, an unknown key, an expired token, a token signed with another
    // secret, for another audience, for an identity the gateway does not serve. None of them
    // reaches the calculator.
    let before = handled.load(Ordering::SeqCst);
    let add = json!({"to": "calculator", "command": "add", "payload": {"a": 1, "b": 2}});
    let refused = [
        (String::new(), 5014u64, "no credentials"),
        ("X-API-Key: not-a-key".to_owned(), 5014, "API key"),
        (
            "Authorization: Bearer not-a-key".to_owned(),
            5014,
            "API key",
        ),
        (
            format!(
                "Authorization: Bearer {}",
                hs256("web-ui", now() - 600, SECRET, AUDIENCE)
            ),
            5014,
            "expired",
        ),
        (
            format!(
                "Authorization: Bearer {}",
                hs256(
                    "web-ui",
                    now() + 300,
                    "another-secret-that-is-long-enough-too",
                    AUDIENCE
                )
            ),
            5014,
            "not valid",
        ),
        (
            format!(
                "Authorization: Bearer {}",
                hs256("web-ui", now() + 300, SECRET, "someone-else")
            ),
            5014,
            "not valid",
        ),
        (
            format!(
                "Authorization: Bearer {}",
                hs256("mallory", now() + 300, SECRET, AUDIENCE)
            ),
            5004,
            "not an identity",
        ),
    ];
    for (header, code, why) in &refused {
        let auth: Vec<&str> = if header.is_empty() {
            vec![]
        } else {
            vec![header.as_str()]
        };
        let a = curl(gw, "POST", "/v1/requests", &auth, Some(&add)).await;
        assert_eq!(
            (a.status, a.body["status"].as_u64()),
            (401, Some(*code)),
            "{header}: {}",
            a.body
        );
        assert!(
            a.body["reason"].as_str().is_some_and(|r| r.contains(why)),
            "{header}: {}",
            a.body
        );
        assert!(
            a.headers.contains("www-authenticate: bearer"),
            "{}",
            a.headers
        );
    }
    assert_eq!(
        handled.load(Ordering::SeqCst),
        before,
        "a refused call reached the agent"
    );

    // Malformed input is answered in the same shape.
    let a = curl(
        gw,
        "POST",
        "/v1/requests",
        &[&key],
        Some(&json!({"to": "calculator"})),
    )
    .await;
    assert_eq!(
        (a.status, a.body["status"].as_u64()),
        (400, Some(5018)),
        "{}",
        a.body
    );
    let a = curl(
        gw,
        "POST",
        "/v1/messages",
        &[&key],
        Some(&json!({"to": "calculator", "command": "add", "delivery": "twice"})),
    )
    .await;
    assert_eq!(
        (a.status, a.body["status"].as_u64()),
        (400, Some(5018)),
        "{}",
        a.body
    );
    let a = curl(gw, "GET", "/openapi.json", &[], None).await;
    assert_eq!((a.status, a.body["openapi"].as_str()), (200, Some("3.1.0")));

    calculator.shutdown().await;
    vault.shutdown().await;
    listener.shutdown().await;
    sender.shutdown().await;
    assert!(within(WAIT, "coordinator shutdown", coordinator.shutdown()).await);
}

/// Runs `code` with `python`, within a minute; its standard output, once it has succeeded.
async fn run_python(python: &std::ffi::OsStr, code: String, what: &'static str) -> String {
    let mut cmd = std::process::Command::new(python);
    cmd.args(["-c", &code]);
    succeeds(cmd, Duration::from_secs(60), what).await
}

/// Runs `cmd` within `limit`; its standard output, once it has succeeded (`what` names it
/// otherwise).
async fn succeeds(mut cmd: std::process::Command, limit: Duration, what: &str) -> String {
    let out = within(
        limit,
        "a documented command",
        tokio::task::spawn_blocking(move || cmd.output()),
    )
    .await
    .expect("command task")
    .expect("the command runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what}: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The commands of docs/INTEROP.md's "Try it", as a user runs them: `deploy/gateway.toml`
/// opened beside the demo's agents, then each line of the second block in a shell (its
/// address and `chorus` pointed at this test's gateway, binary and server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_interop_try_it_runs_as_written() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let server = server();
    let mut config =
        chorus_coordinator::CoordinatorConfig::load(Some(&repo.join("deploy/gateway.toml")))
            .expect("deploy/gateway.toml loads");
    config.servers = server.url().to_owned();
    config.metrics_addr = SocketAddr::from(([127, 0, 0, 1], 0));
    config.reap_interval_ms = 50;
    config.gateway.listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let coordinator = within(
        WAIT,
        "coordinator start",
        chorus_coordinator::Coordinator::start(config, false),
    )
    .await
    .expect("coordinator with the documented gateway");
    let gw = coordinator.gateway_addr().expect("the gateway listens");
    let quiet: fn(&str) = |_| {};
    let demo = within(
        WAIT,
        "demo start",
        chorus_demo::Demo::start(server.url(), quiet),
    )
    .await
    .expect("demo agents");
    eventually(WAIT, "the demo's ocr agent registered", || async {
        (!coordinator
            .discover(&chorus_sdk::DiscoverQuery::capability("ocr"))
            .is_empty())
        .then_some(())
    })
    .await;

    let doc = std::fs::read_to_string(repo.join("docs/INTEROP.md")).expect("docs/INTEROP.md");
    let try_it = doc.split("## Try it").nth(1).expect("a Try it section");
    let block = try_it
        .split("```sh\n")
        .nth(2)
        .and_then(|b| b.split("```").next())
        .expect("the second sh block of Try it");
    let chorus = chorus_tests::chorus_binary();
    let mut outputs = Vec::new();
    for line in block
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let line = line.replace("127.0.0.1:8480", &gw.to_string());
        let line = match line.strip_prefix("chorus ") {
            Some(rest) => format!("{} {rest}", chorus.display()),
            None => line,
        };
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", &line]).env("CHORUS_NATS_URL", server.url());
        outputs.push(succeeds(cmd, Duration::from_secs(30), &line).await);
    }
    assert_eq!(outputs.len(), 6, "the block has six commands");
    let json = |i: usize| -> Value {
        serde_json::from_str(&outputs[i]).unwrap_or_else(|e| panic!("{}: {e}", outputs[i]))
    };
    assert_eq!(
        json(0)["agents"][0]["id"],
        json!("ocr-agent"),
        "{}",
        outputs[0]
    );
    assert_eq!(
        (json(1)["payload"].as_f64(), json(1)["from"].as_str()),
        (Some(5.0), Some("calculator")),
        "{}",
        outputs[1]
    );
    assert_eq!(json(2)["kind"], json!("event"));
    assert!(json(3)["stream_seq"].as_u64().is_some(), "{}", outputs[3]);
    let polled = json(5);
    assert_eq!(
        polled["messages"][0]["payload"],
        json!({"text": "hello from the bus"}),
        "{polled}"
    );
    assert_eq!(polled["messages"][0]["command"], json!("notify"));

    // The Python examples (the official A2A, SAP and MCP clients), with the interpreter
    // scripts/test set up.
    match std::env::var_os("CHORUS_TEST_PYTHON") {
        Some(python) => {
            let example = |n: usize| {
                doc.split("```python\n")
                    .nth(n)
                    .and_then(|b| b.split("```").next())
                    .unwrap_or_else(|| panic!("python example {n}"))
                    .replace("127.0.0.1:8480", &gw.to_string())
                    .replace("nats://127.0.0.1:4222", server.url())
            };
            let stdout = run_python(&python, example(1), "the A2A example").await;
            assert!(
                stdout.starts_with("TASK_STATE_COMPLETED") && stdout.contains("'summary'"),
                "{stdout}"
            );
            // The SAP example (synadia-ai-agents, Python 3.11 or newer), on NATS itself.
            let stdout = run_python(&python, example(2), "the SAP example").await;
            assert_eq!(
                stdout.trim(),
                "messages on the wire / each token finds its listener / the stream never gaps"
            );
            // The MCP example: the tools listed, divide by zero a tool error with its code.
            let stdout = run_python(&python, example(3), "the MCP example").await;
            let lines: Vec<&str> = stdout.lines().collect();
            assert!(
                lines.len() == 2
                    && ["'calculator.calculation'", "'ocr'", "'writer.draft'"]
                        .iter()
                        .all(|t| lines[0].contains(t)),
                "{stdout}"
            );
            assert_eq!(lines[1], "True 5018 invalid_argument: division by zero");
        }
        None => eprintln!(
            "CHORUS_TEST_PYTHON is not set (scripts/test sets it): the Python examples were not run"
        ),
    }

    demo.shutdown().await;
    assert!(within(WAIT, "coordinator shutdown", coordinator.shutdown()).await);
}

/// Tasks at the edge with `curl`: submit one that reports progress and streams chunks and
/// read its server-sent events to the end; cancel another; a task of another identity is
/// not there for this one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_callers_submit_follow_and_cancel_tasks() {
    let server = server();
    let (coordinator, gw) = with_gateway(
        &server,
        GatewayConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            identities: vec![
                EdgeIdentity {
                    id: "web-ui".into(),
                    nkey_seed_file: None,
                    tenant: None,
                },
                EdgeIdentity {
                    id: "ops".into(),
                    nkey_seed_file: None,
                    tenant: None,
                },
            ],
            api_keys: vec![
                ApiKey {
                    identity: "web-ui".into(),
                    sha256: hex::encode(sha2::Sha256::digest(API_KEY.as_bytes())),
                    scopes: Vec::new(),
                },
                ApiKey {
                    identity: "ops".into(),
                    sha256: hex::encode(sha2::Sha256::digest(b"ops-key-1f2e3d4c5b6a7980")),
                    scopes: Vec::new(),
                },
            ],
            ..GatewayConfig::default()
        },
    )
    .await;
    let writer = agent(&server, "writer").await;
    writer
        .on_task(
            "draft",
            |task: chorus_sdk::TaskContext, topic: String| async move {
                task.progress(Some(0.5), "outlined").await?;
                task.chunk(&format!("{topic}: part 1")).await?;
                task.last_chunk(&format!("{topic}: part 2")).await?;
                Ok::<_, HandlerError>(json!({"words": 4}))
            },
        )
        .await
        .expect("draft");
    writer
        .on_task("wait", |task: chorus_sdk::TaskContext, (): ()| async move {
            task.cancelled().await;
            Err::<(), _>(HandlerError::new(
                chorus_sdk::StatusCode::CANCELLED,
                "stopped",
            ))
        })
        .await
        .expect("wait");
    let key = format!("X-API-Key: {API_KEY}");

    let a = curl(
        gw,
        "POST",
        "/v1/tasks",
        &[&key],
        Some(&json!({"to": "writer", "command": "draft", "payload": "gateways"})),
    )
    .await;
    assert_eq!(a.status, 202, "{}", a.body);
    let id = a.body["id"].as_str().expect("a task id").to_owned();
    // The events, from the submission to the end: curl returns when the stream ends.
    let mut cmd = std::process::Command::new("curl");
    cmd.args([
        "-s",
        "-N",
        "--max-time",
        "20",
        "-H",
        &key,
        &format!("http://{gw}/v1/tasks/{id}/events"),
    ]);
    let out = within(
        Duration::from_secs(25),
        "the event stream",
        tokio::task::spawn_blocking(move || cmd.output()),
    )
    .await
    .expect("curl task")
    .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let events: Vec<(String, Value)> = text
        .split("\n\n")
        .filter_map(|block| {
            let kind = block.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = block.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((kind.to_owned(), serde_json::from_str(data).ok()?))
        })
        .collect();
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert!(
        kinds.contains(&"progress") && kinds.contains(&"chunk"),
        "{text}"
    );
    let progress = events
        .iter()
        .find(|(k, _)| k == "progress")
        .map(|(_, v)| v)
        .expect("progress");
    assert_eq!(
        (progress["fraction"].as_f64(), progress["text"].as_str()),
        (Some(0.5), Some("outlined")),
        "{progress}"
    );
    let chunks: Vec<&Value> = events
        .iter()
        .filter(|(k, _)| k == "chunk")
        .map(|(_, v)| &v["payload"])
        .collect();
    assert_eq!(
        chunks,
        [&json!("gateways: part 1"), &json!("gateways: part 2")],
        "{text}"
    );
    let last = &events.last().expect("events").1;
    assert_eq!(
        last["state"],
        json!("completed"),
        "the stream ends with the terminal state: {text}"
    );
    let a = curl(gw, "GET", &format!("/v1/tasks/{id}"), &[&key], None).await;
    assert_eq!(
        (a.status, &a.body["state"], &a.body["output"]),
        (200, &json!("completed"), &json!({"words": 4})),
        "{}",
        a.body
    );
    // Another identity does not see it.
    let a = curl(
        gw,
        "GET",
        &format!("/v1/tasks/{id}"),
        &["X-API-Key: ops-key-1f2e3d4c5b6a7980"],
        None,
    )
    .await;
    assert_eq!(a.status, 404, "{}", a.body);
    let a = curl(gw, "GET", "/v1/tasks/not-a-uuid", &[&key], None).await;
    assert_eq!(a.status, 404, "{}", a.body);

    // Cancel a task that runs until cancelled.
    let a = curl(
        gw,
        "POST",
        "/v1/tasks",
        &[&key],
        Some(&json!({"to": "writer", "command": "wait"})),
    )
    .await;
    assert_eq!(a.status, 202, "{}", a.body);
    let id = a.body["id"].as_str().expect("a task id").to_owned();
    eventually(WAIT, "the task working", || async {
        let a = curl(gw, "GET", &format!("/v1/tasks/{id}"), &[&key], None).await;
        (a.body["state"] == json!("working")).then_some(())
    })
    .await;
    let a = curl(gw, "POST", &format!("/v1/tasks/{id}/cancel"), &[&key], None).await;
    assert_eq!(
        (a.status, &a.body["state"]),
        (200, &json!("cancelled")),
        "{}",
        a.body
    );

    writer.shutdown().await;
    assert!(within(WAIT, "coordinator shutdown", coordinator.shutdown()).await);
}

/// What a receiving agent grants applies to edge callers as to any sender: an identity that
/// signs with its own key (`nkey_seed_file`) and is granted the permission is served; another
/// one is refused with 5007 (403). And the gateway's own rate per identity holds (429, 5013).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_and_the_gateways_rate_apply_to_edge_callers() {
    use chorus_sdk::security::{Identity, SignaturePolicy};
    let server = server();
    let dir = tempfile::tempdir().expect("temp dir");
    let signer = Identity::generate();
    let seed_file = dir.path().join("teller.nk");
    std::fs::write(&seed_file, signer.seed().expect("seed")).expect("write seed");
    let key = |k: &str| ApiKey {
        identity: k.into(),
        sha256: hex::encode(sha2::Sha256::digest(
            format!("{k}-key-0123456789").as_bytes(),
        )),
        scopes: Vec::new(),
    };
    let (coordinator, gw) = with_gateway(
        &server,
        GatewayConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            identities: vec![
                EdgeIdentity {
                    id: "teller".into(),
                    nkey_seed_file: Some(seed_file),
                    tenant: None,
                },
                EdgeIdentity {
                    id: "visitor".into(),
                    nkey_seed_file: None,
                    tenant: None,
                },
            ],
            api_keys: vec![key("teller"), key("visitor")],
            // Slow enough to refill that a busy machine does not blur the burst.
            rate_per_second: 0.1,
            rate_burst: 4.0,
            ..GatewayConfig::default()
        },
    )
    .await;
    let vault = within(
        WAIT,
        "vault",
        chorus_tests::agent_options(&server, "vault")
            .verify_signatures(SignaturePolicy::default())
            .trust("teller", signer.public_key())
            .connect(),
    )
    .await
    .expect("vault connects");
    vault
        .on_command("open", |ctx: chorus_sdk::Context, (): ()| async move {
            Ok::<_, HandlerError>(format!("opened for {}", ctx.from()))
        })
        .await
        .expect("open");
    vault.require("open", &["vault.open"]).expect("require");
    vault.grant("teller", &["vault.open"]);
    vault.grant("visitor", &["vault.open"]);

    let open = json!({"to": "vault", "command": "open"});
    let a = curl(
        gw,
        "POST",
        "/v1/requests",
        &["X-API-Key: teller-key-0123456789"],
        Some(&open),
    )
    .await;
    assert_eq!(
        (a.status, &a.body["payload"]),
        (200, &json!("opened for teller")),
        "{}",
        a.body
    );
    // Granted too, but unsigned: its `from` is not proven, so the grant does not apply.
    let a = curl(
        gw,
        "POST",
        "/v1/requests",
        &["X-API-Key: visitor-key-0123456789"],
        Some(&open),
    )
    .await;
    assert_eq!(
        (a.status, a.body["status"].as_u64()),
        (403, Some(5007)),
        "{}",
        a.body
    );
    // The rate: visitor has used 1 of its burst of 4; the 4th after it is refused.
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(
            curl(
                gw,
                "GET",
                "/v1/agents",
                &["X-API-Key: visitor-key-0123456789"],
                None,
            )
            .await
            .status,
        );
    }
    assert_eq!(
        statuses,
        [200, 200, 200, 429],
        "a burst of 4 at 0.1 a second"
    );
    let a = curl(
        gw,
        "GET",
        "/v1/agents",
        &["X-API-Key: visitor-key-0123456789"],
        None,
    )
    .await;
    assert_eq!(a.body["status"].as_u64(), Some(5013), "{}", a.body);
    // Each identity has its own rate.
    let a = curl(
        gw,
        "GET",
        "/v1/agents",
        &["X-API-Key: teller-key-0123456789"],
        None,
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);

    vault.shutdown().await;
    assert!(within(WAIT, "coordinator shutdown", coordinator.shutdown()).await);
}

/// The SAP binding on a secured bus, every user confined by `chorus creds` entries: the edge
/// identity's entry with `--sap` lets it register the `agents` service, heartbeat and stream a
/// prompt's answer (many replies to one request); an SAP client (a plain NATS user allowed only
/// the `agents` and `$SRV` subjects and its inbox) discovers it and gets the streamed reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sap_binding_works_under_generated_credentials() {
    use chorus_broker_adapter::{BrokerOptions, Credentials};
    use chorus_coordinator::creds::{Role, authorization_entry, coordinator_entry};
    use chorus_gateway::config::SapBinding;
    use chorus_sdk::TaskContext;
    use chorus_sdk::security::Identity;

    let subjects = chorus_sdk::Subjects::default();
    let (coordinator_key, edge_key, writer_key, client_key) = (
        Identity::generate(),
        Identity::generate(),
        Identity::generate(),
        Identity::generate(),
    );
    let entry = |role: Role, key: &Identity| {
        authorization_entry(&subjects, &role, &key.public_key()).expect("entry")
    };
    let users = [
        coordinator_entry(&subjects, &coordinator_key.public_key()),
        entry(
            Role {
                agent: "web-ui".into(),
                durable: true,
                tasks: true,
                sap: vec!["drafter.chorus.default".into()],
                ..Role::default()
            },
            &edge_key,
        ),
        entry(
            Role {
                agent: "writer".into(),
                tasks: true,
                ..Role::default()
            },
            &writer_key,
        ),
        // An SAP client: no Chorus role, only what the protocol's client does.
        format!(
            "{{ nkey: \"{}\", permissions: {{ publish: {{ allow: [\"agents.prompt.>\", \"agents.status.>\", \"$SRV.>\"] }}, subscribe: {{ allow: [\"_INBOX.>\", \"agents.hb.>\"] }} }} }}",
            client_key.public_key()
        ),
    ]
    .join("\n");
    let dir = tempfile::tempdir().expect("tempdir");
    let server = chorus_tests::server_with_users(dir.path(), &users);
    let seed_file = |name: &str, key: &Identity| {
        let path = dir.path().join(format!("{name}.nk"));
        std::fs::write(&path, key.seed().expect("seed")).expect("seed file");
        path
    };
    let mut config = chorus_coordinator::CoordinatorConfig {
        servers: server.url().to_owned(),
        metrics_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        gateway: GatewayConfig {
            identities: vec![EdgeIdentity {
                id: "web-ui".into(),
                nkey_seed_file: Some(seed_file("web-ui", &edge_key)),
                tenant: None,
            }],
            sap: vec![SapBinding {
                agent: "drafter".into(),
                owner: "chorus".into(),
                session: "default".into(),
                identity: "web-ui".into(),
                to: Some("writer".into()),
                command: Some("draft".into()),
                capability: None,
                description: None,
                heartbeat_interval_s: 1,
                max_prompt_ms: 60_000,
            }],
            ..GatewayConfig::default()
        },
        ..chorus_coordinator::CoordinatorConfig::default()
    };
    config.security.nkey_seed_file = Some(seed_file("coordinator", &coordinator_key));
    let coordinator = within(
        WAIT,
        "coordinator start",
        chorus_coordinator::Coordinator::start(config, false),
    )
    .await
    .expect("the coordinator and its SAP agent start under their credentials");
    assert_eq!(coordinator.gateway_addr(), None, "SAP only: no HTTP");
    let writer = within(
        WAIT,
        "writer connect",
        chorus_tests::agent_options(&server, "writer")
            .broker(
                BrokerOptions::new([server.url()])
                    .credentials(Credentials::NKeySeed(writer_key.seed().expect("seed"))),
            )
            .connect(),
    )
    .await
    .expect("writer connects");
    writer
        .on_task("draft", |task: TaskContext, topic: String| async move {
            task.chunk(&format!("about {topic}")).await?;
            task.last_chunk(&"done").await?;
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("serve draft");

    let client = within(
        WAIT,
        "SAP client connect",
        BrokerOptions::new([server.url()])
            .name("sap-client")
            .credentials(Credentials::NKeySeed(client_key.seed().expect("seed")))
            .connect(),
    )
    .await
    .expect("client connects");
    // Discovery: `$SRV.INFO.agents`, as the SAP client asks it.
    let info = within(
        WAIT,
        "$SRV.INFO.agents",
        client.request("$SRV.INFO.agents", None, bytes::Bytes::new(), WAIT),
    )
    .await
    .expect("the agents service answers");
    let info: Value = serde_json::from_slice(info.payload()).expect("JSON");
    assert_eq!(info["name"], json!("agents"));
    assert_eq!(info["metadata"]["agent"], json!("drafter"));
    assert_eq!(
        info["endpoints"][0]["subject"],
        json!("agents.prompt.drafter.chorus.default")
    );
    // A heartbeat arrives on its subject.
    let mut beats = client.subscribe("agents.hb.>").await.expect("subscribe hb");
    let beat = within(WAIT, "a heartbeat", beats.next())
        .await
        .expect("a heartbeat");
    let beat: Value = serde_json::from_slice(beat.payload()).expect("JSON");
    assert_eq!(beat["instance_id"], info["id"]);

    // A prompt: the ack, the task's chunks, then the terminator, all allowed to stream back.
    let inbox = client.new_inbox();
    // The subscription reaches the server before the prompt on the same connection, so the
    // stream cannot start before it (this user may not publish to its inbox, so no sync).
    let mut replies = client.subscribe(&inbox).await.expect("subscribe inbox");
    client
        .publish_with(
            "agents.prompt.drafter.chorus.default",
            Some(&inbox),
            None,
            bytes::Bytes::from_static(br#"{"prompt": "permissions"}"#),
        )
        .await
        .expect("prompt");
    let mut stream = Vec::new();
    loop {
        let msg = within(WAIT, "the prompt's stream", replies.next())
            .await
            .expect("a reply");
        assert!(
            msg.header("Nats-Service-Error-Code").is_none(),
            "an error: {:?}",
            msg.header("Nats-Service-Error")
        );
        if msg.payload().is_empty() {
            break;
        }
        stream.push(serde_json::from_slice::<Value>(msg.payload()).expect("a chunk"));
    }
    assert_eq!(
        stream,
        [
            json!({"type": "status", "data": "ack"}),
            json!({"type": "response", "data": "about permissions"}),
            json!({"type": "response", "data": "done"}),
        ]
    );
    writer.shutdown().await;
    assert!(within(WAIT, "coordinator shutdown", coordinator.shutdown()).await);
}

/// A JWK for `key`'s public half (ES256 on P-256, or EdDSA on Ed25519), named `kid`.
fn jwk(key: &rcgen::KeyPair, kid: &str) -> Value {
    use base64::Engine as _;
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let raw = key.public_key_raw();
    if raw.len() == 65 {
        // An uncompressed P-256 point: 0x04, x, y.
        json!({"kty": "EC", "crv": "P-256", "x": b64(&raw[1..33]), "y": b64(&raw[33..]),
               "kid": kid, "alg": "ES256", "use": "sig"})
    } else {
        json!({"kty": "OKP", "crv": "Ed25519", "x": b64(raw), "kid": kid, "use": "sig"})
    }
}

/// A token for `sub` signed by `key` (`alg`), naming `kid`, with these expiry and audience.
fn signed(alg: Algorithm, key: &rcgen::KeyPair, kid: &str, exp: u64, audience: &str) -> String {
    let claims = json!({"sub": "web-ui", "iss": ISSUER, "aud": audience, "exp": exp});
    let mut header = Header::new(alg);
    header.kid = Some(kid.to_owned());
    let pem = key.serialize_pem();
    let encoding = match alg {
        Algorithm::ES256 => EncodingKey::from_ec_pem(pem.as_bytes()),
        _ => EncodingKey::from_ed_pem(pem.as_bytes()),
    }
    .expect("private key");
    format!(
        "Authorization: Bearer {}",
        jsonwebtoken::encode(&header, &claims, &encoding).expect("sign")
    )
}

/// Issue 33, item 2 (first part): bearer JWTs checked against a JSON Web Key Set file, as an
/// OAuth 2 / OIDC provider publishes its keys: ES256 and EdDSA tokens naming their key are
/// served; an expired one, one for another audience, one signed by a key not in the set and
/// one whose `alg` is not its key's are 401 with a body that says which; the set rotated on
/// disk (a new key in, the old one out) takes effect without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_checked_against_a_rotating_key_set() {
    let server = server();
    let dir = tempfile::tempdir().expect("temp dir");
    let es = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256 key");
    let ed = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("Ed25519 key");
    let next = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256 key");
    let stranger = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256 key");
    let jwks_file = dir.path().join("jwks.json");
    let write_set = |keys: Vec<Value>| {
        // Written whole and renamed, as a key-publishing job does: never half a file.
        let tmp = dir.path().join("jwks.json.new");
        std::fs::write(&tmp, json!({ "keys": keys }).to_string()).expect("write");
        std::fs::rename(&tmp, &jwks_file).expect("rename");
    };
    write_set(vec![jwk(&es, "es-1"), jwk(&ed, "ed-1")]);
    let (coordinator, gw) = with_gateway(
        &server,
        GatewayConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            identities: vec![EdgeIdentity {
                id: "web-ui".into(),
                nkey_seed_file: None,
                tenant: None,
            }],
            jwt: Some(JwtConfig {
                issuer: ISSUER.into(),
                audience: AUDIENCE.into(),
                hs256_secret_file: None,
                eddsa_public_key_file: None,
                jwks_file: Some(jwks_file.clone()),
                leeway_secs: 5,
                ..JwtConfig::default()
            }),
            ..GatewayConfig::default()
        },
    )
    .await;
    let later = now() + 300;
    let get = |auth: String| async move { curl(gw, "GET", "/v1/agents", &[&auth], None).await };

    for token in [
        signed(Algorithm::ES256, &es, "es-1", later, AUDIENCE),
        signed(Algorithm::EdDSA, &ed, "ed-1", later, AUDIENCE),
    ] {
        let a = get(token).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let refused = |a: &Answer, says: &str| {
        assert_eq!(a.status, 401, "{}", a.body);
        assert_eq!(a.body["status"], 5014, "{}", a.body);
        let reason = a.body["reason"].as_str().unwrap_or_default();
        assert!(reason.contains(says), "{says:?} not in {reason:?}");
    };
    refused(
        &get(signed(Algorithm::ES256, &es, "es-1", now() - 600, AUDIENCE)).await,
        "expired",
    );
    refused(
        &get(signed(Algorithm::ES256, &es, "es-1", later, "someone-else")).await,
        "not valid",
    );
    refused(
        &get(signed(Algorithm::ES256, &stranger, "es-1", later, AUDIENCE)).await,
        "not valid",
    );
    refused(
        &get(signed(Algorithm::ES256, &es, "es-9", later, AUDIENCE)).await,
        "no key \"es-9\"",
    );
    // An EdDSA signature presented under the ES256 key's id.
    refused(
        &get(signed(Algorithm::EdDSA, &ed, "es-1", later, AUDIENCE)).await,
        "is not the key's",
    );

    // Rotation: the provider publishes es-2 and retires es-1.
    write_set(vec![jwk(&next, "es-2"), jwk(&ed, "ed-1")]);
    let a = get(signed(Algorithm::ES256, &next, "es-2", later, AUDIENCE)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    refused(
        &get(signed(Algorithm::ES256, &es, "es-1", later, AUDIENCE)).await,
        "no key \"es-1\"",
    );
    coordinator.shutdown().await;
}

/// Issue 33, item 9: JSON-RPC's own rules at the A2A endpoint: an `id` that is an object is an
/// invalid request (-32600, answered with a null id); a wrong-typed or missing task id, a
/// negative `historyLength`, a message without `messageId` and params that are not an object
/// are invalid params (-32602), not "no such task"; a task id that is a string but no task is
/// still -32001.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_a2a_endpoint_refuses_malformed_json_rpc_with_the_codes_the_spec_gives() {
    let server = server();
    let (coordinator, gw) = with_web_ui_gateway(&server).await;
    let key = format!("X-API-Key: {API_KEY}");
    let headers = [key.as_str(), "A2A-Version: 1.0"];
    let message = json!({"role": "ROLE_USER", "parts": [{"text": "hi"}]});
    let cases = [
        (
            json!({"jsonrpc": "2.0", "id": {"a": 1}, "method": "GetTask", "params": {"id": "x"}}),
            -32600,
        ),
        (
            json!({"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": 12345}}),
            -32602,
        ),
        (
            json!({"jsonrpc": "2.0", "id": 2, "method": "GetTask", "params": {}}),
            -32602,
        ),
        (
            json!({"jsonrpc": "2.0", "id": 3, "method": "GetTask",
                   "params": {"id": "01234567-89ab-7def-8123-456789abcdef", "historyLength": -1}}),
            -32602,
        ),
        (
            json!({"jsonrpc": "2.0", "id": 4, "method": "SendMessage", "params": {"message": message}}),
            -32602,
        ),
        (
            json!({"jsonrpc": "2.0", "id": 5, "method": "GetTask", "params": ["x"]}),
            -32602,
        ),
        (
            json!({"jsonrpc": "2.0", "id": "six", "method": "GetTask",
                   "params": {"id": "01234567-89ab-7def-8123-456789abcdef"}}),
            -32001,
        ),
    ];
    for (request, code) in cases {
        let a = curl(
            gw,
            "POST",
            "/a2a/agents/writer/draft/",
            &headers,
            Some(&request),
        )
        .await;
        assert_eq!(a.status, 200, "{request}: {}", a.body);
        assert_eq!(a.body["error"]["code"], code, "{request}: {}", a.body);
        let id = if code == -32600 {
            Value::Null
        } else {
            request["id"].clone()
        };
        assert_eq!(a.body["id"], id, "{request}: {}", a.body);
    }
    coordinator.shutdown().await;
}

/// An in-process coordinator on `server` serving `gateway` (registry sweeps every 50 ms,
/// metrics on a free port), and the address the gateway listens on.
pub(crate) async fn with_gateway(
    server: &chorus_tests::NatsServer,
    gateway: GatewayConfig,
) -> (chorus_coordinator::Coordinator, SocketAddr) {
    let config = chorus_coordinator::CoordinatorConfig {
        servers: server.url().to_owned(),
        metrics_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        reap_interval_ms: 50,
        gateway,
        ..chorus_coordinator::CoordinatorConfig::default()
    };
    let coordinator = within(
        WAIT,
        "coordinator start",
        chorus_coordinator::Coordinator::start(config, false),
    )
    .await
    .expect("coordinator with a gateway");
    let gw = coordinator.gateway_addr().expect("the gateway listens");
    (coordinator, gw)
}

/// A gateway with one edge identity, `web-ui`, reached with [`API_KEY`].
async fn with_web_ui_gateway(
    server: &chorus_tests::NatsServer,
) -> (chorus_coordinator::Coordinator, SocketAddr) {
    with_gateway(
        server,
        GatewayConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            identities: vec![EdgeIdentity {
                id: "web-ui".into(),
                nkey_seed_file: None,
                tenant: None,
            }],
            api_keys: vec![ApiKey {
                identity: "web-ui".into(),
                sha256: hex::encode(sha2::Sha256::digest(API_KEY.as_bytes())),
                scopes: Vec::new(),
            }],
            ..GatewayConfig::default()
        },
    )
    .await
}

/// A JWT for `sub` carrying `claims` besides the usual ones, signed with SECRET.
fn hs256_with(sub: &str, claims: Value) -> String {
    let mut all = json!({"sub": sub, "iss": ISSUER, "aud": AUDIENCE, "exp": now() + 300});
    if let (Some(all), Some(extra)) = (all.as_object_mut(), claims.as_object()) {
        all.extend(extra.clone());
    }
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &all,
        &EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .expect("sign HS256")
}

/// Issue 33, item 2: scopes grant route groups and targets. An API key and a JWT (`scope` or
/// `scp`) carry scopes; a caller reaches what the union of its scopes grants, and anything else
/// is 403 with a JSON body naming what was refused, before it reaches the bus; credentials with
/// no scope the gateway knows reach nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopes_grant_routes_and_agents_and_refuse_the_rest_saying_which() {
    let server = server();
    let dir = tempfile::tempdir().expect("temp dir");
    let secret_file = dir.path().join("hs256.secret");
    std::fs::write(&secret_file, SECRET).expect("write secret");
    let key = |k: &str, scopes: &[&str]| ApiKey {
        identity: "web-ui".into(),
        sha256: hex::encode(sha2::Sha256::digest(k.as_bytes())),
        scopes: scopes.iter().map(|s| (*s).to_owned()).collect(),
    };
    let scope = |name: &str, routes: &[&str], agents: &[&str], capabilities: &[&str]| {
        let owned = |l: &[&str]| l.iter().map(|s| (*s).to_owned()).collect();
        chorus_gateway::ScopeConfig {
            name: name.into(),
            routes: owned(routes),
            agents: owned(agents),
            capabilities: owned(capabilities),
        }
    };
    let (coordinator, gw) = with_gateway(
        &server,
        GatewayConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            identities: vec![EdgeIdentity {
                id: "web-ui".into(),
                nkey_seed_file: None,
                tenant: None,
            }],
            api_keys: vec![
                key("k-drafts-0123456789abcdef", &["drafts"]),
                key("k-nothing-0123456789abcdef", &[]),
            ],
            jwt: Some(JwtConfig {
                issuer: ISSUER.into(),
                audience: AUDIENCE.into(),
                hs256_secret_file: Some(secret_file),
                ..JwtConfig::default()
            }),
            scopes: vec![
                scope("drafts", &["tasks", "a2a"], &["writer"], &[]),
                scope("ask", &["requests"], &[], &["text.*"]),
            ],
            ..GatewayConfig::default()
        },
    )
    .await;
    let writer = agent(&server, "writer").await;
    writer
        .on_task(
            "draft",
            |_task: chorus_sdk::TaskContext, topic: String| async move {
                Ok::<_, HandlerError>(format!("about {topic}"))
            },
        )
        .await
        .expect("serve draft");

    let drafts = "X-API-Key: k-drafts-0123456789abcdef";
    let nothing = "X-API-Key: k-nothing-0123456789abcdef";
    let ask = format!(
        "Authorization: Bearer {}",
        hs256_with("web-ui", json!({"scope": "ask other"}))
    );
    let scp = format!(
        "Authorization: Bearer {}",
        hs256_with("web-ui", json!({"scp": ["drafts"]}))
    );
    let draft = json!({"to": "writer", "command": "draft", "payload": "scopes"});
    let refused = |a: &Answer, what: &str| {
        assert_eq!(a.status, 403, "{what}: {}", a.body);
        assert_eq!(a.body["label"], "access", "{what}: {}", a.body);
        assert!(
            a.body["reason"].as_str().is_some_and(|r| r.contains(what)),
            "{what}: {}",
            a.body
        );
    };

    // The drafts scope, from an API key or a JWT's scp: tasks for the writer, nothing else.
    for credential in [drafts, scp.as_str()] {
        let a = eventually(WAIT, "the task is taken", || async {
            let a = curl(gw, "POST", "/v1/tasks", &[credential], Some(&draft)).await;
            (a.status == 202).then_some(a)
        })
        .await;
        assert_eq!(a.body["target"], "writer.draft", "{}", a.body);
        let other = json!({"to": "reader", "command": "draft", "payload": "x"});
        refused(
            &curl(gw, "POST", "/v1/tasks", &[credential], Some(&other)).await,
            "calls to reader",
        );
        let request = json!({"capability": "text.upper", "payload": "x"});
        refused(
            &curl(gw, "POST", "/v1/requests", &[credential], Some(&request)).await,
            "requests routes",
        );
        refused(
            &curl(gw, "GET", "/v1/agents", &[credential], None).await,
            "agents routes",
        );
    }
    // The ask scope, from a JWT's scope claim: requests for text capabilities only.
    let granted = json!({"capability": "text.upper", "payload": "x", "timeout_ms": 200});
    let a = curl(gw, "POST", "/v1/requests", &[ask.as_str()], Some(&granted)).await;
    assert_ne!(
        a.status, 403,
        "granted, whatever the bus then says: {}",
        a.body
    );
    let image = json!({"capability": "image.resize", "payload": "x"});
    refused(
        &curl(gw, "POST", "/v1/requests", &[ask.as_str()], Some(&image)).await,
        "capability image.resize",
    );
    refused(
        &curl(gw, "POST", "/v1/tasks", &[ask.as_str()], Some(&draft)).await,
        "tasks routes",
    );
    // A2A at an endpoint the scopes do not grant.
    let a2a = json!({"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}});
    refused(
        &curl(
            gw,
            "POST",
            "/a2a/agents/reader/draft/",
            &[drafts, "A2A-Version: 1.0"],
            Some(&a2a),
        )
        .await,
        "calls to reader",
    );
    // No scope the gateway knows: nothing.
    refused(
        &curl(gw, "POST", "/v1/tasks", &[nothing], Some(&draft)).await,
        "none this gateway knows",
    );
    // A bad token is still 401, saying why.
    let expired = format!(
        "Authorization: Bearer {}",
        hs256("web-ui", now() - 3600, SECRET, AUDIENCE)
    );
    let a = curl(gw, "POST", "/v1/tasks", &[expired.as_str()], Some(&draft)).await;
    assert_eq!(a.status, 401, "{}", a.body);
    assert!(
        a.body["reason"]
            .as_str()
            .is_some_and(|r| r.contains("expired")),
        "{}",
        a.body
    );
    writer.shutdown().await;
    coordinator.shutdown().await;
}

/// Issue 33, item 2: the identity provider's key set fetched from its URL (`jwks_url`), cached
/// (many tokens, not a fetch each), and fetched again to follow a rotation: a token signed by a
/// key published after the gateway started is served once the set is fetched again, and one
/// signed by the key taken out is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_checked_against_a_key_set_fetched_from_its_url() {
    use axum::extract::State;
    let server = server();
    let old = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256 key");
    let new = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("Ed25519 key");
    // The provider: its key set, and how many times it was fetched.
    let published = Arc::new(std::sync::Mutex::new(json!({"keys": [jwk(&old, "old")]})));
    let fetches = Arc::new(AtomicU64::new(0));
    let app = axum::Router::new()
        .route(
            "/jwks.json",
            axum::routing::get(
                |State((set, count)): State<(Arc<std::sync::Mutex<Value>>, Arc<AtomicU64>)>| async move {
                    count.fetch_add(1, Ordering::SeqCst);
                    axum::Json(set.lock().expect("set").clone())
                },
            ),
        )
        .with_state((Arc::clone(&published), Arc::clone(&fetches)));
    let idp = LocalHttp::serve(app).await;
    let provider = idp.addr;
    let (coordinator, gw) = with_gateway(
        &server,
        GatewayConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            identities: vec![EdgeIdentity {
                id: "web-ui".into(),
                nkey_seed_file: None,
                tenant: None,
            }],
            jwt: Some(JwtConfig {
                issuer: ISSUER.into(),
                audience: AUDIENCE.into(),
                jwks_url: Some(format!("http://{provider}/jwks.json")),
                jwks_refresh_secs: 2,
                ..JwtConfig::default()
            }),
            ..GatewayConfig::default()
        },
    )
    .await;
    let exp = now() + 300;
    let with_old = signed(Algorithm::ES256, &old, "old", exp, AUDIENCE);
    let with_new = signed(Algorithm::EdDSA, &new, "new", exp, AUDIENCE);
    let status = |header: String| async move {
        curl(gw, "GET", "/v1/agents", &[header.as_str()], None)
            .await
            .status
    };
    eventually(WAIT, "the key set fetched", || async {
        (status(with_old.clone()).await == 200).then_some(())
    })
    .await;
    // Cached: twenty calls, not twenty fetches.
    let before = fetches.load(Ordering::SeqCst);
    for _ in 0..20 {
        assert_eq!(status(with_old.clone()).await, 200);
    }
    assert!(
        fetches.load(Ordering::SeqCst) <= before + 2,
        "fetched per call: {fetches:?}"
    );
    // The provider rotates: the new key in, the old one out.
    let a = curl(gw, "GET", "/v1/agents", &[with_new.as_str()], None).await;
    assert_eq!(a.status, 401, "a key not yet fetched: {}", a.body);
    *published.lock().expect("set") = json!({"keys": [jwk(&new, "new")]});
    eventually(WAIT, "the rotated set fetched", || async {
        (status(with_new.clone()).await == 200).then_some(())
    })
    .await;
    let a = curl(gw, "GET", "/v1/agents", &[with_old.as_str()], None).await;
    assert_eq!(a.status, 401, "the retired key: {}", a.body);
    assert_eq!(a.body["label"], "unauthorized", "{}", a.body);
    coordinator.shutdown().await;
    idp.stop().await;
}

/// An HTTP server of the test's own on a loopback port (a webhook, an identity provider),
/// stopped by [`LocalHttp::stop`].
pub(crate) struct LocalHttp {
    pub(crate) addr: SocketAddr,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl LocalHttp {
    pub(crate) async fn serve(app: axum::Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stop = tokio_util::sync::CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move { stopped.cancelled().await })
                .await
        });
        LocalHttp { addr, stop, task }
    }

    pub(crate) async fn stop(self) {
        self.stop.cancel();
        let _ = within(WAIT, "the test's HTTP server stops", self.task).await;
    }
}

/// Replies by its kind: `echo` with the request's payload and content type as they
/// came, `packed` with `{"n": 7}` in MessagePack, `empty` with nothing, `broken` with text that
/// says it is JSON and is not.
struct Shapes(&'static str);

impl chorus_sdk::Handler for Shapes {
    fn call(
        &self,
        ctx: chorus_sdk::Context,
    ) -> chorus_sdk::BoxFuture<Result<chorus_sdk::Output, HandlerError>> {
        use chorus_sdk::envelope::{CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK};
        let m = ctx.message();
        let (payload, content_type) = match self.0 {
            "echo" => (m.payload.clone(), m.content_type.clone()),
            "packed" => (
                chorus_sdk::codec::encode_payload(&json!({"n": 7}), CONTENT_TYPE_MSGPACK)
                    .expect("MessagePack"),
                CONTENT_TYPE_MSGPACK.into(),
            ),
            "empty" => (bytes::Bytes::new(), CONTENT_TYPE_JSON.into()),
            _ => (
                bytes::Bytes::from_static(b"{\"half\": "),
                CONTENT_TYPE_JSON.into(),
            ),
        };
        Box::pin(async move {
            Ok(chorus_sdk::Output {
                payload,
                content_type,
            })
        })
    }
}

/// Issue 38, item 3: a request's JSON payload crosses the gateway as its caller wrote it, and
/// a JSON reply as its agent wrote it, without being read into a tree and written again: a
/// number wider than 64 bits, `2.50` and an escaped character arrive digit for digit, and the
/// agent receives exactly the body's bytes. A reply in another encoding is written as JSON, an
/// empty one as `null`, and one that says it is JSON and is not is 502 with 5006.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_payload_crosses_the_gateway_as_written_both_ways() {
    let server = server();
    let (coordinator, gw) = with_web_ui_gateway(&server).await;
    let shapes = agent(&server, "shapes").await;
    for command in ["echo", "packed", "empty", "broken"] {
        shapes
            .handle_command(command, Shapes(command))
            .await
            .expect("handler");
    }
    let key = format!("X-API-Key: {API_KEY}");
    let post = |body: String| {
        let args = vec![
            "-H".to_owned(),
            key.clone(),
            "-H".to_owned(),
            "content-type: application/json".to_owned(),
            "--data-binary".to_owned(),
            body,
        ];
        async move { chorus_tests::curl(gw, "POST", "/v1/requests", &args, 25).await }
    };

    // As written, both ways: the reply's payload is the request's, byte for byte.
    let payload = r#"{"big": 123456789012345678901234567890, "price": 2.50, "say": "\u00e9"}"#;
    let (status, _, body) = post(format!(
        r#"{{"to": "shapes", "command": "echo", "payload": {payload}}}"#
    ))
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(&format!(r#""payload":{payload}"#)),
        "the payload changed on its way: {body}"
    );
    // Not JSON text at all: refused before the bus, naming the body.
    let (status, _, body) =
        post(r#"{"to": "shapes", "command": "echo", "payload": 01}"#.into()).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("the body"), "{body}");

    let ask = |command: &'static str| {
        let post = &post;
        async move {
            let (status, _, body) =
                post(format!(r#"{{"to": "shapes", "command": "{command}"}}"#)).await;
            let body: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            (status, body)
        }
    };
    // No payload given: the agent gets JSON null, which it echoes.
    let (status, body) = ask("echo").await;
    assert_eq!((status, &body["payload"]), (200, &Value::Null), "{body}");
    let (status, body) = ask("packed").await;
    assert_eq!(
        (status, &body["payload"]),
        (200, &json!({"n": 7})),
        "{body}"
    );
    let (status, body) = ask("empty").await;
    assert_eq!((status, &body["payload"]), (200, &Value::Null), "{body}");
    let (status, body) = ask("broken").await;
    assert_eq!(
        (status, body["status"].as_u64()),
        (502, Some(5006)),
        "{body}"
    );
    shapes.shutdown().await;
    assert!(within(WAIT, "coordinator shutdown", coordinator.shutdown()).await);
}
