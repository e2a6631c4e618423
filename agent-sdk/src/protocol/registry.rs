//! What agents tell the coordinator about themselves, and what the coordinator answers:
//! capability manifests, discovery queries, broadcast requests and reports.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::protocol::envelope::Priority;
use crate::protocol::status::StatusCode;

/// Suffix of the registry bucket's name.
pub const REGISTRY_BUCKET: &str = "registry";

/// The coordinator's agent id: what it sends is `from` it, and the operators' commands
/// (hosting, usage) go to it, answered by one of the coordinators in their queue group.
pub const COORDINATOR_ID: &str = "coordinator";
/// The agent id of the bus's web console (served by the gateway): the bus's own agent, which
/// cancels tasks for the operators it lets in with the `console-admin` scope.
pub const CONSOLE_ID: &str = "chorus-console";
/// What a host's agent id starts with (`host-<name>`): its commands start and stop programs,
/// so the gateway reaches them, as the coordinator's, only through a scope naming them.
pub const HOST_AGENT_PREFIX: &str = "host-";

/// Whether `agent` is one of the bus's own agents whose commands run code or change the bus
/// (the coordinator, a host): reached from the edge only through a scope that names it.
pub fn is_admin_agent(agent: &str) -> bool {
    agent == COORDINATOR_ID || agent.starts_with(HOST_AGENT_PREFIX)
}

/// Whether an agent takes new work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Availability {
    /// Ready for work.
    #[default]
    Available,
    /// Working at capacity; takes work but will be slow.
    Busy,
    /// Not taking work (draining, paused).
    Away,
}

/// A capability an agent offers, with its version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CapabilityInfo {
    /// Capability name (dotted).
    pub name: String,
    /// Its version (free text, semver recommended).
    #[serde(default)]
    pub version: String,
    /// The models behind it (IACP), if the agent says.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// How much it does per second, in the unit the capability names (IACP: tokens a second
    /// for a model), if the agent says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput: Option<f64>,
    /// The most tokens one request to it may carry (IACP's `max_tokens`), if the agent says:
    /// a discovery asking for more passes it by. Unsaid means no stated limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// How long its recent requests took to handle, in ms (a moving average, most recent
    /// weighing most), once it has handled one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handling_ms: Option<u64>,
}

/// An agent's capability manifest (IACP), sent in every heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Agent id.
    pub agent: String,
    /// This run of the agent: changes when the agent restarts.
    pub instance: String,
    /// Capabilities offered.
    #[serde(default)]
    pub capabilities: Vec<CapabilityInfo>,
    /// Commands the agent answers.
    #[serde(default)]
    pub commands: Vec<String>,
    /// Broadcast groups it belongs to.
    #[serde(default)]
    pub groups: Vec<String>,
    /// The customer it is dedicated to, if any (unset: it serves every customer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub customer: Option<String>,
    /// Payload content types it accepts.
    #[serde(default)]
    pub content_types: Vec<String>,
    /// Load from 0 (idle) to 1 (full).
    #[serde(default)]
    pub load: f32,
    /// How many messages it handles at once (its handler slots), if it says: a caller that
    /// routes by load counts each of its own calls in flight as `1 / slots` more load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
    /// Availability.
    #[serde(default)]
    pub availability: Availability,
    /// Estimated time until new work of normal priority sent now would be done, in ms
    /// (IACP's `eta_seconds`): [`estimate_eta_ms`] of its handling time, slots, load and what
    /// waits. Unknown until it has handled something.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_ms: Option<u64>,
    /// How long its recent messages took to handle, in ms (a moving average over every
    /// command and capability, most recent weighing most), once it has handled one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handling_ms: Option<u64>,
    /// Core messages waiting for a handler slot, by priority.
    #[serde(default, skip_serializing_if = "Waiting::is_empty")]
    pub waiting: Waiting,
    /// Its public signing key (an nkey), once signing is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
    /// Its public encryption key (X25519, base64), when it accepts encrypted payloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption_key: Option<String>,
    /// Heartbeat interval in ms: the coordinator declares the agent gone after three missed.
    pub heartbeat_ms: u64,
    /// When this instance started, ms since the epoch.
    pub started_ms: u64,
    /// SDK version.
    #[serde(default)]
    pub sdk_version: String,
    /// Where the agent's process serves Prometheus metrics (`http://host:port/metrics`), if
    /// it does: the coordinator lists it for Prometheus's HTTP service discovery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_url: Option<String>,
    /// The protocol majors the agent reads (`[1, 2]` for this SDK); absent means `[1]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wire_versions: Vec<u16>,
    /// The destinations (`agent:<id>`, `cap:<capability>`) whose circuit breakers in this
    /// agent are open or half-open: it refuses its own calls to them for now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub open_circuits: Vec<String>,
    /// The content encodings the agent reads (`["zstd"]`): senders compress large payloads
    /// for it only when this lists `zstd`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub content_encodings: Vec<String>,
    /// The commands and capabilities the agent describes (what each does, the JSON Schema its
    /// payload follows, whether it runs as a task), for callers that list them as tools: the
    /// gateway's MCP server. Absent for those it does not describe and that are no tasks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<EndpointInfo>,
}

