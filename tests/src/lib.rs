//! Helpers for the end-to-end tests: a real `nats-server` per test, agents connected to it,
//! and deadlines on every wait.

pub mod creds_bus;
pub mod vectors;

use std::future::Future;
use std::time::Duration;

pub use chorus_nats_server::{NatsServer, ServerBuilder};

/// The deadline for any single wait in a test that has no reason to pick another.
pub const WAIT: Duration = Duration::from_secs(20);

/// Starts a fresh server (loopback, OS-chosen port, JetStream in a temp dir) and waits until
/// it listens. Panics with the server's log if it does not come up: a test cannot go on.
pub fn server() -> NatsServer {
    init_tracing();
    match NatsServer::start() {
        Ok(server) => server,
        Err(err) => panic!("nats-server did not start: {err}"),
    }
}

/// Awaits `fut`, failing the test if it takes longer than `limit`.
pub async fn within<F: Future>(limit: Duration, what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(limit, fut).await {
        Ok(out) => out,
        Err(_) => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

/// Agent options for `id` pointed at `server`.
pub fn agent_options(server: &NatsServer, id: &str) -> chorus_sdk::AgentOptions {
    chorus_sdk::AgentOptions::new(id).servers([server.url()])
}

/// Connects agent `id` to `server`.
pub async fn agent(server: &NatsServer, id: &str) -> chorus_sdk::Agent {
    within(WAIT, "agent connect", agent_options(server, id).connect())
        .await
        .unwrap_or_else(|e| panic!("agent {id} did not connect: {e}"))
}

/// A raw broker connection to `server`, for sending bytes no SDK would send.
pub async fn raw_broker(server: &NatsServer) -> chorus_broker_adapter::Broker {
    within(
        WAIT,
        "broker connect",
        chorus_broker_adapter::BrokerOptions::new([server.url()])
            .name("raw-test-client")
            .connect(),
    )
    .await
    .unwrap_or_else(|e| panic!("raw broker did not connect: {e}"))
}

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// A nats-server with JetStream (its store under `dir`) whose users are `users`: `nats.conf`
/// authorization entries, one per line, as `chorus creds` prints them.
pub fn server_with_users(dir: &std::path::Path, users: &str) -> NatsServer {
    let conf = dir.join("auth.conf");
    std::fs::write(
        &conf,
        format!(
            "listen: \"127.0.0.1:-1\"\njetstream {{ store_dir: \"{}\" }}\nauthorization {{\n  users = [\n{users}\n  ]\n}}\n",
            dir.join("js").display()
        ),
    )
    .expect("write the server's config");
    ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("the server takes the entries")
}

/// Starts an in-process coordinator against `server` with fast timings for tests: registry
/// sweeps every 50 ms, metrics on a free loopback port when `metrics` is set.
pub async fn coordinator(server: &NatsServer, metrics: bool) -> chorus_coordinator::Coordinator {
    start_coordinator(coordinator_config(server), metrics).await
}

/// The configuration [`coordinator`] starts with, for a test that changes some of it.
pub fn coordinator_config(server: &NatsServer) -> chorus_coordinator::CoordinatorConfig {
    chorus_coordinator::CoordinatorConfig {
        servers: server.url().to_owned(),
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        reap_interval_ms: 50,
        ..chorus_coordinator::CoordinatorConfig::default()
    }
}

/// Starts an in-process coordinator with `config`, within the test's deadline.
pub async fn start_coordinator(
    config: chorus_coordinator::CoordinatorConfig,
    metrics: bool,
) -> chorus_coordinator::Coordinator {
    within(
        WAIT,
        "coordinator start",
        chorus_coordinator::Coordinator::start(config, metrics),
    )
    .await
    .unwrap_or_else(|e| panic!("coordinator did not start: {e:#}"))
}

/// An agent running on its own runtime and thread, so a test can make it vanish the way a
/// crashed process does: no goodbye, no drain, its connection simply gone.
#[derive(Debug)]
pub struct CrashableAgent {
    kill: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CrashableAgent {
    /// Connects `options` on a fresh runtime, runs `setup` on the agent, and keeps it serving.
    pub fn start<F, Fut>(options: chorus_sdk::AgentOptions, setup: F) -> CrashableAgent
    where
        F: FnOnce(chorus_sdk::Agent) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (kill_tx, kill_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return;
                }
            };
            let agent = rt.block_on(async move {
                let agent = options.connect().await.map_err(|e| e.to_string())?;
                setup(agent.clone()).await;
                Ok::<_, String>(agent)
            });
            let agent = match agent {
                Ok(a) => {
                    let _ = ready_tx.send(Ok(()));
                    a
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = kill_rx.recv();
            // Drop every task without letting it run again: no goodbye, no drain.
            rt.shutdown_background();
            drop(agent);
        });
        match ready_rx.recv_timeout(WAIT) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("crashable agent did not start: {e}"),
            Err(e) => panic!("crashable agent did not start in time: {e}"),
        }
        CrashableAgent {
            kill: Some(kill_tx),
            thread: Some(thread),
        }
    }

    /// Makes the agent vanish.
    pub fn crash(&mut self) {
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for CrashableAgent {
    fn drop(&mut self) {
        self.crash();
    }
}

/// Polls `check` every 20 ms until it returns `Some`, failing the test after `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    within(limit, what, async {
        loop {
            if let Some(v) = check().await {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

/// GETs `path` from an HTTP listener on `addr`: (status code, body). Fails the test if the
/// listener cannot be reached.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    within(WAIT, "http get", try_http_get(addr, path))
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

/// GETs `path` from an HTTP listener on `addr`: (status code, body), or the connection's error
/// (for waiting on a listener that is still starting).
pub async fn try_http_get(
    addr: std::net::SocketAddr,
    path: &str,
) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    // The listener may answer chunked: join the chunks.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || tail.len() < n {
                break;
            }
            out.push_str(&tail[..n]);
            rest = tail[n..].trim_start_matches("\r\n");
        }
        out
    } else {
        body.to_owned()
    };
    Ok((status, body))
}

