//! Durable inboxes at scale in both designs (docs/SCALE.md, "Durable inboxes at 10,000
//! agents"): consumers always held, and on demand (bells, looks, consumers released when quiet).

use super::*;

/// Agent `i`'s consumer of one lane, as the SDK makes it (agent-sdk/src/durable/inbox/); on demand, with
/// the threshold after which the server removes it unused.
fn consumer_spec(
    subjects: &Subjects,
    i: usize,
    high: bool,
    on_demand: bool,
) -> anyhow::Result<chorus_broker_adapter::ConsumerSpec> {
    let agent = sim_agent(i);
    let mut spec = chorus_broker_adapter::ConsumerSpec::new(if high {
        format!("{agent}_high")
    } else {
        agent.clone()
    });
    spec.filter_subjects = vec![subjects.durable_inbox(&agent, high)?];
    spec.ack_wait = Duration::from_secs(30);
    spec.max_deliver = 5;
    spec.max_ack_pending = 64;
    if on_demand {
        spec.inactive_threshold = chorus_sdk::durable::ABANDONED_CONSUMER_AFTER;
    }
    spec.description = format!("durable inbox of agent {agent}");
    Ok(spec)
}

/// `per_agent` numbered commands to each of the first `active` agents, every agent's in
/// order (interleaved across agents, as many senders would store them).
fn commands(
    subjects: &Subjects,
    active: usize,
    per_agent: u32,
) -> anyhow::Result<Vec<chorus_broker_adapter::BatchMessage>> {
    let mut batch = Vec::with_capacity(active * per_agent as usize);
    for n in 0..per_agent {
        for i in 0..active {
            batch.push(chorus_broker_adapter::BatchMessage {
                subject: subjects.durable(&sim_agent(i), "work", false)?,
                msg_id: None,
                payload: Bytes::from(n.to_be_bytes().to_vec()),
            });
        }
    }
    Ok(batch)
}

/// The number a command carries.
fn number_of(delivery: &chorus_broker_adapter::Delivery) -> Option<u32> {
    delivery
        .payload()
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_be_bytes)
}

/// What both inbox designs are measured on: a server of their own with the SDK's inbox
/// stream, a connection to it, and the server's memory before any agent.
struct InboxBench {
    server: NatsServer,
    url: String,
    monitor: String,
    subjects: Subjects,
    broker: Broker,
    js: chorus_broker_adapter::JetStream,
    inbox: chorus_broker_adapter::StreamSpec,
    server_rss_before: u64,
}

impl InboxBench {
    async fn start(name: &str) -> anyhow::Result<InboxBench> {
        use chorus_sdk::durable::{InboxLimits, inbox_stream};
        let (server, url, monitor) = monitored_server().await?;
        let subjects = Subjects::new(ROOT)?;
        let broker = connect(&url, name).await?;
        let js = broker.jetstream(Duration::from_secs(30));
        let inbox = inbox_stream(&subjects, &InboxLimits::default());
        js.ensure_stream(&inbox).await?;
        let server_rss_before = server.pid().and_then(rss_of).unwrap_or(0);
        Ok(InboxBench {
            server,
            url,
            monitor,
            subjects,
            broker,
            js,
            inbox,
            server_rss_before,
        })
    }
}

/// What the durable-inbox fleet measured.
#[derive(Debug, Clone)]
pub(crate) struct DurableFigures {
    pub(crate) agents: usize,
    pub(crate) consumers: u64,
    pub(crate) created_in: Duration,
    pub(crate) server_rss_before: u64,
    pub(crate) server_rss_after: u64,
    pub(crate) active: usize,
    pub(crate) sent: u64,
    pub(crate) delivered: u64,
    pub(crate) in_order: bool,
    pub(crate) delivered_in: Duration,
}

