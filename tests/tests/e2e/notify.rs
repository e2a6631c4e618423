//! Notifications (PROTOCOL.md section 7.14) through a real server: a push to one agent reaches
//! its `on_notification` handler with its payload, headers, priority, session and customer,
//! without any topic subscription, and nothing is ever answered; one to a group goes through
//! the coordinator to every live member, reported per recipient; a durable one sent while the
//! recipient is down reaches it once it starts, and a failing handler is retried then
//! dead-lettered; one that no handler takes is counted and dropped.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_broker_adapter::ErrorKind;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::{
    Context, DeliveryClass, Envelope, HandlerError, Kind, Notify, Outcome, Performative, Priority,
    RetryPolicies, RetryPolicy, StatusCode, Subjects,
};
use chorus_tests::{WAIT, agent, agent_options, coordinator, eventually, server, within};

/// What a handler saw of one notification.
#[derive(Debug, Clone)]
struct Seen {
    name: String,
    payload: String,
    from: String,
    kind: Kind,
    performative: Performative,
    priority: Priority,
    delivery: DeliveryClass,
    headers: BTreeMap<String, String>,
    session: Option<String>,
    customer: Option<String>,
    subject: String,
    attempt: u32,
    correlation: Option<uuid::Uuid>,
    hops: u8,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// A handler that notes every notification it takes (as a string payload).
fn recorder(
    log: &Log,
) -> impl Fn(Context, String) -> std::future::Ready<Result<(), HandlerError>> + Send + Sync + 'static
{
    let log = Arc::clone(log);
    move |ctx: Context, payload: String| {
        let env = ctx.message();
        log.lock().expect("lock").push(Seen {
            name: env.name.clone().unwrap_or_default(),
            payload,
            from: env.from.to_string(),
            kind: env.kind,
            performative: env.performative,
            priority: env.priority,
            delivery: env.delivery,
            headers: ctx.headers().clone(),
            session: env.session_id.clone(),
            customer: env.customer_id.clone(),
            subject: ctx.subject().to_owned(),
            attempt: ctx.attempt(),
            correlation: env.correlation_id,
            hops: env.hops,
        });
        std::future::ready(Ok(()))
    }
}

fn seen(log: &Log) -> Vec<Seen> {
    log.lock().expect("lock").clone()
}

/// Sends `env` as a raw request with a reply subject to `subject` and expects no answer within
/// half a second (the receiver is subscribed, so NATS does not answer "no responders" either).
async fn nothing_answers(server: &chorus_tests::NatsServer, subject: &str, env: &Envelope) {
    let raw = chorus_tests::raw_broker(server).await;
    let bytes = codec::encode(env, Encoding::MsgPack).expect("encodes");
    let answer = raw
        .request(subject, None, bytes, Duration::from_millis(500))
        .await;
    match answer {
        Err(e) if e.kind() == ErrorKind::TimedOut => {}
        Err(e) => panic!("expected silence on {subject}, got the error {e}"),
        Ok(reply) => panic!(
            "expected silence on {subject}, got an answer of {} bytes",
            reply.payload().len()
        ),
    }
}

#[tokio::test]
async fn a_notification_reaches_its_handler_without_a_topic_subscription_and_nothing_replies() {
    let server = server();
    let log: Log = Arc::default();
    // The receiver subscribes to no topic: only its own subjects.
    let bot = agent(&server, "ops-bot").await;
    bot.on_notification("disk-full", recorder(&log))
        .await
        .expect("register");
    let sender = agent(&server, "monitor").await;
    let report = within(
        WAIT,
        "notify",
        sender.notify(
            Notify::agent("ops-bot", "disk-full")
                .payload("db-2 at 91%")
                .expect("payload")
                .priority(Priority::High)
                .header("x-host", "db-2")
                .session("night-7")
                .customer("acme"),
        ),
    )
    .await
    .expect("sent");
    assert_eq!(report.recipients.len(), 1);
    let line = report.recipient("ops-bot").expect("its line");
    assert_eq!(line.outcome, Outcome::Delivered);
    assert_eq!(line.status, StatusCode::OK);
    assert_eq!(sender.stats().notifications_sent, 1);
    let got = eventually(WAIT, "the notification handled", || async {
        seen(&log).into_iter().next()
    })
    .await;
    assert_eq!(got.name, "disk-full");
    assert_eq!(got.payload, "db-2 at 91%");
    assert_eq!(got.from, "monitor");
    assert_eq!(got.kind, Kind::Notification);
    assert_eq!(got.performative, Performative::Inform);
    assert_eq!(got.priority, Priority::High);
    assert_eq!(got.delivery, DeliveryClass::AtMostOnce);
    assert_eq!(got.headers.get("x-host").map(String::as_str), Some("db-2"));
    assert_eq!(got.session.as_deref(), Some("night-7"));
    assert_eq!(got.customer.as_deref(), Some("acme"));
    assert_eq!(got.subject, "chorus.agent.ops-bot.$notify");
    assert_eq!(got.attempt, 1);
    // The sender sent a message and published nothing it waited on: no reply went out.
    assert_eq!(bot.stats().replies_sent, 0);

    // Even a notification sent as a request, with a reply subject, is never answered.
    let subject = Subjects::default()
        .notification("ops-bot")
        .expect("subject");
    let mut env = Envelope::new(Kind::Notification, Performative::Inform, "prober");
    env.to = vec!["ops-bot".into()];
    env.name = Some("disk-full".into());
    env.payload = codec::encode_payload(&"again", chorus_sdk::envelope::CONTENT_TYPE_MSGPACK)
        .expect("payload");
    nothing_answers(&server, &subject, &env).await;
    eventually(WAIT, "the second notification handled", || async {
        (seen(&log).len() == 2).then_some(())
    })
    .await;
    assert_eq!(bot.stats().replies_sent, 0);
    assert_eq!(bot.stats().notifications_received, 2);
    assert_eq!(bot.stats().notifications_unhandled, 0);

    // A bad name is refused before anything is sent.
    let bad = sender
        .notify(Notify::agent("ops-bot", "disk full"))
        .await
        .expect_err("a name with a space");
    assert_eq!(bad.status(), StatusCode::INVALID_ARGUMENT, "{bad}");
    bot.shutdown().await;
    sender.shutdown().await;
}

#[tokio::test]
async fn an_unhandled_notification_is_counted_and_dropped_and_nothing_is_answered() {
    let server = server();
    let log: Log = Arc::default();
    let bot = agent(&server, "ops-bot").await;
    bot.on_notification("disk-full", recorder(&log))
        .await
        .expect("register");
    let mut env = Envelope::new(Kind::Notification, Performative::Inform, "prober");
    env.to = vec!["ops-bot".into()];
    env.name = Some("cpu-hot".into());
    let subject = Subjects::default()
        .notification("ops-bot")
        .expect("subject");
    nothing_answers(&server, &subject, &env).await;
    eventually(WAIT, "the unhandled notification counted", || async {
        (bot.stats().notifications_unhandled == 1).then_some(())
    })
    .await;
    let stats = bot.stats();
    assert_eq!(stats.notifications_received, 1);
    assert_eq!(stats.replies_sent, 0);
    assert_eq!(
        stats.unknown_command, 0,
        "not refused as an unknown command"
    );
    assert!(
        seen(&log).is_empty(),
        "the disk-full handler did not take it"
    );

    // A handler for every other name takes what has no handler of its own.
    let any: Log = Arc::default();
    bot.on_notification("*", recorder(&any))
        .await
        .expect("register *");
    let sender = agent(&server, "monitor").await;
    sender
        .notify(
            Notify::agent("ops-bot", "cpu-hot")
                .payload("92 C")
                .expect("payload"),
        )
        .await
        .expect("sent");
    sender
        .notify(
            Notify::agent("ops-bot", "disk-full")
                .payload("db-3")
                .expect("payload"),
        )
        .await
        .expect("sent");
    eventually(WAIT, "both handled", || async {
        (seen(&any).len() == 1 && seen(&log).len() == 1).then_some(())
    })
    .await;
    assert_eq!(seen(&any)[0].name, "cpu-hot");
    assert_eq!(seen(&log)[0].payload, "db-3");
    assert_eq!(bot.stats().notifications_unhandled, 1);
    bot.shutdown().await;
    sender.shutdown().await;
}

#[tokio::test]
async fn a_group_notification_reaches_every_live_member_reported_per_recipient() {
    let server = server();
    let coordinator = coordinator(&server, false).await;
    let mut members = Vec::new();
    let mut logs = Vec::new();
    for id in ["night-1", "night-2", "night-3"] {
        let log: Log = Arc::default();
        let member = within(
            WAIT,
            "member connect",
            agent_options(&server, id)
                .group("night-shift")
                .durable_inbox(true)
                .connect(),
        )
        .await
        .expect("connect");
        member
            .on_notification("maintenance", recorder(&log))
            .await
            .expect("register");
        members.push(member);
        logs.push(log);
    }
    let outsider_log: Log = Arc::default();
    let outsider = agent(&server, "day-1").await;
    outsider
        .on_notification("*", recorder(&outsider_log))
        .await
        .expect("register");
    let sender = agent(&server, "planner").await;
    eventually(WAIT, "three members registered", || async {
        let n = sender
            .discover(&chorus_sdk::DiscoverQuery {
                group: Some("night-shift".into()),
                ..Default::default()
            })
            .await
            .map(|v| v.len())
            .unwrap_or(0);
        (n == 3).then_some(())
    })
    .await;
    let report = within(
        WAIT,
        "group notify",
        sender.notify(
            Notify::group("night-shift", "maintenance")
                .payload("22:00")
                .expect("payload")
                .header("window", "2h"),
        ),
    )
    .await
    .expect("report");
    let agents: Vec<&str> = report.recipients.iter().map(|r| r.agent.as_str()).collect();
    assert_eq!(agents, ["night-1", "night-2", "night-3"]);
    assert_eq!(report.count(Outcome::Delivered), 3, "{report:?}");
    for (log, id) in logs.iter().zip(["night-1", "night-2", "night-3"]) {
        let got = eventually(WAIT, "a member's notification", || async {
            seen(log).into_iter().next()
        })
        .await;
        assert_eq!(got.payload, "22:00", "{id}");
        assert_eq!(
            got.from, "coordinator",
            "{id}: copies come from the coordinator"
        );
        assert_eq!(
            got.headers.get("chorus-origin").map(String::as_str),
            Some("planner"),
            "{id}"
        );
        assert_eq!(got.headers.get("window").map(String::as_str), Some("2h"));
        assert_eq!(got.subject, format!("chorus.agent.{id}.$notify"));
    }

    // Durable: each member's copy is stored in its inbox, and reaches its handler.
    let report = within(
        WAIT,
        "durable group notify",
        sender.notify(
            Notify::group("night-shift", "maintenance")
                .payload("23:00")
                .expect("payload")
                .durable(),
        ),
    )
    .await
    .expect("report");
    assert_eq!(report.count(Outcome::Stored), 3, "{report:?}");
    for log in &logs {
        let got = eventually(WAIT, "a member's durable notification", || async {
            seen(log).into_iter().find(|s| s.payload == "23:00")
        })
        .await;
        assert_eq!(got.delivery, DeliveryClass::AtLeastOnce);
        assert!(got.subject.ends_with(".normal.$notify"), "{}", got.subject);
    }
    assert!(seen(&outsider_log).is_empty(), "not a member");
    assert_eq!(outsider.stats().notifications_received, 0);

    // From the command line: to the group, with its report, and to one agent.
    let (ok, out, err) = chorus_tests::run_chorus(
        &server,
        &[
            "notify",
            "maintenance",
            "\"24:00\"",
            "--group",
            "night-shift",
            "--json",
        ],
    )
    .await;
    assert!(ok, "{out}{err}");
    let report: chorus_sdk::NotifyReport = serde_json::from_str(out.trim()).expect("a report");
    assert_eq!(report.count(Outcome::Delivered), 3, "{report:?}");
    for log in &logs {
        eventually(WAIT, "a member's notification from the CLI", || async {
            seen(log).into_iter().find(|s| s.payload == "24:00")
        })
        .await;
    }
    let (ok, out, err) = chorus_tests::run_chorus(
        &server,
        &["notify", "shift-change", "\"now\"", "--to", "day-1"],
    )
    .await;
    assert!(ok, "{out}{err}");
    assert!(out.contains("day-1") && out.contains("delivered"), "{out}");
    let got = eventually(WAIT, "the outsider's notification from the CLI", || async {
        seen(&outsider_log).into_iter().next()
    })
    .await;
    assert_eq!(
        (got.payload.as_str(), got.subject.as_str()),
        ("now", "chorus.agent.day-1.$notify")
    );
    let (ok, _, err) = chorus_tests::run_chorus(&server, &["notify", "shift-change"]).await;
    assert!(!ok && err.contains("--to AGENT"), "no recipient: {err}");
    for member in members {
        member.shutdown().await;
    }
    outsider.shutdown().await;
    sender.shutdown().await;
    coordinator.shutdown().await;
}

#[tokio::test]
async fn a_durable_notification_sent_while_the_recipient_is_down_reaches_it_after_it_starts() {
    let server = server();
    let sender = agent(&server, "monitor").await;
    // Nobody is "pager" yet: stored in its inbox.
    let report = within(
        WAIT,
        "durable notify",
        sender.notify(
            Notify::agent("pager", "incident")
                .payload("db-2 down")
                .expect("payload")
                .priority(Priority::Critical)
                .header("severity", "1")
                .durable(),
        ),
    )
    .await
    .expect("stored");
    assert_eq!(
        report.recipient("pager").map(|r| r.outcome),
        Some(Outcome::Stored)
    );
    let failing = within(
        WAIT,
        "durable notify",
        sender.notify(
            Notify::agent("pager", "flaky")
                .payload("boom")
                .expect("payload")
                .durable(),
        ),
    )
    .await
    .expect("stored");
    assert_eq!(failing.count(Outcome::Stored), 1);

    let log: Log = Arc::default();
    let tries = Arc::new(Mutex::new(Vec::<u32>::new()));
    let pager = within(
        WAIT,
        "pager connect",
        agent_options(&server, "pager")
            .durable_inbox(true)
            .retry_policies(RetryPolicies {
                default: RetryPolicy {
                    max_attempts: 3,
                    initial_backoff_ms: 100,
                    multiplier: 1.0,
                    max_backoff_ms: 100,
                    jitter: 0.0,
                    ..RetryPolicy::default()
                },
                rules: Vec::new(),
            })
            .connect(),
    )
    .await
    .expect("connect");
    // One handler for both (the inbox starts with the first handler registered): it notes
    // an incident, and fails every attempt at the flaky one.
    let record = recorder(&log);
    let noted = Arc::clone(&tries);
    pager
        .on_notification("*", move |ctx: Context, payload: String| {
            if ctx.message().name.as_deref() == Some("flaky") {
                noted.lock().expect("lock").push(ctx.attempt());
                return std::future::ready(Err(HandlerError::new(
                    StatusCode::UNAVAILABLE,
                    "the pager service is down",
                )));
            }
            record(ctx, payload)
        })
        .await
        .expect("register");
    let got = eventually(WAIT, "the stored notification handled", || async {
        seen(&log).into_iter().next()
    })
    .await;
    assert_eq!(got.payload, "db-2 down");
    assert_eq!(got.priority, Priority::Critical);
    assert_eq!(got.delivery, DeliveryClass::AtLeastOnce);
    assert_eq!(got.headers.get("severity").map(String::as_str), Some("1"));
    assert_eq!(got.subject, "chorus.inbox.pager.high.$notify");
    // The failing handler: tried by the retry policy, then dead-lettered.
    eventually(WAIT, "the failing notification dead-lettered", || async {
        (pager.stats().dead_lettered == 1).then_some(())
    })
    .await;
    assert_eq!(*tries.lock().expect("lock"), [1, 2, 3]);
    assert_eq!(pager.stats().replies_sent, 0);
    pager.shutdown().await;
    sender.shutdown().await;
}

#[tokio::test]
async fn a_handler_notifies_as_part_of_its_conversation() {
    let server = server();
    let log: Log = Arc::default();
    let pager = agent(&server, "pager").await;
    pager
        .on_notification("page", recorder(&log))
        .await
        .expect("register");
    let watchdog = agent(&server, "watchdog").await;
    watchdog
        .on_command("alarm", |ctx: Context, what: String| async move {
            let report = ctx
                .notify(Notify::agent("pager", "page").payload(&format!("alarm: {what}"))?)
                .await?;
            Ok::<_, HandlerError>(report.count(Outcome::Delivered))
        })
        .await
        .expect("register");
    let operator = agent(&server, "operator").await;
    let call = chorus_sdk::Call::agent("watchdog", "alarm")
        .payload("disk")
        .expect("payload");
    let reply = within(WAIT, "alarm", operator.call(call))
        .await
        .expect("reply");
    assert_eq!(reply.payload_as::<usize>().expect("a count"), 1);
    let got = eventually(WAIT, "the page", || async { seen(&log).into_iter().next() }).await;
    assert_eq!(
        (got.payload.as_str(), got.from.as_str()),
        ("alarm: disk", "watchdog")
    );
    assert_eq!(got.kind, Kind::Notification);
    assert_eq!(
        got.correlation,
        Some(reply.envelope.correlation_id.unwrap_or(reply.envelope.id)),
        "the notification continues the alarm's conversation"
    );
    assert_eq!(got.hops, 1, "one hop more than the alarm");
    pager.shutdown().await;
    watchdog.shutdown().await;
    operator.shutdown().await;
}

/// PROTOCOL.md section 3.5: a `chorus-wire` notification from `coordinator` gives the agent
/// the heartbeat floor, as the announcement on `sys.wire` does, and no handler of its own sees
/// it; the same notification from anyone else is an ordinary one, and changes nothing.
#[tokio::test]
async fn a_wire_notification_from_the_coordinator_sets_the_heartbeat_floor_and_no_other_does() {
    use chorus_sdk::registry::{WIRE_NOTIFICATION, WireLevel};
    use futures::StreamExt;
    let server = server();
    let raw = chorus_tests::raw_broker(&server).await;
    let mut beats = raw
        .subscribe("chorus.sys.hb.floored")
        .await
        .expect("subscribe");
    raw.sync(WAIT).await.expect("sync");
    // No coordinator: nothing announces on `sys.wire`.
    let agent = agent_options(&server, "floored")
        .heartbeat_interval(Duration::from_millis(200))
        .connect()
        .await
        .expect("connect");
    let names: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let log = Arc::clone(&names);
    agent
        .on_notification("*", move |ctx: Context, _level: WireLevel| {
            let env = ctx.message();
            log.lock()
                .expect("lock")
                .push((env.from.to_string(), env.name.clone().unwrap_or_default()));
            std::future::ready(Ok::<_, HandlerError>(()))
        })
        .await
        .expect("register");
    let subject = Subjects::default()
        .notification("floored")
        .expect("subject");
    let tell = |from: &str, floor_ms: u64| {
        let mut env = Envelope::new(Kind::Notification, Performative::Inform, from);
        env.to = vec!["floored".into()];
        env.name = Some(WIRE_NOTIFICATION.into());
        env.payload = codec::encode_payload(
            &WireLevel {
                major: 2,
                heartbeat_ms: Some(floor_ms),
            },
            chorus_sdk::envelope::CONTENT_TYPE_MSGPACK,
        )
        .expect("payload");
        codec::encode(&env, Encoding::MsgPack).expect("encodes")
    };

    // From another agent: an ordinary notification, for its handler; the floor stays none.
    raw.publish(&subject, tell("mallory", 1_500))
        .await
        .expect("publish");
    eventually(WAIT, "the forged one handled as any other", || async {
        (!names.lock().expect("lock").is_empty()).then_some(())
    })
    .await;
    assert_eq!(
        *names.lock().expect("lock"),
        [("mallory".to_owned(), WIRE_NOTIFICATION.to_owned())]
    );
    assert_eq!(agent.manifest().heartbeat_ms, 200);

    // From the coordinator: the agent's next heartbeats keep the floor, and no handler sees it.
    raw.publish(&subject, tell("coordinator", 1_500))
        .await
        .expect("publish");
    let mut said = Vec::new();
    let mut at = None;
    let deadline = std::time::Instant::now() + WAIT;
    while said.len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no heartbeat kept the floor the coordinator told"
        );
        let msg = within(WAIT, "a heartbeat", beats.next())
            .await
            .expect("heartbeats");
        let (env, _) = codec::decode(msg.payload()).expect("an envelope");
        let manifest: chorus_sdk::registry::Manifest =
            codec::decode_payload(&env.payload, &env.content_type).expect("a manifest");
        if manifest.heartbeat_ms == 1_500 {
            if let Some(last) = at {
                let gap = std::time::Instant::now().duration_since(last);
                assert!(gap >= Duration::from_millis(1_400), "beat after {gap:?}");
            }
            at = Some(std::time::Instant::now());
            said.push(manifest.heartbeat_ms);
        } else {
            assert!(
                said.is_empty(),
                "a beat said {} after the floor",
                manifest.heartbeat_ms
            );
        }
    }
    assert_eq!(agent.manifest().heartbeat_ms, 1_500);
    assert_eq!(names.lock().expect("lock").len(), 1);
    assert_eq!(agent.stats().notifications_unhandled, 0);
}
