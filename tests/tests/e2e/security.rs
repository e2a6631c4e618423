//! Signed envelopes against a real server: a correct signature passes; a forged one, an
//! impersonation, a replay, a stale timestamp and an unsigned message are each refused with
//! their code. Keys come from explicit trust or from the registry. And a 100,000-case
//! property run of the decoder and the signature check finds no panic.

use agent_sdk::codec::{self, Encoding};
use agent_sdk::security::{Identity, SignaturePolicy, Verifier};
use agent_sdk::{Context, Envelope, HandlerError, Kind, Performative, StatusCode};
use bytes::Bytes;
use chorus_tests::{WAIT, agent_options, coordinator, eventually, raw_broker, server, within};

fn pay(from: &str, cents: u32) -> Envelope {
    let mut env = Envelope::new(Kind::Request, Performative::Request, from);
    env.to = vec!["bank".into()];
    env.name = Some("pay".into());
    env.payload = codec::encode_payload(&cents, "application/msgpack").expect("payload");
    env
}

async fn ask(raw: &broker_adapter::Broker, subject: &str, env: &Envelope) -> Envelope {
    let msg = raw
        .request(
            subject,
            None,
            codec::encode(env, Encoding::MsgPack).expect("enc"),
            WAIT,
        )
        .await
        .expect("a reply");
    codec::decode(msg.payload()).expect("reply envelope").0
}

#[tokio::test]
async fn signatures_are_checked_and_each_attack_is_refused_with_its_code() {
    let server = server();
    let alice = Identity::generate();
    let carol = Identity::generate();
    let alice_public = alice.public_key();
    let bank = agent_options(&server, "bank")
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..SignaturePolicy::default()
        })
        .trust("alice", alice.public_key())
        .trust("carol", carol.public_key())
        .connect()
        .await
        .expect("bank");
    bank.on_command("pay", |ctx: Context, cents: u32| async move {
        Ok::<_, HandlerError>(format!("{} paid {cents}", ctx.from()))
    })
    .await
    .expect("register");

    // Through the SDK: alice signs everything she sends.
    let alice_agent = agent_options(&server, "alice")
        .identity(Identity::from_seed(&alice.seed().expect("seed")).expect("identity"))
        .connect()
        .await
        .expect("alice");
    let ok: String = alice_agent
        .request("bank", "pay", &10u32)
        .await
        .expect("signed request passes");
    assert_eq!(ok, "alice paid 10");
    assert_eq!(
        alice_agent.manifest().public_key.as_deref(),
        Some(alice_public.as_str())
    );

    let raw = raw_broker(&server).await;
    let subject = bank.subjects().command("bank", "pay").expect("subject");

    // A correct one, then the same bytes again: a replay.
    let mut good = pay("alice", 20);
    alice.sign(&subject, &mut good);
    assert_eq!(
        ask(&raw, &subject, &good).await.status,
        Some(StatusCode::OK)
    );
    let replay = ask(&raw, &subject, &good).await;
    assert_eq!(
        replay.status,
        Some(StatusCode::REPLAY),
        "{:?}",
        replay.reason
    );

    // Forged: signed, then the payload changed.
    let mut forged = pay("alice", 30);
    alice.sign(&subject, &mut forged);
    forged.payload = codec::encode_payload(&30_000u32, "application/msgpack").expect("payload");
    let r = ask(&raw, &subject, &forged).await;
    assert_eq!(r.status, Some(StatusCode::IDENTITY), "{:?}", r.reason);

    // Impersonation: the sender field names carol, the signature is alice's.
    let mut impostor = pay("carol", 40);
    alice.sign(&subject, &mut impostor);
    let r = ask(&raw, &subject, &impostor).await;
    assert_eq!(r.status, Some(StatusCode::IDENTITY), "{:?}", r.reason);

    // Stale: a correct signature on a timestamp ten minutes old.
    let mut stale = pay("alice", 50);
    stale.timestamp_ms -= 600_000;
    alice.sign(&subject, &mut stale);
    let r = ask(&raw, &subject, &stale).await;
    assert_eq!(r.status, Some(StatusCode::REPLAY), "{:?}", r.reason);
    assert!(r.reason.unwrap_or_default().contains("tolerance"));

    // Unsigned, where signatures are required.
    let r = ask(&raw, &subject, &pay("alice", 60)).await;
    assert_eq!(r.status, Some(StatusCode::UNAUTHORIZED), "{:?}", r.reason);

    assert_eq!(bank.stats().security_refused, 5);
}

