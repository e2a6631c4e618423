//! The envelopes behind `tests/vectors/`: fixed ids and times so the bytes never change.

use std::collections::BTreeMap;

use bytes::Bytes;
use chorus_demo::Calculation;
use chorus_sdk::codec::encode_payload;
use chorus_sdk::encryption::{CONTENT_TYPE_ENCRYPTED, ENCRYPTION_ALG};
use chorus_sdk::envelope::{
    CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, EncryptedKey, Encryption, ExpectedReply, Progress,
    Sequence, Signature, TaskState, TraceContext,
};
use chorus_sdk::security::SIGNATURE_ALG;
use chorus_sdk::{DeliveryClass, Envelope, Kind, Performative, Priority, StatusCode};
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

/// The name of the vector that sets every optional field of the envelope.
pub const EVERY_FIELD: &str = "06-every-field";

/// Every vector, by file name.
pub fn all() -> Vec<(&'static str, Envelope)> {
    // 1. Agentify's orchestrator asks the demo calculator (`chorus up`) to add 2 and 3: the
    //    demo's own `calculation` command and argument type, as a MessagePack payload.
    let mut request = base(Kind::Request, Performative::Request, "orchestrator", 1);
    request.to = vec!["calculator".into()];
    request.name = Some("calculation".into());
    request.ttl_ms = Some(5_000);
    request.expect = Some(ExpectedReply {
        performative: Performative::Inform,
        timeout_ms: 5_000,
    });
    request.payload = encode_payload(
        &Calculation {
            operation: "add".into(),
            operands: vec![2.0, 3.0],
        },
        CONTENT_TYPE_MSGPACK,
    )
    .expect("the calculation encodes");

    // 2. The calculator's reply (an `f64`), with a JSON payload as a JSON caller gets it.
    let mut response = base(Kind::Response, Performative::Inform, "calculator", 2);
    response.correlation_id = Some(request.id);
    response.in_reply_to = Some(request.id);
    response.to = vec!["orchestrator".into()];
    response.name = Some("calculation".into());
    response.status = Some(StatusCode::OK);
    response.content_type = CONTENT_TYPE_JSON.into();
    response.payload = Bytes::from_static(b"5.0");

    // 3. AIXP's OCR agent announces extracted text as an event, with trace and context.
    let mut event = base(Kind::Event, Performative::Inform, "ocr-agent", 3);
    event.topic = Some("doc.text.extracted".into());
    event.priority = Priority::High;
    // The publisher's 17th event on this subject since it started counting.
    event.seq = Some(Sequence {
        epoch: 2_724_876_109,
        n: 17,
    });
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

    // 5. A signed, end-to-end encrypted, exactly-once command: deadline, progress, token,
    //    signature and encryption (the bytes are placeholders: a vector shows the layout, it is
    //    not a valid signature or ciphertext).
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
        state: TaskState::Queued,
        fraction: Some(0.0),
    });
    command.token = Some("bearer-token".into());
    command.signature = Some(Signature {
        alg: SIGNATURE_ALG.into(),
        key: "UAEXAMPLEPUBLICKEY".into(),
        value: Bytes::from_static(&[7; 64]),
    });
    command.content_type = CONTENT_TYPE_ENCRYPTED.into();
    command.encryption = Some(Encryption {
        alg: ENCRYPTION_ALG.into(),
        inner_content_type: CONTENT_TYPE_MSGPACK.into(),
        recipients: vec![EncryptedKey {
            agent: "reviewer-02".into(),
            key: Bytes::from_static(&[9; 80]),
        }],
    });
    command.payload = Bytes::from_static(&[1, 2, 3, 4]);

    // 6. Every optional field set, each to a value other than its default, nested ones with
    //    their own optional members too (`fraction`, `tracestate`): a progress report from a
    //    reviewer back to the planner of vector 5. Not a realistic message (few carry a topic,
    //    a capability and recipients at once); it is there so a second implementation writes and
    //    reads every field at least once.
    let mut every = base(Kind::Response, Performative::Progress, "reviewer-02", 6);
    every.correlation_id = Some(id(7));
    every.in_reply_to = Some(id(5));
    every.to = vec!["planner".into()];
    every.topic = Some("code.review.progress".into());
    every.capability = Some("code.review".into());
    every.name = Some("review".into());
    every.ttl_ms = Some(30_000);
    every.deadline_ms = Some(T0 + 60_000);
    every.hops = 2;
    every.hop_limit = 8;
    every.priority = Priority::Low;
    every.delivery = DeliveryClass::AtLeastOnce;
    every.seq = Some(Sequence {
        epoch: 0xC0FF_EE01,
        n: 300,
    });
    every.expect = Some(ExpectedReply {
        performative: Performative::Confirm,
        timeout_ms: 1_500,
    });
    every.progress = Some(Progress {
        state: TaskState::Running,
        fraction: Some(0.25),
    });
    every.status = Some(StatusCode::ACCEPTED);
    every.reason = Some("2 of 8 files reviewed".into());
    every.trace = Some(TraceContext {
        traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        tracestate: Some("congo=t61rcWkgMzE".into()),
    });
    every.session_id = Some("session-42".into());
    every.customer_id = Some("acme".into());
    every.headers = BTreeMap::from([
        ("lang".to_owned(), "en".to_owned()),
        ("x-review-round".to_owned(), "2".to_owned()),
    ]);
    every.content_type = CONTENT_TYPE_ENCRYPTED.into();
    every.content_encoding = Some("zstd".into());
    every.payload = Bytes::from_static(&[5, 6, 7, 8]);
    every.token = Some("bearer-token".into());
    every.signature = Some(Signature {
        alg: SIGNATURE_ALG.into(),
        key: "UAEXAMPLEPUBLICKEY".into(),
        value: Bytes::from_static(&[7; 64]),
    });
    every.encryption = Some(Encryption {
        alg: ENCRYPTION_ALG.into(),
        inner_content_type: CONTENT_TYPE_JSON.into(),
        recipients: vec![
            EncryptedKey {
                agent: "planner".into(),
                key: Bytes::from_static(&[9; 80]),
            },
            EncryptedKey {
                agent: "auditor".into(),
                key: Bytes::from_static(&[10; 80]),
            },
        ],
    });

    // 7-11. A task (docs/PROTOCOL.md section 7.4): the demo's orchestrator has the writer
    //    draft a text, streamed; each message is stored on the task's own subject.
    let task = id(7);
    let mut submitted = base(Kind::Command, Performative::Assign, "orchestrator", 7);
    submitted.correlation_id = Some(task);
    submitted.to = vec!["writer".into()];
    submitted.name = Some("draft".into());
    submitted.deadline_ms = Some(T0 + 60_000);
    submitted.expect = Some(ExpectedReply {
        performative: Performative::Agree,
        timeout_ms: 5_000,
    });
    submitted.progress = Some(Progress {
        state: TaskState::Submitted,
        fraction: None,
    });
    submitted.status = Some(StatusCode::ACCEPTED);
    submitted.payload = encode_payload("agents", CONTENT_TYPE_MSGPACK).expect("the topic encodes");

    let mut progress = base(Kind::Event, Performative::Progress, "writer", 8);
    progress.correlation_id = Some(task);
    progress.progress = Some(Progress {
        state: TaskState::Working,
        fraction: Some(0.25),
    });
    progress.reason = Some("writing".into());

    let mut chunk = base(Kind::Event, Performative::Inform, "writer", 9);
    chunk.correlation_id = Some(task);
    chunk.seq = Some(Sequence {
        epoch: 0x5eed_0001,
        n: 1,
    });
    chunk.payload = encode_payload("agents", CONTENT_TYPE_MSGPACK).expect("the word encodes");

    let mut completed = base(Kind::Response, Performative::Done, "writer", 10);
    completed.correlation_id = Some(task);
    completed.progress = Some(Progress {
        state: TaskState::Completed,
        fraction: None,
    });
    completed.status = Some(StatusCode::OK);
    completed.payload = encode_payload(&14u32, CONTENT_TYPE_MSGPACK).expect("the count encodes");

    let mut cancel = base(Kind::Command, Performative::Cancel, "orchestrator", 11);
    cancel.correlation_id = Some(task);
    cancel.reason = Some("cancelled by the requester".into());

    // 12-14. A contract-net round (section 7.10): the call for proposals to one summarizer,
    //    its proposal, and the outcome it is told.
    let round = id(12);
    let mut cfp = base(Kind::Request, Performative::Negotiate, "orchestrator", 12);
    cfp.correlation_id = Some(round);
    cfp.to = vec!["summarizer-careful".into()];
    cfp.capability = Some("summarize".into());
    cfp.ttl_ms = Some(2_000);
    cfp.expect = Some(ExpectedReply {
        performative: Performative::Inform,
        timeout_ms: 2_000,
    });
    cfp.payload =
        encode_payload("Bids are compared.", CONTENT_TYPE_MSGPACK).expect("the work encodes");

    let mut proposal = cfp.reply("summarizer-careful", StatusCode::OK);
    proposal.id = id(13);
    proposal.timestamp_ms = T0 + 13;
    proposal.payload = encode_payload(
        &chorus_sdk::negotiate::Proposal::at(5.0)
            .eta_ms(120)
            .confidence(0.95),
        CONTENT_TYPE_MSGPACK,
    )
    .expect("the proposal encodes");

    let mut lost = base(Kind::Command, Performative::Refuse, "orchestrator", 14);
    lost.correlation_id = Some(round);
    lost.to = vec!["summarizer-fast".into()];
    lost.capability = Some("summarize".into());
    lost.reason = Some("another proposal was awarded".into());

    // 15. The requester's counter to that proposal, on the same bid subject: its offer
    //     beside the proposal it answers.
    let mut counter = base(Kind::Request, Performative::Propose, "orchestrator", 15);
    counter.correlation_id = Some(round);
    counter.to = vec!["summarizer-careful".into()];
    counter.capability = Some("summarize".into());
    counter.ttl_ms = Some(2_000);
    counter.expect = Some(ExpectedReply {
        performative: Performative::Inform,
        timeout_ms: 2_000,
    });
    counter.payload = encode_payload(
        &chorus_sdk::negotiate::CounterOffer {
            offer: chorus_sdk::negotiate::Proposal::at(4.5),
            previous: chorus_sdk::negotiate::Proposal::at(5.0)
                .eta_ms(120)
                .confidence(0.95),
        },
        CONTENT_TYPE_MSGPACK,
    )
    .expect("the counter encodes");

    // 16. A 50 MiB payload carried by reference (section 7.11): the archivist's `store`
    //     command, its payload a reference to the object the sender stored.
    let mut by_reference = base(Kind::Request, Performative::Request, "scanner", 16);
    by_reference.to = vec!["archivist".into()];
    by_reference.name = Some("store".into());
    by_reference.ttl_ms = Some(5_000);
    by_reference.expect = Some(ExpectedReply {
        performative: Performative::Inform,
        timeout_ms: 5_000,
    });
    by_reference.content_type = chorus_sdk::payload::CONTENT_TYPE_OBJECT.into();
    by_reference.payload = encode_payload(
        &chorus_sdk::payload::ObjectRef {
            bucket: "chorus_payloads".into(),
            name: id(16).hyphenated().to_string(),
            size: 50 * 1024 * 1024,
            sha256: "9c1185a5c5e9fc54612808977ee8f548b2258d31a0b6e0e2a5f1c6f3b6b1e6d2".into(),
            content_type: "application/octet-stream".into(),
            // The request's expiry and a minute's grace.
            expires_ms: T0 + 16 + 5_000 + 60_000,
        },
        CONTENT_TYPE_MSGPACK,
    )
    .expect("the reference encodes");

    // 17. A reply compressed for a requester that reads zstd: 841 bytes of JSON (an array of
    //     24 `{"status":"ok","note":"all quiet"}`) in a 56-byte zstd frame.
    let mut compressed = base(Kind::Response, Performative::Inform, "archivist", 17);
    compressed.correlation_id = Some(id(16));
    compressed.in_reply_to = Some(id(16));
    compressed.to = vec!["scanner".into()];
    compressed.name = Some("list".into());
    compressed.status = Some(StatusCode::OK);
    compressed.content_type = CONTENT_TYPE_JSON.into();
    compressed.content_encoding = Some("zstd".into());
    compressed.payload = Bytes::from(hex::decode(COMPRESSED_LIST).expect("the frame is hex"));

    vec![
        ("01-request", request),
        ("02-response", response),
        ("03-event", event),
        ("04-refusal", refusal),
        ("05-command-secured", command),
        (EVERY_FIELD, every),
        ("07-task-submitted", submitted),
        ("08-task-progress", progress),
        ("09-task-chunk", chunk),
        ("10-task-completed", completed),
        ("11-task-cancel", cancel),
        ("12-negotiate-call", cfp),
        ("13-negotiate-proposal", proposal),
        ("14-negotiate-lost", lost),
        ("15-negotiate-counter", counter),
        ("16-payload-reference", by_reference),
        ("17-payload-compressed", compressed),
    ]
}