/// What a command or capability is, as a caller that lists tools (an MCP host) needs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointInfo {
    /// The command's or the capability's name.
    pub name: String,
    /// Whether it is a command of the agent or a capability.
    pub kind: EndpointRole,
    /// What it does, in a sentence or two.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON Schema its payload follows (a JSON object), if the agent gives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<serde_json::Value>,
    /// It runs as a task: submit it (`Agent::submit`), a plain request is refused.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub task: bool,
    /// How its reply's payload reads, when not as plain JSON: [`REPLY_MCP_TOOL_RESULT`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply: Option<String>,
}

/// A reply format: the payload is an MCP `CallToolResult` (`content`, `structuredContent`,
/// `isError`), passed through as it is by the gateway's MCP server. A bridged MCP server's
/// tools answer this way.
pub const REPLY_MCP_TOOL_RESULT: &str = "mcp.tool_result";

/// Whether an [`EndpointInfo`] is a command or a capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EndpointRole {
    /// A command of the agent (`<root>.agent.<id>.<command>`).
    Command,
    /// A capability, shared by every agent serving it.
    Capability,
}

impl Manifest {
    /// Whether the agent reads payloads compressed with `encoding`.
    pub fn reads_encoding(&self, encoding: &str) -> bool {
        self.content_encodings.iter().any(|e| e == encoding)
    }
}

impl Manifest {
    /// Whether the agent reads protocol major `major` (an agent that does not say reads 1).
    pub fn reads(&self, major: u16) -> bool {
        if self.wire_versions.is_empty() {
            major == 1
        } else {
            self.wire_versions.contains(&major)
        }
    }
}

/// What the coordinator announces on `<root>.sys.wire`, when it changes and every
/// [`WIRE_ANNOUNCE_INTERVAL`](crate::registry::WIRE_ANNOUNCE_INTERVAL): the newest protocol
/// major that every live agent reads. Agents that follow the bus write the compact form
/// (protocol 2) while it is 2, and the named form otherwise. It also paces heartbeats: an
/// agent beats no more often than `heartbeat_ms` (up to [`MAX_HEARTBEAT_FLOOR`]), so the
/// whole fleet sends about as many heartbeats a second as the coordinator can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireLevel {
    /// 1 or 2.
    pub major: u16,
    /// The least time between two heartbeats of an agent, in milliseconds (absent: no
    /// floor, each agent beats at its own interval).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_ms: Option<u64>,
}

/// The longest heartbeat interval an announcement can ask of an agent: the floor is bounded,
/// so an announcement (not checked for a signature) cannot silence the fleet for long.
pub const MAX_HEARTBEAT_FLOOR: std::time::Duration = std::time::Duration::from_secs(120);

/// The notification (section 7.14) in which the coordinator tells an agent whose heartbeats
/// come faster than the floor what its last [`WireLevel`] announcement said, so a newcomer
/// need not wait for the next one. An agent takes it only from [`COORDINATOR_ID`]; no
/// handler sees it.
pub const WIRE_NOTIFICATION: &str = "chorus-wire";

/// How often the coordinator repeats its [`WireLevel`] announcement.
pub const WIRE_ANNOUNCE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(15);

