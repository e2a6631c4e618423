//! The permissions matrix of docs/SECURITY.md ("Credentials by role"), against a real
//! nats-server whose users are all `chorus creds` entries: each JetStream API call of the matrix
//! tried with each role's credentials; exactly the allowed ones are answered, and after the
//! refused ones nothing changed. A durable agent under its entry still serves its inbox.

use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::{BrokerOptions, Credentials};
use chorus_coordinator::creds::{Role, authorization_entry, coordinator_entry};
use chorus_sdk::security::Identity;
use chorus_sdk::{Call, Context, HandlerError, Subjects};
use chorus_tests::creds_bus::{answered, connect, messages};
use chorus_tests::{WAIT, within};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_permissions_matrix_holds_and_a_durable_agent_still_works_under_its_entry() {
    let subjects = Subjects::default();
    let keys: Vec<Identity> = (0..4).map(|_| Identity::generate()).collect();
    let (coordinator_key, agent_key, tasks_key, ops_key) = (&keys[0], &keys[1], &keys[2], &keys[3]);
    let entry = |role: Role, key: &Identity| {
        authorization_entry(&subjects, &role, &key.public_key()).expect("entry")
    };
    let users = [
        coordinator_entry(&subjects, &coordinator_key.public_key()),
        entry(
            Role {
                agent: "nlp-agent".into(),
                serves: vec!["nlp.analyze".into()],
                durable: true,
                ..Role::default()
            },
            agent_key,
        ),
        entry(
            Role {
                agent: "writer".into(),
                tasks: true,
                ..Role::default()
            },
            tasks_key,
        ),
        entry(
            Role {
                agent: "ops".into(),
                cli: true,
                durable: true,
                tasks: true,
                dlq: true,
                tap: true,
                ..Role::default()
            },
            ops_key,
        ),
    ]
    .join("\n");
    let dir = tempfile::tempdir().expect("tempdir");
    let server = chorus_tests::server_with_users(dir.path(), &users);
    let url = server.url().to_owned();
    let seed = dir.path().join("coordinator.nk");
    std::fs::write(&seed, coordinator_key.seed().expect("seed")).expect("seed file");
    let mut config = chorus_coordinator::CoordinatorConfig {
        servers: url.clone(),
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        ..chorus_coordinator::CoordinatorConfig::default()
    };
    config.security.nkey_seed_file = Some(seed);
    let coordinator = chorus_tests::start_coordinator(config, false).await;
    let admin = connect(&url, "coordinator", coordinator_key).await;

    // The durable agent serves its inbox under its entry: a durable command from ops is
    // handled (its consumer, acks, exactly-once and seen-id buckets all within its rights).
    let agent = chorus_tests::agent_options(&server, "nlp-agent")
        .broker(
            BrokerOptions::new([url.as_str()])
                .credentials(Credentials::NKeySeed(agent_key.seed().expect("seed"))),
        )
        .durable_inbox(true)
        .connect()
        .await
        .expect("nlp-agent connects under its entry");
    let (handled_tx, mut handled) = tokio::sync::mpsc::unbounded_channel();
    agent
        .on_command("reload", move |_ctx: Context, n: u32| {
            let handled_tx = handled_tx.clone();
            async move {
                let _ = handled_tx.send(n);
                Ok::<_, HandlerError>(())
            }
        })
        .await
        .expect("reload");
    let ops = chorus_tests::agent_options(&server, "ops")
        .broker(
            BrokerOptions::new([url.as_str()])
                .credentials(Credentials::NKeySeed(ops_key.seed().expect("seed"))),
        )
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .connect()
        .await
        .expect("ops connects under its entry");
    ops.send_durable(
        Call::agent("nlp-agent", "reload")
            .command()
            .payload(&7u32)
            .expect("payload"),
    )
    .await
    .expect("stored");
    assert_eq!(
        within(WAIT, "the durable command handled", handled.recv()).await,
        Some(7)
    );

    // A dead letter in the queue, for the purge and removal rows.
    let dlq = subjects.stream_name(chorus_sdk::durable::DLQ_STREAM);
    let inbox = subjects.stream_name(chorus_sdk::durable::INBOX_STREAM);
    let audit = subjects.stream_name(chorus_sdk::audit::AUDIT_STREAM);
    let registry = format!(
        "KV_{}",
        subjects.bucket_name(chorus_coordinator::service::REGISTRY_BUCKET)
    );
    let agent_raw = connect(&url, "nlp-agent", agent_key).await;
    let stored = agent_raw
        .request(
            &subjects.dead_letter("refused.nlp-agent").expect("subject"),
            None,
            Bytes::from_static(b"{}"),
            WAIT,
        )
        .await
        .expect("a dead letter stored");
    assert!(!stored.payload().is_empty());
    let letters = messages(&admin, &dlq).await;
    assert!(letters >= 1);

    let payload_bucket = subjects.bucket_name(chorus_sdk::payload::PAYLOAD_BUCKET);
    let payloads = format!("KV_{payload_bucket}");
    let seen = format!(
        "KV_{}",
        subjects.bucket_name(chorus_sdk::security::SEEN_BUCKET)
    );
    let tasks = subjects.stream_name(chorus_sdk::task::TASK_STREAM);
    // A short-lived consumer reading a stream from its start (what `chorus audit` and a task
    // watcher make).
    let reader = |stream: &str| {
        serde_json::json!({
            "stream_name": stream,
            "config": {"deliver_policy": "all", "ack_policy": "none", "inactive_threshold": 5_000_000_000u64},
        })
        .to_string()
    };
    let (audit_reader, tasks_reader) = (reader(&audit), reader(&tasks));
    let tasks_raw = connect(&url, "writer", tasks_key).await;
    let ops_raw = connect(&url, "ops", ops_key).await;
    // (call, subject, body, allowed for: the durable agent, the tasks agent, the operator).
    // nlp-agent's consumer is its own to read and remove, no one else's.
    let matrix: Vec<(&str, String, &str, [bool; 3])> = vec![
        (
            "read the inbox stream's state",
            format!("$JS.API.STREAM.INFO.{inbox}"),
            "",
            [true, false, true],
        ),
        (
            "delete the inbox stream",
            format!("$JS.API.STREAM.DELETE.{inbox}"),
            "",
            [false, false, false],
        ),
        (
            "update the inbox stream",
            format!("$JS.API.STREAM.UPDATE.{inbox}"),
            "{}",
            [false, false, false],
        ),
        (
            "purge the inbox stream",
            format!("$JS.API.STREAM.PURGE.{inbox}"),
            "{}",
            [false, false, false],
        ),
        (
            "snapshot the inbox stream",
            format!("$JS.API.STREAM.SNAPSHOT.{inbox}"),
            "{}",
            [false, false, false],
        ),
        (
            "purge the registry",
            format!("$JS.API.STREAM.PURGE.{registry}"),
            "{}",
            [false, false, false],
        ),
        (
            "delete the registry",
            format!("$JS.API.STREAM.DELETE.{registry}"),
            "",
            [false, false, false],
        ),
        (
            "remove a dead letter",
            format!("$JS.API.STREAM.MSG.DELETE.{dlq}"),
            r#"{"seq":999999}"#,
            [false, false, true],
        ),
        (
            "purge the audit stream",
            format!("$JS.API.STREAM.PURGE.{audit}"),
            "{}",
            [false, false, false],
        ),
        (
            "remove an audit record",
            format!("$JS.API.STREAM.MSG.DELETE.{audit}"),
            r#"{"seq":1}"#,
            [false, false, false],
        ),
        (
            "write an audit record as nlp-agent",
            "chorus.audit.gateway.nlp-agent".to_owned(),
            r#"{"ms":1,"via":"gateway","actor":"x","action":"y","outcome":"ok"}"#,
            [true, false, false],
        ),
        (
            "write an audit record as writer",
            "chorus.audit.gateway.writer".to_owned(),
            r#"{"ms":1,"via":"gateway","actor":"x","action":"y","outcome":"ok"}"#,
            [false, true, false],
        ),
        (
            "write an audit record as ops",
            "chorus.audit.console.ops".to_owned(),
            r#"{"ms":1,"via":"console","actor":"x","action":"y","outcome":"ok"}"#,
            [false, false, true],
        ),
        (
            "step a stream's leader down",
            format!("$JS.API.STREAM.LEADER.STEPDOWN.{inbox}"),
            "",
            [false, false, false],
        ),
        (
            "read the inbox by sequence (another agent's commands)",
            format!("$JS.API.STREAM.MSG.GET.{inbox}"),
            r#"{"seq":1}"#,
            [false, false, false],
        ),
        (
            "create a stream of its own",
            "$JS.API.STREAM.CREATE.MINE".to_owned(),
            r#"{"name":"MINE","subjects":["mine.>"]}"#,
            [false, false, false],
        ),
        (
            "purge the payload bucket",
            format!("$JS.API.STREAM.PURGE.{payloads}"),
            "{}",
            [false, false, false],
        ),
        (
            "write a payload part under nlp-agent's name",
            format!("$KV.{payload_bucket}.nlp-agent.m.0"),
            "part",
            [true, false, false],
        ),
        (
            "write a payload part under ops's name",
            format!("$KV.{payload_bucket}.ops.m.0"),
            "part",
            [false, false, true],
        ),
        (
            "read a payload part",
            format!("$JS.API.DIRECT.GET.{payloads}.$KV.{payload_bucket}.nlp-agent.m.0"),
            "",
            [true, true, true],
        ),
        (
            "update the seen-id bucket",
            format!("$JS.API.STREAM.UPDATE.{seen}"),
            "{}",
            [false, false, false],
        ),
        (
            "read a dead letter",
            format!("$JS.API.STREAM.MSG.GET.{dlq}"),
            r#"{"seq":1}"#,
            [false, false, true],
        ),
        (
            "read the audit trail (a consumer of its own on it)",
            format!("$JS.API.CONSUMER.CREATE.{audit}"),
            &audit_reader,
            [false, false, true],
        ),
        (
            "follow a task (a consumer of its own on the task stream)",
            format!("$JS.API.CONSUMER.CREATE.{tasks}"),
            &tasks_reader,
            [false, true, true],
        ),
        (
            "read nlp-agent's inbox consumer",
            format!("$JS.API.CONSUMER.INFO.{inbox}.nlp-agent"),
            "",
            [true, false, false],
        ),
        (
            "delete nlp-agent's inbox consumer",
            format!("$JS.API.CONSUMER.DELETE.{inbox}.nlp-agent"),
            "",
            [true, false, false],
        ),
    ];
    let brokers = [&agent_raw, &tasks_raw, &ops_raw];
    let names = [
        "nlp-agent (--durable)",
        "writer (--tasks)",
        "ops (--cli --dlq)",
    ];
    // Every call at once (a refused one waits out its answer): each role's verdict on each.
    let tries =
        matrix.iter().flat_map(|(call, subject, body, allowed)| {
            brokers.iter().zip(names).zip(allowed).map(
                move |((broker, name), allowed)| async move {
                    (
                        answered(broker, subject, body).await,
                        *allowed,
                        format!("{name}: {call} ({subject})"),
                    )
                },
            )
        });
    for (answered, allowed, what) in futures::future::join_all(tries).await {
        assert_eq!(answered, allowed, "{what}");
    }
    // Nothing a refusal targeted changed: the streams are there, the dead letter too.
    assert_eq!(messages(&admin, &dlq).await, letters);
    let _ = messages(&admin, &registry).await;
    let _ = messages(&admin, &inbox).await;
    // The dead-letter queue's purge: refused to the agents, the operator's to do.
    for broker in [&agent_raw, &tasks_raw] {
        assert!(!answered(broker, &format!("$JS.API.STREAM.PURGE.{dlq}"), "{}").await);
    }
    assert_eq!(
        messages(&admin, &dlq).await,
        letters,
        "an agent purged the DLQ"
    );
    assert!(answered(&ops_raw, &format!("$JS.API.STREAM.PURGE.{dlq}"), "{}").await);
    assert_eq!(
        messages(&admin, &dlq).await,
        0,
        "the operator purges the DLQ"
    );

    ops.shutdown().await;
    agent.shutdown().await;
    coordinator.shutdown().await;
}

