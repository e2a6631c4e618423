//! Authority on the bus (docs/SECURITY.md, "Roles and authority"): the coordinator's commands
//! that run code or read what runs check the sender's role before they act. Each refusal
//! carries its code, is counted by reason, and changes nothing.

use std::time::Duration;

use chorus_coordinator::authority::AuthorityConfig;
use chorus_host::manifest::Manifest;
use chorus_host::protocol::{
    COORDINATOR, DeployRequest, DeploymentView, ScaleRequest, TerminateRequest,
    coordinator_commands,
};
use chorus_sdk::security::Identity;
use chorus_sdk::{Agent, Call, SdkError, StatusCode};
use chorus_tests::{
    agent, agent_options, coordinator_config, http_get, metric_sum, server, start_coordinator,
};

/// A manifest an attacker would deploy: a shell command that leaves a mark.
fn hostile(id: &str, mark: &std::path::Path) -> Manifest {
    let mut m = Manifest::new(id, "sh");
    m.run.args = vec!["-c".into(), format!("id > {}", mark.display())];
    m
}

pub(crate) async fn ask<T: serde::Serialize>(
    agent: &Agent,
    command: &str,
    body: &T,
) -> Result<serde_json::Value, SdkError> {
    let reply = agent
        .call(
            Call::agent(COORDINATOR, command)
                .payload(body)?
                .timeout(Duration::from_secs(10)),
        )
        .await?;
    reply.payload_as()
}

async fn deployments(admin: &Agent) -> Vec<String> {
    let views: Vec<DeploymentView> = serde_json::from_value(
        ask(admin, coordinator_commands::DEPLOYMENTS, &())
            .await
            .expect("the admin lists the deployments"),
    )
    .expect("deployment views");
    views.into_iter().map(|v| v.deployment).collect()
}

/// The admin terminates the deployment `kept`, and it is gone.
async fn terminate_kept(admin: &Agent) {
    ask(
        admin,
        coordinator_commands::TERMINATE,
        &TerminateRequest {
            deployment: "kept".into(),
        },
    )
    .await
    .expect("the admin terminates");
    assert!(deployments(admin).await.is_empty());
}

fn refusal(result: Result<serde_json::Value, SdkError>, what: &str) -> StatusCode {
    match result {
        Ok(v) => panic!("{what}: done, but should have been refused: {v}"),
        Err(e) => e.status(),
    }
}

/// Every hosting command an ordinary agent might try, each refused for want of a role.
async fn every_hosting_command_is_refused(agent: &Agent, mark: &std::path::Path, code: StatusCode) {
    let who = agent.id().to_owned();
    let deploy = DeployRequest {
        manifest: hostile("pwn", mark),
    };
    assert_eq!(
        refusal(
            ask(agent, coordinator_commands::DEPLOY, &deploy).await,
            "deploy"
        ),
        code,
        "{who} deploy"
    );
    let scale = ScaleRequest {
        deployment: "kept".into(),
        replicas: 3,
    };
    assert_eq!(
        refusal(
            ask(agent, coordinator_commands::SCALE, &scale).await,
            "scale"
        ),
        code,
        "{who} scale"
    );
    let terminate = TerminateRequest {
        deployment: "kept".into(),
    };
    assert_eq!(
        refusal(
            ask(agent, coordinator_commands::TERMINATE, &terminate).await,
            "terminate"
        ),
        code,
        "{who} terminate"
    );
    for command in [
        coordinator_commands::DEPLOYMENTS,
        coordinator_commands::HOSTS,
    ] {
        assert_eq!(
            refusal(ask(agent, command, &()).await, command),
            code,
            "{who} {command}"
        );
    }
}

#[tokio::test]
async fn on_a_development_bus_only_the_named_admins_deploy_and_an_agent_is_refused_with_nothing_changed()
 {
    let server = server();
    let mut config = coordinator_config(&server);
    config.authority = AuthorityConfig {
        admins: vec!["ops".into()],
        operators: vec!["viewer".into()],
        require_signed: None,
    };
    let coordinator = start_coordinator(config, true).await;
    let ops = agent(&server, "ops").await;
    let dir = tempfile::tempdir().expect("temp dir");
    let mark = dir.path().join("pwned");
    // The admin deploys a manifest no host runs (there is none here): it is kept, placed
    // nowhere, and every later step can see whether it changed.
    let mut kept = Manifest::new("kept", "true");
    kept.replicas = 1;
    ask(
        &ops,
        coordinator_commands::DEPLOY,
        &DeployRequest { manifest: kept },
    )
    .await
    .expect("the admin deploys");
    assert_eq!(deployments(&ops).await, vec!["kept".to_owned()]);

    let nlp = agent(&server, "nlp-agent").await;
    every_hosting_command_is_refused(&nlp, &mark, StatusCode::ACCESS).await;
    // The operator reads, and may not change.
    let viewer = agent(&server, "viewer").await;
    ask(&viewer, coordinator_commands::DEPLOYMENTS, &())
        .await
        .expect("an operator lists the deployments");
    let refused = ask(
        &viewer,
        coordinator_commands::TERMINATE,
        &TerminateRequest {
            deployment: "kept".into(),
        },
    )
    .await
    .expect_err("an operator does not terminate");
    assert_eq!(refused.status(), StatusCode::ACCESS);
    assert!(
        refused.to_string().contains("needs the admin role"),
        "{refused}"
    );

    // Nothing changed: the deployment is still there, with its one replica, and no mark.
    let views: Vec<DeploymentView> = serde_json::from_value(
        ask(&ops, coordinator_commands::DEPLOYMENTS, &())
            .await
            .expect("list"),
    )
    .expect("views");
    assert_eq!(views.len(), 1);
    assert_eq!(
        (views[0].deployment.as_str(), views[0].replicas),
        ("kept", 1)
    );
    assert!(!mark.exists(), "the hostile command ran");

    // Counted by reason.
    let addr = coordinator.metrics_addr().expect("metrics");
    let (_, text) = http_get(addr, "/metrics").await;
    let refused = metric_sum(
        &text,
        "chorus_coordinator_authority_refusals_total",
        &["reason=\"role\""],
    )
    .unwrap_or(0.0);
    assert!(refused >= 6.0, "role refusals counted: {refused}");

    terminate_kept(&ops).await;
    coordinator.shutdown().await;
}

