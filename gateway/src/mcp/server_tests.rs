//! The tests of `server.rs`.

use super::*;

#[test]
fn messages_are_classified_and_bad_ones_refused_with_the_right_code() {
    assert_eq!(
        classify(json!({"jsonrpc": "2.0", "id": 1, "method": "ping"})),
        Ok(Incoming::Request {
            id: json!(1),
            method: "ping".into(),
            params: json!({})
        })
    );
    assert_eq!(
        classify(json!({"jsonrpc": "2.0", "method": "notifications/initialized"})),
        Ok(Incoming::Notification {
            method: "notifications/initialized".into(),
            params: json!({})
        })
    );
    assert_eq!(
        classify(json!({"jsonrpc": "2.0", "id": 1, "result": {}})),
        Ok(Incoming::Response)
    );
    let refused = |v: Value| classify(v).expect_err("refused");
    assert_eq!(
        refused(json!([{"jsonrpc": "2.0", "id": 1, "method": "ping"}]))
            .1
            .code,
        code::INVALID_REQUEST
    );
    assert_eq!(refused(json!({"id": 1, "method": "ping"})).0, json!(1));
    assert_eq!(
        refused(json!({"jsonrpc": "2.0", "id": null, "method": "ping"})).0,
        Value::Null
    );
    assert_eq!(
        refused(json!({"jsonrpc": "2.0", "id": {}, "method": "ping"}))
            .1
            .code,
        code::INVALID_REQUEST
    );
    assert_eq!(
        refused(json!({"jsonrpc": "2.0", "id": 2, "method": "ping", "params": [1]}))
            .1
            .code,
        code::INVALID_PARAMS
    );
    assert_eq!(refused(json!("ping")).1.code, code::INVALID_REQUEST);
}

#[test]
fn event_ids_carry_where_a_task_stream_resumes() {
    let resume = Resume {
        task: Uuid::now_v7(),
        seq: 42,
        request: json!("call/1.2"),
        progress: Some(json!(7)),
    };
    let token = resume.token().expect("a token");
    assert_eq!(Resume::parse(&token), Some(resume.clone()));
    let plain = Resume {
        progress: None,
        request: json!(3),
        ..resume
    };
    assert_eq!(Resume::parse(&plain.token().expect("a token")), Some(plain));
    for bad in ["", "x.1.00", "0190d5b2000070008000000000000000.x.00", "a.b"] {
        assert_eq!(Resume::parse(bad), None, "{bad}");
    }
    let long = Resume {
        task: Uuid::now_v7(),
        seq: 1,
        request: json!("x".repeat(600)),
        progress: None,
    };
    assert_eq!(long.token(), None);
}

#[test]
fn initialize_answers_the_clients_version_when_spoken_here() {
    assert_eq!(
        initialize(&json!({"protocolVersion": "2025-06-18"}))["protocolVersion"],
        json!("2025-06-18")
    );
    assert_eq!(
        initialize(&json!({"protocolVersion": "2024-11-05"}))["protocolVersion"],
        json!(VERSIONS[0])
    );
}

#[test]
fn the_log_level_filters_what_a_session_is_sent() {
    let session = Session::new("web-ui");
    assert!(session.logs("info"));
    session.level.store(3, Ordering::Relaxed);
    assert!(!session.logs("info"));
    assert!(session.logs("error"));
}