/// Durable inboxes at scale with consumers always held (`InboxConsumers::Always`, the naive
/// design): `agents` agents each with its
/// two consumers (normal and high priority) on the inbox stream, most of them idle; then
/// `per_agent` commands to each of `active` of them, pulled and acked through their consumers
/// and checked for order and loss.
pub(crate) async fn durable(
    agents: usize,
    active: usize,
    per_agent: u32,
    progress: fn(&str),
) -> anyhow::Result<Vec<Row>> {
    progress(&format!(
        "durable inboxes: {agents} agents with their consumers, {per_agent} commands to {active} of them"
    ));
    let InboxBench {
        server,
        monitor,
        subjects,
        broker,
        js,
        inbox,
        server_rss_before,
        ..
    } = InboxBench::start("fleet-durable").await?;
    let t = Instant::now();
    let specs: Vec<chorus_broker_adapter::ConsumerSpec> = (0..agents)
        .flat_map(|i| {
            [
                consumer_spec(&subjects, i, false, false),
                consumer_spec(&subjects, i, true, false),
            ]
        })
        .collect::<anyhow::Result<_>>()?;
    let mut created = futures::stream::iter(
        specs
            .iter()
            .map(|spec| js.ensure_consumer(&inbox.name, spec)),
    )
    .buffer_unordered(32);
    while let Some(consumer) = created.next().await {
        consumer?;
    }
    drop(created);
    let created_in = t.elapsed();
    let consumers = monitor_number(&monitor, "/jsz", "consumers").await?;
    let server_rss_after = server.pid().and_then(rss_of).unwrap_or(0);
    let batch = commands(&subjects, active, per_agent)?;
    let sent = batch.len() as u64;
    let t = Instant::now();
    for ack in js.publish_batch(batch, 256).await {
        ack?;
    }
    let pull = |i: usize| {
        let js = js.clone();
        let spec = consumer_spec(&subjects, i, false, false);
        let stream = inbox.name.clone();
        async move {
            let consumer = js.ensure_consumer(&stream, &spec?).await?;
            let mut deliveries = consumer.messages(per_agent as usize).await?;
            let mut got = Vec::with_capacity(per_agent as usize);
            while got.len() < per_agent as usize {
                let next = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
                    .await
                    .map_err(|_| anyhow::anyhow!("agent {i}: no delivery within 30 s"))?;
                let Some(delivery) = next else { break };
                let Ok(delivery) = delivery else { continue };
                delivery.ack().await?;
                got.extend(number_of(&delivery));
            }
            Ok::<_, anyhow::Error>(got)
        }
    };
    let mut delivered = 0u64;
    let mut in_order = true;
    let mut pulls = futures::stream::iter((0..active).map(pull)).buffer_unordered(16);
    while let Some(got) = pulls.next().await {
        let got = got?;
        delivered += got.len() as u64;
        in_order &= got == (0..per_agent).collect::<Vec<_>>();
    }
    let delivered_in = t.elapsed();
    drop(pulls);
    drop(js);
    close(broker).await;
    drop(server);
    let f = DurableFigures {
        agents,
        consumers,
        created_in,
        server_rss_before,
        server_rss_after,
        active,
        sent,
        delivered,
        in_order,
        delivered_in,
    };
    Ok(durable_rows(&f))
}

fn durable_rows(f: &DurableFigures) -> Vec<Row> {
    let at = |what: &str| format!("{} durable agents, consumers always held: {what}", f.agents);
    let per_consumer_kib = (f.server_rss_after.saturating_sub(f.server_rss_before)) as f64
        / 1024.0
        / f.consumers.max(1) as f64;
    vec![
        Row::chorus_only(
            &at("JetStream consumers (two per agent, as the SDK makes them)"),
            "consumers",
            f.consumers as f64,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("time to create their consumers, 32 at a time"),
            "s",
            f.created_in.as_secs_f64(),
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("server resident memory with them"),
            "MiB",
            mib(f.server_rss_after),
            &format!(
                "(reported; {:.1} MiB before, {per_consumer_kib:.1} KiB per consumer)",
                mib(f.server_rss_before)
            ),
            None,
        ),
        Row::chorus_only(
            &at(&format!(
                "commands to {} of them delivered in order, every one acked",
                f.active
            )),
            "s",
            f.delivered_in.as_secs_f64(),
            "in order, lost 0",
            Some(f.in_order && f.delivered == f.sent),
        )
        .counts(f.sent, f.delivered),
    ]
}