#[tokio::test]
async fn receivers_learn_senders_keys_from_the_registry() {
    let server = server();
    let coordinator = coordinator(&server, false).await;
    let bank = agent_options(&server, "bank")
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..SignaturePolicy::default()
        })
        .connect()
        .await
        .expect("bank");
    bank.on_command("pay", |_ctx: Context, cents: u32| async move {
        Ok::<_, HandlerError>(cents)
    })
    .await
    .expect("register");
    let dave = agent_options(&server, "dave")
        .identity(Identity::generate())
        .connect()
        .await
        .expect("dave");
    // Dave's first heartbeat registers his public key; the bank picks it up from the registry.
    let paid = eventually(WAIT, "dave's key known to the bank", || {
        let dave = dave.clone();
        async move { dave.request::<_, u32>("bank", "pay", &7u32).await.ok() }
    })
    .await;
    assert_eq!(paid, 7);
    coordinator.shutdown().await;
}

#[test]
fn a_hundred_thousand_hostile_inputs_never_panic_the_decoder_or_the_signature_check() {
    let alice = Identity::generate();
    let verifier = Verifier::new(SignaturePolicy::default());
    verifier.trust("alice", &alice.public_key());
    let subject = "chorus.agent.bank.pay";
    let mut original = pay("alice", 99);
    original.trace = Some(agent_sdk::envelope::TraceContext {
        traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        tracestate: None,
    });
    alice.sign(subject, &mut original);
    let seeds = [
        codec::encode(&original, Encoding::MsgPack)
            .expect("enc")
            .to_vec(),
        codec::encode(&original, Encoding::Json)
            .expect("enc")
            .to_vec(),
    ];
    let mut state: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    const CASES: usize = 100_000;
    let (mut decoded, mut verified) = (0usize, 0usize);
    for case in 0..CASES {
        let mut bytes = seeds[case % 2].clone();
        match next() % 5 {
            // Flip 1 to 4 random bytes.
            0 | 1 => {
                for _ in 0..=(next() % 4) {
                    let i = (next() as usize) % bytes.len();
                    bytes[i] ^= (next() as u8) | 1;
                }
            }
            // Cut it short.
            2 => bytes.truncate((next() as usize) % bytes.len()),
            // Insert random bytes somewhere.
            3 => {
                let at = (next() as usize) % bytes.len();
                let extra: Vec<u8> = (0..(next() % 16)).map(|_| next() as u8).collect();
                bytes.splice(at..at, extra);
            }
            // Pure noise.
            _ => bytes = (0..(next() % 300)).map(|_| next() as u8).collect(),
        }
        let Ok((env, _)) = codec::decode(&bytes) else {
            continue;
        };
        decoded += 1;
        if verifier.verify(subject, &env, env.timestamp_ms).is_ok() && env.signature.is_some() {
            verified += 1;
            // Whatever verified must not have changed what the signature covers.
            assert_eq!(
                (env.id, env.timestamp_ms, env.from.as_str(), &env.payload),
                (
                    original.id,
                    original.timestamp_ms,
                    "alice",
                    &original.payload
                ),
                "case {case}: a changed message verified"
            );
        }
    }
    println!(
        "hostile input: {CASES} cases, {decoded} still decoded, {verified} verified (only with the signed fields intact), no panic"
    );
    let _ = Bytes::new();
}