/// Issue 56: the web console on a secured bus. The coordinator connects as its `chorus creds
/// --coordinator` user and runs the gateway's console on it; the console's agent
/// (`chorus-console`) takes its replies on its own inbox, which that entry grants, so the console
/// starts and an operator sees its pages (the agents page lists the bus's agents).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_console_starts_on_a_secured_bus_under_the_coordinators_entry() {
    use chorus_gateway::config::{ApiKey, ConsoleConfig, EdgeIdentity};
    use chorus_gateway::{GatewayConfig, ScopeConfig};
    use sha2::Digest;

    let subjects = Subjects::default();
    let (coordinator_key, agent_key, ops_key) = (
        Identity::generate(),
        Identity::generate(),
        Identity::generate(),
    );
    let users = [
        coordinator_entry(&subjects, &coordinator_key.public_key()),
        // The gateway identity the operator signs in as: an agent of its own, `--durable`.
        authorization_entry(
            &subjects,
            &Role {
                agent: "ops".into(),
                durable: true,
                ..Role::default()
            },
            &ops_key.public_key(),
        )
        .expect("entry"),
        authorization_entry(
            &subjects,
            &Role {
                agent: "nlp-agent".into(),
                durable: true,
                ..Role::default()
            },
            &agent_key.public_key(),
        )
        .expect("entry"),
    ]
    .join("\n");
    let dir = tempfile::tempdir().expect("tempdir");
    let server = chorus_tests::server_with_users(dir.path(), &users);
    let url = server.url().to_owned();
    let seed = dir.path().join("coordinator.nk");
    std::fs::write(&seed, coordinator_key.seed().expect("seed")).expect("seed file");
    let ops_seed = dir.path().join("ops.nk");
    std::fs::write(&ops_seed, ops_key.seed().expect("seed")).expect("seed file");
    let key = "console-ops-key-0123456789";
    let mut config = chorus_coordinator::CoordinatorConfig {
        servers: url.clone(),
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        gateway: GatewayConfig {
            identities: vec![EdgeIdentity {
                id: "ops".into(),
                nkey_seed_file: Some(ops_seed),
                tenant: None,
            }],
            api_keys: vec![ApiKey {
                identity: "ops".into(),
                sha256: hex::encode(sha2::Sha256::digest(key.as_bytes())),
                scopes: vec!["operator".into()],
            }],
            scopes: vec![ScopeConfig {
                name: "operator".into(),
                routes: vec!["console".into(), "console-admin".into()],
                agents: vec![],
                capabilities: vec![],
            }],
            console: ConsoleConfig {
                listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
                ..ConsoleConfig::default()
            },
            ..GatewayConfig::default()
        },
        ..chorus_coordinator::CoordinatorConfig::default()
    };
    config.security.nkey_seed_file = Some(seed);
    let coordinator = chorus_tests::start_coordinator(config, false).await;
    let console = coordinator.console_addr().expect("the console listens");
    let agent = chorus_tests::agent_options(&server, "nlp-agent")
        .broker(
            BrokerOptions::new([url.as_str()])
                .credentials(Credentials::NKeySeed(agent_key.seed().expect("seed"))),
        )
        .durable_inbox(true)
        .connect()
        .await
        .expect("nlp-agent connects under its entry");
    let header = format!("x-api-key: {key}");
    let page = chorus_tests::eventually(WAIT, "the agents page lists nlp-agent", || async {
        let (status, _, body) = chorus_tests::curl(
            console,
            "GET",
            "/agents",
            &["-H".to_owned(), header.clone()],
            10,
        )
        .await;
        (status == 200 && body.contains("nlp-agent")).then_some(body)
    })
    .await;
    assert!(page.contains("nlp-agent"), "{page}");
    agent.shutdown().await;
    coordinator.shutdown().await;
}