/// What the on-demand durable-inbox fleet measured.
#[derive(Debug, Clone)]
pub(crate) struct OnDemandFigures {
    pub(crate) agents: usize,
    pub(crate) started_in: Duration,
    pub(crate) idle_consumers: u64,
    pub(crate) subscriptions: u64,
    pub(crate) server_rss_before: u64,
    pub(crate) server_rss_idle: u64,
    pub(crate) active: usize,
    pub(crate) sent: u64,
    pub(crate) delivered: u64,
    pub(crate) in_order: bool,
    pub(crate) delivered_in: Duration,
    pub(crate) peak_consumers: u64,
    pub(crate) released_in: Duration,
    pub(crate) consumers_after: u64,
    /// A durable command to an SDK agent, sent to handled: with no consumer (the bell opens
    /// one), and with its consumer open.
    pub(crate) cold: Vec<Duration>,
    pub(crate) warm: Vec<Duration>,
    /// Server CPU (100 = one core) while idle agents' looks arrive at the rate of `agents`
    /// and of 100,000 agents, each looking every `DEFAULT_INBOX_RECHECK`.
    pub(crate) look_cpu: Vec<(usize, f64)>,
}

/// How long the looks of idle agents are sent at their rate to measure the server's CPU.
const LOOK_WINDOW: Duration = Duration::from_secs(10);

/// Sends the looks `agents` idle agents make (one for both lanes every
/// `DEFAULT_INBOX_RECHECK`),
/// spread evenly over [`LOOK_WINDOW`], and returns the server's CPU meanwhile.
async fn look_load(
    js: &chorus_broker_adapter::JetStream,
    stream: &str,
    subjects: &Subjects,
    server_pid: u32,
    agents: usize,
) -> anyhow::Result<f64> {
    use chorus_sdk::durable::DEFAULT_INBOX_RECHECK;
    let per_second = agents as f64 / DEFAULT_INBOX_RECHECK.as_secs_f64();
    let total = (per_second * LOOK_WINDOW.as_secs_f64()) as usize;
    let cpu0 = cpu_seconds_of(server_pid)?;
    let t = Instant::now();
    let mut tick = tokio::time::interval(TICK);
    let mut sent = 0usize;
    let mut looks = futures::stream::FuturesUnordered::new();
    while sent < total {
        tick.tick().await;
        let due = ((t.elapsed().as_secs_f64() * per_second) as usize).min(total);
        while sent < due {
            let filter = subjects.durable_agent_all(&sim_agent(sent % agents.max(1)))?;
            let js = js.clone();
            let stream = stream.to_owned();
            looks.push(async move { js.subject_counts(&stream, &filter).await });
            sent += 1;
        }
        while let Some(Some(look)) = futures::FutureExt::now_or_never(looks.next()) {
            look?;
        }
    }
    while let Some(look) = looks.next().await {
        look?;
    }
    Ok(100.0 * (cpu_seconds_of(server_pid)? - cpu0) / t.elapsed().as_secs_f64())
}

/// Rounds of the cold and warm durable command measurement.
const FIRST_COMMAND_ROUNDS: usize = 20;

