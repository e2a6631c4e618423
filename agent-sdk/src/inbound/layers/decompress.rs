//! Decompression: a payload that came compressed (`content_encoding: "zstd"`) is handed to its
//! handler as it was sent, after the signature check and decryption. An encoding this SDK does
//! not read, or a payload that does not decompress within the agent's payload limit, is 5006.

use std::sync::Arc;

use super::{Inbound, Layer};
use crate::inbound::outcome::Failure;
use crate::stats::AgentCounters;

pub(crate) struct Decompress {
    /// The largest payload the agent takes.
    pub(crate) limit: usize,
    pub(crate) counters: Arc<AgentCounters>,
}

impl Layer for Decompress {
    fn check(&self, msg: &mut Inbound<'_>) -> Result<(), Failure> {
        if msg.env.content_encoding.is_none() {
            return Ok(());
        }
        crate::payload::open_encoding(&mut msg.env, self.limit)
            .map_err(|(status, reason)| Failure::refused(status, reason))?;
        AgentCounters::bump(&self.counters.payloads_decompressed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::envelope::{Envelope, Kind, Performative};
    use crate::protocol::status::StatusCode;

    fn layer(limit: usize) -> Decompress {
        Decompress {
            limit,
            counters: Arc::default(),
        }
    }

    fn compressed(text: &str) -> Envelope {
        let mut env = Envelope::new(Kind::Request, Performative::Request, "alice");
        env.payload = crate::payload::compress(text.as_bytes()).expect("compresses");
        env.content_encoding = Some("zstd".into());
        env
    }

    #[test]
    fn the_handler_sees_the_payload_as_sent() {
        let text = "abc".repeat(50_000);
        let mut msg = Inbound::new("chorus.agent.x.y", compressed(&text), None);
        layer(1 << 20).check(&mut msg).expect("decompresses");
        assert_eq!(&msg.env.payload[..], text.as_bytes());
        assert_eq!(msg.env.content_encoding, None);
    }

    #[test]
    fn an_unknown_encoding_or_an_oversized_payload_is_5006() {
        let mut env = compressed(&"abc".repeat(50_000));
        env.content_encoding = Some("br".into());
        let mut msg = Inbound::new("chorus.agent.x.y", env, None);
        let failure = layer(1 << 20).check(&mut msg).expect_err("unknown");
        assert_eq!(failure.status, StatusCode::DATA_FORMAT);
        let mut msg = Inbound::new("chorus.agent.x.y", compressed(&"abc".repeat(50_000)), None);
        let failure = layer(1000).check(&mut msg).expect_err("too large");
        assert_eq!(failure.status, StatusCode::DATA_FORMAT);
    }
}
