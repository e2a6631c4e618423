//! IACP's reference client at the edge (`docs/INTEROP.md`, "The seeds' own clients"): the
//! routes its `IACPClient` calls, as it calls them.
//!
//! - `GET /v1/peers[?capability=]`: the registry's live agents as IACP peers, a JSON list;
//! - `POST /v1/messages` with an IACP envelope (told from the gateway's own body by its
//!   `version` and `message`): a `request` becomes a request on the bus to
//!   `recipient.agent_id`'s command (`recipient.channel` if given, else the intent), answered at
//!   once `{"message_id"}` while the call runs; its reply, or its refusal as an IACP `error`,
//!   waits here for the sender's poll. An `event` is a one-way command to the same command; a
//!   `response` or an `error` with `correlation_id` answers a request the caller polled;
//! - `GET /v1/messages?recipient=` with `X-Agent-ID`: the caller's IACP inbox, a JSON list of
//!   envelopes: those replies and errors (`correlation_id` the request's `message_id`), then
//!   the messages agents sent to the identity (taken from its inbox as a poll takes them).
//!
//! The sender is the caller's authenticated identity: `sender.agent_id` and `X-Agent-ID`, when
//! given, must name it (403, 5007). `identity_sig` is not checked: the gateway authenticated
//! the caller, and signs on the bus with the identity's key when it has one.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode as Http};
use chorus_sdk::{DiscoverQuery, Priority, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::Notify;
use uuid::Uuid;

use super::api::{self, ApiError, ApiResult, Credential, whole};
use super::inbox::{EdgeReply, PolledMessage};
use super::scopes::Route;
use super::{Edge, GatewayState};

/// The header IACP's client names itself with.
pub(crate) const AGENT_ID_HEADER: &str = "x-agent-id";
/// The IACP version this gateway speaks (any `1.x` is taken).
pub(crate) const VERSION: &str = "1.0";
/// The longest `message_id` or `correlation_id` taken, in characters.
pub(crate) const MAX_ID_CHARS: usize = 128;
/// IACP's capability query: a `request` with this intent and no `recipient.channel` is
/// answered by the registry, not sent to a command of that name.
pub(crate) const QUERY_INTENT: &str = "query";
/// The application header that carries an IACP request's intent on the bus.
pub(crate) const INTENT_HEADER: &str = "iacp-intent";

/// Whether a body is an IACP envelope rather than the gateway's own: an object with `version`
/// and `message` (neither is a field of the gateway's body).
pub(crate) fn is_envelope(body: &Value) -> bool {
    body.as_object()
        .is_some_and(|o| o.contains_key("version") && o.contains_key("message"))
}

/// `X-Agent-ID`, if given, must name the caller's identity `me`.
fn check_agent_id(headers: &HeaderMap, me: &str) -> ApiResult<()> {
    let Some(value) = headers.get(AGENT_ID_HEADER) else {
        return Ok(());
    };
    let named = value
        .to_str()
        .map_err(|_| ApiError::bad_request("X-Agent-ID: not printable ASCII"))?;
    if named != me {
        return Err(ApiError::new(
            StatusCode::ACCESS,
            format!("X-Agent-ID {named:?} is not the caller's identity {me}"),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// GET /v1/peers

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PeersQuery {
    capability: Option<String>,
    /// Several capabilities, all of them: a list in a query's payload, comma-separated in a
    /// URL (`capabilities=code_review,testing`).
    #[serde(default, deserialize_with = "names")]
    capabilities: Vec<String>,
    group: Option<String>,
    #[serde(default)]
    available_only: bool,
    max_load: Option<f32>,
    max_tokens: Option<u64>,
    priority: Option<String>,
    /// Agents serving this customer (dedicated to it, or to none); Agentify's `discover`
    /// names it `customer_id`.
    #[serde(alias = "customer_id")]
    customer: Option<String>,
}

/// A list of names, or one string of them separated by commas.
fn names<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Names {
        List(Vec<String>),
        Text(String),
    }
    Ok(match Option::<Names>::deserialize(d)? {
        None => Vec::new(),
        Some(Names::List(list)) => list,
        Some(Names::Text(text)) => text
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect(),
    })
}

impl PeersQuery {
    /// The query a message's payload holds (IACP's capability query, Agentify's `discover`):
    /// the keys of the URL's query, the others ignored, as IACP asks (Agentify's carries
    /// `customer_id`, which is not a filter).
    pub(crate) fn from_payload(payload: &Value) -> ApiResult<PeersQuery> {
        const KEYS: [&str; 9] = [
            "capability",
            "capabilities",
            "group",
            "available_only",
            "max_load",
            "max_tokens",
            "priority",
            "customer",
            "customer_id",
        ];
        let known: serde_json::Map<String, Value> = match payload {
            Value::Null => serde_json::Map::new(),
            Value::Object(o) => o
                .iter()
                .filter(|(k, v)| KEYS.contains(&k.as_str()) && !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            _ => return Err(ApiError::bad_request("a query's payload is a JSON object")),
        };
        serde_json::from_value(Value::Object(known))
            .map_err(|e| ApiError::bad_request(format!("a query's payload: {e}")))
    }
}

/// The longest list of capabilities a query names.
pub(crate) const MAX_QUERY_CAPABILITIES: usize = 32;

/// One capability of a peer, as IACP's capability manifest writes it.
#[derive(Debug, Serialize)]
pub(crate) struct PeerCapability {
    name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    version: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    models: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    throughput: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u64>,
}

/// A live agent as IACP's `discover` returns it.
#[derive(Debug, Serialize)]
pub(crate) struct Peer {
    agent_id: String,
    instance: String,
    capabilities: Vec<PeerCapability>,
    commands: Vec<String>,
    groups: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    customer: Option<String>,
    load: f32,
    availability: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    eta_seconds: Option<u64>,
    last_seen_ms: u64,
}

/// The peer a registry record describes.
pub(crate) fn peer(record: chorus_sdk::AgentRecord) -> Peer {
    let m = record.manifest;
    Peer {
        agent_id: m.agent,
        instance: m.instance,
        capabilities: m
            .capabilities
            .into_iter()
            .map(|c| PeerCapability {
                name: c.name,
                version: c.version,
                models: c.models,
                throughput: c.throughput.filter(|t| t.is_finite()),
                max_tokens: c.max_tokens,
            })
            .collect(),
        commands: m.commands,
        groups: m.groups,
        customer: m.customer,
        load: if m.load.is_finite() { m.load } else { 0.0 },
        availability: format!("{:?}", m.availability).to_lowercase(),
        // The query's ETA (its capabilities, at its priority), else the agent's own.
        eta_seconds: record.eta_ms.or(m.eta_ms).map(|ms| ms.div_ceil(1000)),
        last_seen_ms: record.last_seen_ms,
    }
}

impl PeersQuery {
    /// The registry's query: names checked, `max_load` 0 to 1, `priority` one of Chorus's.
    pub(crate) fn checked(self) -> ApiResult<DiscoverQuery> {
        if let Some(c) = &self.capability {
            api::dotted("capability", c)?;
        }
        if self.capabilities.len() > MAX_QUERY_CAPABILITIES {
            return Err(ApiError::bad_request(format!(
                "capabilities: at most {MAX_QUERY_CAPABILITIES}"
            )));
        }
        for c in &self.capabilities {
            api::dotted("capabilities", c)?;
        }
        if let Some(g) = &self.group {
            api::name("group", g)?;
        }
        if let Some(c) = &self.customer {
            api::name("customer", c)?;
        }
        if let Some(l) = self.max_load
            && !(0.0..=1.0).contains(&l)
        {
            return Err(ApiError::bad_request("max_load is between 0 and 1"));
        }
        let priority = match self.priority.as_deref() {
            None => None,
            Some(p) => match p.parse::<Priority>() {
                Ok(Priority::Unknown) | Err(_) => {
                    return Err(ApiError::bad_request(format!(
                        "priority {p:?}: critical, high, normal or low"
                    )));
                }
                Ok(known) => Some(known),
            },
        };
        Ok(DiscoverQuery {
            capability: self.capability,
            capabilities: self.capabilities,
            group: self.group,
            available_only: self.available_only,
            max_load: self.max_load,
            max_tokens: self.max_tokens,
            priority,
            customer: self.customer,
        })
    }
}

/// The live agents `query` selects, as peers.
pub(crate) async fn peers_of(edge: &Edge, query: PeersQuery) -> ApiResult<Vec<Peer>> {
    let records = edge.agent.discover(&query.checked()?).await?;
    Ok(records.into_iter().map(peer).collect())
}

/// `GET /v1/peers?capability=&group=&available_only=&max_load=`.
pub(crate) async fn peers(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<Peer>>> {
    let (edge, _) = api::edge(&state, &headers, Route::Agents)?;
    check_agent_id(&headers, edge.agent.id())?;
    let q: PeersQuery = api::query(raw)?;
    Ok(Json(peers_of(edge, q).await?))
}

// ---------------------------------------------------------------------------------------
// The envelope

/// An agent as an envelope names it.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Party {
    agent_id: Option<String>,
    channel: Option<String>,
}

/// An envelope's `message`.
#[derive(Debug, Deserialize)]
pub(crate) struct Body {
    #[serde(rename = "type")]
    kind: String,
    intent: Option<String>,
    #[serde(default)]
    payload: Value,
}

/// An IACP envelope as a client sends it; fields it does not know are ignored, as IACP asks.
#[derive(Debug, Deserialize)]
pub(crate) struct Envelope {
    version: String,
    message_id: Option<String>,
    correlation_id: Option<String>,
    #[serde(default)]
    sender: Party,
    #[serde(default)]
    recipient: Party,
    #[serde(default, deserialize_with = "whole::opt_u64")]
    ttl_seconds: Option<u64>,
    message: Body,
}

/// What an envelope asks of the bus.
#[derive(Debug, PartialEq)]
pub(crate) enum Action<'a> {
    /// A request to `to`'s `command`, its reply queued for the sender's poll.
    Request { to: &'a str, command: &'a str },
    /// A one-way command to `to`'s `command`.
    Notify { to: &'a str, command: &'a str },
    /// IACP's capability query (a `request`, intent `query`, no `recipient.channel`),
    /// answered from the registry: `to`'s capability manifest, or every peer that matches.
    Query { to: Option<&'a str> },
    /// An answer to request `id`, which the caller polled.
    Answer { id: Uuid, reply: EdgeReply },
}

fn id_text<'a>(what: &str, value: Option<&'a str>) -> ApiResult<Option<&'a str>> {
    match value {
        Some(v) if v.is_empty() || v.chars().count() > MAX_ID_CHARS => Err(ApiError::bad_request(
            format!("{what}: 1 to {MAX_ID_CHARS} characters"),
        )),
        other => Ok(other),
    }
}

/// The error an IACP `error` message reports: its `code` when that is a Chorus failure code
/// (5003-5099 but the successes), else 5017 with the code named in the reason.
pub(crate) fn reported_error(payload: &Value) -> EdgeReply {
    let message = payload
        .get("message")
        .or_else(|| payload.get("error"))
        .and_then(Value::as_str)
        .unwrap_or("the IACP client reported an error");
    let code = payload.get("code");
    let chorus = code
        .and_then(Value::as_u64)
        .and_then(|c| u16::try_from(c).ok())
        .map(StatusCode)
        .filter(|c| (5003..=5099).contains(&c.0) && !c.is_success());
    let (status, reason) = match (chorus, code) {
        (Some(status), _) => (status, message.to_owned()),
        (None, Some(Value::String(c))) => (StatusCode::HANDLER_FAILED, format!("{c}: {message}")),
        (None, Some(c)) if !c.is_null() => (StatusCode::HANDLER_FAILED, format!("{c}: {message}")),
        _ => (StatusCode::HANDLER_FAILED, message.to_owned()),
    };
    EdgeReply {
        status,
        reason,
        payload: Value::Null,
    }
}

/// What `env`, sent by `me`, asks: checked (version 1.x, the sender is `me`, names and ids
/// valid), without touching the bus.
pub(crate) fn action<'a>(env: &'a Envelope, me: &str) -> ApiResult<Action<'a>> {
    if env.version.split('.').next() != Some("1") {
        return Err(ApiError::new(
            StatusCode::DATA_FORMAT,
            format!(
                "IACP version {:?}: this gateway speaks {VERSION}",
                env.version
            ),
        ));
    }
    if let Some(sender) = &env.sender.agent_id
        && sender != me
    {
        return Err(ApiError::new(
            StatusCode::ACCESS,
            format!("sender.agent_id {sender:?} is not the caller's identity {me}"),
        ));
    }
    id_text("message_id", env.message_id.as_deref())?;
    let correlation = id_text("correlation_id", env.correlation_id.as_deref())?;
    let target = || -> ApiResult<(&'a str, &'a str)> {
        let to = env
            .recipient
            .agent_id
            .as_deref()
            .ok_or_else(|| ApiError::bad_request("recipient.agent_id: required"))?;
        let command = match (&env.recipient.channel, &env.message.intent) {
            (Some(channel), _) => api::name("recipient.channel", channel)?,
            (None, Some(intent)) => api::name("message.intent", intent)?,
            (None, None) => {
                return Err(ApiError::bad_request(
                    "message.intent (or recipient.channel): the command to call",
                ));
            }
        };
        Ok((api::name("recipient.agent_id", to)?, command))
    };
    match env.message.kind.as_str() {
        "request"
            if env.message.intent.as_deref() == Some(QUERY_INTENT)
                && env.recipient.channel.is_none() =>
        {
            let to = match env.recipient.agent_id.as_deref() {
                Some(to) => Some(api::name("recipient.agent_id", to)?),
                None => None,
            };
            Ok(Action::Query { to })
        }
        "request" => {
            let (to, command) = target()?;
            Ok(Action::Request { to, command })
        }
        "event" => {
            let (to, command) = target()?;
            Ok(Action::Notify { to, command })
        }
        kind @ ("response" | "error") => {
            let id = correlation
                .and_then(|c| c.parse::<Uuid>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "a {kind} names the message_id of the request it answers in \
                         correlation_id (a UUID, as the poll gave it)"
                    ))
                })?;
            let reply = if kind == "response" {
                EdgeReply {
                    status: StatusCode::OK,
                    reason: String::new(),
                    payload: env.message.payload.clone(),
                }
            } else {
                reported_error(&env.message.payload)
            };
            Ok(Action::Answer { id, reply })
        }
        "heartbeat" => Err(ApiError::bad_request(
            "heartbeat: the gateway keeps its identities' presence itself",
        )),
        other => Err(ApiError::bad_request(format!(
            "message.type {other:?}: request, event, response or error"
        ))),
    }
}

