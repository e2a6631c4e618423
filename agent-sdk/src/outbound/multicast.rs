//! Multicast: one call to a list of agents, sent once per recipient as a request of its own,
//! the replies collected (all of them, the first `n`, or a quorum of `n`) within one deadline
//! and reported per recipient (PROTOCOL.md section 7.6.1).

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use uuid::Uuid;

use super::{Call, Outbound, Parent, Reply, Target};
use crate::error::SdkError;
use crate::protocol::status::StatusCode;
use crate::subject::validate_token;

/// The most recipients one multicast may name.
pub const MAX_MULTICAST_RECIPIENTS: usize = 1000;

/// Which replies a multicast waits for. Whatever it waits for, it returns at the call's
/// deadline at the latest, with what has come by then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collect {
    /// Every recipient's answer (a reply, a refusal, no responders), or the deadline.
    All,
    /// The first `n` successful replies: it returns as soon as `n` have come. When too many
    /// recipients have failed for `n` to come, it still waits for the others' replies (as
    /// many as come by the deadline).
    First(usize),
    /// A quorum of `n` successful replies: it returns as soon as `n` have come, or as soon as
    /// too many recipients have failed for `n` to come; the report says which ([`met`]).
    ///
    /// [`met`]: MulticastReport::met
    Quorum(usize),
}

impl Collect {
    /// How many successful replies it asks for, of `recipients`.
    fn wanted(self, recipients: usize) -> usize {
        match self {
            Collect::All => recipients,
            Collect::First(n) | Collect::Quorum(n) => n,
        }
    }

    /// Refuses an `n` that is 0 or more than the recipients.
    fn check(self, recipients: usize) -> Result<(), String> {
        match self {
            Collect::All => Ok(()),
            Collect::First(n) | Collect::Quorum(n) if n == 0 || n > recipients => Err(format!(
                "{self:?}: n must be 1 to the number of recipients ({recipients})"
            )),
            Collect::First(_) | Collect::Quorum(_) => Ok(()),
        }
    }

    /// Whether the collection is over once `tally` stands: nothing more to wait for, or
    /// (first, quorum) `n` replies in, or (quorum) `n` out of reach.
    pub(crate) fn done(self, tally: Tally) -> bool {
        if tally.pending == 0 {
            return true;
        }
        match self {
            Collect::All => false,
            Collect::First(n) => tally.replied >= n,
            Collect::Quorum(n) => tally.replied >= n || tally.replied + tally.pending < n,
        }
    }

    /// Whether `replied` successful replies of `recipients` meet what it asked for.
    pub(crate) fn met(self, replied: usize, recipients: usize) -> bool {
        replied >= self.wanted(recipients)
    }
}

/// How far a multicast's collection has come: successful replies in, recipients not yet in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Tally {
    pub(crate) replied: usize,
    pub(crate) pending: usize,
}

/// How one recipient of a multicast fared.
#[derive(Debug, Clone)]
pub enum MulticastOutcome {
    /// It answered with success: the reply, read as [`Agent::call`](crate::Agent::call)'s
    /// ([`Reply::payload_as`]); boxed, as a reply is much larger than the other outcomes.
    Replied(Box<Reply>),
    /// It answered with an error status: its handler's error, or the receiver's refusal
    /// (expired, unknown command, access), as [`SdkError::Remote`] would give it.
    Refused {
        /// The status of its reply.
        status: StatusCode,
        /// The reason it gave.
        reason: String,
    },
    /// Nobody serves the agent's command subject (the server said so at once, 5012).
    NoResponders,
    /// No answer by the deadline (5005).
    Silent,
    /// The multicast returned before it answered (its collection was over): its request was
    /// dropped, and a late reply is ignored.
    NotAwaited,
    /// Its copy could not be sent or its reply not read, on this side: its circuit breaker
    /// open, no encryption key for it, a payload too large, the connection gone.
    Failed {
        /// The status of the error ([`SdkError::status`]).
        status: StatusCode,
        /// The error.
        reason: String,
    },
}

impl MulticastOutcome {
    /// The outcome of one copy's call.
    fn of(result: Result<Reply, SdkError>) -> Self {
        match result {
            Ok(reply) => MulticastOutcome::Replied(Box::new(reply)),
            Err(SdkError::Remote { status, reason, .. }) => {
                MulticastOutcome::Refused { status, reason }
            }
            Err(SdkError::NoResponders(_)) => MulticastOutcome::NoResponders,
            Err(SdkError::Timeout(_)) => MulticastOutcome::Silent,
            Err(err) => MulticastOutcome::Failed {
                status: err.status(),
                reason: err.to_string(),
            },
        }
    }

