//! The Chorus side of each scenario, through the SDK as an application would use it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::envelope::CONTENT_TYPE_MSGPACK;
use chorus_sdk::{
    Agent, AgentOptions, Call, Context, DeliveryClass, Envelope, HandlerError, Kind, Manifest,
    Performative,
};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::CoordinatorLauncher;
use crate::measure::{IDLE, Tally, Throughput, count_arrivals};

mod gateway;

pub(crate) use gateway::{gateway_a2a, gateway_https, gateway_latency, gateway_mcp};

/// Events queued per agent before the SDK drops: enough for a whole burst.
const QUEUE_CAPACITY: usize = 64 * 1024;
/// How long the discovery scenario waits for the coordinator to register every agent.
pub(crate) const REGISTRATION_DEADLINE: Duration = Duration::from_secs(30);
/// How often it looks.
pub(crate) const REGISTRATION_POLL: Duration = Duration::from_millis(50);
/// Heartbeat period the synthetic agents announce: they never send a second one.
const FAKE_HEARTBEAT_MS: u64 = 60_000;

/// The bus the Chorus side of a scenario runs on: the server, and the envelope form its
/// agents write.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bus<'a> {
    pub(crate) url: &'a str,
    pub(crate) wire: chorus_sdk::Encoding,
}

impl Bus<'_> {
    /// Options for agent `id` on this bus.
    pub(crate) fn options(&self, id: &str) -> AgentOptions {
        AgentOptions::new(id)
            .servers([self.url])
            .encoding(self.wire)
    }
}

pub(crate) async fn agent(bus: &Bus<'_>, id: &str) -> anyhow::Result<Agent> {
    Ok(bus
        .options(id)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .queue_capacity(QUEUE_CAPACITY)
        .connect()
        .await?)
}

/// Chorus: `count` events of `size` bytes from one agent to `subscribers` agents.
pub(crate) async fn chorus_events(
    bus: &Bus<'_>,
    count: u64,
    size: usize,
    subscribers: usize,
) -> anyhow::Result<Throughput> {
    let topic = format!("bench.events.{}", uuid::Uuid::now_v7().simple());
    let mut counters = Vec::new();
    let mut keep = Vec::new();
    for i in 0..subscribers {
        let sub = agent(bus, &format!("bench-sub-{i}")).await?;
        let mut events = sub.subscribe(&topic).await?;
        keep.push(sub);
        counters.push(tokio::spawn(async move {
            count_arrivals(&mut events, count, IDLE).await
        }));
    }
    let publisher = agent(bus, "bench-pub").await?;
    let started = publish_burst(&publisher, &topic, count, size).await?;
    let mut received = 0;
    let mut end = started;
    for counter in counters {
        if let Ok((n, last)) = counter.await {
            received += n;
            end = end.max(last);
        }
    }
    for a in keep {
        a.shutdown().await;
    }
    publisher.shutdown().await;
    Ok(Throughput {
        sent: count * subscribers as u64,
        received,
        elapsed: end - started,
    })
}

/// Chorus: `count` events of `size` bytes with nobody subscribed, until the server has them all
/// (a flush): what the SDK costs a sender.
pub(crate) async fn chorus_publish_only(
    bus: &Bus<'_>,
    count: u64,
    size: usize,
) -> anyhow::Result<Throughput> {
    let topic = format!("bench.publish.{}", uuid::Uuid::now_v7().simple());
    let publisher = agent(bus, "bench-pub-only").await?;
    let started = publish_burst(&publisher, &topic, count, size).await?;
    let elapsed = started.elapsed();
    publisher.shutdown().await;
    Ok(Throughput {
        sent: count,
        received: count,
        elapsed,
    })
}

/// Publishes `count` events of `size` bytes on `topic` and flushes; returns when it began.
async fn publish_burst(
    publisher: &Agent,
    topic: &str,
    count: u64,
    size: usize,
) -> anyhow::Result<Instant> {
    let payload = Bytes::from(vec![0x5a; size]);
    let started = Instant::now();
    for _ in 0..count {
        publisher
            .publish_raw(topic, payload.clone(), "application/octet-stream")
            .await?;
    }
    publisher.broker().flush().await?;
    Ok(started)
}

