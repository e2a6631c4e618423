use bytes::Bytes;
use uuid::Uuid;

use super::*;
use crate::protocol::envelope::{
    EncryptedKey, Encryption, ExpectedReply, Kind, Performative, Progress, Sequence, Signature,
    TaskState, TraceContext,
};
use crate::protocol::status::StatusCode;

fn serde_bytes(env: &Envelope) -> Vec<u8> {
    let mut out = Vec::new();
    serde::Serialize::serialize(
        env,
        &mut rmp_serde::Serializer::new(&mut out).with_struct_map(),
    )
    .expect("serde encodes");
    out
}

fn full() -> Envelope {
    let mut e = Envelope::new(Kind::Command, Performative::Assign, "orchestrator");
    e.version.minor = 3;
    e.correlation_id = Some(Uuid::now_v7());
    e.in_reply_to = Some(Uuid::now_v7());
    e.to = vec!["a".into(), "b".repeat(40)];
    e.topic = Some("doc.scanned".into());
    e.capability = Some("ocr".into());
    e.name = Some("scan".into());
    e.ttl_ms = Some(70_000);
    e.deadline_ms = Some(u64::MAX);
    e.hops = 3;
    e.hop_limit = 200;
    e.priority = Priority::Critical;
    e.delivery = DeliveryClass::ExactlyOnce;
    e.seq = Some(Sequence {
        epoch: u32::MAX,
        n: u64::MAX,
    });
    e.expect = Some(ExpectedReply {
        performative: Performative::Inform,
        timeout_ms: 300,
    });
    e.progress = Some(Progress {
        state: TaskState::Running,
        fraction: Some(0.25),
    });
    e.status = Some(StatusCode(5002));
    e.reason = Some("é".repeat(300));
    e.trace = Some(TraceContext {
        traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        tracestate: Some("congo=t61rcWkgMzE".into()),
    });
    e.session_id = Some("s".into());
    e.customer_id = Some("c".into());
    e.headers.insert("k1".into(), "v1".into());
    e.headers.insert("k2".into(), String::new());
    e.content_type = "application/json".into();
    e.payload = Bytes::from(vec![7u8; 70_000]);
    e.token = Some("t".into());
    e.signature = Some(Signature {
        alg: "ed25519".into(),
        key: "UABC".into(),
        value: Bytes::from(vec![1u8; 64]),
    });
    e
}

/// Every field, one at a time and together, at the size boundaries of each MessagePack
/// form.
fn variants() -> Vec<Envelope> {
    let base = Envelope::new(Kind::Event, Performative::Inform, "p");
    let mut out = vec![base.clone(), full()];
    let mut with_encryption = full();
    with_encryption.encryption = Some(Encryption {
        alg: "hpke".into(),
        inner_content_type: "application/msgpack".into(),
        recipients: vec![EncryptedKey {
            agent: "r".into(),
            key: Bytes::from(vec![9u8; 32]),
        }],
    });
    out.push(with_encryption);
    for len in [0usize, 1, 31, 32, 255, 256, 65_535, 65_536] {
        let mut e = base.clone();
        e.from = "x".repeat(len).into();
        e.payload = Bytes::from(vec![0x5a; len]);
        out.push(e);
    }
    for n in [
        0u64,
        127,
        128,
        255,
        256,
        65_535,
        65_536,
        u32::MAX.into(),
        u64::MAX,
    ] {
        let mut e = base.clone();
        e.timestamp_ms = n;
        e.ttl_ms = Some(n);
        out.push(e);
    }
    for n in 0..40 {
        let mut e = base.clone();
        e.to = (0..n).map(|i| i.to_string()).collect();
        e.headers = (0..n).map(|i| (i.to_string(), i.to_string())).collect();
        out.push(e);
    }
    let mut no_fraction = full();
    no_fraction.progress = Some(Progress {
        state: TaskState::Failed,
        fraction: None,
    });
    no_fraction.trace.as_mut().expect("trace").tracestate = None;
    out.push(no_fraction);
    out
}