#[tokio::test]
async fn where_signatures_are_required_a_role_counts_only_with_the_key_the_coordinator_holds() {
    let server = server();
    let ops_key = Identity::generate();
    let mut config = coordinator_config(&server);
    config.authority = AuthorityConfig {
        admins: vec!["ops".into()],
        operators: Vec::new(),
        require_signed: Some(true),
    };
    config
        .trusted_keys
        .insert("ops".into(), ops_key.public_key());
    let coordinator = start_coordinator(config, false).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let mark = dir.path().join("pwned");

    // Claiming to be ops without a signature: 5014.
    let unsigned = agent(&server, "ops").await;
    every_hosting_command_is_refused(&unsigned, &mark, StatusCode::UNAUTHORIZED).await;
    unsigned.shutdown().await;
    // Signed as ops with another key: 5004.
    let forger = agent_options(&server, "ops")
        .identity(Identity::generate())
        .connect()
        .await
        .expect("forger");
    every_hosting_command_is_refused(&forger, &mark, StatusCode::IDENTITY).await;
    forger.shutdown().await;
    // An agent with a key of its own, which the registry learns from it, is still an agent.
    let nlp = agent_options(&server, "nlp-agent")
        .identity(Identity::generate())
        .connect()
        .await
        .expect("nlp-agent");
    every_hosting_command_is_refused(&nlp, &mark, StatusCode::ACCESS).await;

    // ops, signing with its key, deploys and terminates.
    let ops = agent_options(&server, "ops")
        .identity(ops_key)
        .heartbeat_interval(Duration::ZERO)
        .connect()
        .await
        .expect("ops");
    ask(
        &ops,
        coordinator_commands::DEPLOY,
        &DeployRequest {
            manifest: Manifest::new("kept", "true"),
        },
    )
    .await
    .expect("ops deploys");
    assert_eq!(deployments(&ops).await, vec!["kept".to_owned()]);
    terminate_kept(&ops).await;
    assert!(!mark.exists(), "the hostile command ran");
    coordinator.shutdown().await;
}

/// Publishes a heartbeat for `agent` as a forger would, straight on the wire.
async fn forged_heartbeat(raw: &chorus_broker_adapter::Broker, agent: &str) {
    use chorus_sdk::codec::{self, Encoding};
    use chorus_sdk::{Envelope, Kind, Performative};
    let manifest: chorus_sdk::registry::Manifest = serde_json::from_value(serde_json::json!({
        "agent": agent,
        "instance": "forged",
        "heartbeat_ms": 60_000,
        "started_ms": chorus_sdk::envelope::now_ms(),
    }))
    .expect("manifest");
    let mut env = Envelope::new(Kind::Heartbeat, Performative::Health, agent);
    env.payload = codec::encode_payload(&manifest, chorus_sdk::envelope::CONTENT_TYPE_MSGPACK)
        .expect("payload");
    // Built by hand: the SDK's subject builder refuses such an id.
    raw.publish(
        &format!("chorus.sys.hb.{agent}"),
        codec::encode(&env, Encoding::MsgPack).expect("encode"),
    )
    .await
    .expect("publish");
}

#[tokio::test]
async fn a_heartbeat_with_a_hostile_id_is_not_registered() {
    let server = server();
    let coordinator = start_coordinator(coordinator_config(&server), true).await;
    let addr = coordinator.metrics_addr().expect("metrics");
    let refused = || async move {
        let (_, text) = http_get(addr, "/metrics").await;
        metric_sum(
            &text,
            "chorus_coordinator_messages_total",
            &["kind=\"heartbeat\"", "status=\"data_format\""],
        )
        .unwrap_or(0.0)
    };
    let before = refused().await;
    let raw = chorus_tests::raw_broker(&server).await;
    // No `>`: the client refuses a wildcard inside a token, but a server takes this one.
    let hostile = "<img/src/onerror=alert(1)";
    forged_heartbeat(&raw, hostile).await;
    forged_heartbeat(&raw, "plain-agent").await;
    let all = chorus_sdk::DiscoverQuery::default();
    chorus_tests::eventually(
        chorus_tests::WAIT,
        "the hostile heartbeat refused and the plain one registered",
        || async {
            let registered = coordinator
                .discover(&all)
                .iter()
                .any(|r| r.manifest.agent == "plain-agent");
            (registered && refused().await > before).then_some(())
        },
    )
    .await;
    let ids: Vec<String> = coordinator
        .discover(&all)
        .into_iter()
        .map(|r| r.manifest.agent)
        .collect();
    assert!(!ids.iter().any(|id| id == hostile), "registered: {ids:?}");
    coordinator.shutdown().await;
}

