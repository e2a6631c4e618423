//! End-to-end payload encryption for named recipients (HPKE: X25519, HKDF-SHA256,
//! AES-256-GCM).
//!
//! The payload is sealed once, to a fresh X25519 key pair made for this message; that key
//! pair's private key is then sealed to each recipient's public key. Only a recipient can open
//! its copy of the message key and so the payload; the broker, the coordinator and the
//! dead-letter queue see the routing fields and ciphertext. The signature (if any) covers the
//! ciphertext.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use hpke::aead::AesGcm256;
use hpke::kdf::HkdfSha256;
use hpke::kem::X25519HkdfSha256;
use hpke::{Deserializable, Kem as _, OpModeR, OpModeS, Serializable};

use crate::protocol::envelope::{EncryptedKey, Encryption, Envelope};
use crate::protocol::status::StatusCode;
use crate::security::signing::KeyError;

/// A payload that could not be sealed: a recipient's public key malformed, or no recipient.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot encrypt: {0}")]
pub struct EncryptionError(String);

type Kem = X25519HkdfSha256;

/// The scheme name carried in envelopes.
pub const ENCRYPTION_ALG: &str = "hpke-x25519-hkdfsha256-aes256gcm";
/// The content type of an encrypted payload.
pub use crate::protocol::envelope::CONTENT_TYPE_ENCRYPTED;
const INFO: &[u8] = b"chorus-e2e-v1";
const ENC_LEN: usize = 32;

/// An agent's decryption key pair (X25519). Share the public half (the manifest does).
pub struct EncryptionKey {
    private: <Kem as hpke::Kem>::PrivateKey,
    public: <Kem as hpke::Kem>::PublicKey,
}

impl std::fmt::Debug for EncryptionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EncryptionKey({})", self.public_key())
    }
}

impl EncryptionKey {
    /// A new random key pair.
    pub fn generate() -> Self {
        let (private, public) = Kem::gen_keypair();
        EncryptionKey { private, public }
    }

    /// The public key, base64.
    pub fn public_key(&self) -> String {
        STANDARD.encode(self.public.to_bytes())
    }

    /// The private key, base64 (to store securely).
    pub fn secret(&self) -> String {
        STANDARD.encode(self.private.to_bytes())
    }

    /// A key pair from its base64 private key.
    ///
    /// # Errors
    /// [`KeyError`] when `secret` is not base64 or not an X25519 private key.
    pub fn from_secret(secret: &str) -> Result<Self, KeyError> {
        let bytes = STANDARD
            .decode(secret)
            .map_err(|e| KeyError(e.to_string()))?;
        let private = <Kem as hpke::Kem>::PrivateKey::from_bytes(&bytes)
            .map_err(|e| KeyError(e.to_string()))?;
        let public = Kem::sk_to_pk(&private);
        Ok(EncryptionKey { private, public })
    }

    /// Opens `env`'s payload if it is encrypted for `me`: replaces the payload with the
    /// plaintext and restores its content type.
    ///
    /// # Errors
    /// 5007 (access) when `me` is not a recipient or the message key does not open with this key;
    /// 5006 (data format) for another scheme or a payload that does not decrypt.
    pub fn decrypt(&self, me: &str, env: &mut Envelope) -> Result<(), (StatusCode, String)> {
        let Some(enc) = env.encryption.take() else {
            return Ok(());
        };
        let refuse = |status, why: &str| Err((status, why.to_owned()));
        if enc.alg != ENCRYPTION_ALG {
            return refuse(StatusCode::DATA_FORMAT, "unsupported encryption scheme");
        }
        let Some(mine) = enc.recipients.iter().find(|r| r.agent == me) else {
            return refuse(
                StatusCode::ACCESS,
                "this agent is not a recipient of the encrypted payload",
            );
        };
        let open = |sealed: &[u8], sk: &<Kem as hpke::Kem>::PrivateKey| -> Option<Vec<u8>> {
            if sealed.len() < ENC_LEN {
                return None;
            }
            let (encapped, ct) = sealed.split_at(ENC_LEN);
            let encapped = <Kem as hpke::Kem>::EncappedKey::from_bytes(encapped).ok()?;
            hpke::single_shot_open::<AesGcm256, HkdfSha256, Kem>(
                &OpModeR::Base,
                sk,
                &encapped,
                INFO,
                ct,
                b"",
            )
            .ok()
        };
        let Some(message_key) = open(&mine.key, &self.private) else {
            return refuse(
                StatusCode::ACCESS,
                "the message key does not open with this agent's key",
            );
        };
        let Ok(message_sk) = <Kem as hpke::Kem>::PrivateKey::from_bytes(&message_key) else {
            return refuse(StatusCode::DATA_FORMAT, "malformed message key");
        };
        let Some(plain) = open(&env.payload, &message_sk) else {
            return refuse(StatusCode::DATA_FORMAT, "the payload does not decrypt");
        };
        env.payload = Bytes::from(plain);
        env.content_type = enc.inner_content_type.into();
        Ok(())
    }
}

