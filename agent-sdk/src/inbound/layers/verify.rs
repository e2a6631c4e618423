//! Signature check: a signed message must verify against the sender's registered key, within
//! the timestamp tolerance and never twice (5004, 5014, 5015).

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Inbound, Layer};
use crate::inbound::outcome::Failure;
use crate::protocol::envelope::{Envelope, now_ms};
use crate::protocol::status::StatusCode;
use crate::security::Verifier;
use crate::security::signing::Refused;
use crate::stats::AgentCounters;

pub(crate) struct Verify {
    pub(crate) agent: String,
    pub(crate) verifier: Arc<Verifier>,
    pub(crate) counters: Arc<AgentCounters>,
}

impl Verify {
    fn refused(&self, msg: &Inbound<'_>, (status, reason): (StatusCode, String)) -> Failure {
        AgentCounters::bump(&self.counters.security_refused);
        tracing::warn!(agent = %self.agent, from = %msg.env.from, id = %msg.env.id, %status, %reason, "message refused by signature check");
        Failure::refused(status, reason)
    }
}

impl Layer for Verify {
    fn check(&self, msg: &mut Inbound<'_>) -> Result<(), Failure> {
        // A replay of a dead letter: the replayer's signature instead of the age and seen id.
        if let Some(replay) = msg.replay.take() {
            let verdict = replay
                .map_err(|why| (StatusCode::IDENTITY, why))
                .and_then(|proof| {
                    let verdict = self.verifier.verify_replay(
                        msg.subject,
                        &msg.env,
                        msg.stored,
                        &proof,
                        now_ms(),
                    );
                    if verdict.is_ok() {
                        tracing::info!(agent = %self.agent, from = %msg.env.from, id = %msg.env.id, by = %proof.by, of = %proof.of, "dead letter replayed");
                    }
                    verdict
                });
            msg.seen_id = verdict.map_err(|refused| self.refused(msg, refused))?;
            msg.verified = msg.env.signature.is_some();
            return Ok(());
        }
        // Checked already in a batch ([`Batches`]), or here on its own.
        let verdict = match msg.preverified.take() {
            Some(verdict) => verdict,
            None => self
                .verifier
                .verify_delivery(msg.subject, &msg.env, msg.stored, now_ms()),
        };
        verdict.map_err(|refused| self.refused(msg, refused))?;
        // An unsigned message passes where signatures are optional, but proves nothing.
        msg.verified = msg.env.signature.is_some();
        Ok(())
    }

    /// Signatures checked as a batch: about half the cost per signature.
    fn check_batch(&self, msgs: &mut [Inbound<'_>]) -> Vec<Result<(), Failure>> {
        let items: Vec<_> = msgs.iter().map(|m| (m.subject, &m.env, m.stored)).collect();
        let results = self.verifier.verify_deliveries(&items, now_ms());
        msgs.iter_mut()
            .zip(results)
            .map(|(msg, result)| {
                result.map_err(|refused| self.refused(msg, refused))?;
                msg.verified = msg.env.signature.is_some();
                Ok(())
            })
            .collect()
    }
}

/// Most signatures checked in one batch.
const BATCH: usize = 64;

/// One signed message waiting for its check.
struct Job {
    subject: String,
    env: Arc<Envelope>,
    /// The stored copy's stream sequence, for a durable delivery.
    stored: Option<u64>,
    done: tokio::sync::oneshot::Sender<Result<(), Refused>>,
}

/// Signature checks for the handler routes (commands, capabilities, events, the durable
/// inbox), in batches as the event stream does, on every core.
///
/// Handlers hand their signed messages to one collector, which takes whatever is waiting (up
/// to 64) and checks it as a batch on a blocking thread: about half the cost per signature of
/// checking one by one, and while one batch is being checked the next is collected for
/// another core, so checks use all of them. A message that arrives alone is checked at once,
/// on the collector, without the hop. When the agent stops, the collector checks what is
/// waiting and closes; a message that finds it closed is checked by the layer itself.
pub(crate) struct Batches {
    jobs: tokio::sync::mpsc::UnboundedSender<Job>,
}

impl Batches {
    /// Starts the collector, tracked by `tracker` and stopped by `stop`.
    pub(crate) fn start(
        verifier: Arc<Verifier>,
        counters: Arc<AgentCounters>,
        tracker: &TaskTracker,
        stop: CancellationToken,
    ) -> Self {
        let (jobs, mut waiting) = tokio::sync::mpsc::unbounded_channel::<Job>();
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let checking = Arc::new(tokio::sync::Semaphore::new(cores));
        let blocking = tracker.clone();
        tracker.spawn(async move {
            let mut batch = Vec::with_capacity(BATCH);
            loop {
                // One batch per core at a time: the next waits (and grows) meanwhile.
                let Ok(core) = Arc::clone(&checking).acquire_owned().await else {
                    break;
                };
                let taken = tokio::select! {
                    taken = waiting.recv_many(&mut batch, BATCH) => taken,
                    () = stop.cancelled() => {
                        // Check what is already waiting, then take no more.
                        waiting.close();
                        waiting.recv_many(&mut batch, usize::MAX).await
                    }
                };
                if taken == 0 {
                    break;
                }
                AgentCounters::bump(&counters.verify_batches);
                counters
                    .verified_in_batches
                    .fetch_add(taken as u64, std::sync::atomic::Ordering::Relaxed);
                let jobs = std::mem::replace(&mut batch, Vec::with_capacity(BATCH));
                if jobs.len() == 1 {
                    check(&verifier, jobs);
                    drop(core);
                    continue;
                }
                let verifier = Arc::clone(&verifier);
                blocking.spawn_blocking(move || {
                    check(&verifier, jobs);
                    drop(core);
                });
            }
        });
        Batches { jobs }
    }

