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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use uuid::Uuid;

use crate::protocol::envelope::Envelope;
use crate::protocol::status::StatusCode;

pub use super::identity::{Identity, KeyError, SIGNATURE_ALG, canonical_bytes};

/// How far a signed message's timestamp may be from the receiver's clock by default.
pub const DEFAULT_SIGNATURE_TOLERANCE: Duration = Duration::from_secs(120);

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
            tolerance: DEFAULT_SIGNATURE_TOLERANCE,
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
    keys: Mutex<HashMap<String, Arc<TrustedKey>>>,
    seen: Mutex<SeenIds>,
    /// The ids whose keys were pinned ([`Verifier::pin`]): their replays of dead letters are
    /// accepted, and the registry does not change their keys.
    replayers: Mutex<std::collections::HashSet<String>>,
}

/// A registered public key: as written (`U...`) and parsed.
#[derive(Debug)]
struct TrustedKey {
    encoded: String,
    key: ed25519_dalek::VerifyingKey,
}

#[derive(Debug, Default)]
struct SeenIds {
    /// Each id seen: until when it is remembered, and the stored copy it came from (a stream
    /// sequence), if it came from one.
    expiry: HashMap<Uuid, (u64, Option<u64>)>,
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

    /// Registers (or replaces) `agent`'s public key; a pinned one ([`Verifier::pin`]) stays.
    pub fn trust(&self, agent: &str, public_key: &str) {
        if self.is_pinned(agent) {
            return;
        }
        let parsed = nkeys::from_public_key(public_key)
            .ok()
            .and_then(|(_, raw)| ed25519_dalek::VerifyingKey::from_bytes(&raw).ok());
        let Some(key) = parsed else {
            tracing::warn!(agent, "ignoring an unusable public key");
            return;
        };
        if let Ok(mut keys) = self.keys.lock() {
            keys.insert(
                agent.to_owned(),
                Arc::new(TrustedKey {
                    encoded: public_key.to_owned(),
                    key,
                }),
            );
        }
    }

    /// Trusts `agent`'s `public_key` for good, as given in the agent's options
    /// (`AgentOptions::trust`): the registry neither replaces nor removes it, and `agent` may
    /// replay dead letters here ([`Verifier::verify_replay`]). The bus's own keys
    /// (coordinator, operators) are given so; keys learned from the registry never are.
    pub fn pin(&self, agent: &str, public_key: &str) {
        if let Ok(mut pinned) = self.replayers.lock() {
            pinned.remove(agent);
        }
        self.trust(agent, public_key);
        if let Ok(mut pinned) = self.replayers.lock() {
            pinned.insert(agent.to_owned());
        }
    }

    fn is_pinned(&self, agent: &str) -> bool {
        self.replayers
            .lock()
            .is_ok_and(|pinned| pinned.contains(agent))
    }

