//! Multicast (PROTOCOL.md section 7.6.1): one call to a list of agents, a request of its own
//! per recipient, the replies collected (all, the first n, a quorum) within one deadline and
//! reported per recipient: replied, refused, no responders, silent or not awaited.
//!
//! Four agents serve `vote`; its ballot names who refuses (a handler error, 5018) and who is
//! slow (held until the test ends, so never in time); `mc-absent` never runs.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_sdk::{
    Agent, Call, Collect, Context, HandlerError, MAX_MULTICAST_RECIPIENTS, MulticastOutcome,
    MulticastReport, SdkError, StatusCode,
};
use chorus_tests::{NatsServer, WAIT, agent, eventually, server, within};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use uuid::Uuid;

/// Who refuses and who is slow, by agent id.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct Ballot {
    refuse: Vec<String>,
    slow: Vec<String>,
}

/// A copy as its recipient saw it.
#[derive(Debug, Clone)]
struct Seen {
    agent: String,
    id: Uuid,
    conversation: Uuid,
    to: Vec<String>,
}

/// The voters, the copies they saw, the gate their slow ones wait on, and the caller.
struct Fleet {
    _voters: Vec<Agent>,
    seen: Arc<Mutex<Vec<Seen>>>,
    gate: Arc<Semaphore>,
    caller: Agent,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // Slow handlers end (with an error nobody awaits) instead of outliving the test.
        self.gate.close();
    }
}

const VOTERS: [&str; 4] = ["mc-a", "mc-b", "mc-c", "mc-d"];

async fn fleet(server: &NatsServer) -> Fleet {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let gate = Arc::new(Semaphore::new(0));
    let mut voters = Vec::new();
    for id in VOTERS {
        let voter = agent(server, id).await;
        let seen = Arc::clone(&seen);
        let gate = Arc::clone(&gate);
        voter
            .on_command("vote", move |ctx: Context, ballot: Ballot| {
                let me = ctx.agent_id().to_owned();
                let env = ctx.message();
                seen.lock().expect("lock").push(Seen {
                    agent: me.clone(),
                    id: env.id,
                    conversation: env.conversation(),
                    to: env.to.clone(),
                });
                let gate = Arc::clone(&gate);
                async move {
                    if ballot.slow.contains(&me) {
                        let _closed = gate.acquire().await;
                        return Err(HandlerError::failed("released late"));
                    }
                    if ballot.refuse.contains(&me) {
                        return Err(HandlerError::invalid_argument(format!("{me} refuses")));
                    }
                    Ok::<_, HandlerError>(format!("{me} agrees"))
                }
            })
            .await
            .expect("serve vote");
        voters.push(voter);
    }
    let caller = agent(server, "mc-caller").await;
    Fleet {
        _voters: voters,
        seen,
        gate,
        caller,
    }
}

fn vote(ballot: &Ballot, timeout: Duration) -> Call {
    Call::multicast("vote")
        .payload(ballot)
        .expect("ballot encodes")
        .timeout(timeout)
}

fn ballot(refuse: &[&str], slow: &[&str]) -> Ballot {
    let names = |ids: &[&str]| ids.iter().map(|s| (*s).to_owned()).collect();
    Ballot {
        refuse: names(refuse),
        slow: names(slow),
    }
}

fn labels(report: &MulticastReport) -> Vec<(&str, &'static str)> {
    report
        .recipients
        .iter()
        .map(|r| (r.agent.as_str(), r.outcome.label()))
        .collect()
}

fn answer(report: &MulticastReport, agent: &str) -> String {
    report
        .outcome(agent)
        .and_then(MulticastOutcome::reply)
        .unwrap_or_else(|| panic!("{agent} replied"))
        .payload_as()
        .expect("a string")
}