/// A signed durable command to an agent that requires signatures: its handler fails twice,
/// then succeeds. Each redelivery of the same stored message is not a replay, so it runs three
/// times and is acknowledged, with no dead letter; with `persist_seen_ids` too.
#[tokio::test]
async fn a_signed_durable_command_that_fails_twice_then_succeeds_is_retried_not_refused_as_a_replay()
 {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use chorus_sdk::durable::DeadLetterQueue;
    use chorus_sdk::security::SignaturePolicy;
    use chorus_sdk::{Context, HandlerError};

    let server = server();
    let _coordinator = start_coordinator(coordinator_config(&server), false).await;
    for persist in [false, true] {
        let worker_id = if persist { "payments-kept" } else { "payments" };
        let shop_key = Identity::generate();
        let tries = Arc::new(AtomicU32::new(0));
        let worker = agent_options(&server, worker_id)
            .durable_inbox(true)
            .retry_policies(crate::coordinator::fast_policy(5))
            .verify_signatures(SignaturePolicy {
                require_signed: true,
                ..SignaturePolicy::default()
            })
            .trust("shop", shop_key.public_key())
            .persist_seen_ids(persist)
            .connect()
            .await
            .expect("worker");
        let t = Arc::clone(&tries);
        worker
            .on_command("charge", move |_ctx: Context, cents: u32| {
                let attempt = t.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    if attempt <= 2 {
                        Err(HandlerError::failed("the card service is down"))
                    } else {
                        Ok(cents)
                    }
                }
            })
            .await
            .expect("register");
        let shop = agent_options(&server, "shop")
            .identity(shop_key)
            .heartbeat_interval(Duration::ZERO)
            .connect()
            .await
            .expect("shop");
        shop.send_durable(
            Call::agent(worker_id, "charge")
                .command()
                .payload(&4200u32)
                .expect("payload"),
        )
        .await
        .expect("stored");
        chorus_tests::eventually(chorus_tests::WAIT, "the third attempt", || async {
            (tries.load(Ordering::SeqCst) >= 3).then_some(())
        })
        .await;
        chorus_tests::eventually(chorus_tests::WAIT, "acknowledged", || async {
            chorus_tests::inbox_settled(&worker, worker_id)
                .await
                .then_some(())
        })
        .await;
        assert_eq!(tries.load(Ordering::SeqCst), 3, "persist {persist}");
        let dlq = DeadLetterQueue::new(shop.broker().clone(), shop.subjects().clone());
        let letters = dlq.list(10).await.expect("list");
        assert!(
            letters.iter().all(|l| l.letter.agent != worker_id),
            "persist {persist}: dead-lettered: {:?}",
            letters.iter().map(|l| &l.letter.detail).collect::<Vec<_>>()
        );
        assert_eq!(worker.stats().security_refused, 0, "persist {persist}");
        shop.shutdown().await;
        worker.shutdown().await;
    }
}

/// Answers one request on `subject` with a reply claiming to be from `bank`, signed by
/// `signer` (or unsigned), as a forger on the wire would.
async fn forge_one_reply(
    raw: chorus_broker_adapter::Broker,
    mut requests: chorus_broker_adapter::Subscription,
    signer: Option<Identity>,
) {
    use chorus_sdk::codec::{self, Encoding};
    use chorus_sdk::{Envelope, Kind, Performative};
    use futures::StreamExt;
    let msg = chorus_tests::within(chorus_tests::WAIT, "a request", requests.next())
        .await
        .expect("a request");
    let reply_to = msg.reply().expect("a reply subject").to_owned();
    let mut env = Envelope::new(Kind::Response, Performative::Inform, "bank");
    env.payload = codec::encode_payload(&"paid", "application/msgpack").expect("payload");
    if let Some(signer) = &signer {
        signer.sign(&reply_to, &mut env);
    }
    raw.publish(
        &reply_to,
        codec::encode(&env, Encoding::MsgPack).expect("encode"),
    )
    .await
    .expect("publish");
}

/// A Rust requester that verifies signatures checks its replies as it checks requests: a
/// reply from the real bank passes; one claiming to be the bank, signed by another key (5004)
/// or unsigned (5014), is refused.
#[tokio::test]
async fn a_requester_that_verifies_signatures_refuses_a_forged_or_unsigned_reply() {
    use chorus_sdk::security::SignaturePolicy;
    use chorus_sdk::{Context, HandlerError};

    let server = server();
    let bank_key = Identity::generate();
    let bank_public = bank_key.public_key();
    let bank = agent_options(&server, "bank")
        .identity(bank_key)
        .heartbeat_interval(Duration::ZERO)
        .connect()
        .await
        .expect("bank");
    bank.on_command("pay", |_ctx: Context, cents: u32| async move {
        Ok::<_, HandlerError>(format!("paid {cents}"))
    })
    .await
    .expect("pay");
    let shop = agent_options(&server, "shop")
        .heartbeat_interval(Duration::ZERO)
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..SignaturePolicy::default()
        })
        .trust("bank", &bank_public)
        .connect()
        .await
        .expect("shop");
    let paid: String = shop
        .request("bank", "pay", &5u32)
        .await
        .expect("the bank's reply");
    assert_eq!(paid, "paid 5");

    let raw = chorus_tests::raw_broker(&server).await;
    for (signer, code) in [
        (Some(Identity::generate()), StatusCode::IDENTITY),
        (None, StatusCode::UNAUTHORIZED),
    ] {
        let requests = raw
            .subscribe("chorus.agent.fake-bank.pay")
            .await
            .expect("subscribe");
        raw.sync(chorus_tests::WAIT)
            .await
            .expect("the subscription is in place");
        let forger = tokio::spawn(forge_one_reply(raw.clone(), requests, signer));
        let refused = shop
            .request::<_, String>("fake-bank", "pay", &5u32)
            .await
            .expect_err("a forged reply");
        assert_eq!(refused.status(), code, "{refused}");
        forger.await.expect("the forger answered");
    }
    assert_eq!(shop.stats().security_refused, 2);
}

/// Publishes `env`, which claims to be the coordinator's, on `subject`: signed by `signer`
/// (the coordinator's key, or a forger's) or unsigned.
async fn publish_as_coordinator(
    raw: &chorus_broker_adapter::Broker,
    subject: &str,
    mut env: chorus_sdk::Envelope,
    signer: Option<&Identity>,
) {
    use chorus_sdk::codec::{self, Encoding};
    if let Some(signer) = signer {
        signer.sign(subject, &mut env);
    }
    raw.publish(
        subject,
        codec::encode(&env, Encoding::MsgPack).expect("encode"),
    )
    .await
    .expect("publish");
}

/// Publishes an announcement on `sys.wire` claiming to be the coordinator's: protocol major 2,
/// signed by `signer` or unsigned.
async fn announce(raw: &chorus_broker_adapter::Broker, signer: Option<&Identity>) {
    use chorus_sdk::codec;
    use chorus_sdk::registry::WireLevel;
    use chorus_sdk::{Envelope, Kind, Performative};
    let subject = chorus_sdk::Subjects::default().wire();
    let mut env = Envelope::new(Kind::Event, Performative::Inform, "coordinator");
    env.payload = codec::encode_payload(
        &WireLevel {
            major: 2,
            heartbeat_ms: None,
        },
        "application/msgpack",
    )
    .expect("payload");
    publish_as_coordinator(raw, &subject, env, signer).await;
}

