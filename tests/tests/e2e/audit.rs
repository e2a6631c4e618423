//! The audit trail (docs/SECURITY.md, "The audit trail"; issue 56): who asked for what, and
//! what came of it, written by the part of the bus that saw it and read with `chorus audit`.

use std::net::SocketAddr;

use chorus_gateway::config::{ApiKey, ConsoleConfig, EdgeIdentity};
use chorus_gateway::{Bus, Gateway, GatewayConfig, ScopeConfig};
use chorus_host::protocol::{COORDINATOR, TerminateRequest, coordinator_commands};
use chorus_sdk::{Call, Context, HandlerError, StatusCode};
use chorus_tests::{WAIT, agent, eventually, run_chorus, server, within};
use serde_json::{Value, json};
use sha2::Digest;

use crate::gateway::curl;

const WEB_KEY: &str = "web-ui-key-0123456789abcdef";
const OPS_KEY: &str = "ops-key-0123456789abcdef";

fn config() -> GatewayConfig {
    let sha = |k: &str| hex::encode(sha2::Sha256::digest(k.as_bytes()));
    let identity = |id: &str| EdgeIdentity {
        id: id.into(),
        nkey_seed_file: None,
        tenant: None,
    };
    GatewayConfig {
        listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        identities: vec![identity("web-ui"), identity("ops")],
        api_keys: vec![
            ApiKey {
                identity: "web-ui".into(),
                sha256: sha(WEB_KEY),
                scopes: vec!["caller".into()],
            },
            ApiKey {
                identity: "ops".into(),
                sha256: sha(OPS_KEY),
                scopes: vec!["operator".into()],
            },
        ],
        scopes: vec![
            ScopeConfig {
                name: "operator".into(),
                routes: vec!["console".into(), "console-admin".into()],
                agents: vec![],
                capabilities: vec![],
            },
            ScopeConfig {
                name: "caller".into(),
                routes: vec!["requests".into()],
                agents: vec!["echo".into()],
                capabilities: vec![],
            },
        ],
        console: ConsoleConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            ..ConsoleConfig::default()
        },
        // Two actions at once, then one every 100 s: the third console action is over the rate.
        rate_burst: 2.0,
        rate_per_second: 0.01,
        ..GatewayConfig::default()
    }
}

/// Records of the last hour, as `chorus audit --json` prints them.
async fn audit(server: &chorus_nats_server::NatsServer, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["audit", "--json", "--since", "1h"];
    args.extend_from_slice(extra);
    let (ok, out, err) = run_chorus(server, &args).await;
    assert!(ok, "{err}");
    serde_json::from_str(&out).expect("records as JSON")
}

/// The coordinator records its authority decisions with the sender; the gateway each write
/// of an edge identity with what it was answered, written as that identity; the console each
/// action with the person who took it, counted against that person's rate (the third in a
/// burst of two is refused 429, not run). `chorus audit` lists them, `--actor` one actor's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_gateway_and_console_record_who_did_what_and_chorus_audit_reads_it() {
    let server = server();
    let coordinator = chorus_tests::coordinator(&server, false).await;
    let gateway = within(
        WAIT,
        "gateway start",
        Gateway::start(&Bus::new(server.url()), &config()),
    )
    .await
    .expect("the gateway starts");
    let (gw, console) = (
        gateway.local_addr().expect("the gateway listens"),
        gateway.console_addr().expect("the console listens"),
    );
    let echo = agent(&server, "echo").await;
    echo.on_command("ping", |_ctx: Context, n: u32| async move {
        Ok::<_, HandlerError>(n)
    })
    .await
    .expect("ping");

    // A write through the gateway, as web-ui.
    let web = format!("X-API-Key: {WEB_KEY}");
    let a = curl(
        gw,
        "POST",
        "/v1/requests",
        &[&web],
        Some(&json!({"to": "echo", "command": "ping", "payload": 7})),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    // An agent asking the coordinator for what only admins may do.
    let intruder = agent(&server, "intruder").await;
    let refused = intruder
        .call(
            Call::agent(COORDINATOR, coordinator_commands::TERMINATE)
                .payload(&TerminateRequest {
                    deployment: "anything".into(),
                })
                .expect("payload"),
        )
        .await
        .expect_err("refused");
    assert!(
        matches!(&refused, chorus_sdk::SdkError::Remote { status, .. } if *status == StatusCode::ACCESS),
        "{refused:?}"
    );
    // Console actions by ops: two replays of a dead letter that is not there, then a third
    // over ops's rate.
    let ops = format!("x-api-key: {OPS_KEY}");
    for _ in 0..2 {
        let a = curl(console, "POST", "/dlq/424242/replay", &[&ops], None).await;
        assert_eq!(a.status, 404, "{}", a.body);
    }
    let over = curl(console, "POST", "/dlq/424242/replay", &[&ops], None).await;
    assert_eq!(over.status, 429, "{}", over.body);

    // Once outside the deadline below: finding the `chorus` binary may build it.
    let _ = audit(&server, &[]).await;
    let records = eventually(WAIT, "the four records", || async {
        let records = audit(&server, &[]).await;
        (records.len() >= 4).then_some(records)
    })
    .await;
    let find = |via: &str, actor: &str| {
        records
            .iter()
            .filter(|r| r["via"] == via && r["actor"] == actor)
            .cloned()
            .collect::<Vec<_>>()
    };
    let coordinator_says = find("coordinator", "intruder");
    assert_eq!(coordinator_says.len(), 1, "{records:?}");
    assert_eq!(
        (
            &coordinator_says[0]["action"],
            &coordinator_says[0]["outcome"],
            &coordinator_says[0]["status"],
            &coordinator_says[0]["writer"]
        ),
        (
            &json!("terminate"),
            &json!("refused"),
            &json!(5007),
            &json!("coordinator")
        ),
        "{records:?}"
    );
    let gateway_says = find("gateway", "web-ui");
    assert_eq!(gateway_says.len(), 1, "{records:?}");
    assert_eq!(
        (
            &gateway_says[0]["action"],
            &gateway_says[0]["outcome"],
            &gateway_says[0]["status"],
            &gateway_says[0]["writer"]
        ),
        (
            &json!("POST /v1/requests"),
            &json!("ok"),
            &json!(200),
            &json!("web-ui")
        ),
        "{records:?}"
    );
    let console_says = find("console", "ops");
    assert_eq!(
        console_says.len(),
        2,
        "the third was over the rate: {records:?}"
    );
    for r in &console_says {
        assert_eq!(
            (&r["action"], &r["target"], &r["outcome"], &r["writer"]),
            (
                &json!("dlq.replay"),
                &json!("424242"),
                &json!("failed"),
                &json!("chorus-console")
            ),
            "{r}"
        );
    }
    let only_ops = audit(&server, &["--actor", "ops"]).await;
    assert!(
        only_ops.len() == 2 && only_ops.iter().all(|r| r["actor"] == "ops"),
        "{only_ops:?}"
    );
    let (ok, text, err) = run_chorus(&server, &["audit", "--since", "1h"]).await;
    assert!(ok, "{err}");
    assert!(
        text.lines().any(|l| l.contains("intruder")
            && l.contains("terminate")
            && l.contains("refused 5007")),
        "{text}"
    );

    intruder.shutdown().await;
    echo.shutdown().await;
    gateway.stop().await;
    coordinator.shutdown().await;
}
