//! Prometheus metrics of the agents in this process.
//!
//! Every agent records into one process-wide registry ([`registry`]) with an `agent` label, so
//! a process running several agents (and the coordinator) has one `/metrics`. Hot-path counts
//! are plain atomics read at scrape time; only the request-latency histogram and the
//! messages-by-kind-and-status counter are updated per message. The coordinator serves the
//! registry over HTTP (`chorus_coordinator::MetricsServer`); any other process can serve
//! [`render`]`(`[`registry`]`())` on a listener of its own and announce it with
//! [`AgentOptions::metrics_url`](crate::AgentOptions::metrics_url), so the coordinator's
//! service discovery (`/sd/agents`) hands it to Prometheus.

use crate::Report;
use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock, Weak};

use chorus_broker_adapter::StatsSnapshot;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::stats::AgentStats;

/// The registry every agent (and the coordinator, when in the same process) records into.
/// It also holds the process's own `process_*` metrics (CPU, memory, descriptors, start time).
pub fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let reg = Registry::new();
        #[cfg(target_os = "linux")]
        if let Err(err) = reg.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        )) {
            tracing::warn!(error = %Report(&err), "process metrics not registered");
        }
        reg
    })
}

/// Per-message metrics shared by every agent of the process.
#[derive(Debug, Clone)]
pub(crate) struct SdkMetrics {
    /// Inbound messages by kind and the status they were answered or refused with.
    pub(crate) handled: IntCounterVec,
    /// Requests this agent made, by outcome status, timed from send to reply.
    pub(crate) request_seconds: HistogramVec,
    /// Each destination's circuit breaker: 0 closed, 1 half-open, 2 open.
    pub(crate) circuit_state: IntGaugeVec,
    /// Times a destination's breaker opened.
    pub(crate) circuits_opened: IntCounterVec,
}

pub(crate) fn sdk_metrics() -> &'static SdkMetrics {
    static METRICS: OnceLock<SdkMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let handled = IntCounterVec::new(
            Opts::new(
                "chorus_agent_messages_total",
                "Inbound messages by kind and the status they were answered (or refused) with.",
            ),
            &["agent", "kind", "status"],
        )
        .expect("static metric definition");
        let request_seconds = HistogramVec::new(
            HistogramOpts::new(
                "chorus_agent_request_duration_seconds",
                "Time from sending a request or command to its reply, by reply status.",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0,
            ]),
            &["agent", "status"],
        )
        .expect("static metric definition");
        let circuit_state = IntGaugeVec::new(
            Opts::new(
                "chorus_agent_circuit_state",
                "Each destination's circuit breaker in this agent: 0 closed, 1 half-open, 2 open.",
            ),
            &["agent", "destination"],
        )
        .expect("static metric definition");
        let circuits_opened = IntCounterVec::new(
            Opts::new(
                "chorus_agent_circuits_opened_total",
                "Times a destination's circuit breaker opened in this agent.",
            ),
            &["agent", "destination"],
        )
        .expect("static metric definition");
        let reg = registry();
        for c in [
            Box::new(handled.clone()) as Box<dyn Collector>,
            Box::new(request_seconds.clone()),
            Box::new(circuit_state.clone()),
            Box::new(circuits_opened.clone()),
            Box::new(AgentsCollector::new()),
        ] {
            if let Err(err) = reg.register(c) {
                tracing::warn!(error = %Report(&err), "agent metrics not registered");
            }
        }
        SdkMetrics {
            handled,
            request_seconds,
            circuit_state,
            circuits_opened,
        }
    })
}

/// Something that can report an agent's counters at scrape time.
pub(crate) trait StatsSource: Send + Sync {
    fn agent_id(&self) -> &str;
    fn agent_stats(&self) -> AgentStats;
    fn broker_stats(&self) -> StatsSnapshot;
    fn in_flight(&self) -> usize;
    /// The NATS connections the agent uses (its own, or one it shares; the one for events).
    fn connections(&self) -> Vec<chorus_broker_adapter::Broker>;
}