    /// Its name, as the report's JSON and the Python SDK write it: `replied`, `refused`,
    /// `no_responders`, `silent`, `not_awaited` or `failed`.
    pub fn label(&self) -> &'static str {
        match self {
            MulticastOutcome::Replied(_) => "replied",
            MulticastOutcome::Refused { .. } => "refused",
            MulticastOutcome::NoResponders => "no_responders",
            MulticastOutcome::Silent => "silent",
            MulticastOutcome::NotAwaited => "not_awaited",
            MulticastOutcome::Failed { .. } => "failed",
        }
    }

    /// The status it stands for: the reply's, the refusal's or the error's; 5012 for no
    /// responders, 5005 for silence; `None` when it was not awaited.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            MulticastOutcome::Replied(reply) => Some(reply.status()),
            MulticastOutcome::Refused { status, .. } | MulticastOutcome::Failed { status, .. } => {
                Some(*status)
            }
            MulticastOutcome::NoResponders => Some(StatusCode::NO_RESPONDERS),
            MulticastOutcome::Silent => Some(StatusCode::TIMEOUT),
            MulticastOutcome::NotAwaited => None,
        }
    }

    /// The successful reply, if it is one.
    pub fn reply(&self) -> Option<&Reply> {
        match self {
            MulticastOutcome::Replied(reply) => Some(reply.as_ref()),
            _ => None,
        }
    }
}

/// One recipient's line in a multicast report.
#[derive(Debug, Clone)]
pub struct MulticastRecipient {
    /// Agent id.
    pub agent: String,
    /// What happened.
    pub outcome: MulticastOutcome,
}

/// How many recipients fared each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MulticastCounts {
    /// Answered with success.
    pub replied: usize,
    /// Answered with an error status.
    pub refused: usize,
    /// Nobody serves them.
    pub no_responders: usize,
    /// No answer by the deadline.
    pub silent: usize,
    /// Not waited for.
    pub not_awaited: usize,
    /// Failed on this side.
    pub failed: usize,
}

/// What a multicast brought back: one line per recipient, in the order they were given.
#[derive(Debug, Clone)]
pub struct MulticastReport {
    /// The conversation every copy carries as its `correlation_id`: a fresh id, or, for a
    /// multicast sent while handling a message, that message's conversation.
    pub multicast_id: Uuid,
    /// What it waited for.
    pub collect: Collect,
    /// Whether enough successful replies came: every recipient's for [`Collect::All`], `n`
    /// for [`Collect::First`] and [`Collect::Quorum`].
    pub met: bool,
    /// How long it took, from the first send to the return.
    pub elapsed: Duration,
    /// One line per recipient, in the order given.
    pub recipients: Vec<MulticastRecipient>,
}

impl MulticastReport {
    /// How many recipients fared each way.
    pub fn counts(&self) -> MulticastCounts {
        let mut counts = MulticastCounts::default();
        for r in &self.recipients {
            let count = match r.outcome {
                MulticastOutcome::Replied(_) => &mut counts.replied,
                MulticastOutcome::Refused { .. } => &mut counts.refused,
                MulticastOutcome::NoResponders => &mut counts.no_responders,
                MulticastOutcome::Silent => &mut counts.silent,
                MulticastOutcome::NotAwaited => &mut counts.not_awaited,
                MulticastOutcome::Failed { .. } => &mut counts.failed,
            };
            *count += 1;
        }
        counts
    }

    /// How agent `agent` fared, if it was a recipient.
    pub fn outcome(&self, agent: &str) -> Option<&MulticastOutcome> {
        self.recipients
            .iter()
            .find(|r| r.agent == agent)
            .map(|r| &r.outcome)
    }

    /// The successful replies, by agent, in the recipients' order.
    pub fn replies(&self) -> impl Iterator<Item = (&str, &Reply)> {
        self.recipients
            .iter()
            .filter_map(|r| r.outcome.reply().map(|reply| (r.agent.as_str(), reply)))
    }
}