/// The form an event from `publisher` travels in now, read off the wire.
async fn form_now(
    publisher: &Agent,
    wire: &mut chorus_broker_adapter::Subscription,
) -> chorus_sdk::codec::Encoding {
    use futures::StreamExt;
    publisher.publish("probe", &1u32).await.expect("publish");
    let msg = chorus_tests::within(chorus_tests::WAIT, "probe on the wire", wire.next())
        .await
        .expect("probe");
    chorus_sdk::codec::Encoding::sniff(msg.payload()).expect("an envelope")
}

/// The coordinator's announcements on `sys.wire` are its word only when signed with its key,
/// where an agent verifies signatures and knows that key: a forged unsigned one (switching
/// the bus to protocol 2) is ignored and counted; the same signed with the coordinator's key
/// is followed.
#[tokio::test]
async fn a_forged_wire_announcement_is_ignored_where_the_coordinators_key_is_known() {
    use chorus_sdk::codec::Encoding;
    use chorus_sdk::security::SignaturePolicy;

    let server = server();
    let coordinator_key = Identity::generate();
    // No coordinator runs: nothing but these announcements tells the agent the bus's level.
    let publisher = agent_options(&server, "publisher")
        .verify_signatures(SignaturePolicy::default())
        .trust("coordinator", coordinator_key.public_key())
        .connect()
        .await
        .expect("publisher");
    let raw = chorus_tests::raw_broker(&server).await;
    let mut wire = raw.subscribe("chorus.evt.probe").await.expect("subscribe");
    raw.sync(chorus_tests::WAIT).await.expect("sync");
    assert_eq!(form_now(&publisher, &mut wire).await, Encoding::MsgPack);

    announce(&raw, None).await;
    chorus_tests::eventually(chorus_tests::WAIT, "the forgery counted", || async {
        (publisher.stats().security_refused >= 1).then_some(())
    })
    .await;
    assert_eq!(
        form_now(&publisher, &mut wire).await,
        Encoding::MsgPack,
        "a forged announcement switched the form"
    );

    announce(&raw, Some(&coordinator_key)).await;
    let deadline = std::time::Instant::now() + chorus_tests::WAIT;
    while form_now(&publisher, &mut wire).await != Encoding::Compact {
        assert!(
            std::time::Instant::now() < deadline,
            "the coordinator's signed word not followed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(publisher.stats().security_refused, 1);
}

/// A gateway identity with a key of its own signs what its callers send and announces its key
/// in the registry, so an agent that requires signatures (and was told no key by hand) serves
/// a gateway caller and sees who it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_requiring_signatures_serves_a_gateway_caller_and_sees_its_identity() {
    use chorus_gateway::config::{ApiKey, EdgeIdentity, GatewayConfig};
    use chorus_sdk::security::SignaturePolicy;
    use chorus_sdk::{Context, HandlerError};
    use sha2::Digest;

    let server = server();
    let dir = tempfile::tempdir().expect("temp dir");
    let seed = dir.path().join("web-ui.nk");
    std::fs::write(&seed, Identity::generate().seed().expect("seed")).expect("seed file");
    let mut config = coordinator_config(&server);
    config.gateway = GatewayConfig {
        listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
        identities: vec![EdgeIdentity {
            id: "web-ui".into(),
            nkey_seed_file: Some(seed),
            tenant: None,
        }],
        api_keys: vec![ApiKey {
            identity: "web-ui".into(),
            sha256: hex::encode(sha2::Sha256::digest(b"signed-edge-key")),
            scopes: Vec::new(),
        }],
        ..GatewayConfig::default()
    };
    let coordinator = start_coordinator(config, false).await;
    let gw = coordinator.gateway_addr().expect("the gateway listens");
    let strict = agent_options(&server, "strict")
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..SignaturePolicy::default()
        })
        .connect()
        .await
        .expect("strict");
    strict
        .on_command("whoami", |ctx: Context, (): ()| async move {
            Ok::<_, HandlerError>(format!("asked by {}", ctx.from()))
        })
        .await
        .expect("whoami");
    // Once the registry has told the agent web-ui's key, the caller is served.
    let args: Vec<String> = [
        "-H",
        "X-API-Key: signed-edge-key",
        "-H",
        "content-type: application/json",
        "-d",
        r#"{"to":"strict","command":"whoami"}"#,
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect();
    let answer = chorus_tests::eventually(chorus_tests::WAIT, "a gateway caller served", || {
        let args = args.clone();
        async move {
            let (status, _, body) = chorus_tests::curl(gw, "POST", "/v1/requests", &args, 10).await;
            (status == 200).then_some(body)
        }
    })
    .await;
    assert!(answer.contains("asked by web-ui"), "{answer}");
    coordinator.shutdown().await;
}

