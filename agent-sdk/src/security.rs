//! Signed envelopes: each agent signs what it sends with its ed25519 identity (an nkey, the
//! same kind of key NATS authenticates users with), and receivers check the signature against
//! the key registered for the claimed sender, refuse timestamps outside a tolerance and ids
//! they have already seen.
//!
//! The signed bytes are, joined by `\n`: `chorus-sig-v1`, the subject the message was published
//! to, the message id (hyphenated), `timestamp_ms` in decimal, `from`, and the lowercase hex
//! SHA-256 of the payload. Everything else in the envelope is routing or context a relay may
//! need to change.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::envelope::{Envelope, Signature};
use crate::status::StatusCode;

/// The signature algorithm name carried in envelopes.
pub const SIGNATURE_ALG: &str = "ed25519";

/// An agent's signing identity: an nkey user key pair.
pub struct Identity {
    key: nkeys::KeyPair,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Identity({})", self.key.public_key())
    }
}

impl Identity {
    /// A new random identity.
    pub fn generate() -> Self {
        Identity {
            key: nkeys::KeyPair::new_user(),
        }
    }

    /// The identity of a user nkey seed (`SU...`).
    pub fn from_seed(seed: &str) -> Result<Self, String> {
        nkeys::KeyPair::from_seed(seed)
            .map(|key| Identity { key })
            .map_err(|e| format!("not a valid nkey seed: {e}"))
    }

    /// The public key (`U...`), what others register and verify against.
    pub fn public_key(&self) -> String {
        self.key.public_key()
    }

    /// The seed, to store securely.
    pub fn seed(&self) -> Result<String, String> {
        self.key.seed().map_err(|e| e.to_string())
    }

    /// Signs `env` for publication on `subject`.
    pub fn sign(&self, subject: &str, env: &mut Envelope) {
        let input = canonical_bytes(subject, env);
        match self.key.sign(&input) {
            Ok(sig) => {
                env.signature = Some(Signature {
                    alg: SIGNATURE_ALG.to_owned(),
                    key: self.key.public_key(),
                    value: Bytes::from(sig),
                });
            }
            Err(e) => tracing::error!(error = %e, "signing failed; sending unsigned"),
        }
    }
}

/// The bytes a signature covers.
pub fn canonical_bytes(subject: &str, env: &Envelope) -> Vec<u8> {
    let digest = Sha256::digest(&env.payload);
    format!(
        "chorus-sig-v1\n{subject}\n{}\n{}\n{}\n{}",
        env.id,
        env.timestamp_ms,
        env.from,
        hex::encode(digest)
    )
    .into_bytes()
}

/// What a receiver accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignaturePolicy {
    /// Refuse unsigned messages (5014). Off by default, so agents can be moved to signing one
    /// by one.
    pub require_signed: bool,
    /// How far a signed message's timestamp may be from the receiver's clock (default 2 min).
    pub tolerance: Duration,
}

impl Default for SignaturePolicy {
    fn default() -> Self {
        SignaturePolicy {
            require_signed: false,
            tolerance: Duration::from_secs(120),
        }
    }
}

/// A refusal: the status code and why.
pub type Refused = (StatusCode, String);

/// Checks signatures against registered keys and remembers recent ids to refuse replays.
#[derive(Debug, Default)]
pub struct Verifier {
    policy: SignaturePolicy,
    /// Agent id to its public key, parsed once.
    keys: Mutex<HashMap<String, (String, std::sync::Arc<nkeys::KeyPair>)>>,
    seen: Mutex<SeenIds>,
}

#[derive(Debug, Default)]
struct SeenIds {
    expiry: HashMap<Uuid, u64>,
    next_prune_ms: u64,
}

impl Verifier {
    /// A verifier with `policy` and no keys yet.
    pub fn new(policy: SignaturePolicy) -> Self {
        Verifier {
            policy,
            ..Verifier::default()
        }
    }

    /// The policy.
    pub fn policy(&self) -> &SignaturePolicy {
        &self.policy
    }

    /// Registers (or replaces) `agent`'s public key.
    pub fn trust(&self, agent: &str, public_key: &str) {
        let Ok(parsed) = nkeys::KeyPair::from_public_key(public_key) else {
            tracing::warn!(agent, "ignoring an unusable public key");
            return;
        };
        if let Ok(mut keys) = self.keys.lock() {
            keys.insert(
                agent.to_owned(),
                (public_key.to_owned(), std::sync::Arc::new(parsed)),
            );
        }
    }

