//! Large payloads through a real nats-server: a 50 MiB payload by reference through the
//! payload bucket both ways, its digest checked; a compressible 512 KiB payload compressed for
//! a reader that reads zstd and plain for one that does not; a damaged or oversized payload
//! refused with 5006; payloads removed by the server once their messages expire.

use std::time::Duration;

use bytes::Bytes;
use chorus_sdk::codec;
use chorus_sdk::payload::{CONTENT_TYPE_OBJECT, ObjectRef, PayloadLimits};
use chorus_sdk::{
    BoxFuture, Call, Context, Envelope, Handler, HandlerError, Kind, Output, Performative,
    SdkError, StatusCode,
};
use chorus_tests::{WAIT, agent, agent_options, eventually, raw_broker, server, within};
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

/// Hands back what it was sent, and tells the test the size and digest it saw.
struct Echo(mpsc::UnboundedSender<(usize, String)>);

impl Handler for Echo {
    fn call(&self, ctx: Context) -> BoxFuture<Result<Output, HandlerError>> {
        let request = ctx.message();
        let _ = self
            .0
            .send((request.payload.len(), digest(&request.payload)));
        let output = Output {
            payload: request.payload.clone(),
            content_type: request.content_type.clone(),
        };
        Box::pin(async move { Ok(output) })
    }
}

