//! End-to-end payload encryption for named recipients (HPKE: X25519, HKDF-SHA256,
//! AES-256-GCM), in two schemes a receiver reads alike (docs/PROTOCOL.md section 4):
//!
//! - **Sessions** ([`SESSION_ALG`], what agents send): one HPKE setup per sender, recipient
//!   and session (`session`), then one AES-256-GCM seal per message and recipient.
//! - **One setup per message** ([`ENCRYPTION_ALG`], [`encrypt`]): the payload is sealed to a
//!   fresh X25519 key pair made for the message, whose private key is sealed to each
//!   recipient's public key.
//!
//! Only a recipient can open its copy of the message key and so the payload; the broker, the
//! coordinator and the dead-letter queue see the routing fields and ciphertext. The signature
//! (if any) covers the ciphertext.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use hpke::aead::AesGcm256;
use hpke::kdf::HkdfSha256;
use hpke::kem::X25519HkdfSha256;
use hpke::{Deserializable, Kem as _, OpModeR, OpModeS, Serializable};

use crate::protocol::envelope::{EncryptedKey, Encryption, Envelope};
use crate::protocol::status::StatusCode;
use crate::security::session::{
    self, HEADER_LEN, KEY_LEN, Opened, SESSION_INFO, Sessions, open_payload, seal_payload,
};
use crate::security::signing::KeyError;

pub(crate) use crate::security::session::Sessions as EncryptionSessions;
pub use crate::security::session::{Rekey, SESSION_ALG};

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
    /// The sessions opened with this key so far.
    opened: Opened,
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
        EncryptionKey {
            private,
            public,
            opened: Opened::default(),
        }
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
        Ok(EncryptionKey {
            private,
            public,
            opened: Opened::default(),
        })
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
        if enc.alg != ENCRYPTION_ALG && enc.alg != SESSION_ALG {
            return refuse(StatusCode::DATA_FORMAT, "unsupported encryption scheme");
        }
        let Some(mine) = enc.recipients.iter().find(|r| r.agent == me) else {
            return refuse(
                StatusCode::ACCESS,
                "this agent is not a recipient of the encrypted payload",
            );
        };
        let plain = if enc.alg == SESSION_ALG {
            self.open_in_session(&mine.key, env)?
        } else {
            let Some(message_key) = open(&mine.key, &self.private, INFO) else {
                return refuse(
                    StatusCode::ACCESS,
                    "the message key does not open with this agent's key",
                );
            };
            let Ok(message_sk) = <Kem as hpke::Kem>::PrivateKey::from_bytes(&message_key) else {
                return refuse(StatusCode::DATA_FORMAT, "malformed message key");
            };
            let Some(plain) = open(&env.payload, &message_sk, INFO) else {
                return refuse(StatusCode::DATA_FORMAT, "the payload does not decrypt");
            };
            plain
        };
        env.payload = Bytes::from(plain);
        env.content_type = enc.inner_content_type.into();
        Ok(())
    }

    /// The plaintext of `env`'s payload in the session scheme, `key` being this agent's entry.
    fn open_in_session(&self, key: &[u8], env: &Envelope) -> Result<Vec<u8>, (StatusCode, String)> {
        let refuse = |status, why: &str| Err((status, why.to_owned()));
        if key.len() != KEY_LEN {
            return refuse(
                StatusCode::DATA_FORMAT,
                "a session's recipient key is not 136 bytes",
            );
        }
        let (header, rest) = key.split_at(HEADER_LEN);
        let (seq, wrapped) = rest.split_at(8);
        let header: &[u8; HEADER_LEN] = header.try_into().expect("split at its length");
        let seq = u64::from_be_bytes(seq.try_into().expect("split at 8"));
        let Some(keys) = self
            .opened
            .keys(header, |h| open(h, &self.private, SESSION_INFO))
        else {
            return refuse(
                StatusCode::ACCESS,
                "the session does not open with this agent's key",
            );
        };
        let id = env.id.hyphenated().to_string();
        let Some(content_key) = keys.unwrap(seq, env.from.as_str(), &id, wrapped) else {
            return refuse(
                StatusCode::ACCESS,
                "the message key was not sealed for this message",
            );
        };
        match open_payload(&content_key, &env.payload) {
            Some(plain) => Ok(plain),
            None => refuse(StatusCode::DATA_FORMAT, "the payload does not decrypt"),
        }
    }
}

