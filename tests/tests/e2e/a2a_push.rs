//! A2A push notifications (issue 33, item 12): a client registers a webhook for its task and
//! the gateway posts the task's updates there, signed; configs are created, read, listed and
//! deleted; a webhook outside the allow-list is refused; a webhook that stays down gets its
//! bounded retries and the update lands in the dead-letter queue.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use chorus_coordinator::service::dlq::DeadLetterQueue;
use chorus_gateway::config::{ApiKey, EdgeIdentity};
use chorus_gateway::{GatewayConfig, PushConfig};
use chorus_sdk::durable::DeadLetterReason;
use chorus_sdk::{HandlerError, TaskContext};
use chorus_tests::{WAIT, agent, eventually, server, within};
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Digest;
use tokio::sync::{Notify, mpsc};

use super::gateway::{LocalHttp, curl, with_gateway};

const API_KEY: &str = "k-push-7d1e3b5c9a2f4e6d8c0b1a3e5f7d9b2c";
const SIGNING_SECRET: &str = "a-push-signing-secret-of-32-bytes-or-more";
/// How long the steps that start a second coordinator may take (see their comment).
const SLOW: std::time::Duration = std::time::Duration::from_secs(60);

/// How many deliveries the webhook's down route refused.
#[derive(Default)]
struct Hook {
    refused: Mutex<u32>,
}

/// The webhook's state: the refusals, and where each taken delivery (headers, body) goes.
type Webhook = (Arc<Hook>, mpsc::UnboundedSender<(HeaderMap, Value)>);

async fn ok(State((_, seen)): State<Webhook>, headers: HeaderMap, body: String) -> StatusCode {
    let value = serde_json::from_str(&body).unwrap_or(Value::String(body));
    let _ = seen.send((headers, value));
    StatusCode::NO_CONTENT
}

async fn down(State((hook, _)): State<Webhook>) -> StatusCode {
    *hook.refused.lock().expect("count") += 1;
    StatusCode::SERVICE_UNAVAILABLE
}

fn verify(headers: &HeaderMap, body: &Value) {
    let at = headers["x-chorus-timestamp"].to_str().expect("a timestamp");
    let signature = headers["x-chorus-signature"].to_str().expect("a signature");
    let mut mac =
        <Hmac<sha2::Sha256> as Mac>::new_from_slice(SIGNING_SECRET.as_bytes()).expect("key");
    mac.update(format!("{at}.{body}").as_bytes());
    let expected = format!("sha256={}", hex::encode(mac.finalize().into_bytes()));
    assert_eq!(signature, expected, "the signature of {body}");
}

