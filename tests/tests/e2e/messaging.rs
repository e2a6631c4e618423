//! Events, commands and request-reply through the SDK.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chorus_sdk::{Call, Context, HandlerError, SdkError, StatusCode};
use chorus_tests::{WAIT, agent, agent_options, server, within};
use futures::{StreamExt, TryStreamExt, stream};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Calc {
    op: String,
    a: f64,
    b: f64,
}

async fn calculator(server: &chorus_tests::NatsServer, id: &str) -> chorus_sdk::Agent {
    let calc = agent(server, id).await;
    calc.on_command("calculate", |_ctx: Context, c: Calc| async move {
        match c.op.as_str() {
            "add" => Ok(c.a + c.b),
            "mul" => Ok(c.a * c.b),
            "div" if c.b == 0.0 => Err(HandlerError::invalid_argument("division by zero")),
            "div" => Ok(c.a / c.b),
            other => Err(HandlerError::failed(format!("unknown operation {other}"))),
        }
    })
    .await
    .expect("register");
    calc
}

#[tokio::test]
async fn events_reach_every_matching_subscriber_by_wildcard() {
    let server = server();
    let publisher = agent(&server, "publisher").await;
    let star = agent(&server, "star").await;
    let tail = agent(&server, "tail").await;
    let other = agent(&server, "other").await;

    let mut star_events = star.subscribe("doc.*").await.expect("subscribe");
    let mut tail_events = tail.subscribe("doc.>").await.expect("subscribe");
    let mut other_events = other.subscribe("billing.>").await.expect("subscribe");
    let handled = Arc::new(AtomicUsize::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    {
        let handled = Arc::clone(&handled);
        other
            .on_event("doc.ready", move |ctx: Context, name: String| {
                let handled = Arc::clone(&handled);
                let tx = tx.clone();
                async move {
                    handled.fetch_add(1, Ordering::SeqCst);
                    let _ = tx.send((ctx.from().to_owned(), name));
                    Ok(())
                }
            })
            .await
            .expect("on_event");
    }

    publisher
        .publish("doc.ready", "report.pdf")
        .await
        .expect("publish");
    publisher
        .publish("doc.pages.scanned", &3u32)
        .await
        .expect("publish");

    let e = within(WAIT, "doc.* event", star_events.next())
        .await
        .expect("event");
    assert_eq!(e.topic(), "doc.ready");
    assert_eq!(e.envelope.from, "publisher");
    assert_eq!(e.payload_as::<String>().expect("payload"), "report.pdf");

    let first = within(WAIT, "first doc.> event", tail_events.next())
        .await
        .expect("event");
    let second = within(WAIT, "doc.> event", tail_events.next())
        .await
        .expect("event");
    assert_eq!(
        (first.topic(), second.topic()),
        ("doc.ready", "doc.pages.scanned")
    );
    assert_eq!(second.payload_as::<u32>().expect("payload"), 3);

    let (from, name) = within(WAIT, "handler event", rx.recv())
        .await
        .expect("handled");
    assert_eq!((from.as_str(), name.as_str()), ("publisher", "report.pdf"));

    // `doc.*` does not match the three-token topic, and `billing.>` matches nothing here: a
    // sentinel published after everything else is the first thing `other` sees on billing.>.
    publisher.publish("doc.last", &()).await.expect("publish");
    publisher
        .publish("billing.sentinel", &())
        .await
        .expect("publish");
    let e = within(WAIT, "doc.last", star_events.next())
        .await
        .expect("event");
    assert_eq!(
        e.topic(),
        "doc.last",
        "doc.pages.scanned must not have matched doc.*"
    );
    let first_billing = within(WAIT, "billing sentinel", other_events.next())
        .await
        .expect("event");
    assert_eq!(
        first_billing.topic(),
        "billing.sentinel",
        "nothing else matched billing.>"
    );
    assert_eq!(handled.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn commands_run_typed_handlers_and_errors_come_back_coded() {
    let server = server();
    let _calc = calculator(&server, "calculator").await;
    let orchestrator = agent(&server, "orchestrator").await;

    let add = Calc {
        op: "add".into(),
        a: 2.0,
        b: 3.5,
    };
    let sum: f64 = orchestrator
        .command("calculator", "calculate", &add)
        .await
        .expect("add");
    assert_eq!(sum, 5.5);
    let product: f64 = orchestrator
        .request(
            "calculator",
            "calculate",
            &Calc {
                op: "mul".into(),
                a: 4.0,
                b: 2.5,
            },
        )
        .await
        .expect("mul");
    assert_eq!(product, 10.0);

    let err = orchestrator
        .request::<_, f64>(
            "calculator",
            "calculate",
            &Calc {
                op: "div".into(),
                a: 1.0,
                b: 0.0,
            },
        )
        .await
        .expect_err("division by zero");
    assert_eq!(err.status(), StatusCode::INVALID_ARGUMENT);
    assert!(err.to_string().contains("division by zero"), "{err}");

    let err = orchestrator
        .request::<_, f64>(
            "calculator",
            "calculate",
            &Calc {
                op: "pow".into(),
                a: 1.0,
                b: 0.0,
            },
        )
        .await
        .expect_err("unknown op");
    assert_eq!(err.status(), StatusCode::HANDLER_FAILED);

    let err = orchestrator
        .request::<_, f64>("calculator", "integrate", &add)
        .await
        .expect_err("no such command");
    assert_eq!(err.status(), StatusCode::UNKNOWN_COMMAND);

    // A payload of the wrong shape is a data-format error, not a crash or a timeout.
    let err = orchestrator
        .request::<_, f64>("calculator", "calculate", &"not a calc")
        .await
        .expect_err("bad args");
    assert_eq!(err.status(), StatusCode::DATA_FORMAT);

    let err = orchestrator
        .request::<_, f64>("nobody", "calculate", &add)
        .await
        .expect_err("no agent");
    assert!(matches!(err, SdkError::NoResponders(_)), "{err}");
    assert_eq!(err.status(), StatusCode::NO_RESPONDERS);
}

#[tokio::test]
async fn a_json_request_gets_a_json_reply() {
    let server = server();
    let _calc = calculator(&server, "calculator").await;
    let client = agent(&server, "cli").await;
    let reply = client
        .call(
            Call::agent("calculator", "calculate")
                .json_payload(&serde_json::json!({"op": "add", "a": 1, "b": 2}))
                .expect("json"),
        )
        .await
        .expect("reply");
    assert_eq!(reply.envelope.content_type, "application/json");
    assert_eq!(&reply.payload()[..], b"3.0");
    assert_eq!(reply.status(), StatusCode::OK);
    assert_eq!(reply.envelope.from, "calculator");
}

#[tokio::test]
async fn a_slow_handler_times_out_at_the_callers_deadline() {
    let server = server();
    let slow = agent(&server, "slow").await;
    slow.on_command("nap", |_ctx: Context, ms: u64| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, HandlerError>(())
    })
    .await
    .expect("register");
    let caller = agent(&server, "caller").await;
    let started = std::time::Instant::now();
    let err = caller
        .call(
            Call::agent("slow", "nap")
                .payload(&2_000u64)
                .expect("payload")
                .timeout(Duration::from_millis(150)),
        )
        .await
        .expect_err("timeout");
    assert!(matches!(err, SdkError::Timeout(_)), "{err}");
    assert_eq!(err.status(), StatusCode::TIMEOUT);
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn capability_requests_are_shared_across_the_agents_offering_it() {
    let server = server();
    let counts: Vec<Arc<AtomicUsize>> = (0..2).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    let mut workers = Vec::new();
    for (i, count) in counts.iter().enumerate() {
        let worker = agent(&server, &format!("ocr-{i}")).await;
        let count = Arc::clone(count);
        worker
            .on_capability("text.ocr", move |ctx: Context, page: u32| {
                let count = Arc::clone(&count);
                async move {
                    count.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, HandlerError>(format!("page {page} read by {}", ctx.agent_id()))
                }
            })
            .await
            .expect("serve");
        assert_eq!(worker.capabilities(), vec!["text.ocr".to_owned()]);
        workers.push(worker);
    }
    let client = agent(&server, "client").await;
    let replies: Vec<String> = within(
        WAIT,
        "200 capability requests",
        stream::iter(0..200u32)
            .map(|page| {
                let client = client.clone();
                async move {
                    client
                        .request_capability::<_, String>("text.ocr", &page)
                        .await
                }
            })
            .buffer_unordered(16)
            .try_collect(),
    )
    .await
    .expect("all replies");
    assert_eq!(replies.len(), 200);
    let (a, b) = (
        counts[0].load(Ordering::SeqCst),
        counts[1].load(Ordering::SeqCst),
    );
    assert_eq!(a + b, 200, "each request handled exactly once");
    assert!(a > 0 && b > 0, "both agents took a share: {a} / {b}");
}

#[tokio::test]
async fn ten_thousand_requests_get_ten_thousand_correct_replies() {
    let server = server();
    let _calc = calculator(&server, "calculator").await;
    let client = chorus_tests::within(
        WAIT,
        "connect",
        agent_options(&server, "load-client").connect(),
    )
    .await
    .expect("connect");
    let correct = within(
        Duration::from_secs(120),
        "10,000 requests",
        stream::iter(0..10_000u32)
            .map(|i| {
                let client = client.clone();
                async move {
                    let c = Calc {
                        op: "add".into(),
                        a: f64::from(i),
                        b: 1.0,
                    };
                    let sum: f64 = client.request("calculator", "calculate", &c).await?;
                    Ok::<_, SdkError>(sum == f64::from(i) + 1.0)
                }
            })
            .buffer_unordered(64)
            .try_fold(0usize, |n, ok| async move { Ok(n + usize::from(ok)) }),
    )
    .await
    .expect("no request failed");
    assert_eq!(correct, 10_000);
    let stats = client.stats();
    assert_eq!(stats.requests_sent, 10_000);
}

#[tokio::test]
async fn trace_context_travels_in_every_envelope_and_keeps_its_trace_id_across_agents() {
    let server = server();
    let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let c = agent(&server, "trace-c").await;
    {
        let seen = Arc::clone(&seen);
        c.on_command("leaf", move |ctx: Context, (): ()| {
            seen.lock().expect("lock").push(
                ctx.message()
                    .trace
                    .as_ref()
                    .expect("trace")
                    .traceparent
                    .to_string(),
            );
            async { Ok::<_, HandlerError>(()) }
        })
        .await
        .expect("register");
    }
    let b = agent(&server, "trace-b").await;
    {
        let seen = Arc::clone(&seen);
        b.on_command("mid", move |ctx: Context, (): ()| {
            seen.lock().expect("lock").push(
                ctx.message()
                    .trace
                    .as_ref()
                    .expect("trace")
                    .traceparent
                    .to_string(),
            );
            async move {
                ctx.request::<_, ()>("trace-c", "leaf", &()).await?;
                Ok::<_, HandlerError>(())
            }
        })
        .await
        .expect("register");
    }
    let a = agent(&server, "trace-a").await;
    a.request::<_, ()>("trace-b", "mid", &())
        .await
        .expect("chain");
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2);
    let parsed: Vec<_> = seen
        .iter()
        .map(|t| chorus_sdk::trace::parse_traceparent(t).expect("valid W3C traceparent"))
        .collect();
    assert_eq!(
        parsed[0].trace_id(),
        parsed[1].trace_id(),
        "one trace across agents"
    );
    assert_ne!(
        parsed[0].span_id(),
        parsed[1].span_id(),
        "a new span per hop"
    );
}

#[tokio::test]
async fn an_event_subject_past_the_length_limit_is_refused_with_a_clear_error() {
    let server = server();
    let publisher = agent(&server, "publisher").await;
    // 16 tokens of 64 characters: a valid topic, but its subject passes 512 bytes.
    let topic = vec!["t".repeat(64); 16].join(".");
    let err = publisher
        .publish(&topic, &"x")
        .await
        .expect_err("too long a subject");
    assert!(
        err.to_string().contains("too long"),
        "the error says why: {err}"
    );
    // The agent goes on publishing.
    publisher
        .publish("doc.ready", &"x")
        .await
        .expect("publishes");
    publisher.shutdown().await;
}

/// Many agents in one process on one connection (`AgentOptions::connection`): each serves its
/// own commands under its own id; one shutting down leaves the connection and the others.
#[tokio::test]
async fn agents_sharing_one_connection_each_serve_and_one_leaving_leaves_the_rest() {
    let server = server();
    let connection = chorus_sdk::BrokerOptions::new([server.url()])
        .name("fleet")
        .connect()
        .await
        .expect("connection");
    let mut agents = Vec::new();
    for i in 0..50 {
        let agent = chorus_sdk::AgentOptions::new(format!("fleet-{i}"))
            .connection(connection.clone())
            .connect()
            .await
            .expect("agent on the shared connection");
        agent
            .on_command("who", |ctx: Context, (): ()| async move {
                Ok::<_, HandlerError>(ctx.agent_id().to_owned())
            })
            .await
            .expect("handler");
        agents.push(agent);
    }
    let caller = agent(&server, "fleet-caller").await;
    for i in 0..50 {
        let id = format!("fleet-{i}");
        let who: String = caller.request(&id, "who", &()).await.expect("answers");
        assert_eq!(who, id);
    }
    let leaving = agents.remove(7);
    within(WAIT, "one agent shuts down", leaving.shutdown()).await;
    assert!(matches!(
        caller.request::<_, String>("fleet-7", "who", &()).await,
        Err(SdkError::NoResponders(_))
    ));
    assert!(connection.is_connected(), "the shared connection stays");
    for i in [0, 8, 49] {
        let id = format!("fleet-{i}");
        let who: String = caller
            .request(&id, "who", &())
            .await
            .expect("still answers");
        assert_eq!(who, id);
    }
    for agent in agents {
        agent.shutdown().await;
    }
    connection.drain().await.expect("drained by its owner");
}
