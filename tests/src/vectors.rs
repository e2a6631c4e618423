//! The envelopes behind `tests/vectors/`: fixed ids and times so the bytes never change.

use std::collections::BTreeMap;

use agent_sdk::envelope::{
    EncryptedKey, Encryption, ExpectedReply, Progress, ProgressState, Signature, TraceContext,
};
use agent_sdk::{DeliveryClass, Envelope, Kind, Performative, Priority, StatusCode};
use bytes::Bytes;
use uuid::Uuid;

const T0: u64 = 1_798_761_600_000; // 2027-01-01T00:00:00Z

fn id(n: u8) -> Uuid {
    uuid::Builder::from_unix_timestamp_millis(T0 + u64::from(n), &[n; 10]).into_uuid()
}

fn base(kind: Kind, performative: Performative, from: &str, n: u8) -> Envelope {
    let mut e = Envelope::new(kind, performative, from);
    e.id = id(n);
    e.timestamp_ms = T0 + u64::from(n);
    e
}

/// Every vector, by file name.
pub fn all() -> Vec<(&'static str, Envelope)> {
    // 1. Agentify's orchestrator asks the calculator: MessagePack payload {"a":2,"b":3}.
    let mut request = base(Kind::Request, Performative::Request, "orchestrator", 1);
    request.to = vec!["calculator".into()];
    request.name = Some("add".into());
    request.ttl_ms = Some(5_000);
    request.expect = Some(ExpectedReply {
        performative: Performative::Inform,
        timeout_ms: 5_000,
    });
    request.payload = Bytes::from_static(&[0x82, 0xa1, b'a', 0x02, 0xa1, b'b', 0x03]);

    // 2. The calculator's reply, JSON payload.
    let mut response = base(Kind::Response, Performative::Inform, "calculator", 2);
    response.correlation_id = Some(request.id);
    response.in_reply_to = Some(request.id);
    response.to = vec!["orchestrator".into()];
    response.name = Some("add".into());
    response.status = Some(StatusCode::OK);
    response.content_type = "application/json".into();
    response.payload = Bytes::from_static(b"{\"result\":5}");

    // 3. AIXP's OCR agent announces extracted text as an event, with trace and context.
    let mut event = base(Kind::Event, Performative::Inform, "ocr-agent", 3);
    event.topic = Some("doc.text.extracted".into());
    event.priority = Priority::High;
    event.trace = Some(TraceContext {
        traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        tracestate: None,
    });
    event.session_id = Some("session-42".into());
    event.customer_id = Some("acme".into());
    event.headers = BTreeMap::from([("lang".to_owned(), "en".to_owned())]);
    event.payload = Bytes::from_static(&[0xa5, b'h', b'e', b'l', b'l', b'o']);

    // 4. A refusal: the hop limit was passed.
    let mut refusal = base(Kind::Response, Performative::Refuse, "nlp-agent", 4);
    refusal.correlation_id = Some(id(9));
    refusal.in_reply_to = Some(id(8));
    refusal.hops = 9;
    refusal.hop_limit = 8;
    refusal.status = Some(StatusCode::LOOP_DETECTED);
    refusal.reason = Some("hop 9 is past the limit of 8".into());

    // 5. A command with every optional field: deadline, progress, token, signature and
    //    encryption (the last two are carried but not checked until the security release).
    let mut command = base(Kind::Command, Performative::Assign, "planner", 5);
    command.correlation_id = Some(id(7));
    command.to = vec!["builder-01".into(), "reviewer-02".into()];
    command.capability = Some("code.review".into());
    command.name = Some("review".into());
    command.deadline_ms = Some(T0 + 60_000);
    command.hops = 1;
    command.priority = Priority::Critical;
    command.delivery = DeliveryClass::ExactlyOnce;
    command.progress = Some(Progress {
        state: ProgressState::Queued,
        fraction: Some(0.0),
    });
    command.token = Some("bearer-token".into());
    command.signature = Some(Signature {
        alg: "ed25519".into(),
        key: "UAEXAMPLEPUBLICKEY".into(),
        value: Bytes::from_static(&[7; 64]),
    });
    command.encryption = Some(Encryption {
        alg: "hpke-x25519-aes256gcm".into(),
        inner_content_type: "application/msgpack".into(),
        recipients: vec![EncryptedKey {
            agent: "reviewer-02".into(),
            key: Bytes::from_static(&[9; 32]),
        }],
    });
    command.payload = Bytes::from_static(&[1, 2, 3, 4]);

    vec![
        ("01-request", request),
        ("02-response", response),
        ("03-event", event),
        ("04-refusal", refusal),
        ("05-command-all-fields", command),
    ]
}