/// How long a request waits for its reply: `ttl_seconds` (at most `max_ms`), else
/// `default_ms`.
pub(crate) fn request_timeout(
    ttl_seconds: Option<u64>,
    default_ms: u64,
    max_ms: u64,
) -> ApiResult<Duration> {
    match ttl_seconds {
        Some(0) => Err(ApiError::bad_request("ttl_seconds must be positive")),
        Some(s) => Ok(Duration::from_millis(s.saturating_mul(1000).min(max_ms))),
        None => Ok(Duration::from_millis(default_ms)),
    }
}

// ---------------------------------------------------------------------------------------
// Envelopes out

/// `ms` since the epoch as IACP's and Agentify's timestamps (RFC 3339, UTC, seconds).
pub(crate) fn timestamp_of(ms: u64) -> String {
    timestamp(Some(ms))
}

/// Now, or `ms` since the epoch, as IACP's timestamps (RFC 3339, UTC, seconds).
fn timestamp(ms: Option<u64>) -> String {
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]Z");
    let at = match ms {
        Some(ms) => time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH),
        None => time::OffsetDateTime::now_utc(),
    };
    at.format(&format).unwrap_or_default()
}

/// Who answers a capability query that names no agent.
pub(crate) const REGISTRY_SENDER: &str = "registry";

