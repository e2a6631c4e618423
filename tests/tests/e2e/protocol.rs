//! Protocol rules on the wire: loop protection, expiry, bad input, versions.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::envelope::now_ms;
use chorus_sdk::{Context, Envelope, HandlerError, Kind, Performative, SdkError, StatusCode};
use chorus_tests::{WAIT, agent, agent_options, raw_broker, server, within};

/// Sends raw bytes as a request and decodes the reply envelope.
async fn raw_request(
    broker: &chorus_broker_adapter::Broker,
    subject: &str,
    bytes: Bytes,
) -> Envelope {
    let msg = broker
        .request(subject, None, bytes, WAIT)
        .await
        .unwrap_or_else(|e| panic!("no reply on {subject}: {e}"));
    codec::decode(msg.payload())
        .expect("the reply is an envelope")
        .0
}

fn echo_request(from: &str) -> Envelope {
    let mut env = Envelope::new(Kind::Request, Performative::Request, from);
    env.to = vec!["echo".into()];
    env.name = Some("echo".into());
    env.payload = codec::encode_payload("hi", "application/msgpack").expect("payload");
    env
}

async fn echo_agent(server: &chorus_tests::NatsServer) -> (chorus_sdk::Agent, Arc<AtomicUsize>) {
    let echo = agent(server, "echo").await;
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    echo.on_command("echo", move |_ctx: Context, s: String| {
        counter.fetch_add(1, Ordering::SeqCst);
        async move { Ok::<_, HandlerError>(s) }
    })
    .await
    .expect("register");
    (echo, calls)
}

#[tokio::test]
async fn a_forwarding_loop_is_cut_at_the_hop_limit_with_the_loop_code() {
    let server = server();
    const LIMIT: u8 = 5;
    let hits = Arc::new(AtomicUsize::new(0));
    let mut agents = Vec::new();
    // ping forwards to pong, pong forwards to ping: a loop by construction.
    for (me, peer) in [("ping", "pong"), ("pong", "ping")] {
        let a = within(
            WAIT,
            "connect",
            agent_options(&server, me).hop_limit(LIMIT).connect(),
        )
        .await
        .expect("connect");
        let hits = Arc::clone(&hits);
        a.on_command("bounce", move |ctx: Context, n: u32| {
            let hits = Arc::clone(&hits);
            async move {
                hits.fetch_add(1, Ordering::SeqCst);
                let back: u32 = ctx.request(peer, "bounce", &(n + 1)).await?;
                Ok::<_, HandlerError>(back)
            }
        })
        .await
        .expect("register");
        agents.push(a);
    }
    let starter = agent(&server, "starter").await;
    let err = within(
        WAIT,
        "loop",
        starter.request::<_, u32>("ping", "bounce", &0u32),
    )
    .await
    .expect_err("the loop must be refused");
    assert_eq!(err.status(), StatusCode::LOOP_DETECTED, "{err}");
    // Hops 0..=LIMIT were handled; the forward that would be hop LIMIT+1 was refused.
    assert_eq!(hits.load(Ordering::SeqCst), usize::from(LIMIT) + 1);
    let refused: u64 = agents.iter().map(|a| a.stats().loop_refused).sum();
    assert_eq!(refused, 1);
}

#[tokio::test]
async fn a_received_message_past_its_hop_limit_is_refused_unhandled() {
    let server = server();
    let (echo, calls) = echo_agent(&server).await;
    let raw = raw_broker(&server).await;
    let subject = echo.subjects().command("echo", "echo").expect("subject");

    let mut env = echo_request("forger");
    env.hops = 9;
    env.hop_limit = 8;
    let reply = raw_request(
        &raw,
        &subject,
        codec::encode(&env, Encoding::MsgPack).expect("enc"),
    )
    .await;
    assert_eq!(reply.status, Some(StatusCode::LOOP_DETECTED));
    assert_eq!(reply.in_reply_to, Some(env.id));

    // A sender cannot lift the receiver's own limit (16) by claiming a higher one.
    env.hops = 17;
    env.hop_limit = 255;
    let reply = raw_request(
        &raw,
        &subject,
        codec::encode(&env, Encoding::MsgPack).expect("enc"),
    )
    .await;
    assert_eq!(reply.status, Some(StatusCode::LOOP_DETECTED));
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    env.hops = 3;
    let reply = raw_request(
        &raw,
        &subject,
        codec::encode(&env, Encoding::MsgPack).expect("enc"),
    )
    .await;
    assert_eq!(reply.status, Some(StatusCode::OK));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(echo.stats().loop_refused, 2);
}