/// Opens `sealed` (a 32-byte encapsulated key, then the HPKE ciphertext) with `sk`.
fn open(sealed: &[u8], sk: &<Kem as hpke::Kem>::PrivateKey, info: &[u8]) -> Option<Vec<u8>> {
    if sealed.len() < ENC_LEN {
        return None;
    }
    let (encapped, ct) = sealed.split_at(ENC_LEN);
    let encapped = <Kem as hpke::Kem>::EncappedKey::from_bytes(encapped).ok()?;
    hpke::single_shot_open::<AesGcm256, HkdfSha256, Kem>(
        &OpModeR::Base,
        sk,
        &encapped,
        info,
        ct,
        b"",
    )
    .ok()
}

fn seal(
    pk: &<Kem as hpke::Kem>::PublicKey,
    plaintext: &[u8],
    info: &[u8],
) -> Result<Vec<u8>, String> {
    let (encapped, ct) = hpke::single_shot_seal::<AesGcm256, HkdfSha256, Kem>(
        &OpModeS::Base,
        pk,
        info,
        plaintext,
        b"",
    )
    .map_err(|e| e.to_string())?;
    let mut out = encapped.to_bytes().to_vec();
    out.extend_from_slice(&ct);
    Ok(out)
}

/// Encrypts `env`'s payload for `recipients` (agent id and base64 public key each), with one
/// HPKE setup per message and recipient ([`ENCRYPTION_ALG`]). Agents send in sessions
/// ([`SESSION_ALG`]), which cost one AES-GCM seal per message and recipient instead.
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
    let payload = seal(&message_pk, &env.payload, INFO)?;
    let mut wrapped = Vec::with_capacity(recipients.len());
    for (agent, public) in recipients {
        let pk = public_key(agent, public)?;
        wrapped.push(EncryptedKey {
            agent: agent.clone(),
            key: Bytes::from(seal(&pk, &message_sk.to_bytes(), INFO)?),
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

/// A public key (base64) as HPKE takes it.
fn public_key(agent: &str, public: &str) -> Result<<Kem as hpke::Kem>::PublicKey, String> {
    let bytes = STANDARD
        .decode(public)
        .map_err(|e| format!("{agent}'s key: {e}"))?;
    <Kem as hpke::Kem>::PublicKey::from_bytes(&bytes).map_err(|e| format!("{agent}'s key: {e}"))
}

/// Encrypts `env`'s payload for `recipients` (agent id and base64 public key each) in the
/// session scheme ([`SESSION_ALG`]), each recipient's session taken from `sessions`.
pub(crate) fn encrypt_in_sessions(
    env: &mut Envelope,
    recipients: &[(String, String)],
    sessions: &Sessions,
) -> Result<(), EncryptionError> {
    if recipients.is_empty() {
        return Err(EncryptionError("no recipients to encrypt for".into()));
    }
    let content_key = session::random_key().map_err(EncryptionError)?;
    let id = env.id.hyphenated().to_string();
    let mut wrapped = Vec::with_capacity(recipients.len());
    for (agent, public) in recipients {
        let (header, keys, seq) = sessions
            .next(public, |secret| {
                let sealed = seal(&public_key(agent, public)?, secret, SESSION_INFO)?;
                sealed
                    .try_into()
                    .map_err(|_| "a session header is 80 bytes".to_owned())
            })
            .map_err(EncryptionError)?;
        let mut key = Vec::with_capacity(KEY_LEN);
        key.extend_from_slice(&header);
        key.extend_from_slice(&seq.to_be_bytes());
        key.extend_from_slice(&keys.wrap(seq, env.from.as_str(), &id, &content_key));
        wrapped.push(EncryptedKey {
            agent: agent.clone(),
            key: Bytes::from(key),
        });
    }
    env.encryption = Some(Encryption {
        alg: SESSION_ALG.to_owned(),
        inner_content_type: String::from(std::mem::replace(
            &mut env.content_type,
            CONTENT_TYPE_ENCRYPTED.into(),
        )),
        recipients: wrapped,
    });
    env.payload = Bytes::from(seal_payload(&content_key, &env.payload));
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

    /// `n` messages from alice to bob (and carol, when given) through `sessions`.
    fn sealed(sessions: &Sessions, to: &[(&str, &EncryptionKey)], n: usize) -> Vec<Envelope> {
        (0..n)
            .map(|i| {
                let mut env = Envelope::new(Kind::Command, Performative::Request, "alice");
                env.payload = Bytes::from(format!("order {i}"));
                let recipients: Vec<(String, String)> = to
                    .iter()
                    .map(|(agent, key)| ((*agent).to_owned(), key.public_key()))
                    .collect();
                encrypt_in_sessions(&mut env, &recipients, sessions).expect("encrypts");
                env
            })
            .collect()
    }

    fn header_and_seq(env: &Envelope, agent: &str) -> (Vec<u8>, u64) {
        let enc = env.encryption.as_ref().expect("encrypted");
        let key = &enc
            .recipients
            .iter()
            .find(|r| r.agent == agent)
            .expect("a recipient")
            .key;
        assert_eq!(key.len(), KEY_LEN);
        (
            key[..HEADER_LEN].to_vec(),
            u64::from_be_bytes(key[HEADER_LEN..HEADER_LEN + 8].try_into().expect("8")),
        )
    }

    #[test]
    fn a_session_seals_each_message_with_the_next_number_and_one_header() {
        let bob = EncryptionKey::generate();
        let carol = EncryptionKey::generate();
        let sessions = Sessions::new(Rekey::default());
        let envs = sealed(&sessions, &[("bob", &bob), ("carol", &carol)], 5);
        assert_eq!(sessions.len(), 2, "one session per recipient key");
        let first = header_and_seq(&envs[0], "bob").0;
        for (i, env) in envs.iter().enumerate() {
            assert_eq!(env.encryption.as_ref().expect("enc").alg, SESSION_ALG);
            assert!(!env.payload.windows(5).any(|w| w == b"order"));
            assert_eq!(header_and_seq(env, "bob"), (first.clone(), i as u64));
            let mut for_bob = env.clone();
            bob.decrypt("bob", &mut for_bob).expect("bob opens");
            assert_eq!(for_bob.payload, format!("order {i}").as_bytes());
            let mut for_carol = env.clone();
            carol.decrypt("carol", &mut for_carol).expect("carol opens");
        }
        assert_eq!(
            bob.opened.len(),
            1,
            "the session was opened once for five messages"
        );
        // Not a recipient, or the wrong key.
        let eve = EncryptionKey::generate();
        let mut for_eve = envs[0].clone();
        assert_eq!(
            eve.decrypt("bob", &mut for_eve).map_err(|e| e.0),
            Err(StatusCode::ACCESS)
        );
        let mut for_eve = envs[0].clone();
        assert_eq!(
            eve.decrypt("eve", &mut for_eve).map_err(|e| e.0),
            Err(StatusCode::ACCESS)
        );
    }

    #[test]
    fn a_wrapped_key_opens_only_its_own_message_and_a_changed_payload_is_refused() {
        let bob = EncryptionKey::generate();
        let sessions = Sessions::new(Rekey::default());
        let envs = sealed(&sessions, &[("bob", &bob)], 2);
        // The second message's key pasted onto the first (another id and number): refused.
        let mut moved = envs[0].clone();
        moved.encryption = envs[1].encryption.clone();
        assert_eq!(
            bob.decrypt("bob", &mut moved).map_err(|e| e.0),
            Err(StatusCode::ACCESS)
        );
        // Another id with the same key: refused.
        let mut renamed = envs[0].clone();
        renamed.id = uuid::Uuid::now_v7();
        assert_eq!(
            bob.decrypt("bob", &mut renamed).map_err(|e| e.0),
            Err(StatusCode::ACCESS)
        );
        // Another sender: refused.
        let mut other = envs[0].clone();
        other.from = "mallory".into();
        assert_eq!(
            bob.decrypt("bob", &mut other).map_err(|e| e.0),
            Err(StatusCode::ACCESS)
        );
        // A payload changed in transit: refused.
        let mut changed = envs[0].clone();
        let mut bytes = changed.payload.to_vec();
        bytes[0] ^= 1;
        changed.payload = Bytes::from(bytes);
        assert_eq!(
            bob.decrypt("bob", &mut changed).map_err(|e| e.0),
            Err(StatusCode::DATA_FORMAT)
        );
        // A key of the wrong length: refused, no panic.
        let mut short = envs[0].clone();
        if let Some(enc) = short.encryption.as_mut() {
            enc.recipients[0].key = Bytes::from_static(&[1, 2, 3]);
        }
        assert_eq!(
            bob.decrypt("bob", &mut short).map_err(|e| e.0),
            Err(StatusCode::DATA_FORMAT)
        );
    }

    #[test]
    fn a_session_ends_after_its_count_or_age_and_a_restarted_receiver_opens_the_next_message() {
        let bob = EncryptionKey::generate();
        let sessions = Sessions::new(Rekey {
            messages: 3,
            age: std::time::Duration::from_secs(600),
        });
        let envs = sealed(&sessions, &[("bob", &bob)], 7);
        let seqs: Vec<u64> = envs.iter().map(|e| header_and_seq(e, "bob").1).collect();
        assert_eq!(seqs, [0, 1, 2, 0, 1, 2, 0]);
        let headers: std::collections::HashSet<Vec<u8>> =
            envs.iter().map(|e| header_and_seq(e, "bob").0).collect();
        assert_eq!(headers.len(), 3, "a new session every 3 messages");
        // A receiver restarted mid-session (its opened sessions lost) opens from the message.
        let restarted = EncryptionKey::from_secret(&bob.secret()).expect("restore");
        let mut middle = envs[4].clone();
        restarted
            .decrypt("bob", &mut middle)
            .expect("opens mid-session");
        assert_eq!(middle.payload, &b"order 4"[..]);

        let by_age = Sessions::new(Rekey {
            messages: 1_000,
            age: std::time::Duration::ZERO,
        });
        let envs = sealed(&by_age, &[("bob", &bob)], 3);
        let seqs: Vec<u64> = envs.iter().map(|e| header_and_seq(e, "bob").1).collect();
        assert_eq!(seqs, [0, 0, 0], "an age of zero is a session per message");
    }

    /// tests/vectors/crypto/session.json, read and written byte for byte (the Python SDK reads
    /// the same file).
    #[test]
    fn the_session_vectors_are_read_and_written_byte_for_byte() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/vectors/crypto/session.json");
        let text = std::fs::read_to_string(&path).expect("the session vectors");
        let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let hex =
            |x: &serde_json::Value| hex::decode(x.as_str().expect("a hex string")).expect("hex");
        let s = |x: &serde_json::Value| x.as_str().expect("a string").to_owned();
        assert_eq!(v["alg"], SESSION_ALG);
        let bob = EncryptionKey::from_secret(v["recipient"]["secret"].as_str().expect("secret"))
            .expect("the recipient's key");
        assert_eq!(bob.public_key(), s(&v["recipient"]["public"]));
        let agent = s(&v["recipient"]["agent"]);
        let header = hex(&v["session"]["header"]);
        let secret = hex(&v["session"]["secret"]);
        // Reading: the header opens to the secret, which derives the key and nonce.
        assert_eq!(
            open(&header, &bob.private, SESSION_INFO).expect("opens"),
            secret
        );
        let okm = super::session::key_material(&secret, &header);
        assert_eq!(okm[..32], hex(&v["session"]["key"])[..]);
        assert_eq!(okm[32..], hex(&v["session"]["nonce"])[..]);
        let keys = super::session::SessionKeys::derive(&secret, &header);
        let envelope = |from: &str, id: &str, key: Vec<u8>, payload: Vec<u8>, inner: &str| {
            let mut env = Envelope::new(Kind::Command, Performative::Request, from);
            env.id = id.parse().expect("a uuid");
            env.payload = Bytes::from(payload);
            env.content_type = CONTENT_TYPE_ENCRYPTED.into();
            env.encryption = Some(Encryption {
                alg: SESSION_ALG.to_owned(),
                inner_content_type: inner.to_owned(),
                recipients: vec![EncryptedKey {
                    agent: agent.clone(),
                    key: Bytes::from(key),
                }],
            });
            env
        };
        let messages = v["messages"].as_array().expect("messages");
        assert!(messages.len() >= 3);
        for m in messages {
            let (from, id) = (s(&m["from"]), s(&m["id"]));
            let seq = m["seq"].as_u64().expect("seq");
            let content_key: [u8; 32] = hex(&m["content_key"]).try_into().expect("32 bytes");
            let plain = hex(&m["plaintext"]);
            // Writing: the same bytes.
            let mut key = header.clone();
            key.extend_from_slice(&seq.to_be_bytes());
            key.extend_from_slice(&keys.wrap(seq, &from, &id, &content_key));
            assert_eq!(key, hex(&m["key"]), "key of message {seq}");
            assert_eq!(
                super::session::seal_payload(&content_key, &plain),
                hex(&m["payload"]),
                "payload of message {seq}"
            );
            // Reading: the envelope opens to the plaintext.
            let inner = s(&m["inner_content_type"]);
            let mut env = envelope(&from, &id, hex(&m["key"]), hex(&m["payload"]), &inner);
            bob.decrypt(&agent, &mut env).expect("opens");
            assert_eq!(env.payload, plain);
            assert_eq!(env.content_type.as_str(), inner);
        }
        let refused = v["refused"].as_array().expect("refused");
        assert!(refused.len() >= 5);
        for r in refused {
            let mut env = envelope(
                &s(&r["from"]),
                &s(&r["id"]),
                hex(&r["key"]),
                hex(&r["payload"]),
                "text/plain",
            );
            let status = bob
                .decrypt(&agent, &mut env)
                .expect_err(r["why"].as_str().expect("why"))
                .0;
            assert_eq!(
                u64::from(status.0),
                r["status"].as_u64().expect("status"),
                "{}",
                r["why"]
            );
        }
    }
}