/// Issue 56: a gateway identity whose NATS user lacks JetStream rights (made without
/// `--durable`) cannot have the durable inbox the gateway gives each identity. The server's
/// refusal of its first JetStream call ends the gateway's start at once, saying what is
/// missing, instead of after each call's timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_identity_without_jetstream_rights_is_refused_at_once_saying_why() {
    chorus_tests::init_tracing();
    use chorus_gateway::config::{ApiKey, EdgeIdentity};
    use chorus_gateway::{Bus, Gateway, GatewayConfig};

    let subjects = Subjects::default();
    let (coordinator_key, web_key) = (Identity::generate(), Identity::generate());
    let users = [
        coordinator_entry(&subjects, &coordinator_key.public_key()),
        authorization_entry(
            &subjects,
            &Role {
                agent: "web-ui".into(),
                ..Role::default()
            },
            &web_key.public_key(),
        )
        .expect("entry"),
    ]
    .join("\n");
    let dir = tempfile::tempdir().expect("tempdir");
    let server = chorus_tests::server_with_users(dir.path(), &users);
    let seed = dir.path().join("coordinator.nk");
    std::fs::write(&seed, coordinator_key.seed().expect("seed")).expect("seed file");
    let mut config = chorus_coordinator::CoordinatorConfig {
        servers: server.url().to_owned(),
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        ..chorus_coordinator::CoordinatorConfig::default()
    };
    config.security.nkey_seed_file = Some(seed);
    let coordinator = chorus_tests::start_coordinator(config, false).await;
    let web_seed = dir.path().join("web-ui.nk");
    std::fs::write(&web_seed, web_key.seed().expect("seed")).expect("seed file");
    let gateway = GatewayConfig {
        listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
        identities: vec![EdgeIdentity {
            id: "web-ui".into(),
            nkey_seed_file: Some(web_seed),
            tenant: None,
        }],
        api_keys: vec![ApiKey {
            identity: "web-ui".into(),
            sha256: "0".repeat(64),
            scopes: Vec::new(),
        }],
        ..GatewayConfig::default()
    };
    let began = std::time::Instant::now();
    let started = within(
        WAIT,
        "the gateway's start",
        Gateway::start(&Bus::new(server.url()), &gateway),
    )
    .await;
    let Err(err) = started else {
        panic!("the gateway started without JetStream rights for web-ui");
    };
    let said = chorus_sdk::Report(&err).to_string();
    assert!(said.contains("chorus creds web-ui --durable"), "{said}");
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "refused after {:?}: {said}",
        began.elapsed()
    );
    coordinator.shutdown().await;
}