#[test]
fn writes_exactly_what_serde_writes() {
    for env in variants() {
        let mut ours = Vec::new();
        encode(&env, &mut ours);
        assert_eq!(ours, serde_bytes(&env), "{env:?}");
    }
}

#[test]
fn reads_what_it_writes_with_the_payload_shared() {
    for env in variants() {
        let bytes = Bytes::from(serde_bytes(&env));
        let fast = decode(&bytes, Some(&bytes));
        if env.encryption.is_some() {
            assert!(fast.is_none(), "encryption goes to serde");
            continue;
        }
        let fast = fast.expect("the fast path takes what Chorus writes");
        assert_eq!(fast, env);
        if !fast.payload.is_empty() {
            let within = bytes.as_ptr_range();
            assert!(
                within.contains(&fast.payload.as_ptr()),
                "payload not copied"
            );
        }
        assert_eq!(decode(&bytes, None), Some(env));
    }
}

#[test]
fn unusual_shapes_go_to_serde() {
    let env = Envelope::new(Kind::Event, Performative::Inform, "p");
    let good = serde_bytes(&env);
    // A repeated field.
    let mut repeated = good.clone();
    repeated[0] += 1;
    repeated.extend_from_slice(&[0xa4, b'f', b'r', b'o', b'm', 0xa1, b'q']);
    assert!(decode(&repeated, None).is_none());
    assert!(rmp_serde::from_slice::<Envelope>(&repeated).is_err());
    // A missing required field: a map of version alone.
    let version_only = [
        0x81, 0xa7, b'v', b'e', b'r', b's', b'i', b'o', b'n', 0xa3, b'1', b'.', b'0',
    ];
    assert!(decode(&version_only, None).is_none());
    // An unknown field of every kind is skipped.
    let mut unknown = good.clone();
    unknown[0] += 1;
    unknown.extend_from_slice(&[
        0xa1, b'z', 0x92, 0x81, 0xa1, b'a', 0xd6, 1, 0, 0, 0, 0, 0xcb,
    ]);
    unknown.extend_from_slice(&1.5f64.to_be_bytes());
    assert_eq!(decode(&unknown, None), Some(env.clone()));
    assert_eq!(rmp_serde::from_slice::<Envelope>(&unknown).ok(), Some(env));
}

/// Whatever the fast path accepts, serde accepts as the same envelope: random damage to
/// real envelopes, compared.
#[test]
fn the_fast_path_never_disagrees_with_serde() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let samples: Vec<Vec<u8>> = variants()
        .iter()
        .filter(|e| e.payload.len() < 1024 && e.from.len() < 1024)
        .map(serde_bytes)
        .collect();
    let mut fast_taken = 0;
    for round in 0..200_000 {
        let mut bytes = samples[round % samples.len()].clone();
        for _ in 0..1 + next() % 3 {
            let i = (next() as usize) % bytes.len();
            bytes[i] = next() as u8;
        }
        if next() % 4 == 0 {
            bytes.truncate((next() as usize) % bytes.len());
        }
        if let Some(fast) = decode(&bytes, None) {
            fast_taken += 1;
            let slow = rmp_serde::from_slice::<Envelope>(&bytes);
            assert_eq!(slow.ok().as_ref(), Some(&fast), "{bytes:x?}");
        }
    }
    assert!(fast_taken > 10_000, "the fast path took {fast_taken}");
}

mod compact_form {
    use super::{full, variants};
    use crate::protocol::codec::{self, CodecError, Encoding};
    use crate::protocol::envelope::{
        CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, DEFAULT_HOP_LIMIT, Envelope, Kind,
        PROTOCOL_VERSION, Performative, Sequence, TraceContext,
    };
    use crate::protocol::wire::compact;
    use crate::subject::{Implied, Subjects};
    use bytes::Bytes;
    use uuid::Uuid;

    /// What a compact envelope decodes to: the model's version, whatever was sent.
    fn as_read(env: &Envelope) -> Envelope {
        let mut e = env.clone();
        e.version = PROTOCOL_VERSION;
        e
    }

