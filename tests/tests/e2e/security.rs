//! Signed envelopes against a real server: a correct signature passes; a forged one, an
//! impersonation, a replay, a stale timestamp and an unsigned message are each refused with
//! their code. Keys come from explicit trust or from the registry. And a 100,000-case
//! property run of the decoder and the signature check finds no panic.

use bytes::Bytes;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::security::{Identity, SignaturePolicy, Verifier};
use chorus_sdk::{Context, Envelope, HandlerError, Kind, Performative, StatusCode};
use chorus_tests::{WAIT, agent_options, coordinator, eventually, raw_broker, server, within};

fn pay(from: &str, cents: u32) -> Envelope {
    let mut env = Envelope::new(Kind::Request, Performative::Request, from);
    env.to = vec!["bank".into()];
    env.name = Some("pay".into());
    env.payload = codec::encode_payload(&cents, "application/msgpack").expect("payload");
    env
}

async fn ask(raw: &chorus_broker_adapter::Broker, subject: &str, env: &Envelope) -> Envelope {
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

/// A bank that requires signatures, trusts `trusted`, and answers `pay` with who paid what.
async fn strict_bank(
    server: &chorus_tests::NatsServer,
    trusted: &[(&str, &Identity)],
) -> chorus_sdk::Agent {
    let mut options = agent_options(server, "bank").verify_signatures(SignaturePolicy {
        require_signed: true,
        ..SignaturePolicy::default()
    });
    for (id, identity) in trusted {
        options = options.trust(*id, identity.public_key());
    }
    let bank = options.connect().await.expect("bank");
    answer_pay(&bank).await;
    bank
}

/// Registers the bank's `pay`: who paid what.
async fn answer_pay(bank: &chorus_sdk::Agent) {
    bank.on_command("pay", |ctx: Context, cents: u32| async move {
        Ok::<_, HandlerError>(format!("{} paid {cents}", ctx.from()))
    })
    .await
    .expect("register");
}

#[tokio::test]
async fn signatures_are_checked_and_each_attack_is_refused_with_its_code() {
    let server = server();
    let alice = Identity::generate();
    let carol = Identity::generate();
    let alice_public = alice.public_key();
    let bank = strict_bank(&server, &[("alice", &alice), ("carol", &carol)]).await;

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

/// A burst of signed requests to a handler is checked in batches (several signatures at once,
/// on every core), and each message still gets its own verdict: the forged ones in the burst
/// are refused with 5004, every other is handled once.
#[tokio::test]
async fn a_burst_of_signed_requests_is_verified_in_batches_each_with_its_verdict() {
    let server = server();
    let alice = Identity::generate();
    let bank = strict_bank(&server, &[("alice", &alice)]).await;
    let raw = raw_broker(&server).await;
    let subject = bank.subjects().command("bank", "pay").expect("subject");

    // 300 requests at once, every tenth forged (signed, then its payload changed).
    const N: u32 = 300;
    let asks = (0..N).map(|i| {
        let mut env = pay("alice", i);
        alice.sign(&subject, &mut env);
        if i % 10 == 0 {
            env.payload =
                codec::encode_payload(&(i + 1_000_000), "application/msgpack").expect("payload");
        }
        let (raw, subject) = (&raw, &subject);
        async move { (i, ask(raw, subject, &env).await) }
    });
    let replies = within(WAIT * 3, "the replies", futures::future::join_all(asks)).await;
    for (i, reply) in replies {
        if i % 10 == 0 {
            assert_eq!(
                reply.status,
                Some(StatusCode::IDENTITY),
                "{i}: {:?}",
                reply.reason
            );
        } else {
            assert_eq!(
                reply.status,
                Some(StatusCode::OK),
                "{i}: {:?}",
                reply.reason
            );
            let paid: String =
                codec::decode_payload(&reply.payload, &reply.content_type).expect("text");
            assert_eq!(paid, format!("alice paid {i}"));
        }
    }
    let stats = bank.stats();
    assert_eq!(stats.security_refused, u64::from(N / 10));
    assert_eq!(stats.verified_in_batches, u64::from(N));
    assert!(
        stats.verify_batches < stats.verified_in_batches,
        "a burst is checked in batches: {} batches for {} signatures",
        stats.verify_batches,
        stats.verified_in_batches
    );
}

/// SECURITY.md: with `persist_seen_ids`, the ids of verified messages are kept in a bucket
/// that outlives the agent, so the bank restarted refuses, with 5015, a signed request it
/// accepted before the restart; a bank without it (in memory only) would accept it again.
#[tokio::test]
async fn a_replay_across_a_restart_is_refused_when_seen_ids_are_persisted() {
    let server = server();
    let alice = Identity::generate();
    let bank = |persist: bool| {
        let options = agent_options(&server, "bank")
            .verify_signatures(SignaturePolicy {
                require_signed: true,
                ..SignaturePolicy::default()
            })
            .trust("alice", alice.public_key())
            .persist_seen_ids(persist);
        async move {
            let bank = options.connect().await.expect("bank");
            answer_pay(&bank).await;
            bank
        }
    };
    let raw = raw_broker(&server).await;
    let subject = "chorus.agent.bank.pay";
    let signed = |cents| {
        let mut env = pay("alice", cents);
        alice.sign(subject, &mut env);
        env
    };

    // In memory only: the restarted bank has forgotten the id.
    let forgetful = signed(1);
    let first = bank(false).await;
    assert_eq!(
        ask(&raw, subject, &forgetful).await.status,
        Some(StatusCode::OK)
    );
    first.shutdown().await;
    let second = bank(false).await;
    assert_eq!(
        ask(&raw, subject, &forgetful).await.status,
        Some(StatusCode::OK),
        "the in-memory cache does not survive a restart"
    );
    second.shutdown().await;

    // Persisted: refused after the restart, and a new message still passes.
    let captured = signed(2);
    let first = bank(true).await;
    assert_eq!(
        ask(&raw, subject, &captured).await.status,
        Some(StatusCode::OK)
    );
    first.shutdown().await;
    let restarted = bank(true).await;
    let replay = ask(&raw, subject, &captured).await;
    assert_eq!(replay.status, Some(StatusCode::REPLAY), "{replay:?}");
    assert_eq!(restarted.stats().security_refused, 1);
    assert_eq!(restarted.stats().handled_ok, 0);
    assert_eq!(
        ask(&raw, subject, &signed(3)).await.status,
        Some(StatusCode::OK)
    );
    restarted.shutdown().await;
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
    // A fresh verifier per input: one verifier remembers the ids it has accepted, and would
    // refuse every later copy of the original as a replay before checking its signature.
    let verifier = || {
        let v = Verifier::new(SignaturePolicy::default());
        v.trust("alice", &alice.public_key());
        v
    };
    let subject = "chorus.agent.bank.pay";
    let mut original = pay("alice", 99);
    original.trace = Some(chorus_sdk::envelope::TraceContext {
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
    // The unchanged seeds decode and verify: the check below has something to compare with.
    for seed in &seeds {
        let (env, _) = codec::decode(seed).expect("the seed decodes");
        verifier()
            .verify(subject, &env, env.timestamp_ms)
            .expect("the seed verifies");
    }
    let mut state: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    const CASES: usize = 100_000;
    let (mut decoded, mut verified) = (0usize, 0usize);
    let mut outcomes = std::collections::HashMap::new();
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
        // What the verifier reads is the signed content and the signature: inputs equal in
        // those get the same answer, so each distinct one is verified once (the arithmetic is
        // slow in a debug build) and every case is still checked below.
        let signed = (
            env.id,
            env.timestamp_ms,
            env.from.clone(),
            env.payload.clone(),
            env.signature
                .as_ref()
                .map(|s| (s.alg.clone(), s.key.clone(), s.value.clone())),
        );
        let passes = *outcomes
            .entry(signed)
            .or_insert_with(|| verifier().verify(subject, &env, env.timestamp_ms).is_ok());
        if passes && env.signature.is_some() {
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
    // The run exercised what it claims to: many damaged inputs still decoded, and some still
    // verified (damage outside the signed fields), so the check above ran on them.
    assert!(decoded >= CASES / 10, "only {decoded} of {CASES} decoded");
    assert!(verified >= 100, "only {verified} of {CASES} verified");
}

#[tokio::test]
async fn handlers_refuse_senders_without_the_required_permission_and_over_their_rate() {
    let server = server();
    // Grants apply to verified senders: admin signs, and the vault knows its key.
    let admin_key = Identity::generate();
    let vault = agent_options(&server, "vault")
        .verify_signatures(SignaturePolicy::default())
        .trust("admin", admin_key.public_key())
        .grant("admin", ["secrets:read"])
        .rate_limit(chorus_sdk::RateLimit {
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
        .identity(admin_key)
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

    // The intern may ping, three at once, then about one a second. Five back to back: the
    // first three pass; of the other two, at most one per second elapsed can have refilled.
    let started = std::time::Instant::now();
    let mut outcomes = Vec::new();
    for _ in 0..5 {
        outcomes.push(
            intern
                .request::<_, ()>("vault", "ping", &())
                .await
                .map_err(|e| e.status()),
        );
    }
    let took = started.elapsed();
    println!("rate limit: 5 pings in {took:?}: {outcomes:?}");
    assert_eq!(&outcomes[..3], &[Ok(()), Ok(()), Ok(())]);
    assert!(
        outcomes[3..]
            .iter()
            .all(|o| *o == Ok(()) || *o == Err(StatusCode::RATE_LIMITED)),
        "{outcomes:?}"
    );
    let refused = outcomes.iter().filter(|o| o.is_err()).count();
    let refill = took.as_secs_f64().floor() as usize;
    assert!(
        refused + refill >= 2,
        "{refused} refused in {took:?}: more passed than the budget allows"
    );
    assert_eq!(vault.stats().rate_limited, refused as u64);
    // Other senders have their own budget.
    admin
        .request::<_, ()>("vault", "ping", &())
        .await
        .expect("admin's own bucket");
}

/// SECURITY.md: grants apply only to a sender whose signature verified. A message that claims
/// to come from a granted agent is refused with 5007 when it is unsigned (the sender is not
/// verified) and with 5004 when it is signed by another key; the real sender, signing, is
/// served. Only an agent that opts into trusting unverified senders takes the claim.
#[tokio::test]
async fn a_spoofed_from_does_not_get_the_granted_senders_rights() {
    let server = server();
    let admin_key = Identity::generate();
    let mallory_key = Identity::generate();
    let serve = |id: &str, trusting: bool| {
        let options = agent_options(&server, id)
            .verify_signatures(SignaturePolicy::default())
            .trust("admin", admin_key.public_key())
            .trust("mallory", mallory_key.public_key())
            .grant("admin", ["secrets:read"])
            .trust_unverified_senders(trusting);
        async move {
            let vault = options.connect().await.expect("vault");
            vault
                .on_command("read", |_ctx: Context, key: String| async move {
                    Ok::<_, HandlerError>(format!("value of {key}"))
                })
                .await
                .expect("register");
            vault.require("read", &["secrets:read"]).expect("require");
            vault
        }
    };
    let vault = serve("vault", false).await;
    let raw = raw_broker(&server).await;
    let read = |from: &str, signer: Option<&Identity>, subject: &str| {
        let mut env = Envelope::new(Kind::Request, Performative::Request, from);
        env.to = vec!["vault".into()];
        env.name = Some("read".into());
        env.payload = codec::encode_payload(&"db", "application/msgpack").expect("payload");
        if let Some(identity) = signer {
            identity.sign(subject, &mut env);
        }
        env
    };

    // Unsigned, claiming to be admin: not verified, so admin's grant does not apply.
    let subject = "chorus.agent.vault.read";
    let spoofed = ask(&raw, subject, &read("admin", None, subject)).await;
    assert_eq!(spoofed.status, Some(StatusCode::ACCESS), "{spoofed:?}");
    let reason = spoofed.reason.clone().unwrap_or_default();
    assert!(reason.contains("admin is not verified"), "{reason}");
    // Signed by mallory's key, claiming to be admin: impersonation.
    let forged = ask(&raw, subject, &read("admin", Some(&mallory_key), subject)).await;
    assert_eq!(forged.status, Some(StatusCode::IDENTITY), "{forged:?}");
    // Mallory as herself, verified: she holds no grant.
    let honest = ask(&raw, subject, &read("mallory", Some(&mallory_key), subject)).await;
    assert_eq!(honest.status, Some(StatusCode::ACCESS), "{honest:?}");
    // Admin, signing: served.
    let admin = ask(&raw, subject, &read("admin", Some(&admin_key), subject)).await;
    assert_eq!(admin.status, Some(StatusCode::OK), "{admin:?}");
    assert_eq!(vault.stats().access_refused, 2);
    assert_eq!(vault.stats().security_refused, 1);

    // The explicit opt-in takes the unsigned claim, as before.
    let trusting = serve("trusting", true).await;
    let subject = "chorus.agent.trusting.read";
    let taken = ask(&raw, subject, &read("admin", None, subject)).await;
    assert_eq!(taken.status, Some(StatusCode::OK), "{taken:?}");
    drop(trusting);
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
    use chorus_broker_adapter::{BrokerOptions, ConnectionEvent, Credentials, ErrorKind};
    use chorus_coordinator::creds::{Role, authorization_entry};
    let subjects = chorus_sdk::Subjects::default();
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

fn tls_server(certs: &chorus_cli::certs::DevCerts, verify: bool) -> chorus_tests::NatsServer {
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

/// A connection refused in the TLS handshake: not a timeout, not a bad address, not auth.
fn assert_tls_refusal(err: &chorus_broker_adapter::Error) {
    let chain = {
        let mut text = err.to_string();
        let mut source = std::error::Error::source(err);
        while let Some(s) = source {
            text.push_str(&format!(": {s}"));
            source = s.source();
        }
        text.to_ascii_lowercase()
    };
    println!("TLS refusal: kind {:?}: {chain}", err.kind());
    assert_eq!(err.kind(), chorus_broker_adapter::ErrorKind::Tls, "{chain}");
    assert!(
        chain.contains("tls") || chain.contains("certificate") || chain.contains("handshake"),
        "not a TLS failure: {chain}"
    );
    assert!(
        !chain.contains("timed out"),
        "a timeout, not a refusal: {chain}"
    );
}

#[tokio::test]
async fn tls_listeners_refuse_plain_and_unverified_clients_and_serve_verified_ones() {
    use chorus_broker_adapter::{BrokerOptions, TlsOptions};
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = chorus_cli::certs::generate(
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
        // The server answers with an error and closes, or resets the connection: never PONG.
        match within(WAIT, "server answer", stream.read_line(&mut reply)).await {
            Ok(_) => assert!(
                reply.is_empty() || reply.starts_with("-ERR"),
                "a plain-text client was served: {reply:?}"
            ),
            Err(e) => assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                ),
                "{e}"
            ),
        }
    }
    // A client that does not trust the CA cannot connect.
    let untrusting = BrokerOptions::new([server.url()])
        .connect_timeout(std::time::Duration::from_secs(3))
        .connect()
        .await
        .expect_err("a client without the CA connected");
    assert_tls_refusal(&untrusting);
    // One that trusts it can, and the SDK works over it.
    let tls = || TlsOptions::required().ca_file(certs.ca.clone());
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
        .await
        .expect_err("a client without a certificate connected to the mutual-TLS listener");
    assert_tls_refusal(&no_cert);
    let with_cert = BrokerOptions::new([mtls.url()])
        .tls(tls().client_cert(certs.client_cert.clone(), certs.client_key.clone()))
        .connect()
        .await;
    assert!(with_cert.is_ok(), "{:?}", with_cert.err());
}

#[tokio::test]
async fn an_encrypted_payload_is_readable_by_its_recipient_only_and_stays_ciphertext_in_the_dlq() {
    use chorus_sdk::encryption::EncryptionKey;
    use chorus_sdk::{Call, DeliveryClass};
    use futures::StreamExt;
    let server = server();
    let bob_key = EncryptionKey::generate();
    let bob_public = bob_key.public_key();
    let bob = agent_options(&server, "bob")
        .encryption_key(bob_key)
        .durable_inbox(true)
        .retry_policies(chorus_sdk::RetryPolicies {
            default: chorus_sdk::RetryPolicy {
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
            && copy.content_type == chorus_sdk::encryption::CONTENT_TYPE_ENCRYPTED
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
    assert!(matches!(err, chorus_sdk::SdkError::Encryption(_)), "{err}");

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
    let dlq = chorus_coordinator::service::dlq::DeadLetterQueue::new(
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
    let certs = chorus_cli::certs::generate(
        dir.path(),
        &["localhost".into(), "127.0.0.1".into()],
        "coordinator",
    )
    .expect("certs");
    let subjects = chorus_sdk::Subjects::default();
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
            chorus_coordinator::creds::coordinator_entry(&subjects, &coordinator_key.public_key())
        ),
    )
    .expect("write conf");
    let server = chorus_tests::ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("secure server");
    let base = chorus_coordinator::CoordinatorConfig {
        servers: server.url().to_owned(),
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        ..chorus_coordinator::CoordinatorConfig::default()
    };
    let refused = chorus_coordinator::Coordinator::start(base.clone(), false)
        .await
        .expect_err("no TLS and no credentials must not connect");
    let text = format!("{refused:#}").to_ascii_lowercase();
    println!("coordinator refused: {text}");
    assert!(
        text.contains("cannot reach nats") && (text.contains("tls") || text.contains("auth")),
        "refused for another reason: {text}"
    );
    let secured = chorus_coordinator::CoordinatorConfig {
        security: chorus_sdk::security::ConnectionSecurity {
            tls_ca: Some(certs.ca.clone()),
            tls_cert: Some(certs.client_cert.clone()),
            tls_key: Some(certs.client_key.clone()),
            nkey_seed_file: Some(seed_file),
        },
        ..base
    };
    let coordinator = chorus_coordinator::Coordinator::start(secured, false)
        .await
        .expect("the coordinator connects over mutual TLS with its nkey");
    coordinator.shutdown().await;
}

/// SECURITY.md: a signed message from a sender whose key the receiver does not know is
/// refused with 5004, end to end through the SDK.
#[tokio::test]
async fn a_signed_request_from_a_sender_with_no_registered_key_is_refused_with_5004() {
    let server = server();
    let bank = agent_options(&server, "bank")
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..SignaturePolicy::default()
        })
        .trust("alice", Identity::generate().public_key())
        .connect()
        .await
        .expect("bank");
    bank.on_command("pay", |_ctx: Context, cents: u32| async move {
        Ok::<_, HandlerError>(cents)
    })
    .await
    .expect("register");
    let mallory = agent_options(&server, "mallory")
        .identity(Identity::generate())
        .connect()
        .await
        .expect("mallory");
    let err = mallory
        .request::<_, u32>("bank", "pay", &1u32)
        .await
        .expect_err("nobody registered mallory's key");
    assert_eq!(err.status(), StatusCode::IDENTITY, "{err}");
    assert!(err.to_string().contains("no key is registered"), "{err}");
    assert_eq!(bank.stats().security_refused, 1);
    assert_eq!(bank.stats().handled_ok, 0);
}

/// SECURITY.md: an encrypted payload reaching an agent that is not among its recipients, or
/// has no decryption key at all, is refused with 5007, end to end.
#[tokio::test]
async fn an_encrypted_request_at_an_agent_that_is_not_a_recipient_is_refused_with_5007() {
    use chorus_sdk::Call;
    use chorus_sdk::encryption::EncryptionKey;
    let server = server();
    let bob_key = EncryptionKey::generate();
    let bob_public = bob_key.public_key();
    let mut agents = Vec::new();
    for (id, key) in [("carol", Some(EncryptionKey::generate())), ("dave", None)] {
        let mut options = agent_options(&server, id);
        if let Some(key) = key {
            options = options.encryption_key(key);
        }
        let a = options.connect().await.expect("connect");
        a.on_command("secret", |_ctx: Context, text: String| async move {
            Ok::<_, HandlerError>(text)
        })
        .await
        .expect("register");
        agents.push(a);
    }
    let alice = agent_options(&server, "alice")
        .trust_encryption("bob", bob_public)
        .connect()
        .await
        .expect("alice");
    for id in ["carol", "dave"] {
        let err = alice
            .call(
                Call::agent(id, "secret")
                    .payload("for bob only")
                    .expect("payload")
                    .encrypt_for(["bob"]),
            )
            .await
            .expect_err("only bob can open it");
        assert_eq!(err.status(), StatusCode::ACCESS, "{id}: {err}");
    }
    assert!(agents.iter().all(|a| a.stats().handled_ok == 0));
}

fn signed_event(alice: &Identity, subject: &str, n: u32) -> Envelope {
    let mut env = Envelope::new(Kind::Event, Performative::Inform, "alice");
    env.topic = Some("feed.x".into());
    env.payload = codec::encode_payload(&n, "application/msgpack").expect("payload");
    alice.sign(subject, &mut env);
    env
}

/// SECURITY.md: an event stream verifies the events that arrived together as one batch; if
/// the batch fails, each is checked alone, so one forgery refuses only itself.
#[tokio::test]
async fn a_forged_event_inside_a_signed_batch_refuses_only_itself() {
    use futures::StreamExt;
    let server = server();
    let alice = Identity::generate();
    let watcher = agent_options(&server, "watcher")
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..SignaturePolicy::default()
        })
        .trust("alice", alice.public_key())
        .connect()
        .await
        .expect("watcher");
    let mut events = watcher.subscribe("feed.>").await.expect("subscribe");
    let raw = raw_broker(&server).await;
    let subject = watcher.subjects().event("feed.x").expect("subject");
    const SENT: u32 = 50;
    const FORGED: u32 = 25;
    // All published before the stream is read, so they arrive and are verified together.
    for n in 0..SENT {
        let mut env = signed_event(&alice, &subject, n);
        if n == FORGED {
            env.payload =
                codec::encode_payload(&1_000_000u32, "application/msgpack").expect("payload");
        }
        raw.publish(
            &subject,
            codec::encode(&env, Encoding::MsgPack).expect("enc"),
        )
        .await
        .expect("publish");
    }
    // A signed sentinel last: everything before it has been admitted or refused when it comes.
    let sentinel = signed_event(&alice, &subject, SENT);
    raw.publish(
        &subject,
        codec::encode(&sentinel, Encoding::MsgPack).expect("enc"),
    )
    .await
    .expect("publish");
    raw.flush().await.expect("flush");
    let got = within(WAIT, "every event up to the sentinel", async {
        let mut got = Vec::new();
        while let Some(event) = events.next().await {
            let n: u32 = event.payload_as().expect("payload");
            if n == SENT {
                break;
            }
            got.push(n);
        }
        got
    })
    .await;
    let expected: Vec<u32> = (0..SENT).filter(|n| *n != FORGED).collect();
    assert_eq!(
        got, expected,
        "the 49 genuine events, in order, and not the forged one"
    );
    assert_eq!(watcher.stats().security_refused, 1);
}

/// SECURITY.md: broadcast copies are re-sent by the coordinator under new ids and are not
/// signed by the original sender, so an agent that requires signatures refuses them; one that
/// does not takes them.
/// SECURITY.md: the coordinator verifies a broadcast request against its sender's key and,
/// requiring signatures, refuses an unsigned one (5014) or one signed by another key (5004):
/// a forged broadcast reaches nobody. Copies are the coordinator's, signed with its key and
/// naming the sender in `chorus-origin`, so an agent that requires signatures and trusts the
/// coordinator's key takes them.
#[tokio::test]
async fn broadcast_copies_are_signed_by_the_coordinator_and_forged_broadcasts_are_refused() {
    use chorus_sdk::{BroadcastTarget, Outcome};
    let server = server();
    let dir = tempfile::tempdir().expect("tempdir");
    let coordinator_key = Identity::generate();
    let seed_file = dir.path().join("coordinator.nk");
    std::fs::write(&seed_file, coordinator_key.seed().expect("seed")).expect("write seed");
    let coordinator = within(
        WAIT,
        "coordinator start",
        chorus_coordinator::Coordinator::start(
            chorus_coordinator::CoordinatorConfig {
                servers: server.url().to_owned(),
                metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                reap_interval_ms: 50,
                signing_seed_file: Some(seed_file),
                require_signed_broadcasts: true,
                ..chorus_coordinator::CoordinatorConfig::default()
            },
            false,
        ),
    )
    .await
    .expect("coordinator");
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut fleet = Vec::new();
    for (id, strict) in [("strict", true), ("lax", false)] {
        let mut options = agent_options(&server, id).group("signed");
        if strict {
            options = options
                .verify_signatures(SignaturePolicy {
                    require_signed: true,
                    ..SignaturePolicy::default()
                })
                .trust("coordinator", coordinator_key.public_key());
        }
        let a = options.connect().await.expect("connect");
        let seen = seen_tx.clone();
        a.on_command("reload", move |ctx: Context, (): ()| {
            let seen = seen.clone();
            async move {
                let origin = ctx
                    .message()
                    .headers
                    .get(chorus_coordinator::service::ORIGIN_HEADER)
                    .cloned();
                let _ = seen.send((ctx.from().to_owned(), origin));
                Ok::<_, HandlerError>(())
            }
        })
        .await
        .expect("register");
        fleet.push(a);
    }
    let operator_key = Identity::generate();
    let operator = agent_options(&server, "operator")
        .identity(operator_key)
        .connect()
        .await
        .expect("operator");
    eventually(WAIT, "all three registered", || async {
        let n = operator
            .discover(&chorus_sdk::DiscoverQuery::default())
            .await
            .map(|v| v.len())
            .unwrap_or(0);
        (n == 3).then_some(())
    })
    .await;
    let report = operator
        .broadcast(
            &BroadcastTarget::Group("signed".into()),
            "reload",
            &(),
            std::time::Duration::from_secs(5),
        )
        .await
        .expect("report");
    for line in &report.recipients {
        assert_eq!(line.outcome, Outcome::Delivered, "{report:?}");
    }
    assert_eq!(report.recipients.len(), 2, "{report:?}");
    assert_eq!(fleet[0].stats().handled_ok, 1);
    assert_eq!(fleet[0].stats().security_refused, 0);
    for _ in 0..2 {
        let (from, origin) = within(WAIT, "a copy handled", seen_rx.recv())
            .await
            .expect("a copy");
        assert_eq!(from, "coordinator");
        assert_eq!(origin.as_deref(), Some("operator"));
    }

    // Forged broadcasts claiming to be the operator: unsigned, and signed by another key.
    let raw = raw_broker(&server).await;
    let subject = "chorus.bcast.group.signed";
    let forged = |signer: Option<&Identity>| {
        let mut env = Envelope::new(Kind::Request, Performative::Request, "operator");
        env.name = Some("reload".into());
        env.payload = codec::encode_payload(&(), "application/msgpack").expect("payload");
        if let Some(identity) = signer {
            identity.sign(subject, &mut env);
        }
        env
    };
    let unsigned = ask(&raw, subject, &forged(None)).await;
    assert_eq!(
        unsigned.status,
        Some(StatusCode::UNAUTHORIZED),
        "{unsigned:?}"
    );
    let impostor = ask(&raw, subject, &forged(Some(&Identity::generate()))).await;
    assert_eq!(impostor.status, Some(StatusCode::IDENTITY), "{impostor:?}");
    // Nothing reached the fleet.
    assert_eq!(fleet[0].stats().handled_ok + fleet[1].stats().handled_ok, 2);
    assert!(
        seen_rx.try_recv().is_err(),
        "a forged broadcast was delivered"
    );
    coordinator.shutdown().await;
}

/// A recipient `id` of signed, encrypted commands: a new encryption key, signatures required,
/// `sender`'s key trusted. Returns it and its public encryption key.
async fn sealed_recipient(
    server: &chorus_tests::NatsServer,
    id: &str,
    sender: &str,
    sender_key: &Identity,
) -> (chorus_sdk::Agent, String) {
    let key = chorus_sdk::encryption::EncryptionKey::generate();
    let public = key.public_key();
    let agent = agent_options(server, id)
        .encryption_key(key)
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..SignaturePolicy::default()
        })
        .trust(sender, sender_key.public_key())
        .connect()
        .await
        .expect("the recipient");
    (agent, public)
}

/// The options of a sender `id` signing as `identity` that knows `recipient`'s public
/// encryption key.
fn sealed_sender(
    server: &chorus_tests::NatsServer,
    id: &str,
    identity: &Identity,
    recipient: &str,
    public: String,
) -> chorus_sdk::AgentOptions {
    agent_options(server, id)
        .identity(Identity::from_seed(&identity.seed().expect("seed")).expect("identity"))
        .trust_encryption(recipient, public)
}

/// SECURITY.md: the signature covers the ciphertext, so a relay that cannot read a message can
/// still verify it, and a changed ciphertext is refused as tampering (5004) before anything
/// tries to open it.
#[tokio::test]
async fn the_signature_covers_the_ciphertext() {
    use chorus_sdk::Call;
    use futures::StreamExt;
    let server = server();
    let alice = Identity::generate();
    let (bob, bob_public) = sealed_recipient(&server, "bob", "alice", &alice).await;
    bob.on_command("secret", |_ctx: Context, text: String| async move {
        Ok::<_, HandlerError>(text.len())
    })
    .await
    .expect("register");
    let tap = raw_broker(&server).await;
    let mut copies = tap.subscribe("chorus.agent.bob.*").await.expect("tap");
    tap.sync(WAIT).await.expect("sync");
    let alice_agent = sealed_sender(&server, "alice", &alice, "bob", bob_public)
        .connect()
        .await
        .expect("alice");
    let len: usize = alice_agent
        .call(
            Call::agent("bob", "secret")
                .payload("sealed")
                .expect("payload")
                .encrypt_for(["bob"]),
        )
        .await
        .expect("bob reads it")
        .payload_as()
        .expect("len");
    assert_eq!(len, 6);
    let copy = within(WAIT, "the tapped copy", copies.next())
        .await
        .expect("copy");
    let subject = copy.subject().to_owned();
    let (sealed, _) = codec::decode(copy.payload()).expect("envelope");
    assert!(sealed.encryption.is_some() && sealed.signature.is_some());

    // A relay with alice's public key and no way to decrypt verifies it as it is.
    let relay = Verifier::new(SignaturePolicy::default());
    relay.trust("alice", &alice.public_key());
    relay
        .verify(&subject, &sealed, sealed.timestamp_ms)
        .expect("the ciphertext verifies without being opened");

    // One ciphertext byte changed: the signature no longer holds.
    let mut tampered = sealed.clone();
    let mut payload = tampered.payload.to_vec();
    let last = payload.len() - 1;
    payload[last] ^= 0x01;
    tampered.payload = payload.into();
    let fresh = Verifier::new(SignaturePolicy::default());
    fresh.trust("alice", &alice.public_key());
    let (status, _) = fresh
        .verify(&subject, &tampered, tampered.timestamp_ms)
        .expect_err("a changed ciphertext does not verify");
    assert_eq!(status, StatusCode::IDENTITY);
    let reply = ask(&tap, &subject, &tampered).await;
    assert_eq!(
        reply.status,
        Some(StatusCode::IDENTITY),
        "refused as tampering, not as undecryptable: {:?}",
        reply.reason
    );
    assert_eq!(bob.stats().handled_ok, 1);
}

/// Keeps every message published on `subject` in `copies`, until the returned task is
/// aborted.
async fn tap_copies(
    url: &str,
    subject: &str,
    copies: &std::sync::Arc<std::sync::Mutex<Vec<Bytes>>>,
) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    let tap = chorus_broker_adapter::BrokerOptions::new([url])
        .connect()
        .await
        .expect("tap");
    let mut sub = tap.subscribe(subject).await.expect("tap");
    tap.sync(WAIT).await.expect("sync");
    let copies = std::sync::Arc::clone(copies);
    tokio::spawn(async move {
        let _tap = tap;
        while let Some(msg) = sub.next().await {
            copies.lock().expect("copies").push(msg.payload().clone());
        }
    })
}

/// PROTOCOL.md 4.2: a stream of signed, encrypted commands in sessions of 10 messages, with
/// the only server restarted in the middle: every command is handled once with its payload,
/// the session in use when the server went away goes on after it (the same header, the next
/// numbers), a new session begins every 10 messages, and a captured message sent again is
/// refused as a replay.
#[tokio::test]
async fn an_encrypted_stream_goes_on_across_a_re_key_and_a_server_restart_and_refuses_a_replay() {
    use chorus_sdk::Call;
    use chorus_sdk::encryption::{Rekey, SESSION_ALG};
    use std::sync::{Arc, Mutex};
    const SENT: u32 = 40;
    const RESTART_AFTER: u32 = 25;
    let mut server = server();
    let alice = Identity::generate();
    let (bob, bob_public) = sealed_recipient(&server, "bob-stream", "alice-stream", &alice).await;
    let handled = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&handled);
    bob.on_command("secret", move |_ctx: Context, n: u32| {
        let log = Arc::clone(&log);
        async move {
            log.lock().expect("log").push(n);
            Ok::<_, HandlerError>(n)
        }
    })
    .await
    .expect("register");
    let alice_agent = sealed_sender(&server, "alice-stream", &alice, "bob-stream", bob_public)
        .encryption_rekey(Rekey {
            messages: 10,
            age: std::time::Duration::from_secs(600),
        })
        .connect()
        .await
        .expect("alice");
    let send = |n: u32| {
        Call::agent("bob-stream", "secret")
            .payload(&n)
            .expect("payload")
            .encrypt_for(["bob-stream"])
    };
    // Every copy bob is sent, as it crossed the bus, before and after the restart.
    let copies = Arc::new(Mutex::new(Vec::new()));
    let tapping = tap_copies(server.url(), "chorus.agent.bob-stream.secret", &copies).await;
    // Each command is answered with its own number.
    let ask_n = |n: u32| {
        let call = alice_agent.call(send(n));
        async move {
            let back: u32 = call.await.expect("handled").payload_as().expect("n");
            assert_eq!(back, n);
        }
    };
    for n in 0..RESTART_AFTER {
        ask_n(n).await;
    }
    tapping.abort();
    server.kill();
    server.restart().expect("restart");
    let tapping = tap_copies(server.url(), "chorus.agent.bob-stream.secret", &copies).await;
    // Both agents back on the restarted server, their subscriptions restored.
    eventually(WAIT, "both agents reconnected", || async {
        let mut back = true;
        for agent in [&alice_agent, &bob] {
            back &= agent.broker().is_connected() && agent.broker().sync(WAIT).await.is_ok();
        }
        back.then_some(())
    })
    .await;
    for n in RESTART_AFTER..SENT {
        ask_n(n).await;
    }
    // Every command handled once, in order.
    assert_eq!(*handled.lock().expect("log"), (0..SENT).collect::<Vec<_>>());

    // The copies on the wire: sessions of 10, one of them across the restart.
    eventually(WAIT, "the tap saw every command", || async {
        (copies.lock().expect("copies").len() >= SENT as usize).then_some(())
    })
    .await;
    tapping.abort();
    let wire: Vec<(Vec<u8>, u64, Envelope)> = copies
        .lock()
        .expect("copies")
        .iter()
        .map(|bytes| {
            let (env, _) = codec::decode(bytes).expect("envelope");
            let enc = env.encryption.clone().expect("encrypted");
            assert_eq!(enc.alg, SESSION_ALG);
            let key = &enc.recipients[0].key;
            assert_eq!(key.len(), 136);
            let seq = u64::from_be_bytes(key[80..88].try_into().expect("8 bytes"));
            (key[..80].to_vec(), seq, env)
        })
        .collect();
    assert_eq!(wire.len(), SENT as usize);
    let mut headers: Vec<&Vec<u8>> = wire.iter().map(|(h, _, _)| h).collect();
    headers.dedup();
    assert_eq!(
        headers.len(),
        (SENT as usize).div_ceil(10),
        "a session every 10 messages"
    );
    let numbers: Vec<u64> = wire.iter().map(|(_, seq, _)| *seq).collect();
    let expected: Vec<u64> = (0..wire.len() as u64).map(|i| i % 10).collect();
    assert_eq!(
        numbers, expected,
        "each session numbered from 0, one after the other"
    );
    let at = RESTART_AFTER as usize;
    assert_eq!(
        wire[at - 1].0,
        wire[at].0,
        "the session in use at the restart went on after it"
    );

    // A captured message sent again: refused, not handled again.
    let raw = raw_broker(&server).await;
    let captured = &wire[5].2;
    let replay = ask(&raw, "chorus.agent.bob-stream.secret", captured).await;
    assert_eq!(replay.status, Some(StatusCode::REPLAY), "{replay:?}");
    assert_eq!(
        handled
            .lock()
            .expect("log")
            .iter()
            .filter(|&&n| n == 5)
            .count(),
        1
    );
    alice_agent.shutdown().await;
    bob.shutdown().await;
}
