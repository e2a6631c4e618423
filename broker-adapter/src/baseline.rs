//! Raw async-nats baselines for `chorus bench`: the same scenarios as Chorus's, written
//! directly against the client library Chorus is built on, so the two can be compared side by
//! side in one run. Not used by Chorus itself.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;

use crate::{Error, ErrorKind, Result};

async fn connect(url: &str, name: &str) -> Result<async_nats::Client> {
    async_nats::ConnectOptions::new()
        .name(name)
        .connect(url)
        .await
        .map_err(|e| Error::with_source(ErrorKind::Broker, "baseline connect", e))
}

fn err<E: std::error::Error + Send + Sync + 'static>(what: &str) -> impl FnOnce(E) -> Error + '_ {
    move |e| Error::with_source(ErrorKind::Broker, what.to_owned(), e)
}

/// What a throughput run saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throughput {
    /// Messages sent.
    pub sent: u64,
    /// Messages received.
    pub received: u64,
    /// From the first send to the last receipt.
    pub elapsed: Duration,
}

impl Throughput {
    /// Received messages per second.
    pub fn per_second(&self) -> f64 {
        self.received as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Counts items of `stream` until `count` have arrived, or `idle` passes without one (up to
/// 30 s for the first, while the sender sets up). Returns the count and when the last came.
/// Both sides of the stream benchmarks count with this (where Chorus hands messages to a handler
/// instead of a stream, the benchmark counts in the handler, as the raw side counts in its loop).
pub async fn count_arrivals<S: futures::Stream + Unpin>(
    stream: &mut S,
    count: u64,
    idle: Duration,
) -> (u64, Instant) {
    let mut n = 0u64;
    let mut last = Instant::now();
    let mut wait = Duration::from_secs(30).max(idle);
    while n < count {
        match tokio::time::timeout(wait, stream.next()).await {
            Ok(Some(_)) => {
                n += 1;
                last = Instant::now();
                wait = idle;
            }
            _ => break,
        }
    }
    (n, last)
}

/// Publishes `count` messages of `size` bytes to one subscriber on another connection and
/// counts what arrives (waiting at most `idle` after the last arrival).
pub async fn pubsub(
    url: &str,
    count: u64,
    size: usize,
    subscribers: usize,
    idle: Duration,
) -> Result<Throughput> {
    let subject = format!("baseline.pubsub.{}", crate::jetstream::now_ms());
    let mut counters = Vec::new();
    let mut subs = Vec::new();
    for i in 0..subscribers.max(1) {
        let client = connect(url, &format!("baseline-sub-{i}")).await?;
        let mut sub = client
            .subscribe(subject.clone())
            .await
            .map_err(err("baseline subscribe"))?;
        client.flush().await.map_err(err("baseline flush"))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        counters.push(rx);
        subs.push(tokio::spawn(async move {
            let _client = client;
            let _ = tx.send(count_arrivals(&mut sub, count, idle).await);
        }));
    }
    // Let the subscriptions reach the server before publishing.
    let publisher = connect(url, "baseline-pub").await?;
    settle(&publisher, &subject).await?;
    let payload = Bytes::from(vec![0x5a; size]);
    let started = Instant::now();
    for _ in 0..count {
        publisher
            .publish(subject.clone(), payload.clone())
            .await
            .map_err(err("baseline publish"))?;
    }
    publisher.flush().await.map_err(err("baseline flush"))?;
    let mut received = 0;
    let mut end = started;
    for rx in counters {
        if let Ok((n, last)) = rx.await {
            received += n;
            end = end.max(last);
        }
    }
    for s in subs {
        let _ = s.await;
    }
    Ok(Throughput {
        sent: count * subscribers.max(1) as u64,
        received,
        elapsed: end - started,
    })
}

/// Waits until the server has processed this connection's protocol so far.
async fn settle(client: &async_nats::Client, _subject: &str) -> Result<()> {
    let inbox = client.new_inbox();
    let mut sub = client
        .subscribe(inbox.clone())
        .await
        .map_err(err("settle"))?;
    client
        .publish(inbox, Bytes::new())
        .await
        .map_err(err("settle"))?;
    tokio::time::timeout(Duration::from_secs(10), sub.next())
        .await
        .map_err(|_| Error::new(ErrorKind::TimedOut, "settle"))?;
    Ok(())
}

/// Starts a responder echoing every request on `subject`; it stops when the handle drops.
async fn responder(url: &str, subject: &str) -> Result<tokio::task::JoinHandle<()>> {
    let client = connect(url, "baseline-responder").await?;
    let mut sub = client
        .subscribe(subject.to_owned())
        .await
        .map_err(err("baseline subscribe"))?;
    settle(&client, subject).await?;
    Ok(tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            if let Some(reply) = msg.reply {
                let _ = client.publish(reply, msg.payload).await;
            }
        }
    }))
}

/// `n` sequential requests of `size` bytes; returns each round trip.
pub async fn request_latency(url: &str, n: usize, size: usize) -> Result<Vec<Duration>> {
    let subject = format!("baseline.req.{}", crate::jetstream::now_ms());
    let echo = responder(url, &subject).await?;
    let client = connect(url, "baseline-requester").await?;
    let payload = Bytes::from(vec![1u8; size]);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        client
            .request(subject.clone(), payload.clone())
            .await
            .map_err(err("baseline request"))?;
        out.push(t.elapsed());
    }
    echo.abort();
    Ok(out)
}

/// Requests from `concurrency` tasks for `duration`; returns completed requests.
pub async fn request_throughput(
    url: &str,
    concurrency: usize,
    duration: Duration,
    size: usize,
) -> Result<Throughput> {
    let subject = format!("baseline.rt.{}", crate::jetstream::now_ms());
    let echo = responder(url, &subject).await?;
    let client = connect(url, "baseline-requester").await?;
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
                if client
                    .request(subject.clone(), payload.clone())
                    .await
                    .is_ok()
                {
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
    echo.abort();
    Ok(Throughput {
        sent: done,
        received: done,
        elapsed: started.elapsed(),
    })
}

/// Publishes `count` messages of `size` bytes to a JetStream stream with `in_flight` acks
/// outstanding while a durable pull consumer takes and acks them; the time is from the first
/// publish to the last message consumed.
pub async fn jetstream_roundtrip(
    url: &str,
    count: u64,
    size: usize,
    in_flight: usize,
) -> Result<Throughput> {
    use async_nats::jetstream;
    use futures::stream::FuturesUnordered;
    let client = connect(url, "baseline-js").await?;
    let js = jetstream::new(client);
    let name = format!("BASELINE_{}", crate::jetstream::now_ms());
    let subject = format!("baseline.js.{name}");
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            retention: jetstream::stream::RetentionPolicy::WorkQueue,
            ..Default::default()
        })
        .await
        .map_err(err("baseline stream"))?;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("baseline".into()),
            max_ack_pending: 256,
            ..Default::default()
        })
        .await
        .map_err(err("baseline consumer"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(err("baseline messages"))?;
    let reader = tokio::spawn(async move {
        let mut received = 0u64;
        while received < count {
            match tokio::time::timeout(Duration::from_secs(10), messages.next()).await {
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
    for _ in 0..count {
        while pending.len() >= in_flight {
            let _ = pending.next().await;
        }
        let ack = js
            .publish(subject.clone(), payload.clone())
            .await
            .map_err(err("baseline js publish"))?;
        pending.push(ack.into_future());
    }
    while pending.next().await.is_some() {}
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
