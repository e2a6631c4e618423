//! The raw baseline: the same scenarios as Chorus's, written directly against async-nats
//! (through `chorus_broker_adapter::raw`, which adds nothing to each call), so the two can be
//! compared side by side in one run.

use std::time::{Duration, Instant};

use bytes::Bytes;
use chorus_broker_adapter::raw::{RawClient, RawJetStream};
use chorus_broker_adapter::{Error, ErrorKind, Result};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::measure::{Throughput, count_arrivals};

/// How long the reader of the JetStream scenario waits for each next message.
const JETSTREAM_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`settle`] waits for the server's echo.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

fn unique(prefix: &str) -> String {
    format!("{prefix}.{}", uuid::Uuid::now_v7().simple())
}

/// Waits for `publisher` to reach the server, publishes `count` messages of `size` bytes on
/// `subject` and flushes; returns when the publishing began.
async fn publish_burst(
    publisher: &RawClient,
    subject: &str,
    count: u64,
    size: usize,
) -> Result<Instant> {
    settle(publisher).await?;
    let payload = Bytes::from(vec![0x5a; size]);
    let subject = chorus_broker_adapter::Subject::from(subject);
    let started = Instant::now();
    for _ in 0..count {
        publisher.publish_to(&subject, payload.clone()).await?;
    }
    publisher.flush().await?;
    Ok(started)
}

/// Publishes `count` messages of `size` bytes with nobody subscribed, until the server has
/// them all (a flush): the sender's side of the events alone.
pub(crate) async fn publish_only(url: &str, count: u64, size: usize) -> Result<Throughput> {
    let subject = unique("baseline.publish");
    let publisher = RawClient::connect(url, "baseline-pub-only").await?;
    let started = publish_burst(&publisher, &subject, count, size).await?;
    Ok(Throughput {
        sent: count,
        received: count,
        elapsed: started.elapsed(),
    })
}

/// Publishes `count` messages of `size` bytes to `subscribers` subscribers, each on its own
/// connection, and counts what arrives (waiting at most `idle` after the last arrival).
pub(crate) async fn pubsub(
    url: &str,
    count: u64,
    size: usize,
    subscribers: usize,
    idle: Duration,
) -> Result<Throughput> {
    let subject = unique("baseline.pubsub");
    let mut counters = Vec::new();
    for i in 0..subscribers.max(1) {
        let client = RawClient::connect(url, &format!("baseline-sub-{i}")).await?;
        let mut sub = client.subscribe(&subject).await?;
        client.flush().await?;
        counters.push(tokio::spawn(async move {
            let _client = client;
            count_arrivals(&mut sub, count, idle).await
        }));
    }
    // Let the subscriptions reach the server before publishing.
    let publisher = RawClient::connect(url, "baseline-pub").await?;
    let started = publish_burst(&publisher, &subject, count, size).await?;
    let mut received = 0;
    let mut end = started;
    for counter in counters {
        if let Ok((n, last)) = counter.await {
            received += n;
            end = end.max(last);
        }
    }
    Ok(Throughput {
        sent: count * subscribers.max(1) as u64,
        received,
        elapsed: end - started,
    })
}