async fn echo_agent(bus: &Bus<'_>, id: &str) -> anyhow::Result<Agent> {
    let echo = agent(bus, id).await?;
    echo.handle_command("echo", EchoHandler).await?;
    Ok(echo)
}

/// Replies with the request's payload as it is (no decode, no encode): the SDK's own cost.
struct EchoHandler;

impl chorus_sdk::Handler for EchoHandler {
    fn call(
        &self,
        ctx: Context,
    ) -> chorus_sdk::BoxFuture<Result<chorus_sdk::Output, HandlerError>> {
        let m = ctx.message();
        let out = chorus_sdk::Output {
            payload: m.payload.clone(),
            content_type: m.content_type.clone(),
        };
        Box::pin(async move { Ok(out) })
    }
}

fn echo_call(id: &str, payload: &Bytes) -> Call {
    Call::agent(id, "echo").raw_payload(payload.clone(), "application/octet-stream")
}

pub(crate) async fn chorus_latency(
    bus: &Bus<'_>,
    n: usize,
    size: usize,
) -> anyhow::Result<Vec<Duration>> {
    let echo = echo_agent(bus, "bench-echo").await?;
    let client = agent(bus, "bench-client").await?;
    let payload = Bytes::from(vec![1u8; size]);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        client.call(echo_call("bench-echo", &payload)).await?;
        out.push(t.elapsed());
    }
    client.shutdown().await;
    echo.shutdown().await;
    Ok(out)
}

/// Chorus tasks, sequential: `n` tasks submitted to an agent that answers at once (from
/// submission to the completed report), and `n` tasks streaming `chunks` chunks (from
/// submission to the first chunk read by the requester). Every state, chunk and report is
/// stored in JetStream on the way.
pub(crate) async fn chorus_tasks(
    bus: &Bus<'_>,
    n: usize,
    size: usize,
    chunks: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let worker = agent(bus, "bench-tasker").await?;
    worker
        .on_task(
            "echo",
            |task: chorus_sdk::TaskContext, data: Bytes| async move {
                drop(task);
                Ok::<_, HandlerError>(data)
            },
        )
        .await?;
    worker
        .on_task(
            "stream",
            move |task: chorus_sdk::TaskContext, data: Bytes| async move {
                for i in 1..=chunks {
                    if i == chunks {
                        task.last_chunk(&data).await?;
                    } else {
                        task.chunk(&data).await?;
                    }
                }
                Ok::<_, HandlerError>(chunks)
            },
        )
        .await?;
    let client = agent(bus, "bench-task-client").await?;
    let payload = Bytes::from(vec![1u8; size]);
    let mut round_trips = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let task = client
            .submit(Call::agent("bench-tasker", "echo").payload(&payload)?)
            .await?;
        let report = task.result().await?;
        anyhow::ensure!(report.is_completed(), "task ended {}", report.state);
        round_trips.push(t.elapsed());
    }
    let mut first_chunks = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let task = client
            .submit(Call::agent("bench-tasker", "stream").payload(&payload)?)
            .await?;
        let mut updates = task.updates().await?;
        let mut first = None;
        let mut seen = 0;
        while let Some(update) = futures::StreamExt::next(&mut updates).await {
            if update?.chunk().is_some() {
                first.get_or_insert_with(|| t.elapsed());
                seen += 1;
            }
        }
        anyhow::ensure!(seen == chunks, "{seen} of {chunks} chunks read");
        first_chunks.extend(first);
    }
    client.shutdown().await;
    worker.shutdown().await;
    Ok((round_trips, first_chunks))
}