    /// Forgets `agent`'s key.
    pub fn forget(&self, agent: &str) {
        if let Ok(mut keys) = self.keys.lock() {
            keys.remove(agent);
        }
    }

    /// The key registered for `agent`.
    pub fn key_of(&self, agent: &str) -> Option<String> {
        self.keys.lock().ok()?.get(agent).map(|(k, _)| k.clone())
    }

    fn parsed_key_of(&self, agent: &str) -> Option<(String, std::sync::Arc<nkeys::KeyPair>)> {
        self.keys.lock().ok()?.get(agent).cloned()
    }

    /// Checks `env`, received on `subject`, at `now_ms`.
    pub fn verify(&self, subject: &str, env: &Envelope, now_ms: u64) -> Result<(), Refused> {
        let Some(sig) = &env.signature else {
            return if self.policy.require_signed {
                Err((
                    StatusCode::UNAUTHORIZED,
                    "unsigned messages are refused here".into(),
                ))
            } else {
                Ok(())
            };
        };
        if sig.alg != SIGNATURE_ALG {
            return Err((
                StatusCode::UNAUTHORIZED,
                format!("unsupported signature algorithm {:?}", sig.alg),
            ));
        }
        let Some((registered, verifier)) = self.parsed_key_of(&env.from) else {
            return Err((
                StatusCode::IDENTITY,
                format!("no key is registered for {:?}", env.from),
            ));
        };
        if registered != sig.key {
            return Err((
                StatusCode::IDENTITY,
                format!("signed with a key that is not {:?}'s", env.from),
            ));
        }
        if verifier
            .verify(&canonical_bytes(subject, env), &sig.value)
            .is_err()
        {
            return Err((StatusCode::IDENTITY, "the signature does not verify".into()));
        }
        let tolerance = u64::try_from(self.policy.tolerance.as_millis()).unwrap_or(u64::MAX);
        if env.timestamp_ms.abs_diff(now_ms) > tolerance {
            return Err((
                StatusCode::REPLAY,
                format!(
                    "timestamp is {} ms from this receiver's clock, beyond the tolerance of {tolerance} ms",
                    env.timestamp_ms.abs_diff(now_ms)
                ),
            ));
        }
        let mut seen = self
            .seen
            .lock()
            .map_err(|_| (StatusCode::INTERNAL, "replay cache unavailable".to_owned()))?;
        if now_ms >= seen.next_prune_ms {
            seen.expiry.retain(|_, until| *until > now_ms);
            seen.next_prune_ms = now_ms + tolerance.max(1_000);
        }
        // An id is remembered as long as its timestamp could still pass the tolerance check.
        let until = env.timestamp_ms.saturating_add(tolerance).saturating_add(1);
        if seen.expiry.insert(env.id, until).is_some() {
            return Err((StatusCode::REPLAY, "this message id was seen before".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{Kind, Performative};

    #[test]
    fn a_signed_envelope_verifies_and_every_tampering_is_refused_with_its_code() {
        let alice = Identity::generate();
        let verifier = Verifier::new(SignaturePolicy {
            require_signed: true,
            ..Default::default()
        });
        verifier.trust("alice", &alice.public_key());
        let mut env = Envelope::new(Kind::Request, Performative::Request, "alice");
        env.payload = Bytes::from_static(b"pay 10");
        alice.sign("chorus.agent.bob.pay", &mut env);
        let now = env.timestamp_ms;
        assert_eq!(verifier.verify("chorus.agent.bob.pay", &env, now), Ok(()));
        assert_eq!(
            verifier
                .verify("chorus.agent.bob.pay", &env, now)
                .map_err(|e| e.0),
            Err(StatusCode::REPLAY)
        );

        let mut forged = env.clone();
        forged.id = Uuid::now_v7();
        forged.payload = Bytes::from_static(b"pay 1000");
        assert_eq!(
            verifier
                .verify("chorus.agent.bob.pay", &forged, now)
                .map_err(|e| e.0),
            Err(StatusCode::IDENTITY)
        );

        let mut other_subject = env.clone();
        other_subject.id = Uuid::now_v7();
        assert_eq!(
            verifier
                .verify("chorus.agent.eve.pay", &other_subject, now)
                .map_err(|e| e.0),
            Err(StatusCode::IDENTITY)
        );

        let mut unsigned = env.clone();
        unsigned.signature = None;
        assert_eq!(
            verifier.verify("s", &unsigned, now).map_err(|e| e.0),
            Err(StatusCode::UNAUTHORIZED)
        );
    }
}
