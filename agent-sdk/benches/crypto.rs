//! Signing, verification and end-to-end encryption of one envelope with a 128-byte payload:
//! the per-message work a secured bus adds. `cargo bench -p chorus-sdk --bench crypto`.

use bytes::Bytes;
use chorus_sdk::encryption::{self, EncryptionKey};
use chorus_sdk::envelope::now_ms;
use chorus_sdk::security::{Identity, SignaturePolicy, Verifier, canonical_bytes};
use chorus_sdk::{Envelope, Kind, Performative};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;

const SUBJECT: &str = "chorus.evt.doc.pages.scanned";

fn sample() -> Envelope {
    let mut e = Envelope::new(Kind::Event, Performative::Inform, "publisher-01");
    e.topic = Some("doc.pages.scanned".into());
    e.payload = Bytes::from(vec![0x5a; 128]);
    e
}

fn crypto_bench(c: &mut Criterion) {
    let id = Identity::generate();
    let verifier = Verifier::new(SignaturePolicy {
        require_signed: true,
        ..SignaturePolicy::default()
    });
    verifier.trust("publisher-01", &id.public_key());
    let mut group = c.benchmark_group("security");
    group.throughput(Throughput::Elements(1));
    group.bench_function("canonical bytes", |b| {
        let env = sample();
        b.iter(|| canonical_bytes(black_box(SUBJECT), black_box(&env)))
    });
    group.bench_function("sign", |b| {
        b.iter_batched(
            sample,
            |mut env| {
                id.sign(SUBJECT, &mut env);
                env
            },
            BatchSize::SmallInput,
        )
    });
    // Every verified message needs a fresh id, or the replay check refuses it.
    group.bench_function("verify", |b| {
        b.iter_batched(
            || {
                let mut env = sample();
                id.sign(SUBJECT, &mut env);
                env
            },
            |env| {
                verifier
                    .verify(SUBJECT, &env, now_ms())
                    .expect("a good signature verifies")
            },
            BatchSize::SmallInput,
        )
    });
    // What a receiver does with a burst: the signatures of 64 events checked together.
    group.throughput(Throughput::Elements(64));
    group.bench_function("verify, batches of 64", |b| {
        b.iter_batched(
            || {
                (0..64)
                    .map(|_| {
                        let mut env = sample();
                        id.sign(SUBJECT, &mut env);
                        env
                    })
                    .collect::<Vec<_>>()
            },
            |envs| {
                let items: Vec<_> = envs.iter().map(|e| (SUBJECT, e)).collect();
                let results = verifier.verify_batch(&items, now_ms());
                assert!(results.iter().all(Result::is_ok), "good signatures verify");
                envs
            },
            BatchSize::SmallInput,
        )
    });
    group.throughput(Throughput::Elements(1));
    let key = EncryptionKey::generate();
    let recipients = vec![("reader".to_owned(), key.public_key())];
    group.bench_function("encrypt for one recipient", |b| {
        b.iter_batched(
            sample,
            |mut env| {
                encryption::encrypt(&mut env, &recipients).expect("encrypts");
                env
            },
            BatchSize::SmallInput,
        )
    });
    group.bench_function("decrypt", |b| {
        b.iter_batched(
            || {
                let mut env = sample();
                encryption::encrypt(&mut env, &recipients).expect("encrypts");
                env
            },
            |mut env| {
                key.decrypt("reader", &mut env).expect("decrypts");
                env
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, crypto_bench);
criterion_main!(benches);
