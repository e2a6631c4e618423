//! The broker adapter against a real server: typed errors, connection events, drain.

use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::{BrokerOptions, ConnectionEvent, ErrorKind};
use chorus_tests::{WAIT, raw_broker, server, within};
use futures::StreamExt;

#[tokio::test]
async fn publish_subscribe_and_queue_groups_deliver() {
    let server = server();
    let broker = raw_broker(&server).await;
    let mut plain = broker.subscribe("t.*").await.expect("subscribe");
    let mut q1 = broker.queue_subscribe("t.q", "workers").await.expect("q1");
    let mut q2 = broker.queue_subscribe("t.q", "workers").await.expect("q2");
    broker.sync(WAIT).await.expect("sync");

    broker
        .publish("t.a", Bytes::from_static(b"hello"))
        .await
        .expect("publish");
    let msg = within(WAIT, "plain message", plain.next())
        .await
        .expect("message");
    assert_eq!(msg.subject(), "t.a");
    assert_eq!(&msg.payload()[..], b"hello");

    for _ in 0..100 {
        broker.publish("t.q", Bytes::new()).await.expect("publish");
    }
    broker.sync(WAIT).await.expect("sync");
    let (mut n1, mut n2) = (0, 0);
    while n1 + n2 < 100 {
        tokio::select! {
            Some(_) = q1.next() => n1 += 1,
            Some(_) = q2.next() => n2 += 1,
            _ = tokio::time::sleep(WAIT) => panic!("queue messages missing: {n1} + {n2}"),
        }
    }
    // Each message went to exactly one member; the plain subscriber saw all 100.
    assert_eq!(n1 + n2, 100);
    let mut plain_count = 0;
    while plain_count < 100 {
        within(WAIT, "plain copies", plain.next())
            .await
            .expect("message");
        plain_count += 1;
    }
}

#[tokio::test]
async fn request_errors_tell_timeout_from_no_responders() {
    let server = server();
    let broker = raw_broker(&server).await;

    let err = broker
        .request("nobody.home", None, Bytes::new(), Duration::from_secs(5))
        .await
        .expect_err("no responders");
    assert_eq!(err.kind(), ErrorKind::NoResponders);

    // Someone listens but never answers.
    let _silent = broker.subscribe("silent").await.expect("subscribe");
    broker.sync(WAIT).await.expect("sync");
    let started = std::time::Instant::now();
    let err = broker
        .request("silent", None, Bytes::new(), Duration::from_millis(200))
        .await
        .expect_err("timeout");
    assert_eq!(err.kind(), ErrorKind::TimedOut);
    assert!(started.elapsed() >= Duration::from_millis(200));
}

#[tokio::test]
async fn bad_subjects_and_oversized_payloads_are_refused_before_sending() {
    let server = server();
    let broker = raw_broker(&server).await;
    for subject in ["", "a..b", "a.*", "a.>", "has space"] {
        let err = broker
            .publish(subject, Bytes::new())
            .await
            .expect_err(subject);
        assert_eq!(err.kind(), ErrorKind::InvalidSubject, "{subject:?}");
    }
    let err = broker.subscribe("a.>.b").await.expect_err("bad pattern");
    assert_eq!(err.kind(), ErrorKind::InvalidSubject);

    let too_big = Bytes::from(vec![0u8; broker.max_payload() + 1]);
    let err = broker
        .publish("big", too_big.clone())
        .await
        .expect_err("too large");
    assert_eq!(err.kind(), ErrorKind::TooLarge);
    let err = broker
        .request("big", None, too_big, Duration::from_secs(1))
        .await
        .expect_err("too large");
    assert_eq!(err.kind(), ErrorKind::TooLarge);
    // The connection is still good.
    broker.publish("fine", Bytes::new()).await.expect("publish");
    broker.sync(WAIT).await.expect("sync");
}

#[tokio::test]
async fn wrong_credentials_are_refused() {
    let server = chorus_tests::ServerBuilder::default()
        .arg("--user")
        .arg("alice")
        .arg("--pass")
        .arg("correct-horse")
        .start()
        .expect("server");
    let err = BrokerOptions::new([server.url()])
        .credentials(chorus_broker_adapter::Credentials::UserPassword {
            user: "alice".into(),
            password: "wrong".into(),
        })
        .connect()
        .await
        .expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::Refused, "{err}");
    let ok = BrokerOptions::new([server.url()])
        .credentials(chorus_broker_adapter::Credentials::UserPassword {
            user: "alice".into(),
            password: "correct-horse".into(),
        })
        .connect()
        .await;
    assert!(ok.is_ok());
}

