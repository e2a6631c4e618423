//! The pipeline's cross-cutting checks, each a small [`Layer`] in a file of its own. A layer
//! sees the decoded, admitted message before its handler and may pass it, change it (decrypt
//! or decompress its payload) or stop it with a [`Failure`]. A new concern (usage counting, say) is a new
//! layer here and one line in `Pipeline::new`.

mod authorize;
mod decompress;
mod decrypt;
mod token;
mod verify;

pub(crate) use authorize::Authorize;
pub(crate) use decompress::Decompress;
pub(crate) use decrypt::Decrypt;
pub(crate) use token::RequireToken;
pub(crate) use token::TokenCheck;
pub(crate) use verify::{Batches, Verify};

use crate::handler::endpoint::Endpoint;
use crate::inbound::outcome::Failure;
use crate::protocol::envelope::Envelope;

/// One message as the layers see it.
pub(crate) struct Inbound<'a> {
    /// The subject it arrived on (signatures cover it).
    pub(crate) subject: &'a str,
    pub(crate) env: Envelope,
    /// The command or capability it is for; `None` for events and unknown commands.
    pub(crate) endpoint: Option<&'a Endpoint>,
    /// Whether its `from` is proven: set by the verify layer when the message carried a
    /// signature that verified against the key registered for that sender. Grants apply only
    /// to verified senders (unless the agent trusts unverified ones).
    pub(crate) verified: bool,
    /// The signature check's verdict, when it was made already in a batch
    /// ([`Batches`]); the verify layer makes it otherwise.
    pub(crate) preverified: Option<Result<(), crate::security::signing::Refused>>,
    /// The stream sequence of the stored copy it was delivered from, if it was (a redelivery
    /// of the same copy is not a replay).
    pub(crate) stored: Option<u64>,
    /// A replayer's signed word that this is its replay of a dead letter (or why it does not
    /// read): checked by the verify layer instead of the usual age and seen-id checks.
    pub(crate) replay: Option<Result<crate::security::replay::ReplayProof, String>>,
    /// The id it is remembered by against replays: its own, or for a replay of a dead
    /// letter, [`crate::security::replay::replay_id`]. Set by the verify layer.
    pub(crate) seen_id: uuid::Uuid,
}

impl<'a> Inbound<'a> {
    /// A message not yet checked by any layer (so not verified).
    pub(crate) fn new(subject: &'a str, env: Envelope, endpoint: Option<&'a Endpoint>) -> Self {
        let seen_id = env.id;
        Inbound {
            subject,
            env,
            endpoint,
            verified: false,
            preverified: None,
            stored: None,
            replay: None,
            seen_id,
        }
    }
}

/// One cross-cutting check of the inbound pipeline.
pub(crate) trait Layer: Send + Sync + 'static {
    /// Passes `msg` (possibly changed) or stops it.
    fn check(&self, msg: &mut Inbound<'_>) -> Result<(), Failure>;

    /// [`check`](Layer::check) for several messages at once (events already waiting); one by
    /// one unless the layer can do better.
    fn check_batch(&self, msgs: &mut [Inbound<'_>]) -> Vec<Result<(), Failure>> {
        msgs.iter_mut().map(|m| self.check(m)).collect()
    }
}