fn live_agents() -> &'static Mutex<Vec<Weak<dyn StatsSource>>> {
    static AGENTS: OnceLock<Mutex<Vec<Weak<dyn StatsSource>>>> = OnceLock::new();
    AGENTS.get_or_init(|| Mutex::new(Vec::new()))
}

/// Makes an agent's counters visible to the collector for as long as it lives.
pub(crate) fn track(source: Weak<dyn StatsSource>) {
    let _ = sdk_metrics();
    let mut agents = live_agents()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    agents.retain(|w| w.strong_count() > 0);
    agents.push(source);
}

/// Reads every live agent's atomic counters at scrape time.
struct AgentsCollector {
    refusals: IntCounterVec,
    traffic: IntCounterVec,
    connection: IntCounterVec,
    inbox_consumers: IntCounterVec,
    batched: IntCounterVec,
    in_flight: IntGaugeVec,
    active_connections: IntGaugeVec,
    descs: Vec<Desc>,
}

impl AgentsCollector {
    fn new() -> Self {
        let refusals = IntCounterVec::new(
            Opts::new(
                "chorus_agent_refusals_total",
                "Inbound messages refused unhandled, by reason: loop_detected (hop limit), expired (past its deadline), data_format (undecodable or bad version), unknown_command, signature (missing, bad or stale signature), access (not granted), rate_limited.",
            ),
            &["agent", "reason"],
        )
        .expect("static metric definition");
        let traffic = IntCounterVec::new(
            Opts::new(
                "chorus_agent_traffic_total",
                "Messages by direction: received, requests_sent, events_published, replies_sent, reply_failures, retries, dead_lettered, dropped (slow subscriber), lost (events missed, from sequence gaps, dropped ones included), shed (overloaded, answered 5019), redelivered, duplicates_suppressed, notifications_sent, notifications_received, notifications_unhandled (no handler took it: dropped).",),
            &["agent", "direction"],
        )
        .expect("static metric definition");
        let connection = IntCounterVec::new(
            Opts::new(
                "chorus_agent_connection_events_total",
                "NATS connection events: disconnects, reconnects, slow_consumer_drops, permission_violations, server_errors, client_errors.",
            ),
            &["agent", "event"],
        )
        .expect("static metric definition");
        let inbox_consumers = IntCounterVec::new(
            Opts::new(
                "chorus_agent_inbox_consumers_total",
                "Durable inbox consumers an on-demand inbox opened because commands waited (opened) and deleted once none did (released).",
            ),
            &["agent", "event"],
        )
        .expect("static metric definition");
        let batched = IntCounterVec::new(
            Opts::new(
                "chorus_agent_batched_total",
                "What this agent's batchers sent, by unit: batches, and the messages in them (messages / batches is the mean batch).",
            ),
            &["agent", "unit"],
        )
        .expect("static metric definition");
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "chorus_agent_in_flight",
                "Messages being handled right now.",
            ),
            &["agent"],
        )
        .expect("static metric definition");
        let active_connections = IntGaugeVec::new(
            Opts::new(
                "chorus_agent_active_connections",
                "NATS connections of this process's agents that are up, by the server each is on or was last on (destination, host:port); one shared by several agents counts once.",
            ),
            &["destination"],
        )
        .expect("static metric definition");
        let descs = [
            active_connections.desc(),
            refusals.desc(),
            traffic.desc(),
            connection.desc(),
            inbox_consumers.desc(),
            batched.desc(),
            in_flight.desc(),
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
        AgentsCollector {
            refusals,
            traffic,
            connection,
            inbox_consumers,
            batched,
            in_flight,
            active_connections,
            descs,
        }
    }
}

#[derive(Default)]
struct Sums {
    agent: AgentStats,
    broker: StatsSnapshot,
    in_flight: usize,
}