/// Contract-net rounds, sequential: `n` rounds among `bidders` agents, each from the call for
/// proposals until the winner's task has completed.
pub(crate) async fn chorus_negotiation(
    bus: &Bus<'_>,
    n: usize,
    bidders: usize,
) -> anyhow::Result<Vec<Duration>> {
    use chorus_sdk::negotiate::{Negotiation, Proposal};
    let mut agents = Vec::new();
    let mut ids = Vec::new();
    for i in 0..bidders {
        let id = format!("bench-bidder-{i}");
        let a = agent(bus, &id).await?;
        #[allow(clippy::cast_precision_loss)]
        let price = (bidders - i) as f64;
        a.on_bid("bench.work", move |_ctx: Context, (): ()| async move {
            Ok(Proposal::at(price))
        })
        .await?;
        a.on_task_capability(
            "bench.work",
            |_task: chorus_sdk::TaskContext, (): ()| async { Ok::<_, HandlerError>(()) },
        )
        .await?;
        agents.push(a);
        ids.push(id);
    }
    let client = agent(bus, "bench-negotiator").await?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let award = client
            .negotiate(
                Negotiation::capability("bench.work")
                    .payload(&())?
                    .bidders(ids.iter().cloned()),
            )
            .await?;
        let report = award.task.result().await?;
        anyhow::ensure!(report.is_completed(), "task ended {}", report.state);
        out.push(t.elapsed());
    }
    client.shutdown().await;
    for a in agents {
        a.shutdown().await;
    }
    Ok(out)
}

/// What the routing scenario measured in one mode: each request's latency, and how many of
/// them the slow holder answered.
pub(crate) struct Routed {
    pub(crate) latencies: Vec<Duration>,
    pub(crate) to_slow: usize,
}

/// Work one request takes at the routing scenario's fast holders and at its slow one.
pub(crate) const ROUTE_FAST: Duration = Duration::from_micros(500);
pub(crate) const ROUTE_SLOW: Duration = Duration::from_millis(5);

/// Chorus: three holders of a capability, one ten times slower than the others, with a
/// coordinator; `n` requests, `concurrency` at a time, first through the queue group, then
/// routed to the least-loaded holder. Returns (queue group, least loaded).
pub(crate) async fn chorus_routing(
    url: &str,
    launcher: &dyn CoordinatorLauncher,
    wire: chorus_sdk::Encoding,
    n: usize,
    concurrency: usize,
) -> anyhow::Result<(Routed, Routed)> {
    let coordinator = launcher.start(url).await?;
    let bus = Bus { url, wire };
    let mut holders = Vec::new();
    for (id, work) in [
        ("bench-holder-slow", ROUTE_SLOW),
        ("bench-holder-fast-1", ROUTE_FAST),
        ("bench-holder-fast-2", ROUTE_FAST),
    ] {
        let holder = bus
            .options(id)
            .heartbeat_interval(Duration::from_millis(500))
            .service_discovery(false)
            .max_in_flight(16)
            .connect()
            .await?;
        holder
            .on_capability("bench.route", move |ctx: Context, (): ()| async move {
                tokio::time::sleep(work).await;
                Ok::<_, HandlerError>(ctx.agent_id().to_owned())
            })
            .await?;
        holders.push(holder);
    }
    let deadline = Instant::now() + REGISTRATION_DEADLINE;
    while coordinator.registered() < holders.len() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the coordinator did not register the holders"
        );
        tokio::time::sleep(REGISTRATION_POLL).await;
    }
    let client = agent(&bus, "bench-router").await?;
    let run = |least_loaded: bool| {
        let client = client.clone();
        async move {
            let calls = futures::stream::iter(0..n).map(|_| {
                let client = client.clone();
                async move {
                    let mut call = Call::capability("bench.route").payload(&())?;
                    if least_loaded {
                        call = call.least_loaded();
                    }
                    let t = Instant::now();
                    let who: String = client.call(call).await?.payload_as()?;
                    Ok::<_, anyhow::Error>((t.elapsed(), who == "bench-holder-slow"))
                }
            });
            let mut out = Routed {
                latencies: Vec::with_capacity(n),
                to_slow: 0,
            };
            let mut done = calls.buffer_unordered(concurrency);
            while let Some(one) = done.next().await {
                let (latency, slow) = one?;
                out.latencies.push(latency);
                out.to_slow += usize::from(slow);
            }
            Ok::<_, anyhow::Error>(out)
        }
    };
    let queue_group = run(false).await?;
    let least_loaded = run(true).await?;
    client.shutdown().await;
    for h in holders {
        h.shutdown().await;
    }
    coordinator.shutdown().await;
    Ok((queue_group, least_loaded))
}