fn seal(pk: &<Kem as hpke::Kem>::PublicKey, plaintext: &[u8]) -> Result<Vec<u8>, String> {
    let (encapped, ct) = hpke::single_shot_seal::<AesGcm256, HkdfSha256, Kem>(
        &OpModeS::Base,
        pk,
        INFO,
        plaintext,
        b"",
    )
    .map_err(|e| e.to_string())?;
    let mut out = encapped.to_bytes().to_vec();
    out.extend_from_slice(&ct);
    Ok(out)
}

/// Encrypts `env`'s payload for `recipients` (agent id and base64 public key each).
///
/// # Errors
/// [`EncryptionError`] when `recipients` is empty or a recipient's key is not a base64 X25519
/// public key.
pub fn encrypt(env: &mut Envelope, recipients: &[(String, String)]) -> Result<(), EncryptionError> {
    seal_for(env, recipients).map_err(EncryptionError)
}

fn seal_for(env: &mut Envelope, recipients: &[(String, String)]) -> Result<(), String> {
    if recipients.is_empty() {
        return Err("no recipients to encrypt for".into());
    }
    let (message_sk, message_pk) = Kem::gen_keypair();
    let payload = seal(&message_pk, &env.payload)?;
    let mut wrapped = Vec::with_capacity(recipients.len());
    for (agent, public) in recipients {
        let bytes = STANDARD
            .decode(public)
            .map_err(|e| format!("{agent}'s key: {e}"))?;
        let pk = <Kem as hpke::Kem>::PublicKey::from_bytes(&bytes)
            .map_err(|e| format!("{agent}'s key: {e}"))?;
        wrapped.push(EncryptedKey {
            agent: agent.clone(),
            key: Bytes::from(seal(&pk, &message_sk.to_bytes())?),
        });
    }
    env.encryption = Some(Encryption {
        alg: ENCRYPTION_ALG.to_owned(),
        inner_content_type: String::from(std::mem::replace(
            &mut env.content_type,
            CONTENT_TYPE_ENCRYPTED.into(),
        )),
        recipients: wrapped,
    });
    env.payload = Bytes::from(payload);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::envelope::{Kind, Performative};

    #[test]
    fn only_recipients_open_the_payload() {
        let bob = EncryptionKey::generate();
        let carol = EncryptionKey::generate();
        let eve = EncryptionKey::generate();
        let mut env = Envelope::new(Kind::Command, Performative::Request, "alice");
        env.payload = Bytes::from_static(b"the launch code");
        encrypt(
            &mut env,
            &[
                ("bob".into(), bob.public_key()),
                ("carol".into(), carol.public_key()),
            ],
        )
        .expect("encrypts");
        assert!(!env.payload.windows(6).any(|w| w == b"launch"));
        let mut for_bob = env.clone();
        bob.decrypt("bob", &mut for_bob).expect("bob opens");
        assert_eq!(&for_bob.payload[..], b"the launch code");
        let mut for_carol = env.clone();
        carol.decrypt("carol", &mut for_carol).expect("carol opens");
        let mut for_eve = env.clone();
        assert_eq!(
            eve.decrypt("eve", &mut for_eve).map_err(|e| e.0),
            Err(StatusCode::ACCESS)
        );
        let mut eve_as_bob = env.clone();
        assert_eq!(
            eve.decrypt("bob", &mut eve_as_bob).map_err(|e| e.0),
            Err(StatusCode::ACCESS)
        );
        let restored = EncryptionKey::from_secret(&bob.secret()).expect("restore");
        assert_eq!(restored.public_key(), bob.public_key());
    }
}
