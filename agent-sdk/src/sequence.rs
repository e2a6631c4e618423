//! Loss that is never silent: each publisher numbers its events per subject
//! ([`Sequence`]), and each subscription checks the numbers as messages arrive, before
//! anything is queued, so an event missed on the way (a reset connection, the server cutting
//! a slow consumer, a restart, the client's full buffer) is counted in
//! [`AgentStats::lost`](crate::AgentStats::lost); the subscription's own full queue counts its
//! drops there too. NATS itself does not offer this for core subjects.

use std::collections::HashMap;
use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use std::sync::{Arc, Mutex};

use crate::protocol::codec::Encoding;
use crate::protocol::envelope::Sequence;

/// Subjects a publisher keeps a count for; beyond that it forgets them all and starts each
/// again under a new epoch (a receiver sees a new count, not a gap).
const MAX_PUBLISHED_SUBJECTS: usize = 4096;
/// Streams (publisher and subject) a subscription follows; beyond that it forgets them all
/// (and may then miss a gap, never count a false one).
const MAX_FOLLOWED_STREAMS: usize = 65_536;

/// One subject's count at the publisher.
#[derive(Debug)]
pub(crate) struct Counter {
    epoch: u32,
    next: u64,
}

impl Counter {
    /// The number the next message gets.
    pub(crate) fn peek(&self) -> Sequence {
        Sequence {
            epoch: self.epoch,
            n: self.next,
        }
    }

    /// The message numbered by [`peek`](Counter::peek) went out.
    pub(crate) fn advance(&mut self) {
        self.next += 1;
    }
}

/// A publisher's counts, one per subject. A count is held (an async lock) from numbering a
/// message until it is handed to the connection, so concurrent publishers on one subject
/// send their numbers in order.
#[derive(Debug, Default)]
pub(crate) struct Sequencer {
    /// By subject. The subjects are the agent's own, so a fast hasher (foldhash, seeded at
    /// random) serves where SipHash cost a share of every published event.
    counters: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Counter>>, RandomState>>,
}

impl Sequencer {
    pub(crate) fn counter(&self, subject: &str) -> Arc<tokio::sync::Mutex<Counter>> {
        let mut counters = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = counters.get(subject) {
            return Arc::clone(c);
        }
        if counters.len() >= MAX_PUBLISHED_SUBJECTS {
            counters.clear();
        }
        let counter = Arc::new(tokio::sync::Mutex::new(Counter {
            // The low bits of a UUIDv7 are random.
            epoch: uuid::Uuid::now_v7().as_u128() as u32,
            next: 1,
        }));
        counters.insert(subject.to_owned(), Arc::clone(&counter));
        counter
    }
}

/// The event numbering of a publisher that is not an [`Agent`](crate::Agent), such as the
/// coordinator: each subject its own count under a random epoch, as an agent numbers its events
/// (PROTOCOL.md section 7.9), so subscribers count what they missed of its events too.
#[derive(Debug, Default)]
pub struct EventNumbers {
    sequencer: Sequencer,
}

impl EventNumbers {
    /// Sets `env.seq` to the next number on `subject` and runs `publish` with it. The count is
    /// held until `publish` returns, so concurrent publishers on one subject send their numbers
    /// in order, and it advances only when `publish` succeeds (a number is never skipped).
    ///
    /// # Errors
    /// What `publish` returns.
    pub async fn publish<F, Fut, T, E>(
        &self,
        subject: &str,
        env: &mut crate::Envelope,
        publish: F,
    ) -> Result<T, E>
    where
        F: FnOnce(&crate::Envelope) -> Fut,
        Fut: std::future::Future<Output = Result<T, E>>,
    {
        let counter = self.sequencer.counter(subject);
        let mut counter = counter.lock().await;
        env.seq = Some(counter.peek());
        let sent = publish(env).await?;
        counter.advance();
        Ok(sent)
    }
}

/// What one subscription has seen of each publisher's count on each subject.
#[derive(Debug, Default)]
pub(crate) struct Gaps {
    /// By a hash of (sender, subject): the epoch and the highest number seen.
    streams: HashMap<u64, (u32, u64), RandomState>,
    /// Seeded at random for each subscription, so that senders cannot choose colliding keys.
    hasher: RandomState,
}

impl Gaps {
    /// Notes one arriving message; returns how many messages before it were missed.
    pub(crate) fn observe(&mut self, subject: &str, payload: &[u8]) -> u64 {
        let Some((from, seq)) = peek(payload) else {
            return 0;
        };
        let key = self.hasher.hash_one((&*from, subject));
        if self.streams.len() >= MAX_FOLLOWED_STREAMS && !self.streams.contains_key(&key) {
            self.streams.clear();
        }
        match self.streams.get_mut(&key) {
            Some((epoch, last)) if *epoch == seq.epoch => {
                if seq.n <= *last {
                    // A repeat or a late copy: nothing missed.
                    return 0;
                }
                let missed = seq.n - *last - 1;
                *last = seq.n;
                missed
            }
            // The first seen, or a new count (the publisher restarted): nothing to compare.
            _ => {
                self.streams.insert(key, (seq.epoch, seq.n));
                0
            }
        }
    }
}