/// A task's cancel counts only from its requester (or the agent working on it, or the bus's
/// own agents): a stranger's cancel on the task's subject is ignored and counted, and the
/// requester's stops it.
#[tokio::test]
async fn a_strangers_cancel_is_ignored_and_the_requesters_stops_the_task() {
    use std::sync::{Arc, Mutex};

    use chorus_sdk::codec::{self, Encoding};
    use chorus_sdk::task::{TaskMessage, TaskStop};
    use chorus_sdk::{Envelope, HandlerError, Kind, Performative, TaskContext};

    let server = server();
    let worker = agent(&server, "slow").await;
    let seen: Arc<Mutex<Option<TaskStop>>> = Arc::default();
    let slot = Arc::clone(&seen);
    worker
        .on_task("wait", move |task: TaskContext, (): ()| {
            let slot = Arc::clone(&slot);
            async move {
                let why = task.cancelled().await;
                *slot.lock().expect("lock") = Some(why);
                Err::<(), _>(HandlerError::new(StatusCode::CANCELLED, "stopped"))
            }
        })
        .await
        .expect("wait");
    let boss = agent(&server, "boss").await;
    let task = boss
        .submit(Call::agent("slow", "wait").payload(&()).expect("payload"))
        .await
        .expect("submit");
    chorus_tests::eventually(chorus_tests::WAIT, "the task working", || async {
        task.report()
            .await
            .ok()
            .filter(|r| r.state == chorus_sdk::TaskState::Working)
    })
    .await;

    let raw = chorus_tests::raw_broker(&server).await;
    let mut cancel = Envelope::new(Kind::Command, Performative::Cancel, "mallory");
    cancel.name = Some("cancel".into());
    raw.publish(
        &chorus_sdk::Subjects::default().task(&task.id(), TaskMessage::Cancel),
        codec::encode(&cancel, Encoding::MsgPack).expect("encode"),
    )
    .await
    .expect("publish");
    chorus_tests::eventually(
        chorus_tests::WAIT,
        "the stranger's cancel counted",
        || async { (worker.stats().security_refused >= 1).then_some(()) },
    )
    .await;
    assert_eq!(
        *seen.lock().expect("lock"),
        None,
        "a stranger cancelled the task"
    );

    let report = chorus_tests::within(chorus_tests::WAIT, "cancel", task.cancel())
        .await
        .expect("cancel");
    assert_eq!(report.state, chorus_sdk::TaskState::Cancelled);
    assert_eq!(*seen.lock().expect("lock"), Some(TaskStop::Cancelled));
}

/// A worker, `payments`, that requires signatures and trusts `shop` and `trusted` by hand,
/// whose `charge` fails while `broken`; and `shop`, signing, which has sent it one durable
/// charge: it ends in the dead-letter queue (two attempts) while broken.
struct Payments {
    worker: Agent,
    shop: Agent,
    broken: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Charges handled, and who each was from.
    runs: std::sync::Arc<std::sync::atomic::AtomicU32>,
    senders: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    dlq: chorus_sdk::durable::DeadLetterQueue,
}

impl Payments {
    async fn start(server: &chorus_tests::NatsServer, trusted: (&str, String)) -> Payments {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

        use chorus_sdk::security::SignaturePolicy;
        use chorus_sdk::{Context, HandlerError};

        let shop_key = Identity::generate();
        let broken = Arc::new(AtomicBool::new(true));
        let (runs, senders) = (
            Arc::new(AtomicU32::new(0)),
            Arc::new(std::sync::Mutex::new(Vec::new())),
        );
        let worker = agent_options(server, "payments")
            .durable_inbox(true)
            .retry_policies(crate::coordinator::fast_policy(2))
            .verify_signatures(SignaturePolicy {
                require_signed: true,
                ..SignaturePolicy::default()
            })
            .trust("shop", shop_key.public_key())
            .trust(trusted.0, trusted.1)
            .persist_seen_ids(true)
            .connect()
            .await
            .expect("worker");
        let (b, r, s) = (Arc::clone(&broken), Arc::clone(&runs), Arc::clone(&senders));
        worker
            .on_command("charge", move |ctx: Context, cents: u32| {
                let failing = b.load(Ordering::SeqCst);
                if !failing {
                    r.fetch_add(1, Ordering::SeqCst);
                    s.lock().expect("senders").push(ctx.from().to_owned());
                }
                async move {
                    if failing {
                        Err(HandlerError::failed("the card service is down"))
                    } else {
                        Ok(cents)
                    }
                }
            })
            .await
            .expect("register");
        let shop = agent_options(server, "shop")
            .identity(shop_key)
            .heartbeat_interval(Duration::ZERO)
            .connect()
            .await
            .expect("shop");
        shop.send_durable(
            Call::agent("payments", "charge")
                .command()
                .payload(&4200u32)
                .expect("payload"),
        )
        .await
        .expect("stored");
        let dlq = chorus_sdk::durable::DeadLetterQueue::new(
            shop.broker().clone(),
            shop.subjects().clone(),
        );
        Payments {
            worker,
            shop,
            broken,
            runs,
            senders,
            dlq,
        }
    }

    /// The newest dead letter of payments, with status `reason` if given.
    async fn letter(&self, reason: Option<u16>) -> Option<chorus_sdk::durable::DlqEntry> {
        self.dlq
            .list(50)
            .await
            .ok()?
            .into_iter()
            .rev()
            .find(|l| l.letter.agent == "payments" && reason.is_none_or(|r| l.letter.status.0 == r))
    }

    fn runs(&self) -> u32 {
        self.runs.load(std::sync::atomic::Ordering::SeqCst)
    }

    async fn shutdown(self) {
        self.shop.shutdown().await;
        self.worker.shutdown().await;
    }
}

