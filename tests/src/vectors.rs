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
    //     command, its payload a reference to the payload the sender stored under its own
    //     name.
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
            name: format!("scanner.{}", id(16).hyphenated()),
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

    // 18. The requester's answer to a task's question (section 7.4), on `.input`: a reply to
    //     the `input_required` status message, in JSON as the question was.
    let mut input = base(Kind::Response, Performative::Inform, "orchestrator", 18);
    input.correlation_id = Some(task);
    input.in_reply_to = Some(id(17));
    input.content_type = CONTENT_TYPE_JSON.into();
    input.payload = Bytes::from_static(b"\"short\"");

    // 19. A worker's report of one attempt, on `.report`, for a requester that verifies
    //     results itself (section 7.4): `done`, the status and the result.
    let mut report = base(Kind::Response, Performative::Done, "writer", 19);
    report.correlation_id = Some(task);
    report.status = Some(StatusCode::OK);
    report.payload = encode_payload(&14u32, CONTENT_TYPE_MSGPACK).expect("the count encodes");

    // 20. A request on the reviewer's command subject whose fields the subject does not all
    //     carry: its `timestamp_ms` is not its id's time (compact key 5), its `to` is another
    //     agent than the subject's (key 8), and its traceparent is of a later version than 00
    //     (key 25, a string).
    let mut rerouted = base(Kind::Request, Performative::Request, "planner", 20);
    rerouted.timestamp_ms = T0 + 20 + 1_500;
    rerouted.to = vec!["auditor".into()];
    rerouted.name = Some("review".into());
    rerouted.trace = Some(TraceContext {
        traceparent: "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        tracestate: None,
    });

    // 21. A reply with `in_reply_to` and no `correlation_id` (compact key 6 nil), and a
    //     status code no table lists, carried as it is.
    let mut unknown_status = base(Kind::Response, Performative::Failure, "builder-01", 21);
    unknown_status.in_reply_to = Some(id(5));
    unknown_status.status = Some(StatusCode(5999));
    unknown_status.reason = Some("a code from a later protocol".into());

    // 22. Progress with a fraction JSON writes in exponent form (`1e-7`, section 3.2).
    let mut tiny = base(Kind::Event, Performative::Progress, "writer", 22);
    tiny.correlation_id = Some(task);
    tiny.progress = Some(Progress {
        state: TaskState::Working,
        fraction: Some(1e-7),
    });

    // 23. A notification (section 7.14) from the monitor to the ops bot, on its notification
    //     subject: no reply subject, no `expect` or `ttl_ms`; its `name` is written (the
    //     subject's last token, `$notify`, is never a name), `to` left to the subject.
    let mut notification = base(Kind::Notification, Performative::Inform, "monitor", 23);
    notification.to = vec!["ops-bot".into()];
    notification.name = Some("disk-full".into());
    notification.priority = Priority::High;
    notification.headers.insert("x-host".into(), "db-2".into());
    notification.payload =
        encode_payload(&"db-2 at 91%", CONTENT_TYPE_MSGPACK).expect("the text encodes");

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
        ("18-task-input", input),
        ("19-task-report", report),
        ("20-request-rerouted", rerouted),
        ("21-reply-unknown-status", unknown_status),
        ("22-progress-tiny-fraction", tiny),
        ("23-notification", notification),
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
        "08-task-progress" | "22-progress-tiny-fraction" => task("progress"),
        "18-task-input" => task("input"),
        "19-task-report" => task("report"),
        "20-request-rerouted" => "chorus.agent.reviewer-02.review".into(),
        "23-notification" => "chorus.agent.ops-bot.$notify".into(),
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