/// Chorus: `concurrency` requesters calling an echo agent for `duration`. With `signed`, the
/// client signs every request and the echo agent verifies each (in batches).
pub(crate) async fn chorus_request_throughput(
    bus: &Bus<'_>,
    concurrency: usize,
    duration: Duration,
    size: usize,
    signed: bool,
) -> anyhow::Result<Throughput> {
    let (echo, client) = if signed {
        use chorus_sdk::security::{Identity, SignaturePolicy};
        let identity = Identity::generate();
        let echo = bus
            .options("bench-echo")
            .heartbeat_interval(Duration::ZERO)
            .service_discovery(false)
            .queue_capacity(QUEUE_CAPACITY)
            .verify_signatures(SignaturePolicy {
                require_signed: true,
                ..SignaturePolicy::default()
            })
            .trust("bench-client", identity.public_key())
            .connect()
            .await?;
        echo.handle_command("echo", EchoHandler).await?;
        let client = bus
            .options("bench-client")
            .heartbeat_interval(Duration::ZERO)
            .service_discovery(false)
            .identity(identity)
            .connect()
            .await?;
        (echo, client)
    } else {
        (
            echo_agent(bus, "bench-echo").await?,
            agent(bus, "bench-client").await?,
        )
    };
    let payload = Bytes::from(vec![1u8; size]);
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let client = client.clone();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                if client.call(echo_call("bench-echo", &payload)).await.is_ok() {
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
    client.shutdown().await;
    echo.shutdown().await;
    Ok(Throughput {
        sent: done,
        received: done,
        elapsed: started.elapsed(),
    })
}

pub(crate) async fn chorus_durable(
    bus: &Bus<'_>,
    count: u64,
    size: usize,
    consumers: chorus_sdk::durable::InboxConsumers,
) -> anyhow::Result<Throughput> {
    let id = format!("bench-durable-{}", uuid::Uuid::now_v7().simple());
    let worker = bus
        .options(&id)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .durable_inbox(true)
        .inbox_consumers(consumers)
        .connect()
        .await?;
    let tally = Arc::new(Tally::new(count));
    worker
        .handle_command("work", SignalHandler(Arc::clone(&tally)))
        .await?;
    let sender = agent(bus, "bench-sender").await?;
    let payload = Bytes::from(vec![7u8; size]);
    let started = Instant::now();
    let calls: Vec<Call> = (0..count)
        .map(|_| {
            Call::agent(id.clone(), "work")
                .command()
                .delivery(DeliveryClass::AtLeastOnce)
                .raw_payload(payload.clone(), "application/octet-stream")
        })
        .collect();
    // One batch, so that 256 acks stay in flight from the first publish to the last, as on
    // the raw side (chunks would drain the window at each boundary).
    for r in sender.send_batch(calls).await {
        r?;
    }

    let (received, end) = tally.wait(IDLE).await;

    sender.shutdown().await;
    worker.shutdown().await;
    Ok(Throughput {
        sent: count,
        received,
        elapsed: end - started,
    })
}

/// What the batching scenario sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Batched {
    /// At-least-once commands to a durable worker, each stored (acked) before the sender
    /// counts it sent.
    Commands,
    /// Events to a subscriber, each flushed (the server has it) before the sender counts it
    /// sent.
    Events,
}