/// Issue 56: a gateway identity's A2A push configs on a secured bus. Under its
/// `chorus creds web-ui --gateway` entry the gateway opens the push bucket and reads back its
/// own configs at start; another identity's entry (even with `--gateway`) neither lists nor
/// writes web-ui's keys; and an identity with `--durable` alone is refused at start, saying
/// which flag it lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_identity_keeps_push_configs_under_its_own_name_only() {
    use chorus_gateway::config::{ApiKey, EdgeIdentity};
    use chorus_gateway::{Bus, Gateway, GatewayConfig, PushConfig};

    let subjects = Subjects::default();
    let keys: Vec<Identity> = (0..4).map(|_| Identity::generate()).collect();
    let role = |agent: &str, gateway: bool| Role {
        agent: agent.into(),
        durable: true,
        gateway,
        ..Role::default()
    };
    let users = [
        coordinator_entry(&subjects, &keys[0].public_key()),
        authorization_entry(&subjects, &role("web-ui", true), &keys[1].public_key())
            .expect("entry"),
        authorization_entry(&subjects, &role("other-ui", true), &keys[2].public_key())
            .expect("entry"),
        authorization_entry(&subjects, &role("plain-ui", false), &keys[3].public_key())
            .expect("entry"),
    ]
    .join("\n");
    let dir = tempfile::tempdir().expect("tempdir");
    let server = chorus_tests::server_with_users(dir.path(), &users);
    let seed = |name: &str, key: &Identity| {
        let path = dir.path().join(format!("{name}.nk"));
        std::fs::write(&path, key.seed().expect("seed")).expect("seed file");
        path
    };
    let gateway = |id: &str, key: &Identity| GatewayConfig {
        listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
        identities: vec![EdgeIdentity {
            id: id.into(),
            nkey_seed_file: Some(seed(id, key)),
            tenant: None,
        }],
        api_keys: vec![ApiKey {
            identity: id.into(),
            sha256: "0".repeat(64),
            scopes: Vec::new(),
        }],
        push: Some(PushConfig {
            allow: vec!["https://hooks.example.com/".into()],
            ..PushConfig::default()
        }),
        ..GatewayConfig::default()
    };
    let bus = Bus::new(server.url());
    let started = within(
        WAIT,
        "web-ui's gateway",
        Gateway::start(&bus, &gateway("web-ui", &keys[1])),
    )
    .await
    .expect("the gateway starts under web-ui's --gateway entry");
    // web-ui's own keys, written and listed under its entry.
    let web = connect(server.url(), "web-ui", &keys[1]).await;
    let bucket_name = subjects.bucket_name(chorus_gateway::PUSH_BUCKET);
    let web_bucket = web
        .jetstream(WAIT)
        .open_kv(&bucket_name)
        .await
        .expect("the bucket the gateway made");
    web_bucket
        .put(
            "web-ui.0190a7c4-0000-7000-8000-000000000000.mine",
            Bytes::from_static(b"{}"),
        )
        .await
        .expect("its own key");
    let own = web_bucket
        .entries_under("web-ui")
        .await
        .expect("its own keys");
    assert_eq!(own.len(), 1, "{own:?}");
    // other-ui neither lists nor writes them.
    let other = connect(server.url(), "other-ui", &keys[2]).await;
    let other_bucket = other
        .jetstream(chorus_tests::creds_bus::ANSWER)
        .open_kv(&bucket_name)
        .await
        .expect("the bucket's info");
    assert!(
        other_bucket.entries_under("web-ui").await.is_err(),
        "other-ui listed web-ui's configs"
    );
    assert!(
        other_bucket
            .put("web-ui.forged.x", Bytes::from_static(b"{}"))
            .await
            .is_err(),
        "other-ui wrote under web-ui's name"
    );
    assert_eq!(
        web_bucket
            .entries_under("web-ui")
            .await
            .expect("listed")
            .len(),
        1,
        "nothing changed"
    );
    started.stop().await;
    // An identity with --durable alone: refused at start, saying what it lacks.
    let refused = within(
        WAIT,
        "plain-ui's gateway",
        Gateway::start(&bus, &gateway("plain-ui", &keys[3])),
    )
    .await;
    let Err(err) = refused else {
        panic!("a gateway without push rights started with push configured");
    };
    let said = chorus_sdk::Report(&err).to_string();
    assert!(said.contains("chorus creds plain-ui --gateway"), "{said}");
}

