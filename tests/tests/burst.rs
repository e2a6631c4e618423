//! A burst of 200,000 events at a slow subscriber: memory stays bounded, and every event is
//! either handled or counted as dropped, exactly. (Its own test binary: it measures the
//! resident memory of its whole process, which tests running beside it would grow.)

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::{Context, Envelope, Kind, Performative};
use chorus_tests::{agent_options, eventually, raw_broker, rss_bytes, server, within};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_200k_events_at_a_slow_subscriber_keeps_memory_bounded_and_counts_every_drop() {
    let server = server();
    // The numbers that reached the handler (recorded as it is called), and the calls finished.
    let entered = Arc::new(Mutex::new(Vec::<u32>::new()));
    let finished = Arc::new(AtomicUsize::new(0));
    let slow = agent_options(&server, "slow")
        .queue_capacity(1_000)
        .max_in_flight(4)
        .connect()
        .await
        .expect("connect");
    {
        let entered = Arc::clone(&entered);
        let finished = Arc::clone(&finished);
        slow.on_event("burst.>", move |_ctx: Context, n: u32| {
            entered.lock().expect("lock").push(n);
            let finished = Arc::clone(&finished);
            async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                finished.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        })
        .await
        .expect("subscribe");
    }
    let raw = raw_broker(&server).await;
    let subject = slow.subjects().event("burst.x").expect("subject");
    let event = |n: u32| {
        let mut env = Envelope::new(Kind::Event, Performative::Inform, "firehose");
        env.topic = Some("burst.x".into());
        env.payload = codec::encode_payload(&n, "application/msgpack").expect("payload");
        codec::encode(&env, Encoding::MsgPack).expect("encode")
    };

    const BURST: u32 = 200_000;
    let rss_before = rss_bytes();
    let peak = Arc::new(AtomicU64::new(rss_before));
    let sampler = tokio::spawn({
        let peak = Arc::clone(&peak);
        async move {
            loop {
                peak.fetch_max(rss_bytes(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let started = Instant::now();
    for n in 0..BURST {
        raw.publish(&subject, event(n)).await.expect("publish");
    }
    raw.flush().await.expect("flush");
    let burst_took = started.elapsed();

    // One subscription, one queue, first in first out: once the last event sent has reached
    // the handler, every event before it has been handed on or dropped, and none is still
    // buffered to be counted either way. So send sentinels, one at a time, until the latest
    // one sent is handled (an earlier one may be dropped like any event).
    let mut sent = BURST;
    within(
        Duration::from_secs(60),
        "the last sentinel handled after the burst",
        async {
            loop {
                let sentinel = sent;
                raw.publish(&subject, event(sentinel))
                    .await
                    .expect("publish");
                raw.flush().await.expect("flush");
                sent += 1;
                let arrived = tokio::time::timeout(Duration::from_millis(500), async {
                    while !entered.lock().expect("lock").contains(&sentinel) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
                .await;
                if arrived.is_ok() {
                    break;
                }
            }
        },
    )
    .await;
    eventually(
        Duration::from_secs(60),
        "every handler call finished",
        || async {
            (finished.load(Ordering::SeqCst) == entered.lock().expect("lock").len()).then_some(())
        },
    )
    .await;
    sampler.abort();
    let stats = slow.stats();
    let entered = entered.lock().expect("lock").clone();
    let distinct: HashSet<u32> = entered.iter().copied().collect();
    // What never reached the handler, counted here from the numbers, not from the SDK.
    let missing = u64::from(sent) - distinct.len() as u64;
    let growth = peak.load(Ordering::Relaxed).saturating_sub(rss_before);
    println!(
        "burst: {BURST} events in {burst_took:?}, then {} sentinels; handled {}, missing {missing}, dropped {} (reported by the SDK); RSS {} MiB before, peak growth {} MiB",
        sent - BURST,
        distinct.len(),
        stats.dropped,
        rss_before >> 20,
        growth >> 20
    );
    assert_eq!(distinct.len(), entered.len(), "no event handled twice");
    assert_eq!(
        stats.dropped, missing,
        "the SDK counted exactly the events that never reached the handler"
    );
    assert!(stats.dropped > 0, "the slow subscriber did drop");
    assert!(growth < 128 << 20, "memory grew {} MiB", growth >> 20);
}