/// The raw side's yardstick: the plainest async-nats program
/// (`chorus_broker_adapter::raw::plain_pubsub`, the adapter's example `plain_pubsub`) run as a
/// process of its own, as an independent program would be, with `count` messages of `size`
/// bytes; built beside `program` first.
pub(crate) async fn plain_pubsub(
    program: &std::path::Path,
    url: &str,
    count: u64,
    size: usize,
) -> anyhow::Result<Throughput> {
    let example =
        crate::memory::build_example(program, "chorus-broker-adapter", &["raw"], "plain_pubsub")
            .await?;
    let run = tokio::process::Command::new(&example)
        .args([url, &count.to_string(), &size.to_string()])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(PLAIN_LIMIT, run)
        .await
        .map_err(|_| anyhow::anyhow!("plain_pubsub took over {PLAIN_LIMIT:?}"))??;
    let said = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "plain_pubsub {}: {}{}",
        out.status,
        said.trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    // "<received> of <count> messages of <size> B in <elapsed>: <rate> msg/s"
    let mut words = said.split_whitespace();
    let received: u64 = words.next().unwrap_or("").parse()?;
    let rate: f64 = said
        .rsplit(": ")
        .next()
        .and_then(|r| r.trim().strip_suffix(" msg/s"))
        .ok_or_else(|| anyhow::anyhow!("plain_pubsub said {said:?}"))?
        .parse()?;
    Ok(Throughput {
        sent: count,
        received,
        elapsed: Duration::from_secs_f64(received as f64 / rate.max(1e-9)),
    })
}

/// How long the yardstick may take to deliver its messages.
const PLAIN_LIMIT: Duration = Duration::from_secs(120);

/// Waits until the server has processed this connection's protocol so far.
async fn settle(client: &RawClient) -> Result<()> {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(&inbox).await?;
    client.publish(&inbox, Bytes::new()).await?;
    tokio::time::timeout(SETTLE_TIMEOUT, sub.next())
        .await
        .map_err(|_| Error::new(ErrorKind::TimedOut, "settle"))?;
    Ok(())
}

/// A responder echoing every request on its subject, until stopped.
struct Responder {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Responder {
    async fn start(url: &str, subject: &str) -> Result<Responder> {
        let client = RawClient::connect(url, "baseline-responder").await?;
        let mut sub = client.subscribe(subject).await?;
        settle(&client).await?;
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    msg = sub.next() => msg,
                    _ = stopped.cancelled() => break,
                };
                let Some(msg) = msg else { break };
                let payload = msg.payload().clone();
                let _ = client.respond(msg, payload).await;
            }
        });
        Ok(Responder { stop, task })
    }

    async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// `n` sequential requests of `size` bytes; returns each round trip.
pub(crate) async fn request_latency(url: &str, n: usize, size: usize) -> Result<Vec<Duration>> {
    let subject = unique("baseline.req");
    let echo = Responder::start(url, &subject).await?;
    let client = RawClient::connect(url, "baseline-requester").await?;
    let payload = Bytes::from(vec![1u8; size]);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        client.request(&subject, payload.clone()).await?;
        out.push(t.elapsed());
    }
    echo.stop().await;
    Ok(out)
}

/// Requests from `concurrency` tasks for `duration`; returns completed requests.
pub(crate) async fn request_throughput(
    url: &str,
    concurrency: usize,
    duration: Duration,
    size: usize,
) -> Result<Throughput> {
    let subject = unique("baseline.rt");
    let echo = Responder::start(url, &subject).await?;
    let client = RawClient::connect(url, "baseline-requester").await?;
    let payload = Bytes::from(vec![1u8; size]);
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let client = client.clone();
        let subject = subject.clone();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                if client.request(&subject, payload.clone()).await.is_ok() {
                    n += 1;
                }
            }
            n
        }));
    }
    let mut done = 0;
    for t in tasks {
        done += t.await.unwrap_or(0);
    }
    echo.stop().await;
    Ok(Throughput {
        sent: done,
        received: done,
        elapsed: started.elapsed(),
    })
}

/// How [`jetstream_roundtrip`] publishes and consumes: today's design (what Chorus's durable
/// path does, with async-nats alone) and the candidates measured beside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum JsDesign {
    /// One publish per message, its ack awaited with the others in flight; a plain durable
    /// pull consumer.
    Today,
    /// Atomic batches of this many messages (nats-server 2.12+), one ack per batch, as many
    /// batches in flight as make the same number of messages outstanding.
    AtomicBatches(usize),
    /// Publishes as today; the pull consumer in a priority group (nats-server 2.12+).
    PriorityGroup,
}