/// Chorus: `count` messages of 128 B, each confirmed (a durable command's ack, an event's
/// flush), sent one at a time (`batching` none: `send`/`publish`, then the confirmation,
/// then the next), or through a [`chorus_sdk::Batcher`] (queued, confirmed per batch).
/// Timed from the first send until every message is confirmed and received.
pub(crate) async fn chorus_batching(
    bus: &Bus<'_>,
    count: u64,
    what: Batched,
    batching: Option<chorus_sdk::Batching>,
) -> anyhow::Result<Throughput> {
    let id = format!("bench-batch-{}", uuid::Uuid::now_v7().simple());
    let topic = format!("bench.batch.{}", uuid::Uuid::now_v7().simple());
    let worker = bus
        .options(&id)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .durable_inbox(what == Batched::Commands)
        .queue_capacity(QUEUE_CAPACITY)
        .connect()
        .await?;
    let tally = Arc::new(Tally::new(count));
    let counter = match what {
        Batched::Commands => {
            worker
                .handle_command("work", SignalHandler(Arc::clone(&tally)))
                .await?;
            None
        }
        Batched::Events => {
            let mut events = worker.subscribe(&topic).await?;
            let tally = Arc::clone(&tally);
            Some(tokio::spawn(async move {
                while events.next().await.is_some() {
                    tally.hit();
                }
            }))
        }
    };
    let sender = agent(bus, "bench-batch-sender").await?;
    let payload = Bytes::from(vec![7u8; 128]);
    let command = || {
        Call::agent(id.clone(), "work")
            .command()
            .delivery(DeliveryClass::AtLeastOnce)
            .raw_payload(payload.clone(), "application/octet-stream")
    };
    let event = || {
        chorus_sdk::Publish::topic(topic.clone())
            .raw_payload(payload.clone(), "application/octet-stream")
    };
    let started = Instant::now();
    match batching {
        None => {
            for _ in 0..count {
                match what {
                    Batched::Commands => {
                        sender.send(command()).await?;
                    }
                    Batched::Events => {
                        sender.publish_with(event()).await?;
                        sender.broker().flush().await?;
                    }
                }
            }
        }
        Some(batching) => {
            let batcher = sender.batcher(batching)?;
            let mut confirmations = futures::stream::FuturesOrdered::new();
            for _ in 0..count {
                match what {
                    Batched::Commands => {
                        let queued = batcher.send(command()).await?;
                        confirmations.push_back(futures::future::Either::Left(async move {
                            queued.await.map(drop)
                        }));
                    }
                    Batched::Events => {
                        let queued = batcher.publish(event()).await?;
                        confirmations.push_back(futures::future::Either::Right(queued));
                    }
                }
            }
            while let Some(confirmed) = confirmations.next().await {
                confirmed?;
            }
            batcher.close().await;
        }
    }
    let (received, end) = tally.wait(IDLE).await;
    sender.shutdown().await;
    worker.shutdown().await;
    if let Some(counter) = counter {
        counter.abort();
        let _ = counter.await;
    }
    Ok(Throughput {
        sent: count,
        received,
        elapsed: end - started,
    })
}

struct SignalHandler(Arc<Tally>);

impl chorus_sdk::Handler for SignalHandler {
    fn call(
        &self,
        _ctx: Context,
    ) -> chorus_sdk::BoxFuture<Result<chorus_sdk::Output, HandlerError>> {
        self.0.hit();
        Box::pin(async { Ok(chorus_sdk::Output::default()) })
    }
}

/// Discovery with `agents` registered (synthetic heartbeats): query latencies, and how many
/// the coordinator (started in process by `launcher`) had registered.
pub(crate) async fn discovery(
    url: &str,
    launcher: &dyn CoordinatorLauncher,
    agents: usize,
    queries: usize,
) -> anyhow::Result<(Vec<Duration>, usize)> {
    let coordinator = launcher.start(url).await?;
    let publisher = register_fakes(url, agents).await?;
    let deadline = Instant::now() + REGISTRATION_DEADLINE;
    let mut registered = 0;
    while Instant::now() < deadline {
        registered = coordinator.registered();
        if registered >= agents {
            break;
        }
        tokio::time::sleep(REGISTRATION_POLL).await;
    }
    let mut lat = Vec::with_capacity(queries);
    for _ in 0..queries {
        let t = Instant::now();
        publisher.discover_capability("ocr").await?;
        lat.push(t.elapsed());
    }
    publisher.shutdown().await;
    coordinator.shutdown().await;
    Ok((lat, registered))
}