/// A request the caller sent, as its reply's envelope refers to it.
#[derive(Debug, Clone)]
pub(crate) struct Sent {
    /// The sender's identity.
    pub(crate) me: String,
    /// The envelope's `message_id` (or the bus message's id when it gave none).
    pub(crate) message_id: String,
    pub(crate) to: String,
    pub(crate) intent: Option<String>,
}

/// The `response` envelope of a reply to `sent` from `from`.
pub(crate) fn response(sent: &Sent, from: &str, payload: Value) -> Value {
    json!({
        "version": VERSION,
        "message_id": Uuid::now_v7().to_string(),
        "correlation_id": sent.message_id,
        "sender": {"agent_id": from},
        "recipient": {"agent_id": sent.me},
        "timestamp": timestamp(None),
        "message": {"type": "response", "intent": sent.intent, "payload": payload},
    })
}

/// The `error` envelope of a request `sent` that failed with `status`.
pub(crate) fn error(sent: &Sent, status: StatusCode, reason: &str) -> Value {
    json!({
        "version": VERSION,
        "message_id": Uuid::now_v7().to_string(),
        "correlation_id": sent.message_id,
        "sender": {"agent_id": sent.to},
        "recipient": {"agent_id": sent.me},
        "timestamp": timestamp(None),
        "message": {
            "type": "error",
            "intent": sent.intent,
            "payload": {"code": status.0, "label": status.label(), "message": reason},
        },
    })
}

