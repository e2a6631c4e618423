//! The coordinator's metrics, in the process-wide registry the SDK serves.

use chorus_sdk::Report;
use std::sync::OnceLock;

use chorus_sdk::durable::DeadLetterReason;
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts};

/// Metrics shared by every coordinator in the process.
#[derive(Debug, Clone)]
pub struct CoordinatorMetrics {
    /// Agents by state: `registered` (in the registry bucket) and `live` (heard from lately).
    pub agents: IntGaugeVec,
    /// Registry events: `joined`, `left`.
    pub registry_events: IntCounterVec,
    /// Messages the coordinator handled, by kind and status.
    pub messages: IntCounterVec,
    /// Broadcasts fanned out.
    pub broadcasts: IntCounter,
    /// Broadcast recipients by outcome: `delivered`, `failed`, `timed_out`.
    pub broadcast_recipients: IntCounterVec,
    /// Dead letters written by the coordinator, by reason.
    pub dead_letters: IntCounterVec,
    /// Advisories given up after every attempt failed (their messages stay in the inbox).
    pub advisories_abandoned: IntCounter,
    /// Messages in the dead-letter stream, by reason (whoever wrote them).
    pub dlq_depth: IntGaugeVec,
    /// The coordinator's own NATS connection events, by event.
    pub connection_events: IntCounterVec,
    /// What the agents handled, from their usage reports since this coordinator started,
    /// by agent, customer, kind and outcome (`ok`, `failed`).
    pub usage_messages: IntCounterVec,
    /// Payload bytes the agents handled, from the same reports, by agent, customer and
    /// direction (`in`, `out`).
    pub usage_bytes: IntCounterVec,
    /// Commands refused for want of authority, by action and reason (`role`: the sender does
    /// not hold the role; `unsigned`: its role counts only signed; `identity`, `replay`: its
    /// signature did not verify, or was seen before).
    pub authority_refusals: IntCounterVec,
    /// Always 1, labelled with the build: `version` and `revision`.
    pub build_info: IntGauge,
}

/// The connection events counted, in the order they are reported.
pub(crate) const CONNECTION_EVENTS: [&str; 4] = [
    "disconnects",
    "reconnects",
    "slow_consumer_drops",
    "permission_violations",
];

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("static metric definition")
}

fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric definition")
}

/// The coordinator metrics, registered on first use.
pub fn metrics() -> &'static CoordinatorMetrics {
    static METRICS: OnceLock<CoordinatorMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let m = CoordinatorMetrics {
            agents: gauge_vec(
                "chorus_coordinator_agents",
                "Agents by state: registered (in the registry) and live (heartbeating).",
                &["state"],
            ),
            registry_events: counter_vec(
                "chorus_coordinator_registry_events_total",
                "Agents joining and leaving the registry.",
                &["event"],
            ),
            messages: counter_vec(
                "chorus_coordinator_messages_total",
                "Messages the coordinator handled, by kind and status.",
                &["kind", "status"],
            ),
            broadcasts: IntCounter::new(
                "chorus_coordinator_broadcasts_total",
                "Broadcasts fanned out.",
            )
            .expect("static metric definition"),
            broadcast_recipients: counter_vec(
                "chorus_coordinator_broadcast_recipients_total",
                "Broadcast recipients by outcome: delivered, failed, timed_out.",
                &["outcome"],
            ),
            dead_letters: counter_vec(
                "chorus_coordinator_dead_letters_total",
                "Dead letters the coordinator wrote, by reason.",
                &["reason"],
            ),
            advisories_abandoned: IntCounter::new(
                "chorus_coordinator_advisories_abandoned_total",
                "Advisories given up after every attempt to dead-letter their message failed; the message stays in the inbox stream.",
            )
            .expect("static metric definition"),
            dlq_depth: gauge_vec(
                "chorus_dlq_messages",
                "Messages in the dead-letter queue, by reason.",
                &["reason"],
            ),
            connection_events: counter_vec(
                "chorus_coordinator_connection_events_total",
                "The coordinator's NATS connection events since start: disconnects, reconnects, slow_consumer_drops, permission_violations.",
                &["event"],
            ),
            usage_messages: counter_vec(
                "chorus_usage_messages_total",
                "Messages the agents handled, from their usage reports since this coordinator started (every coordinator counts every report), by agent, customer, kind and outcome.",
                &["agent", "customer", "kind", "outcome"],
            ),
            usage_bytes: counter_vec(
                "chorus_usage_bytes_total",
                "Payload bytes the agents handled, from their usage reports since this coordinator started, by agent, customer and direction (in, out).",
                &["agent", "customer", "direction"],
            ),
            authority_refusals: counter_vec(
                "chorus_coordinator_authority_refusals_total",
                "Commands the coordinator refused for want of authority, by action and reason (role, unsigned, identity, replay).",
                &["action", "reason"],
            ),
            build_info: IntGauge::with_opts(
                Opts::new(
                    "chorus_build_info",
                    "Always 1: the coordinator's version and the git revision it was built from.",
                )
                .const_label("version", env!("CARGO_PKG_VERSION"))
                .const_label("revision", crate::REVISION),
            )
            .expect("static metric definition"),
        };
        m.build_info.set(1);
        // Every series a dashboard or an alert reads exists from the start, at zero, so a
        // quiet system shows 0 rather than no data.
        for event in ["joined", "left"] {
            m.registry_events.with_label_values(&[event]);
        }
        for outcome in ["delivered", "failed", "timed_out"] {
            m.broadcast_recipients.with_label_values(&[outcome]);
        }
        for reason in DeadLetterReason::ALL {
            m.dead_letters.with_label_values(&[reason.as_str()]);
            m.dlq_depth.with_label_values(&[reason.as_str()]);
        }
        for event in CONNECTION_EVENTS {
            m.connection_events.with_label_values(&[event]);
        }
        for state in ["registered", "live"] {
            m.agents.with_label_values(&[state]);
        }
        let reg = chorus_sdk::metrics::registry();
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.agents.clone()),
            Box::new(m.registry_events.clone()),
            Box::new(m.messages.clone()),
            Box::new(m.broadcasts.clone()),
            Box::new(m.broadcast_recipients.clone()),
            Box::new(m.dead_letters.clone()),
            Box::new(m.advisories_abandoned.clone()),
            Box::new(m.dlq_depth.clone()),
            Box::new(m.connection_events.clone()),
            Box::new(m.usage_messages.clone()),
            Box::new(m.usage_bytes.clone()),
            Box::new(m.authority_refusals.clone()),
            Box::new(m.build_info.clone()),
        ];
        for c in collectors {
            if let Err(err) = reg.register(c) {
                tracing::warn!(error = %Report(&err), "coordinator metric not registered");
            }
        }
        m
    })
}
