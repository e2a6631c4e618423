//! Envelope encode and decode, MessagePack and JSON, with a 128-byte payload: the per-message
//! work the SDK adds on top of NATS. `cargo bench -p chorus-sdk --bench codec`.
//! (Signing and encryption benches join these when those paths exist.)

use bytes::Bytes;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::{Envelope, Kind, Performative};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;

fn sample() -> Envelope {
    let mut e = Envelope::new(Kind::Event, Performative::Inform, "publisher-01");
    e.topic = Some("doc.pages.scanned".into());
    e.payload = Bytes::from(vec![0x5a; 128]);
    e
}

fn codec_bench(c: &mut Criterion) {
    let env = sample();
    let mut group = c.benchmark_group("envelope");
    group.throughput(Throughput::Elements(1));
    for enc in [Encoding::MsgPack, Encoding::Json] {
        let bytes = codec::encode(&env, enc).expect("encodes");
        group.bench_function(format!("encode {enc:?}"), |b| {
            b.iter(|| codec::encode(black_box(&env), enc).expect("encodes"))
        });
        group.bench_function(format!("decode {enc:?}"), |b| {
            b.iter(|| codec::decode_shared(black_box(&bytes)).expect("decodes"))
        });
    }
    group.bench_function("new envelope (uuid v7, clock)", |b| {
        b.iter(|| Envelope::new(Kind::Event, Performative::Inform, black_box("publisher-01")))
    });
    group.finish();
}

criterion_group!(benches, codec_bench);
criterion_main!(benches);