/// A gateway whose one identity, `hooked`, is reached with [`API_KEY`], with `push`.
fn hooked(push: PushConfig) -> GatewayConfig {
    GatewayConfig {
        listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        identities: vec![EdgeIdentity {
            id: "hooked".into(),
            nkey_seed_file: None,
            tenant: None,
        }],
        api_keys: vec![ApiKey {
            identity: "hooked".into(),
            sha256: hex::encode(sha2::Sha256::digest(API_KEY.as_bytes())),
            scopes: Vec::new(),
        }],
        push: Some(push),
        ..GatewayConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_notifications_reach_an_allowed_webhook_signed_and_a_dead_one_ends_in_the_dlq() {
    let server = server();
    // The webhook: /hooks/ok takes every delivery, /hooks/down refuses every one.
    let hook = Arc::new(Hook::default());
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let app = axum::Router::new()
        .route("/hooks/ok", axum::routing::post(ok))
        .route("/hooks/down", axum::routing::post(down))
        .with_state((Arc::clone(&hook), seen_tx));
    let webhook = LocalHttp::serve(app).await;
    let hook_addr = webhook.addr;

    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("push.secret");
    std::fs::write(&secret, SIGNING_SECRET).expect("secret");
    let (coordinator, gw) = with_gateway(
        &server,
        hooked(PushConfig {
            allow: vec![format!("http://{hook_addr}/hooks")],
            max_attempts: 3,
            first_backoff_ms: 20,
            max_backoff_ms: 100,
            signing_secret_file: Some(secret),
            ..PushConfig::default()
        }),
    )
    .await;

    // A writer whose task streams two chunks once the test says go.
    let go = Arc::new(Notify::new());
    let writer = agent(&server, "writer").await;
    let gate = Arc::clone(&go);
    writer
        .on_task("draft", move |task: TaskContext, topic: String| {
            let gate = Arc::clone(&gate);
            async move {
                gate.notified().await;
                task.chunk(&"about ").await?;
                task.last_chunk(&topic).await?;
                Ok::<_, HandlerError>(format!("about {topic}"))
            }
        })
        .await
        .expect("serve draft");
    let base = "/a2a/agents/writer/draft/";
    let key = format!("X-API-Key: {API_KEY}");
    let headers = [key.as_str(), "A2A-Version: 1.0"];
    let rpc = |method: &'static str, params: Value| {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let headers = headers.map(str::to_owned);
        async move {
            let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
            let a = curl(gw, "POST", base, &headers, Some(&body)).await;
            assert_eq!(a.status, 200, "{method}: {}", a.body);
            a.body
        }
    };
    eventually(WAIT, "the writer registered", || async {
        let card = curl(
            gw,
            "GET",
            "/a2a/agents/writer/draft/.well-known/agent-card.json",
            &headers,
            None,
        )
        .await;
        (card.body["capabilities"]["pushNotifications"] == json!(true)).then_some(())
    })
    .await;
    let message = |text: &str| json!({"messageId": uuid::Uuid::now_v7().to_string(), "role": "ROLE_USER", "parts": [{"text": text}]});

    // A webhook outside the allow-list is refused before anything is submitted.
    for url in [
        "http://169.254.169.254/latest",
        &format!("http://{hook_addr}/elsewhere"),
        "file:///etc/passwd",
    ] {
        let refused = rpc(
            "SendMessage",
            json!({"message": message("x"), "configuration": {
            "returnImmediately": true, "taskPushNotificationConfig": {"url": url}}}),
        )
        .await;
        assert_eq!(refused["error"]["code"], -32602, "{url}: {refused}");
    }

    // A task with its webhook given in the message, and a second config added after.
    let sent = rpc("SendMessage", json!({"message": message("pushes"), "configuration": {
        "returnImmediately": true,
        "taskPushNotificationConfig": {"id": "first", "url": format!("http://{hook_addr}/hooks/ok"),
            "token": "t-123", "authentication": {"scheme": "Bearer", "credentials": "hook-secret"}}}})).await;
    let task = sent["result"]["task"]["id"]
        .as_str()
        .expect("a task")
        .to_owned();
    let second = rpc(
        "CreateTaskPushNotificationConfig",
        json!({"taskId": task, "id": "second",
        "url": format!("http://{hook_addr}/hooks/ok?copy=2")}),
    )
    .await;
    assert_eq!(second["result"]["id"], "second", "{second}");
    let got = rpc(
        "GetTaskPushNotificationConfig",
        json!({"taskId": task, "id": "first"}),
    )
    .await;
    assert_eq!(got["result"]["token"], "t-123", "{got}");
    assert!(
        got["result"]["authentication"].get("credentials").is_none(),
        "credentials are not shown: {got}"
    );
    let listed = rpc("ListTaskPushNotificationConfigs", json!({"taskId": task})).await;
    assert_eq!(
        listed["result"]["configs"].as_array().map(Vec::len),
        Some(2),
        "{listed}"
    );
    rpc(
        "DeleteTaskPushNotificationConfig",
        json!({"taskId": task, "id": "second"}),
    )
    .await;
    rpc(
        "DeleteTaskPushNotificationConfig",
        json!({"taskId": task, "id": "second"}),
    )
    .await;
    let listed = rpc("ListTaskPushNotificationConfigs", json!({"taskId": task})).await;
    assert_eq!(
        listed["result"]["configs"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );
    let missing = rpc(
        "GetTaskPushNotificationConfig",
        json!({"taskId": task, "id": "second"}),
    )
    .await;
    assert_eq!(missing["error"]["code"], -32001, "{missing}");

    // Go: every update reaches the webhook, in order, signed, with the config's credentials.
    go.notify_one();
    let mut kinds = Vec::new();
    loop {
        let (headers, body) = within(WAIT, "a push delivery", seen.recv())
            .await
            .expect("a delivery");
        verify(&headers, &body);
        assert_eq!(headers["authorization"], "Bearer hook-secret");
        assert_eq!(headers["x-a2a-notification-token"], "t-123");
        let kind = body
            .as_object()
            .and_then(|o| o.keys().next().cloned())
            .expect("one member");
        let done =
            body.pointer("/statusUpdate/status/state") == Some(&json!("TASK_STATE_COMPLETED"));
        kinds.push((kind, body));
        if done {
            break;
        }
    }
    let chunks: Vec<&Value> = kinds
        .iter()
        .filter(|(_, b)| b.pointer("/artifactUpdate/artifact/name") == Some(&json!("stream")))
        .map(|(_, b)| &b["artifactUpdate"]["artifact"]["parts"][0]["text"])
        .collect();
    assert_eq!(chunks, [&json!("about "), &json!("pushes")], "{kinds:?}");
    assert!(
        kinds
            .iter()
            .any(|(_, b)| b.pointer("/artifactUpdate/artifact/name") == Some(&json!("result")))
    );
    // Once the task has ended its configs are gone, and a new one is refused: no update follows.
    eventually(WAIT, "the ended task's configs removed", || async {
        let listed = rpc("ListTaskPushNotificationConfigs", json!({"taskId": task})).await;
        (listed["result"]["configs"] == json!([])).then_some(())
    })
    .await;
    let late = rpc(
        "CreateTaskPushNotificationConfig",
        json!({"taskId": task, "url": format!("http://{hook_addr}/hooks/ok")}),
    )
    .await;
    assert_eq!(late["error"]["code"], -32004, "{late}");

    // A webhook that stays down: three attempts, then the update is a dead letter.
    let sent = rpc(
        "SendMessage",
        json!({"message": message("nobody"), "configuration": {
        "returnImmediately": true,
        "taskPushNotificationConfig": {"url": format!("http://{hook_addr}/hooks/down")}}}),
    )
    .await;
    let dead_task = sent["result"]["task"]["id"]
        .as_str()
        .expect("a task")
        .to_owned();
    go.notify_one();
    let dlq = DeadLetterQueue::new(writer.broker().clone(), writer.subjects().clone());
    let letter = eventually(WAIT, "the push dead letter", || async {
        dlq.list(100)
            .await
            .expect("dlq")
            .into_iter()
            .find(|e| e.letter.agent == "hooked" && e.letter.detail.contains("/hooks/down"))
    })
    .await;
    assert_eq!(letter.letter.reason, DeadLetterReason::MaxAttempts);
    assert_eq!(letter.letter.attempts, 3);
    assert_eq!(
        *hook.refused.lock().expect("count"),
        3,
        "exactly the attempts allowed"
    );
    let (env, _) =
        chorus_sdk::codec::decode(&letter.letter.envelope).expect("the update as an envelope");
    assert_eq!(
        env.correlation_id.map(|u| u.to_string()),
        Some(dead_task.clone())
    );
    // The config is dropped after its dead letter: no more attempts.
    let listed = rpc(
        "ListTaskPushNotificationConfigs",
        json!({"taskId": dead_task}),
    )
    .await;
    assert_eq!(listed["result"]["configs"], json!([]), "{listed}");

    writer.shutdown().await;
    coordinator.shutdown().await;
    webhook.stop().await;
}

/// Issue 33, item 13: A2A tenants. Each tenant is its own subject root (its own agents, task
/// stream and registry); a tenant's identity reaches only its tenant. Two tenants on one bus,
/// each with a writer of its own: a task one tenant submits is done by its own writer, and the
/// other tenant can neither get, list, cancel nor subscribe to it, nor name the first tenant
/// in a call, over JSON-RPC or REST.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_on_one_bus_never_see_each_others_tasks() {
    let server = server();
    let key = |k: &str, identity: &str| ApiKey {
        identity: identity.into(),
        sha256: hex::encode(sha2::Sha256::digest(k.as_bytes())),
        scopes: Vec::new(),
    };
    let identity = |id: &str, tenant: &str| EdgeIdentity {
        id: id.into(),
        nkey_seed_file: None,
        tenant: Some(tenant.into()),
    };
    let (coordinator, gw) = with_gateway(
        &server,
        GatewayConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            tenants: vec![
                chorus_gateway::Tenant {
                    name: "acme".into(),
                    root: "acme".into(),
                },
                chorus_gateway::Tenant {
                    name: "globex".into(),
                    root: "globex".into(),
                },
            ],
            identities: vec![identity("acme-ui", "acme"), identity("globex-ui", "globex")],
            api_keys: vec![
                key("k-acme-0123456789abcdef", "acme-ui"),
                key("k-globex-0123456789abcdef", "globex-ui"),
            ],
            ..GatewayConfig::default()
        },
    )
    .await;
    // Each tenant's writer, under its tenant's root, says whose it is.
    let mut writers = Vec::new();
    for tenant in ["acme", "globex"] {
        let writer = within(
            WAIT,
            "writer connect",
            chorus_tests::agent_options(&server, "writer")
                .root(tenant)
                .connect(),
        )
        .await
        .expect("writer connects");
        let name = tenant.to_owned();
        writer
            .on_task("draft", move |task: TaskContext, topic: String| {
                let name = name.clone();
                async move {
                    if topic == "wait" {
                        let _ = task.cancelled().await;
                        return Err(HandlerError::new(
                            chorus_sdk::StatusCode::CANCELLED,
                            "cancelled",
                        ));
                    }
                    Ok::<_, HandlerError>(format!("{name}'s writer on {topic}"))
                }
            })
            .await
            .expect("serve draft");
        writers.push(writer);
    }
    let acme = ["X-API-Key: k-acme-0123456789abcdef", "A2A-Version: 1.0"];
    let globex = ["X-API-Key: k-globex-0123456789abcdef", "A2A-Version: 1.0"];
    let base = "/a2a/agents/writer/draft/";
    let rpc = |headers: [&'static str; 2], method: &'static str, params: Value| async move {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let a = curl(gw, "POST", base, &headers, Some(&body)).await;
        assert_eq!(a.status, 200, "{method}: {}", a.body);
        a.body
    };
    let message = |text: &str| json!({"messageId": uuid::Uuid::now_v7().to_string(), "role": "ROLE_USER", "parts": [{"text": text}]});

    // Acme's task, done by acme's writer; a long one left running to try to cancel.
    let done = rpc(
        acme,
        "SendMessage",
        json!({"message": message("plans"), "tenant": "acme"}),
    )
    .await;
    let done_task = &done["result"]["task"];
    assert_eq!(
        done_task["status"]["state"], "TASK_STATE_COMPLETED",
        "{done}"
    );
    assert_eq!(
        done_task["artifacts"][0]["parts"][0]["text"], "acme's writer on plans",
        "{done}"
    );
    let done_id = done_task["id"].as_str().expect("id").to_owned();
    let running = rpc(
        acme,
        "SendMessage",
        json!({"message": message("wait"), "configuration": {"returnImmediately": true}}),
    )
    .await;
    let running_id = running["result"]["task"]["id"]
        .as_str()
        .expect("id")
        .to_owned();

    // Globex sees none of it, and cannot name acme.
    for id in [&done_id, &running_id] {
        for method in ["GetTask", "CancelTask", "SubscribeToTask"] {
            let refused = rpc(globex, method, json!({"id": id})).await;
            assert_eq!(refused["error"]["code"], -32001, "{method}: {refused}");
            let named = rpc(globex, method, json!({"id": id, "tenant": "acme"})).await;
            assert_eq!(
                named["error"]["code"], -32602,
                "{method} naming acme: {named}"
            );
        }
    }
    let listed = rpc(globex, "ListTasks", json!({})).await;
    assert_eq!(listed["result"]["totalSize"], 0, "{listed}");
    let listed = rpc(globex, "ListTasks", json!({"tenant": "acme"})).await;
    assert_eq!(listed["error"]["code"], -32602, "{listed}");
    // Globex's own task is its writer's, in its own list.
    let own = rpc(globex, "SendMessage", json!({"message": message("plans")})).await;
    assert_eq!(
        own["result"]["task"]["artifacts"][0]["parts"][0]["text"], "globex's writer on plans",
        "{own}"
    );
    let listed = rpc(globex, "ListTasks", json!({"tenant": "globex"})).await;
    assert_eq!(listed["result"]["totalSize"], 1, "{listed}");
    // Acme lists its two, over REST too, with its tenant in the path.
    let a = curl(
        gw,
        "GET",
        "/a2a/agents/writer/draft/acme/tasks",
        &acme,
        None,
    )
    .await;
    assert_eq!(
        (a.status, a.body["totalSize"].clone()),
        (200, json!(2)),
        "{}",
        a.body
    );
    let a = curl(
        gw,
        "GET",
        &format!("/a2a/agents/writer/draft/tasks/{done_id}"),
        &globex,
        None,
    )
    .await;
    assert_eq!(a.status, 404, "{}", a.body);
    let a = curl(
        gw,
        "GET",
        &format!("/a2a/agents/writer/draft/acme/tasks/{done_id}"),
        &globex,
        None,
    )
    .await;
    assert_eq!(a.status, 400, "{}", a.body);
    // The running task is still acme's to cancel.
    let cancelled = rpc(acme, "CancelTask", json!({"id": running_id})).await;
    assert_eq!(
        cancelled["result"]["status"]["state"], "TASK_STATE_CANCELED",
        "{cancelled}"
    );
    // The card (from acme's own registry: a coordinator under acme's root) tells the caller
    // its tenant.
    // A second coordinator and its registry's first heartbeat: on a loaded machine (the suite's
    // first tests start while others build the CLI) this can take longer than a call.
    let acme_coordinator = within(
        SLOW,
        "acme's coordinator",
        chorus_coordinator::Coordinator::start(
            chorus_coordinator::CoordinatorConfig {
                servers: server.url().to_owned(),
                root: "acme".into(),
                metrics_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
                reap_interval_ms: 50,
                ..chorus_coordinator::CoordinatorConfig::default()
            },
            false,
        ),
    )
    .await
    .expect("acme's coordinator");
    let card = eventually(SLOW, "acme's card", || async {
        let card = curl(
            gw,
            "GET",
            "/a2a/agents/writer/draft/.well-known/agent-card.json",
            &acme,
            None,
        )
        .await;
        (card.status == 200).then_some(card)
    })
    .await;
    assert_eq!(
        card.body["supportedInterfaces"][0]["tenant"], "acme",
        "{}",
        card.body
    );
    acme_coordinator.shutdown().await;

    for writer in writers {
        writer.shutdown().await;
    }
    coordinator.shutdown().await;
}

/// Push configs are kept in JetStream: a gateway that stops (its coordinator shut down) and
/// starts again reads them back and goes on from the first update each config has not had,
/// with the webhook's credentials as given. What the task did while no gateway ran reaches
/// the webhook after the restart, what was delivered before is not sent again, and the
/// config's record goes when the task ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_configs_outlive_a_gateway_restart_and_go_on_where_they_stopped() {
    let server = server();
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let app = axum::Router::new()
        .route("/hooks/ok", axum::routing::post(ok))
        .with_state((Arc::new(Hook::default()), seen_tx));
    let webhook = LocalHttp::serve(app).await;
    let hook_addr = webhook.addr;
    let config = hooked(PushConfig {
        allow: vec![format!("http://{hook_addr}/hooks")],
        ..PushConfig::default()
    });
    let (coordinator, gw) = with_gateway(&server, config.clone()).await;

    // A writer whose task streams "one", then waits, then streams "two" and ends.
    let (first, second) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let writer = agent(&server, "writer").await;
    let gates = (Arc::clone(&first), Arc::clone(&second));
    writer
        .on_task("draft", move |task: TaskContext, (): ()| {
            let (first, second) = gates.clone();
            async move {
                first.notified().await;
                task.chunk(&"one").await?;
                second.notified().await;
                task.last_chunk(&"two").await?;
                Ok::<_, HandlerError>("done".to_owned())
            }
        })
        .await
        .expect("serve draft");
    let key = format!("X-API-Key: {API_KEY}");
    let send = |gw: SocketAddr, body: Value| {
        let key = key.clone();
        async move {
            curl(
                gw,
                "POST",
                "/a2a/agents/writer/draft/",
                &[key.as_str(), "A2A-Version: 1.0"],
                Some(&body),
            )
            .await
        }
    };
    let sent = eventually(WAIT, "the task submitted", || async {
        let a = send(gw, json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {
            "message": {"messageId": uuid::Uuid::now_v7().to_string(), "role": "ROLE_USER", "parts": [{"data": null}]},
            "configuration": {"returnImmediately": true, "taskPushNotificationConfig": {
                "id": "kept", "url": format!("http://{hook_addr}/hooks/ok"),
                "authentication": {"scheme": "Bearer", "credentials": "hook-secret"}}}}}))
        .await;
        a.body["result"]["task"]["id"].as_str().map(str::to_owned)
    })
    .await;
    let task = sent;
    // A text chunk delivered, with the credentials the config was given.
    let chunk_of = |body: &Value| {
        (body.pointer("/artifactUpdate/artifact/name") == Some(&json!("stream")))
            .then(|| body["artifactUpdate"]["artifact"]["parts"][0]["text"].clone())
    };
    first.notify_one();
    loop {
        let (headers, body) = within(WAIT, "chunk one pushed", seen.recv())
            .await
            .expect("a delivery");
        assert_eq!(headers["authorization"], "Bearer hook-secret");
        if chunk_of(&body) == Some(json!("one")) {
            break;
        }
    }
    // The record is in the bucket, under the identity's name, with its progress.
    let bucket = writer
        .broker()
        .jetstream(WAIT)
        .open_kv(&writer.subjects().bucket_name(chorus_gateway::PUSH_BUCKET))
        .await
        .expect("the push bucket");
    let kept = bucket.entries_under("hooked").await.expect("listed");
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].key, format!("hooked.{task}.kept"));

    // The gateway stops; the task goes on and ends while none runs.
    coordinator.shutdown().await;
    second.notify_one();
    let handle = writer
        .task(task.parse().expect("a task id"))
        .await
        .expect("the task");
    eventually(WAIT, "the task completed", || async {
        handle
            .history(100)
            .await
            .ok()?
            .iter()
            .any(|u| u.state() == Some(chorus_sdk::TaskState::Completed))
            .then_some(())
    })
    .await;
    assert!(
        seen.try_recv().is_err(),
        "nothing is pushed while no gateway runs"
    );

    // Started again: the rest reaches the webhook, and "one" is not sent again.
    let (coordinator, _gw) = with_gateway(&server, config).await;
    let mut after = Vec::new();
    loop {
        let (headers, body) = within(WAIT, "the rest pushed", seen.recv())
            .await
            .expect("a delivery");
        assert_eq!(headers["authorization"], "Bearer hook-secret");
        let done =
            body.pointer("/statusUpdate/status/state") == Some(&json!("TASK_STATE_COMPLETED"));
        after.push(body);
        if done {
            break;
        }
    }
    let chunks: Vec<Value> = after.iter().filter_map(chunk_of).collect();
    assert_eq!(chunks, [json!("two")], "{after:?}");
    eventually(WAIT, "the ended task's record removed", || async {
        bucket
            .entries_under("hooked")
            .await
            .ok()
            .filter(Vec::is_empty)
    })
    .await;
    writer.shutdown().await;
    coordinator.shutdown().await;
    webhook.stop().await;
}
