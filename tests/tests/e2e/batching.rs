//! Automatic batching (issue 39, item 4) through a real server: a batcher sends a batch when it
//! holds N messages, or T after its first one, or on flush; each message still reaches its
//! receiver as its own envelope, in order; durable commands come back with their receipts;
//! what is queued when the agent shuts down is sent, and queuing after is refused.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chorus_sdk::{Batching, Call, Context, DeliveryClass, HandlerError, Publish, SdkError};
use chorus_tests::{WAIT, agent, agent_options, eventually, server, within};
use futures::StreamExt;

fn tick(n: u32) -> Publish {
    Publish::topic("ticks").payload(&n).expect("payload")
}

/// A full batch goes at once; the rest waits for its delay or a flush. 25 events with batches
/// of 10 and a long delay: two batches leave by size, the last five on flush, and the
/// subscriber reads 25 envelopes, each its own (distinct ids), in the order queued.
#[tokio::test]
async fn a_batch_leaves_when_full_or_flushed_and_each_message_is_its_own_envelope() {
    let server = server();
    let listener = agent(&server, "listener").await;
    let mut ticks = listener.subscribe("ticks").await.expect("subscribe");
    let publisher = agent(&server, "full-batches").await;
    let batcher = publisher
        .batcher(
            Batching::new()
                .max_messages(10)
                .max_delay(Duration::from_secs(50)),
        )
        .expect("batcher");
    let mut queued = Vec::new();
    for n in 0..25u32 {
        queued.push(batcher.publish(tick(n)).await.expect("queued"));
    }
    // Two full batches left by size; the five after them wait (the delay is 50 s).
    let mut seen = Vec::new();
    while seen.len() < 20 {
        let event = within(WAIT, "a tick", ticks.next())
            .await
            .expect("stream open");
        seen.push(event);
    }
    let stats = eventually(WAIT, "two batches counted", || async {
        let s = publisher.stats();
        (s.batches_sent == 2).then_some(s)
    })
    .await;
    assert_eq!(stats.batched_messages, 20);
    within(WAIT, "flush", batcher.flush())
        .await
        .expect("flushed");
    while seen.len() < 25 {
        let event = within(WAIT, "a tick", ticks.next())
            .await
            .expect("stream open");
        seen.push(event);
    }
    for sent in queued {
        within(WAIT, "queued event", sent).await.expect("sent");
    }
    let numbers: Vec<u32> = seen
        .iter()
        .map(|e| e.payload_as::<u32>().expect("a number"))
        .collect();
    assert_eq!(numbers, (0..25).collect::<Vec<_>>());
    let mut ids: Vec<_> = seen.iter().map(|e| e.envelope.id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 25, "each event is its own envelope");
    assert!(
        seen.iter()
            .all(|e| e.envelope.from.as_str() == "full-batches")
    );
    let stats = publisher.stats();
    assert_eq!((stats.batches_sent, stats.batched_messages), (3, 25));
    // The agent's metrics say the same.
    let text = chorus_sdk::metrics::render(chorus_sdk::metrics::registry());
    assert!(
        text.contains(r#"chorus_agent_batched_total{agent="full-batches",unit="batches"} 3"#)
            && text
                .contains(r#"chorus_agent_batched_total{agent="full-batches",unit="messages"} 25"#),
        "{text}"
    );
    batcher.close().await;
    publisher.shutdown().await;
    listener.shutdown().await;
}

/// A batch that does not fill goes when its delay has passed since its first message, with
/// no flush: three events queued together arrive as one batch, no sooner than the delay.
#[tokio::test]
async fn a_batch_that_does_not_fill_leaves_after_its_delay() {
    let server = server();
    let listener = agent(&server, "listener").await;
    let mut ticks = listener.subscribe("ticks").await.expect("subscribe");
    let publisher = agent(&server, "publisher").await;
    let delay = Duration::from_millis(400);
    let batcher = publisher
        .batcher(Batching::new().max_messages(1_000).max_delay(delay))
        .expect("batcher");
    let started = Instant::now();
    let mut queued = Vec::new();
    for n in 0..3u32 {
        queued.push(batcher.publish(tick(n)).await.expect("queued"));
    }
    for sent in queued {
        within(WAIT, "queued event", sent).await.expect("sent");
    }
    assert!(
        started.elapsed() >= delay,
        "sent after {:?}, before the delay",
        started.elapsed()
    );
    for n in 0..3u32 {
        let event = within(WAIT, "a tick", ticks.next())
            .await
            .expect("stream open");
        assert_eq!(event.payload_as::<u32>().expect("a number"), n);
    }
    let stats = publisher.stats();
    assert_eq!((stats.batches_sent, stats.batched_messages), (1, 3));
    batcher.close().await;
    publisher.shutdown().await;
    listener.shutdown().await;
}

/// Durable commands through a batcher come back with their receipts (stored: a stream
/// sequence each), and the worker handles each once; core commands and events may share a
/// batch with them.
#[tokio::test]
async fn commands_through_a_batcher_are_stored_with_receipts_and_handled() {
    let server = server();
    let _coordinator = chorus_tests::coordinator(&server, false).await;
    let worker = agent_options(&server, "worker")
        .durable_inbox(true)
        .connect()
        .await
        .expect("worker");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    worker
        .on_command("work", move |_ctx: Context, n: u32| {
            record.lock().expect("lock").push(n);
            async { Ok::<_, HandlerError>(()) }
        })
        .await
        .expect("serve work");
    let sender = agent(&server, "sender").await;
    let batcher = sender
        .batcher(
            Batching::new()
                .max_messages(16)
                .max_delay(Duration::from_millis(20)),
        )
        .expect("batcher");
    let work = |n: u32, class: DeliveryClass| {
        Call::agent("worker", "work")
            .command()
            .delivery(class)
            .payload(&n)
            .expect("payload")
    };
    let mut receipts = Vec::new();
    for n in 0..40u32 {
        let class = if n % 4 == 3 {
            DeliveryClass::AtMostOnce
        } else {
            DeliveryClass::AtLeastOnce
        };
        receipts.push((class, batcher.send(work(n, class)).await.expect("queued")));
    }
    let mut stored = Vec::new();
    for (class, receipt) in receipts {
        let receipt = within(WAIT, "receipt", receipt).await.expect("sent");
        assert_eq!(receipt.delivery, class);
        if class == DeliveryClass::AtLeastOnce {
            stored.push(receipt.stream_seq.expect("a stream sequence"));
        }
    }
    assert_eq!(stored.len(), 30);
    stored.sort_unstable();
    stored.dedup();
    assert_eq!(stored.len(), 30, "each durable command stored once");
    eventually(WAIT, "the worker handled all 40", || async {
        (seen.lock().expect("lock").len() >= 40).then_some(())
    })
    .await;
    let mut handled = seen.lock().expect("lock").clone();
    handled.sort_unstable();
    assert_eq!(handled, (0..40).collect::<Vec<_>>());
    let stats = sender.stats();
    assert_eq!(stats.batched_messages, 40);
    assert!(stats.batches_sent >= 3, "{stats:?}");
    batcher.close().await;
    sender.shutdown().await;
    worker.shutdown().await;
}

/// What is queued when the agent shuts down is sent before the connection goes; queuing after
/// is refused with ShuttingDown. Bad settings are refused up front.
#[tokio::test]
async fn shutdown_sends_what_is_queued_and_refuses_more() {
    let server = server();
    let listener = agent(&server, "listener").await;
    let mut ticks = listener.subscribe("ticks").await.expect("subscribe");
    let publisher = agent(&server, "publisher").await;
    for bad in [
        Batching::new().max_messages(0),
        Batching::new().max_messages(chorus_sdk::MAX_BATCH_MESSAGES + 1),
        Batching::new().max_delay(Duration::ZERO),
        Batching::new().max_delay(chorus_sdk::MAX_BATCH_DELAY + Duration::from_secs(1)),
    ] {
        let err = publisher.batcher(bad).expect_err("refused");
        assert!(matches!(err, SdkError::InvalidCall(_)), "{err}");
    }
    let batcher = publisher
        .batcher(Batching::new().max_delay(Duration::from_secs(50)))
        .expect("batcher");
    let mut queued = Vec::new();
    for n in 0..5u32 {
        queued.push(batcher.publish(tick(n)).await.expect("queued"));
    }
    within(WAIT, "shutdown", publisher.shutdown()).await;
    for sent in queued {
        within(WAIT, "queued event", sent)
            .await
            .expect("sent at shutdown");
    }
    for n in 0..5u32 {
        let event = within(WAIT, "a tick", ticks.next())
            .await
            .expect("stream open");
        assert_eq!(event.payload_as::<u32>().expect("a number"), n);
    }
    let err = batcher.publish(tick(5)).await.expect_err("refused");
    assert!(matches!(err, SdkError::ShuttingDown), "{err}");
    assert!(publisher.batcher(Batching::new()).is_err());
    listener.shutdown().await;
}

/// 002's `flow_control` in an agent's configuration file: `[batching]` sets what
/// `default_batcher` batches by, here 3 messages and a delay too long to matter.
#[tokio::test]
async fn the_configuration_file_s_batching_is_the_default_batcher_s() {
    let server = server();
    let listener = agent(&server, "config-listener").await;
    let mut ticks = listener.subscribe("ticks").await.expect("subscribe");
    let config = chorus_sdk::AgentConfig::parse(&format!(
        "id = \"configured-batches\"\n[bus]\nservers = \"{}\"\n\
         [batching]\nmax_messages = 3\nmax_delay_ms = 50000\n",
        server.url()
    ))
    .expect("a configuration");
    let publisher = within(
        WAIT,
        "connect",
        config.options(None).expect("options").connect(),
    )
    .await
    .expect("connect");
    let batcher = publisher.default_batcher().expect("batcher");
    for n in 0..3u32 {
        let _sent = batcher.publish(tick(n)).await.expect("queued");
    }
    // Three make a full batch: it leaves without a flush, long before its delay.
    for _ in 0..3 {
        within(WAIT, "a tick", ticks.next())
            .await
            .expect("stream open");
    }
    let stats = eventually(WAIT, "one batch counted", || async {
        let s = publisher.stats();
        (s.batches_sent == 1).then_some(s)
    })
    .await;
    assert_eq!(stats.batched_messages, 3);
}