    /// Checks a replay of a dead letter ([`super::replay`]): `env`, received on `subject`
    /// from the stored copy `stored`, with the replayer's `proof`. Returns the id the replay is
    /// remembered by ([`super::replay::replay_id`]).
    ///
    /// # Errors
    /// 5004 a replayer not trusted for replays, another key or a signature (the replay's or
    /// the original's) that does not verify; 5014 an unsigned original where signatures are
    /// required; 5015 a replay time past the tolerance, or this replay seen already.
    pub fn verify_replay(
        &self,
        subject: &str,
        env: &Envelope,
        stored: Option<u64>,
        proof: &super::replay::ReplayProof,
        now_ms: u64,
    ) -> Result<Uuid, Refused> {
        let tolerance = u64::try_from(self.policy.tolerance.as_millis()).unwrap_or(u64::MAX);
        let identity = |why: String| (StatusCode::IDENTITY, why);
        let replayer_trusted = self.is_pinned(&proof.by);
        let Some(replayer) = self.trusted_key_of(&proof.by).filter(|_| replayer_trusted) else {
            return Err(identity(format!(
                "replays are accepted only from senders trusted here, not {:?}",
                proof.by
            )));
        };
        if replayer.encoded != proof.key {
            return Err(identity(format!(
                "the replay is signed with a key that is not {:?}'s",
                proof.by
            )));
        }
        if proof.at_ms.abs_diff(now_ms) > tolerance {
            return Err((
                StatusCode::REPLAY,
                format!(
                    "the replay's time is {} ms from this receiver's clock, beyond the tolerance of {tolerance} ms",
                    proof.at_ms.abs_diff(now_ms)
                ),
            ));
        }
        let bytes = super::replay::replay_bytes(subject, env.id, &proof.of, proof.at_ms, &proof.by);
        let verified = ed25519_dalek::Signature::from_slice(&proof.signature)
            .is_ok_and(|sig| replayer.key.verify_strict(&bytes, &sig).is_ok());
        if !verified {
            return Err(identity("the replay signature does not verify".into()));
        }
        // The original as its sender signed it, however old.
        if let Some((signature, key)) = self.precheck(env, env.timestamp_ms, tolerance)?
            && key
                .key
                .verify_strict(&canonical_bytes(subject, env), &signature)
                .is_err()
        {
            return Err(identity("the signature does not verify".into()));
        }
        let id = super::replay::replay_id(env.id, &proof.of);
        let Ok(mut seen) = self.seen.lock() else {
            return Err((StatusCode::INTERNAL, "replay cache unavailable".to_owned()));
        };
        match seen.expiry.get(&id) {
            Some((_, Some(copy))) if stored == Some(*copy) => {}
            Some(_) => {
                return Err((
                    StatusCode::REPLAY,
                    format!("dead letter {} was replayed here already", proof.of),
                ));
            }
            None => {
                let until = proof.at_ms.saturating_add(tolerance).saturating_add(1);
                seen.expiry.insert(id, (until, stored));
            }
        }
        Ok(id)
    }

    /// Forgets `agent`'s key, unless it is pinned.
    pub fn forget(&self, agent: &str) {
        if self.is_pinned(agent) {
            return;
        }
        if let Ok(mut keys) = self.keys.lock() {
            keys.remove(agent);
        }
    }

    /// The key registered for `agent`.
    pub fn key_of(&self, agent: &str) -> Option<String> {
        self.keys.lock().ok()?.get(agent).map(|k| k.encoded.clone())
    }

    fn trusted_key_of(&self, agent: &str) -> Option<Arc<TrustedKey>> {
        self.keys.lock().ok()?.get(agent).cloned()
    }

    /// Checks `env`, received on `subject`, at `now_ms`.
    ///
    /// # Errors
    /// The refusal's code and reason: 5014 unsigned (when signatures are required) or another
    /// algorithm; 5004 no key, another key or a bad signature; 5015 a replay or a timestamp past
    /// the tolerance.
    pub fn verify(&self, subject: &str, env: &Envelope, now_ms: u64) -> Result<(), Refused> {
        self.verify_delivery(subject, env, None, now_ms)
    }

    /// As [`Verifier::verify`], for a message delivered from a stored copy: `stored` is that
    /// copy's stream sequence. The same copy delivered again (a redelivery after a failure,
    /// a crash or a lost ack) is not a replay; the same id from anywhere else is.
    ///
    /// # Errors
    /// As [`Verifier::verify`].
    pub fn verify_delivery(
        &self,
        subject: &str,
        env: &Envelope,
        stored: Option<u64>,
        now_ms: u64,
    ) -> Result<(), Refused> {
        self.verify_deliveries(&[(subject, env, stored)], now_ms)
            .pop()
            .unwrap_or(Ok(()))
    }

