//! Tracing across agents: W3C trace context in every envelope, OpenTelemetry spans per
//! request, publish and handling.
//!
//! Spans go to whatever OpenTelemetry tracer provider the process installs
//! (`opentelemetry::global::set_tracer_provider`, then [`enable_spans`]); without that, no
//! span is made, but every envelope still carries a `traceparent` (the inherited trace id and
//! a new span id), so a trace can be followed in logs and picked up by agents that do export. One request crossing agents A, B and C is one
//! trace: A's request span, B's handle span as its child, B's request span under that, C's
//! handle span under that.

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
};
use opentelemetry::{Context as OtelContext, KeyValue, global};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::protocol::envelope::{Envelope, TraceContext, TraceParent};

static SPANS: AtomicBool = AtomicBool::new(false);

/// Turns OpenTelemetry spans on for every agent in the process: call it after installing a
/// tracer provider (`opentelemetry::global::set_tracer_provider`). Off by default, so an agent
/// that exports nothing pays only for the `traceparent` it writes.
pub fn enable_spans() {
    SPANS.store(true, Ordering::Relaxed);
}

/// Whether spans are on.
pub fn spans_enabled() -> bool {
    SPANS.load(Ordering::Relaxed)
}

/// `00-<trace id>-<span id>-<flags>`.
pub fn format_traceparent(sc: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    )
}