/// A message sent to identity `me`, as an IACP envelope: a `request` when its sender waits for
/// the answer (a `response` or `error` with `correlation_id` its `message_id`), else an
/// `event` with intent `notify`. The command is `recipient.channel`.
pub(crate) fn inbound(m: &PolledMessage, me: &str) -> Value {
    let (kind, intent) = if m.reply_expected {
        ("request", m.command.as_str())
    } else {
        ("event", "notify")
    };
    let mut env = json!({
        "version": VERSION,
        "message_id": m.id.to_string(),
        "correlation_id": m.conversation.to_string(),
        "sender": {"agent_id": m.from},
        "recipient": {"agent_id": me, "channel": m.command},
        "timestamp": timestamp(Some(m.timestamp_ms)),
        "message": {"type": kind, "intent": intent, "payload": m.payload},
    });
    if let Some(ms) = m.timeout_ms {
        env["ttl_seconds"] = json!(ms.div_ceil(1000));
    }
    if let Some(task) = &m.task {
        env["message"]["task"] = json!(task);
    }
    env
}

// ---------------------------------------------------------------------------------------
// The replies waiting for a poll

#[derive(Default)]
struct Queued {
    envelopes: VecDeque<Value>,
    in_flight: usize,
}

/// The IACP replies and errors waiting for one identity's poll, and its requests in flight:
/// together at most `capacity`.
pub(crate) struct Outbox {
    capacity: usize,
    queued: Mutex<Queued>,
    arrived: Notify,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// A place in an [`Outbox`] for a request in flight, given back when dropped.
pub(crate) struct Place {
    outbox: Arc<Outbox>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut q = self.outbox.lock();
        q.in_flight = q.in_flight.saturating_sub(1);
    }
}

