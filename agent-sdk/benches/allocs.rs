//! Heap allocations per message on the SDK's publish path (envelope, subject, encoding) and
//! receive path (decoding), counted by `allocation-counter`. Prints the figures.
//! `cargo bench -p agent-sdk --bench allocs`.

use agent_sdk::codec::{self, Encoding};
use agent_sdk::{Envelope, Kind, Performative, Subjects};
use bytes::Bytes;

fn per_message(n: u64, mut f: impl FnMut()) -> f64 {
    f();
    let info = allocation_counter::measure(|| {
        for _ in 0..n {
            f();
        }
    });
    info.count_total as f64 / n as f64
}

fn main() {
    let subjects = Subjects::default();
    let payload = Bytes::from(vec![0x5a; 128]);
    let n = 100_000;
    for (form, encoding) in [("named", Encoding::MsgPack), ("compact", Encoding::Compact)] {
        let subject = subjects.event("doc.pages.scanned").expect("subject");
        let publish = per_message(n, || {
            // What Agent::publish_raw does before handing bytes to the NATS client.
            let subject = subjects.event("doc.pages.scanned").expect("subject");
            let mut env = Envelope::new(Kind::Event, Performative::Inform, "publisher-01");
            env.topic = Some("doc.pages.scanned".to_owned());
            env.content_type = "application/octet-stream".to_owned();
            env.payload = payload.clone();
            let bytes =
                codec::encode_on(&env, encoding, &subjects.implied(&subject)).expect("encodes");
            std::hint::black_box((subject, bytes));
        });
        let mut env = Envelope::new(Kind::Event, Performative::Inform, "publisher-01");
        env.topic = Some("doc.pages.scanned".to_owned());
        env.payload = payload.clone();
        let wire = codec::encode_on(&env, encoding, &subjects.implied(&subject)).expect("encodes");
        let receive = per_message(n, || {
            std::hint::black_box(
                codec::decode_on(&wire, &subjects.implied(&subject)).expect("decodes"),
            );
        });
        println!(
            "allocations per message, {form} form, SDK publish path (subject, envelope, encode): {publish:.1}"
        );
        println!("allocations per message, {form} form, SDK receive path (decode): {receive:.1}");
    }
}
