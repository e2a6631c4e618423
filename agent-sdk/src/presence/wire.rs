//! Following the bus's protocol level: the coordinator announces on `<root>.sys.wire` the
//! newest protocol major that every live agent reads, and an agent that has no encoding of its
//! own writes the compact form while that is 2. The same announcement carries the heartbeat
//! floor, which every agent that heartbeats follows.

use std::sync::Arc;

use chorus_broker_adapter::Subscription;
use tokio_util::sync::CancellationToken;

use crate::outbound::Outbound;
use crate::protocol::codec;
use crate::protocol::registry::WireLevel;

/// Reads the announcements until `stop`; what does not decode is ignored (the last good one
/// holds). An announcement is the coordinator's word: one that does not come from
/// `coordinator` is ignored, and where the agent verifies signatures and knows the
/// coordinator's key, so is one that is not signed with it (counted as a security refusal).
pub(crate) async fn follow_wire(
    out: Arc<Outbound>,
    mut sub: Subscription,
    stop: CancellationToken,
) {
    while let Some(msg) = sub.next_until(stop.cancelled()).await {
        let Ok((env, _)) = codec::decode(msg.payload()) else {
            tracing::debug!(agent = %out.link.id, "an announcement on the wire subject did not decode");
            continue;
        };
        if let Err(why) = out.coordinators_word(msg.subject(), &env) {
            out.link.count_security_refusal();
            tracing::warn!(agent = %out.link.id, from = %env.from, %why, "an announcement on the wire subject ignored");
            continue;
        }
        match codec::decode_payload::<WireLevel>(&env.payload, &env.content_type) {
            Ok(level) => out.take_wire(&level),
            Err(_) => {
                tracing::debug!(agent = %out.link.id, "an announcement on the wire subject did not decode");
            }
        }
    }
}
