//! The ordering lanes (one sender's commands in order, lanes by a hash of the sender) and
//! the keeper that reports progress on every delivery held, so none is redelivered while it
//! waits its turn.

use crate::Report;
use std::sync::Arc;
use std::time::Duration;

use chorus_broker_adapter::{Deliveries, Delivery};
use opentelemetry::trace::SpanKind;

use crate::inbound::{Outcome, Retry, Target, Via};
use crate::protocol::envelope::Kind;
use crate::stats::AgentCounters;
use crate::sync::read;

use super::consumer::sleep_until_some;
use super::*;

impl DurableInbox {
    /// Every third of the ack wait, reports progress on every delivery this instance holds
    /// (handled or waiting its turn), so the server redelivers none of them while the
    /// instance lives, and all of them within one ack wait once it is gone.
    pub(super) fn spawn_keeper(self: &Arc<Self>) {
        let inbox = Arc::clone(self);
        let period = self.ack_wait / 3;
        self.tracker.spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = inbox.stop.cancelled() => break,
                }
                let held: Vec<Arc<Delivery>> = inbox.held().values().cloned().collect();
                for delivery in held {
                    if let Err(err) = delivery.in_progress().await {
                        tracing::debug!(agent = %inbox.link.id, error = %Report(&err), "in-progress ack not sent");
                    }
                }
            }
        });
    }

    /// Spawns `lanes` lanes: each handles its deliveries one at a time, so one sender's
    /// messages (always sent to the same lane) are handled in the order they were stored.
    pub(super) fn spawn_lanes(
        self: &Arc<Self>,
        lanes: usize,
    ) -> Vec<tokio::sync::mpsc::UnboundedSender<(Arc<Delivery>, Decoded)>> {
        let mut senders = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Arc<Delivery>, Decoded)>();
            senders.push(tx);
            let inbox = Arc::clone(self);
            self.tracker.spawn(async move {
                while let Some((delivery, decoded)) = rx.recv().await {
                    inbox.process(delivery, decoded).await;
                }
            });
        }
        senders
    }

    /// Sends each delivery to the lane chosen by its sender. Never waits for a lane: what it
    /// takes is held (and kept alive) at once, and the consumer's `max_ack_pending` bounds how
    /// much that is. With `quiet`, returns once nothing has been delivered for that long and
    /// nothing is held here.
    pub(super) async fn dispatch(
        &self,
        deliveries: &mut Deliveries,
        senders: &[tokio::sync::mpsc::UnboundedSender<(Arc<Delivery>, Decoded)>],
        quiet: Option<Duration>,
    ) -> Ended {
        let quiet_for = |from: tokio::time::Instant| quiet.map(|q| from + q);
        let mut quiet_at = quiet_for(tokio::time::Instant::now());
        loop {
            let next = tokio::select! {
                next = futures::StreamExt::next(deliveries) => next,
                () = sleep_until_some(quiet_at) => {
                    if self.held().is_empty() {
                        return Ended::Quiet;
                    }
                    quiet_at = quiet_for(tokio::time::Instant::now());
                    continue;
                }
                () = self.stop.cancelled() => return Ended::Stopped,
            };
            let delivery = match next {
                Some(Ok(d)) => d,
                Some(Err(err)) => {
                    tracing::debug!(agent = %self.link.id, error = %Report(&err), "durable inbox: pull interrupted");
                    continue;
                }
                None => return Ended::Closed,
            };
            quiet_at = quiet_for(tokio::time::Instant::now());
            let decoded = self.pipeline.decode(delivery.subject(), delivery.payload());
            let lane = match &decoded {
                Ok((env, _)) => lane_of(&env.from, senders.len()),
                Err(_) => 0,
            };
            let delivery = Arc::new(delivery);
            self.held()
                .insert(delivery.stream_seq(), Arc::clone(&delivery));
            if senders[lane].send((delivery, decoded)).is_err() {
                return Ended::Stopped;
            }
        }
    }

    /// One delivery through the pipeline, then settled and let go.
    pub(super) async fn process(&self, delivery: Arc<Delivery>, decoded: Decoded) {
        let counters = self.pipeline.counters();
        let seen_here = self
            .recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(delivery.stream_seq());
        if delivery.delivered() > 1 || seen_here {
            AgentCounters::bump(&counters.redelivered);
        }
        let command = self.link.subjects.durable_command(delivery.subject());
        let target = if command == Some(crate::subject::NOTIFY_TOKEN) {
            Target::Notification
        } else {
            match command.and_then(|name| self.pipeline.endpoints.command(name)) {
                Some(endpoint) => Target::Endpoint(endpoint),
                None => Target::Unknown(delivery.subject().to_owned()),
            }
        };
        let mut decoded = decoded;
        let mut paused = 0;
        let processed = loop {
            let processed = self
                .pipeline
                .run(
                    &delivery.shared_subject(),
                    decoded,
                    target.clone(),
                    Via {
                        span: SpanKind::Consumer,
                        attempt: u32::try_from(delivery.delivered()).unwrap_or(u32::MAX),
                        stored: Some(delivery.stream_seq()),
                        replay: crate::security::replay::ReplayProof::from_headers(|name| {
                            delivery.header(name)
                        }),
                    },
                )
                .await;
            // A pause the bus asked for (its exactly-once store unreachable in a leader
            // election, a rate limit) is waited out here, the delivery held and kept alive by
            // the keeper, so an outage does not use up the deliveries the server makes.
            let pause = match &processed.outcome {
                Outcome::Failed(f) if paused < PAUSES_IN_PLACE && self.holds(&delivery) => {
                    match f.retry {
                        Retry::After(pause) => pause,
                        _ => break processed,
                    }
                }
                _ => break processed,
            };
            paused += 1;
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = self.stop.cancelled() => break processed,
            }
            decoded = self.pipeline.decode(delivery.subject(), delivery.payload());
        };
        let kind = processed.request.as_ref().map_or(Kind::Unknown, |r| r.kind);
        let settle = super::settle::settle(
            &read(&self.retry_policies),
            delivery.subject(),
            delivery.delivered(),
            kind,
            processed.outcome,
        );
        if let Settle::Nak(delay) = &settle {
            tracing::debug!(agent = %self.link.id, seq = delivery.stream_seq(), delivered = delivery.delivered(), ?delay, "durable attempt failed; retrying");
        }
        let message_id = processed.request.as_ref().map(|r| r.id);
        if matches!(settle, Settle::Nak(_)) && !self.holds(&delivery) {
            // A later copy of the message is held now and settles it: a nak from this one
            // would only have the server deliver it once more.
            return;
        }
        self.apply(&delivery, settle, message_id).await;
        let mut held = self.held();
        // A later copy of the same message (redelivered meanwhile) stays held.
        if held
            .get(&delivery.stream_seq())
            .is_some_and(|h| Arc::ptr_eq(h, &delivery))
        {
            held.remove(&delivery.stream_seq());
        }
    }
}