/// Issue 56: an operator's replay of a signed dead letter (docs/PROTOCOL.md, "Replaying a
/// signed dead letter"). A signed durable command to an agent that requires signatures fails
/// until it is dead-lettered; the fault is fixed. Replayed by someone the agent does not trust
/// (`mallory`), it is refused (5004) and dead-lettered again, the handler not run. Replayed by
/// the operator `ops`, whose key the agent trusts, it is handled once, its sender (`shop`)
/// still the one the handler sees. A second replay of the same dead letter, signed afresh by
/// ops, is refused as a replay (5015): handled once.
#[tokio::test]
async fn a_signed_dead_letter_replayed_by_a_trusted_operator_is_handled_once() {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    use chorus_sdk::security::replay::ReplayProof;

    let server = server();
    let _coordinator = start_coordinator(coordinator_config(&server), false).await;
    let ops_key = Arc::new(Identity::generate());
    let pay = Payments::start(&server, ("ops", ops_key.public_key())).await;
    let (dlq, shop) = (&pay.dlq, &pay.shop);
    let first =
        chorus_tests::eventually(chorus_tests::WAIT, "the dead letter", || pay.letter(None)).await;
    pay.broken.store(false, Ordering::SeqCst);

    // Mallory's replay: refused, dead-lettered again as refused 5004, nothing run.
    let mallory = dlq
        .clone()
        .signed_by("mallory", Arc::new(Identity::generate()));
    mallory.replay(first.id).await.expect("replayed");
    let refused = chorus_tests::eventually(chorus_tests::WAIT, "mallory's replay refused", || {
        pay.letter(Some(StatusCode::IDENTITY.0))
    })
    .await;
    assert!(
        refused
            .letter
            .detail
            .contains("replays are accepted only from senders trusted here"),
        "{}",
        refused.letter.detail
    );
    assert_eq!(pay.runs(), 0);

    // The operator's: handled once, as shop's.
    let ops = dlq.clone().signed_by("ops", Arc::clone(&ops_key));
    let entry = ops.show(refused.id).await.expect("the letter");
    ops.replay(refused.id).await.expect("replayed");
    chorus_tests::eventually(chorus_tests::WAIT, "the replay handled", || async {
        (pay.runs() == 1).then_some(())
    })
    .await;
    assert_eq!(
        *pay.senders.lock().expect("senders"),
        vec!["shop".to_owned()]
    );

    // The same dead letter replayed again, signed afresh: refused as a replay.
    let of = format!("{}:{}", shop.subjects().stream_name("DLQ"), refused.id);
    let message_id = entry.letter.message_id.expect("the original's id");
    let proof = ReplayProof::sign(
        &ops_key,
        "ops",
        &entry.letter.subject,
        message_id,
        &of,
        chorus_sdk::envelope::now_ms(),
    );
    let mut headers = chorus_broker_adapter::Headers::new();
    for (name, value) in proof.headers() {
        headers.insert(name, &value).expect("header");
    }
    shop.broker()
        .jetstream(Duration::from_secs(5))
        .publish(
            &entry.letter.subject,
            Some(headers),
            Some("replayed-again"),
            None,
            entry.letter.envelope.clone(),
        )
        .await
        .expect("published");
    let again = chorus_tests::eventually(chorus_tests::WAIT, "the second replay refused", || {
        pay.letter(Some(StatusCode::REPLAY.0))
    })
    .await;
    assert!(
        again.letter.detail.contains("replayed here already"),
        "{}",
        again.letter.detail
    );
    assert_eq!(pay.runs(), 1, "handled once");
    pay.shutdown().await;
}

