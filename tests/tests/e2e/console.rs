//! The web console (issue 37), driven with `curl` as a browser and a script would: sign-in
//! and its cookie, every page for an operator, `/login` for a stranger, 403 for a read-only
//! key on every action, CSRF and Origin checks on forms, 404 and 400 pages for unknown ids and
//! filters that do not parse, values from the bus escaped, a task cancelled from its page and
//! a dead letter replayed out of the queue. The console runs alone (no HTTP API) beside a
//! coordinator, against a real nats-server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use chorus_gateway::config::{ApiKey, ConsoleConfig, EdgeIdentity};
use chorus_gateway::{Bus, Gateway, GatewayConfig, ScopeConfig};
use chorus_sdk::{Call, Context, HandlerError, RetryPolicies, RetryPolicy, TaskContext, TaskState};
use chorus_tests::{WAIT, agent, agent_options, eventually, server, within};
use sha2::Digest;

const ADMIN_KEY: &str = "k-console-operator-5b1e7d9a3c4f6e8a0b2d";
const VIEW_KEY: &str = "k-console-viewer-8c2a4e6f1b3d5a7c9e0f";
const SCRIPT: &str = "<script>alert(1)</script>";

/// What `curl` got: the status, the headers and the body.
struct Got {
    status: u16,
    headers: String,
    body: String,
}

impl Got {
    /// The value of cookie `name` set by the answer.
    fn cookie(&self, name: &str) -> Option<String> {
        self.headers
            .lines()
            .filter_map(|l| l.split_once(": "))
            .filter(|(n, _)| n.eq_ignore_ascii_case("set-cookie"))
            .map(|(_, c)| c)
            .filter_map(|c| c.split(';').next()?.split_once('='))
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.trim().to_owned())
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .lines()
            .filter_map(|l| l.split_once(": "))
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim())
    }
}

/// `curl` `method` `path` on the console with `headers`, a form body if `form`, and at most
/// `max` seconds (a server-sent event stream is cut there).
async fn curl(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[String],
    form: Option<&[(&str, &str)]>,
    max: u32,
) -> Got {
    let mut args = Vec::new();
    for h in headers {
        args.extend(["-H".to_owned(), h.clone()]);
    }
    if let Some(form) = form {
        let body: Vec<String> = form
            .iter()
            .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
            .collect();
        args.extend([
            "--data-binary".to_owned(),
            body.join("&"),
            "-H".to_owned(),
            "content-type: application/x-www-form-urlencoded".to_owned(),
        ]);
    }
    let (status, headers, body) = chorus_tests::curl(addr, method, path, &args, max).await;
    Got {
        status,
        headers,
        body,
    }
}

