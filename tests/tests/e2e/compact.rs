//! The compact envelope (protocol 2) through a real server: agents that write it and agents
//! that write the named form (protocol 1) talk to each other, every exchange restores what
//! the subject carries, and what travels is the compact form without the subject's fields.

use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::security::{Identity, SignaturePolicy};
use chorus_sdk::{Call, Context, HandlerError};
use chorus_tests::{WAIT, agent_options, eventually, raw_broker, server, within};
use futures::StreamExt;
use tokio::sync::mpsc;

#[tokio::test]
async fn compact_and_named_agents_talk_through_the_bus() {
    let server = server();
    let client_key = Identity::generate();
    let client_public = client_key.public_key();
    // A worker that writes compact envelopes and checks signatures.
    let worker = agent_options(&server, "worker")
        .encoding(Encoding::Compact)
        .durable_inbox(true)
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..SignaturePolicy::default()
        })
        .trust("compact-client", client_public)
        .connect()
        .await
        .expect("worker");
    worker
        .on_command("add", |ctx: Context, n: Vec<i64>| async move {
            // The command's name and recipient came back from the subject.
            let m = ctx.message();
            assert_eq!(m.name.as_deref(), Some("add"));
            assert_eq!(m.to, ["worker"]);
            Ok::<_, HandlerError>(n.iter().sum::<i64>())
        })
        .await
        .expect("add");
    worker
        .on_capability("math.sum", |ctx: Context, n: Vec<i64>| async move {
            assert_eq!(ctx.message().capability.as_deref(), Some("math.sum"));
            Ok::<_, HandlerError>(n.iter().sum::<i64>())
        })
        .await
        .expect("capability");
    let (posted, mut posts) = mpsc::unbounded_channel();
    worker
        .on_command("post", move |_ctx: Context, entry: String| {
            let posted = posted.clone();
            async move {
                let _ = posted.send(entry);
                Ok::<_, HandlerError>(())
            }
        })
        .await
        .expect("post");
    let (seen, mut events) = mpsc::unbounded_channel();
    worker
        .on_event("doc.>", move |ctx: Context, name: String| {
            let seen = seen.clone();
            async move {
                let _ = seen.send((ctx.message().topic.clone(), name));
                Ok(())
            }
        })
        .await
        .expect("events");

    let compact_client = agent_options(&server, "compact-client")
        .encoding(Encoding::Compact)
        .identity(client_key)
        .connect()
        .await
        .expect("compact client");
    // A named-form (protocol 1) agent beside it: it reads compact replies, and is answered
    // in its own form.
    let named_client = agent_options(&server, "named-client")
        .connect()
        .await
        .expect("named client");

    // What travels on the event subjects, seen raw.
    let raw = raw_broker(&server).await;
    let mut wire = raw.subscribe("chorus.evt.>").await.expect("raw subscribe");
    raw.sync(WAIT).await.expect("sync");

    // Request to an agent, and to a capability, both ways.
    let sum: i64 = within(
        WAIT,
        "compact request",
        compact_client.request("worker", "add", &vec![2, 3]),
    )
    .await
    .expect("compact request");
    assert_eq!(sum, 5);
    let sum: i64 = within(
        WAIT,
        "capability request",
        compact_client.request_capability("math.sum", &vec![4, 5]),
    )
    .await
    .expect("capability request");
    assert_eq!(sum, 9);
    // The worker requires signatures: the named client is refused, in its own form.
    let refused = within(
        WAIT,
        "unsigned",
        named_client.request::<_, i64>("worker", "add", &vec![1]),
    )
    .await
    .expect_err("unsigned is refused");
    assert_eq!(
        refused.status(),
        chorus_sdk::StatusCode::UNAUTHORIZED,
        "{refused}"
    );

    // A durable command, stored compact and handled.
    within(
        WAIT,
        "durable send",
        compact_client.send_durable(
            Call::agent("worker", "post")
                .command()
                .payload(&"entry-1".to_owned())
                .expect("payload"),
        ),
    )
    .await
    .expect("stored");
    assert_eq!(
        within(WAIT, "durable handled", posts.recv())
            .await
            .as_deref(),
        Some("entry-1")
    );

    // Events: the topic is restored from the subject, and what travelled is compact without it.
    compact_client
        .publish("doc.ready.for-review", &"memo.png".to_owned())
        .await
        .expect("publish");
    let (topic, name) = within(WAIT, "event", events.recv()).await.expect("event");
    assert_eq!(topic.as_deref(), Some("doc.ready.for-review"));
    assert_eq!(name, "memo.png");
    let msg = within(WAIT, "raw event", wire.next())
        .await
        .expect("raw event");
    assert_eq!(Encoding::sniff(msg.payload()), Some(Encoding::Compact));
    assert!(
        !msg.payload().windows(10).any(|w| w == b"for-review"),
        "the topic travels only in the subject"
    );
    let (env, _) = codec::decode(msg.payload()).expect("decodes");
    assert!(env.seq.is_some() && env.trace.is_some() && env.topic.is_none());

    // A burst of compact events is counted without loss by a named-form subscriber.
    let mut stream = named_client.subscribe("burst.>").await.expect("subscribe");
    for i in 0..200u32 {
        compact_client
            .publish("burst.n", &i)
            .await
            .expect("publish");
    }
    let mut got = 0;
    while got < 200 {
        let event = within(WAIT, "burst", stream.next()).await.expect("event");
        assert_eq!(event.envelope.topic.as_deref(), Some("burst.n"));
        got += 1;
    }
    eventually(WAIT, "no loss counted", || async {
        (named_client.stats().lost == 0).then_some(())
    })
    .await;
    compact_client.shutdown().await;
    named_client.shutdown().await;
    worker.shutdown().await;
}