/// Runs `curl` `method` on `path` at `addr` with `args` (headers, a body) and at most `max`
/// seconds (a server-sent event stream is cut there): (status code, response headers, body)
/// as curl printed them. Fails the test if curl cannot run or the answer has no status.
pub async fn curl(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    args: &[String],
    max: u32,
) -> (u16, String, String) {
    let mut cmd = std::process::Command::new("curl");
    cmd.args([
        "-s",
        "-D",
        "-",
        "-X",
        method,
        "--max-time",
        &max.to_string(),
    ]);
    cmd.args(args);
    cmd.arg(format!("http://{addr}{path}"));
    let out = within(
        Duration::from_secs(u64::from(max) + 10),
        "curl",
        tokio::task::spawn_blocking(move || cmd.output()),
    )
    .await
    .expect("curl task")
    .expect("curl runs (is it installed?)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("curl {method} {path}: no status in {text:?}"));
    (status, head.to_owned(), body.to_owned())
}

/// Processes a test started, killed when it ends however it ends.
#[derive(Debug, Default)]
pub struct Processes(pub Vec<std::process::Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The `chorus` binary, built (or found up to date) by cargo in the calling test's own target
/// directory: `CARGO_BIN_EXE_chorus` exists only for the coordinator package's tests.
pub fn chorus_binary() -> std::path::PathBuf {
    built("chorus-cli", &["--bin", "chorus"], "chorus")
}

/// Runs `chorus --server <url> <args>` off the runtime (which keeps serving the test's agents),
/// within two minutes, and returns whether it succeeded, its standard output and its error.
pub async fn run_chorus(server: &NatsServer, args: &[&str]) -> (bool, String, String) {
    // Off the runtime: finding the binary may run cargo, and the test's agents keep beating.
    let binary = tokio::task::spawn_blocking(chorus_binary)
        .await
        .expect("find the chorus binary");
    let out = within(
        Duration::from_secs(120),
        &format!("chorus {}", args.first().copied().unwrap_or_default()),
        tokio::process::Command::new(binary)
            .arg("--server")
            .arg(server.url())
            .args(args)
            .env_remove("CHORUS_CONTEXT")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("run chorus");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Example `name` of `package`, built (or found up to date) by cargo as [`chorus_binary`] is.
pub fn example_binary(package: &str, name: &str) -> std::path::PathBuf {
    built(package, &["--example", name], &format!("examples/{name}"))
}

/// Builds `what` of `package` in the calling test's own target directory and profile, and
/// returns `path` under that profile's folder.
fn built(package: &str, what: &[&str], path: &str) -> std::path::PathBuf {
    use std::path::Path;
    let exe = std::env::current_exe().expect("test binary path");
    // <target>/<profile>/deps/e2e-<hash>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("profile directory");
    let target_dir = profile_dir.parent().expect("target directory");
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .expect("profile name");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .args(["build", "--quiet", "-p", package])
        .args(what)
        .arg("--target-dir")
        .arg(target_dir);
    if profile != "debug" {
        cmd.args(["--profile", profile]);
    }
    let out = cmd.output().expect("run cargo build");
    assert!(
        out.status.success(),
        "cargo build: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let binary = profile_dir.join(path);
    assert!(binary.is_file(), "no {}", binary.display());
    binary
}

/// The sum of the values of every sample of `name` whose labels contain all of `labels`
/// (each `key="value"`), in Prometheus text output.
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (label_part, value) = match rest.strip_prefix('{') {
            Some(r) => match r.split_once("} ") {
                Some((l, v)) => (l, v),
                None => continue,
            },
            None => match rest.strip_prefix(' ') {
                Some(v) => ("", v),
                None => continue,
            },
        };
        if labels.iter().all(|l| label_part.contains(l))
            && let Ok(v) = value.trim().parse::<f64>()
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// A consumer for `agent_id`'s durable inbox that takes deliveries and never answers them, as
/// an agent that crashes on every message would: each message reaches `max_deliver` and only
/// the server's advisory reports it. Runs until the returned task is aborted or the test ends.
pub async fn crashing_consumer(
    server: &NatsServer,
    agent_id: &str,
    max_deliver: i64,
) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    let broker = raw_broker(server).await;
    let js = broker.jetstream(WAIT);
    let subjects = chorus_sdk::Subjects::default();
    let inbox = subjects.stream_name(chorus_sdk::durable::INBOX_STREAM);
    js.ensure_stream(&chorus_sdk::durable::inbox_stream(
        &subjects,
        &Default::default(),
    ))
    .await
    .unwrap_or_else(|e| panic!("inbox stream: {e}"));
    let mut spec = chorus_broker_adapter::ConsumerSpec::new(agent_id);
    spec.filter_subjects = vec![
        subjects
            .durable_inbox(agent_id, false)
            .unwrap_or_else(|e| panic!("subject: {e}")),
    ];
    spec.ack_wait = Duration::from_millis(500);
    spec.max_deliver = max_deliver;
    let consumer = js
        .ensure_consumer(&inbox, &spec)
        .await
        .unwrap_or_else(|e| panic!("consumer: {e}"));
    let mut deliveries = consumer
        .messages(100)
        .await
        .unwrap_or_else(|e| panic!("messages: {e}"));
    tokio::spawn(async move {
        let _broker = broker;
        while let Some(delivery) = deliveries.next().await {
            drop(delivery);
        }
    })
}

/// This process's resident memory in bytes (Linux), or 0 where unknown.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Three `nats-server`s clustered on loopback, JetStream on every node with fsync per write:
/// [`chorus_nats_server::Cluster`], started or the test fails.
#[derive(Debug)]
pub struct Cluster(chorus_nats_server::Cluster);

impl Cluster {
    /// Starts the three nodes and waits until each listens (see
    /// [`chorus_nats_server::Cluster`]); panics with the cause if one does not come up.
    pub fn start() -> Cluster {
        init_tracing();
        match chorus_nats_server::Cluster::start() {
            Ok(cluster) => Cluster(cluster),
            Err(err) => panic!("cluster did not start: {err}"),
        }
    }
}

impl std::ops::Deref for Cluster {
    type Target = chorus_nats_server::Cluster;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Cluster {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// What a publisher under faults got acknowledged, as it goes.
#[derive(Debug, Clone, Default)]
pub struct Acked {
    numbers: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
    resent: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Acked {
    /// Sends made again after a failed one: each may have stored a second copy (its first
    /// send stored, its ack lost), which at least once allows and a handler then sees twice.
    pub fn resent(&self) -> usize {
        self.resent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many so far.
    pub fn count(&self) -> usize {
        self.numbers.lock().map_or(0, |n| n.len())
    }

    /// Every acknowledged number.
    pub fn set(&self) -> std::collections::HashSet<u32> {
        self.numbers
            .lock()
            .map(|n| n.iter().copied().collect())
            .unwrap_or_default()
    }
}

/// Sends `work(n)` for every `n` below `sent` as at-least-once `work` commands to agent
/// `worker`, in batches of `chunk`, recording the acknowledged ones. A message whose send
/// failed (refused at once while a stream has no leader, or its ack lost) is sent again, as a
/// producer under at-least-once does, up to [`SEND_ATTEMPTS`] times a pause apart, so the
/// traffic goes on through a fault instead of running out while it lasts. Returns the sender
/// when done.
pub fn publish_tracking_acks(
    sender: chorus_sdk::Agent,
    worker: &'static str,
    sent: u32,
    chunk: usize,
) -> (tokio::task::JoinHandle<chorus_sdk::Agent>, Acked) {
    let acked = Acked::default();
    let numbers = std::sync::Arc::clone(&acked.numbers);
    let resent = std::sync::Arc::clone(&acked.resent);
    let task = tokio::spawn(async move {
        for batch in (0..sent).collect::<Vec<_>>().chunks(chunk) {
            let mut left: Vec<u32> = batch.to_vec();
            for attempt in 1..=SEND_ATTEMPTS {
                if attempt > 1 {
                    resent.fetch_add(left.len(), std::sync::atomic::Ordering::Relaxed);
                }
                let calls = left
                    .iter()
                    .map(|n| {
                        chorus_sdk::Call::agent(worker, "work")
                            .delivery(chorus_sdk::DeliveryClass::AtLeastOnce)
                            .payload(n)
                            .unwrap_or_else(|e| panic!("payload: {e}"))
                    })
                    .collect();
                let results = sender.send_batch(calls).await;
                let (ok, failed): (Vec<_>, Vec<_>) =
                    left.iter().zip(&results).partition(|(_, r)| r.is_ok());
                if let Ok(mut numbers) = numbers.lock() {
                    numbers.extend(ok.into_iter().map(|(n, _)| *n));
                }
                left = failed.into_iter().map(|(n, _)| *n).collect();
                if left.is_empty() {
                    break;
                }
                if attempt < SEND_ATTEMPTS {
                    tokio::time::sleep(SEND_RETRY_PAUSE).await;
                }
            }
        }
        sender
    });
    (task, acked)
}

/// How many times [`publish_tracking_acks`] sends a message whose send failed.
pub const SEND_ATTEMPTS: u32 = 20;
/// The pause between two of those sends.
const SEND_RETRY_PAUSE: Duration = Duration::from_millis(250);

/// Whether inbox consumer `consumer` of `stream` has nothing pending and nothing awaiting an
/// ack, or is gone: an on-demand inbox deletes its consumer only once that is so.
pub async fn consumer_idle(
    js: &chorus_broker_adapter::JetStream,
    stream: &str,
    consumer: &str,
) -> bool {
    match js.consumer_state(stream, consumer).await {
        Ok(state) => state.pending == 0 && state.ack_pending == 0,
        Err(err) => err.kind() == chorus_broker_adapter::ErrorKind::NotFound,
    }
}

/// Whether agent `agent`'s durable inbox is settled: no command stored for it (acked and
/// dead-lettered ones are removed from the work-queue stream) and neither consumer holding
/// anything, if it has them now.
pub async fn inbox_settled(agent: &chorus_sdk::Agent, id: &str) -> bool {
    let subjects = agent.subjects();
    let js = agent.broker().jetstream(Duration::from_secs(5));
    let stream = subjects.stream_name(chorus_sdk::durable::INBOX_STREAM);
    let Ok(filter) = subjects.durable_agent_all(id) else {
        return false;
    };
    matches!(js.has_messages(&stream, &filter).await, Ok(false))
        && consumer_idle(&js, &stream, id).await
        && consumer_idle(&js, &stream, &format!("{id}_high")).await
}

/// Sent, acked, handled and lost, after a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossReport {
    /// Acknowledged by the server.
    pub acked: usize,
    /// Distinct messages handled.
    pub handled: usize,
    /// Acknowledged and never handled.
    pub lost: usize,
    /// Handler calls beyond the first for a message.
    pub duplicated: usize,
    /// Whether the server had nothing left for the consumer when counted (no message pending,
    /// none awaiting its ack); false if the wait ran out first.
    pub settled: bool,
}

/// Waits (up to `limit`) until the server has nothing left to give `consumer` of `stream` (no
/// message pending, none delivered and awaiting an ack, and none left in the stream: acked
/// inbox messages are removed, so this holds only once `consumer` is its only reader and has
/// acked everything), then counts what was acknowledged against what was handled. The wait does not depend on the count: a message acknowledged
/// and never handled shows as `lost`, not as a timeout.
pub async fn settle_and_count(
    acked: &Acked,
    seen: &std::sync::Mutex<Vec<u32>>,
    js: &chorus_broker_adapter::JetStream,
    stream: &str,
    consumer: &str,
    limit: Duration,
) -> LossReport {
    let settled = tokio::time::timeout(limit, async {
        loop {
            if consumer_idle(js, stream, consumer).await
                && let Ok(stored) = js.stream_state(stream).await
                && stored.messages == 0
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .is_ok();
    let acked = acked.set();
    let (handled, calls) = seen.lock().map_or_else(
        |_| (std::collections::HashSet::new(), 0),
        |s| (s.iter().copied().collect(), s.len()),
    );
    LossReport {
        acked: acked.len(),
        handled: handled.len(),
        lost: acked.difference(&handled).count(),
        duplicated: calls.saturating_sub(handled.len()),
        settled,
    }
}

/// Starts each coordinator of a `chorus chaos` run in this process, on an isolated runtime,
/// so that a kill drops it where it stands, as `kill -9` of `chorus serve` would.
#[derive(Debug)]
pub struct InProcessCoordinator;

impl chorus_chaos::CoordinatorLauncher for InProcessCoordinator {
    fn start<'a>(
        &'a self,
        spec: &'a chorus_chaos::CoordinatorSpec,
    ) -> futures::future::BoxFuture<'a, anyhow::Result<Box<dyn chorus_chaos::RunningCoordinator>>>
    {
        Box::pin(async move {
            let config = chorus_coordinator::CoordinatorConfig {
                servers: spec.servers.join(","),
                metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                replicas: spec.replicas,
                inbox: chorus_sdk::durable::InboxLimits::default().replicas(spec.replicas),
                ..chorus_coordinator::CoordinatorConfig::default()
            };
            let isolated = chorus_chaos::Isolated::start("coordinator", move || async move {
                Ok(chorus_coordinator::Coordinator::start(config, false).await?)
            })
            .await?;
            Ok(Box::new(InProcessStarted(isolated)) as Box<dyn chorus_chaos::RunningCoordinator>)
        })
    }
}

#[derive(Debug)]
struct InProcessStarted(chorus_chaos::Isolated);

impl chorus_chaos::RunningCoordinator for InProcessStarted {
    fn kill(mut self: Box<Self>) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(async move { self.0.crash().await })
    }

    /// At the end of a run, when nothing depends on its goodbye: the same as a kill.
    fn shutdown(mut self: Box<Self>) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(async move { self.0.crash().await })
    }
}
