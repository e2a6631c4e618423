//! Encryption sessions (docs/PROTOCOL.md section 4.2): one HPKE setup per sender, recipient
//! and session instead of one per message.
//!
//! A sender seals a 32-byte session secret to the recipient's public key once (the 80-byte
//! session header), derives an AES-256-GCM key and a base nonce from it, and then wraps each
//! message's content key under that key with a sequence-numbered nonce, bound to the message's
//! sender and id. Every message carries the header, so a receiver that has not seen the session
//! (it restarted, or the message took another path) opens it from the message alone: sessions
//! belong to neither connection nor server, and a reconnect or a restart changes nothing. The
//! sender begins a new session after [`Rekey::messages`] messages or [`Rekey::age`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::hkdf::{HKDF_SHA256, KeyType, Salt};
use ring::rand::{SecureRandom, SystemRandom};

/// The scheme name carried in envelopes' `encryption.alg`.
pub const SESSION_ALG: &str = "hpke-x25519-session-aes256gcm";
/// HPKE's `info` when the session secret is sealed to the recipient.
pub(crate) const SESSION_INFO: &[u8] = b"chorus-e2e-session-v1";
/// HKDF's `info` when the session's key and base nonce are derived.
const KEYS_INFO: &[u8] = b"chorus-e2e-session-v1 keys";
/// The session header: HPKE's 32-byte encapsulated key, then the sealed secret (32 + 16).
pub(crate) const HEADER_LEN: usize = 80;
/// A recipient's `key` in this scheme: the header, the sequence number (8 bytes, big-endian),
/// the wrapped content key (32 + 16).
pub(crate) const KEY_LEN: usize = HEADER_LEN + 8 + 48;
/// Sessions a receiver keeps opened (a header seen again needs no HPKE open); past it, the
/// oldest half is forgotten and opened again when it comes back.
const OPENED_MAX: usize = 4096;

/// When a sender ends a session with a recipient and begins another: after this many messages
/// or this long, whichever comes first (and whenever the recipient's key changes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rekey {
    /// Messages sealed in one session.
    pub messages: u64,
    /// A session's age.
    pub age: Duration,
}

impl Default for Rekey {
    /// 100,000 messages or 10 minutes.
    fn default() -> Self {
        Rekey {
            messages: 100_000,
            age: Duration::from_secs(600),
        }
    }
}

/// A session's key and base nonce.
pub(crate) struct SessionKeys {
    key: LessSafeKey,
    nonce: [u8; 12],
}

impl std::fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKeys(..)")
    }
}

struct Len(usize);

impl KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// The 44 bytes of HKDF-SHA256 with the header as salt, the secret as input and
/// [`KEYS_INFO`]: the session's key (the first 32) and base nonce (the last 12).
pub(crate) fn key_material(secret: &[u8], header: &[u8]) -> [u8; 44] {
    let mut okm = [0u8; 44];
    Salt::new(HKDF_SHA256, header)
        .extract(secret)
        .expand(&[KEYS_INFO], Len(okm.len()))
        .and_then(|expanded| expanded.fill(&mut okm))
        .expect("44 bytes is within HKDF-SHA256's limit");
    okm
}

impl SessionKeys {
    /// The session's key and base nonce, from its secret and header ([`key_material`]).
    pub(crate) fn derive(secret: &[u8], header: &[u8]) -> SessionKeys {
        let okm = key_material(secret, header);
        let (key, nonce) = okm.split_at(32);
        SessionKeys {
            key: LessSafeKey::new(
                UnboundKey::new(&AES_256_GCM, key).expect("a 32-byte AES-256 key"),
            ),
            nonce: nonce.try_into().expect("12 bytes"),
        }
    }

    fn nonce(&self, seq: u64) -> Nonce {
        let mut n = self.nonce;
        for (b, s) in n[4..].iter_mut().zip(seq.to_be_bytes()) {
            *b ^= s;
        }
        Nonce::assume_unique_for_key(n)
    }

    /// The content key wrapped for message `seq` from `from` with id `id` (48 bytes).
    pub(crate) fn wrap(&self, seq: u64, from: &str, id: &str, content_key: &[u8; 32]) -> Vec<u8> {
        let mut out = content_key.to_vec();
        self.key
            .seal_in_place_append_tag(self.nonce(seq), Aad::from(aad(from, id)), &mut out)
            .expect("a 32-byte plaintext seals");
        out
    }

