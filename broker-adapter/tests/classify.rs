//! What a caller of the adapter gets when a real nats-server refuses or finds nothing: each case
//! is produced on a server of its own, and the test asserts the [`ErrorKind`] (or the result)
//! the caller matches on. How async-nats error kinds and JetStream error codes map to kinds is
//! unit-tested without a server in `src/classify.rs`; the stream the server has no room for, the
//! connection limit and permission violations are tested end to end in `tests/tests/e2e`.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::{
    Broker, BrokerOptions, ErrorKind, Headers, JetStream, KvSpec, StreamSpec,
};
use chorus_nats_server::NatsServer;

/// The deadline of every wait: each JetStream call (the handle's timeout), connecting, and the
/// requests sent here.
const WAIT: Duration = Duration::from_secs(20);

fn start(builder: chorus_nats_server::ServerBuilder) -> NatsServer {
    builder
        .start()
        .unwrap_or_else(|e| panic!("nats-server did not start: {e}"))
}

async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(WAIT, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} not done within {WAIT:?}"))
}

async fn connect(server: &NatsServer) -> (Broker, JetStream) {
    let options = BrokerOptions::new([server.url()]).name("classify-test");
    let broker = within("connect", Broker::connect(options))
        .await
        .expect("connect");
    let js = broker.jetstream(WAIT);
    (broker, js)
}

async fn publish(
    js: &JetStream,
    subject: &str,
) -> chorus_broker_adapter::Result<chorus_broker_adapter::PubAck> {
    within(
        "publish",
        js.publish(subject, None, None, None, Bytes::from_static(b"x")),
    )
    .await
}

/// Sends a JetStream API request the adapter has no call for, and fails the test if the
/// server answers with an error.
async fn api(broker: &Broker, subject: &str, body: &'static str) {
    let reply = within(
        subject,
        broker.request(subject, None, Bytes::from_static(body.as_bytes()), WAIT),
    )
    .await
    .expect("api request");
    let text = String::from_utf8_lossy(reply.payload());
    assert!(!text.contains("\"error\""), "{subject}: {text}");
}

#[tokio::test]
async fn a_missing_stream_or_bucket_is_not_found() {
    let server = start(NatsServer::builder());
    let (_broker, js) = connect(&server).await;
    let err = within("stream state", js.stream_state("GONE"))
        .await
        .expect_err("no stream");
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    let err = within("delete", js.delete_message("GONE", 1))
        .await
        .expect_err("no stream to delete from");
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    // The bucket's stream lookup error is the source of the bucket error.
    let err = within("open kv", js.open_kv("gone"))
        .await
        .expect_err("no bucket");
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
}

#[tokio::test]
async fn an_existing_stream_is_left_as_its_owner_configured_it() {
    let server = start(NatsServer::builder());
    let (_broker, js) = connect(&server).await;
    let owners = StreamSpec::new("SHARED", vec!["owned.>".into()]);
    within("ensure stream", js.ensure_stream(&owners))
        .await
        .expect("owner creates");
    let mine = StreamSpec::new("SHARED", vec!["mine.>".into()]);
    within("ensure stream exists", js.ensure_stream_exists(&mine))
        .await
        .expect("the stream is there");
    let ack = publish(&js, "owned.1").await.expect("owner's subject");
    assert_eq!(ack.stream, "SHARED");
    let err = publish(&js, "mine.1").await.expect_err("not captured");
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
}

/// The lookup of `ensure_stream_exists` misses a stream that its create then finds taken: what
/// happens when someone else creates it in between. Here the server's own subject mapping makes
/// the lookup ask for another stream, so the lookup says "not found" every time and the create
/// meets the owner's stream.
#[tokio::test]
async fn a_stream_whose_name_is_taken_at_creation_is_left_to_its_owner() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("mapped.conf");
    std::fs::write(
        &conf,
        format!(
            "listen: \"127.0.0.1:-1\"\n\
             jetstream {{ store_dir: \"{}\" }}\n\
             mappings {{ \"$JS.API.STREAM.INFO.TAKEN\": \"$JS.API.STREAM.INFO.ELSEWHERE\" }}\n",
            dir.path().join("jetstream").display()
        ),
    )
    .expect("write config");
    let server = start(NatsServer::builder().config(&conf));
    let (_broker, js) = connect(&server).await;
    let owners = StreamSpec::new("TAKEN", vec!["owned.>".into()]);
    within("ensure stream", js.ensure_stream(&owners))
        .await
        .expect("owner creates");
    let err = within("stream state", js.stream_state("TAKEN"))
        .await
        .expect_err("the lookup misses it");
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    // The create is refused (the name is in use with another configuration): no error, the
    // owner's stream stays as it is.
    let mine = StreamSpec::new("TAKEN", vec!["mine.>".into()]);
    within("ensure stream exists", js.ensure_stream_exists(&mine))
        .await
        .expect("someone else's stream is there");
    let ack = publish(&js, "owned.1").await.expect("owner's subject");
    assert_eq!(ack.stream, "TAKEN");
    let err = publish(&js, "mine.1").await.expect_err("not captured");
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
}