#[tokio::test]
async fn expired_messages_are_not_handled() {
    let server = server();
    let (echo, calls) = echo_agent(&server).await;
    let raw = raw_broker(&server).await;
    let subject = echo.subjects().command("echo", "echo").expect("subject");

    let mut by_ttl = echo_request("late");
    by_ttl.timestamp_ms = now_ms() - 10_000;
    by_ttl.ttl_ms = Some(1_000);
    let mut by_deadline = echo_request("late");
    by_deadline.deadline_ms = Some(now_ms() - 1);
    for env in [by_ttl, by_deadline] {
        let reply = raw_request(
            &raw,
            &subject,
            codec::encode(&env, Encoding::Json).expect("enc"),
        )
        .await;
        assert_eq!(reply.status, Some(StatusCode::EXPIRED));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(echo.stats().expired, 2);

    let mut fresh = echo_request("on-time");
    fresh.ttl_ms = Some(60_000);
    let reply = raw_request(
        &raw,
        &subject,
        codec::encode(&fresh, Encoding::Json).expect("enc"),
    )
    .await;
    assert_eq!(reply.status, Some(StatusCode::OK));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_forward_inherits_the_deadline_and_is_not_sent_after_it() {
    let server = server();
    let slowpoke = agent(&server, "slowpoke").await;
    let downstream_calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&downstream_calls);
    let downstream = agent(&server, "downstream").await;
    downstream
        .on_command("work", move |_ctx: Context, (): ()| {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, HandlerError>(()) }
        })
        .await
        .expect("register");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    slowpoke
        .on_command("relay", move |ctx: Context, (): ()| {
            let tx = tx.clone();
            async move {
                // Outlive the caller's deadline, then try to forward.
                tokio::time::sleep(Duration::from_millis(400)).await;
                let result = ctx.request::<_, ()>("downstream", "work", &()).await;
                let _ = tx.send(result.map_err(|e| e.status()));
                Ok::<_, HandlerError>(())
            }
        })
        .await
        .expect("register");
    let caller = agent(&server, "caller").await;
    let err = caller
        .call(
            chorus_sdk::Call::agent("slowpoke", "relay")
                .payload(&())
                .expect("payload")
                .timeout(Duration::from_millis(200)),
        )
        .await
        .expect_err("caller times out");
    assert!(matches!(err, SdkError::Timeout(_)));
    let forwarded = within(WAIT, "relay outcome", rx.recv())
        .await
        .expect("outcome");
    assert_eq!(forwarded, Err(StatusCode::EXPIRED));
    assert_eq!(downstream_calls.load(Ordering::SeqCst), 0);
}

