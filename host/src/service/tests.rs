//! The tests of the host service.

use super::*;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::envelope::CONTENT_TYPE_MSGPACK;
use chorus_sdk::{Envelope, Kind, Performative};

fn heartbeat(heartbeat_ms: u64, encoding: Encoding) -> Vec<u8> {
    let manifest: chorus_sdk::registry::Manifest = serde_json::from_value(serde_json::json!({
        "agent": "a1", "instance": "0", "heartbeat_ms": heartbeat_ms, "started_ms": 0,
    }))
    .expect("manifest");
    let mut env = Envelope::new(Kind::Heartbeat, Performative::Health, "a1");
    env.payload = codec::encode_payload(&manifest, CONTENT_TYPE_MSGPACK).expect("payload");
    codec::encode(&env, encoding).expect("encode").to_vec()
}

#[test]
fn a_paced_agent_is_allowed_three_of_the_intervals_its_heartbeats_announce() {
    for encoding in [Encoding::MsgPack, Encoding::Compact, Encoding::Json] {
        assert_eq!(
            announced_interval(&heartbeat(50_000, encoding)),
            Some(Duration::from_secs(50)),
            "{encoding:?}"
        );
    }
    assert_eq!(announced_interval(b"not an envelope"), None);
    let mut watch = Watch {
        deployment: "d".into(),
        replica: 0,
        process: "d".into(),
        started: Instant::now(),
        check: HealthCheck::Heartbeat,
        grace: Duration::from_secs(30),
        silence: Duration::from_secs(30),
        last_heartbeat: None,
        beat: Duration::ZERO,
        confirmed: true,
    };
    // Before a heartbeat says otherwise, and while the agent beats faster than the
    // manifest's health interval: the manifest's silence.
    assert_eq!(watch.allowed_silence(), Duration::from_secs(30));
    watch.beat = Duration::from_secs(5);
    assert_eq!(watch.allowed_silence(), Duration::from_secs(30));
    // Paced by the bus to one beat in 50 s: three of those.
    watch.beat = Duration::from_secs(50);
    assert_eq!(watch.allowed_silence(), Duration::from_secs(150));
}