    /// Checks `env`'s signature with whatever else is waiting; gives the envelope back with
    /// the verdict, or with `None` when the collector could not check it (closed as the agent
    /// stops): the layer checks it then.
    pub(crate) async fn verify(
        &self,
        subject: &str,
        env: Envelope,
        stored: Option<u64>,
    ) -> (Envelope, Option<Result<(), Refused>>) {
        let env = Arc::new(env);
        let (done, verdict) = tokio::sync::oneshot::channel();
        let job = Job {
            subject: subject.to_owned(),
            env: Arc::clone(&env),
            stored,
            done,
        };
        let verdict = match self.jobs.send(job) {
            Ok(()) => verdict.await.ok(),
            Err(_) => None,
        };
        // The job lets go of its reference before it answers, so this is the only one left.
        let env = Arc::try_unwrap(env).unwrap_or_else(|shared| (*shared).clone());
        (env, verdict)
    }
}

/// Checks `jobs` as one batch and answers each.
fn check(verifier: &Verifier, jobs: Vec<Job>) {
    let items: Vec<(&str, &Envelope, Option<u64>)> = jobs
        .iter()
        .map(|j| (j.subject.as_str(), j.env.as_ref(), j.stored))
        .collect();
    let verdicts = verifier.verify_deliveries(&items, now_ms());
    drop(items);
    for (job, verdict) in jobs.into_iter().zip(verdicts) {
        let Job { env, done, .. } = job;
        drop(env);
        // The handler may have gone (its agent stopping): nothing to tell.
        let _ = done.send(verdict);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::protocol::envelope::{Envelope, Kind, Performative};
    use crate::security::{Identity, SignaturePolicy};

    fn layer(require_signed: bool) -> (Verify, Identity) {
        let alice = Identity::generate();
        let verifier = Verifier::new(SignaturePolicy {
            require_signed,
            ..SignaturePolicy::default()
        });
        verifier.trust("alice", &alice.public_key());
        let layer = Verify {
            agent: "bank".into(),
            verifier: Arc::new(verifier),
            counters: Arc::default(),
        };
        (layer, alice)
    }

    fn signed(identity: &Identity, from: &str) -> Envelope {
        let mut env = Envelope::new(Kind::Request, Performative::Request, from);
        env.payload = bytes::Bytes::from_static(b"\x0a");
        identity.sign("chorus.agent.bank.pay", &mut env);
        env
    }

    fn check(layer: &Verify, env: Envelope) -> Result<(), Failure> {
        layer.check(&mut Inbound::new("chorus.agent.bank.pay", env, None))
    }

    /// The collector answers each message with its own verdict, whatever batch it was in,
    /// and once the agent stops it hands the message back unchecked for the layer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_give_each_message_its_own_verdict_and_hand_back_once_stopped() {
        let (layer, alice) = layer(true);
        let counters = Arc::new(AgentCounters::default());
        let tracker = TaskTracker::new();
        let stop = CancellationToken::new();
        let batches = Batches::start(
            Arc::clone(&layer.verifier),
            Arc::clone(&counters),
            &tracker,
            stop.clone(),
        );
        let checks = (0..40u8).map(|i| {
            let mut env = signed(&alice, "alice");
            if i % 5 == 0 {
                env.payload = bytes::Bytes::from(vec![0xff, i]);
            }
            let id = env.id;
            let batches = &batches;
            async move {
                let (back, verdict) = batches.verify("chorus.agent.bank.pay", env, None).await;
                assert_eq!(back.id, id, "the same envelope comes back");
                (i, verdict)
            }
        });
        for (i, verdict) in futures::future::join_all(checks).await {
            match verdict {
                Some(Ok(())) => assert_ne!(i % 5, 0, "{i}: a forgery passed"),
                Some(Err((status, _))) => {
                    assert_eq!(i % 5, 0, "{i}: refused");
                    assert_eq!(status, StatusCode::IDENTITY);
                }
                None => panic!("{i}: not checked while running"),
            }
        }
        let stats = counters.snapshot();
        assert_eq!(stats.verified_in_batches, 40);
        assert!((1..=40).contains(&stats.verify_batches));

        stop.cancel();
        tracker.close();
        tokio::time::timeout(std::time::Duration::from_secs(10), tracker.wait())
            .await
            .expect("the collector stops");
        let env = signed(&alice, "alice");
        let id = env.id;
        let (back, verdict) = batches.verify("chorus.agent.bank.pay", env, None).await;
        assert_eq!((back.id, verdict), (id, None), "left to the layer");
    }

    #[test]
    fn only_a_message_whose_signature_verified_is_marked_verified() {
        let (layer, alice) = layer(false);
        let mut msg = Inbound::new("chorus.agent.bank.pay", signed(&alice, "alice"), None);
        assert!(layer.check(&mut msg).is_ok());
        assert!(msg.verified, "signed and verified");
        let unsigned = Envelope::new(Kind::Request, Performative::Request, "alice");
        let mut msg = Inbound::new("chorus.agent.bank.pay", unsigned, None);
        assert!(
            layer.check(&mut msg).is_ok(),
            "unsigned passes where optional"
        );
        assert!(!msg.verified, "but is not verified");
        let mut batch = vec![
            Inbound::new("chorus.agent.bank.pay", signed(&alice, "alice"), None),
            Inbound::new(
                "chorus.agent.bank.pay",
                Envelope::new(Kind::Request, Performative::Request, "alice"),
                None,
            ),
        ];
        assert!(layer.check_batch(&mut batch).iter().all(Result::is_ok));
        assert!(batch[0].verified);
        assert!(!batch[1].verified);
    }

    #[test]
    fn a_good_signature_passes_once_and_its_replay_is_5015() {
        let (layer, alice) = layer(true);
        let env = signed(&alice, "alice");
        assert!(check(&layer, env.clone()).is_ok());
        assert_eq!(
            check(&layer, env).expect_err("replay").status,
            StatusCode::REPLAY
        );
        assert_eq!(layer.counters.snapshot().security_refused, 1);
    }

    #[test]
    fn a_forged_payload_or_an_impostor_is_5004() {
        let (layer, alice) = layer(true);
        let mut forged = signed(&alice, "alice");
        forged.payload = bytes::Bytes::from_static(b"\x0b");
        assert_eq!(
            check(&layer, forged).expect_err("forged").status,
            StatusCode::IDENTITY
        );
        let impostor = signed(&alice, "carol");
        assert_eq!(
            check(&layer, impostor).expect_err("no key").status,
            StatusCode::IDENTITY
        );
    }

    #[test]
    fn unsigned_is_5014_only_where_signatures_are_required() {
        let (strict, _) = layer(true);
        let env = Envelope::new(Kind::Request, Performative::Request, "alice");
        assert_eq!(
            check(&strict, env.clone()).expect_err("unsigned").status,
            StatusCode::UNAUTHORIZED
        );
        let (lenient, _) = layer(false);
        assert!(check(&lenient, env).is_ok());
    }

    #[test]
    fn a_batch_refuses_only_the_forged_one() {
        let (layer, alice) = layer(true);
        let good = signed(&alice, "alice");
        let mut forged = signed(&alice, "alice");
        forged.payload = bytes::Bytes::from_static(b"\x0c");
        let mut msgs: Vec<_> = [good, forged]
            .into_iter()
            .map(|env| Inbound::new("chorus.agent.bank.pay", env, None))
            .collect();
        let results = layer.check_batch(&mut msgs);
        assert!(results[0].is_ok());
        assert_eq!(
            results[1].as_ref().expect_err("forged").status,
            StatusCode::IDENTITY
        );
    }
}