impl Outbox {
    pub(crate) fn new(capacity: usize) -> Self {
        Outbox {
            capacity,
            queued: Mutex::new(Queued::default()),
            arrived: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queued> {
        self.queued
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for one more request in flight, or 429 (5013) when requests in flight and
    /// replies not yet polled fill the outbox.
    pub(crate) fn reserve(self: &Arc<Self>) -> ApiResult<Place> {
        let mut q = self.lock();
        if q.in_flight + q.envelopes.len() >= self.capacity {
            return Err(ApiError::new(
                StatusCode::RATE_LIMITED,
                format!(
                    "{} IACP requests in flight or replies not yet polled: poll first",
                    self.capacity
                ),
            ));
        }
        q.in_flight += 1;
        drop(q);
        Ok(Place {
            outbox: Arc::clone(self),
        })
    }

    /// Queues the reply of the request holding `place`.
    pub(crate) fn deliver(&self, place: Place, envelope: Value) {
        self.lock().envelopes.push_back(envelope);
        drop(place);
        self.arrived.notify_waiters();
    }

    /// Up to `max` queued envelopes, oldest first.
    pub(crate) fn take(&self, max: usize) -> Vec<Value> {
        let mut q = self.lock();
        let n = max.min(q.envelopes.len());
        q.envelopes.drain(..n).collect()
    }
}

// ---------------------------------------------------------------------------------------
// POST /v1/messages, GET /v1/messages

/// What `POST /v1/messages` answers an envelope with.
#[derive(Debug, Serialize)]
pub(crate) struct Accepted {
    message_id: String,
}

/// Sends what envelope `body` asks as the caller's identity (`edge`): see the module's doc.
pub(crate) async fn send(
    state: &Arc<GatewayState>,
    edge: &Edge,
    credential: &Credential,
    headers: &HeaderMap,
    body: Value,
) -> ApiResult<Accepted> {
    let me = edge.agent.id();
    check_agent_id(headers, me)?;
    let env: Envelope = serde_json::from_value(body)
        .map_err(|e| ApiError::new(StatusCode::DATA_FORMAT, format!("the IACP envelope: {e}")))?;
    let given = env.message_id.clone();
    let bus_id = given
        .as_deref()
        .and_then(|g| g.parse::<Uuid>().ok())
        .unwrap_or_else(Uuid::now_v7);
    let message_id = given.unwrap_or_else(|| bus_id.to_string());
    match action(&env, me)? {
        Action::Answer { id, reply } => {
            if !edge.inbox.reply(id, reply) {
                return Err(ApiError::new(
                    StatusCode::INVALID_ARGUMENT,
                    format!("no request {id} waits for a reply"),
                )
                .with_http(Http::NOT_FOUND));
            }
        }
        Action::Notify { to, command } => {
            // A notification: at most once, as an event is (the gateway's own body sends
            // durable commands).
            let call = credential
                .call(Some(to), Some(command), None)?
                .id(bus_id)
                .delivery(chorus_sdk::DeliveryClass::AtMostOnce)
                .json_payload(&env.message.payload)?;
            let call = match &env.message.intent {
                Some(intent) => call.header(INTENT_HEADER, intent),
                None => call,
            };
            edge.agent.send(call).await?;
        }
        Action::Query { to } => {
            credential.route(Route::Agents)?;
            let peers = peers_of(edge, PeersQuery::from_payload(&env.message.payload)?).await?;
            let sent = Sent {
                me: me.to_owned(),
                message_id: message_id.clone(),
                to: to.unwrap_or(REGISTRY_SENDER).to_owned(),
                intent: env.message.intent.clone(),
            };
            let answer = match to {
                None => response(&sent, REGISTRY_SENDER, json!({ "peers": peers })),
                Some(to) => match peers.into_iter().find(|p| p.agent_id == to) {
                    Some(peer) => response(&sent, to, json!(peer)),
                    None => error(
                        &sent,
                        StatusCode::NO_RESPONDERS,
                        &format!("no live agent {to} answers this query"),
                    ),
                },
            };
            let place = edge.iacp.reserve()?;
            edge.iacp.deliver(place, answer);
        }
        Action::Request { to, command } => {
            // A request is also what `/v1/requests` is: its scopes must grant that too.
            credential.route(Route::Requests)?;
            let timeout = request_timeout(
                env.ttl_seconds,
                state.config.request_timeout_ms,
                state.config.max_request_timeout_ms,
            )?;
            let mut call = credential
                .call(Some(to), Some(command), None)?
                .id(bus_id)
                .timeout(timeout)
                .json_payload(&env.message.payload)?;
            if let Some(intent) = &env.message.intent {
                call = call.header(INTENT_HEADER, intent);
            }
            let place = edge.iacp.reserve()?;
            let sent = Sent {
                me: me.to_owned(),
                message_id: message_id.clone(),
                to: to.to_owned(),
                intent: env.message.intent.clone(),
            };
            let (state, stop) = (Arc::clone(state), state.stop.child_token());
            state.tracker.clone().spawn(async move {
                let Some(edge) = state.edges.get(&sent.me) else {
                    return;
                };
                let outcome = tokio::select! {
                    outcome = edge.agent.call(call) => outcome,
                    () = stop.cancelled() => return,
                };
                let envelope = match outcome {
                    Ok(reply) if reply.payload().is_empty() => {
                        response(&sent, reply.envelope.from.as_str(), Value::Null)
                    }
                    Ok(reply) => match reply.payload_as::<Value>() {
                        Ok(payload) => response(&sent, reply.envelope.from.as_str(), payload),
                        Err(e) => error(
                            &sent,
                            StatusCode::DATA_FORMAT,
                            &format!("the reply's payload does not read as JSON: {e}"),
                        ),
                    },
                    Err(e) => error(&sent, e.status(), &e.to_string()),
                };
                edge.iacp.deliver(place, envelope);
            });
        }
    }
    Ok(Accepted { message_id })
}

/// The caller's IACP inbox: replies and errors to its requests first, then messages sent to
/// it, up to `max` in all, waiting up to `wait_ms` for the first.
pub(crate) async fn poll(
    state: &GatewayState,
    edge: &Edge,
    headers: &HeaderMap,
    q: &api::PollQuery,
) -> ApiResult<Vec<Value>> {
    let me = edge.agent.id();
    check_agent_id(headers, me)?;
    let (wait, max) = q.checked(state, me)?;
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        // Registered before the outbox is read, so a reply in between still wakes it.
        let arrived = edge.iacp.arrived.notified();
        tokio::pin!(arrived);
        arrived.as_mut().enable();
        let mut out = edge.iacp.take(max);
        if !out.is_empty() {
            let room = max - out.len();
            if room > 0 {
                let taken = edge.inbox.take(room, Duration::ZERO).await;
                out.extend(taken.iter().map(|m| inbound(m, me)));
            }
            return Ok(out);
        }
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        tokio::select! {
            taken = edge.inbox.take(max, remaining) => {
                return Ok(taken.iter().map(|m| inbound(m, me)).collect());
            }
            () = &mut arrived => {}
        }
    }
}

#[cfg(test)]
#[path = "iacp_tests.rs"]
mod tests;
