//! Decryption: a payload sealed for named recipients is opened with this agent's key (after the
//! signature check, which covers the ciphertext). An agent that is not a recipient, or has no
//! key, refuses it with 5007; a payload that does not open is 5006.

use std::sync::Arc;

use super::{Inbound, Layer};
use crate::inbound::outcome::Failure;
use crate::protocol::status::StatusCode;
use crate::security::encryption::EncryptionKey;

pub(crate) struct Decrypt {
    pub(crate) agent: String,
    pub(crate) key: Option<Arc<EncryptionKey>>,
}

impl Layer for Decrypt {
    fn check(&self, msg: &mut Inbound<'_>) -> Result<(), Failure> {
        if msg.env.encryption.is_none() {
            return Ok(());
        }
        let Some(key) = &self.key else {
            return Err(Failure::refused(
                StatusCode::ACCESS,
                "this agent has no decryption key",
            ));
        };
        key.decrypt(&self.agent, &mut msg.env)
            .map_err(|(status, reason)| Failure::refused(status, reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::envelope::{Envelope, Kind, Performative};
    use crate::security::encryption::encrypt;

    fn sealed_for(agent: &str, key: &EncryptionKey) -> Envelope {
        let mut env = Envelope::new(Kind::Request, Performative::Request, "alice");
        env.content_type = "application/json".into();
        env.payload = bytes::Bytes::from_static(b"\"secret\"");
        encrypt(&mut env, &[(agent.to_owned(), key.public_key())]).expect("encrypts");
        env
    }

    fn check(layer: &Decrypt, env: Envelope) -> Result<Envelope, Failure> {
        let mut msg = Inbound::new("chorus.agent.vault.open", env, None);
        layer.check(&mut msg).map(|()| msg.env)
    }

    #[test]
    fn the_recipient_reads_the_plaintext() {
        let key = Arc::new(EncryptionKey::generate());
        let layer = Decrypt {
            agent: "vault".into(),
            key: Some(Arc::clone(&key)),
        };
        let env = check(&layer, sealed_for("vault", &key)).expect("opens");
        assert_eq!(&env.payload[..], b"\"secret\"");
        assert_eq!(env.content_type, "application/json");
    }

    #[test]
    fn a_non_recipient_or_an_agent_without_a_key_is_5007() {
        let key = EncryptionKey::generate();
        let other = Decrypt {
            agent: "eve".into(),
            key: Some(Arc::new(EncryptionKey::generate())),
        };
        let failure = check(&other, sealed_for("vault", &key)).expect_err("not a recipient");
        assert_eq!(failure.status, StatusCode::ACCESS);
        let keyless = Decrypt {
            agent: "vault".into(),
            key: None,
        };
        let failure = check(&keyless, sealed_for("vault", &key)).expect_err("no key");
        assert_eq!(failure.status, StatusCode::ACCESS);
    }

    #[test]
    fn a_damaged_ciphertext_is_5006() {
        let key = Arc::new(EncryptionKey::generate());
        let mut env = sealed_for("vault", &key);
        env.payload = bytes::Bytes::from_static(b"0123456789012345678901234567890123456789");
        let layer = Decrypt {
            agent: "vault".into(),
            key: Some(key),
        };
        assert_eq!(
            check(&layer, env).expect_err("damaged").status,
            StatusCode::DATA_FORMAT
        );
    }
}