/// Issue 56: MCP and A2A show only what the caller may call. A host's commands (`host-*`) and
/// the coordinator's start and stop programs: a scope granting every agent (`*`) neither lists
/// them as MCP tools nor reads their A2A cards (403), while it lists and reads an ordinary
/// agent's; a scope naming the host lists its tools. Anonymous public cards never show them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_and_a2a_list_only_what_the_caller_may_call() {
    use chorus_gateway::config::{ApiKey, EdgeIdentity};
    use chorus_gateway::{GatewayConfig, ScopeConfig};
    use chorus_sdk::{Context, HandlerError};
    use sha2::Digest;

    use crate::gateway::curl;

    let server = server();
    let sha = |k: &str| hex::encode(sha2::Sha256::digest(k.as_bytes()));
    let scope = |name: &str, agents: &[&str]| ScopeConfig {
        name: name.into(),
        routes: vec!["mcp".into(), "a2a".into()],
        agents: agents.iter().map(|a| (*a).to_owned()).collect(),
        capabilities: vec!["*".into()],
    };
    let (coordinator, gw) = crate::gateway::with_gateway(
        &server,
        GatewayConfig {
            listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
            identities: vec![EdgeIdentity {
                id: "mcp-host".into(),
                nkey_seed_file: None,
                tenant: None,
            }],
            api_keys: vec![
                ApiKey {
                    identity: "mcp-host".into(),
                    sha256: sha("every-agent-key-0123456789"),
                    scopes: vec!["every".into()],
                },
                ApiKey {
                    identity: "mcp-host".into(),
                    sha256: sha("hosting-admin-key-0123456789"),
                    scopes: vec!["hosting".into()],
                },
            ],
            scopes: vec![
                scope("every", &["*"]),
                scope("hosting", &["host-h1", "echo"]),
            ],
            public_cards: true,
            ..GatewayConfig::default()
        },
    )
    .await;
    let mut served = Vec::new();
    for (id, command) in [("echo", "ping"), ("host-h1", "deploy")] {
        let a = agent(&server, id).await;
        a.on_command(command, |_ctx: Context, n: u32| async move {
            Ok::<_, HandlerError>(n)
        })
        .await
        .expect("serve");
        served.push(a);
    }
    let list = |key: &'static str| async move {
        let a = curl(
            gw,
            "POST",
            "/mcp",
            &[
                &format!("X-API-Key: {key}"),
                "Accept: application/json, text/event-stream",
            ],
            Some(&serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.body);
        let mut names: Vec<String> = a.body["result"]["tools"]
            .as_array()
            .map(|t| {
                t.iter()
                    .filter_map(|t| t["name"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    };
    let every = chorus_tests::eventually(chorus_tests::WAIT, "echo's tool listed", || async {
        let names = list("every-agent-key-0123456789").await;
        names.iter().any(|n| n == "echo.ping").then_some(names)
    })
    .await;
    assert!(
        !every
            .iter()
            .any(|n| n.starts_with("host-") || n.starts_with("coordinator")),
        "{every:?}"
    );
    let hosting =
        chorus_tests::eventually(chorus_tests::WAIT, "the host's tool listed", || async {
            let names = list("hosting-admin-key-0123456789").await;
            names.iter().any(|n| n == "host-h1.deploy").then_some(names)
        })
        .await;
    assert!(hosting.contains(&"echo.ping".to_owned()), "{hosting:?}");

    let card = |key: Option<&'static str>, path: &'static str| async move {
        let auth = key.map(|k| format!("X-API-Key: {k}"));
        let headers: Vec<&str> = auth.iter().map(String::as_str).collect();
        curl(gw, "GET", path, &headers, None).await.status
    };
    let host_card = "/a2a/agents/host-h1/deploy/.well-known/agent-card.json";
    let echo_card = "/a2a/agents/echo/ping/.well-known/agent-card.json";
    let coordinator_card = "/a2a/agents/coordinator/deploy/.well-known/agent-card.json";
    assert_eq!(
        card(Some("every-agent-key-0123456789"), echo_card).await,
        200
    );
    assert_eq!(
        card(Some("every-agent-key-0123456789"), host_card).await,
        403
    );
    assert_eq!(
        card(Some("every-agent-key-0123456789"), coordinator_card).await,
        403
    );
    assert_eq!(
        card(Some("hosting-admin-key-0123456789"), host_card).await,
        200
    );
    assert_eq!(card(None, echo_card).await, 200);
    assert_eq!(card(None, host_card).await, 403);
    assert_eq!(card(None, coordinator_card).await, 403);

    for a in served {
        a.shutdown().await;
    }
    coordinator.shutdown().await;
}

/// Issue 56: an MCP session that expires ends its calls, and the tasks they started are
/// cancelled on the bus, as when its client ends it. A client opens a session, calls a tool
/// backed by a task and goes away without a word; once the session has been idle past
/// `session_idle_secs`, the worker sees its task cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_mcp_sessions_tasks_are_cancelled() {
    use chorus_gateway::GatewayConfig;
    use chorus_gateway::config::{ApiKey, EdgeIdentity, McpConfig};
    use chorus_sdk::{HandlerError, TaskContext};
    use sha2::Digest;

    let server = server();
    let key = "mcp-expiry-key-0123456789";
    let (coordinator, gw) = crate::gateway::with_gateway(
        &server,
        GatewayConfig {
            listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
            identities: vec![EdgeIdentity {
                id: "mcp-host".into(),
                nkey_seed_file: None,
                tenant: None,
            }],
            api_keys: vec![ApiKey {
                identity: "mcp-host".into(),
                sha256: hex::encode(sha2::Sha256::digest(key.as_bytes())),
                scopes: Vec::new(),
            }],
            mcp: McpConfig {
                session_idle_secs: 2,
                ..McpConfig::default()
            },
            ..GatewayConfig::default()
        },
    )
    .await;
    let worker = agent(&server, "writer").await;
    let started = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (cancelled_tx, mut cancelled) = tokio::sync::mpsc::unbounded_channel();
    let began = std::sync::Arc::clone(&started);
    worker
        .on_task(
            "draft",
            move |task: TaskContext, _topic: serde_json::Value| {
                let (began, cancelled_tx) = (std::sync::Arc::clone(&began), cancelled_tx.clone());
                async move {
                    began.store(true, std::sync::atomic::Ordering::SeqCst);
                    let _ = task.cancelled().await;
                    let _ = cancelled_tx.send(());
                    Err::<String, _>(HandlerError::new(StatusCode::CANCELLED, "cancelled"))
                }
            },
        )
        .await
        .expect("serve draft");
    let auth = format!("X-API-Key: {key}");
    let init = serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "expiry-test", "version": "1"}}});
    let opened = crate::gateway::curl(
        gw,
        "POST",
        "/mcp",
        &[&auth, "Accept: application/json, text/event-stream"],
        Some(&init),
    )
    .await;
    assert_eq!(opened.status, 200, "{}", opened.body);
    let session = opened
        .headers
        .lines()
        .find_map(|l| l.strip_prefix("mcp-session-id:"))
        .map(|v| v.trim().to_owned())
        .expect("a session id");
    // The tool appears once the registry has the writer; the call is made and abandoned.
    let call = serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "writer.draft", "arguments": {"input": "plans"}}});
    let args = vec![
        "-H".to_owned(),
        auth.clone(),
        "-H".to_owned(),
        format!("Mcp-Session-Id: {session}"),
        "-H".to_owned(),
        "Accept: application/json, text/event-stream".to_owned(),
        "-H".to_owned(),
        "content-type: application/json".to_owned(),
        "--data-binary".to_owned(),
        call.to_string(),
    ];
    chorus_tests::eventually(chorus_tests::WAIT, "the task started", || async {
        // The client gives up after a second: its call stays with the session.
        let _ = chorus_tests::curl(gw, "POST", "/mcp", &args, 1).await;
        started
            .load(std::sync::atomic::Ordering::SeqCst)
            .then_some(())
    })
    .await;
    chorus_tests::within(
        Duration::from_secs(20),
        "the task cancelled",
        cancelled.recv(),
    )
    .await
    .expect("cancelled");
    worker.shutdown().await;
    coordinator.shutdown().await;
}

/// A `registry.left` event (5009, the worker's heartbeats stopped) as the registry writes it,
/// claiming to be the coordinator's: signed by `signer` or unsigned.
async fn departure(raw: &chorus_broker_adapter::Broker, worker: &str, signer: Option<&Identity>) {
    use chorus_sdk::codec;
    use chorus_sdk::{Envelope, Kind, Performative};
    let subject = chorus_sdk::Subjects::default()
        .event("registry.left")
        .expect("subject");
    let mut env = Envelope::new(Kind::Event, Performative::Inform, "coordinator");
    env.topic = Some("registry.left".into());
    env.status = Some(StatusCode::UNEXPECTED_DISCONNECT);
    env.payload = codec::encode_payload(
        &chorus_coordinator::service::registry::RegistryEvent {
            agent: worker.into(),
            instance: "i".into(),
            reason: "missed heartbeats".into(),
        },
        "application/msgpack",
    )
    .expect("payload");
    publish_as_coordinator(raw, &subject, env, signer).await;
}