    /// The content key of message `seq`, or `None` when `wrapped` was not sealed for it.
    pub(crate) fn unwrap(
        &self,
        seq: u64,
        from: &str,
        id: &str,
        wrapped: &[u8],
    ) -> Option<[u8; 32]> {
        let mut buf = wrapped.to_vec();
        let plain = self
            .key
            .open_in_place(self.nonce(seq), Aad::from(aad(from, id)), &mut buf)
            .ok()?;
        plain.try_into().ok()
    }
}

/// What a wrapped content key is bound to: the sender's id, a zero byte, the message's id.
fn aad(from: &str, id: &str) -> Vec<u8> {
    let mut a = Vec::with_capacity(from.len() + 1 + id.len());
    a.extend_from_slice(from.as_bytes());
    a.push(0);
    a.extend_from_slice(id.as_bytes());
    a
}

/// Seals `plain` under a content key (AES-256-GCM, a nonce of 12 zero bytes: each content key
/// seals one payload): the ciphertext, then the 16-byte tag.
pub(crate) fn seal_payload(content_key: &[u8; 32], plain: &[u8]) -> Vec<u8> {
    let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, content_key).expect("32 bytes"));
    let mut out = Vec::with_capacity(plain.len() + 16);
    out.extend_from_slice(plain);
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key([0; 12]),
        Aad::empty(),
        &mut out,
    )
    .expect("a payload under 64 GiB seals");
    out
}

/// The plaintext of a payload sealed by [`seal_payload`], or `None`.
pub(crate) fn open_payload(content_key: &[u8; 32], sealed: &[u8]) -> Option<Vec<u8>> {
    let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, content_key).ok()?);
    let mut buf = sealed.to_vec();
    let len = key
        .open_in_place(
            Nonce::assume_unique_for_key([0; 12]),
            Aad::empty(),
            &mut buf,
        )
        .ok()?
        .len();
    buf.truncate(len);
    Some(buf)
}

/// 32 random bytes from the system.
pub(crate) fn random_key() -> Result<[u8; 32], String> {
    let mut k = [0u8; 32];
    SystemRandom::new()
        .fill(&mut k)
        .map_err(|_| "the system's random source failed".to_owned())?;
    Ok(k)
}

/// A sender's session with one recipient key.
struct Outgoing {
    header: [u8; HEADER_LEN],
    keys: Arc<SessionKeys>,
    next: u64,
    began: Instant,
}

/// What sealing the next message to a recipient takes: its session's header and keys, and
/// the message's number in the session.
pub(crate) type Next = ([u8; HEADER_LEN], Arc<SessionKeys>, u64);

/// A sender's sessions, one per recipient public key.
#[derive(Default)]
pub(crate) struct Sessions {
    rekey: Rekey,
    by_key: Mutex<HashMap<String, Outgoing>>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("rekey", &self.rekey)
            .finish_non_exhaustive()
    }
}

impl Sessions {
    pub(crate) fn new(rekey: Rekey) -> Sessions {
        Sessions {
            rekey,
            by_key: Mutex::new(HashMap::new()),
        }
    }

    /// The header, keys and sequence number of the next message to the recipient whose public
    /// key is `public` (base64): from its current session, or a new one when there is none or
    /// the current one is due for a new key. `open_new` seals a new session's secret to the
    /// key (HPKE); it runs under the lock, and only when a session begins (once per 100,000
    /// messages by default), so that concurrent senders to one recipient begin one session.
    pub(crate) fn next(
        &self,
        public: &str,
        open_new: impl FnOnce(&[u8; 32]) -> Result<[u8; HEADER_LEN], String>,
    ) -> Result<Next, String> {
        let mut map = self.by_key.lock().unwrap_or_else(PoisonError::into_inner);
        let due = map.get(public).is_none_or(|s| {
            s.next >= self.rekey.messages.max(1) || s.began.elapsed() >= self.rekey.age
        });
        if due {
            let secret = random_key()?;
            let header = open_new(&secret)?;
            let keys = Arc::new(SessionKeys::derive(&secret, &header));
            map.insert(
                public.to_owned(),
                Outgoing {
                    header,
                    keys,
                    next: 0,
                    began: Instant::now(),
                },
            );
        }
        let s = map.get_mut(public).expect("inserted above when absent");
        let seq = s.next;
        s.next += 1;
        Ok((s.header, Arc::clone(&s.keys), seq))
    }

