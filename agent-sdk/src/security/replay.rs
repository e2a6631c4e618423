//! A person's replay of a signed dead letter (docs/PROTOCOL.md 7.5, "Replaying a signed dead
//! letter").
//!
//! A replay republishes the original bytes unchanged, so the original sender's signature stays
//! as provenance; a receiver that verifies would refuse them as a replay (the id was seen) or as
//! stale (the timestamp is old). So the replayer signs the replay itself, in headers beside the
//! original: who replayed (`Chorus-Replay-By`), when (`Chorus-Replay-Ms`), which dead letter
//! (`Chorus-Replay-Of`), and an ed25519 signature (`Chorus-Replay-Signature`, `<nkey>
//! <hex>`) over, joined by `\n`: `chorus-replay-v1`, the subject, the original id (hyphenated),
//! the dead letter, the time in decimal and the replayer's id.
//!
//! A receiver accepts it when the replayer is one it trusts explicitly (a key given with
//! `trust`, never one it learned from the registry), the replay signature verifies, the replay
//! time is within its tolerance, and the original's signature verifies against its sender's key
//! (its age not counted). It is then handled once per dead letter: its seen id is
//! [`replay_id`] of the original id and the dead letter, so the same replay delivered again from
//! another copy is refused with 5015, and a replay of the same letter's later dead letter is
//! a new one.

use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::identity::{Identity, SIGNATURE_ALG};

/// The dead letter replayed: `<DLQ stream>:<sequence>`.
pub const REPLAY_OF_HEADER: &str = "Chorus-Replay-Of";
/// Who replayed it.
pub const REPLAY_BY_HEADER: &str = "Chorus-Replay-By";
/// When, ms since the epoch.
pub const REPLAY_MS_HEADER: &str = "Chorus-Replay-Ms";
/// `<nkey> <hex signature>`.
pub const REPLAY_SIGNATURE_HEADER: &str = "Chorus-Replay-Signature";

/// A replayer's signed word that it replayed a dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayProof {
    /// The dead letter, `<stream>:<sequence>`.
    pub of: String,
    /// The replayer's id.
    pub by: String,
    /// When it replayed, ms since the epoch.
    pub at_ms: u64,
    /// The replayer's public key (`U...`).
    pub key: String,
    /// The ed25519 signature.
    pub signature: Vec<u8>,
}

/// What a replay signature covers.
pub fn replay_bytes(subject: &str, id: Uuid, of: &str, at_ms: u64, by: &str) -> Vec<u8> {
    format!(
        "chorus-replay-v1\n{subject}\n{}\n{of}\n{at_ms}\n{by}",
        id.hyphenated()
    )
    .into_bytes()
}

/// The id a replay is remembered by: the first 16 bytes of the SHA-256 of
/// `chorus-replay-v1\n<original id>\n<dead letter>`.
pub fn replay_id(id: Uuid, of: &str) -> Uuid {
    let digest = Sha256::digest(format!("chorus-replay-v1\n{}\n{of}", id.hyphenated()));
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    Uuid::from_bytes(bytes)
}

impl ReplayProof {
    /// `identity` (id `by`) replaying dead letter `of`, the message `id` published to `subject`,
    /// at `at_ms`.
    pub fn sign(
        identity: &Identity,
        by: &str,
        subject: &str,
        id: Uuid,
        of: &str,
        at_ms: u64,
    ) -> Self {
        ReplayProof {
            of: of.to_owned(),
            by: by.to_owned(),
            at_ms,
            key: identity.public_key(),
            signature: identity.sign_bytes(&replay_bytes(subject, id, of, at_ms, by)),
        }
    }

    /// The headers that carry it.
    pub fn headers(&self) -> [(&'static str, String); 4] {
        [
            (REPLAY_OF_HEADER, self.of.clone()),
            (REPLAY_BY_HEADER, self.by.clone()),
            (REPLAY_MS_HEADER, self.at_ms.to_string()),
            (
                REPLAY_SIGNATURE_HEADER,
                format!("{} {}", self.key, hex::encode(&self.signature)),
            ),
        ]
    }

    /// The proof in a message's headers (`header` reads one): `None` when it carries no replay
    /// signature (an unsigned replay, or no replay at all).
    ///
    /// # Errors
    /// Why a replay signature that is there cannot be read.
    pub fn from_headers<'a>(
        header: impl Fn(&str) -> Option<&'a str>,
    ) -> Option<Result<ReplayProof, String>> {
        let signed = header(REPLAY_SIGNATURE_HEADER)?;
        let read = || {
            let (key, value) = signed
                .split_once(' ')
                .ok_or("Chorus-Replay-Signature is not `<key> <hex>`")?;
            let signature = hex::decode(value.trim())
                .map_err(|_| "Chorus-Replay-Signature's signature is not hex")?;
            let of =
                header(REPLAY_OF_HEADER).ok_or("a replay signature without Chorus-Replay-Of")?;
            let by =
                header(REPLAY_BY_HEADER).ok_or("a replay signature without Chorus-Replay-By")?;
            let at_ms = header(REPLAY_MS_HEADER)
                .and_then(|ms| ms.parse().ok())
                .ok_or("a replay signature without a Chorus-Replay-Ms in ms")?;
            Ok::<_, &str>(ReplayProof {
                of: of.to_owned(),
                by: by.to_owned(),
                at_ms,
                key: key.to_owned(),
                signature,
            })
        };
        Some(read().map_err(str::to_owned))
    }

    /// The algorithm of its signature (ed25519, as envelopes').
    pub fn alg(&self) -> &'static str {
        SIGNATURE_ALG
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_round_trips_through_its_headers() {
        let ops = Identity::generate();
        let id = Uuid::now_v7();
        let proof = ReplayProof::sign(
            &ops,
            "ops",
            "chorus.agent.nlp.analyze",
            id,
            "CHORUS_DLQ:7",
            42,
        );
        let headers = proof.headers();
        let read = ReplayProof::from_headers(|name| {
            headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_str())
        })
        .expect("present")
        .expect("reads");
        assert_eq!(read, proof);
        assert!(ReplayProof::from_headers(|_| None).is_none());
        let broken = ReplayProof::from_headers(|name| {
            (name == REPLAY_SIGNATURE_HEADER).then_some("nospace")
        });
        assert!(broken.expect("present").is_err());
    }

    #[test]
    fn the_replay_id_differs_per_dead_letter_and_is_stable() {
        let id = Uuid::parse_str("0190f0d2-7c4e-7000-8000-000000000001").expect("uuid");
        assert_eq!(replay_id(id, "CHORUS_DLQ:1"), replay_id(id, "CHORUS_DLQ:1"));
        assert_ne!(replay_id(id, "CHORUS_DLQ:1"), replay_id(id, "CHORUS_DLQ:2"));
        assert_ne!(replay_id(id, "CHORUS_DLQ:1"), id);
    }
}