    fn compact(env: &Envelope, implied: &Implied<'_>) -> Bytes {
        codec::encode_on(env, Encoding::Compact, implied).expect("encodes")
    }

    #[test]
    fn reads_what_it_writes_for_every_field_and_size() {
        for env in variants() {
            let bytes = compact(&env, &Implied::default());
            assert_eq!(Encoding::sniff(&bytes), Some(Encoding::Compact));
            let (read, encoding) = codec::decode_shared(&bytes).expect("decodes");
            assert_eq!(encoding, Encoding::Compact);
            assert_eq!(read, as_read(&env), "{env:?}");
        }
    }

    #[test]
    fn a_reply_does_not_repeat_its_conversation() {
        let request = Envelope::new(Kind::Request, Performative::Request, "asker");
        let mut reply = Envelope::new(Kind::Response, Performative::Inform, "answerer");
        reply.in_reply_to = Some(request.id);
        for correlation in [Some(request.id), None, Some(uuid::Uuid::now_v7())] {
            reply.correlation_id = correlation;
            let bytes = compact(&reply, &Implied::default());
            let (read, _) = codec::decode(&bytes).expect("decodes");
            assert_eq!(read, as_read(&reply), "{correlation:?}");
            // 16 bytes of id saved when the conversation is the request.
            let with_both = bytes.len();
            if correlation == Some(request.id) {
                let mut named = reply.clone();
                named.correlation_id = Some(uuid::Uuid::now_v7());
                assert_eq!(compact(&named, &Implied::default()).len(), with_both + 19);
            }
        }
    }

    #[test]
    fn the_named_form_is_still_told_apart_and_read() {
        let env = full();
        let named = codec::encode(&env, Encoding::MsgPack).expect("encodes");
        assert_eq!(Encoding::sniff(&named), Some(Encoding::MsgPack));
        assert_eq!(codec::decode(&named).expect("decodes").0, env);
    }

    #[test]
    fn leaves_out_what_the_subject_carries_and_gets_it_back() {
        let subjects = Subjects::default();
        let mut event = Envelope::new(Kind::Event, Performative::Inform, "publisher");
        event.topic = Some("doc.ready.for-review".into());
        let subject = subjects.event("doc.ready.for-review").expect("subject");
        let bytes = compact(&event, &subjects.implied(&subject));
        assert!(!bytes.windows(6).any(|w| w == b"review"), "{bytes:?}");
        let (mut read, _) = codec::decode(&bytes).expect("decodes");
        assert_eq!(read.topic, None);
        subjects.implied(&subject).restore(&mut read);
        assert_eq!(read, as_read(&event));

        let mut command = Envelope::new(Kind::Command, Performative::Request, "orchestrator");
        command.to = vec!["calculator".into()];
        command.name = Some("calculation".into());
        for subject in [
            subjects
                .command("calculator", "calculation")
                .expect("subject"),
            subjects
                .durable("calculator", "calculation", true)
                .expect("subject"),
        ] {
            let bytes = compact(&command, &subjects.implied(&subject));
            assert!(!bytes.windows(10).any(|w| w == b"calculator"), "{subject}");
            let (mut read, _) = codec::decode(&bytes).expect("decodes");
            subjects.implied(&subject).restore(&mut read);
            assert_eq!(read, as_read(&command), "{subject}");
        }
        // What the subject does not say is written: a second recipient, another name.
        let mut two = command.clone();
        two.to.push("auditor".into());
        let subject = subjects.command("calculator", "other").expect("subject");
        let (mut read, _) =
            codec::decode(&compact(&two, &subjects.implied(&subject))).expect("decodes");
        subjects.implied(&subject).restore(&mut read);
        assert_eq!(read, as_read(&two));
        // A subject of another root implies nothing.
        assert_eq!(subjects.implied("other.evt.doc.ready"), Implied::default());
    }