/// One value in a hand-built compact map ([`decode_cases`]).
enum V {
    Uint(u64),
    Int(i64),
    Str(&'static str),
    Bin(Vec<u8>),
    Nil,
    Array(Vec<V>),
}

fn write_value(out: &mut Vec<u8>, value: &V) {
    use rmp::encode;
    match value {
        V::Uint(n) => {
            encode::write_uint(out, *n).expect("vec");
        }
        V::Int(n) => {
            // A signed format on purpose, even for a non-negative value.
            encode::write_i8(out, i8::try_from(*n).expect("small")).expect("vec");
        }
        V::Str(s) => encode::write_str(out, s).expect("vec"),
        V::Bin(b) => encode::write_bin(out, b).expect("vec"),
        V::Nil => encode::write_nil(out).expect("vec"),
        V::Array(items) => {
            encode::write_array_len(out, u32::try_from(items.len()).expect("small")).expect("vec");
            for item in items {
                write_value(out, item);
            }
        }
    }
}

/// A compact map of `entries`, in the order given.
fn compact(entries: &[(u64, V)]) -> Vec<u8> {
    let mut out = Vec::new();
    rmp::encode::write_map_len(&mut out, u32::try_from(entries.len()).expect("small"))
        .expect("vec");
    for (key, value) in entries {
        rmp::encode::write_uint(&mut out, *key).expect("vec");
        write_value(&mut out, value);
    }
    out
}

/// A decoding case: bytes no encoder writes, and what a reader makes of them
/// (`tests/vectors/decode/NAME.hex`, with `NAME.json` for what it decodes to or `NAME.error` for
/// the 5006 reason it refuses it with; docs/PROTOCOL.md section 9).
#[derive(Debug)]
pub struct DecodeCase {
    /// The file name.
    pub name: &'static str,
    /// The subject the bytes arrive on.
    pub subject: &'static str,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// The decoding cases: what a reader accepts that no writer writes, and each malformed shape
/// with its reason.
pub fn decode_cases() -> Vec<DecodeCase> {
    let id1 = || V::Bin(id(1).as_bytes().to_vec());
    // A well-formed reply's fields: {0: 2, 1: id, 2: "calculator", 3: response, 4: inform}.
    let head = |kind: u64| {
        vec![
            (0, V::Uint(2)),
            (1, id1()),
            (2, V::Str("calculator")),
            (3, V::Uint(kind)),
            (4, V::Uint(2)),
        ]
    };
    let with = |extra: Vec<(u64, V)>| {
        let mut entries = head(2);
        entries.extend(extra);
        compact(&entries)
    };
    let inbox = "_INBOX.planner.a1b2c3";
    let mut cases = vec![
        // Accepted.
        DecodeCase {
            name: "d01-minor-version",
            subject: inbox,
            bytes: with(vec![(34, V::Uint(3))]),
        },
        DecodeCase {
            name: "d02-unknown-kind-code",
            subject: inbox,
            bytes: compact(&head(99)),
        },
        DecodeCase {
            name: "d03-unknown-key",
            subject: inbox,
            bytes: with(vec![(60, V::Str("from a later minor"))]),
        },
        DecodeCase {
            name: "d04-signed-integer",
            subject: inbox,
            bytes: with(vec![(14, V::Int(2))]),
        },
        DecodeCase {
            name: "d05-uuid-variant",
            subject: inbox,
            bytes: {
                let mut other = *id(1).as_bytes();
                // The variant bits (the top two of byte 8) are 11, not 10.
                other[8] |= 0xc0;
                compact(&[
                    (0, V::Uint(2)),
                    (1, V::Bin(other.to_vec())),
                    (2, V::Str("calculator")),
                    (3, V::Uint(2)),
                    (4, V::Uint(2)),
                ])
            },
        },
        // Refused with 5006, each with its own reason.
        DecodeCase {
            name: "d10-first-key-not-0",
            subject: inbox,
            bytes: compact(&[(1, id1()), (0, V::Uint(2)), (2, V::Str("calculator"))]),
        },
        DecodeCase {
            name: "d11-repeated-key",
            subject: inbox,
            bytes: with(vec![(22, V::Str("a")), (22, V::Str("b"))]),
        },
        DecodeCase {
            name: "d12-no-id",
            subject: inbox,
            bytes: compact(&[
                (0, V::Uint(2)),
                (2, V::Str("calculator")),
                (3, V::Uint(2)),
                (4, V::Uint(2)),
            ]),
        },
        DecodeCase {
            name: "d13-nil-where-no-nil",
            subject: inbox,
            bytes: with(vec![(22, V::Nil)]),
        },
        DecodeCase {
            name: "d14-unknown-content-type-code",
            subject: inbox,
            bytes: with(vec![(29, V::Uint(7))]),
        },
        DecodeCase {
            name: "d15-trailing-bytes",
            subject: inbox,
            bytes: {
                let mut b = compact(&head(2));
                b.push(0xc0);
                b
            },
        },
        DecodeCase {
            name: "d16-tracestate-alone",
            subject: inbox,
            bytes: with(vec![(24, V::Str("congo=t61rcWkgMzE"))]),
        },
        DecodeCase {
            name: "d17-not-a-uuidv7",
            subject: inbox,
            bytes: compact(&[
                (0, V::Uint(2)),
                (
                    1,
                    V::Bin(
                        Uuid::from_u128(0x0123_4567_89ab_4def_8123_4567_89ab_cdef)
                            .as_bytes()
                            .to_vec(),
                    ),
                ),
                (2, V::Str("calculator")),
                (3, V::Uint(2)),
                (4, V::Uint(2)),
            ]),
        },
        DecodeCase {
            name: "d18-major-3",
            subject: inbox,
            bytes: compact(&[(0, V::Uint(3)), (1, id1())]),
        },
        DecodeCase {
            name: "d19-seq-not-a-pair",
            subject: inbox,
            bytes: with(vec![(18, V::Array(vec![V::Uint(1)]))]),
        },
    ];
    cases.sort_by_key(|c| c.name);
    cases
}
