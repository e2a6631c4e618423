//! The hostile insider (issue 56; docs/SECURITY.md, "Roles and authority" and "Credentials and
//! subject permissions"): on a bus whose every user is a `chorus creds` entry, whose
//! coordinator names `ops` its admin and requires admins to sign, an ordinary agent, a gateway
//! key without a scope naming the coordinator, and a client without credentials each try what
//! would take the bus over: deploy, scale and terminate; purge or delete a stream; remove
//! another agent's consumer; read, remove or purge dead letters; cancel another's task; forge a
//! `sys.wire` announcement or a reply; register a hostile id. Each is refused, and after each a
//! check that nothing it aimed at changed. The admin then does what it may, and it is done.

use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::{Broker, BrokerOptions, Credentials};
use chorus_coordinator::creds::{Role, authorization_entry, coordinator_entry};
use chorus_gateway::config::{ApiKey, EdgeIdentity};
use chorus_gateway::{Bus, Gateway, GatewayConfig, ScopeConfig};
use chorus_host::manifest::Manifest;
use chorus_host::protocol::{
    DeployRequest, DeploymentView, ScaleRequest, TerminateRequest, coordinator_commands,
};
use chorus_sdk::security::Identity;
use chorus_sdk::{Agent, StatusCode, Subjects};
use chorus_tests::creds_bus::{answered, connect, consumer_exists, messages};
use chorus_tests::{WAIT, within};
use futures::StreamExt;
use serde_json::json;
use sha2::Digest;

use crate::authority::ask;
use crate::gateway::curl;

/// The gateway key of the `web-ui` identity: it may call nlp-agent, nothing else.
const WEB_KEY: &str = "web-ui-key-0123456789abcdef";

/// The deployments and their replicas, as the admin sees them.
async fn deployments(admin: &Agent) -> Vec<(String, u32)> {
    let views: Vec<DeploymentView> = serde_json::from_value(
        ask(admin, coordinator_commands::DEPLOYMENTS, &())
            .await
            .expect("the admin lists the deployments"),
    )
    .expect("deployment views");
    views
        .into_iter()
        .map(|v| (v.deployment, v.replicas))
        .collect()
}

/// A heartbeat on `subject` whose manifest claims the id `claimed`, as a forger writes it.
fn forged_heartbeat(claimed: &str) -> Bytes {
    use chorus_sdk::codec::{self, Encoding};
    use chorus_sdk::{Envelope, Kind, Performative};
    let manifest: chorus_sdk::registry::Manifest = serde_json::from_value(json!({
        "agent": claimed,
        "instance": "forged",
        "heartbeat_ms": 60_000,
        "started_ms": chorus_sdk::envelope::now_ms(),
    }))
    .expect("manifest");
    let mut env = Envelope::new(Kind::Heartbeat, Performative::Health, claimed);
    env.payload = codec::encode_payload(&manifest, chorus_sdk::envelope::CONTENT_TYPE_MSGPACK)
        .expect("payload");
    codec::encode(&env, Encoding::MsgPack).expect("encode")
}

/// Publishes `forged` on `subject` from `attacker`, then a harmless event from the same
/// connection; `watcher` (subscribed to both) sees the event and, since one connection's
/// messages arrive in order, would have seen the forgery before it: it must not have.
async fn forgery_never_arrives(
    attacker: &Broker,
    watcher: &Broker,
    subject: &str,
    forged: Bytes,
    what: &str,
) {
    let subjects = Subjects::default();
    let sentinel = subjects
        .event_pattern(&format!(
            "insider.sentinel.{}",
            uuid::Uuid::now_v7().simple()
        ))
        .expect("event subject");
    let mut seen = watcher.subscribe(subject).await.expect("watch");
    let mut marks = watcher.subscribe(&sentinel).await.expect("watch sentinel");
    watcher.flush().await.expect("flush");
    attacker.publish(subject, forged).await.expect("publish");
    attacker
        .publish(&sentinel, Bytes::from_static(b"{}"))
        .await
        .expect("sentinel");
    attacker.flush().await.expect("flush");
    within(WAIT, "the sentinel arrives", marks.next())
        .await
        .expect("sentinel");
    watcher.flush().await.expect("flush");
    let got = tokio::time::timeout(Duration::from_millis(1), seen.next()).await;
    assert!(got.is_err(), "{what}: the forgery arrived on {subject}");
}

/// What the attacks aim at, and the check that none of it changed.
struct Aims<'a> {
    admin: &'a Broker,
    before: &'a [(String, u32)],
    mark: &'a std::path::Path,
    dlq: &'a str,
    inbox: &'a str,
    letters: u64,
}