/// Parses a W3C `traceparent`; `None` for anything malformed or all-zero.
pub fn parse_traceparent(text: &str) -> Option<SpanContext> {
    let mut parts = text.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    let sc = SpanContext::new(
        TraceId::from_hex(trace).ok()?,
        SpanId::from_hex(span).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// The context to handle an envelope in: its remote parent when spans are on, empty otherwise.
pub(crate) fn remote_parent(env: &Envelope) -> OtelContext {
    if !spans_enabled() {
        return OtelContext::new();
    }
    env.trace
        .as_ref()
        .and_then(|t| span_context_of(&t.traceparent))
        .map_or_else(OtelContext::new, |sc| {
            OtelContext::new().with_remote_span_context(sc)
        })
}

/// The span context of a `traceparent` (read from its bytes when it is held as bytes).
fn span_context_of(traceparent: &TraceParent) -> Option<SpanContext> {
    let Some(b) = traceparent.as_bytes() else {
        return traceparent.with_text(parse_traceparent);
    };
    let mut trace = [0u8; 16];
    trace.copy_from_slice(&b[..16]);
    let mut span = [0u8; 8];
    span.copy_from_slice(&b[16..24]);
    let sc = SpanContext::new(
        TraceId::from_bytes(trace),
        SpanId::from_bytes(span),
        TraceFlags::new(b[24]),
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// The `traceparent` of a span context.
fn traceparent_of(sc: &SpanContext) -> TraceParent {
    let mut b = [0u8; 25];
    b[..16].copy_from_slice(&sc.trace_id().to_bytes());
    b[16..24].copy_from_slice(&sc.span_id().to_bytes());
    b[24] = sc.trace_flags().to_u8();
    TraceParent::from_bytes(b)
}

thread_local! {
    static RNG: Cell<u64> = Cell::new(
        (uuid::Uuid::now_v7().as_u128() as u64) | 1
    );
}

/// A non-zero random 64-bit number (xorshift, seeded per thread from a UUIDv7's random bits).
fn random_u64() -> u64 {
    RNG.with(|r| {
        let mut x = r.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        r.set(x);
        x
    })
}

/// A new trace context with spans off, as its 25 bytes: a new trace id, a new parent (span)
/// id, sampled.
pub(crate) fn fresh() -> [u8; 25] {
    let mut out = [0u8; 25];
    out[..8].copy_from_slice(&random_u64().to_be_bytes());
    out[8..16].copy_from_slice(&random_u64().to_be_bytes());
    out[16..24].copy_from_slice(&random_u64().to_be_bytes());
    out[24] = 1;
    out
}

/// The trace id of a `traceparent`, when it has a well-formed one.
fn trace_id_of(tc: &TraceContext) -> Option<[u8; 16]> {
    if let Some(b) = tc.traceparent.as_bytes() {
        let mut id = [0u8; 16];
        id.copy_from_slice(&b[..16]);
        return Some(id);
    }
    tc.traceparent.with_text(|text| {
        let hex_id = text.get(3..35).filter(|_| text.starts_with("00-"))?;
        let mut id = [0u8; 16];
        hex::decode_to_slice(hex_id, &mut id).ok()?;
        Some(id)
    })
}

/// A span for something this agent sends, and the `traceparent` for its envelope.
///
/// With spans on, an OpenTelemetry span of `kind` named `name()` starts under `parent` (or,
/// if that is empty, under the trace the envelope inherited). With spans off, only the trace
/// context is made: the inherited trace id (or a new one) and a new span id.
pub(crate) fn start(
    kind: SpanKind,
    parent: &OtelContext,
    inherited: Option<&TraceContext>,
    name: impl FnOnce() -> String,
    attributes: impl FnOnce() -> Vec<KeyValue>,
) -> (Option<OtelContext>, TraceContext) {
    if !spans_enabled() {
        // A new trace (or the inherited one), a new span id, sampled.
        let mut bytes = fresh();
        if let Some(trace) = inherited.and_then(trace_id_of) {
            bytes[..16].copy_from_slice(&trace);
        }
        return (
            None,
            TraceContext {
                traceparent: TraceParent::from_bytes(bytes),
                tracestate: None,
            },
        );
    }
    let parent = if parent.span().span_context().is_valid() {
        parent.clone()
    } else {
        inherited
            .and_then(|t| span_context_of(&t.traceparent))
            .map_or_else(OtelContext::new, |sc| {
                OtelContext::new().with_remote_span_context(sc)
            })
    };
    let cx = child(kind, &parent, name, attributes);
    let sc = cx.span().span_context().clone();
    let traceparent = if sc.is_valid() {
        traceparent_of(&sc)
    } else {
        TraceParent::from_bytes(fresh())
    };
    (
        Some(cx),
        TraceContext {
            traceparent,
            tracestate: None,
        },
    )
}

/// The span to handle a message in (an empty context when spans are off).
pub(crate) fn handle(
    kind: SpanKind,
    env: &Envelope,
    name: impl FnOnce() -> String,
    attributes: impl FnOnce() -> Vec<KeyValue>,
) -> OtelContext {
    if !spans_enabled() {
        return OtelContext::new();
    }
    child(kind, &remote_parent(env), name, attributes)
}

/// A new span of `kind` under `parent`, as a context.
fn child(
    kind: SpanKind,
    parent: &OtelContext,
    name: impl FnOnce() -> String,
    attributes: impl FnOnce() -> Vec<KeyValue>,
) -> OtelContext {
    let tracer = global::tracer("chorus");
    let span = tracer
        .span_builder(name())
        .with_kind(kind)
        .with_attributes(attributes())
        .start_with_context(&tracer, parent);
    parent.with_span(span)
}

/// Ends the span in `cx` (if any) with an error status when `error` is set.
pub(crate) fn finish(cx: Option<&OtelContext>, error: Option<String>) {
    let Some(cx) = cx else { return };
    let span = cx.span();
    if let Some(e) = error {
        span.set_status(Status::error(e));
    } else {
        span.set_status(Status::Ok);
    }
    span.end();
}

/// Standard attributes of a message span.
pub(crate) fn attributes(agent: &str, env: &Envelope) -> Vec<KeyValue> {
    let mut attributes = vec![
        KeyValue::new("messaging.system", "nats"),
        KeyValue::new("chorus.agent", agent.to_owned()),
        KeyValue::new("messaging.message.id", env.id.to_string()),
        KeyValue::new(
            "messaging.message.conversation_id",
            env.conversation().to_string(),
        ),
    ];
    // What kind of message, from whom, to whom, how large (the design's `message.type`,
    // `.source`, `.destination` and `.size`).
    attributes.push(KeyValue::new("chorus.kind", env.kind.as_str()));
    attributes.push(KeyValue::new("chorus.from", env.from.to_string()));
    let destination = if env.to.is_empty() {
        env.capability
            .clone()
            .or_else(|| env.topic.as_ref().map(ToString::to_string))
    } else {
        Some(env.to.join(","))
    };
    if let Some(destination) = destination {
        attributes.push(KeyValue::new("chorus.destination", destination));
    }
    attributes.push(KeyValue::new(
        "messaging.message.body.size",
        i64::try_from(env.payload.len()).unwrap_or(i64::MAX),
    ));
    // The session and customer a message is for, so a trace can be found by either.
    if let Some(session) = &env.session_id {
        attributes.push(KeyValue::new("chorus.session_id", session.clone()));
    }
    if let Some(customer) = &env.customer_id {
        attributes.push(KeyValue::new("chorus.customer_id", customer.clone()));
    }
    attributes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_garbage_is_refused() {
        let text = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let sc = parse_traceparent(text).expect("valid");
        assert_eq!(format_traceparent(&sc), text);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-zzf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn traceparents_made_without_spans_are_valid_and_keep_the_inherited_trace() {
        let (_, fresh) = start(
            SpanKind::Producer,
            &OtelContext::new(),
            None,
            String::new,
            Vec::new,
        );
        let text = fresh.traceparent.to_string();
        let sc = parse_traceparent(&text).expect("a valid traceparent");
        assert_eq!(text.len(), 55);
        assert_eq!(span_context_of(&fresh.traceparent), Some(sc.clone()));
        let (_, child) = start(
            SpanKind::Producer,
            &OtelContext::new(),
            Some(&fresh),
            String::new,
            Vec::new,
        );
        let child_sc =
            parse_traceparent(&child.traceparent.to_string()).expect("a valid traceparent");
        assert_eq!(child_sc.trace_id(), sc.trace_id());
        assert_ne!(child_sc.span_id(), sc.span_id());
        // Inherited from a traceparent that came as text of another version.
        let other = TraceContext {
            traceparent: "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra".into(),
            tracestate: None,
        };
        assert!(other.traceparent.as_bytes().is_none(), "kept as text");
        let (_, child) = start(
            SpanKind::Producer,
            &OtelContext::new(),
            Some(&other),
            String::new,
            Vec::new,
        );
        assert!(
            !child.traceparent.to_string().contains("4bf92f35"),
            "a trace id is taken only from version 00"
        );
    }

    #[test]
    fn a_traceparent_is_held_as_bytes_only_in_its_canonical_form() {
        let text = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let canonical = TraceParent::parse(text);
        assert!(canonical.as_bytes().is_some());
        assert_eq!(canonical.to_string(), text);
        assert_eq!(canonical, text);
        for kept in [
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "not a traceparent",
            "",
        ] {
            let t = TraceParent::parse(kept);
            assert!(t.as_bytes().is_none(), "{kept:?}");
            assert_eq!(t.to_string(), kept);
        }
        let json = serde_json::to_string(&canonical).expect("json");
        assert_eq!(json, format!("\"{text}\""));
        let back: TraceParent = serde_json::from_str(&json).expect("reads");
        assert_eq!(back, canonical);
    }
}