/// What each kind of message the SDK sends costs on the wire in each form, around a 128-byte
/// payload: the table in docs/PROTOCOL.md section 3.5 is this measurement.
#[tokio::test]
async fn envelope_sizes_per_kind_are_the_ones_the_spec_gives() {
    let server = server();
    let raw = raw_broker(&server).await;
    let mut rows: Vec<(String, usize, usize)> = Vec::new();
    // 128 bytes of MessagePack payload: a 126-character string (`str 8`).
    let payload = "x".repeat(126);
    for (column, encoding) in [(0, Encoding::MsgPack), (1, Encoding::Compact)] {
        let worker = agent_options(&server, "worker")
            .encoding(encoding)
            .durable_inbox(true)
            .connect()
            .await
            .expect("worker");
        worker
            .on_command("echo", |_ctx: Context, s: String| async move {
                Ok::<_, HandlerError>(s)
            })
            .await
            .expect("echo");
        worker
            .on_capability("text.echo", |_ctx: Context, s: String| async move {
                Ok::<_, HandlerError>(s)
            })
            .await
            .expect("capability");
        let client = agent_options(&server, "client")
            .encoding(encoding)
            .connect()
            .await
            .expect("client");
        let mut wire = raw.subscribe(">").await.expect("raw subscribe");
        raw.sync(WAIT).await.expect("sync");
        client
            .publish("doc.ready", &payload)
            .await
            .expect("publish");
        let _: String = within(WAIT, "request", client.request("worker", "echo", &payload))
            .await
            .expect("request");
        let _: String = within(
            WAIT,
            "capability",
            client.request_capability("text.echo", &payload),
        )
        .await
        .expect("capability");
        within(
            WAIT,
            "durable",
            client.send_durable(
                Call::agent("worker", "echo")
                    .command()
                    .payload(&payload)
                    .expect("payload"),
            ),
        )
        .await
        .expect("durable");
        // The first message seen of each kind, by its subject.
        let mut found: Vec<(String, usize)> = Vec::new();
        let wanted = [
            "event",
            "request to an agent",
            "response",
            "request to a capability",
            "durable command",
        ];
        while found.len() < wanted.len() {
            let msg = within(WAIT, "raw message", wire.next())
                .await
                .expect("message");
            let subject = msg.subject();
            let Ok((env, _)) = codec::decode(msg.payload()) else {
                continue;
            };
            if env.payload.len() != 128 {
                continue;
            }
            let what = if subject.starts_with("chorus.evt.") {
                "event"
            } else if subject.starts_with("chorus.agent.") {
                "request to an agent"
            } else if subject.starts_with("chorus.cap.") {
                "request to a capability"
            } else if subject.starts_with("chorus.inbox.") {
                "durable command"
            } else if subject.starts_with("_INBOX.") {
                "response"
            } else {
                continue;
            };
            if !found.iter().any(|(w, _)| w == what) {
                found.push((what.to_owned(), msg.payload().len() - 128));
            }
        }
        for what in wanted {
            let size = found
                .iter()
                .find(|(w, _)| w == what)
                .map(|(_, s)| *s)
                .expect("measured");
            match rows.iter_mut().find(|(w, _, _)| w == what) {
                Some(row) if column == 1 => row.2 = size,
                _ => rows.push((what.to_owned(), size, 0)),
            }
        }
        client.shutdown().await;
        worker.shutdown().await;
    }
    let table: Vec<String> = rows
        .iter()
        .map(|(what, named, compact)| format!("| {what} | {named} | {compact} |"))
        .collect();
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/PROTOCOL.md"))
        .expect("PROTOCOL.md");
    let start = doc.find("<!-- compact-sizes -->").expect("sizes marker");
    let documented: Vec<&str> = doc[start..]
        .lines()
        .skip(3)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(
        documented,
        table.iter().map(String::as_str).collect::<Vec<_>>(),
        "docs/PROTOCOL.md's size table; measured:\n{}",
        table.join("\n")
    );
    let event = rows.iter().find(|(w, _, _)| w == "event").expect("event");
    assert!(
        event.2 < 80,
        "an event's compact envelope: {} bytes",
        event.2
    );
}