    /// The typical event: a sequence number, trace context and a 128-byte payload. The
    /// sizes per kind are the ones docs/PROTOCOL.md gives.
    #[test]
    fn an_event_carries_under_80_bytes_of_envelope_around_its_payload() {
        let subjects = Subjects::default();
        let mut event = Envelope::new(Kind::Event, Performative::Inform, "publisher");
        event.topic = Some("bench.events".into());
        event.seq = Some(Sequence {
            epoch: 0x9e37_79b9,
            n: 1_000,
        });
        event.trace = Some(TraceContext {
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
            tracestate: None,
        });
        event.payload = Bytes::from(vec![0x5a; 128]);
        let subject = subjects.event("bench.events").expect("subject");
        let compact_len = compact(&event, &subjects.implied(&subject)).len();
        let named_len = codec::encode(&event, Encoding::MsgPack)
            .expect("encodes")
            .len();
        assert!(
            compact_len - 128 < 80,
            "compact envelope {} bytes around 128",
            compact_len - 128
        );
        assert!(
            named_len > compact_len + 150,
            "{named_len} vs {compact_len}"
        );
    }

    /// An event written from its parts is the same bytes as the envelope it describes,
    /// whatever its id, hop limit, content type and payload.
    #[test]
    fn an_event_from_its_parts_is_the_envelope_byte_for_byte() {
        use compact::{EventParts, encode_event};
        let subjects = Subjects::default();
        let subject = subjects.event("doc.pages.scanned").expect("subject");
        let trace = crate::trace::fresh();
        let v4 = Uuid::from_u128(0x0123_4567_89ab_4def_8123_4567_89ab_cdef);
        let big = vec![0x5a; 70_000];
        for (id, hop_limit, content_type, payload) in [
            (
                Uuid::now_v7(),
                DEFAULT_HOP_LIMIT,
                CONTENT_TYPE_MSGPACK,
                &b"x"[..],
            ),
            (Uuid::now_v7(), 3, CONTENT_TYPE_JSON, &b"{}"[..]),
            (Uuid::now_v7(), 200, "application/octet-stream", &big[..]),
            (Uuid::now_v7(), DEFAULT_HOP_LIMIT, "text/plain", &b""[..]),
            (v4, DEFAULT_HOP_LIMIT, CONTENT_TYPE_MSGPACK, &big[..300]),
        ] {
            let parts = EventParts {
                id,
                from: "publisher-01",
                hop_limit,
                seq: Sequence {
                    epoch: 7,
                    n: 1 << 40,
                },
                trace,
                content_type,
                payload,
            };
            let mut direct = Vec::new();
            encode_event(&parts, &mut direct);
            let mut env = Envelope::new_typed(
                Kind::Event,
                Performative::Inform,
                "publisher-01",
                content_type.into(),
            );
            env.id = id;
            if id != v4 {
                env.timestamp_ms = (id.as_u128() >> 80) as u64;
            } else {
                // A non-v7 id carries its own timestamp: compare that field by reading it back.
                let (read, _) = codec::decode(&direct).expect("decodes");
                env.timestamp_ms = read.timestamp_ms;
            }
            env.topic = Some("doc.pages.scanned".into());
            env.hop_limit = hop_limit;
            env.seq = Some(parts.seq);
            env.trace = Some(TraceContext {
                traceparent: crate::protocol::envelope::TraceParent::from_bytes(trace),
                tracestate: None,
            });
            env.payload = Bytes::copy_from_slice(payload);
            assert_eq!(
                direct,
                compact(&env, &subjects.implied(&subject)).to_vec(),
                "{hop_limit} {content_type} {}",
                payload.len()
            );
        }
    }

    #[test]
    fn a_traceparent_of_another_version_travels_as_text() {
        let mut env = Envelope::new(Kind::Event, Performative::Inform, "p");
        for traceparent in [
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
            "garbage",
        ] {
            env.trace = Some(TraceContext {
                traceparent: traceparent.into(),
                tracestate: Some("a=b".into()),
            });
            let (read, _) = codec::decode(&compact(&env, &Implied::default())).expect("decodes");
            assert_eq!(read, env);
        }
    }

    /// Hand-made bytes: `0x8N` map, then key/value pairs.
    fn map(pairs: &[&[u8]]) -> Vec<u8> {
        let mut out = vec![0x80 | (pairs.len() as u8)];
        for p in pairs {
            out.extend_from_slice(p);
        }
        out
    }