fn digest(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// `len` bytes that do not compress.
fn noise(len: usize) -> Bytes {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    Bytes::from(out)
}

/// `len` bytes of repetitive JSON-like text, which compresses well.
fn text(len: usize) -> Bytes {
    let mut out = String::with_capacity(len + 64);
    let mut i = 0u64;
    while out.len() < len {
        out.push_str(&format!(
            "{{\"row\":{i},\"status\":\"ok\",\"note\":\"all quiet\"}}\n"
        ));
        i += 1;
    }
    out.truncate(len);
    Bytes::from(out)
}

/// What travelled on `subject`, as a tap on the server saw it: the wire size and envelope.
async fn tap(
    server: &chorus_tests::NatsServer,
    subject: &str,
) -> (
    chorus_broker_adapter::Broker,
    chorus_broker_adapter::Subscription,
) {
    let raw = raw_broker(server).await;
    let sub = raw.subscribe(subject).await.expect("tap");
    raw.flush().await.expect("flush");
    (raw, sub)
}

/// The next envelope the tap saw (an inbox also gets JetStream API answers: skipped).
async fn tapped(sub: &mut chorus_broker_adapter::Subscription) -> (usize, Envelope) {
    loop {
        let msg = within(WAIT, "a tapped message", sub.next())
            .await
            .expect("tap open");
        if let Ok((env, _)) = codec::decode(msg.payload()) {
            return (msg.payload().len(), env);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_50_mib_payload_round_trips_by_reference_with_its_digest_checked() {
    const SIZE: usize = 50 * 1024 * 1024;
    let server = server();
    let vault = agent(&server, "vault").await;
    let (seen, mut sightings) = mpsc::unbounded_channel();
    vault
        .handle_command("echo", Echo(seen))
        .await
        .expect("echo");
    let client = agent(&server, "client").await;
    let (_raw, mut wire) = tap(&server, "chorus.agent.vault.echo").await;

    let payload = noise(SIZE);
    let sent_digest = digest(&payload);
    let reply = within(
        Duration::from_secs(180),
        "the 50 MiB round trip",
        client.call(
            Call::agent("vault", "echo")
                .raw_payload(payload.clone(), "application/octet-stream")
                .timeout(Duration::from_secs(170)),
        ),
    )
    .await
    .expect("the echo answers");

    // The handler saw the payload whole; the caller got it back whole.
    let (len, handled_digest) = within(WAIT, "the handler's sighting", sightings.recv())
        .await
        .expect("seen");
    assert_eq!(len, SIZE);
    assert_eq!(handled_digest, sent_digest);
    assert_eq!(reply.payload().len(), SIZE);
    assert_eq!(digest(reply.payload()), sent_digest);
    assert_eq!(reply.envelope.content_type, "application/octet-stream");

    // What crossed the wire was a reference: small, naming the object and its digest.
    let (wire_size, env) = tapped(&mut wire).await;
    assert!(
        wire_size < 4096,
        "the request was {wire_size} bytes on the wire"
    );
    assert_eq!(env.content_type, CONTENT_TYPE_OBJECT);
    let reference: ObjectRef =
        codec::decode_payload(&env.payload, "application/msgpack").expect("a reference");
    assert_eq!(reference.size, SIZE as u64);
    assert_eq!(reference.sha256, sent_digest);
    assert_eq!(reference.content_type, "application/octet-stream");
    assert!(
        reference.expires_ms > env.timestamp_ms,
        "kept until the request expires"
    );
    assert_eq!(
        reference.name,
        format!("client.{}", env.id.hyphenated()),
        "named by its writer"
    );

    let (c, v) = (client.stats(), vault.stats());
    assert_eq!(
        (c.payloads_stored, c.payloads_fetched),
        (1, 1),
        "client: {c:?}"
    );
    assert_eq!(
        (v.payloads_stored, v.payloads_fetched),
        (1, 1),
        "vault: {v:?}"
    );
    client.shutdown().await;
    vault.shutdown().await;
}

/// `Agent::subscribe` hands out an event whose payload came by reference fetched, as a
/// handler gets it, with and without signature checks (the batched path); an event whose
/// object is gone is skipped, and the events after it still come, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_fetches_a_payload_by_reference() {
    use chorus_sdk::security::{Identity, SignaturePolicy};
    let server = server();
    let key = Identity::generate();
    let publisher = agent_options(&server, "publisher")
        .identity(Identity::from_seed(&key.seed().expect("seed")).expect("the same key"))
        .connect()
        .await
        .expect("publisher");
    let plain = agent(&server, "plain-reader").await;
    let verifying = agent_options(&server, "verifying-reader")
        .verify_signatures(SignaturePolicy::default())
        .trust("publisher", key.public_key())
        .connect()
        .await
        .expect("verifying reader");
    let mut streams = Vec::new();
    for reader in [&plain, &verifying] {
        streams.push(reader.subscribe("bulk.>").await.expect("subscribed"));
    }

    let large = noise(3 << 20);
    // A reference to an object that is not there, signed as the publisher.
    let mut forged = Envelope::new(Kind::Event, Performative::Inform, "publisher");
    forged.topic = Some("bulk.gone".into());
    forged.content_type = CONTENT_TYPE_OBJECT.into();
    forged.payload = codec::encode_payload(
        &ObjectRef {
            bucket: "chorus_payloads".into(),
            name: "never-stored".into(),
            size: 10,
            sha256: digest(b"0123456789"),
            content_type: "application/octet-stream".into(),
            expires_ms: u64::MAX,
        },
        "application/msgpack",
    )
    .expect("reference");
    key.sign("chorus.evt.bulk.gone", &mut forged);
    publisher
        .publish_raw("bulk.large", large.clone(), "application/octet-stream")
        .await
        .expect("a large event");
    let raw = raw_broker(&server).await;
    raw.publish(
        "chorus.evt.bulk.gone",
        codec::encode(&forged, codec::Encoding::MsgPack).expect("encodes"),
    )
    .await
    .expect("the forged event");
    raw.flush().await.expect("flush");
    publisher
        .publish_raw("bulk.small", Bytes::from_static(b"after"), "text/plain")
        .await
        .expect("a small event");

    for (reader, stream) in ["plain", "verifying"].into_iter().zip(&mut streams) {
        let first = within(WAIT, "the large event", stream.next())
            .await
            .expect("open");
        assert_eq!(first.topic(), "bulk.large", "{reader}");
        assert_eq!(first.envelope.content_type, "application/octet-stream");
        assert_eq!(first.envelope.payload.len(), large.len(), "{reader}");
        assert_eq!(digest(&first.envelope.payload), digest(&large), "{reader}");
        // The forged one is skipped: the next is the small one.
        let next = within(WAIT, "the event after", stream.next())
            .await
            .expect("open");
        assert_eq!(next.topic(), "bulk.small", "{reader}");
        assert_eq!(&next.envelope.payload[..], b"after");
    }
    assert_eq!(publisher.stats().payloads_stored, 1);
    assert_eq!(plain.stats().payloads_fetched, 1);
    assert_eq!(verifying.stats().payloads_fetched, 1);
    publisher.shutdown().await;
    plain.shutdown().await;
    verifying.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_missing_or_oversized_object_is_refused_with_5006() {
    let server = server();
    let (seen, mut sightings) = mpsc::unbounded_channel();
    // A reader that takes at most 1 MiB, by reference or not.
    let small = agent_options(&server, "small")
        .payload_limits(PayloadLimits::default().max_bytes(1024 * 1024))
        .connect()
        .await
        .expect("small");
    small
        .handle_command("echo", Echo(seen))
        .await
        .expect("echo");
    let client = agent(&server, "client").await;

    // 2 MiB goes by reference, and the reader refuses it before fetching.
    let err = within(
        WAIT,
        "an oversized payload",
        client.call(
            Call::agent("small", "echo").raw_payload(noise(2 << 20), "application/octet-stream"),
        ),
    )
    .await
    .expect_err("over the reader's limit");
    assert_eq!(err.status(), StatusCode::DATA_FORMAT, "{err}");
    assert!(err.to_string().contains("over this agent's limit"), "{err}");

    // A sender refuses what is over its own limit at once.
    let strict = agent_options(&server, "strict")
        .payload_limits(PayloadLimits::default().max_bytes(1024 * 1024))
        .connect()
        .await
        .expect("strict");
    let err = strict
        .call(Call::agent("small", "echo").raw_payload(noise(2 << 20), "application/octet-stream"))
        .await
        .expect_err("over the sender's limit");
    assert!(matches!(err, SdkError::Codec(_)), "{err}");
    assert_eq!(err.status(), StatusCode::DATA_FORMAT);

    // A reference whose payload does not match its digest, one whose payload is gone, one
    // whose parts stop short of its size, and one whose name reaches outside the bucket.
    let raw = raw_broker(&server).await;
    let js = raw.jetstream(WAIT);
    let parts = js
        .ensure_kv_exists(&chorus_sdk::payload::payload_bucket(
            &chorus_sdk::Subjects::default(),
            1,
        ))
        .await
        .expect("bucket");
    let stored = noise(4096);
    parts
        .put("forger.planted.0", stored.clone())
        .await
        .expect("planted");
    parts
        .put("forger.short.0", stored.slice(..1024))
        .await
        .expect("planted");
    for (name, sha256, why) in [
        ("forger.planted", digest(b"something else"), "SHA-256"),
        ("forger.absent", digest(&stored), "gone"),
        ("forger.short", digest(&stored), "gone"),
        ("forger.>", digest(&stored), "invalid name"),
    ] {
        let mut env = Envelope::new(Kind::Request, Performative::Request, "forger");
        env.to = vec!["small".into()];
        env.name = Some("echo".into());
        env.content_type = CONTENT_TYPE_OBJECT.into();
        env.payload = codec::encode_payload(
            &ObjectRef {
                bucket: "chorus_payloads".into(),
                name: name.into(),
                size: stored.len() as u64,
                sha256,
                content_type: "application/octet-stream".into(),
                expires_ms: u64::MAX,
            },
            "application/msgpack",
        )
        .expect("reference");
        let bytes = codec::encode(&env, codec::Encoding::MsgPack).expect("encodes");
        let answer = raw
            .request("chorus.agent.small.echo", None, bytes, WAIT)
            .await
            .expect("an answer");
        let (reply, _) = codec::decode(answer.payload()).expect("a reply");
        assert_eq!(reply.status, Some(StatusCode::DATA_FORMAT), "{name}");
        let reason = reply.reason.unwrap_or_default();
        assert!(reason.contains(why), "{name}: {reason}");
    }
    assert!(
        sightings.try_recv().is_err(),
        "no refused payload reached the handler"
    );
    client.shutdown().await;
    strict.shutdown().await;
    small.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressible_payload_is_compressed_for_a_reader_of_zstd_and_plain_for_another() {
    const SIZE: usize = 512 * 1024;
    let server = server();
    let coordinator = chorus_tests::coordinator(&server, false).await;
    let (seen, mut sightings) = mpsc::unbounded_channel();
    let modern = agent(&server, "modern").await;
    modern
        .handle_command("echo", Echo(seen.clone()))
        .await
        .expect("echo");
    let legacy = agent_options(&server, "legacy")
        .payload_limits(PayloadLimits::default().accept_compressed(false))
        .connect()
        .await
        .expect("legacy");
    legacy
        .handle_command("echo", Echo(seen))
        .await
        .expect("echo");
    let client = agent(&server, "client").await;
    // Both are in the registry, with what they read.
    eventually(WAIT, "both readers registered", || async {
        let records = client.discover(&Default::default()).await.ok()?;
        let reads = |id: &str| {
            records
                .iter()
                .find(|r| r.manifest.agent == id)
                .map(|r| r.manifest.reads_encoding("zstd"))
        };
        (reads("modern")? && !reads("legacy")? && reads("client")?).then_some(())
    })
    .await;
    let (_raw, mut wire) = tap(&server, "chorus.agent.*.echo").await;
    let (_raw_replies, mut replies) = tap(&server, "_INBOX.client.>").await;

    let payload = text(SIZE);
    let sent_digest = digest(&payload);
    for reader in ["modern", "legacy"] {
        let reply = within(
            WAIT,
            "an echo",
            client
                .call(Call::agent(reader, "echo").raw_payload(payload.clone(), "application/json")),
        )
        .await
        .unwrap_or_else(|e| panic!("{reader} answers: {e}"));
        // Each handler saw the payload as sent, and so did the caller in the reply.
        let (len, handled) = within(WAIT, "a sighting", sightings.recv())
            .await
            .expect("seen");
        assert_eq!(
            (len, handled.as_str()),
            (SIZE, sent_digest.as_str()),
            "{reader}"
        );
        assert_eq!(digest(reply.payload()), sent_digest, "{reader}'s reply");
        assert_eq!(
            reply.envelope.content_encoding, None,
            "opened for the caller"
        );

        let (wire_size, env) = tapped(&mut wire).await;
        assert_eq!(env.to, [reader]);
        if reader == "modern" {
            assert_eq!(env.content_encoding.as_deref(), Some("zstd"));
            assert!(
                wire_size < SIZE / 5,
                "compressed: {wire_size} bytes on the wire"
            );
        } else {
            assert_eq!(env.content_encoding, None);
            assert!(wire_size > SIZE, "plain: {wire_size} bytes on the wire");
        }
        // The reply went to the client, which reads zstd, compressed either way.
        let (reply_size, reply_env) = tapped(&mut replies).await;
        assert_eq!(
            reply_env.content_encoding.as_deref(),
            Some("zstd"),
            "{reader}'s reply"
        );
        assert!(
            reply_size < SIZE / 5,
            "{reader}'s reply: {reply_size} bytes"
        );
    }
    assert_eq!(modern.stats().payloads_decompressed, 1);
    assert_eq!(legacy.stats().payloads_decompressed, 0);
    assert_eq!(client.stats().payloads_decompressed, 2);
    client.shutdown().await;
    modern.shutdown().await;
    legacy.shutdown().await;
    coordinator.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_is_removed_by_the_server_once_its_message_has_expired() {
    let server = server();
    let config = chorus_coordinator::CoordinatorConfig {
        servers: server.url().to_owned(),
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        ..chorus_coordinator::CoordinatorConfig::default()
    };
    let coordinator = within(
        WAIT,
        "coordinator",
        chorus_coordinator::Coordinator::start(config, false),
    )
    .await
    .expect("coordinator");
    let (seen, mut sightings) = mpsc::unbounded_channel();
    let sink = agent(&server, "sink").await;
    sink.handle_command("echo", Echo(seen)).await.expect("echo");
    let client = agent_options(&server, "client")
        .payload_limits(PayloadLimits::default().keep_after_expiry(Duration::ZERO))
        .connect()
        .await
        .expect("client");
    let (_raw, mut wire) = tap(&server, "chorus.agent.sink.echo").await;
    within(
        WAIT,
        "the request",
        client.call(
            Call::agent("sink", "echo")
                .raw_payload(noise(2 << 20), "application/octet-stream")
                .timeout(Duration::from_secs(2)),
        ),
    )
    .await
    .expect("answered");
    within(WAIT, "a sighting", sightings.recv())
        .await
        .expect("seen");
    let (_, env) = tapped(&mut wire).await;
    let reference: ObjectRef =
        codec::decode_payload(&env.payload, "application/msgpack").expect("a reference");
    let raw = raw_broker(&server).await;
    let parts = raw
        .jetstream(WAIT)
        .open_kv(&reference.bucket)
        .await
        .expect("bucket");
    // Kept while the request could still be read (its 2 s time to live)...
    let first = format!("{}.0", reference.name);
    assert!(parts.get(&first).await.expect("read").is_some(), "stored");
    // ...and removed by the server (each part's own TTL) once it has expired: every part.
    eventually(WAIT, "the payload removed", || async {
        parts
            .entries_under(&reference.name)
            .await
            .ok()
            .filter(Vec::is_empty)
    })
    .await;
    client.shutdown().await;
    sink.shutdown().await;
    coordinator.shutdown().await;
}

/// On a server whose users are the entries `chorus creds` makes, with JetStream: bob may call
/// alice and nothing else of hers; his large payloads reach her by reference and compressed,
/// and hers come back, within what the generated permissions allow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_travel_under_generated_credentials() {
    use chorus_broker_adapter::{BrokerOptions, Credentials};
    use chorus_coordinator::creds::{Role, authorization_entry, coordinator_entry};
    use chorus_sdk::security::Identity;
    let subjects = chorus_sdk::Subjects::default();
    let (alice, bob, coordinator_key) = (
        Identity::generate(),
        Identity::generate(),
        Identity::generate(),
    );
    let entry = |agent: &str, calls: Vec<String>, key: &Identity| {
        authorization_entry(
            &subjects,
            &Role {
                agent: agent.into(),
                calls,
                ..Role::default()
            },
            &key.public_key(),
        )
        .expect("entry")
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let seed_file = dir.path().join("coordinator.nk");
    std::fs::write(&seed_file, coordinator_key.seed().expect("seed")).expect("seed file");
    let conf = dir.path().join("auth.conf");
    std::fs::write(
        &conf,
        format!(
            "listen: \"127.0.0.1:-1\"\njetstream {{ store_dir: \"{}\" }}\nauthorization {{\n  users = [\n{}\n{}\n{}\n  ]\n}}\n",
            dir.path().join("js").display(),
            entry("alice", vec!["agent:bob".into()], &alice),
            entry("bob", vec!["agent:alice".into()], &bob),
            coordinator_entry(&subjects, &coordinator_key.public_key()),
        ),
    )
    .expect("write");
    let server = chorus_tests::ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("server");
    let coordinator = within(
        WAIT,
        "coordinator",
        chorus_coordinator::Coordinator::start(
            chorus_coordinator::CoordinatorConfig {
                servers: server.url().to_owned(),
                metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                reap_interval_ms: 50,
                security: chorus_sdk::security::ConnectionSecurity {
                    nkey_seed_file: Some(seed_file),
                    ..Default::default()
                },
                ..chorus_coordinator::CoordinatorConfig::default()
            },
            false,
        ),
    )
    .await
    .expect("the coordinator connects with its key");
    let connect = |id: &'static str, key: &Identity| {
        agent_options(&server, id)
            .broker(
                BrokerOptions::new([server.url()])
                    .credentials(Credentials::NKeySeed(key.seed().expect("seed"))),
            )
            .connect()
    };
    let alice_agent = within(WAIT, "alice", connect("alice", &alice))
        .await
        .expect("alice connects");
    let (seen, mut sightings) = mpsc::unbounded_channel();
    alice_agent
        .handle_command("echo", Echo(seen))
        .await
        .expect("echo");
    let bob_agent = within(WAIT, "bob", connect("bob", &bob))
        .await
        .expect("bob connects");
    eventually(WAIT, "alice registered", || async {
        let records = bob_agent.discover(&Default::default()).await.ok()?;
        records
            .iter()
            .any(|r| r.manifest.agent == "alice")
            .then_some(())
    })
    .await;
    // The tap connects as the coordinator, which may read every subject.
    let raw = BrokerOptions::new([server.url()])
        .credentials(Credentials::NKeySeed(coordinator_key.seed().expect("seed")))
        .connect()
        .await
        .expect("tap connects");
    let mut wire = raw.subscribe("chorus.agent.alice.echo").await.expect("tap");
    raw.flush().await.expect("flush");
    for (payload, by_reference) in [(noise(2 << 20), true), (text(512 * 1024), false)] {
        let reply = within(
            WAIT,
            "an echo under credentials",
            bob_agent.call(
                Call::agent("alice", "echo").raw_payload(payload.clone(), "application/json"),
            ),
        )
        .await
        .expect("alice answers bob");
        assert_eq!(digest(reply.payload()), digest(&payload));
        let (len, handled) = within(WAIT, "a sighting", sightings.recv())
            .await
            .expect("seen");
        assert_eq!((len, handled), (payload.len(), digest(&payload)));
        let (_, env) = tapped(&mut wire).await;
        if by_reference {
            assert_eq!(env.content_type, CONTENT_TYPE_OBJECT);
        } else {
            assert_eq!(env.content_encoding.as_deref(), Some("zstd"));
        }
    }
    let stats = bob_agent.stats();
    assert_eq!((stats.payloads_stored, stats.payloads_fetched), (1, 1));
    bob_agent.shutdown().await;
    alice_agent.shutdown().await;
    coordinator.shutdown().await;
}