#[tokio::test]
async fn permission_violations_arrive_as_typed_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("auth.conf");
    std::fs::write(
        &conf,
        r#"
        listen: "127.0.0.1:-1"
        authorization {
          users = [
            { user: "agent", password: "pw", permissions: { publish: { allow: ["ok.>"] }, subscribe: { allow: ["ok.>"] } } }
          ]
        }
        "#,
    )
    .expect("write conf");
    let server = chorus_tests::ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("server");
    let broker = BrokerOptions::new([server.url()])
        .credentials(chorus_broker_adapter::Credentials::UserPassword {
            user: "agent".into(),
            password: "pw".into(),
        })
        .connect()
        .await
        .expect("connect");
    let mut events = broker.events();
    // The publish itself "succeeds": NATS reports the violation asynchronously.
    broker
        .publish("forbidden.x", Bytes::new())
        .await
        .expect("queued");
    broker.flush().await.expect("flush");
    let event = within(WAIT, "permission event", async {
        loop {
            match events.recv().await {
                Ok(ConnectionEvent::PermissionViolation(text)) => break text,
                Ok(_) => continue,
                Err(e) => panic!("event channel: {e}"),
            }
        }
    })
    .await;
    assert!(event.contains("forbidden.x"), "{event}");
    assert_eq!(broker.stats().permission_violations, 1);
}

#[tokio::test]
async fn slow_consumer_drops_are_counted_not_silent() {
    let server = server();
    let slow = BrokerOptions::new([server.url()])
        .subscription_capacity(16)
        .connect()
        .await
        .expect("connect");
    let mut events = slow.events();
    let _sub = slow.subscribe("firehose").await.expect("subscribe");
    slow.sync(WAIT).await.expect("sync");
    let publisher = raw_broker(&server).await;
    for _ in 0..2_000 {
        publisher
            .publish("firehose", Bytes::from_static(b"x"))
            .await
            .expect("publish");
    }
    publisher.flush().await.expect("flush");
    within(WAIT, "slow consumer event", async {
        loop {
            if let Ok(ConnectionEvent::SlowConsumer { .. }) = events.recv().await {
                break;
            }
        }
    })
    .await;
    assert!(slow.stats().slow_consumer_drops > 0);
}

#[tokio::test]
async fn a_lost_server_is_reported_and_the_client_reconnects() {
    let mut server = server();
    let broker = BrokerOptions::new([server.url()])
        .reconnect_max_delay(Duration::from_millis(200))
        .connect()
        .await
        .expect("connect");
    let mut events = broker.events();
    let mut sub = broker.subscribe("after.restart").await.expect("subscribe");
    broker.sync(WAIT).await.expect("sync");

    server.kill();
    within(WAIT, "disconnect event", async {
        while events.recv().await != Ok(ConnectionEvent::Disconnected) {}
    })
    .await;
    server.restart().expect("restart");
    within(WAIT, "reconnect event", async {
        while events.recv().await != Ok(ConnectionEvent::Reconnected) {}
    })
    .await;
    let stats = broker.stats();
    assert_eq!((stats.disconnects, stats.reconnects), (1, 1));

    // The subscription was restored with the connection.
    broker.sync(WAIT).await.expect("sync");
    broker
        .publish("after.restart", Bytes::from_static(b"back"))
        .await
        .expect("publish");
    let msg = within(WAIT, "message after reconnect", sub.next())
        .await
        .expect("msg");
    assert_eq!(&msg.payload()[..], b"back");
}

#[tokio::test]
async fn subscription_drain_delivers_what_was_routed_then_ends() {
    let server = server();
    let broker = raw_broker(&server).await;
    let mut sub = broker.subscribe("d").await.expect("subscribe");
    broker.sync(WAIT).await.expect("sync");
    for i in 0..50u8 {
        broker
            .publish("d", Bytes::from(vec![i]))
            .await
            .expect("publish");
    }
    broker.sync(WAIT).await.expect("sync");
    sub.drain().await.expect("drain");
    let got: Vec<_> = within(WAIT, "drained stream", sub.collect::<Vec<_>>()).await;
    assert_eq!(got.len(), 50);
}