/// Publishes one heartbeat for each of `agents` synthetic agents (every tenth offering `ocr`).
pub(crate) async fn publish_fake_heartbeats(
    publisher: &Agent,
    agents: usize,
) -> anyhow::Result<()> {
    let subjects = publisher.subjects().clone();
    for i in 0..agents {
        let id = format!("fake-{i:04}");
        let manifest = Manifest {
            agent: id.clone(),
            instance: "bench".into(),
            capabilities: vec![chorus_sdk::registry::CapabilityInfo {
                name: if i % 10 == 0 {
                    "ocr".into()
                } else {
                    format!("cap{}", i % 50)
                },
                version: "1".into(),
                models: Vec::new(),
                throughput: None,
                max_tokens: None,
                handling_ms: None,
            }],
            commands: vec![],
            groups: vec![],
            customer: None,
            content_types: vec![],
            load: (i % 100) as f32 / 100.0,
            slots: None,
            availability: chorus_sdk::Availability::Available,
            eta_ms: None,
            handling_ms: None,
            waiting: Default::default(),
            public_key: None,
            encryption_key: None,
            heartbeat_ms: FAKE_HEARTBEAT_MS,
            started_ms: chorus_sdk::envelope::now_ms(),
            sdk_version: String::new(),
            metrics_url: None,
            wire_versions: vec![1, 2],
            open_circuits: Vec::new(),
            content_encodings: Vec::new(),
            endpoints: Vec::new(),
        };
        let mut env = Envelope::new(Kind::Heartbeat, Performative::Health, id.as_str());
        env.payload = codec::encode_payload(&manifest, CONTENT_TYPE_MSGPACK)?;
        let bytes = codec::encode(&env, Encoding::MsgPack)?;
        publisher
            .broker()
            .publish(&subjects.heartbeat(&id)?, bytes)
            .await?;
    }
    publisher.broker().flush().await?;
    Ok(())
}

/// Publishes heartbeats for `agents` synthetic agents (every tenth with capability `ocr`).
async fn register_fakes(url: &str, agents: usize) -> anyhow::Result<Agent> {
    let bus = Bus {
        url,
        wire: Encoding::MsgPack,
    };
    let publisher = agent(&bus, "bench-registrar").await?;
    publish_fake_heartbeats(&publisher, agents).await?;
    Ok(publisher)
}

/// What [`secure_events`] sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Secured {
    /// Signed events.
    Events,
    /// Signed one-way commands.
    Commands,
    /// Signed one-way commands, encrypted for the receiver (in sessions, as agents send).
    EncryptedCommands,
}

/// Signed messages from one agent to another that verifies every signature: events, or
/// one-way commands, encrypted for the receiver or not.
pub(crate) async fn secure_events(
    bus: &Bus<'_>,
    count: u64,
    mode: Secured,
) -> anyhow::Result<Throughput> {
    use chorus_sdk::encryption::EncryptionKey;
    use chorus_sdk::security::{Identity, SignaturePolicy};
    let sender_id = Identity::generate();
    let receiver_key = EncryptionKey::generate();
    let receiver_public = receiver_key.public_key();
    let base = |id: &str| {
        bus.options(id)
            .heartbeat_interval(Duration::ZERO)
            .service_discovery(false)
            .queue_capacity(QUEUE_CAPACITY)
    };
    let receiver = base("bench-verifier")
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..SignaturePolicy::default()
        })
        .trust("bench-signer", sender_id.public_key())
        .encryption_key(receiver_key)
        .connect()
        .await?;
    let topic = format!("bench.signed.{}", uuid::Uuid::now_v7().simple());
    let mut events = receiver.subscribe(&topic).await?;
    let tally = Arc::new(Tally::new(count));
    // The counting task of the events case, stopped and awaited at the end.
    let stop = CancellationToken::new();
    let mut counter = None;
    if mode != Secured::Events {
        receiver
            .handle_command("sealed", SignalHandler(Arc::clone(&tally)))
            .await?;
    } else {
        let tally = Arc::clone(&tally);
        let stopped = stop.clone();
        counter = Some(tokio::spawn(async move {
            loop {
                tokio::select! {
                    event = events.next() => match event {
                        Some(_) => tally.hit(),
                        None => break,
                    },
                    _ = stopped.cancelled() => break,
                }
            }
        }));
    }
    let sender = base("bench-signer")
        .identity(sender_id)
        .trust_encryption("bench-verifier", receiver_public)
        .connect()
        .await?;
    let payload = Bytes::from(vec![0x5a; 128]);
    let started = Instant::now();
    for _ in 0..count {
        let command = || {
            Call::agent("bench-verifier", "sealed")
                .raw_payload(payload.clone(), "application/octet-stream")
        };
        match mode {
            Secured::Events => {
                sender
                    .publish_raw(&topic, payload.clone(), "application/octet-stream")
                    .await?;
            }
            Secured::Commands => {
                sender.send(command()).await?;
            }
            Secured::EncryptedCommands => {
                sender
                    .send(command().encrypt_for(["bench-verifier"]))
                    .await?;
            }
        }
    }
    sender.broker().flush().await?;
    let (received, end) = tally.wait(IDLE).await;
    stop.cancel();
    if let Some(counter) = counter {
        let _ = counter.await;
    }
    sender.shutdown().await;
    receiver.shutdown().await;
    Ok(Throughput {
        sent: count,
        received,
        elapsed: end - started,
    })
}

