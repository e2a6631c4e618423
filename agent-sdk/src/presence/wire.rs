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
/// holds).
pub(crate) async fn follow_wire(
    out: Arc<Outbound>,
    mut sub: Subscription,
    stop: CancellationToken,
) {
    while let Some(msg) = sub.next_until(stop.cancelled()).await {
        let level = codec::decode(msg.payload()).ok().and_then(|(env, _)| {
            codec::decode_payload::<WireLevel>(&env.payload, &env.content_type).ok()
        });
        match level {
            Some(level) => out.take_wire(&level),
            None => {
                tracing::debug!(agent = %out.link.id, "an announcement on the wire subject did not decode");
            }
        }
    }
}