/// A metrics address as Prometheus scrapes it: scheme, `host:port` and path.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MetricsTarget {
    /// `http` or `https`.
    pub scheme: String,
    /// `host:port`.
    pub address: String,
    /// The path, starting with `/` (`/metrics` when the URL has none).
    pub path: String,
}

impl MetricsTarget {
    /// Reads `http[s]://host:port[/path]`; `None` for anything else (no port, another scheme,
    /// a query, whitespace).
    pub fn parse(url: &str) -> Option<MetricsTarget> {
        let (scheme, rest) = url.split_once("://")?;
        if scheme != "http" && scheme != "https" {
            return None;
        }
        let (address, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/metrics"),
        };
        let (host, port) = address.rsplit_once(':')?;
        let valid_host = !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-._[]:".contains(c));
        if !valid_host
            || port.is_empty()
            || !port.chars().all(|c| c.is_ascii_digit())
            || port.parse::<u16>().is_err()
            || path
                .chars()
                .any(|c| c.is_whitespace() || c == '?' || c == '#')
        {
            return None;
        }
        Some(MetricsTarget {
            scheme: scheme.to_owned(),
            address: address.to_owned(),
            path: path.to_owned(),
        })
    }
}

impl Manifest {
    /// Whether it offers `capability`.
    pub fn offers(&self, capability: &str) -> bool {
        self.capabilities.iter().any(|c| c.name == capability)
    }

    /// Estimated time until work of `priority` for `capabilities` (any of its work when
    /// empty), sent now, would be done, in ms: [`estimate_eta_ms`] with the slowest named
    /// capability's handling time (the agent's own when none is known), its slots, the
    /// handlers its load says are busy, and the messages waiting at `priority` or above.
    /// `None` until the agent has handled something.
    pub fn eta_at(&self, priority: Priority, capabilities: &[&str]) -> Option<u64> {
        let named = self
            .capabilities
            .iter()
            .filter(|c| capabilities.contains(&c.name.as_str()))
            .filter_map(|c| c.handling_ms)
            .max();
        let handling = named.or(self.handling_ms)?;
        let slots = self.slots.unwrap_or(1).max(1);
        let load = if self.load.is_finite() {
            self.load.clamp(0.0, 1.0)
        } else {
            0.0
        };
        // At most `slots`, so the cast cannot overflow.
        let busy = (load * slots as f32).round() as u32;
        Some(estimate_eta_ms(
            handling,
            slots,
            busy,
            self.waiting.at_or_above(priority),
        ))
    }
}

/// How many core messages wait for a handler slot, per priority.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Waiting {
    /// Critical ones.
    #[serde(skip_serializing_if = "is_zero")]
    pub critical: u32,
    /// High ones.
    #[serde(skip_serializing_if = "is_zero")]
    pub high: u32,
    /// Normal ones (and those of a priority this version does not know).
    #[serde(skip_serializing_if = "is_zero")]
    pub normal: u32,
    /// Low ones.
    #[serde(skip_serializing_if = "is_zero")]
    pub low: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Waiting {
    /// Nothing waits.
    pub fn is_empty(&self) -> bool {
        *self == Waiting::default()
    }

    /// Those taken before a new message of `priority`: its own priority and the more urgent
    /// ones (the receiver takes the most urgent first, section 7.15).
    pub fn at_or_above(&self, priority: Priority) -> u32 {
        let levels = [self.critical, self.high, self.normal, self.low];
        levels[..=priority.rank()]
            .iter()
            .fold(0u32, |a, b| a.saturating_add(*b))
    }
}

/// Estimated time until a message sent now would be handled, in ms: `handling_ms` when a slot
/// is free for it; otherwise it waits for `busy + ahead - slots + 1` handlers to finish, which
/// finish at `slots` per `handling_ms`, and then takes `handling_ms` itself.
pub fn estimate_eta_ms(handling_ms: u64, slots: u32, busy: u32, ahead: u32) -> u64 {
    let slots = u64::from(slots.max(1));
    let before = u64::from(busy) + u64::from(ahead);
    if before < slots {
        return handling_ms;
    }
    let finishes = before - slots + 1;
    handling_ms
        .saturating_mul(finishes)
        .div_ceil(slots)
        .saturating_add(handling_ms)
}