/// How many pauses the bus asks for (`Retry::After`) one delivery waits out in place before
/// it is naked: ten of one second outlast a cluster's leader election.
const PAUSES_IN_PLACE: u32 = 10;

impl DurableInbox {
    /// Whether `delivery` is the copy of its message held now (not one a redelivery replaced).
    fn holds(&self, delivery: &Arc<Delivery>) -> bool {
        self.held()
            .get(&delivery.stream_seq())
            .is_some_and(|h| Arc::ptr_eq(h, delivery))
    }
}

pub(super) fn lane_of(sender: &str, lanes: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    sender.hash(&mut h);
    (h.finish() % lanes.max(1) as u64) as usize
}

/// The ordering promise of docs/PROTOCOL.md section 7.9 ("Ordering"), model-checked: every
/// reachable state of a model of the durable inbox, for every order the stream can hold the
/// senders' messages in, every interleaving of the lanes, every redelivery time and every
/// pattern of failed attempts (within bounds), is explored, and in each one a sender's messages
/// are first handled in the order it sent them, and every message is in the end handled
/// successfully. The model keeps what the promise rests on: the stream delivers in the order it
/// stored; each delivery goes to the lane [`lane_of`] (the real function) picks for its sender;
/// a lane handles its deliveries one at a time, in the order it got them; a failed attempt is
/// given back to the server, which redelivers it at any later moment, behind what was
/// delivered meanwhile. A lane choice that ignores the sender breaks the promise, and the same
/// check finds the counterexample.
#[cfg(test)]
mod ordering_model {
    use std::collections::{BTreeSet, HashSet, VecDeque};

    /// A message: its sender and its number in that sender's sequence.
    type Msg = (usize, u32);

    #[derive(Clone, PartialEq, Eq, Hash)]
    struct State {
        /// How much of the stream has been delivered.
        delivered: usize,
        /// Failed attempts waiting to be redelivered.
        naked: BTreeSet<Msg>,
        /// Each lane's deliveries, in the order it got them.
        lanes: Vec<VecDeque<Msg>>,
        /// Messages handled successfully.
        done: BTreeSet<Msg>,
        /// Messages attempted at least once.
        tried: BTreeSet<Msg>,
        /// Per sender, the last message number attempted for the first time.
        first: Vec<u32>,
        /// Failed attempts so far.
        failures: u32,
    }