/// The sender and sequence of an envelope in any encoding (the sender borrowed from the
/// bytes, but for JSON).
fn peek(payload: &[u8]) -> Option<(std::borrow::Cow<'_, str>, Sequence)> {
    use std::borrow::Cow;
    match Encoding::sniff(payload)? {
        Encoding::MsgPack => crate::protocol::wire::peek_sequence(payload)
            .map(|(from, seq)| (Cow::Borrowed(from), seq)),
        Encoding::Compact => crate::protocol::wire::compact::peek_sequence(payload)
            .map(|(from, seq)| (Cow::Borrowed(from), seq)),
        Encoding::Json => {
            #[derive(serde::Deserialize)]
            struct Peek {
                from: String,
                seq: Option<Sequence>,
            }
            let p: Peek = serde_json::from_slice(payload).ok()?;
            Some((Cow::Owned(p.from), p.seq?))
        }
    }
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn event_numbers_count_each_subject_and_skip_none_on_failure() {
        let numbers = super::EventNumbers::default();
        let mut env = crate::Envelope::new(
            crate::Kind::Event,
            crate::Performative::Inform,
            "coordinator",
        );
        let mut seen = Vec::new();
        for subject in ["a", "a", "b", "a"] {
            let seq = numbers
                .publish(subject, &mut env, |e| {
                    let seq = e.seq;
                    async move { Ok::<_, ()>(seq) }
                })
                .await
                .expect("sent")
                .expect("numbered");
            seen.push((subject, seq.n));
        }
        assert_eq!(seen, [("a", 1), ("a", 2), ("b", 1), ("a", 3)]);
        // A failed publish leaves its number to the next message.
        let failed = numbers
            .publish("a", &mut env, |_| async { Err::<(), _>("down") })
            .await;
        assert_eq!(failed, Err("down"));
        numbers
            .publish("a", &mut env, |e| {
                assert_eq!(e.seq.map(|s| s.n), Some(4));
                async { Ok::<_, ()>(()) }
            })
            .await
            .expect("sent");
    }

    use super::*;
    use crate::protocol::codec::encode;
    use crate::protocol::envelope::{Envelope, Kind, Performative};

    fn event(from: &str, epoch: u32, n: u64, encoding: Encoding) -> Vec<u8> {
        let mut e = Envelope::new(Kind::Event, Performative::Inform, from);
        e.topic = Some("t".into());
        e.seq = Some(Sequence { epoch, n });
        e.payload = bytes::Bytes::from_static(b"\\x01");
        encode(&e, encoding).expect("encodes").to_vec()
    }

    #[test]
    fn a_jump_is_counted_a_repeat_and_a_new_epoch_are_not() {
        for enc in [Encoding::MsgPack, Encoding::Json] {
            let mut gaps = Gaps::default();
            let seen: Vec<u64> = [(1, 1), (1, 2), (1, 5), (1, 5), (1, 3), (7, 1), (7, 4)]
                .into_iter()
                .map(|(epoch, n)| gaps.observe("s", &event("p", epoch, n, enc)))
                .collect();
            assert_eq!(seen, [0, 0, 2, 0, 0, 0, 2], "{enc:?}");
        }
    }

    #[test]
    fn publishers_and_subjects_are_counted_apart_and_unsequenced_messages_ignored() {
        let mut gaps = Gaps::default();
        assert_eq!(gaps.observe("a", &event("p", 1, 1, Encoding::MsgPack)), 0);
        assert_eq!(gaps.observe("b", &event("p", 1, 9, Encoding::MsgPack)), 0);
        assert_eq!(gaps.observe("a", &event("q", 1, 9, Encoding::MsgPack)), 0);
        assert_eq!(gaps.observe("a", &event("p", 1, 3, Encoding::MsgPack)), 1);
        let plain = encode(
            &Envelope::new(Kind::Event, Performative::Inform, "p"),
            Encoding::MsgPack,
        )
        .expect("encodes");
        assert_eq!(gaps.observe("a", &plain), 0);
        assert_eq!(gaps.observe("a", b"\\xc1 not an envelope"), 0);
    }

    #[tokio::test]
    async fn a_publisher_numbers_each_subject_from_one() {
        let seq = Sequencer::default();
        for expected in 1..=3 {
            let c = seq.counter("x");
            let mut c = c.lock().await;
            assert_eq!(c.peek().n, expected);
            c.advance();
        }
        let y = seq.counter("y");
        assert_eq!(y.lock().await.peek().n, 1);
    }
}