    /// Checks several envelopes at once, each received on its subject, at `now_ms`; one
    /// result per envelope, in order. The same checks as [`Verifier::verify`], but the
    /// signatures are verified together (ed25519 batch verification, about half the work per
    /// signature from eight on); when a batch fails, each is verified alone, so one bad
    /// signature does not cost the good ones. Ids repeated within the batch are replays too.
    pub fn verify_batch(
        &self,
        items: &[(&str, &Envelope)],
        now_ms: u64,
    ) -> Vec<Result<(), Refused>> {
        let items: Vec<_> = items.iter().map(|(s, e)| (*s, *e, None)).collect();
        self.verify_deliveries(&items, now_ms)
    }

    /// As [`Verifier::verify_batch`], each item with the stream sequence of the stored copy it
    /// was delivered from, if any ([`Verifier::verify_delivery`]).
    pub fn verify_deliveries(
        &self,
        items: &[(&str, &Envelope, Option<u64>)],
        now_ms: u64,
    ) -> Vec<Result<(), Refused>> {
        let tolerance = u64::try_from(self.policy.tolerance.as_millis()).unwrap_or(u64::MAX);
        let mut results: Vec<Result<(), Refused>> = Vec::with_capacity(items.len());
        // (index, signed bytes, signature, key) of each envelope that passed the cheap checks.
        let mut pending = Vec::new();
        for (i, (subject, env, _)) in items.iter().enumerate() {
            match self.precheck(env, now_ms, tolerance) {
                Ok(Some((signature, key))) => {
                    pending.push((i, canonical_bytes(subject, env), signature, key));
                    results.push(Ok(()));
                }
                Ok(None) => results.push(Ok(())),
                Err(refused) => results.push(Err(refused)),
            }
        }
        let all_good = pending.len() > 1 && {
            let messages: Vec<&[u8]> = pending.iter().map(|p| p.1.as_slice()).collect();
            let signatures: Vec<_> = pending.iter().map(|p| p.2).collect();
            let keys: Vec<_> = pending.iter().map(|p| p.3.key).collect();
            ed25519_dalek::verify_batch(&messages, &signatures, &keys).is_ok()
        };
        let Ok(mut seen) = self.seen.lock() else {
            return items
                .iter()
                .map(|_| Err((StatusCode::INTERNAL, "replay cache unavailable".to_owned())))
                .collect();
        };
        if now_ms >= seen.next_prune_ms {
            seen.expiry.retain(|_, (until, _)| *until > now_ms);
            seen.next_prune_ms = now_ms + tolerance.max(1_000);
        }
        for (i, bytes, signature, key) in &pending {
            if !all_good && key.key.verify_strict(bytes, signature).is_err() {
                results[*i] = Err((StatusCode::IDENTITY, "the signature does not verify".into()));
                continue;
            }
            let (_, env, stored) = items[*i];
            // An id is remembered as long as its timestamp could still pass the tolerance check.
            let until = env.timestamp_ms.saturating_add(tolerance).saturating_add(1);
            match seen.expiry.get(&env.id) {
                // The same stored copy delivered again: a redelivery, not a replay.
                Some((_, Some(copy))) if stored == Some(*copy) => {}
                Some(_) => {
                    results[*i] =
                        Err((StatusCode::REPLAY, "this message id was seen before".into()));
                }
                None => {
                    seen.expiry.insert(env.id, (until, stored));
                }
            }
        }
        results
    }