/// A requester gives up a task whose worker the registry declares gone without a goodbye.
/// Where it verifies signatures and knows the coordinator's key, a forged departure (unsigned)
/// is ignored and counted, and the task goes on; the coordinator's signed word ends it. The
/// coordinator signs its registry events with its key: a requester that verifies takes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_departure_does_not_end_a_task_where_the_coordinators_key_is_known() {
    use chorus_sdk::security::SignaturePolicy;
    use chorus_sdk::{TaskContext, TaskState};
    use futures::StreamExt;

    let server = server();
    let coordinator_key = Identity::generate();
    let dir = tempfile::tempdir().expect("temp dir");
    let seed = dir.path().join("coordinator.nk");
    std::fs::write(&seed, coordinator_key.seed().expect("seed")).expect("seed file");
    let mut config = coordinator_config(&server);
    config.security.nkey_seed_file = Some(seed);
    let coordinator = start_coordinator(config, false).await;
    let raw = chorus_tests::raw_broker(&server).await;

    // The coordinator's own registry events carry its signature.
    let mut joined = raw
        .subscribe("chorus.evt.registry.joined")
        .await
        .expect("subscribe");
    raw.sync(chorus_tests::WAIT).await.expect("sync");
    let worker = agent(&server, "slow-worker").await;
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    worker
        .on_task("wait", move |_task: TaskContext, _: u32| {
            let started_tx = started_tx.clone();
            async move {
                let _ = started_tx.send(());
                std::future::pending::<()>().await;
                Ok::<u32, chorus_sdk::HandlerError>(0)
            }
        })
        .await
        .expect("wait");
    let event = chorus_tests::within(chorus_tests::WAIT, "registry.joined", joined.next())
        .await
        .expect("an event");
    let (env, _) = chorus_sdk::codec::decode(event.payload()).expect("an envelope");
    let checker = chorus_sdk::security::Verifier::new(SignaturePolicy::default());
    checker.trust("coordinator", &coordinator_key.public_key());
    checker
        .verify(event.subject(), &env, chorus_sdk::envelope::now_ms())
        .expect("the registry event is signed with the coordinator's key");

    let requester = agent_options(&server, "requester")
        .verify_signatures(SignaturePolicy::default())
        .trust("coordinator", coordinator_key.public_key())
        .connect()
        .await
        .expect("requester");
    let task = requester
        .submit(
            Call::agent("slow-worker", "wait")
                .payload(&1u32)
                .expect("payload"),
        )
        .await
        .expect("submit");
    chorus_tests::within(chorus_tests::WAIT, "the worker starts", started.recv())
        .await
        .expect("started");
    let mut result = tokio::spawn(async move { task.result().await });
    // Forged until one is counted (the requester hears departures once it waits on the
    // result and knows the worker has the task).
    let forged = std::sync::atomic::AtomicU64::new(0);
    tokio::select! {
        ended = &mut result => panic!("a forged departure ended the task: {ended:?}"),
        () = chorus_tests::eventually(chorus_tests::WAIT, "the forgery counted", || async {
            departure(&raw, "slow-worker", None).await;
            forged.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            (requester.stats().security_refused >= 1).then_some(())
        }) => {}
    }
    departure(&raw, "slow-worker", Some(&coordinator_key)).await;
    let report = chorus_tests::within(chorus_tests::WAIT, "the task given up", result)
        .await
        .expect("the waiter")
        .expect("a report");
    assert_eq!(report.state, TaskState::Failed);
    // Every forgery the requester heard refused, and the signed word not among them.
    assert!(
        requester.stats().security_refused <= forged.load(std::sync::atomic::Ordering::Relaxed),
        "the coordinator's signed departure was refused"
    );
    worker.shutdown().await;
    coordinator.shutdown().await;
}

/// The web console in the coordinator's process replays dead letters in the coordinator's
/// name, signed with its key (PROTOCOL.md 7.8): an agent that requires signatures and trusts
/// that key handles the replay of a signed dead letter once, as its original sender's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_replays_a_signed_dead_letter_in_the_coordinators_name_handled_once() {
    use std::sync::atomic::Ordering;

    use chorus_gateway::ScopeConfig;
    use chorus_gateway::config::{ApiKey, ConsoleConfig, EdgeIdentity, GatewayConfig};
    use sha2::Digest;

    const OPS_KEY: &str = "ops-console-key-0123456789abcdef";
    let server = server();
    let coordinator_key = Identity::generate();
    let dir = tempfile::tempdir().expect("temp dir");
    let seed = dir.path().join("coordinator.nk");
    std::fs::write(&seed, coordinator_key.seed().expect("seed")).expect("seed file");
    let mut config = coordinator_config(&server);
    config.signing_seed_file = Some(seed);
    config.gateway = GatewayConfig {
        identities: vec![EdgeIdentity {
            id: "ops".into(),
            nkey_seed_file: None,
            tenant: None,
        }],
        api_keys: vec![ApiKey {
            identity: "ops".into(),
            sha256: hex::encode(sha2::Sha256::digest(OPS_KEY.as_bytes())),
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
    };
    let coordinator = start_coordinator(config, false).await;
    let console = coordinator.console_addr().expect("the console listens");

    let pay = Payments::start(&server, ("coordinator", coordinator_key.public_key())).await;
    let letter =
        chorus_tests::eventually(chorus_tests::WAIT, "the dead letter", || pay.letter(None)).await;
    pay.broken.store(false, Ordering::SeqCst);

    let answer = crate::gateway::curl(
        console,
        "POST",
        &format!("/dlq/{}/replay", letter.id),
        &[&format!("x-api-key: {OPS_KEY}")],
        None,
    )
    .await;
    assert!(
        (200..400).contains(&answer.status),
        "the console's replay: {} {}",
        answer.status,
        answer.body
    );
    chorus_tests::eventually(chorus_tests::WAIT, "the replay handled", || async {
        (pay.runs() == 1).then_some(())
    })
    .await;
    assert_eq!(
        *pay.senders.lock().expect("senders"),
        vec!["shop".to_owned()]
    );
    // Not dead-lettered again: the replay was taken, not refused.
    assert!(
        pay.dlq
            .list(50)
            .await
            .expect("list")
            .iter()
            .all(|l| l.letter.agent != "payments"),
        "the console's replay was refused"
    );
    pay.shutdown().await;
    coordinator.shutdown().await;
}