/// `text` percent-encoded for a form.
fn enc(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn sha(key: &str) -> String {
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

fn key(k: &str) -> Vec<String> {
    vec![format!("x-api-key: {k}")]
}

/// The value of the first `name="csrf"` input of a page.
fn csrf_of(page: &str) -> String {
    let at = page.find(r#"name="csrf" value=""#).expect("a CSRF input") + 19;
    page[at..].split('"').next().expect("its value").to_owned()
}

fn config() -> GatewayConfig {
    let scope = |name: &str, routes: &[&str]| ScopeConfig {
        name: name.into(),
        routes: routes.iter().map(|r| (*r).to_owned()).collect(),
        agents: vec![],
        capabilities: vec![],
    };
    let identity = |id: &str| EdgeIdentity {
        id: id.into(),
        nkey_seed_file: None,
        tenant: None,
    };
    GatewayConfig {
        identities: vec![identity("ops"), identity("auditor")],
        api_keys: vec![
            ApiKey {
                identity: "ops".into(),
                sha256: sha(ADMIN_KEY),
                scopes: vec!["operator".into()],
            },
            ApiKey {
                identity: "auditor".into(),
                sha256: sha(VIEW_KEY),
                scopes: vec!["viewer".into()],
            },
        ],
        scopes: vec![
            scope("operator", &["console", "console-admin"]),
            scope("viewer", &["console"]),
        ],
        console: ConsoleConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            ..ConsoleConfig::default()
        },
        ..GatewayConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_serves_operators_refuses_the_rest_cancels_tasks_and_replays_dead_letters() {
    let server = server();
    let coordinator = chorus_tests::coordinator(&server, false).await;
    let gateway = within(
        WAIT,
        "console start",
        Gateway::start(&Bus::new(server.url()), &config()),
    )
    .await
    .expect("the console starts without the HTTP API");
    assert_eq!(gateway.local_addr(), None);
    let addr = gateway.console_addr().expect("the console listens");

    // A worker whose task reports progress and a chunk, then waits for a cancel.
    let worker = agent(&server, "worker").await;
    worker
        .on_task("hold", |task: TaskContext, (): ()| async move {
            task.progress(Some(0.25), "a quarter").await?;
            task.chunk(&"first piece").await?;
            let _ = task.cancelled().await;
            Err::<(), _>(HandlerError::new(
                chorus_sdk::StatusCode::CANCELLED,
                "stopped",
            ))
        })
        .await
        .expect("serve the task");
    // A durable command that fails once is dead-lettered; once fixed, a replay succeeds.
    let fixed = Arc::new(AtomicBool::new(false));
    let handled = Arc::new(AtomicUsize::new(0));
    let payments = agent_options(&server, "payments")
        .durable_inbox(true)
        .retry_policies(RetryPolicies {
            default: RetryPolicy {
                max_attempts: 1,
                ..RetryPolicy::default()
            },
            rules: Vec::new(),
        })
        .connect()
        .await
        .expect("connect");
    {
        let (fixed, handled) = (Arc::clone(&fixed), Arc::clone(&handled));
        payments
            .on_command("charge", move |_ctx: Context, note: String| {
                let ok = fixed.load(Ordering::SeqCst);
                if ok {
                    handled.fetch_add(1, Ordering::SeqCst);
                }
                async move {
                    if ok {
                        Ok(note)
                    } else {
                        Err(HandlerError::failed("card declined"))
                    }
                }
            })
            .await
            .expect("register");
    }
    let boss = agent(&server, "boss").await;
    let task = boss
        .submit(Call::agent("worker", "hold").payload(&()).expect("payload"))
        .await
        .expect("submit");
    boss.send_durable(
        Call::agent("payments", "charge")
            .command()
            .payload(&SCRIPT.to_owned())
            .expect("payload"),
    )
    .await
    .expect("stored");

    // A stranger is sent to /login; a feed answers 401.
    let got = curl(addr, "GET", "/tasks?state=working", &[], None, 10).await;
    assert_eq!(got.status, 303);
    assert_eq!(
        got.header("location"),
        Some("/login?next=%2Ftasks%3Fstate%3Dworking")
    );
    assert_eq!(
        curl(addr, "GET", "/tap/events", &[], None, 10).await.status,
        401
    );
    assert_eq!(
        curl(addr, "GET", "/overview", &key("not-a-key"), None, 10)
            .await
            .status,
        401
    );

    // Sign-in: the form's token must match its cookie, and the key must be known.
    let form = curl(addr, "GET", "/login", &[], None, 10).await;
    assert_eq!(form.status, 200);
    assert!(form.body.contains(r#"id="login""#));
    let login_token = form.cookie("chorus_console_login").expect("a login cookie");
    assert_eq!(csrf_of(&form.body), login_token);
    let login_cookie = vec![format!("cookie: chorus_console_login={login_token}")];
    let refused = curl(
        addr,
        "POST",
        "/login",
        &login_cookie,
        Some(&[("credential", ADMIN_KEY), ("csrf", "forged")]),
        10,
    )
    .await;
    assert_eq!(refused.status, 403, "a login without its token");
    let refused = curl(
        addr,
        "POST",
        "/login",
        &login_cookie,
        Some(&[("credential", "k-wrong"), ("csrf", &login_token)]),
        10,
    )
    .await;
    assert_eq!(refused.status, 401, "an unknown key");
    let signed = curl(
        addr,
        "POST",
        "/login",
        &login_cookie,
        Some(&[
            ("credential", ADMIN_KEY),
            ("csrf", &login_token),
            ("next", "/agents"),
        ]),
        10,
    )
    .await;
    assert_eq!(signed.status, 303);
    assert_eq!(signed.header("location"), Some("/agents"));
    let set = signed
        .headers
        .lines()
        .map(str::to_ascii_lowercase)
        .find(|l| l.starts_with("set-cookie: chorus_console="))
        .expect("a session cookie");
    assert!(
        set.contains("httponly") && set.contains("samesite=strict") && set.contains("path=/"),
        "{set}"
    );
    let session = signed.cookie("chorus_console").expect("the session id");
    assert_eq!(session.len(), 64);
    let browser = vec![format!("cookie: chorus_console={session}")];

    // Every page for the operator.
    eventually(WAIT, "the worker listed", || async {
        let got = curl(addr, "GET", "/agents", &browser, None, 10).await;
        (got.status == 200 && got.body.contains(r#"data-agent="worker""#)).then_some(())
    })
    .await;
    let overview = curl(addr, "GET", "/", &browser, None, 10).await;
    assert_eq!(overview.status, 200);
    for id in [
        "overview",
        "chart-kinds",
        "chart-refusals",
        "chart-dlq",
        "chart-tasks",
    ] {
        assert!(overview.body.contains(&format!(r#"id="{id}""#)), "{id}");
    }
    let csp = overview.header("content-security-policy").expect("a CSP");
    assert!(csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"));
    assert_eq!(overview.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(overview.header("cache-control"), Some("no-store"));
    let csrf = csrf_of(&overview.body);
    for path in [
        "/agents/worker",
        "/tasks",
        "/dlq",
        "/tap",
        "/tap?pattern=agent.worker.%3E&kind=command",
    ] {
        assert_eq!(
            curl(addr, "GET", path, &browser, None, 10).await.status,
            200,
            "{path}"
        );
    }
    for path in ["/static/console.js", "/static/console.css"] {
        assert_eq!(
            curl(addr, "GET", path, &[], None, 10).await.status,
            200,
            "{path}"
        );
    }
    assert_eq!(
        curl(addr, "GET", "/favicon.ico", &[], None, 10)
            .await
            .status,
        204
    );

    // Unknown ids are 404 pages, filters that do not parse 400 pages naming the filter, and
    // what came from outside is shown as text.
    for path in [
        "/tasks/6f1c1d7e-0000-4000-8000-000000000000",
        "/tasks/not-a-task",
        "/dlq/99999",
        "/agents/gone-agent",
        "/no-such-page",
    ] {
        let got = curl(addr, "GET", path, &browser, None, 10).await;
        assert_eq!(got.status, 404, "{path}");
        assert!(got.body.contains(r#"id="error""#), "{path}");
    }
    let script = curl(
        addr,
        "GET",
        "/agents/%3Cscript%3Ealert(1)%3C%2Fscript%3E",
        &browser,
        None,
        10,
    )
    .await;
    assert_eq!(script.status, 404);
    assert!(
        script
            .body
            .contains("&lt;script&gt;alert(1)&lt;/script&gt;")
    );
    assert!(!script.body.contains(SCRIPT));
    for (path, named) in [
        ("/tasks?state=sleeping", "state:"),
        ("/tasks?age=soon", "age:"),
        ("/tasks?page=0", "page:"),
        ("/dlq?reason=bored", "reason:"),
        ("/dlq/abc", "dead letter id"),
        ("/tap?pattern=a..b", "pattern:"),
        ("/tap?kind=gossip", "kind:"),
    ] {
        let got = curl(addr, "GET", path, &browser, None, 10).await;
        assert_eq!(got.status, 400, "{path}");
        assert!(got.body.contains(named), "{path}: {}", got.body);
    }

    // The task: listed, its page and its events.
    let id = task.id().to_string();
    eventually(WAIT, "the task working", || async {
        let got = curl(
            addr,
            "GET",
            "/tasks?state=working&agent=worker",
            &browser,
            None,
            10,
        )
        .await;
        got.body
            .contains(&format!(r#"data-task="{id}""#))
            .then_some(())
    })
    .await;
    let page = curl(addr, "GET", &format!("/tasks/{id}"), &browser, None, 10).await;
    assert_eq!(page.status, 200);
    for el in [
        "task-state",
        "task-progress",
        "task-chunks",
        "task-attempts",
        "task-report",
        "cancel",
    ] {
        assert!(page.body.contains(&format!(r#"id="{el}""#)), "{el}");
    }
    let events = curl(
        addr,
        "GET",
        &format!("/tasks/{id}/events"),
        &key(ADMIN_KEY),
        None,
        3,
    )
    .await;
    assert_eq!(events.status, 200);
    assert!(
        events.body.contains(r#""kind":"progress""#),
        "{}",
        events.body
    );
    assert!(events.body.contains("first piece"), "{}", events.body);

    // A read-only key sees no buttons and may not act.
    let viewer = key(VIEW_KEY);
    let seen = curl(addr, "GET", &format!("/tasks/{id}"), &viewer, None, 10).await;
    assert_eq!(seen.status, 200);
    assert!(!seen.body.contains(r#"id="cancel""#));
    for path in [
        format!("/tasks/{id}/cancel"),
        "/dlq/1/replay".into(),
        "/dlq/replay".into(),
        "/dlq/purge".into(),
    ] {
        let got = curl(
            addr,
            "POST",
            &path,
            &viewer,
            Some(&[("confirm", "yes")]),
            10,
        )
        .await;
        assert_eq!(got.status, 403, "{path}");
    }

    // A form without its CSRF token, or from another origin, is refused.
    let cancel = format!("/tasks/{id}/cancel");
    let got = curl(addr, "POST", &cancel, &browser, Some(&[]), 10).await;
    assert_eq!(got.status, 403, "no CSRF token");
    let got = curl(
        addr,
        "POST",
        &cancel,
        &browser,
        Some(&[("csrf", "0000")]),
        10,
    )
    .await;
    assert_eq!(got.status, 403, "a wrong CSRF token");
    let mut elsewhere = browser.clone();
    elsewhere.push("origin: http://evil.example".into());
    let got = curl(
        addr,
        "POST",
        &cancel,
        &elsewhere,
        Some(&[("csrf", &csrf)]),
        10,
    )
    .await;
    assert_eq!(got.status, 403, "another origin");
    assert!(!task.report().await.expect("report").is_finished());

    // Cancel from the page: the task ends cancelled.
    let mut same = browser.clone();
    same.push(format!("origin: http://{addr}"));
    let got = curl(addr, "POST", &cancel, &same, Some(&[("csrf", &csrf)]), 20).await;
    assert_eq!(got.status, 303, "{}", got.body);
    let report = within(WAIT, "the task ends", task.result())
        .await
        .expect("report");
    assert_eq!(report.state, TaskState::Cancelled);

    // The dead letter: listed, shown decoded (escaped), replayed out of the queue.
    let letter = eventually(WAIT, "the dead letter listed", || async {
        let got = curl(addr, "GET", "/dlq?agent=payments", &browser, None, 10).await;
        let at = got.body.find(r#"data-id=""#)? + 9;
        got.body[at..].split('"').next().map(str::to_owned)
    })
    .await;
    let shown = curl(addr, "GET", &format!("/dlq/{letter}"), &browser, None, 10).await;
    assert_eq!(shown.status, 200);
    assert!(shown.body.contains(r#"id="dlq-envelope""#) && shown.body.contains(r#"id="replay""#));
    assert!(shown.body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(!shown.body.contains(SCRIPT));
    fixed.store(true, Ordering::SeqCst);
    let got = curl(
        addr,
        "POST",
        &format!("/dlq/{letter}/replay"),
        &key(ADMIN_KEY),
        Some(&[]),
        20,
    )
    .await;
    assert_eq!(got.status, 303, "{}", got.body);
    eventually(WAIT, "the replay handled", || async {
        (handled.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    assert_eq!(
        curl(addr, "GET", &format!("/dlq/{letter}"), &browser, None, 10)
            .await
            .status,
        404,
        "the replayed letter left the queue"
    );

    // Purge asks first.
    let ask = curl(addr, "POST", "/dlq/purge", &key(ADMIN_KEY), Some(&[]), 10).await;
    assert_eq!(ask.status, 200);
    assert!(ask.body.contains(r#"id="purge-confirm""#));
    let purged = curl(
        addr,
        "POST",
        "/dlq/purge",
        &key(ADMIN_KEY),
        Some(&[("confirm", "yes")]),
        10,
    )
    .await;
    assert_eq!(purged.status, 303);

    // Live traffic streams decoded envelopes.
    let tap = curl(addr, "GET", "/tap/events", &key(ADMIN_KEY), None, 2).await;
    assert_eq!(tap.status, 200);
    assert_eq!(tap.header("content-type"), Some("text/event-stream"));

    // Signing out ends the session.
    let out = curl(
        addr,
        "POST",
        "/logout",
        &browser,
        Some(&[("csrf", &csrf)]),
        10,
    )
    .await;
    assert_eq!(out.status, 303);
    assert_eq!(curl(addr, "GET", "/", &browser, None, 10).await.status, 303);

    gateway.stop().await;
    coordinator.shutdown().await;
}