#[tokio::test]
async fn a_multicast_reports_each_recipient_replied_refused_absent_or_silent() {
    let server = server();
    let fleet = fleet(&server).await;
    let deadline = Duration::from_millis(1500);
    let to = ["mc-a", "mc-b", "mc-c", "mc-absent", "mc-d"];
    let report = within(
        WAIT,
        "multicast",
        fleet.caller.multicast(
            vote(&ballot(&["mc-c"], &["mc-d"]), deadline),
            &to,
            Collect::All,
        ),
    )
    .await
    .expect("multicast");
    assert_eq!(
        labels(&report),
        [
            ("mc-a", "replied"),
            ("mc-b", "replied"),
            ("mc-c", "refused"),
            ("mc-absent", "no_responders"),
            ("mc-d", "silent"),
        ]
    );
    assert_eq!(answer(&report, "mc-a"), "mc-a agrees");
    assert_eq!(answer(&report, "mc-b"), "mc-b agrees");
    match report.outcome("mc-c") {
        Some(MulticastOutcome::Refused { status, reason }) => {
            assert_eq!(*status, StatusCode::INVALID_ARGUMENT);
            assert_eq!(reason, "mc-c refuses");
        }
        other => panic!("mc-c refused, not {other:?}"),
    }
    assert_eq!(
        report
            .outcome("mc-absent")
            .and_then(MulticastOutcome::status),
        Some(StatusCode::NO_RESPONDERS)
    );
    let counts = report.counts();
    assert_eq!(
        (
            counts.replied,
            counts.refused,
            counts.no_responders,
            counts.silent,
            counts.not_awaited
        ),
        (2, 1, 1, 1, 0)
    );
    assert!(!report.met, "not every recipient replied");
    assert!(
        report.elapsed >= deadline - Duration::from_millis(50) && report.elapsed < WAIT / 2,
        "it waited out the one deadline for the silent one: {:?}",
        report.elapsed
    );
    assert_eq!(
        report.replies().map(|(agent, _)| agent).collect::<Vec<_>>(),
        ["mc-a", "mc-b"]
    );

    // Each copy was a request of its own, addressed to its one recipient, all in one
    // conversation: the multicast's.
    let seen = eventually(WAIT, "every running recipient's copy", || {
        let seen = fleet.seen.lock().expect("lock").clone();
        async move { (seen.len() == 4).then_some(seen) }
    })
    .await;
    let mut ids: Vec<Uuid> = seen.iter().map(|s| s.id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 4, "every copy has its own id: {seen:?}");
    for copy in &seen {
        assert_eq!(copy.conversation, report.multicast_id);
        assert_eq!(copy.to, std::slice::from_ref(&copy.agent));
    }

    // Nobody listening is known at once, not at the deadline.
    let report = within(
        WAIT,
        "multicast to nobody",
        fleet.caller.multicast(
            vote(&Ballot::default(), Duration::from_secs(10)),
            &["mc-absent", "mc-gone"],
            Collect::All,
        ),
    )
    .await
    .expect("multicast");
    assert_eq!(
        labels(&report),
        [("mc-absent", "no_responders"), ("mc-gone", "no_responders")]
    );
    assert!(
        report.elapsed < Duration::from_secs(5),
        "{:?}",
        report.elapsed
    );
}

#[tokio::test]
async fn first_and_quorum_return_early_and_leave_the_rest_not_awaited() {
    let server = server();
    let fleet = fleet(&server).await;
    let long = Duration::from_secs(10);
    let early = Duration::from_secs(5);
    let caller = &fleet.caller;

    // The first reply: the fast one's, without waiting for the slow one.
    let report = within(
        WAIT,
        "first(1)",
        caller.multicast(
            vote(&ballot(&[], &["mc-d"]), long),
            &["mc-d", "mc-a"],
            Collect::First(1),
        ),
    )
    .await
    .expect("multicast");
    assert_eq!(
        labels(&report),
        [("mc-d", "not_awaited"), ("mc-a", "replied")]
    );
    assert!(report.met);
    assert!(
        report.elapsed < early,
        "returned early: {:?}",
        report.elapsed
    );
    assert_eq!(report.counts().not_awaited, 1);

    // A quorum of two of three, the third slow: met, the slow one not awaited.
    let report = within(
        WAIT,
        "quorum(2)",
        caller.multicast(
            vote(&ballot(&[], &["mc-d"]), long),
            &["mc-a", "mc-d", "mc-b"],
            Collect::Quorum(2),
        ),
    )
    .await
    .expect("multicast");
    assert_eq!(
        labels(&report),
        [
            ("mc-a", "replied"),
            ("mc-d", "not_awaited"),
            ("mc-b", "replied")
        ]
    );
    assert!(report.met);
    assert!(
        report.elapsed < early,
        "returned early: {:?}",
        report.elapsed
    );

    // A quorum of three of four with two refusals is out of reach: reported not met at once,
    // not at the deadline.
    let report = within(
        WAIT,
        "quorum(3)",
        caller.multicast(
            vote(&ballot(&["mc-b", "mc-c"], &["mc-d"]), long),
            &["mc-a", "mc-b", "mc-c", "mc-d"],
            Collect::Quorum(3),
        ),
    )
    .await
    .expect("multicast");
    assert!(!report.met);
    assert!(
        report.elapsed < early,
        "returned early: {:?}",
        report.elapsed
    );
    let outcomes = labels(&report);
    assert!(
        matches!(outcomes[0].1, "replied" | "not_awaited"),
        "{outcomes:?}"
    );
    assert_eq!(
        outcomes[1..],
        [
            ("mc-b", "refused"),
            ("mc-c", "refused"),
            ("mc-d", "not_awaited")
        ]
    );

    // The first two, when a refusal puts two out of reach: unlike a quorum it still collects
    // the others' replies, here until the deadline for the slow one.
    let short = Duration::from_millis(800);
    let report = within(
        WAIT,
        "first(2)",
        caller.multicast(
            vote(&ballot(&["mc-c"], &["mc-d"]), short),
            &["mc-a", "mc-c", "mc-d"],
            Collect::First(2),
        ),
    )
    .await
    .expect("multicast");
    assert_eq!(
        labels(&report),
        [("mc-a", "replied"), ("mc-c", "refused"), ("mc-d", "silent")]
    );
    assert!(!report.met);
    assert!(report.elapsed >= short - Duration::from_millis(50));
}

