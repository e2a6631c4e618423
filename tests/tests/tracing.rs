//! A request crossing three agents is one trace with parent-child spans (each carrying the
//! session and customer the request was made for), read back from an
//! in-memory OpenTelemetry exporter. (Its own test binary: it installs a global tracer
//! provider, which would record every other test's spans.)

use std::sync::{Arc, Mutex};

use chorus_sdk::{Call, Context, HandlerError};
use chorus_tests::{WAIT, agent, eventually, server};
use opentelemetry::trace::{SpanId, SpanKind, TraceId};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};

#[tokio::test]
async fn a_request_across_three_agents_is_one_trace_with_parent_child_spans() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    // Installed, and spans turned on, before any traffic.
    opentelemetry::global::set_tracer_provider(provider.clone());
    chorus_sdk::trace::enable_spans();

    let server = server();
    let seen_traceparent = Arc::new(Mutex::new(None::<String>));
    let c = agent(&server, "agent-c").await;
    {
        let seen = Arc::clone(&seen_traceparent);
        c.on_command("leaf", move |ctx: Context, n: u32| {
            *seen.lock().expect("lock") = ctx
                .message()
                .trace
                .as_ref()
                .map(|t| t.traceparent.to_string());
            async move { Ok::<_, HandlerError>(n * 2) }
        })
        .await
        .expect("register");
    }
    let b = agent(&server, "agent-b").await;
    b.on_command("plan", |ctx: Context, n: u32| async move {
        let doubled: u32 = ctx.request("agent-c", "leaf", &(n + 1)).await?;
        Ok::<_, HandlerError>(doubled)
    })
    .await
    .expect("register");
    let a = agent(&server, "agent-a").await;
    let answer: u32 = a
        .call(
            Call::agent("agent-b", "plan")
                .session("chat-7")
                .customer("acme")
                .payload(&20u32)
                .expect("payload"),
        )
        .await
        .expect("chain answers")
        .payload_as()
        .expect("a number");
    assert_eq!(answer, 42);

    let find = |spans: &[SpanData], name: &str, kind: SpanKind| {
        spans
            .iter()
            .find(|s| s.name == name && s.span_kind == kind)
            .cloned()
    };
    let spans = eventually(WAIT, "the four spans", || {
        let exporter = exporter.clone();
        async move {
            let spans = exporter.get_finished_spans().ok()?;
            let got = (
                find(&spans, "chorus.request plan", SpanKind::Client)?,
                find(&spans, "chorus.handle plan", SpanKind::Server)?,
                find(&spans, "chorus.request leaf", SpanKind::Client)?,
                find(&spans, "chorus.handle leaf", SpanKind::Server)?,
            );
            Some(got)
        }
    })
    .await;
    let (a_request, b_handle, b_request, c_handle) = spans;
    let trace: TraceId = a_request.span_context.trace_id();
    for s in [&b_handle, &b_request, &c_handle] {
        assert_eq!(
            s.span_context.trace_id(),
            trace,
            "{} is in the same trace",
            s.name
        );
    }
    assert_eq!(
        a_request.parent_span_id,
        SpanId::INVALID,
        "the chain starts at A"
    );
    assert_eq!(b_handle.parent_span_id, a_request.span_context.span_id());
    assert_eq!(b_request.parent_span_id, b_handle.span_context.span_id());
    assert_eq!(c_handle.parent_span_id, b_request.span_context.span_id());
    // The session and customer A set are on every span of the chain, B's forward included.
    for s in [&a_request, &b_handle, &b_request, &c_handle] {
        for (key, value) in [
            ("chorus.session_id", "chat-7"),
            ("chorus.customer_id", "acme"),
        ] {
            assert!(
                s.attributes
                    .iter()
                    .any(|kv| kv.key.as_str() == key && kv.value.as_str() == value),
                "{} carries {key}={value}: {:?}",
                s.name,
                s.attributes
            );
        }
    }
    // Each span says what the message was, from whom, to whom and how large.
    let attribute = |s: &SpanData, key: &str| {
        s.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.as_str().into_owned())
    };
    for (s, from, to) in [
        (&a_request, "agent-a", "agent-b"),
        (&b_handle, "agent-a", "agent-b"),
        (&b_request, "agent-b", "agent-c"),
        (&c_handle, "agent-b", "agent-c"),
    ] {
        assert_eq!(
            attribute(s, "chorus.kind").as_deref(),
            Some("request"),
            "{}",
            s.name
        );
        assert_eq!(
            attribute(s, "chorus.from").as_deref(),
            Some(from),
            "{}",
            s.name
        );
        assert_eq!(
            attribute(s, "chorus.destination").as_deref(),
            Some(to),
            "{}",
            s.name
        );
        // 20 and 21 as MessagePack: one byte each.
        assert_eq!(
            attribute(s, "messaging.message.body.size").as_deref(),
            Some("1"),
            "{}",
            s.name
        );
    }
    // And the envelope C received carried the trace as W3C trace context.
    let traceparent = seen_traceparent
        .lock()
        .expect("lock")
        .clone()
        .expect("traceparent");
    assert!(
        traceparent.starts_with(&format!("00-{trace}-{}-", b_request.span_context.span_id())),
        "{traceparent}"
    );
    println!("trace {trace}: A request -> B handle -> B request -> C handle");
    let _ = provider.shutdown();
}