/// 1,000 malformed payloads of many shapes, each answered with 5006; then a good request.
#[tokio::test]
async fn a_thousand_malformed_payloads_are_each_answered_and_the_agent_keeps_serving() {
    let server = server();
    let echo = within(
        WAIT,
        "connect",
        agent_options(&server, "echo")
            .max_message_bytes(64 * 1024)
            .connect(),
    )
    .await
    .expect("connect");
    echo.on_command("echo", |_ctx: Context, s: String| async move {
        Ok::<_, HandlerError>(s)
    })
    .await
    .expect("register");
    let raw = raw_broker(&server).await;
    let subject = echo.subjects().command("echo", "echo").expect("subject");

    let good = codec::encode(&echo_request("tester"), Encoding::MsgPack).expect("enc");
    let good_json = codec::encode(&echo_request("tester"), Encoding::Json).expect("enc");
    let mut newer_major = echo_request("future");
    newer_major.version.major = 2;
    let newer_major = codec::encode(&newer_major, Encoding::MsgPack).expect("enc");

    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        // xorshift: deterministic, so a failure reproduces.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut payloads: Vec<Bytes> = Vec::with_capacity(1_000);
    for i in 0..1_000usize {
        let r = next();
        let bytes: Vec<u8> = match i % 8 {
            // Random bytes.
            0 => (0..(r % 200) as usize).map(|_| next() as u8).collect(),
            // A good envelope cut short.
            1 => good[..(r as usize % (good.len() - 1))].to_vec(),
            // A good envelope with one byte flipped into garbage in its header.
            2 => {
                let mut b = good.to_vec();
                b[0] = 0xc1; // never valid MessagePack
                b
            }
            // JSON that is not an envelope.
            3 => format!("{{\"version\":\"1.0\",\"id\":{r}}}").into_bytes(),
            // JSON envelope truncated.
            4 => good_json[..(r as usize % (good_json.len() - 1))].to_vec(),
            // An unknown major version.
            5 => newer_major.to_vec(),
            // Oversized for this agent (64 KiB limit).
            6 => vec![b'{'; 64 * 1024 + 1 + (r % 1000) as usize],
            // An envelope whose kind is one this version does not know.
            _ => {
                let mut v = serde_json::to_value(echo_request("odd")).expect("value");
                v["kind"] = "telepathy".into();
                serde_json::to_vec(&v).expect("json")
            }
        };
        payloads.push(Bytes::from(bytes));
    }
    // A few of the random ones might be empty: still malformed, still answered.
    let mut answered = 0;
    for (i, bytes) in payloads.into_iter().enumerate() {
        let reply = raw_request(&raw, &subject, bytes).await;
        assert_eq!(reply.status, Some(StatusCode::DATA_FORMAT), "payload #{i}");
        assert!(reply.reason.as_deref().is_some_and(|r| !r.is_empty()));
        answered += 1;
    }
    assert_eq!(answered, 1_000);
    assert_eq!(echo.stats().bad_input, 1_000);

    let reply = raw_request(&raw, &subject, good).await;
    assert_eq!(reply.status, Some(StatusCode::OK));
    let echoed: String = codec::decode_payload(&reply.payload, &reply.content_type).expect("str");
    assert_eq!(echoed, "hi");
}

#[tokio::test]
async fn an_unknown_major_version_is_refused_with_a_reason_naming_it() {
    let server = server();
    let (echo, _) = echo_agent(&server).await;
    let raw = raw_broker(&server).await;
    let subject = echo.subjects().command("echo", "echo").expect("subject");
    let future = serde_json::json!({"version": "2.0", "something": "else entirely"});
    let reply = raw_request(
        &raw,
        &subject,
        Bytes::from(serde_json::to_vec(&future).expect("json")),
    )
    .await;
    assert_eq!(reply.status, Some(StatusCode::DATA_FORMAT));
    let reason = reply.reason.unwrap_or_default();
    assert!(reason.contains("2.0"), "{reason}");
}

#[tokio::test]
async fn a_json_request_that_does_not_decode_is_refused_in_json() {
    let server = server();
    let (echo, calls) = echo_agent(&server).await;
    let raw = raw_broker(&server).await;
    let subject = echo.subjects().command("echo", "echo").expect("subject");
    // An unknown major, and JSON broken halfway: both start like JSON, so both are answered in
    // JSON, which a JSON-only client can read.
    for bytes in [
        &br#"{"version":"9.0"}"#[..],
        &br#"{"version":"1.0","id":"#[..],
    ] {
        let msg = within(
            WAIT,
            "refusal",
            raw.request(&subject, None, Bytes::copy_from_slice(bytes), WAIT),
        )
        .await
        .expect("a reply");
        let reply: serde_json::Value =
            serde_json::from_slice(msg.payload()).expect("the refusal is JSON");
        assert_eq!(reply["status"], 5006, "{reply}");
        assert!(
            reply["reason"].as_str().is_some_and(|r| !r.is_empty()),
            "{reply}"
        );
    }
    // Bytes that say nothing of their encoding get the agent's own (MessagePack).
    let garbage = raw_request(&raw, &subject, Bytes::from_static(b"\x00garbage")).await;
    assert_eq!(garbage.status, Some(StatusCode::DATA_FORMAT));
    assert_eq!(calls.load(Ordering::SeqCst), 0, "no handler ran");
}

