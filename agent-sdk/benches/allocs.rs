//! Heap allocations per message on the SDK's real paths, through a real `nats-server`:
//! publishing an event (`Agent::publish_raw`), and receiving one as a stream
//! (`Agent::subscribe`) and in a handler (`Agent::handle_events`). Everything runs on one
//! thread (a current-thread runtime, the NATS connections' own tasks included), and
//! `allocation-counter` counts that thread's allocations; the same traffic through raw
//! async-nats is counted the same way, so the difference is what the SDK adds.
//!
//! `cargo bench -p chorus-sdk --bench allocs`. The server: `NATS_URL` if set, else one started
//! from `NATS_SERVER` (or `nats-server` on the `PATH`, or the one `scripts/install-nats-server`
//! put in `.tools/bin`) on a free loopback port.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chorus_broker_adapter::raw::RawClient;
use chorus_sdk::{Agent, AgentOptions, Context, Encoding, EventHandler, HandlerError};
use futures::StreamExt;

/// Messages per measurement (fewer than a subscription's buffer holds, so none is dropped).
const N: u64 = 20_000;
/// How long a measurement may wait for its messages.
const DEADLINE: Duration = Duration::from_secs(30);

/// A `nats-server` this bench started, stopped when dropped.
struct Server(Option<Child>);

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn server() -> (String, Server) {
    if let Ok(url) = std::env::var("NATS_URL") {
        return (url, Server(None));
    }
    let binary = std::env::var("NATS_SERVER").unwrap_or_else(|_| {
        let local = concat!(env!("CARGO_MANIFEST_DIR"), "/../.tools/bin/nats-server");
        if std::path::Path::new(local).exists() {
            local.to_owned()
        } else {
            "nats-server".to_owned()
        }
    });
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port();
    let child = Command::new(&binary)
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("allocs: cannot start {binary} ({e}); set NATS_URL or NATS_SERVER")
        });
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "allocs: nats-server did not listen within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (format!("nats://127.0.0.1:{port}"), Server(Some(child)))
}

/// Allocations per message made on this thread while `run` completes on `rt`.
fn per_message<F: std::future::Future<Output = ()>>(
    rt: &tokio::runtime::Runtime,
    run: impl FnOnce() -> F,
) -> f64 {
    let info = allocation_counter::measure(|| rt.block_on(run()));
    info.count_total as f64 / N as f64
}

async fn agent(url: &str, id: &str) -> Agent {
    AgentOptions::new(id)
        .servers([url])
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .encoding(Encoding::Compact)
        .connect()
        .await
        .expect("agent connects")
}

/// Counts events handed to it.
struct Count(Arc<AtomicU64>);

impl EventHandler for Count {
    fn call(&self, _ctx: Context) -> chorus_sdk::BoxFuture<Result<(), HandlerError>> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Box::pin(async { Ok(()) })
    }
}

/// Waits until `count` reaches `n`, yielding to the connection's tasks in between.
async fn until(count: &AtomicU64, n: u64) {
    let started = Instant::now();
    while count.load(Ordering::Relaxed) < n {
        assert!(started.elapsed() < DEADLINE, "allocs: messages missing");
        tokio::task::yield_now().await;
    }
}

fn main() {
    let (url, _server) = server();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let payload = Bytes::from(vec![0x5a; 128]);
    let topic = "bench.allocs";

    let (raw, publisher, events, handled) = rt.block_on(async {
        let raw = RawClient::connect(&url, "allocs-raw").await.expect("raw");
        (
            raw,
            agent(&url, "allocs-publisher").await,
            agent(&url, "allocs-stream").await,
            agent(&url, "allocs-handler").await,
        )
    });
    let subject = publisher.subjects().event(topic).expect("an event subject");

    // Publishing: raw async-nats, then the SDK, nobody subscribed.
    let raw_publish = per_message(&rt, || async {
        for _ in 0..N {
            raw.publish(&subject, payload.clone()).await.expect("raw");
        }
        raw.flush().await.expect("flush");
    });
    let sdk_publish = per_message(&rt, || async {
        for _ in 0..N {
            publisher
                .publish_raw(topic, payload.clone(), "application/octet-stream")
                .await
                .expect("publishes");
        }
        publisher.broker().flush().await.expect("flush");
    });

    // Receiving: an event as the SDK published it above, sent N times by a raw publisher
    // (each phase on its own topic, subscribed before counting) to a raw subscriber, to a
    // stream and to a handler.
    let envelope = rt.block_on(async {
        let mut sub = raw.subscribe(&subject).await.expect("raw subscribe");
        // The subscription is another connection's: publish until it is in place.
        let started = Instant::now();
        loop {
            publisher
                .publish_raw(topic, payload.clone(), "application/octet-stream")
                .await
                .expect("publishes");
            if let Ok(Some(msg)) =
                tokio::time::timeout(Duration::from_millis(100), sub.next()).await
            {
                break msg.payload().clone();
            }
            assert!(started.elapsed() < DEADLINE, "allocs: no event arrives");
        }
    });
    let on = |name: &str| {
        let topic = format!("{topic}.{name}");
        let subject = publisher.subjects().event(&topic).expect("subject");
        (topic, subject)
    };
    let send = |subject: String| {
        let (raw, envelope) = (&raw, &envelope);
        async move {
            for _ in 0..N {
                raw.publish(&subject, envelope.clone()).await.expect("raw");
            }
            raw.flush().await.expect("flush");
        }
    };
    let (_, raw_subject) = on("raw");
    let mut raw_sub = rt.block_on(async {
        let sub = raw.subscribe(&raw_subject).await.expect("raw subscribe");
        raw.flush().await.expect("flush");
        sub
    });
    let raw_receive = per_message(&rt, || async {
        send(raw_subject.clone()).await;
        for _ in 0..N {
            tokio::time::timeout(DEADLINE, raw_sub.next())
                .await
                .expect("arrives")
                .expect("a message");
        }
    });
    let (stream_topic, stream_subject) = on("stream");
    let mut stream = rt
        .block_on(events.subscribe(&stream_topic))
        .expect("subscribes");
    let sdk_stream = per_message(&rt, || async {
        send(stream_subject.clone()).await;
        for _ in 0..N {
            tokio::time::timeout(DEADLINE, stream.next())
                .await
                .expect("arrives")
                .expect("an event");
        }
    });
    let (handler_topic, handler_subject) = on("handler");
    let count = Arc::new(AtomicU64::new(0));
    rt.block_on(handled.handle_events(&handler_topic, Count(Arc::clone(&count))))
        .expect("subscribes");
    let sdk_handler = per_message(&rt, || async {
        send(handler_subject.clone()).await;
        until(&count, N).await;
    });
    drop((raw_sub, stream));
    rt.block_on(async {
        for a in [publisher, events, handled] {
            a.shutdown().await;
        }
    });

    println!("allocations per 128-byte event on one thread, {N} events, compact form:");
    println!(
        "  publish: raw async-nats {raw_publish:.2}, Chorus {sdk_publish:.2}: the SDK adds {:.2}",
        sdk_publish - raw_publish
    );
    println!(
        "  receive: raw async-nats {raw_receive:.2}, Chorus stream {sdk_stream:.2} (adds {:.2}), Chorus handler {sdk_handler:.2} (adds {:.2})",
        sdk_stream - raw_receive,
        sdk_handler - raw_receive
    );
}