/// A durable command's time from send to handled at one SDK agent, on demand: cold (its
/// consumer released, so the bell opens one) and warm (the consumer still open), `rounds`
/// times each.
async fn first_command(url: &str, rounds: usize) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    use chorus_sdk::durable::InboxConsumers;
    let release_after = Duration::from_millis(200);
    let worker = AgentOptions::new("fleet-durable")
        .servers([url])
        .root(ROOT)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .durable_inbox(true)
        .inbox_consumers(InboxConsumers::OnDemand {
            release_after,
            recheck: Duration::from_secs(60),
        })
        .connect()
        .await?;
    let (handled_tx, mut handled) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    worker
        .on_command("work", move |_ctx: chorus_sdk::Context, (): ()| {
            let _ = handled_tx.send(Instant::now());
            async { Ok::<_, chorus_sdk::HandlerError>(()) }
        })
        .await?;
    let sender = AgentOptions::new("fleet-sender")
        .servers([url])
        .root(ROOT)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .connect()
        .await?;
    let call = || {
        chorus_sdk::Call::agent("fleet-durable", "work")
            .command()
            .payload(&())
    };
    let mut one = async |released: u64| -> anyhow::Result<Duration> {
        // Cold rounds wait for the release first.
        let deadline = Instant::now() + Duration::from_secs(10);
        while worker.stats().inbox_consumers_released < released {
            anyhow::ensure!(Instant::now() < deadline, "the consumer was not released");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let t = Instant::now();
        sender.send_durable(call()?).await?;
        let at = tokio::time::timeout(Duration::from_secs(10), handled.recv())
            .await?
            .ok_or_else(|| anyhow::anyhow!("the worker stopped"))?;
        Ok(at.duration_since(t))
    };
    let (mut cold, mut warm) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for round in 0..rounds as u64 {
        cold.push(one(round).await?);
        warm.push(one(0).await?);
    }
    sender.shutdown().await;
    worker.shutdown().await;
    cold.sort();
    warm.sort();
    Ok((cold, warm))
}

/// How long a simulated on-demand agent waits with nothing arriving before it releases its
/// consumer (the SDK's default is 30 s; shorter here so the run is short).
const SIM_RELEASE_AFTER: Duration = Duration::from_secs(2);