#[tokio::test]
async fn a_message_at_the_default_hop_limit_is_handled_and_one_past_it_refused() {
    let server = server();
    let (echo, calls) = echo_agent(&server).await;
    let raw = raw_broker(&server).await;
    let subject = echo.subjects().command("echo", "echo").expect("subject");
    let mut env = echo_request("relay");
    assert_eq!(env.hop_limit, 16, "the default hop limit");
    env.hops = 16;
    let at_limit = raw_request(
        &raw,
        &subject,
        codec::encode(&env, Encoding::Json).expect("enc"),
    )
    .await;
    assert_eq!(
        at_limit.status,
        Some(StatusCode::OK),
        "{:?}",
        at_limit.reason
    );
    env.id = uuid::Uuid::now_v7();
    env.hops = 17;
    let past = raw_request(
        &raw,
        &subject,
        codec::encode(&env, Encoding::Json).expect("enc"),
    )
    .await;
    assert_eq!(past.status, Some(StatusCode::LOOP_DETECTED));
    assert_eq!(
        past.reason.as_deref(),
        Some("hop 17 is past the limit of 16")
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A response that carries no `status` is a success (5002): the SDK's request returns its
/// payload and `Reply::status` reads 5002.
#[tokio::test]
async fn a_response_without_a_status_reads_as_success() {
    use futures::StreamExt;
    let server = server();
    let raw = raw_broker(&server).await;
    let me = agent(&server, "caller").await;
    let subject = me.subjects().command("bare", "hello").expect("subject");
    let mut sub = raw.subscribe(&subject).await.expect("subscribe");
    raw.sync(WAIT).await.expect("the subscription is in place");
    let responder = tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            let (request, encoding) = codec::decode(msg.payload()).expect("an envelope");
            let mut reply = request.reply("bare", StatusCode::OK);
            reply.status = None;
            reply.payload = codec::encode_payload("hello back", &reply.content_type).expect("p");
            raw.publish(msg.reply().expect("a reply subject"), {
                codec::encode(&reply, encoding).expect("encode")
            })
            .await
            .expect("publish");
        }
    });
    let answer: String = within(WAIT, "request", me.request("bare", "hello", &"hi"))
        .await
        .expect("no status is a success");
    assert_eq!(answer, "hello back");
    let reply = within(
        WAIT,
        "call",
        me.call(
            chorus_sdk::Call::agent("bare", "hello")
                .payload(&"hi")
                .expect("payload"),
        ),
    )
    .await
    .expect("no status is a success");
    assert_eq!(reply.envelope.status, None);
    assert_eq!(reply.status(), StatusCode::OK);
    responder.abort();
}