#[tokio::test]
async fn a_handler_multicasts_in_its_own_conversation() {
    let server = server();
    let fleet = fleet(&server).await;
    let lead = agent(&server, "mc-lead").await;
    lead.on_command("poll", |ctx: Context, (): ()| async move {
        let call = Call::multicast("vote").payload(&Ballot::default())?;
        let report = ctx.multicast(call, &["mc-a", "mc-b"], Collect::All).await?;
        Ok::<_, HandlerError>((report.multicast_id, report.counts().replied))
    })
    .await
    .expect("serve poll");
    let conversation = Uuid::now_v7();
    let (multicast_id, replied): (Uuid, usize) = within(
        WAIT,
        "poll",
        fleet.caller.call(
            Call::agent("mc-lead", "poll")
                .payload(&())
                .expect("payload")
                .id(conversation),
        ),
    )
    .await
    .expect("poll")
    .payload_as()
    .expect("decodes");
    assert_eq!((multicast_id, replied), (conversation, 2));
    let seen = fleet.seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|s| s.conversation == conversation));
}

#[tokio::test]
async fn bad_multicasts_are_refused_before_anything_is_sent() {
    let server = server();
    let fleet = fleet(&server).await;
    let call = || vote(&Ballot::default(), Duration::from_secs(2));
    let many: Vec<String> = (0..=MAX_MULTICAST_RECIPIENTS)
        .map(|i| format!("mc-{i}"))
        .collect();
    let empty: [&str; 0] = [];
    let cases: Vec<(Result<MulticastReport, SdkError>, &str)> = vec![
        (
            fleet.caller.multicast(call(), &empty, Collect::All).await,
            "no recipients",
        ),
        (
            fleet
                .caller
                .multicast(call(), &["mc-a", "mc-b", "mc-a"], Collect::All)
                .await,
            "recipient mc-a is listed twice",
        ),
        (
            fleet
                .caller
                .multicast(call(), &["mc-a", "mc b"], Collect::All)
                .await,
            "agent id",
        ),
        (
            fleet
                .caller
                .multicast(call(), &["mc-a"], Collect::First(0))
                .await,
            "n must be 1 to the number of recipients (1)",
        ),
        (
            fleet
                .caller
                .multicast(call(), &["mc-a", "mc-b"], Collect::Quorum(3))
                .await,
            "n must be 1 to the number of recipients (2)",
        ),
        (
            fleet.caller.multicast(call(), &many, Collect::All).await,
            "1001 recipients: at most 1000 are allowed",
        ),
        (
            fleet
                .caller
                .multicast(
                    Call::capability("mc.vote").payload(&()).expect("payload"),
                    &["mc-a"],
                    Collect::All,
                )
                .await,
            "by id",
        ),
    ];
    for (result, why) in cases {
        match result {
            Err(err @ SdkError::InvalidCall(_)) => {
                assert_eq!(err.status(), StatusCode::INVALID_ARGUMENT);
                assert!(err.to_string().contains(why), "{err} should say {why:?}");
            }
            other => panic!("expected a refusal saying {why:?}, got {other:?}"),
        }
    }
    // Nothing of those reached a voter: the next multicast's copies are the only ones seen.
    let report = within(
        WAIT,
        "multicast",
        fleet
            .caller
            .multicast(call(), &["mc-a", "mc-b"], Collect::All),
    )
    .await
    .expect("multicast");
    assert!(report.met);
    let seen = fleet.seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|s| s.conversation == report.multicast_id));
}