/// A registry entry as discovery returns it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRecord {
    /// The manifest from the latest heartbeat.
    pub manifest: Manifest,
    /// When the coordinator last heard from the agent, ms since the epoch.
    pub last_seen_ms: u64,
    /// Estimated time until the query's work (its capabilities, at its priority) sent now
    /// would be done, in ms ([`Manifest::eta_at`]); absent when the agent has not handled
    /// anything yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_ms: Option<u64>,
}

/// A discovery query. Empty fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DiscoverQuery {
    /// Only agents offering this capability.
    pub capability: Option<String>,
    /// Only agents offering every one of these (IACP's `capabilities`), besides `capability`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
    /// Only agents in this group.
    pub group: Option<String>,
    /// Only agents whose availability is `available`.
    pub available_only: bool,
    /// Only agents at or below this load.
    pub max_load: Option<f32>,
    /// Only agents whose named capabilities (any one of its capabilities, when the query
    /// names none) take requests of this many tokens: a capability that states no
    /// `max_tokens` takes any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// The priority the work would be sent at: each record's `eta_ms` is at that priority,
    /// and the records come soonest first (unknown last) instead of least loaded first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// Only agents that serve this customer: those dedicated to it, and those dedicated to
    /// none (Agentify's `discover` with a `customer_id`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub customer: Option<String>,
}

impl DiscoverQuery {
    /// Agents offering `capability`.
    pub fn capability(capability: impl Into<String>) -> Self {
        DiscoverQuery {
            capability: Some(capability.into()),
            ..DiscoverQuery::default()
        }
    }

    /// Every capability it names: `capability`, then `capabilities`.
    pub fn named(&self) -> Vec<&str> {
        let mut named: Vec<&str> = self.capability.iter().map(String::as_str).collect();
        for c in &self.capabilities {
            if !named.contains(&c.as_str()) {
                named.push(c);
            }
        }
        named
    }

    /// Whether `m` matches.
    pub fn matches(&self, m: &Manifest) -> bool {
        let named = self.named();
        named.iter().all(|c| m.offers(c))
            && self.max_tokens.is_none_or(|tokens| {
                let takes = |c: &CapabilityInfo| c.max_tokens.is_none_or(|max| max >= tokens);
                if named.is_empty() {
                    m.capabilities.iter().any(takes)
                } else {
                    m.capabilities
                        .iter()
                        .filter(|c| named.contains(&c.name.as_str()))
                        .all(takes)
                }
            })
            && self
                .customer
                .as_deref()
                .is_none_or(|c| m.customer.as_deref().is_none_or(|own| own == c))
            && self
                .group
                .as_deref()
                .is_none_or(|g| m.groups.iter().any(|x| x == g))
            && (!self.available_only || m.availability == Availability::Available)
            && self.max_load.is_none_or(|max| m.load <= max)
    }
}

/// Who a broadcast goes to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "type", content = "name")]
pub enum BroadcastTarget {
    /// Every live agent.
    All,
    /// Every live agent in a group.
    Group(String),
    /// Every live agent offering a capability.
    Capability(String),
}

/// How one recipient of a broadcast fared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The command was handled and acknowledged with success.
    Delivered,
    /// The agent answered with an error, or nobody was subscribed.
    Failed,
    /// No answer within the broadcast's timeout.
    TimedOut,
    /// A durable notification stored in the recipient's inbox (section 7.14); a core one
    /// published is `Delivered`.
    Stored,
}

/// One recipient's line in a broadcast report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecipientReport {
    /// Agent id.
    pub agent: String,
    /// What happened.
    pub outcome: Outcome,
    /// The status it answered with (or the code for what went wrong).
    pub status: StatusCode,
    /// The reason given with a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The coordinator's report of a broadcast.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BroadcastReport {
    /// The broadcast's message id (the correlation id of every copy).
    pub broadcast_id: Uuid,
    /// Who it went to.
    pub target: BroadcastTarget,
    /// One line per recipient, sorted by agent id.
    pub recipients: Vec<RecipientReport>,
}

