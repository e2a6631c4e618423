//! An agent's signing identity: its ed25519 key (an nkey), and the bytes a message's signature
//! covers (docs/PROTOCOL.md section 4). What receivers do with signatures is `signing`'s; a
//! replay's own signature is `replay`'s; both stand on this.

use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::protocol::envelope::{Envelope, Signature};

/// A key that cannot be read or written: a malformed seed or secret, or the wrong kind of key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid key: {0}")]
pub struct KeyError(pub(crate) String);

/// The signature algorithm name carried in envelopes.
pub const SIGNATURE_ALG: &str = "ed25519";

/// An agent's signing identity: an nkey user key pair, held as the ed25519 key it encodes
/// (nkeys keeps no expanded key, so signing through it redoes work per message).
pub struct Identity {
    signer: ed25519_dalek::SigningKey,
    /// The public key as an nkey (`U...`), encoded once.
    public: String,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Identity({})", self.public)
    }
}

impl Identity {
    /// A new random identity.
    pub fn generate() -> Self {
        Self::from_key(&nkeys::KeyPair::new_user()).expect("a fresh user key has a seed")
    }

    /// The identity of a user nkey seed (`SU...`).
    ///
    /// # Errors
    /// [`KeyError`] when `seed` is not a valid nkey seed.
    pub fn from_seed(seed: &str) -> Result<Self, KeyError> {
        nkeys::KeyPair::from_seed(seed)
            .map_err(|e| KeyError(format!("not a valid nkey seed: {e}")))
            .and_then(|key| Self::from_key(&key))
    }

    fn from_key(key: &nkeys::KeyPair) -> Result<Self, KeyError> {
        let seed = key.seed().map_err(|e| KeyError(e.to_string()))?;
        let (_, raw) = nkeys::decode_seed(&seed).map_err(|e| KeyError(e.to_string()))?;
        Ok(Identity {
            signer: ed25519_dalek::SigningKey::from_bytes(&raw),
            public: key.public_key(),
        })
    }

    /// The public key (`U...`), what others register and verify against.
    pub fn public_key(&self) -> String {
        self.public.clone()
    }

    /// The seed, to store securely.
    ///
    /// # Errors
    /// [`KeyError`] when nkeys cannot encode the key as a user seed.
    pub fn seed(&self) -> Result<String, KeyError> {
        nkeys::KeyPair::new_from_raw(nkeys::KeyPairType::User, self.signer.to_bytes())
            .and_then(|key| key.seed())
            .map_err(|e| KeyError(e.to_string()))
    }

    /// The ed25519 signature of `bytes` (a replay's: [`super::replay`]).
    pub fn sign_bytes(&self, bytes: &[u8]) -> Vec<u8> {
        use ed25519_dalek::Signer;
        self.signer.sign(bytes).to_bytes().to_vec()
    }

    /// Signs `env` as published to `subject`.
    pub fn sign(&self, subject: &str, env: &mut Envelope) {
        use ed25519_dalek::Signer;
        let sig = self.signer.sign(&canonical_bytes(subject, env));
        env.signature = Some(Signature {
            alg: SIGNATURE_ALG.to_owned(),
            key: self.public.clone(),
            value: Bytes::copy_from_slice(&sig.to_bytes()),
        });
    }
}

/// The bytes a signature covers.
pub fn canonical_bytes(subject: &str, env: &Envelope) -> Vec<u8> {
    use std::io::Write;
    let digest = Sha256::digest(&env.payload);
    let mut out =
        Vec::with_capacity(14 + subject.len() + 1 + 36 + 1 + 20 + 1 + env.from.len() + 1 + 64);
    // Writes to a Vec do not fail.
    let _ = write!(
        out,
        "chorus-sig-v1\n{subject}\n{}\n{}\n{}\n",
        env.id.hyphenated(),
        env.timestamp_ms,
        env.from,
    );
    let mut hex = [0u8; 64];
    // 32 bytes always fit 64 hex digits.
    let _ = hex::encode_to_slice(digest, &mut hex);
    out.extend_from_slice(&hex);
    out
}