impl Collector for AgentsCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        // Agents sharing an id in one process are summed, so no series is reported twice.
        let mut sums: BTreeMap<String, Sums> = BTreeMap::new();
        // Each connection once, by its id: the server it is on (or was last), and whether it
        // is up.
        let mut connections: BTreeMap<usize, (String, bool)> = BTreeMap::new();
        {
            let agents = live_agents()
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            for source in agents.iter().filter_map(Weak::upgrade) {
                let s = sums.entry(source.agent_id().to_owned()).or_default();
                s.agent.add(&source.agent_stats());
                s.broker.add(&source.broker_stats());
                s.in_flight += source.in_flight();
                for broker in source.connections() {
                    connections
                        .entry(broker.connection_id())
                        .or_insert_with(|| (broker.server_addr(), broker.is_connected()));
                }
            }
        }
        for v in [
            &self.refusals,
            &self.traffic,
            &self.connection,
            &self.inbox_consumers,
            &self.batched,
        ] {
            v.reset();
        }
        self.in_flight.reset();
        self.active_connections.reset();
        for (destination, up) in connections.values() {
            // A connection that is down keeps its server's series, at zero.
            self.active_connections
                .with_label_values(&[destination])
                .add(i64::from(*up));
        }
        for (agent, s) in &sums {
            let a = &s.agent;
            for (reason, n) in [
                ("loop_detected", a.loop_refused),
                ("expired", a.expired),
                ("data_format", a.bad_input),
                ("unknown_command", a.unknown_command),
                ("signature", a.security_refused),
                ("access", a.access_refused),
                ("rate_limited", a.rate_limited),
            ] {
                self.refusals.with_label_values(&[agent, reason]).inc_by(n);
            }
            for (direction, n) in [
                ("received", a.received),
                ("requests_sent", a.requests_sent),
                ("events_published", a.events_published),
                ("replies_sent", a.replies_sent),
                ("reply_failures", a.reply_failures),
                ("retries", a.retries),
                ("dead_lettered", a.dead_lettered),
                ("dropped", a.dropped),
                ("lost", a.lost),
                ("shed", a.shed),
                ("redelivered", a.redelivered),
                ("duplicates_suppressed", a.duplicates_suppressed),
                ("notifications_sent", a.notifications_sent),
                ("notifications_received", a.notifications_received),
                ("notifications_unhandled", a.notifications_unhandled),
            ] {
                self.traffic
                    .with_label_values(&[agent, direction])
                    .inc_by(n);
            }
            for (event, n) in [
                ("opened", a.inbox_consumers_opened),
                ("released", a.inbox_consumers_released),
            ] {
                self.inbox_consumers
                    .with_label_values(&[agent, event])
                    .inc_by(n);
            }
            for (unit, n) in [
                ("batches", a.batches_sent),
                ("messages", a.batched_messages),
            ] {
                self.batched.with_label_values(&[agent, unit]).inc_by(n);
            }
            let b = &s.broker;
            for (event, n) in [
                ("disconnects", b.disconnects),
                ("reconnects", b.reconnects),
                ("slow_consumer_drops", b.slow_consumer_drops),
                ("permission_violations", b.permission_violations),
                ("server_errors", b.server_errors),
                ("client_errors", b.client_errors),
            ] {
                self.connection.with_label_values(&[agent, event]).inc_by(n);
            }
            self.in_flight
                .with_label_values(&[agent])
                .set(i64::try_from(s.in_flight).unwrap_or(i64::MAX));
        }
        let mut out = Vec::new();
        out.extend(self.refusals.collect());
        out.extend(self.traffic.collect());
        out.extend(self.connection.collect());
        out.extend(self.inbox_consumers.collect());
        out.extend(self.batched.collect());
        out.extend(self.in_flight.collect());
        out.extend(self.active_connections.collect());
        out
    }
}

/// Renders `registry` in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    if let Err(err) = prometheus::TextEncoder::new().encode_utf8(&registry.gather(), &mut out) {
        tracing::error!(error = %Report(&err), "metrics did not encode");
    }
    out
}
