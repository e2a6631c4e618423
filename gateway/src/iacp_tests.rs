//! The tests of `iacp.rs`.

use super::*;

fn envelope(value: Value) -> Envelope {
    serde_json::from_value(value).expect("an envelope")
}

#[test]
fn a_capability_query_reads_from_a_url_and_from_a_payload_alike() {
    let from_url: PeersQuery = api::query(Some(
        "capabilities=code_review,testing&max_tokens=4096&priority=high".into(),
    ))
    .expect("a query");
    // As the seed writes it, with a field that is not a filter.
    let from_payload = PeersQuery::from_payload(&json!({
        "capabilities": ["code_review", "testing"], "max_tokens": 4096,
        "priority": "high", "customer_id": "customer-123",
    }))
    .expect("a query");
    for q in [from_url, from_payload] {
        let q = q.checked().expect("valid");
        assert_eq!(q.capabilities, ["code_review", "testing"]);
        assert_eq!(
            (q.max_tokens, q.priority),
            (Some(4096), Some(Priority::High))
        );
    }
    let refused = |v: Value| {
        let e = PeersQuery::from_payload(&v)
            .and_then(PeersQuery::checked)
            .expect_err("refused");
        format!("{e:?}")
    };
    assert!(refused(json!({"priority": "urgent"})).contains("priority"));
    assert!(refused(json!({"capabilities": ["a b"]})).contains("capabilities"));
    assert!(refused(json!({"max_tokens": -1})).contains("-1"));
    assert!(refused(json!(["code_review"])).contains("object"));
    let many: Vec<String> = (0..=MAX_QUERY_CAPABILITIES)
        .map(|i| format!("c{i}"))
        .collect();
    assert!(refused(json!({ "capabilities": many })).contains("at most"));
    // A URL still refuses a parameter it does not know (a typo filters nothing).
    assert!(api::query::<PeersQuery>(Some("capabilites=a".into())).is_err());
    // The query intent with no channel asks the registry; with one, the agent's command.
    let asked = envelope(json!({
        "version": "1.0", "recipient": {"agent_id": "reviewer-02"},
        "message": {"type": "request", "intent": "query", "payload": {}},
    }));
    assert_eq!(
        action(&asked, "me").ok(),
        Some(Action::Query {
            to: Some("reviewer-02")
        })
    );
    let command = envelope(json!({
        "version": "1.0", "recipient": {"agent_id": "reviewer-02", "channel": "query"},
        "message": {"type": "request", "intent": "query", "payload": {}},
    }));
    assert_eq!(
        action(&command, "me").ok(),
        Some(Action::Request {
            to: "reviewer-02",
            command: "query"
        })
    );
}

fn seed_request(to: &str, intent: &str) -> Value {
    // As the seed's IACPClient.send writes it.
    json!({
        "version": "1.0",
        "message_id": "0f8a3c1e-6f1d-4c52-9a53-1b7c2a4d9e10",
        "sender": {"agent_id": "builder-01"},
        "recipient": {"agent_id": to},
        "timestamp": "2026-05-06T00:00:00Z",
        "message": {"type": "request", "intent": intent, "payload": {"task": "Review src/main.py"}}
    })
}

#[test]
fn the_seeds_envelope_is_told_from_the_gateways_own_body() {
    assert!(is_envelope(&seed_request("reviewer-02", "handoff")));
    assert!(!is_envelope(&json!({"to": "a", "command": "b"})));
    assert!(!is_envelope(&json!([1])));
}

#[test]
fn a_request_calls_the_channel_or_else_the_intent() {
    let env = envelope(seed_request("reviewer-02", "handoff"));
    assert_eq!(
        action(&env, "builder-01").ok(),
        Some(Action::Request {
            to: "reviewer-02",
            command: "handoff"
        })
    );
    let mut v = seed_request("reviewer-02", "handoff");
    v["recipient"]["channel"] = json!("review");
    v["message"]["type"] = json!("event");
    v["unknown"] = json!({"ignored": true});
    let env = envelope(v);
    assert_eq!(
        action(&env, "builder-01").ok(),
        Some(Action::Notify {
            to: "reviewer-02",
            command: "review"
        })
    );
}

#[test]
fn a_sender_other_than_the_caller_and_bad_names_are_refused() {
    let env = envelope(seed_request("reviewer-02", "handoff"));
    let refused = action(&env, "someone-else").expect_err("not the caller");
    assert_eq!(refused.http(), Http::FORBIDDEN);
    assert!(
        refused.body()["reason"]
            .as_str()
            .is_some_and(|r| r.contains("builder-01"))
    );
    let env = envelope(seed_request("a.b", "handoff"));
    assert_eq!(
        action(&env, "builder-01").map(|_| ()).map_err(|e| e.http()),
        Err(Http::BAD_REQUEST)
    );
    let mut v = seed_request("reviewer-02", "handoff");
    v["version"] = json!("2.0");
    assert!(action(&envelope(v), "builder-01").is_err());
    let mut v = seed_request("reviewer-02", "handoff");
    v["message"]["type"] = json!("heartbeat");
    assert!(action(&envelope(v), "builder-01").is_err());
    let mut v = seed_request("reviewer-02", "handoff");
    v["message_id"] = json!("x".repeat(MAX_ID_CHARS + 1));
    assert!(action(&envelope(v), "builder-01").is_err());
}