impl BroadcastReport {
    /// How many recipients had `outcome`.
    pub fn count(&self, outcome: Outcome) -> usize {
        self.recipients
            .iter()
            .filter(|r| r.outcome == outcome)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(value: serde_json::Value) -> Manifest {
        let mut base = serde_json::json!({
            "agent": "a", "instance": "0", "heartbeat_ms": 1000, "started_ms": 0,
        });
        if let (Some(base), Some(more)) = (base.as_object_mut(), value.as_object()) {
            base.extend(more.clone());
        }
        serde_json::from_value(base).expect("a manifest")
    }

    #[test]
    fn the_eta_counts_the_handlers_ahead_at_the_rate_the_slots_free_up() {
        // A free slot: its own handling time.
        assert_eq!(estimate_eta_ms(100, 4, 2, 1), 100);
        // Every slot busy, nothing waiting: one of 4 finishes in 100/4 ms, then 100.
        assert_eq!(estimate_eta_ms(100, 4, 4, 0), 125);
        // One slot, 3 busy-or-waiting ahead: 3 runs, then its own.
        assert_eq!(estimate_eta_ms(100, 1, 1, 2), 400);
        assert_eq!(estimate_eta_ms(100, 0, 1, 0), 200, "no slots read as one");
        assert_eq!(
            estimate_eta_ms(u64::MAX, 1, u32::MAX, u32::MAX),
            u64::MAX,
            "saturates"
        );
    }

    #[test]
    fn a_manifest_s_eta_is_at_a_priority_for_its_slowest_named_capability() {
        let m = manifest(serde_json::json!({
            "capabilities": [
                {"name": "review", "handling_ms": 200},
                {"name": "testing", "handling_ms": 50},
                {"name": "new"},
            ],
            "handling_ms": 100, "slots": 1, "load": 1.0,
            "waiting": {"high": 1, "normal": 2, "low": 4},
        }));
        // Priority high: the busy handler and the one high ahead.
        assert_eq!(m.eta_at(Priority::High, &["review"]), Some(600));
        // Normal waits behind high and normal too; low behind everything.
        assert_eq!(m.eta_at(Priority::Normal, &["testing"]), Some(250));
        assert_eq!(m.eta_at(Priority::Low, &[]), Some(900));
        // The slowest of those named; a capability not yet timed takes the agent's own.
        assert_eq!(
            m.eta_at(Priority::Critical, &["review", "testing"]),
            Some(400)
        );
        assert_eq!(m.eta_at(Priority::Critical, &["new"]), Some(200));
        let untimed = manifest(serde_json::json!({}));
        assert_eq!(untimed.eta_at(Priority::Normal, &[]), None);
        assert_eq!(Waiting::default().at_or_above(Priority::Low), 0);
    }

    #[test]
    fn a_query_takes_several_capabilities_and_a_token_count() {
        let m = manifest(serde_json::json!({
            "capabilities": [
                {"name": "code_review", "max_tokens": 8192},
                {"name": "testing"},
                {"name": "small", "max_tokens": 1024},
            ],
        }));
        let q =
            |v: serde_json::Value| -> DiscoverQuery { serde_json::from_value(v).expect("a query") };
        assert!(q(serde_json::json!({"capabilities": ["code_review", "testing"]})).matches(&m));
        assert!(!q(serde_json::json!({"capabilities": ["code_review", "security"]})).matches(&m));
        assert!(
            q(serde_json::json!({"capability": "testing", "capabilities": ["code_review"]}))
                .matches(&m)
        );
        // 4096 tokens: review states 8192, testing states no limit.
        assert!(
            q(serde_json::json!({"capabilities": ["code_review", "testing"], "max_tokens": 4096}))
                .matches(&m)
        );
        assert!(!q(serde_json::json!({"capabilities": ["small"], "max_tokens": 4096})).matches(&m));
        assert!(
            !q(serde_json::json!({"capabilities": ["code_review"], "max_tokens": 10000}))
                .matches(&m)
        );
        // Naming none: any one of its capabilities will do.
        assert!(q(serde_json::json!({"max_tokens": 100000})).matches(&m));
        let q = q(serde_json::json!({"capability": "a", "capabilities": ["b", "a"]}));
        assert_eq!(q.named(), ["a", "b"]);
    }
}