/// Issue 56: a host on a secured bus. `chorus host --name a` connects as `host-a` under its
/// `chorus creds host-a --host` entry, reports to the hosts bucket under its own name (never
/// another's), and runs what the admin `ops`, signing its commands, deploys; the admin then
/// terminates it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_under_its_entry_runs_what_the_admin_deploys_on_a_secured_bus() {
    use chorus_host::manifest::Manifest;
    use chorus_host::protocol::{DeployRequest, TerminateRequest, coordinator_commands};

    // Built outside the deadlines below.
    let chorus = chorus_tests::chorus_binary();
    let subjects = Subjects::default();
    let (coordinator_key, host_key, ops_key) = (
        Identity::generate(),
        Identity::generate(),
        Identity::generate(),
    );
    let users = [
        coordinator_entry(&subjects, &coordinator_key.public_key()),
        authorization_entry(
            &subjects,
            &Role {
                agent: "host-a".into(),
                host: true,
                ..Role::default()
            },
            &host_key.public_key(),
        )
        .expect("entry"),
        authorization_entry(
            &subjects,
            &Role {
                agent: "ops".into(),
                cli: true,
                ..Role::default()
            },
            &ops_key.public_key(),
        )
        .expect("entry"),
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
        reconcile_interval_ms: 200,
        ..chorus_coordinator::CoordinatorConfig::default()
    };
    config.security.nkey_seed_file = Some(seed("coordinator", &coordinator_key));
    chorus_tests::creds_bus::signing_admin(&mut config, "ops", ops_key.public_key());
    let coordinator = chorus_tests::start_coordinator(config, false).await;

    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).expect("work folder");
    // Killed when the test ends, however it ends.
    let host = std::process::Command::new(&chorus)
        .args(["--server", &url, "--nkey-file"])
        .arg(seed("host-a", &host_key))
        .args(["host", "--name", "a", "--report-interval", "1s"])
        .args(["--stop-grace", "2s", "--sandbox", "none", "--user"])
        .arg(chorus_host::process::user::current_user())
        .arg("--trust")
        .arg(format!("coordinator={}", coordinator_key.public_key()))
        .arg("--log-dir")
        .arg(dir.path().join("logs"))
        .env_remove("CHORUS_CONTEXT")
        .env("CHORUS_CONFIG_DIR", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("chorus host starts");
    let host = chorus_tests::Processes(vec![host]);
    let ops = chorus_tests::agent_options(&server, "ops")
        .broker(
            BrokerOptions::new([url.as_str()])
                .credentials(Credentials::NKeySeed(ops_key.seed().expect("seed"))),
        )
        .identity(Identity::from_seed(&ops_key.seed().expect("seed")).expect("key"))
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .connect()
        .await
        .expect("ops connects");
    let ask = |command: &'static str, body: serde_json::Value| {
        let ops = ops.clone();
        async move { crate::authority::ask(&ops, command, &body).await }
    };
    // The host reports under its own name.
    chorus_tests::eventually(WAIT, "host a reports", || async {
        let hosts = ask(coordinator_commands::HOSTS, serde_json::json!(null))
            .await
            .ok()?;
        hosts
            .as_array()?
            .iter()
            .any(|h| h["report"]["name"] == "a" && h["state"] == "live")
            .then_some(())
    })
    .await;
    let host_raw = connect(&url, "host-a", &host_key).await;
    assert!(answered(&host_raw, "$KV.chorus_hosts.a", "{}").await);
    assert!(
        !answered(&host_raw, "$KV.chorus_hosts.b", "{}").await,
        "host-a wrote host b's report"
    );

    let mut manifest = Manifest::from_toml(&format!(
        "id = \"marker\"\n[run]\ncommand = \"/bin/sh\"\nargs = [\"-c\", \"echo ran > ran; exec sleep 600\"]\nworking_dir = {:?}\n[health]\ncheck = \"none\"\n",
        work.display().to_string()
    ))
    .expect("manifest");
    manifest.replicas = 1;
    ask(
        coordinator_commands::DEPLOY,
        serde_json::to_value(DeployRequest { manifest }).expect("json"),
    )
    .await
    .expect("the admin deploys");
    chorus_tests::eventually(WAIT, "host a runs the deployment", || async {
        work.join("ran").exists().then_some(())
    })
    .await;
    ask(
        coordinator_commands::TERMINATE,
        serde_json::to_value(TerminateRequest {
            deployment: "marker".into(),
        })
        .expect("json"),
    )
    .await
    .expect("the admin terminates");
    drop(host);
    ops.shutdown().await;
    coordinator.shutdown().await;
}