/// Checks a multicast before anything is sent: the call (to agents, by command, without a
/// fixed id), the recipients (1 to [`MAX_MULTICAST_RECIPIENTS`] valid agent ids, none twice)
/// and `collect`'s `n`.
fn check<S: AsRef<str>>(call: &Call, to: &[S], collect: Collect) -> Result<(), SdkError> {
    let invalid = |why: String| SdkError::InvalidCall(format!("multicast: {why}"));
    if !matches!(call.target, Target::Agent(_)) {
        return Err(invalid(
            "a multicast goes to agents by id: build it with Call::multicast(command)".into(),
        ));
    }
    if call.id.is_some() {
        return Err(invalid(
            "every copy has an id of its own: do not set Call::id".into(),
        ));
    }
    let command = call.name.as_deref().unwrap_or_default();
    validate_token("command name", command).map_err(|e| invalid(e.to_string()))?;
    if to.is_empty() {
        return Err(invalid("no recipients: name at least one agent".into()));
    }
    if to.len() > MAX_MULTICAST_RECIPIENTS {
        return Err(invalid(format!(
            "{} recipients: at most {MAX_MULTICAST_RECIPIENTS} are allowed",
            to.len()
        )));
    }
    let mut seen = HashSet::with_capacity(to.len());
    for agent in to {
        let agent = agent.as_ref();
        validate_token("agent id", agent).map_err(|e| invalid(e.to_string()))?;
        if !seen.insert(agent) {
            return Err(invalid(format!("recipient {agent} is listed twice")));
        }
    }
    collect.check(to.len()).map_err(invalid)
}