/// Publishes a presence message for `agent` as a protocol-1 agent would: a manifest without
/// `wire_versions`, in the named form.
async fn old_agent_presence(raw: &chorus_broker_adapter::Broker, agent: &str, goodbye: bool) {
    use chorus_sdk::{Envelope, Kind, Performative, Subjects};
    let manifest = serde_json::json!({
        "agent": agent,
        "instance": "v1",
        "heartbeat_ms": 60_000,
        "started_ms": chorus_sdk::envelope::now_ms(),
    });
    let manifest: chorus_sdk::registry::Manifest =
        serde_json::from_value(manifest).expect("manifest");
    let subjects = Subjects::default();
    let (subject, performative) = if goodbye {
        (
            subjects.goodbye(agent).expect("subject"),
            Performative::Done,
        )
    } else {
        (
            subjects.heartbeat(agent).expect("subject"),
            Performative::Health,
        )
    };
    let mut env = Envelope::new(Kind::Heartbeat, performative, agent);
    env.payload = codec::encode_payload(&manifest, chorus_sdk::envelope::CONTENT_TYPE_MSGPACK)
        .expect("payload");
    raw.publish(
        &subject,
        codec::encode(&env, Encoding::MsgPack).expect("encode"),
    )
    .await
    .expect("publish");
}

/// The form events travel in now: publishes one and reads it off the wire.
async fn form_on_the_wire(
    publisher: &chorus_sdk::Agent,
    wire: &mut chorus_broker_adapter::Subscription,
) -> Encoding {
    publisher.publish("probe", &1u32).await.expect("publish");
    let msg = within(WAIT, "probe on the wire", wire.next())
        .await
        .expect("probe");
    Encoding::sniff(msg.payload()).expect("an envelope")
}

/// Publishes probes until they travel in `want`, within the test's deadline.
async fn until_form(
    publisher: &chorus_sdk::Agent,
    wire: &mut chorus_broker_adapter::Subscription,
    want: Encoding,
    what: &str,
) {
    let deadline = std::time::Instant::now() + WAIT;
    while form_on_the_wire(publisher, wire).await != want {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: events still not {want:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// An agent without an encoding of its own follows its bus: compact while every live agent
/// reads protocol 2 (the coordinator announces it), the named form as soon as one that reads
/// only 1 registers, and compact again once it leaves.
#[tokio::test]
async fn agents_write_what_every_live_agent_reads() {
    let server = server();
    let coordinator = chorus_tests::coordinator(&server, false).await;
    let publisher = chorus_tests::agent(&server, "publisher").await;
    let _listener = chorus_tests::agent(&server, "listener").await;
    let raw = raw_broker(&server).await;
    let mut wire = raw.subscribe("chorus.evt.probe").await.expect("subscribe");
    raw.sync(WAIT).await.expect("sync");

    until_form(&publisher, &mut wire, Encoding::Compact, "once announced").await;
    old_agent_presence(&raw, "old-agent", false).await;
    until_form(
        &publisher,
        &mut wire,
        Encoding::MsgPack,
        "a protocol-1 agent is live",
    )
    .await;
    old_agent_presence(&raw, "old-agent", true).await;
    until_form(&publisher, &mut wire, Encoding::Compact, "it left").await;
    coordinator.shutdown().await;
}