    /// Sessions begun so far and live now (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_key
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// An opened session's keys, and when it was opened (a count of openings).
type OpenedAt = (Arc<SessionKeys>, u64);

/// A receiver's opened sessions, by header.
pub(crate) struct Opened {
    by_header: Mutex<HashMap<[u8; HEADER_LEN], OpenedAt>>,
    /// Counts insertions, so the oldest can be told apart.
    clock: std::sync::atomic::AtomicU64,
    /// Sessions kept at most.
    max: usize,
}

impl Default for Opened {
    fn default() -> Self {
        Opened::with_max(OPENED_MAX)
    }
}

impl Opened {
    fn with_max(max: usize) -> Opened {
        Opened {
            by_header: Mutex::new(HashMap::new()),
            clock: std::sync::atomic::AtomicU64::new(0),
            max: max.max(2),
        }
    }

    /// The keys of the session `header` begins, opened with `open` (HPKE) the first time it
    /// is seen; `None` when it does not open.
    pub(crate) fn keys(
        &self,
        header: &[u8; HEADER_LEN],
        open: impl FnOnce(&[u8]) -> Option<Vec<u8>>,
    ) -> Option<Arc<SessionKeys>> {
        if let Some((keys, _)) = self
            .by_header
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(header)
        {
            return Some(Arc::clone(keys));
        }
        let secret = open(header)?;
        if secret.len() != 32 {
            return None;
        }
        let keys = Arc::new(SessionKeys::derive(&secret, header));
        let tick = self
            .clock
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut map = self
            .by_header
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if map.len() >= self.max {
            // Forget the older half: a session still in use is opened again when next seen.
            let mut ticks: Vec<u64> = map.values().map(|(_, t)| *t).collect();
            ticks.sort_unstable();
            let cut = ticks[ticks.len() / 2];
            map.retain(|_, (_, t)| *t > cut);
        }
        map.insert(*header, (Arc::clone(&keys), tick));
        Some(keys)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_header
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receiver_keeps_a_bounded_number_of_sessions_and_opens_each_once() {
        let opened = Opened::with_max(8);
        let mut opens = 0;
        let header = |i: u8| [i; HEADER_LEN];
        for round in 0..2 {
            for i in 0..4 {
                opened
                    .keys(&header(i), |_| {
                        opens += 1;
                        Some(vec![i; 32])
                    })
                    .expect("opens");
            }
            assert_eq!(opens, 4, "round {round}: each of 4 sessions opened once");
        }
        for i in 4..40 {
            opened
                .keys(&header(i), |_| Some(vec![i; 32]))
                .expect("opens");
            assert!(opened.len() <= 8);
        }
        assert!(opened.len() >= 4);
        // The newest is still open; the first was forgotten and opens again.
        let mut again = 0;
        opened.keys(&header(39), |_| {
            again += 1;
            Some(vec![39; 32])
        });
        opened.keys(&header(0), |_| {
            again += 1;
            Some(vec![0; 32])
        });
        assert_eq!(again, 1);
        // A header that does not open, or opens to the wrong length, gives no keys.
        assert!(opened.keys(&header(200), |_| None).is_none());
        assert!(opened.keys(&header(201), |_| Some(vec![1; 31])).is_none());
    }

    #[test]
    fn the_nonce_is_the_base_nonce_with_the_number_in_its_last_eight_bytes() {
        let keys = SessionKeys::derive(&[7; 32], &[9; HEADER_LEN]);
        let okm = key_material(&[7; 32], &[9; HEADER_LEN]);
        let base: [u8; 12] = okm[32..].try_into().expect("12");
        let seq = 0x0102_0304_0506_0708_u64;
        let mut want = base;
        for (b, s) in want[4..].iter_mut().zip(seq.to_be_bytes()) {
            *b ^= s;
        }
        assert_eq!(keys.nonce(seq).as_ref(), &want);
        assert_eq!(keys.nonce(0).as_ref(), &base);
    }
}