    /// Everything but the signature arithmetic and the replay cache: `Ok(None)` for an unsigned
    /// envelope this policy lets through, else the signature and the key to check it with.
    fn precheck(
        &self,
        env: &Envelope,
        now_ms: u64,
        tolerance: u64,
    ) -> Result<Option<(ed25519_dalek::Signature, Arc<TrustedKey>)>, Refused> {
        let Some(sig) = &env.signature else {
            return if self.policy.require_signed {
                Err((
                    StatusCode::UNAUTHORIZED,
                    "unsigned messages are refused here".into(),
                ))
            } else {
                Ok(None)
            };
        };
        if sig.alg != SIGNATURE_ALG {
            return Err((
                StatusCode::UNAUTHORIZED,
                format!("unsupported signature algorithm {:?}", sig.alg),
            ));
        }
        let Some(trusted) = self.trusted_key_of(&env.from) else {
            return Err((
                StatusCode::IDENTITY,
                format!("no key is registered for {:?}", env.from),
            ));
        };
        if trusted.encoded != sig.key {
            return Err((
                StatusCode::IDENTITY,
                format!("signed with a key that is not {:?}'s", env.from),
            ));
        }
        let Ok(signature) = ed25519_dalek::Signature::from_slice(&sig.value) else {
            return Err((StatusCode::IDENTITY, "the signature does not verify".into()));
        };
        if env.timestamp_ms.abs_diff(now_ms) > tolerance {
            return Err((
                StatusCode::REPLAY,
                format!(
                    "timestamp is {} ms from this receiver's clock, beyond the tolerance of {tolerance} ms",
                    env.timestamp_ms.abs_diff(now_ms)
                ),
            ));
        }
        Ok(Some((signature, trusted)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::envelope::{Kind, Performative};
    use bytes::Bytes;

    #[test]
    fn a_replay_counts_only_from_a_pinned_key_and_only_once_per_dead_letter() {
        use super::super::replay::ReplayProof;
        let (alice, ops, eve) = (
            Identity::generate(),
            Identity::generate(),
            Identity::generate(),
        );
        let verifier = Verifier::new(SignaturePolicy {
            require_signed: true,
            ..Default::default()
        });
        verifier.trust("alice", &alice.public_key());
        verifier.pin("ops", &ops.public_key());
        // Learned from the registry: may send, may not replay; nor replace a pinned key.
        verifier.trust("eve", &eve.public_key());
        verifier.trust("ops", &eve.public_key());
        assert_eq!(verifier.key_of("ops"), Some(ops.public_key()));
        verifier.forget("ops");
        assert_eq!(verifier.key_of("ops"), Some(ops.public_key()));

        let subject = "chorus.agent.bob.pay";
        let mut env = Envelope::new(Kind::Request, Performative::Request, "alice");
        env.timestamp_ms = 1_000;
        alice.sign(subject, &mut env);
        let now = 10_000_000;
        // Old and seen: the plain check refuses it.
        assert_eq!(
            verifier.verify(subject, &env, now).map_err(|e| e.0),
            Err(StatusCode::REPLAY)
        );
        let code = |proof: &ReplayProof, stored| {
            verifier
                .verify_replay(subject, &env, stored, proof, now)
                .map(|_| ())
                .map_err(|e| e.0)
        };
        let by_eve = ReplayProof::sign(&eve, "eve", subject, env.id, "DLQ:1", now);
        assert_eq!(code(&by_eve, Some(5)), Err(StatusCode::IDENTITY));
        let posing = ReplayProof::sign(&eve, "ops", subject, env.id, "DLQ:1", now);
        assert_eq!(code(&posing, Some(5)), Err(StatusCode::IDENTITY));
        let stale = ReplayProof::sign(&ops, "ops", subject, env.id, "DLQ:1", 1_000);
        assert_eq!(code(&stale, Some(5)), Err(StatusCode::REPLAY));
        let mut tampered = env.clone();
        tampered.payload = Bytes::from_static(b"pay 1000");
        let good = ReplayProof::sign(&ops, "ops", subject, env.id, "DLQ:1", now);
        assert_eq!(
            verifier
                .verify_replay(subject, &tampered, Some(5), &good, now)
                .map_err(|e| e.0),
            Err(StatusCode::IDENTITY)
        );
        assert_eq!(code(&good, Some(5)), Ok(()));
        // The same stored copy again: a redelivery; another copy of it: a replay.
        assert_eq!(code(&good, Some(5)), Ok(()));
        assert_eq!(code(&good, Some(6)), Err(StatusCode::REPLAY));
        // Another dead letter of the same message is another replay.
        let later = ReplayProof::sign(&ops, "ops", subject, env.id, "DLQ:2", now);
        assert_eq!(code(&later, Some(7)), Ok(()));
    }

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

    #[test]
    fn a_redelivery_of_the_same_stored_copy_is_not_a_replay_but_another_copy_is() {
        let alice = Identity::generate();
        let verifier = Verifier::new(SignaturePolicy::default());
        verifier.trust("alice", &alice.public_key());
        let subject = "chorus.inbox.bob.pay";
        let mut env = Envelope::new(Kind::Command, Performative::Request, "alice");
        alice.sign(subject, &mut env);
        let now = env.timestamp_ms;
        assert_eq!(
            verifier.verify_delivery(subject, &env, Some(7), now),
            Ok(())
        );
        // The server delivers stored message 7 again: twice more.
        assert_eq!(
            verifier.verify_delivery(subject, &env, Some(7), now),
            Ok(())
        );
        assert_eq!(
            verifier.verify_delivery(subject, &env, Some(7), now),
            Ok(())
        );
        // The same bytes stored again (sequence 8), or sent on a core subject: a replay.
        for stored in [Some(8), None] {
            assert_eq!(
                verifier
                    .verify_delivery(subject, &env, stored, now)
                    .map_err(|e| e.0),
                Err(StatusCode::REPLAY),
                "{stored:?}"
            );
        }
        // A core message's id seen again is a replay, whatever comes later.
        let mut core = Envelope::new(Kind::Request, Performative::Request, "alice");
        alice.sign(subject, &mut core);
        assert_eq!(verifier.verify(subject, &core, now), Ok(()));
        assert_eq!(
            verifier
                .verify_delivery(subject, &core, Some(9), now)
                .map_err(|e| e.0),
            Err(StatusCode::REPLAY)
        );
    }

    #[test]
    fn a_batch_refuses_exactly_its_bad_members_and_replays_within_it() {
        let alice = Identity::generate();
        let verifier = Verifier::new(SignaturePolicy {
            require_signed: true,
            ..Default::default()
        });
        verifier.trust("alice", &alice.public_key());
        let subject = "chorus.evt.t";
        let mut envs: Vec<Envelope> = (0..10)
            .map(|i| {
                let mut env = Envelope::new(Kind::Event, Performative::Inform, "alice");
                env.payload = Bytes::from(vec![i; 16]);
                alice.sign(subject, &mut env);
                env
            })
            .collect();
        envs[3].payload = Bytes::from_static(b"tampered");
        envs[7].signature = None;
        let replayed = envs[1].clone();
        envs.push(replayed);
        let now = envs[0].timestamp_ms;
        let items: Vec<_> = envs.iter().map(|e| (subject, e)).collect();
        let codes: Vec<Option<StatusCode>> = verifier
            .verify_batch(&items, now)
            .into_iter()
            .map(|r| r.err().map(|e| e.0))
            .collect();
        let mut expected = vec![None; 11];
        expected[3] = Some(StatusCode::IDENTITY);
        expected[7] = Some(StatusCode::UNAUTHORIZED);
        expected[10] = Some(StatusCode::REPLAY);
        assert_eq!(codes, expected);
        // The good ones are remembered: sending any of them again is a replay.
        assert_eq!(
            verifier.verify(subject, &envs[0], now).map_err(|e| e.0),
            Err(StatusCode::REPLAY)
        );
        // A tampered one was not remembered: its untampered original still verifies.
        envs[3].payload = Bytes::from(vec![3; 16]);
        assert_eq!(verifier.verify(subject, &envs[3], now), Ok(()));
    }

    #[test]
    fn an_identity_survives_its_seed() {
        let id = Identity::generate();
        let seed = id.seed().expect("a seed");
        assert!(seed.starts_with("SU"), "{seed}");
        let again = Identity::from_seed(&seed).expect("the seed loads");
        assert_eq!(again.public_key(), id.public_key());
        let mut a = Envelope::new(Kind::Event, Performative::Inform, "a");
        let mut b = a.clone();
        id.sign("s", &mut a);
        again.sign("s", &mut b);
        assert_eq!(a.signature, b.signature);
    }
}