impl Aims<'_> {
    /// The deployments as they were, no mark of the hostile command, the dead letters all
    /// there, the inbox stream and ocr-agent's consumer too.
    async fn unchanged(&self, ops: &Agent) {
        assert_eq!(deployments(ops).await, self.before, "a deployment changed");
        assert!(!self.mark.exists(), "the hostile command ran");
        assert_eq!(
            messages(self.admin, self.dlq).await,
            self.letters,
            "the DLQ changed"
        );
        let _ = messages(self.admin, self.inbox).await;
        assert!(
            consumer_exists(self.admin, self.inbox, "ocr-agent").await,
            "ocr-agent's consumer is gone"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_a_gateway_key_and_a_stranger_take_nothing_over_and_the_admin_does_what_it_may() {
    let subjects = Subjects::default();
    let keys: Vec<Identity> = (0..5).map(|_| Identity::generate()).collect();
    let [coordinator_key, nlp_key, ocr_key, web_key, ops_key] =
        <[Identity; 5]>::try_from(keys).unwrap_or_else(|_| unreachable!());
    let entry = |role: Role, key: &Identity| {
        authorization_entry(&subjects, &role, &key.public_key()).expect("entry")
    };
    // As SECURITY.md's walk-through makes them.
    let users = [
        coordinator_entry(&subjects, &coordinator_key.public_key()),
        entry(
            Role {
                agent: "nlp-agent".into(),
                serves: vec!["nlp.analyze".into()],
                durable: true,
                ..Role::default()
            },
            &nlp_key,
        ),
        entry(
            Role {
                agent: "ocr-agent".into(),
                serves: vec!["ocr".into()],
                durable: true,
                ..Role::default()
            },
            &ocr_key,
        ),
        entry(
            Role {
                agent: "web-ui".into(),
                durable: true,
                tasks: true,
                ..Role::default()
            },
            &web_key,
        ),
        entry(
            Role {
                agent: "ops".into(),
                cli: true,
                durable: true,
                tasks: true,
                dlq: true,
                ..Role::default()
            },
            &ops_key,
        ),
    ]
    .join("\n");
    let dir = tempfile::tempdir().expect("tempdir");
    let server = chorus_tests::server_with_users(dir.path(), &users);
    let url = server.url().to_owned();
    let seed = |name: &str, key: &Identity| {
        let path = dir.path().join(format!("{name}.nk"));
        std::fs::write(&path, key.seed().expect("seed")).expect("seed file");
        path
    };
    let mut config = chorus_coordinator::CoordinatorConfig {
        servers: url.clone(),
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        ..chorus_coordinator::CoordinatorConfig::default()
    };
    config.security.nkey_seed_file = Some(seed("coordinator", &coordinator_key));
    chorus_tests::creds_bus::signing_admin(&mut config, "ops", ops_key.public_key());
    let coordinator = chorus_tests::start_coordinator(config, false).await;
    let admin_raw = connect(&url, "coordinator", &coordinator_key).await;
    let creds = |key: &Identity| {
        BrokerOptions::new([url.as_str()])
            .credentials(Credentials::NKeySeed(key.seed().expect("seed")))
    };
    let same = |key: &Identity| Identity::from_seed(&key.seed().expect("seed")).expect("key");

    // The admin, signing with its key, as the CLI connects (no heartbeat, no registration).
    let ops = chorus_tests::agent_options(&server, "ops")
        .broker(creds(&ops_key))
        .identity(same(&ops_key))
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .connect()
        .await
        .expect("ops connects");
    let ops_raw = connect(&url, "ops", &ops_key).await;
    // Two durable agents with keys of their own.
    let nlp = chorus_tests::agent_options(&server, "nlp-agent")
        .broker(creds(&nlp_key))
        .identity(same(&nlp_key))
        .durable_inbox(true)
        .connect()
        .await
        .expect("nlp-agent connects");
    let nlp_raw = connect(&url, "nlp-agent", &nlp_key).await;
    let ocr = chorus_tests::agent_options(&server, "ocr-agent")
        .broker(creds(&ocr_key))
        .identity(same(&ocr_key))
        .durable_inbox(true)
        // Its consumer stays on the server, for the attack on it to aim at.
        .inbox_consumers(chorus_sdk::durable::InboxConsumers::Always)
        .connect()
        .await
        .expect("ocr-agent connects");
    ocr.on_command("scan", |_ctx: chorus_sdk::Context, n: u32| async move {
        Ok::<_, chorus_sdk::HandlerError>(n)
    })
    .await
    .expect("scan");

    // What the attacks aim at: a deployment, a dead letter, ocr-agent's inbox consumer.
    let mut kept = Manifest::new("kept", "true");
    kept.replicas = 1;
    ask(
        &ops,
        coordinator_commands::DEPLOY,
        &DeployRequest { manifest: kept },
    )
    .await
    .expect("the admin deploys");
    let before = vec![("kept".to_owned(), 1)];
    assert_eq!(deployments(&ops).await, before);
    nlp_raw
        .request(
            &subjects.dead_letter("refused.nlp-agent").expect("subject"),
            None,
            Bytes::from_static(b"{}"),
            WAIT,
        )
        .await
        .expect("a dead letter stored");
    let (inbox, dlq) = (
        subjects.stream_name(chorus_sdk::durable::INBOX_STREAM),
        subjects.stream_name(chorus_sdk::durable::DLQ_STREAM),
    );
    let letters = messages(&admin_raw, &dlq).await;
    assert!(letters >= 1);
    assert!(consumer_exists(&admin_raw, &inbox, "ocr-agent").await);
    let dir_mark = tempfile::tempdir().expect("tempdir");
    let mark = dir_mark.path().join("pwned");
    let hostile = || {
        let mut m = Manifest::new("pwn", "sh");
        m.run.args = vec!["-c".into(), format!("id > {}", mark.display())];
        m
    };
    let aims = Aims {
        admin: &admin_raw,
        before: &before,
        mark: &mark,
        dlq: &dlq,
        inbox: &inbox,
        letters,
    };
    // 1. The ordinary agent, signing as itself.
    for (command, body) in [
        (
            coordinator_commands::DEPLOY,
            serde_json::to_value(DeployRequest {
                manifest: hostile(),
            })
            .expect("json"),
        ),
        (
            coordinator_commands::SCALE,
            serde_json::to_value(ScaleRequest {
                deployment: "kept".into(),
                replicas: 3,
            })
            .expect("json"),
        ),
        (
            coordinator_commands::TERMINATE,
            serde_json::to_value(TerminateRequest {
                deployment: "kept".into(),
            })
            .expect("json"),
        ),
    ] {
        let err = ask(&nlp, command, &body)
            .await
            .expect_err("an agent is refused");
        assert_eq!(
            err.status(),
            StatusCode::ACCESS,
            "nlp-agent {command}: {err}"
        );
        aims.unchanged(&ops).await;
    }
    for (what, subject, body) in [
        ("purge the DLQ", format!("$JS.API.STREAM.PURGE.{dlq}"), "{}"),
        (
            "delete the inbox",
            format!("$JS.API.STREAM.DELETE.{inbox}"),
            "",
        ),
        (
            "delete ocr-agent's consumer",
            format!("$JS.API.CONSUMER.DELETE.{inbox}.ocr-agent"),
            "",
        ),
        (
            "read a dead letter (to replay it)",
            format!("$JS.API.STREAM.MSG.GET.{dlq}"),
            r#"{"seq":1}"#,
        ),
        (
            "remove a dead letter",
            format!("$JS.API.STREAM.MSG.DELETE.{dlq}"),
            r#"{"seq":1}"#,
        ),
    ] {
        assert!(
            !answered(&nlp_raw, &subject, body).await,
            "nlp-agent may {what}"
        );
        aims.unchanged(&ops).await;
    }
    // Forgeries: a wire announcement, a reply into ops's inbox, a task's cancel, a registry
    // departure, a heartbeat under another id, and one under its own subject claiming a hostile id.
    let hostile_id = "<img/src/onerror=alert(1)";
    for (subject, watcher, what) in [
        (subjects.wire(), &admin_raw, "a sys.wire announcement"),
        (
            "_INBOX.ops.forged.reply".to_owned(),
            &ops_raw,
            "a reply to ops",
        ),
        (
            subjects.task(&uuid::Uuid::now_v7(), chorus_sdk::task::TaskMessage::Cancel),
            &admin_raw,
            "a task's cancel",
        ),
        (
            subjects.event("registry.left").expect("subject"),
            &admin_raw,
            "a registry departure",
        ),
        (
            format!("chorus.sys.hb.{hostile_id}"),
            &admin_raw,
            "a heartbeat under a hostile id",
        ),
    ] {
        forgery_never_arrives(
            &nlp_raw,
            watcher,
            &subject,
            forged_heartbeat(hostile_id),
            what,
        )
        .await;
        aims.unchanged(&ops).await;
    }
    nlp_raw
        .publish(
            &subjects.heartbeat("nlp-agent").expect("subject"),
            forged_heartbeat(hostile_id),
        )
        .await
        .expect("publish");
    nlp_raw.flush().await.expect("flush");
    let all = chorus_sdk::DiscoverQuery::default();
    chorus_tests::eventually(WAIT, "nlp-agent registered", || async {
        coordinator
            .discover(&all)
            .iter()
            .any(|r| r.manifest.agent == "nlp-agent")
            .then_some(())
    })
    .await;
    let ids: Vec<String> = coordinator
        .discover(&all)
        .into_iter()
        .map(|r| r.manifest.agent)
        .collect();
    assert!(
        !ids.iter().any(|id| id == hostile_id),
        "registered: {ids:?}"
    );

    // 2. A gateway key without a scope naming the coordinator: it calls nlp-agent, and
    // reaches no hosting command.
    let sha = |k: &str| hex::encode(sha2::Sha256::digest(k.as_bytes()));
    let gateway = within(
        WAIT,
        "gateway start",
        Gateway::start(
            &Bus::new(url.as_str()),
            &GatewayConfig {
                listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
                identities: vec![EdgeIdentity {
                    id: "web-ui".into(),
                    nkey_seed_file: Some(seed("web-ui", &web_key)),
                    tenant: None,
                }],
                api_keys: vec![ApiKey {
                    identity: "web-ui".into(),
                    sha256: sha(WEB_KEY),
                    scopes: vec!["caller".into()],
                }],
                scopes: vec![ScopeConfig {
                    name: "caller".into(),
                    routes: vec!["requests".into()],
                    agents: vec!["ocr-agent".into()],
                    capabilities: vec![],
                }],
                ..GatewayConfig::default()
            },
        ),
    )
    .await
    .expect("the gateway starts under web-ui's entry");
    let gw = gateway.local_addr().expect("the gateway listens");
    let web = format!("X-API-Key: {WEB_KEY}");
    let allowed = curl(
        gw,
        "POST",
        "/v1/requests",
        &[&web],
        Some(&json!({"to": "ocr-agent", "command": "scan", "payload": 4})),
    )
    .await;
    assert_eq!(allowed.status, 200, "{:?}", allowed.body);
    for (command, payload) in [
        (
            "deploy",
            json!({"manifest": {"agent": "pwn", "run": {"command": "sh", "args": ["-c", format!("id > {}", mark.display())]}}}),
        ),
        ("scale", json!({"deployment": "kept", "replicas": 3})),
        ("terminate", json!({"deployment": "kept"})),
    ] {
        let refused = curl(
            gw,
            "POST",
            "/v1/requests",
            &[&web],
            Some(&json!({"to": "coordinator", "command": command, "payload": payload})),
        )
        .await;
        assert_eq!(refused.status, 403, "web-ui {command}: {:?}", refused.body);
        // 3. And a client without credentials.
        let stranger = curl(
            gw,
            "POST",
            "/v1/requests",
            &[],
            Some(&json!({"to": "coordinator", "command": command, "payload": payload})),
        )
        .await;
        assert_eq!(
            stranger.status, 401,
            "stranger {command}: {:?}",
            stranger.body
        );
        aims.unchanged(&ops).await;
    }
    let stranger = BrokerOptions::new([url.as_str()]).connect().await;
    assert!(
        stranger.is_err(),
        "a client without credentials connected to the bus"
    );
    aims.unchanged(&ops).await;

    // The admin does what it may: scale, read and purge the dead letters, terminate.
    ask(
        &ops,
        coordinator_commands::SCALE,
        &ScaleRequest {
            deployment: "kept".into(),
            replicas: 2,
        },
    )
    .await
    .expect("the admin scales");
    assert_eq!(deployments(&ops).await, vec![("kept".to_owned(), 2)]);
    assert!(
        answered(
            &ops_raw,
            &format!("$JS.API.STREAM.MSG.GET.{dlq}"),
            r#"{"seq":1}"#
        )
        .await
    );
    assert!(answered(&ops_raw, &format!("$JS.API.STREAM.PURGE.{dlq}"), "{}").await);
    assert_eq!(messages(&admin_raw, &dlq).await, 0, "the admin purged");
    ask(
        &ops,
        coordinator_commands::TERMINATE,
        &TerminateRequest {
            deployment: "kept".into(),
        },
    )
    .await
    .expect("the admin terminates");
    assert!(deployments(&ops).await.is_empty());
    assert!(!mark.exists(), "the hostile command ran");

    gateway.stop().await;
    for agent in [ocr, nlp, ops] {
        agent.shutdown().await;
    }
    coordinator.shutdown().await;
}