/// Publishes `count` messages of `size` bytes to a JetStream stream with `in_flight` messages
/// awaiting their acks while a durable pull consumer takes and acks them, as `design` says;
/// the time is from the first publish to the last message consumed.
pub(crate) async fn jetstream_roundtrip(
    url: &str,
    count: u64,
    size: usize,
    in_flight: usize,
    design: JsDesign,
) -> Result<Throughput> {
    use futures::stream::FuturesUnordered;
    let client = RawClient::connect(url, "baseline-js").await?;
    let js: RawJetStream = client.jetstream();
    let name = format!("BASELINE_{}", uuid::Uuid::now_v7().simple());
    let subject = format!("baseline.js.{name}");
    let stream = match design {
        JsDesign::AtomicBatches(_) => js.create_atomic_work_queue(&name, &subject).await?,
        _ => js.create_work_queue(&name, &subject).await?,
    };
    let max_ack_pending = i64::try_from(in_flight).unwrap_or(i64::MAX);
    let mut messages = match design {
        JsDesign::PriorityGroup => stream.pull_in_group("baseline", max_ack_pending).await?,
        _ => stream.pull("baseline", max_ack_pending).await?,
    };
    let reader = tokio::spawn(async move {
        let mut received = 0u64;
        while received < count {
            match tokio::time::timeout(JETSTREAM_READ_TIMEOUT, messages.next()).await {
                Ok(Some(Ok(m))) => {
                    let _ = m.ack().await;
                    received += 1;
                }
                _ => break,
            }
        }
        (received, Instant::now())
    });
    let payload = Bytes::from(vec![7u8; size]);
    let started = Instant::now();
    let mut pending = FuturesUnordered::new();
    let published = async {
        match design {
            JsDesign::AtomicBatches(batch) => {
                let batch = batch.max(1);
                let batches_in_flight = (in_flight / batch).max(1);
                let mut left = count;
                while left > 0 {
                    while pending.len() >= batches_in_flight {
                        if let Some(acked) = pending.next().await {
                            acked?;
                        }
                    }
                    let n = usize::try_from(left).unwrap_or(usize::MAX).min(batch);
                    let payloads = vec![payload.clone(); n];
                    let ack = js.publish_atomic_batch(&subject, &payloads).await?;
                    pending.push(ack.wait());
                    left -= n as u64;
                }
            }
            JsDesign::Today | JsDesign::PriorityGroup => {
                for _ in 0..count {
                    while pending.len() >= in_flight {
                        let _ = pending.next().await;
                    }
                    let ack = js.publish(&subject, payload.clone()).await?;
                    pending.push(ack.wait());
                }
            }
        }
        while let Some(acked) = pending.next().await {
            if matches!(design, JsDesign::AtomicBatches(_)) {
                acked?;
            }
        }
        Result::Ok(())
    }
    .await;
    if let Err(e) = published {
        reader.abort();
        let _ = js.delete_stream(&name).await;
        return Err(e);
    }
    let (received, end) = reader
        .await
        .map_err(|e| Error::with_source(ErrorKind::Broker, "baseline reader", e))?;
    let _ = js.delete_stream(&name).await;
    Ok(Throughput {
        sent: count,
        received,
        elapsed: end - started,
    })
}

/// `n` round trips of `size` bytes through a JetStream object store bucket (put, then get),
/// with async-nats alone.
pub(crate) async fn object_transfer(url: &str, size: usize, n: usize) -> Result<Vec<Duration>> {
    let client = RawClient::connect(url, "baseline-objects").await?;
    let js = client.jetstream();
    let bucket = unique("baseline_objects").replace('.', "_");
    let data = crate::scenarios::noise(size);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let back = js
            .object_round_trip(&bucket, &format!("o{i}"), &data, 512 * 1024)
            .await?;
        out.push(t.elapsed());
        if back.len() != size {
            return Err(Error::new(ErrorKind::Broker, "object came back short"));
        }
    }
    Ok(out)
}