/// The kind is not matched against the subject: an `event` (or any known kind) sent as a
/// request to a command subject runs the command's handler and is answered like a request;
/// only an unknown kind is refused (5006).
#[tokio::test]
async fn a_known_kind_on_a_command_subject_is_handled_whatever_it_is() {
    let server = server();
    let (echo, calls) = echo_agent(&server).await;
    let raw = raw_broker(&server).await;
    let subject = echo.subjects().command("echo", "echo").expect("subject");
    for kind in [Kind::Event, Kind::Response, Kind::Heartbeat, Kind::Error] {
        let mut env = echo_request("odd");
        env.kind = kind;
        let reply = raw_request(
            &raw,
            &subject,
            codec::encode(&env, Encoding::MsgPack).expect("enc"),
        )
        .await;
        assert_eq!(reply.status, Some(StatusCode::OK), "{kind}");
        assert_eq!(reply.kind, Kind::Response);
        assert_eq!(reply.performative, Performative::Inform);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

/// The heartbeat manifest has the fields, types and formats of the table in section 7.7, and
/// the `$SRV` answers name the agent as section 2 says: `name` the agent id, `id` the
/// manifest's `instance`, `version` the SDK version.
#[tokio::test]
async fn the_heartbeat_manifest_and_the_srv_answers_are_as_documented() {
    use futures::StreamExt;
    let server = server();
    let raw = raw_broker(&server).await;
    let hb = chorus_sdk::Subjects::new("chorus")
        .expect("root")
        .heartbeat("beater")
        .expect("subject");
    let mut sub = raw.subscribe(&hb).await.expect("subscribe");
    raw.sync(WAIT).await.expect("the subscription is in place");
    let beater = within(
        WAIT,
        "connect",
        agent_options(&server, "beater")
            .heartbeat_interval(Duration::from_millis(200))
            .connect(),
    )
    .await
    .expect("connect");
    beater
        .on_command("work", |_ctx: Context, (): ()| async move {
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("register");
    let msg = within(WAIT, "heartbeat", sub.next())
        .await
        .expect("a heartbeat");
    let (env, _) = codec::decode(msg.payload()).expect("an envelope");
    assert_eq!(
        (env.kind, env.performative),
        (Kind::Heartbeat, Performative::Health)
    );
    assert_eq!(env.from, "beater");
    assert_eq!(env.content_type, "application/msgpack");
    let manifest: serde_json::Value =
        rmp_serde::from_slice(&env.payload).expect("a MessagePack map");
    let manifest = manifest.as_object().expect("a map").clone();

    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/PROTOCOL.md"),
    )
    .expect("docs/PROTOCOL.md");
    let start = doc
        .lines()
        .position(|l| l.trim() == "<!-- manifest-fields -->")
        .expect("the manifest table");
    let rows: Vec<Vec<String>> = doc
        .lines()
        .skip(start + 1)
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().trim_matches('`').to_owned())
                .collect()
        })
        .skip(2)
        .collect();
    assert!(rows.len() >= 14, "{rows:?}");
    for key in manifest.keys() {
        assert!(
            rows.iter().any(|r| &r[0] == key),
            "{key} is not in the table"
        );
    }
    for row in &rows {
        let (name, ty, written) = (&row[0], &row[1], &row[2]);
        let Some(value) = manifest.get(name) else {
            assert!(
                written.starts_with("omitted"),
                "{name} is always written but missing"
            );
            continue;
        };
        let ok = match ty.as_str() {
            "string" => value.is_string(),
            "integer" => value.is_u64(),
            "float 32" => value.is_f64(),
            "enum" => value.is_string(),
            t if t.starts_with("array") => value.is_array(),
            t if t.starts_with("map") => value.is_object(),
            t => panic!("unknown type {t} in the manifest table"),
        };
        assert!(ok, "{name}: {value} is not a {ty}");
    }
    // Written by this agent, with no signing or encryption keys.
    for always in [
        "agent",
        "instance",
        "capabilities",
        "commands",
        "groups",
        "content_types",
        "load",
        "availability",
        "heartbeat_ms",
        "started_ms",
        "sdk_version",
    ] {
        assert!(manifest.contains_key(always), "{always}");
    }
    let instance = manifest["instance"].as_str().expect("instance");
    assert!(
        instance.len() == 32
            && instance
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)),
        "{instance}"
    );
    assert_eq!(manifest["agent"], "beater");
    assert_eq!(manifest["heartbeat_ms"], 200);
    assert_eq!(manifest["availability"], "available");
    assert_eq!(
        manifest["content_types"],
        serde_json::json!(["application/msgpack", "application/json"])
    );
    // The load is a 32-bit float in the MessagePack.
    let key = [&[0xa4][..], b"load", &[0xca]].concat();
    assert!(
        env.payload.windows(key.len()).any(|w| w == key),
        "load as float 32"
    );

    for verb in ["PING", "INFO", "STATS"] {
        for subject in [
            format!("$SRV.{verb}.beater"),
            format!("$SRV.{verb}.beater.{instance}"),
        ] {
            let answer = within(WAIT, "srv", raw.request(&subject, None, Bytes::new(), WAIT))
                .await
                .expect("an answer");
            let answer: serde_json::Value = serde_json::from_slice(answer.payload()).expect("json");
            assert_eq!(answer["name"], "beater", "{subject}");
            assert_eq!(answer["id"], instance, "{subject}");
            assert_eq!(answer["version"], manifest["sdk_version"], "{subject}");
            assert_eq!(answer["metadata"]["chorus.root"], "chorus");
        }
    }
    drop(beater);
}
