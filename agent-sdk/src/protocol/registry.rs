//! What agents tell the coordinator about themselves, and what the coordinator answers:
//! capability manifests, discovery queries, broadcast requests and reports.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::protocol::status::StatusCode;

/// Suffix of the registry bucket's name.
pub const REGISTRY_BUCKET: &str = "registry";

/// The coordinator's agent id: what it sends is `from` it, and the operators' commands
/// (hosting, usage) go to it, answered by one of the coordinators in their queue group.
pub const COORDINATOR_ID: &str = "coordinator";

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
    /// Estimated time until it could start new work, in ms, if it knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_ms: Option<u64>,
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
/// (protocol 2) while it is 2, and the named form otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireLevel {
    /// 1 or 2.
    pub major: u16,
}

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
}

/// A registry entry as discovery returns it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRecord {
    /// The manifest from the latest heartbeat.
    pub manifest: Manifest,
    /// When the coordinator last heard from the agent, ms since the epoch.
    pub last_seen_ms: u64,
}

/// A discovery query. Empty fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DiscoverQuery {
    /// Only agents offering this capability.
    pub capability: Option<String>,
    /// Only agents in this group.
    pub group: Option<String>,
    /// Only agents whose availability is `available`.
    pub available_only: bool,
    /// Only agents at or below this load.
    pub max_load: Option<f32>,
}

impl DiscoverQuery {
    /// Agents offering `capability`.
    pub fn capability(capability: impl Into<String>) -> Self {
        DiscoverQuery {
            capability: Some(capability.into()),
            ..DiscoverQuery::default()
        }
    }

    /// Whether `m` matches.
    pub fn matches(&self, m: &Manifest) -> bool {
        self.capability.as_deref().is_none_or(|c| m.offers(c))
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