/// Durable inboxes at scale with on-demand consumers (`InboxConsumers::OnDemand`, the SDK's
/// default), as the SDK runs them (agent-sdk/src/durable/inbox/): each of `agents` agents subscribes to
/// its bells and looks for stored commands of both lanes at start, holding no consumer; then
/// `per_agent` commands to each of `active` of them ring their bells, each of those opens its
/// normal lane's consumer, takes and acks its commands (checked for order and loss), and
/// deletes the consumer once nothing has arrived for a quiet time and nothing is pending.
pub(crate) async fn durable_on_demand(
    agents: usize,
    active: usize,
    per_agent: u32,
    progress: fn(&str),
) -> anyhow::Result<Vec<Row>> {
    progress(&format!(
        "durable inboxes on demand: {agents} agents with their bells, {per_agent} commands to {active} of them"
    ));
    let InboxBench {
        server,
        url,
        monitor,
        subjects,
        broker,
        js,
        inbox,
        server_rss_before,
    } = InboxBench::start("fleet-on-demand").await?;
    // The agents' start: a bell subscription for each lane (on shared connections), then a
    // look at both lanes for stored commands, 32 agents at a time.
    let mut connections = Vec::with_capacity(CONNECTIONS);
    for c in 0..CONNECTIONS {
        connections.push(connect(&url, &format!("fleet-bells-{c}")).await?);
    }
    let t = Instant::now();
    let mut bells = Vec::with_capacity(agents);
    let mut high_bells = Vec::with_capacity(agents);
    for i in 0..agents {
        let connection = &connections[i % CONNECTIONS];
        let normal = subjects.lane_bells(&sim_agent(i), false)?;
        bells.push(Some(connection.subscribe(&normal).await?));
        let high = subjects.lane_bells(&sim_agent(i), true)?;
        high_bells.push(connection.subscribe(&high).await?);
    }
    let mut looks = futures::stream::iter((0..agents).map(|i| {
        let js = js.clone();
        let filter = subjects.durable_agent_all(&sim_agent(i));
        let stream = inbox.name.clone();
        async move {
            js.subject_counts(&stream, &filter?)
                .await
                .map_err(anyhow::Error::from)
        }
    }))
    .buffer_unordered(32);
    while let Some(found) = looks.next().await {
        if !found?.is_empty() {
            anyhow::bail!("an empty inbox reported stored commands");
        }
    }
    drop(looks);
    let started_in = t.elapsed();
    for c in &connections {
        c.flush().await?;
    }
    let idle_consumers = monitor_number(&monitor, "/jsz", "consumers").await?;
    let subscriptions = monitor_number(&monitor, "/varz", "subscriptions").await?;
    let server_rss_idle = server.pid().and_then(rss_of).unwrap_or(0);

    // The active agents wait for their bells; each opens its consumer when one rings.
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let tracker = TaskTracker::new();
    let mut handles = Vec::with_capacity(active);
    for (i, bell) in bells.iter_mut().enumerate().take(active) {
        let Some(mut bell) = bell.take() else {
            continue;
        };
        let js = js.clone();
        let spec = consumer_spec(&subjects, i, false, true)?;
        let stream = inbox.name.clone();
        let done = done_tx.clone();
        handles.push(tracker.spawn(async move {
            let run = async {
                tokio::time::timeout(Duration::from_secs(120), bell.next())
                    .await
                    .map_err(|_| anyhow::anyhow!("agent {i}: no bell within 120 s"))?;
                // As the SDK does: a lane with its consumer open hears no bells.
                drop(bell);
                let consumer = js.ensure_consumer(&stream, &spec).await?;
                let mut deliveries = consumer.messages(per_agent as usize).await?;
                let mut got = Vec::with_capacity(per_agent as usize);
                loop {
                    // Quiet once everything arrived and nothing more comes for the release time.
                    let wait = if got.len() >= per_agent as usize {
                        SIM_RELEASE_AFTER
                    } else {
                        Duration::from_secs(60)
                    };
                    let Ok(next) = tokio::time::timeout(wait, deliveries.next()).await else {
                        break;
                    };
                    let Some(delivery) = next else { break };
                    let Ok(delivery) = delivery else { continue };
                    delivery.ack().await?;
                    got.extend(number_of(&delivery));
                    if got.len() == per_agent as usize {
                        let _ = done.send(Instant::now());
                    }
                }
                drop(deliveries);
                let state = js.consumer_state(&stream, &spec.durable).await?;
                if state.pending == 0 && state.ack_pending == 0 {
                    js.delete_consumer(&stream, &spec.durable).await?;
                }
                Ok::<_, anyhow::Error>(got)
            };
            run.await
        }));
    }
    drop(done_tx);
    let batch = commands(&subjects, active, per_agent)?;
    let sent = batch.len() as u64;
    let t = Instant::now();
    // Sample the consumer count while the commands are taken.
    let sampling = CancellationToken::new();
    let sampler = {
        let monitor = monitor.clone();
        let stop = sampling.clone();
        tokio::spawn(async move {
            let mut peak = 0u64;
            loop {
                if let Ok(n) = monitor_number(&monitor, "/jsz", "consumers").await {
                    peak = peak.max(n);
                }
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
            peak
        })
    };
    for ack in js.publish_batch(batch, 256).await {
        ack?;
    }
    let mut last_done = t;
    while let Some(at) = done_rx.recv().await {
        last_done = last_done.max(at);
    }
    // Every sender of `done` is gone: every active agent released (or failed).
    let mut delivered = 0u64;
    let mut in_order = true;
    for handle in handles {
        let got = handle.await??;
        delivered += got.len() as u64;
        in_order &= got == (0..per_agent).collect::<Vec<_>>();
    }
    tracker.close();
    tracker.wait().await;
    let released_in = t.elapsed();
    sampling.cancel();
    let peak_consumers = sampler.await.unwrap_or(0);
    let consumers_after = monitor_number(&monitor, "/jsz", "consumers").await?;
    let delivered_in = last_done.duration_since(t);
    let (cold, warm) = first_command(&url, FIRST_COMMAND_ROUNDS).await?;
    let mut look_cpu = Vec::new();
    if let Some(pid) = server.pid() {
        for fleet in [agents, 100_000] {
            look_cpu.push((
                fleet,
                look_load(&js, &inbox.name, &subjects, pid, fleet).await?,
            ));
        }
    }
    drop((bells, high_bells));
    drop(js);
    for c in connections {
        close(c).await;
    }
    close(broker).await;
    drop(server);
    let f = OnDemandFigures {
        agents,
        started_in,
        idle_consumers,
        subscriptions,
        server_rss_before,
        server_rss_idle,
        active,
        sent,
        delivered,
        in_order,
        delivered_in,
        peak_consumers,
        released_in,
        consumers_after,
        cold,
        warm,
        look_cpu,
    };
    Ok(on_demand_rows(&f))
}

fn on_demand_rows(f: &OnDemandFigures) -> Vec<Row> {
    let at = |what: &str| format!("{} durable agents, consumers on demand: {what}", f.agents);
    let mut rows = vec![
        Row::chorus_only(
            &at("time for all to start (a bell subscription per lane and one look each)"),
            "s",
            f.started_in.as_secs_f64(),
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("JetStream consumers while idle"),
            "consumers",
            f.idle_consumers as f64,
            "none",
            Some(f.idle_consumers == 0),
        ),
        Row::chorus_only(
            &at("server subscriptions (a bell per lane each)"),
            "subscriptions",
            f.subscriptions as f64,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at("server resident memory with them"),
            "MiB",
            mib(f.server_rss_idle),
            &format!("(reported; {:.1} MiB before)", mib(f.server_rss_before)),
            None,
        ),
        Row::chorus_only(
            &at(&format!(
                "commands to {} of them delivered in order, every one acked",
                f.active
            )),
            "s",
            f.delivered_in.as_secs_f64(),
            "in order, lost 0",
            Some(f.in_order && f.delivered == f.sent),
        )
        .counts(f.sent, f.delivered),
        Row::chorus_only(
            &at("consumers at the busiest"),
            "consumers",
            f.peak_consumers as f64,
            "(reported)",
            None,
        ),
        Row::chorus_only(
            &at(&format!(
                "consumers after {} s quiet, all released in",
                SIM_RELEASE_AFTER.as_secs()
            )),
            "s",
            f.released_in.as_secs_f64(),
            &format!("{} left: none", f.consumers_after),
            Some(f.consumers_after == 0),
        ),
        Row::chorus_only(
            "a durable command to an SDK agent, sent to handled, its consumer released (p50)",
            "us",
            percentile(&f.cold, 0.5),
            &format!(
                "(reported; p99 {:.0} us; the bell opens the consumer)",
                percentile(&f.cold, 0.99)
            ),
            None,
        )
        .counts(f.cold.len() as u64, f.cold.len() as u64),
        Row::chorus_only(
            "a durable command to an SDK agent, sent to handled, its consumer open (p50)",
            "us",
            percentile(&f.warm, 0.5),
            &format!("(reported; p99 {:.0} us)", percentile(&f.warm, 0.99)),
            None,
        )
        .counts(f.warm.len() as u64, f.warm.len() as u64),
    ];
    for (fleet, cpu) in &f.look_cpu {
        rows.push(Row::chorus_only(
            &format!(
                "server CPU for the looks of {fleet} idle agents (one look every {} s each)",
                chorus_sdk::durable::DEFAULT_INBOX_RECHECK.as_secs()
            ),
            "%",
            *cpu,
            &format!(
                "(reported; {:.0} looks/s; 100 = one core)",
                *fleet as f64 / chorus_sdk::durable::DEFAULT_INBOX_RECHECK.as_secs_f64()
            ),
            None,
        ));
    }
    rows
}