/// The zstd frame of vector 17, fixed here (another zstd build may compress differently).
const COMPRESSED_LIST: &str = "28b52ffd60490275010054025b7b22737461747573223a226f6b222c226e6f7465223a22616c6c207175696574227d2c5d01000c692af504";

/// The task the task vectors (07 to 11) belong to.
pub fn task_id() -> Uuid {
    id(7)
}

/// The subject each vector is published on, for its compact form
/// (`tests/vectors/NAME.compact.hex`), which leaves out what the subject carries: the request
/// goes to the calculator's command subject, the event to its topic's, the secured command to
/// its capability's; the replies and the every-field vector go to a reply inbox, which
/// carries nothing, so every field is written.
pub fn subject(name: &str) -> String {
    let task = |kind: &str| format!("chorus.task.{}.{kind}", task_id());
    match name {
        "01-request" => "chorus.agent.calculator.calculation".into(),
        "03-event" => "chorus.evt.doc.text.extracted".into(),
        "05-command-secured" => "chorus.cap.code.review".into(),
        "07-task-submitted" | "10-task-completed" => task("status"),
        "08-task-progress" => task("progress"),
        "09-task-chunk" => task("chunk"),
        "11-task-cancel" => task("cancel"),
        "12-negotiate-call" | "15-negotiate-counter" => {
            "chorus.agent.summarizer-careful.bid.summarize".into()
        }
        "16-payload-reference" => "chorus.agent.archivist.store".into(),
        "14-negotiate-lost" => "chorus.agent.summarizer-fast.bid.summarize".into(),
        _ => "_INBOX.planner.a1b2c3".into(),
    }
}
