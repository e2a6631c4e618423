use bytes::Bytes;
use uuid::Uuid;

use super::*;
use crate::protocol::envelope::{
    EncryptedKey, Encryption, ExpectedReply, Kind, Performative, Progress, ProgressState, Sequence,
    Signature, TraceContext,
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
        state: ProgressState::Running,
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
        e.from = "x".repeat(len);
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
        state: ProgressState::Failed,
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