/// Answers with the size of what it was sent (a payload whatever its content type).
struct Measure;

impl chorus_sdk::Handler for Measure {
    fn call(
        &self,
        ctx: Context,
    ) -> chorus_sdk::BoxFuture<Result<chorus_sdk::Output, HandlerError>> {
        let len = ctx.message().payload.len() as u64;
        Box::pin(async move {
            Ok(chorus_sdk::Output {
                payload: codec::encode_payload(&len, CONTENT_TYPE_MSGPACK).map_err(|e| {
                    HandlerError::new(chorus_sdk::StatusCode::INTERNAL, e.to_string())
                })?,
                content_type: CONTENT_TYPE_MSGPACK.into(),
            })
        })
    }
}

/// `len` bytes that do not compress (xorshift).
pub(crate) fn noise(len: usize) -> Bytes {
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

/// `len` bytes of repetitive JSON lines, which compress well.
pub(crate) fn json_lines(len: usize) -> Bytes {
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

/// What the payload scenario measured: requests whose payload went by reference, and
/// compressible requests sent compressed and plain.
pub(crate) struct Payloads {
    pub(crate) by_reference: Vec<Duration>,
    pub(crate) compressed: Vec<Duration>,
    pub(crate) plain: Vec<Duration>,
}

/// Large payloads: `n_big` requests of `big` bytes that do not compress (by reference through
/// the object store) to an agent that answers with the size it got, then `n_small` requests of
/// `small` compressible bytes, compressed (the reader reads zstd, by the registry) and plain (a
/// sender that does not compress).
pub(crate) async fn chorus_payloads(
    url: &str,
    launcher: &dyn CoordinatorLauncher,
    wire: chorus_sdk::Encoding,
    (big, n_big): (usize, usize),
    (small, n_small): (usize, usize),
) -> anyhow::Result<Payloads> {
    let coordinator = launcher.start(url).await?;
    let bus = Bus { url, wire };
    let vault = bus
        .options("bench-vault")
        .heartbeat_interval(Duration::from_millis(500))
        .service_discovery(false)
        .connect()
        .await?;
    vault.handle_command("size", Measure).await?;
    let client = bus
        .options("bench-sender")
        .heartbeat_interval(Duration::from_millis(500))
        .service_discovery(false)
        .connect()
        .await?;
    let plain_sender = bus
        .options("bench-plain-sender")
        .payload_limits(chorus_sdk::payload::PayloadLimits::default().compress_above(None))
        .service_discovery(false)
        .connect()
        .await?;
    let deadline = Instant::now() + REGISTRATION_DEADLINE;
    while coordinator.registered() < 2 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the coordinator did not register the vault"
        );
        tokio::time::sleep(REGISTRATION_POLL).await;
    }
    let timed = |sender: Agent, payload: Bytes, n: usize| async move {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let call = Call::agent("bench-vault", "size")
                .raw_payload(payload.clone(), "application/octet-stream")
                .timeout(Duration::from_secs(120));
            let t = Instant::now();
            let got: u64 = sender.call(call).await?.payload_as()?;
            out.push(t.elapsed());
            anyhow::ensure!(got == payload.len() as u64, "the vault got {got} bytes");
        }
        Ok::<_, anyhow::Error>(out)
    };
    let by_reference = timed(client.clone(), noise(big), n_big).await?;
    let text = json_lines(small);
    let compressed = timed(client.clone(), text.clone(), n_small).await?;
    let plain = timed(plain_sender.clone(), text, n_small).await?;
    anyhow::ensure!(
        client.stats().payloads_stored >= n_big as u64,
        "the large payloads did not go by reference"
    );
    anyhow::ensure!(
        vault.stats().payloads_decompressed >= n_small as u64,
        "the compressible payloads did not travel compressed"
    );
    for agent in [client, plain_sender, vault] {
        agent.shutdown().await;
    }
    coordinator.shutdown().await;
    Ok(Payloads {
        by_reference,
        compressed,
        plain,
    })
}