#[tokio::test]
async fn a_stream_update_the_server_cannot_make_is_invalid_input() {
    let server = start(NatsServer::builder());
    let (_broker, js) = connect(&server).await;
    let mut spec = StreamSpec::new("ORDERS", vec!["orders.>".into()]);
    within("ensure stream", js.ensure_stream(&spec))
        .await
        .expect("create");
    // What a stream may change, it changes.
    spec.subjects.push("refunds.>".into());
    within("ensure stream", js.ensure_stream(&spec))
        .await
        .expect("update");
    assert_eq!(
        publish(&js, "refunds.1").await.expect("new subject").stream,
        "ORDERS"
    );
    // Its retention it may not: the server calls that configuration invalid.
    spec.work_queue = true;
    let err = within("ensure stream", js.ensure_stream(&spec))
        .await
        .expect_err("retention cannot change");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
}

#[tokio::test]
async fn a_publish_expecting_another_last_sequence_is_a_conflict() {
    let server = start(NatsServer::builder());
    let (_broker, js) = connect(&server).await;
    let spec = StreamSpec::new("ORDERS", vec!["orders.>".into()]);
    within("ensure stream", js.ensure_stream(&spec))
        .await
        .expect("create");
    assert_eq!(publish(&js, "orders.1").await.expect("first").sequence, 1);
    let expecting = |sequence: &str| {
        let mut headers = Headers::new();
        headers
            .insert("Nats-Expected-Last-Sequence", sequence)
            .expect("header");
        js.publish(
            "orders.2",
            Some(headers),
            None,
            None,
            Bytes::from_static(b"x"),
        )
    };
    let err = within("publish", expecting("7"))
        .await
        .expect_err("the last sequence is 1");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    let ack = within("publish", expecting("1"))
        .await
        .expect("the last sequence is 1");
    assert_eq!(ack.sequence, 2);
}

#[tokio::test]
async fn a_key_value_write_expecting_another_revision_is_a_conflict() {
    let server = start(NatsServer::builder());
    let (_broker, js) = connect(&server).await;
    let kv = within("ensure kv", js.ensure_kv(&KvSpec::new("leases")))
        .await
        .expect("bucket");
    let first = within("put", kv.put("a", Bytes::from_static(b"1")))
        .await
        .expect("put");
    let second = within("update", kv.update("a", Bytes::from_static(b"2"), first))
        .await
        .expect("at its revision");
    let err = within("update", kv.update("a", Bytes::from_static(b"3"), first))
        .await
        .expect_err("stale revision");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    let err = within("create", kv.create("a", Bytes::from_static(b"3")))
        .await
        .expect_err("exists");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    let err = within("delete if", kv.delete_if("a", first))
        .await
        .expect_err("stale revision");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    within("delete if", kv.delete_if("a", second))
        .await
        .expect("at its revision");
}

#[tokio::test]
async fn deleting_a_message_already_gone_is_no_error() {
    let server = start(NatsServer::builder());
    let (_broker, js) = connect(&server).await;
    let spec = StreamSpec::new("ORDERS", vec!["orders.>".into()]);
    within("ensure stream", js.ensure_stream(&spec))
        .await
        .expect("create");
    let first = publish(&js, "orders.1").await.expect("first").sequence;
    let second = publish(&js, "orders.2").await.expect("second").sequence;
    assert!(
        within("delete", js.delete_message("ORDERS", first))
            .await
            .expect("delete")
    );
    // The server refuses the second delete as failed ("no message found"); the message is
    // gone, so it is no error.
    let again = within("delete", js.delete_message("ORDERS", first)).await;
    assert!(!again.expect("already gone"));
    let never = within("delete", js.delete_message("ORDERS", second + 10)).await;
    assert!(!never.expect("never there"));
    let err = within("get", js.get_message("ORDERS", first))
        .await
        .expect_err("gone");
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    let kept = within("get", js.get_message("ORDERS", second))
        .await
        .expect("the other stays");
    assert_eq!(kept.sequence, second);
}

#[tokio::test]
async fn a_delete_the_stream_does_not_permit_is_an_error() {
    let server = start(NatsServer::builder());
    let (broker, js) = connect(&server).await;
    // `StreamSpec` has no `deny_delete`: the stream is created through JetStream's API.
    api(
        &broker,
        "$JS.API.STREAM.CREATE.LEDGER",
        r#"{"name":"LEDGER","subjects":["ledger.>"],"deny_delete":true}"#,
    )
    .await;
    let sequence = publish(&js, "ledger.1").await.expect("publish").sequence;
    let err = within("delete", js.delete_message("LEDGER", sequence))
        .await
        .expect_err("not permitted");
    assert_eq!(err.kind(), ErrorKind::Broker, "{err}");
    let kept = within("get", js.get_message("LEDGER", sequence))
        .await
        .expect("still there");
    assert_eq!(kept.sequence, sequence);
}