#[tokio::test]
async fn a_stream_the_server_has_no_room_for_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("small.conf");
    std::fs::write(
        &conf,
        "listen: \"127.0.0.1:-1\"\njetstream { max_file_store: 64MB }\n",
    )
    .expect("write");
    let server = chorus_tests::ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("server");
    let broker = raw_broker(&server).await;
    let js = broker.jetstream(WAIT);
    let mut spec = chorus_broker_adapter::StreamSpec::new("ROOMY", vec!["roomy.>".into()]);
    spec.max_bytes = 1 << 30;
    let err = within(WAIT, "ensure stream", js.ensure_stream(&spec))
        .await
        .expect_err("a 1 GiB reservation does not fit in 64 MB");
    assert_eq!(err.kind(), ErrorKind::Broker, "{err}");
    let text = err.to_string();
    assert!(
        text.contains("cannot reserve its max_bytes of 1024 MiB")
            && text.contains("lower the limit"),
        "{text}"
    );
    // A stream that fits is created as usual.
    spec.max_bytes = 16 << 20;
    within(WAIT, "ensure stream", js.ensure_stream(&spec))
        .await
        .expect("16 MiB fits");
}

/// Every sync on a connection, its clones' included, shares one inbox subscription: many at
/// once all answer, and after the first none changes the server's subscriptions (each used
/// to subscribe and unsubscribe an inbox of its own; a process starting 1,000 agents on one
/// connection made 6,000 such changes).
#[tokio::test]
async fn syncs_share_one_inbox_and_change_no_subscriptions() {
    let server = chorus_tests::ServerBuilder::default()
        .arg("-m")
        .arg("-1")
        .start()
        .expect("server");
    let monitor = server.monitor_url().expect("a monitoring port").to_owned();
    let broker = raw_broker(&server).await;
    broker.sync(WAIT).await.expect("the first sync");
    let before = sublist(&monitor).await;
    let syncs = (0..200).map(|_| {
        let broker = broker.clone();
        async move { broker.sync(WAIT).await }
    });
    for answered in within(WAIT, "200 syncs", futures::future::join_all(syncs)).await {
        answered.expect("sync");
    }
    let after = sublist(&monitor).await;
    for counter in ["num_inserts", "num_removes"] {
        assert_eq!(
            after[counter], before[counter],
            "{counter} changed: {before} -> {after}"
        );
    }
}

/// The server's subscription index counters (`/subsz`), read over plain HTTP.
async fn sublist(monitor: &str) -> serde_json::Value {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = monitor.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = within(WAIT, "monitor", tokio::net::TcpStream::connect(host))
        .await
        .expect("connect to the monitoring port");
    let request = format!("GET /subsz HTTP/1.0\r\nHost: {host}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    within(WAIT, "subsz", stream.read_to_string(&mut response))
        .await
        .expect("read");
    let body = response.split("\r\n\r\n").nth(1).expect("a body");
    serde_json::from_str(body).expect("subsz is JSON")
}

/// `Kv::entries_under` lists the live keys under a prefix and nothing else: not other
/// prefixes' keys, not deleted ones, and an empty prefix as empty (without waiting).
#[tokio::test]
async fn a_buckets_entries_under_a_prefix_are_its_live_keys_there_and_no_others() {
    use chorus_broker_adapter::jetstream::KvSpec;

    let server = server();
    let broker = raw_broker(&server).await;
    let js = broker.jetstream(WAIT);
    let kv = js
        .ensure_kv_exists(&KvSpec::new("listing"))
        .await
        .expect("bucket");
    for (key, value) in [
        ("web-ui.t1.a", "1"),
        ("web-ui.t1.b", "2"),
        ("web-ui.t2.a", "3"),
        ("web-uix.t1.a", "other identity"),
        ("ops.t1.a", "other"),
    ] {
        kv.put(key, Bytes::from(value)).await.expect("put");
    }
    kv.put("web-ui.t1.b", Bytes::from("2 again"))
        .await
        .expect("put");
    kv.delete("web-ui.t2.a").await.expect("delete");
    let mut listed: Vec<(String, String)> = within(WAIT, "entries", kv.entries_under("web-ui"))
        .await
        .expect("listed")
        .into_iter()
        .map(|e| (e.key, String::from_utf8_lossy(&e.value).into_owned()))
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        [
            ("web-ui.t1.a".to_owned(), "1".to_owned()),
            ("web-ui.t1.b".to_owned(), "2 again".to_owned())
        ]
    );
    let none = within(WAIT, "nothing", kv.entries_under("nobody"))
        .await
        .expect("listed");
    assert!(none.is_empty(), "{none:?}");
    let refused = kv
        .entries_under("web-ui.>")
        .await
        .expect_err("not a prefix");
    assert_eq!(refused.kind(), ErrorKind::InvalidInput);
}
