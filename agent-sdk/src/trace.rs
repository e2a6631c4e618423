//! Tracing across agents: W3C trace context in every envelope, OpenTelemetry spans per
//! request, publish and handling.
//!
//! Spans go to whatever OpenTelemetry tracer provider the process installs
//! (`opentelemetry::global::set_tracer_provider`, before agents connect); with none, the spans
//! are no-ops but every envelope still carries a `traceparent`, so a trace can be followed in
//! logs and picked up by agents that do export. One request crossing agents A, B and C is one
//! trace: A's request span, B's handle span as its child, B's request span under that, C's
//! handle span under that.

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
};
use opentelemetry::{Context as OtelContext, KeyValue, global};

use crate::envelope::{Envelope, TraceContext};

/// The tracer spans are started with.
pub(crate) fn tracer() -> global::BoxedTracer {
    global::tracer("chorus")
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

/// The remote parent an envelope names, as a context to start a span in.
pub(crate) fn remote_parent(env: &Envelope) -> OtelContext {
    env.trace
        .as_ref()
        .and_then(|t| parse_traceparent(&t.traceparent))
        .map_or_else(OtelContext::new, |sc| {
            OtelContext::new().with_remote_span_context(sc)
        })
}

fn random_ids() -> (u128, u64) {
    let a = uuid::Uuid::now_v7().as_u128();
    let b = uuid::Uuid::now_v7().as_u128();
    // The low 62 bits of a UUIDv7 are random.
    ((a << 64) ^ b, (b as u64) | 1)
}

/// Starts a span of `kind` named `name` under `parent`, and returns its context together with
/// the `traceparent` to put in the outgoing envelope. Without an exporting provider the span
/// is a no-op; the trace context is then made here, keeping the parent's trace id.
pub(crate) fn start(
    name: String,
    kind: SpanKind,
    parent: &OtelContext,
    attributes: Vec<KeyValue>,
) -> (OtelContext, TraceContext) {
    let tracer = tracer();
    let span = tracer
        .span_builder(name)
        .with_kind(kind)
        .with_attributes(attributes)
        .start_with_context(&tracer, parent);
    let cx = parent.with_span(span);
    let mut sc = cx.span().span_context().clone();
    if !sc.is_valid() || sc == *parent.span().span_context() {
        let (trace, span) = random_ids();
        let parent_sc = parent.span().span_context().clone();
        let trace_id = if parent_sc.is_valid() {
            parent_sc.trace_id()
        } else {
            TraceId::from_bytes(trace.to_be_bytes())
        };
        sc = SpanContext::new(
            trace_id,
            SpanId::from_bytes(span.to_be_bytes()),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        );
    }
    let trace = TraceContext {
        traceparent: format_traceparent(&sc),
        tracestate: None,
    };
    (cx, trace)
}

/// Ends the span in `cx` with an error status when `error` is set.
pub(crate) fn finish(cx: &OtelContext, error: Option<String>) {
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
    vec![
        KeyValue::new("messaging.system", "nats"),
        KeyValue::new("chorus.agent", agent.to_owned()),
        KeyValue::new("messaging.message.id", env.id.to_string()),
        KeyValue::new(
            "messaging.message.conversation_id",
            env.conversation().to_string(),
        ),
    ]
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
}