#[test]
fn a_response_or_an_error_answers_the_polled_request_it_correlates() {
    let id = Uuid::now_v7();
    let mut v = seed_request("reviewer-02", "handoff");
    v["message"] = json!({"type": "response", "intent": "handoff", "payload": {"ok": 1}});
    v["correlation_id"] = json!(id.to_string());
    match action(&envelope(v.clone()), "builder-01") {
        Ok(Action::Answer { id: got, reply }) => {
            assert_eq!(
                (got, reply.status, reply.payload),
                (id, StatusCode::OK, json!({"ok": 1}))
            );
        }
        other => panic!("expected an answer, got {other:?}"),
    }
    v["message"] = json!({"type": "error", "payload": {"code": 5018, "message": "no such file"}});
    match action(&envelope(v.clone()), "builder-01") {
        Ok(Action::Answer { reply, .. }) => {
            assert_eq!(
                (reply.status, reply.reason.as_str()),
                (StatusCode::INVALID_ARGUMENT, "no such file")
            );
        }
        other => panic!("expected an answer, got {other:?}"),
    }
    v["message"] =
        json!({"type": "error", "payload": {"code": "MATH_ERROR", "message": "Division by zero"}});
    match action(&envelope(v.clone()), "builder-01") {
        Ok(Action::Answer { reply, .. }) => {
            assert_eq!(reply.status, StatusCode::HANDLER_FAILED);
            assert_eq!(reply.reason, "MATH_ERROR: Division by zero");
        }
        other => panic!("expected an answer, got {other:?}"),
    }
    v["correlation_id"] = json!("not-a-uuid");
    assert!(action(&envelope(v), "builder-01").is_err());
}

#[test]
fn ttl_seconds_bounds_the_wait_up_to_the_gateways_limit() {
    assert_eq!(
        request_timeout(None, 30_000, 60_000).ok(),
        Some(Duration::from_secs(30))
    );
    assert_eq!(
        request_timeout(Some(5), 30_000, 60_000).ok(),
        Some(Duration::from_secs(5))
    );
    assert_eq!(
        request_timeout(Some(3600), 30_000, 60_000).ok(),
        Some(Duration::from_secs(60))
    );
    assert!(request_timeout(Some(0), 30_000, 60_000).is_err());
}

#[test]
fn replies_and_messages_read_as_iacp_envelopes() {
    let sent = Sent {
        me: "builder-01".into(),
        message_id: "m-1".into(),
        to: "reviewer-02".into(),
        intent: Some("handoff".into()),
    };
    let r = response(&sent, "reviewer-02", json!({"issues": 3}));
    assert_eq!(
        (
            &r["correlation_id"],
            &r["message"]["type"],
            &r["message"]["payload"],
            &r["sender"]["agent_id"]
        ),
        (
            &json!("m-1"),
            &json!("response"),
            &json!({"issues": 3}),
            &json!("reviewer-02")
        )
    );
    let e = error(&sent, StatusCode::NO_RESPONDERS, "nobody");
    assert_eq!(
        e["message"]["payload"],
        json!({"code": 5012, "label": "no_responders", "message": "nobody"})
    );
    let m = PolledMessage {
        id: Uuid::now_v7(),
        from: "reviewer-02".into(),
        command: "review".into(),
        kind: "request".into(),
        delivery: "at_most_once".into(),
        reply_expected: true,
        conversation: Uuid::nil(),
        timestamp_ms: 1_778_025_600_000,
        attempt: 1,
        payload: json!(1),
        task: Some("Review it".into()),
        timeout_ms: Some(1500),
    };
    let v = inbound(&m, "builder-01");
    assert_eq!(v["timestamp"], json!("2026-05-06T00:00:00Z"));
    assert_eq!(
        (&v["message"]["type"], &v["message"]["intent"]),
        (&json!("request"), &json!("review"))
    );
    assert_eq!(
        (&v["ttl_seconds"], &v["message"]["task"]),
        (&json!(2), &json!("Review it"))
    );
}

#[tokio::test]
async fn the_outbox_holds_at_most_its_capacity_in_flight_and_queued() {
    let outbox = Arc::new(Outbox::new(2));
    let a = outbox.reserve().expect("room");
    let b = outbox.reserve().expect("room");
    assert_eq!(
        outbox.reserve().map(|_| ()).map_err(|e| e.http()),
        Err(Http::TOO_MANY_REQUESTS)
    );
    outbox.deliver(a, json!(1));
    drop(b);
    let c = outbox.reserve().expect("a dropped place is given back");
    drop(c);
    assert_eq!(outbox.take(10), vec![json!(1)]);
    assert!(outbox.take(10).is_empty());
}