    struct Model<'a> {
        stream: &'a [Msg],
        lane: &'a dyn Fn(Msg) -> usize,
        lanes: usize,
        max_failures: u32,
    }

    /// Explores every state reachable from the start; returns the states seen, or the first
    /// violation found.
    fn check(model: &Model<'_>, senders: usize) -> Result<usize, String> {
        let start = State {
            delivered: 0,
            naked: BTreeSet::new(),
            lanes: vec![VecDeque::new(); model.lanes],
            done: BTreeSet::new(),
            tried: BTreeSet::new(),
            first: vec![0; senders],
            failures: 0,
        };
        let mut seen = HashSet::new();
        let mut todo = vec![start];
        while let Some(state) = todo.pop() {
            if !seen.insert(state.clone()) {
                continue;
            }
            let mut next = Vec::new();
            // The stream delivers its next message, to its sender's lane.
            if let Some(&m) = model.stream.get(state.delivered) {
                let mut s = state.clone();
                s.delivered += 1;
                s.lanes[(model.lane)(m)].push_back(m);
                next.push(s);
            }
            // The server redelivers a failed attempt, at any moment.
            for &m in &state.naked {
                let mut s = state.clone();
                s.naked.remove(&m);
                s.lanes[(model.lane)(m)].push_back(m);
                next.push(s);
            }
            // A lane handles its first delivery: it succeeds, or fails and is given back.
            for lane in 0..model.lanes {
                let Some(&m) = state.lanes[lane].front() else {
                    continue;
                };
                let mut s = state.clone();
                s.lanes[lane].pop_front();
                if s.tried.insert(m) {
                    let (sender, n) = m;
                    if n != s.first[sender] + 1 {
                        return Err(format!(
                            "sender {sender}'s message {n} handled first after {} (stream {:?})",
                            s.first[sender], model.stream
                        ));
                    }
                    s.first[sender] = n;
                }
                let mut ok = s.clone();
                ok.done.insert(m);
                next.push(ok);
                if s.failures < model.max_failures {
                    s.failures += 1;
                    s.naked.insert(m);
                    next.push(s);
                }
            }
            if next.is_empty() && state.done.len() != model.stream.len() {
                return Err(format!(
                    "stuck with {} of {} handled",
                    state.done.len(),
                    model.stream.len()
                ));
            }
            todo.extend(next);
        }
        Ok(seen.len())
    }

    /// Every order the stream can hold `counts[s]` messages of each sender `s` in (each
    /// sender's own in its order).
    fn streams(counts: &[u32]) -> Vec<Vec<Msg>> {
        fn go(counts: &[u32], sent: &mut Vec<u32>, now: &mut Vec<Msg>, out: &mut Vec<Vec<Msg>>) {
            if sent.iter().zip(counts).all(|(s, c)| s == c) {
                out.push(now.clone());
                return;
            }
            for sender in 0..counts.len() {
                if sent[sender] < counts[sender] {
                    sent[sender] += 1;
                    now.push((sender, sent[sender]));
                    go(counts, sent, now, out);
                    now.pop();
                    sent[sender] -= 1;
                }
            }
        }
        let mut out = Vec::new();
        go(
            counts,
            &mut vec![0; counts.len()],
            &mut Vec::new(),
            &mut out,
        );
        out
    }

    /// Three senders of which two share a lane of two, by the real lane choice.
    fn senders() -> Vec<String> {
        let names: Vec<String> = (0..64).map(|i| format!("sender-{i}")).collect();
        for a in &names {
            for b in &names {
                for c in &names {
                    let (la, lb, lc) = (
                        super::lane_of(a, 2),
                        super::lane_of(b, 2),
                        super::lane_of(c, 2),
                    );
                    if a < b && la == lb && lc != la {
                        return vec![a.clone(), b.clone(), c.clone()];
                    }
                }
            }
        }
        panic!("no three senders split two and one over two lanes");
    }

    #[test]
    fn each_senders_messages_are_first_handled_in_the_order_it_sent_them() {
        let names = senders();
        let lane = |(sender, _): Msg| super::lane_of(&names[sender], 2);
        let mut states = 0;
        let orders = streams(&[2, 2, 1]);
        for stream in &orders {
            let model = Model {
                stream,
                lane: &lane,
                lanes: 2,
                max_failures: 2,
            };
            states += check(&model, 3).unwrap_or_else(|e| panic!("the promise breaks: {e}"));
        }
        println!(
            "ordering model: {} stream orders, {states} states, every one in order",
            orders.len()
        );
        assert_eq!(orders.len(), 30);
        assert!(states > 10_000, "the space was explored: {states}");
    }

    #[test]
    fn lanes_that_ignore_the_sender_break_it_and_the_check_says_where() {
        // By message number: one sender's messages land in different lanes, which run side
        // by side.
        let by_number = |(_, n): Msg| n as usize % 2;
        let stream = [(0, 1), (0, 2)];
        let model = Model {
            stream: &stream,
            lane: &by_number,
            lanes: 2,
            max_failures: 0,
        };
        let err = check(&model, 1).expect_err("out of order");
        assert!(err.contains("message 2 handled first after 0"), "{err}");
    }
}