#[tokio::test]
async fn handlers_refuse_senders_without_the_required_permission_and_over_their_rate() {
    let server = server();
    let vault = agent_options(&server, "vault")
        .grant("admin", ["secrets:read"])
        .rate_limit(agent_sdk::RateLimit {
            per_second: 1.0,
            burst: 3.0,
        })
        .connect()
        .await
        .expect("vault");
    vault
        .on_command("read", |_ctx: Context, key: String| async move {
            Ok::<_, HandlerError>(format!("value of {key}"))
        })
        .await
        .expect("register");
    vault.require("read", &["secrets:read"]).expect("require");
    vault
        .on_command("ping", |_ctx: Context, (): ()| async {
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("register");

    let admin = agent_options(&server, "admin")
        .connect()
        .await
        .expect("admin");
    let intern = agent_options(&server, "intern")
        .connect()
        .await
        .expect("intern");
    let ok: String = admin.request("vault", "read", "db").await.expect("granted");
    assert_eq!(ok, "value of db");
    let err = intern
        .request::<_, String>("vault", "read", "db")
        .await
        .expect_err("not granted");
    assert_eq!(err.status(), StatusCode::ACCESS);
    assert!(err.to_string().contains("secrets:read"), "{err}");
    assert_eq!(vault.stats().access_refused, 1);

    // The intern may ping, three at once, then about one a second.
    let mut outcomes = Vec::new();
    for _ in 0..5 {
        outcomes.push(
            intern
                .request::<_, ()>("vault", "ping", &())
                .await
                .map_err(|e| e.status()),
        );
    }
    assert_eq!(&outcomes[..3], &[Ok(()), Ok(()), Ok(())]);
    assert!(
        outcomes[3..]
            .iter()
            .all(|o| *o == Err(StatusCode::RATE_LIMITED)),
        "{outcomes:?}"
    );
    assert!(vault.stats().rate_limited >= 2);
    // Other senders have their own budget.
    admin
        .request::<_, ()>("vault", "ping", &())
        .await
        .expect("admin's own bucket");
}

#[tokio::test]
async fn the_servers_connection_limit_is_reported_with_the_connection_limit_code() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("limit.conf");
    std::fs::write(&conf, "listen: \"127.0.0.1:-1\"\nmax_connections: 2\n").expect("write");
    let server = chorus_tests::ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("server");
    let first = agent_options(&server, "first")
        .connect()
        .await
        .expect("first fits");
    let second = agent_options(&server, "second")
        .connect()
        .await
        .expect("second fits");
    let err = agent_options(&server, "third")
        .connect()
        .await
        .expect_err("third is over the limit");
    assert_eq!(err.status(), StatusCode::CONNECTION_LIMIT, "{err}");
    drop((first, second));
}

/// A server whose users are the entries `chorus creds` makes: alice may call only the
/// `nlp.analyze` capability; bob may call alice.
#[tokio::test]
async fn per_agent_credentials_confine_each_agent_to_its_own_subjects() {
    use broker_adapter::{BrokerOptions, ConnectionEvent, Credentials, ErrorKind};
    use chorus::creds::{Role, authorization_entry};
    let subjects = agent_sdk::Subjects::default();
    let alice = Identity::generate();
    let bob = Identity::generate();
    let alice_entry = authorization_entry(
        &subjects,
        &Role {
            agent: "alice".into(),
            calls: vec!["cap:nlp.analyze".into()],
            ..Role::default()
        },
        &alice.public_key(),
    )
    .expect("alice entry");
    let bob_entry = authorization_entry(
        &subjects,
        &Role {
            agent: "bob".into(),
            calls: vec!["agent:alice".into()],
            ..Role::default()
        },
        &bob.public_key(),
    )
    .expect("bob entry");
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("auth.conf");
    std::fs::write(
        &conf,
        format!("listen: \"127.0.0.1:-1\"\nauthorization {{\n  users = [\n{alice_entry}\n{bob_entry}\n  ]\n}}\n"),
    )
    .expect("write");
    let server = chorus_tests::ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("server");
    let creds = |id: &Identity| Credentials::NKeySeed(id.seed().expect("seed"));

    // No valid credentials: refused at connect.
    let err = BrokerOptions::new([server.url()])
        .credentials(creds(&Identity::generate()))
        .connect()
        .await
        .expect_err("an unknown key cannot connect");
    assert_eq!(err.kind(), ErrorKind::Refused, "{err}");

    // The legitimate flow works: bob calls alice, alice's reply reaches bob's inbox.
    let alice_agent = agent_options(&server, "alice")
        .broker(BrokerOptions::new([server.url()]).credentials(creds(&alice)))
        .connect()
        .await
        .expect("alice connects with her key");
    alice_agent
        .on_command("hello", |ctx: Context, (): ()| async move {
            Ok::<_, HandlerError>(format!("hi {}", ctx.from()))
        })
        .await
        .expect("alice may serve her own subjects");
    let bob_agent = agent_options(&server, "bob")
        .broker(BrokerOptions::new([server.url()]).credentials(creds(&bob)))
        .connect()
        .await
        .expect("bob connects");
    let hi: String = bob_agent
        .request("alice", "hello", &())
        .await
        .expect("bob may call alice");
    assert_eq!(hi, "hi bob");

    // Everything alice may not do is refused by the server, and she sees it.
    let raw = BrokerOptions::new([server.url()])
        .credentials(creds(&alice))
        .inbox_prefix("_INBOX.alice")
        .connect()
        .await
        .expect("alice's raw connection");
    let mut events = raw.events();
    let attempts: [(&str, bool); 3] = [
        ("chorus.agent.bob.*", true),    // subscribe to bob's commands
        ("_INBOX.bob.>", true),          // read bob's replies
        ("chorus.agent.bob.pay", false), // send bob a command
    ];
    for (subject, subscribe) in attempts {
        if subscribe {
            let _sub = raw
                .subscribe(subject)
                .await
                .expect("the client sends the SUB");
        } else {
            raw.publish(subject, Bytes::from_static(b"x"))
                .await
                .expect("the client sends the PUB");
        }
        raw.flush().await.expect("flush");
        let violation = within(WAIT, "permission violation", async {
            loop {
                if let Ok(ConnectionEvent::PermissionViolation(text)) = events.recv().await {
                    break text;
                }
            }
        })
        .await;
        assert!(violation.contains(subject), "{subject}: {violation}");
    }
    assert_eq!(raw.stats().permission_violations, 3);
}

fn tls_server(certs: &chorus::certs::DevCerts, verify: bool) -> chorus_tests::NatsServer {
    let dir = certs.ca.parent().expect("dir").to_owned();
    let conf = dir.join(format!("tls-{verify}.conf"));
    std::fs::write(
        &conf,
        format!(
            "listen: \"127.0.0.1:-1\"\ntls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: {verify}\n  timeout: 2\n}}\n",
            certs.server_cert.display(),
            certs.server_key.display(),
            certs.ca.display()
        ),
    )
    .expect("write");
    chorus_tests::ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("TLS server")
}

#[tokio::test]
async fn tls_listeners_refuse_plain_and_unverified_clients_and_serve_verified_ones() {
    use broker_adapter::{BrokerOptions, TlsOptions};
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = chorus::certs::generate(
        dir.path(),
        &["localhost".into(), "127.0.0.1".into()],
        "agent-tls",
    )
    .expect("dev certificates");

    // TLS, no client certificates required.
    let server = tls_server(&certs, false);
    // A client that does not speak TLS gets no further than the server's INFO.
    {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let addr = server
            .url()
            .rsplit("://")
            .next()
            .expect("address")
            .to_owned();
        let stream = tokio::net::TcpStream::connect(&addr).await.expect("tcp");
        let mut stream = BufReader::new(stream);
        let mut info = String::new();
        within(WAIT, "INFO", stream.read_line(&mut info))
            .await
            .expect("info");
        assert!(info.contains("\"tls_required\":true"), "{info}");
        stream
            .get_mut()
            .write_all(b"CONNECT {}\r\nPING\r\n")
            .await
            .expect("write");
        let mut reply = String::new();
        let _ = within(WAIT, "server answer", stream.read_line(&mut reply)).await;
        assert!(
            !reply.starts_with("PONG"),
            "a plain-text client was served: {reply:?}"
        );
    }
    // A client that does not trust the CA cannot connect.
    let untrusting = BrokerOptions::new([server.url()])
        .connect_timeout(std::time::Duration::from_secs(3))
        .connect()
        .await;
    assert!(untrusting.is_err(), "a client without the CA connected");
    // One that trusts it can, and the SDK works over it.
    let tls = || TlsOptions {
        required: true,
        ca_file: Some(certs.ca.clone()),
        ..TlsOptions::default()
    };
    let worker = agent_options(&server, "tls-worker")
        .broker(BrokerOptions::new([server.url()]).tls(tls()))
        .connect()
        .await
        .expect("TLS agent");
    worker
        .on_command("echo", |_ctx: Context, s: String| async move {
            Ok::<_, HandlerError>(s)
        })
        .await
        .expect("register");
    let client = agent_options(&server, "tls-client")
        .broker(BrokerOptions::new([server.url()]).tls(tls()))
        .connect()
        .await
        .expect("TLS client");
    let echoed: String = client
        .request("tls-worker", "echo", "over tls")
        .await
        .expect("request over TLS");
    assert_eq!(echoed, "over tls");

    // Mutual TLS: a client must also present a certificate from the CA.
    let mtls = tls_server(&certs, true);
    let no_cert = BrokerOptions::new([mtls.url()])
        .tls(tls())
        .connect_timeout(std::time::Duration::from_secs(3))
        .connect()
        .await;
    assert!(
        no_cert.is_err(),
        "a client without a certificate connected to the mutual-TLS listener"
    );
    let with_cert = BrokerOptions::new([mtls.url()])
        .tls(TlsOptions {
            client_cert: Some((certs.client_cert.clone(), certs.client_key.clone())),
            ..tls()
        })
        .connect()
        .await;
    assert!(with_cert.is_ok(), "{:?}", with_cert.err());
}

#[tokio::test]
async fn an_encrypted_payload_is_readable_by_its_recipient_only_and_stays_ciphertext_in_the_dlq() {
    use agent_sdk::encryption::EncryptionKey;
    use agent_sdk::{Call, DeliveryClass};
    use futures::StreamExt;
    let server = server();
    let bob_key = EncryptionKey::generate();
    let bob_public = bob_key.public_key();
    let bob = agent_options(&server, "bob")
        .encryption_key(bob_key)
        .durable_inbox(true)
        .retry_policies(agent_sdk::RetryPolicies {
            default: agent_sdk::RetryPolicy {
                max_attempts: 1,
                ..Default::default()
            },
            rules: Vec::new(),
        })
        .connect()
        .await
        .expect("bob");
    bob.on_command("secret", |_ctx: Context, text: String| async move {
        Ok::<_, HandlerError>(text.len())
    })
    .await
    .expect("register");
    bob.on_command("reject", |_ctx: Context, _text: String| async move {
        Err::<(), _>(HandlerError::failed("not today"))
    })
    .await
    .expect("register");
    assert_eq!(
        bob.manifest().encryption_key.as_deref(),
        Some(bob_public.as_str())
    );

    // Eve listens on bob's subjects with a plain connection.
    let eve = raw_broker(&server).await;
    let mut tap = eve.subscribe("chorus.agent.bob.*").await.expect("tap");
    eve.sync(WAIT).await.expect("sync");

    let alice = agent_options(&server, "alice")
        .trust_encryption("bob", bob_public.clone())
        .connect()
        .await
        .expect("alice");
    let plaintext = "the launch code is 0000";
    let len: usize = alice
        .call(
            Call::agent("bob", "secret")
                .payload(plaintext)
                .expect("payload")
                .encrypt_for(["bob"]),
        )
        .await
        .expect("bob reads it")
        .payload_as()
        .expect("len");
    assert_eq!(len, plaintext.len());
    let seen = within(WAIT, "eve's copy", tap.next()).await.expect("copy");
    assert!(
        !String::from_utf8_lossy(seen.payload()).contains("launch code"),
        "eve read the plaintext"
    );
    let (copy, _) = codec::decode(seen.payload()).expect("envelope");
    assert!(
        copy.encryption.is_some()
            && copy.content_type == agent_sdk::encryption::CONTENT_TYPE_ENCRYPTED
    );

    // Encrypting for someone whose key is unknown fails before anything is sent.
    let err = alice
        .call(
            Call::agent("bob", "secret")
                .payload(plaintext)
                .expect("payload")
                .encrypt_for(["carol"]),
        )
        .await
        .expect_err("carol's key is unknown");
    assert!(matches!(err, agent_sdk::SdkError::Encryption(_)), "{err}");

    // A durable encrypted command that fails goes to the DLQ as ciphertext.
    let receipt = alice
        .send(
            Call::agent("bob", "reject")
                .delivery(DeliveryClass::AtLeastOnce)
                .payload(plaintext)
                .expect("payload")
                .encrypt_for(["bob"]),
        )
        .await
        .expect("stored");
    let dlq = chorus::service::dlq::DeadLetterQueue::new(
        alice.broker().clone(),
        alice.subjects().clone(),
    );
    let entry = eventually(WAIT, "the dead letter", || async {
        dlq.list(10)
            .await
            .expect("list")
            .into_iter()
            .find(|e| e.letter.message_id == Some(receipt.id))
    })
    .await;
    let stored = String::from_utf8_lossy(&entry.letter.envelope).into_owned();
    assert!(!stored.contains("launch code"), "the DLQ holds plaintext");
    let (original, _) = codec::decode(&entry.letter.envelope).expect("envelope");
    assert!(
        original.encryption.is_some(),
        "the dead letter keeps the encrypted envelope"
    );
    assert_eq!(
        entry.letter.detail, "not today",
        "bob could read it and refused it"
    );
}

#[tokio::test]
async fn the_coordinator_takes_tls_and_credentials_from_its_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = chorus::certs::generate(
        dir.path(),
        &["localhost".into(), "127.0.0.1".into()],
        "coordinator",
    )
    .expect("certs");
    let subjects = agent_sdk::Subjects::default();
    let coordinator_key = Identity::generate();
    let seed_file = dir.path().join("coordinator.nk");
    std::fs::write(&seed_file, coordinator_key.seed().expect("seed")).expect("write seed");
    let conf = dir.path().join("secure.conf");
    std::fs::write(
        &conf,
        format!(
            "listen: \"127.0.0.1:-1\"\njetstream {{ store_dir: \"{}\" }}\ntls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n}}\nauthorization {{\n  users = [\n{}\n  ]\n}}\n",
            dir.path().join("js").display(),
            certs.server_cert.display(),
            certs.server_key.display(),
            certs.ca.display(),
            chorus::creds::coordinator_entry(&subjects, &coordinator_key.public_key())
        ),
    )
    .expect("write conf");
    let server = chorus_tests::ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("secure server");
    let base = chorus::CoordinatorConfig {
        servers: server.url().to_owned(),
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        ..chorus::CoordinatorConfig::default()
    };
    let refused = chorus::Coordinator::start(base.clone(), false).await;
    assert!(
        refused.is_err(),
        "no TLS and no credentials must not connect"
    );
    let secured = chorus::CoordinatorConfig {
        security: chorus::config::ConnectionSecurity {
            tls_ca: Some(certs.ca.clone()),
            tls_cert: Some(certs.client_cert.clone()),
            tls_key: Some(certs.client_key.clone()),
            nkey_seed_file: Some(seed_file),
        },
        ..base
    };
    let coordinator = chorus::Coordinator::start(secured, false)
        .await
        .expect("the coordinator connects over mutual TLS with its nkey");
    coordinator.shutdown().await;
}
