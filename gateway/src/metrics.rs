//! The gateway's own metrics, in the process's registry (the one `/metrics` serves).

use std::sync::OnceLock;

/// The gateway's refusals before a request reaches the bus, by reason, in the process's
/// registry (`chorus_gateway_refusals_total`).
fn refusals() -> &'static prometheus::IntCounterVec {
    static REFUSALS: OnceLock<prometheus::IntCounterVec> = OnceLock::new();
    REFUSALS.get_or_init(|| {
        let counter = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "chorus_gateway_refusals_total",
                "Requests and connections the gateway refused or closed before they reached the bus, by reason: busy, unauthenticated_busy, body_timeout, body_too_large, unproven_connection_closed.",
            ),
            &["reason"],
        )
        .expect("static metric definition");
        for reason in REFUSAL_REASONS {
            counter.with_label_values(&[reason]);
        }
        if let Err(err) = chorus_sdk::metrics::registry().register(Box::new(counter.clone())) {
            tracing::debug!(error = %chorus_sdk::Report(&err), "gateway refusals not registered");
        }
        counter
    })
}

/// The reasons `chorus_gateway_refusals_total` counts.
const REFUSAL_REASONS: [&str; 5] = [
    "busy",
    "unauthenticated_busy",
    "body_timeout",
    "body_too_large",
    "unproven_connection_closed",
];

/// Counts one refusal of `reason` (one of [`REFUSAL_REASONS`]).
pub(crate) fn count_refusal(reason: &'static str) {
    refusals().with_label_values(&[reason]).inc();
}

/// Registers the gateway's metrics, so a quiet gateway shows zeros rather than no data.
pub(crate) fn register() {
    let _ = refusals();
}