    const ID: [u8; 19] = [
        1, 0xc4, 16, 0x01, 0x93, 0x00, 0x00, 0x00, 0x00, 0x70, 0x00, 0x80, 0, 0, 0, 0, 0, 0, 1,
    ];

    #[test]
    fn a_minimal_envelope_reads_with_its_timestamp_from_the_id() {
        let bytes = map(&[&[0, 2], &ID, &[2, 0xa1, b'p'], &[3, 3], &[4, 2]]);
        let (env, _) = codec::decode(&bytes).expect("decodes");
        assert_eq!(env.kind, Kind::Event);
        assert_eq!(env.performative, Performative::Inform);
        assert_eq!(env.timestamp_ms, 0x0193_0000_0000);
        assert_eq!(env.content_type, "application/msgpack");
        // A key of a newer minor version is skipped; an unknown code reads as unknown.
        let newer = map(&[
            &[0, 2],
            &[34, 7],
            &ID,
            &[2, 0xa1, b'p'],
            &[3, 99],
            &[4, 2],
            &[100, 0x92, 1, 2],
        ]);
        let (env, _) = codec::decode(&newer).expect("decodes");
        assert_eq!(env.kind, Kind::Unknown);
    }

    #[test]
    fn bad_compact_bytes_are_refused_with_what_is_wrong() {
        let cases: [(&str, Vec<u8>); 6] = [
            (
                "unsupported protocol version 3 ",
                map(&[&[0, 3], &ID, &[2, 0xa1, b'p'], &[3, 3], &[4, 2]]),
            ),
            ("no from", map(&[&[0, 2], &ID, &[3, 3], &[4, 2]])),
            (
                "key 3 repeated",
                map(&[&[0, 2], &ID, &[2, 0xa1, b'p'], &[3, 3], &[3, 3]]),
            ),
            (
                "key 1 does not read",
                map(&[
                    &[0, 2],
                    &[1, 0xa1, b'x'],
                    &[2, 0xa1, b'p'],
                    &[3, 3],
                    &[4, 2],
                ]),
            ),
            (
                "not a UUIDv7",
                map(&[
                    &[0, 2],
                    &[
                        1, 0xc4, 16, 0, 0, 0, 0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 1,
                    ],
                    &[2, 0xa1, b'p'],
                    &[3, 3],
                    &[4, 2],
                ]),
            ),
            (
                "bytes after the envelope",
                [
                    map(&[&[0, 2], &ID, &[2, 0xa1, b'p'], &[3, 3], &[4, 2]]),
                    vec![0xc0],
                ]
                .concat(),
            ),
        ];
        for (want, bytes) in cases {
            let err = codec::decode(&bytes).expect_err(want);
            assert!(
                matches!(
                    err,
                    CodecError::Malformed(_) | CodecError::UnsupportedVersion { .. }
                ),
                "{err}"
            );
            assert!(err.to_string().contains(want), "{want}: {err}");
        }
    }

    /// Damaged compact envelopes never panic the reader: every truncation of a full one, and
    /// 200,000 with random bytes changed.
    #[test]
    fn damaged_bytes_are_an_error_never_a_panic() {
        let bytes = compact(&full(), &Implied::default()).to_vec();
        for len in 0..bytes.len().min(600) {
            let _ = codec::decode(&bytes[..len]);
        }
        let small = {
            let mut e = full();
            e.payload = Bytes::from_static(b"pay");
            e.reason = Some("r".into());
            compact(&e, &Implied::default()).to_vec()
        };
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..200_000 {
            let mut damaged = small.clone();
            for _ in 0..1 + next() % 4 {
                let i = (next() as usize) % damaged.len();
                damaged[i] = next() as u8;
            }
            if let Ok((env, _)) = codec::decode(&damaged) {
                // Whatever reads must encode again.
                let _ = codec::encode(&env, Encoding::Compact).expect("encodes");
            }
            let _ = compact::peek_sequence(&damaged);
        }
    }
}