impl Outbound {
    /// Sends `call` to every agent in `to` at once, each copy a request of its own (its own
    /// id, `to` its one recipient, all sharing one conversation), and collects the replies as
    /// `collect` asks within the call's timeout. A recipient's failure is in the report; the
    /// call fails only when it is refused before anything is sent.
    pub(crate) async fn multicast<S: AsRef<str>>(
        &self,
        mut call: Call,
        to: &[S],
        collect: Collect,
        parent: Option<Parent<'_>>,
    ) -> Result<MulticastReport, SdkError> {
        check(&call, to, collect)?;
        let multicast_id = parent.map_or_else(Uuid::now_v7, |p| p.env.conversation());
        call.correlation = Some(multicast_id);
        let wait = call.timeout.unwrap_or(self.request_timeout);
        let started = tokio::time::Instant::now();
        let deadline = started + wait;
        let mut running: FuturesUnordered<_> = to
            .iter()
            .enumerate()
            .map(|(i, agent)| {
                let mut copy = call.clone();
                copy.target = Target::Agent(agent.as_ref().to_owned());
                async move { (i, self.call(copy, parent).await) }
            })
            .collect();
        let mut outcomes: Vec<Option<MulticastOutcome>> = vec![None; to.len()];
        let mut tally = Tally {
            replied: 0,
            pending: to.len(),
        };
        let mut expired = false;
        while !collect.done(tally) {
            match tokio::time::timeout_at(deadline, running.next()).await {
                Ok(Some((i, result))) => {
                    let outcome = MulticastOutcome::of(result);
                    tally.pending -= 1;
                    if matches!(outcome, MulticastOutcome::Replied(_)) {
                        tally.replied += 1;
                    }
                    if let Some(slot) = outcomes.get_mut(i) {
                        *slot = Some(outcome);
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    expired = true;
                    break;
                }
            }
        }
        // The requests still out are dropped with their futures: a late reply finds nobody
        // waiting and is ignored.
        drop(running);
        let left = if expired {
            MulticastOutcome::Silent
        } else {
            MulticastOutcome::NotAwaited
        };
        let recipients = to
            .iter()
            .zip(outcomes)
            .map(|(agent, outcome)| MulticastRecipient {
                agent: agent.as_ref().to_owned(),
                outcome: outcome.unwrap_or_else(|| left.clone()),
            })
            .collect();
        tracing::debug!(agent = %self.link.id, %multicast_id, recipients = to.len(), replied = tally.replied, ?collect, expired, "multicast collected");
        Ok(MulticastReport {
            multicast_id,
            collect,
            met: collect.met(tally.replied, to.len()),
            elapsed: started.elapsed(),
            recipients,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(replied: usize, pending: usize) -> Tally {
        Tally { replied, pending }
    }

    #[test]
    fn all_waits_for_every_recipient() {
        assert!(!Collect::All.done(tally(3, 1)));
        assert!(!Collect::All.done(tally(0, 4)));
        assert!(Collect::All.done(tally(2, 0)));
        assert!(Collect::All.met(4, 4));
        assert!(!Collect::All.met(3, 4));
    }

    #[test]
    fn first_n_stops_at_n_replies_and_otherwise_collects_what_comes() {
        assert!(!Collect::First(2).done(tally(1, 3)));
        assert!(Collect::First(2).done(tally(2, 2)));
        // Three can no longer come (one in, one pending), but it waits for the pending one.
        assert!(!Collect::First(3).done(tally(1, 1)));
        assert!(Collect::First(3).done(tally(1, 0)));
        assert!(Collect::First(1).met(1, 5));
        assert!(!Collect::First(2).met(1, 5));
    }

    #[test]
    fn a_quorum_stops_when_met_or_out_of_reach() {
        let q = Collect::Quorum(3);
        assert!(!q.done(tally(0, 4)), "4 pending can still make 3");
        assert!(!q.done(tally(1, 2)), "1 in and 2 pending can still make 3");
        assert!(q.done(tally(1, 1)), "1 in and 1 pending cannot make 3");
        assert!(q.done(tally(0, 2)), "two pending cannot make 3");
        assert!(q.done(tally(3, 1)), "met");
        assert!(q.met(3, 4));
        assert!(!q.met(2, 4));
        assert!(Collect::Quorum(2).done(tally(2, 2)));
    }

    #[test]
    fn n_must_be_one_to_the_number_of_recipients() {
        assert!(Collect::First(0).check(3).is_err());
        assert!(Collect::Quorum(4).check(3).is_err());
        assert!(Collect::Quorum(3).check(3).is_ok());
        assert!(Collect::All.check(1).is_ok());
        assert_eq!(
            Collect::First(0).check(2),
            Err("First(0): n must be 1 to the number of recipients (2)".to_owned())
        );
    }

    #[test]
    fn bad_input_is_refused_before_anything_is_sent() {
        let call = Call::multicast("vote");
        let refused = |call: &Call, to: &[&str], collect| match check(call, to, collect) {
            Err(SdkError::InvalidCall(why)) => why,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert!(check(&call, &["a", "b"], Collect::All).is_ok());
        assert!(refused(&call, &[], Collect::All).contains("no recipients"));
        assert!(refused(&call, &["a", "b", "a"], Collect::All).contains("a is listed twice"));
        assert!(refused(&call, &["a", "b.c"], Collect::All).contains("agent id"));
        assert!(refused(&call, &["a"], Collect::Quorum(2)).contains("n must be 1 to"));
        assert!(refused(&call, &["a"], Collect::First(0)).contains("n must be 1 to"));
        let many: Vec<String> = (0..=MAX_MULTICAST_RECIPIENTS)
            .map(|i| format!("a{i}"))
            .collect();
        let why = match check(&call, &many, Collect::All) {
            Err(SdkError::InvalidCall(why)) => why,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert!(why.contains("1001 recipients: at most 1000"), "{why}");
        assert!(refused(&Call::capability("doc.scan"), &["a"], Collect::All).contains("by id"));
        assert!(
            refused(&call.clone().id(Uuid::now_v7()), &["a"], Collect::All).contains("Call::id")
        );
        assert!(
            refused(&Call::multicast("no.dots"), &["a"], Collect::All).contains("command name")
        );
        assert_eq!(
            check(&call, &[""], Collect::All).map_err(|e| e.status()),
            Err(StatusCode::INVALID_ARGUMENT)
        );
    }

    #[test]
    fn errors_become_outcomes() {
        let outcome = |err| MulticastOutcome::of(Err(err));
        assert_eq!(
            outcome(SdkError::Timeout(Duration::from_secs(1))).label(),
            "silent"
        );
        assert_eq!(
            outcome(SdkError::NoResponders("s".into())).status(),
            Some(StatusCode::NO_RESPONDERS)
        );
        let refused = outcome(SdkError::Remote {
            status: StatusCode::INVALID_ARGUMENT,
            reason: "no".into(),
            from: Some("b".into()),
        });
        assert!(matches!(
            refused,
            MulticastOutcome::Refused { status, ref reason }
                if status == StatusCode::INVALID_ARGUMENT && reason == "no"
        ));
        let failed = outcome(SdkError::CircuitOpen {
            destination: "agent:b".into(),
            retry_in: Duration::from_secs(1),
        });
        assert_eq!(failed.label(), "failed");
        assert_eq!(failed.status(), Some(StatusCode::UNAVAILABLE));
        assert_eq!(MulticastOutcome::NotAwaited.status(), None);
    }
}
