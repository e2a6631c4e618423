//! The gateway's HTTP API, version 1 (documented in `/openapi.json`): discover, send, poll,
//! reply, request (IACP's envelopes on `/v1/messages` are `iacp.rs`'s, Agentify's
//! `POST /agent/message` is `agentify.rs`'s). Every route authenticates first;
//! bodies and query strings are parsed here, so every refusal has the same JSON shape:
//! `{"status": <Chorus code>, "label": ..., "reason": ...}` with the matching HTTP status.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode as Http, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use chorus_sdk::envelope::CONTENT_TYPE_JSON;
use chorus_sdk::{Call, DeliveryClass, DiscoverQuery, Priority, SdkError, StatusCode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use uuid::Uuid;

use super::auth::AuthError;
use super::inbox::{EdgeReply, PolledMessage};
use super::scopes::{Grants, Route};
use super::{Edge, GatewayState};

/// A refusal: the HTTP status, the Chorus code and why.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    http: Http,
    status: StatusCode,
    reason: String,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    status: u16,
    label: &'a str,
    reason: &'a str,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, reason: impl Into<String>) -> Self {
        ApiError {
            http: http_status(status),
            status,
            reason: reason.into(),
        }
    }

    /// The HTTP status it answers with.
    pub(crate) fn http(&self) -> Http {
        self.http
    }

    /// Its reason, as the body says it.
    pub(crate) fn reason(&self) -> &str {
        &self.reason
    }

    pub(crate) fn bad_request(reason: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INVALID_ARGUMENT, reason)
    }

    /// The refusal as JSON: `{"status", "label", "reason"}`.
    pub(crate) fn body(&self) -> serde_json::Value {
        serde_json::json!(ErrorBody {
            status: self.status.0,
            label: self.status.label(),
            reason: &self.reason,
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            status: self.status.0,
            label: self.status.label(),
            reason: &self.reason,
        };
        refusal(self.http, body)
    }
}

/// A refusal's response: `body` as JSON with status `http`, and the challenge a 401 carries.
pub(crate) fn refusal(http: Http, body: impl Serialize) -> Response {
    let mut response = (http, Json(body)).into_response();
    if http == Http::UNAUTHORIZED {
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    response
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        let status = match e {
            AuthError::UnknownIdentity(_) => StatusCode::IDENTITY,
            _ => StatusCode::UNAUTHORIZED,
        };
        ApiError {
            http: Http::UNAUTHORIZED,
            status,
            reason: e.to_string(),
        }
    }
}

impl From<SdkError> for ApiError {
    fn from(e: SdkError) -> Self {
        match e {
            // The agent's own words: the status beside them says it refused.
            SdkError::Remote { status, reason, .. } => ApiError::new(status, reason),
            e => ApiError::new(e.status(), e.to_string()),
        }
    }
}

/// The HTTP status that says what a Chorus code says.
pub(crate) fn http_status(code: StatusCode) -> Http {
    match code {
        c if c.is_success() => Http::OK,
        StatusCode::IDENTITY | StatusCode::UNAUTHORIZED => Http::UNAUTHORIZED,
        StatusCode::ACCESS => Http::FORBIDDEN,
        StatusCode::TIMEOUT | StatusCode::EXPIRED => Http::GATEWAY_TIMEOUT,
        StatusCode::DATA_FORMAT | StatusCode::INVALID_ARGUMENT => Http::BAD_REQUEST,
        StatusCode::NO_RESPONDERS | StatusCode::UNKNOWN_COMMAND => Http::NOT_FOUND,
        StatusCode::RATE_LIMITED | StatusCode::CONNECTION_LIMIT => Http::TOO_MANY_REQUESTS,
        StatusCode::LOOP_DETECTED => Http::LOOP_DETECTED,
        StatusCode::REPLAY
        | StatusCode::UNCERTAIN
        | StatusCode::TASK_STATE
        | StatusCode::CANCELLED => Http::CONFLICT,
        StatusCode::UNAVAILABLE | StatusCode::UNEXPECTED_DISCONNECT | StatusCode::DISCONNECTED => {
            Http::SERVICE_UNAVAILABLE
        }
        StatusCode::HANDLER_FAILED | StatusCode::UNVERIFIED => Http::BAD_GATEWAY,
        _ => Http::INTERNAL_SERVER_ERROR,
    }
}

pub(crate) type ApiResult<T> = Result<T, ApiError>;

/// What a caller's credentials carry past the door: the token to relay (a JWT; an API key is
/// never relayed) and what its scopes grant (`None`: the gateway has no scopes).
#[derive(Debug, Clone, Default)]
pub(crate) struct Credential {
    token: Option<String>,
    grants: Option<Arc<Grants>>,
}

fn out_of_scope(what: String) -> ApiError {
    ApiError::new(StatusCode::ACCESS, what)
}

impl Credential {
    /// No credentials at all: no token, no scopes (what an anonymous reader of a public card
    /// stands for).
    pub(crate) fn none() -> Credential {
        Credential {
            token: None,
            grants: None,
        }
    }

    /// Whether its scopes grant route group `route` (403 saying which if not).
    pub(crate) fn route(&self, route: Route) -> ApiResult<()> {
        match &self.grants {
            Some(g) if !g.route(route) => Err(out_of_scope(format!(
                "the credentials' scopes ({}) do not grant the {} routes",
                g.names(),
                route.name()
            ))),
            _ => Ok(()),
        }
    }

    /// Whether its scopes grant a call to `to`'s `command`, or to `capability` (403 saying
    /// which if not).
    pub(crate) fn target(
        &self,
        to: Option<&str>,
        command: Option<&str>,
        capability: Option<&str>,
    ) -> ApiResult<()> {
        // The coordinator's and the hosts' commands run code and change the bus: only a scope
        // that names the agent reaches them (neither `*` nor a gateway without scopes does),
        // and the coordinator still checks the identity's role, a host its allowed senders
        // (docs/SECURITY.md, "Roles and authority").
        if let Some(agent) = to
            && command.is_some()
            && chorus_sdk::registry::is_admin_agent(agent)
            && !self.grants.as_ref().is_some_and(|g| g.names_agent(agent))
        {
            return Err(out_of_scope(format!(
                "calls to {agent} need a scope whose agents name \"{agent}\" (an admin scope; \
                 `*` does not reach it)"
            )));
        }
        let Some(g) = &self.grants else {
            return Ok(());
        };
        match (to, command, capability) {
            (_, _, Some(c)) if !g.capability(c) => Err(out_of_scope(format!(
                "the credentials' scopes ({}) do not grant the capability {c}",
                g.names()
            ))),
            (Some(agent), Some(_), None) if !g.agent(agent) => Err(out_of_scope(format!(
                "the credentials' scopes ({}) do not grant calls to {agent}",
                g.names()
            ))),
            _ => Ok(()),
        }
    }

    /// The call to `to`'s `command`, or to `capability` (and `to` for one holder of it), if
    /// the names are valid and the scopes grant it, carrying the token if there is one.
    pub(crate) fn call(
        &self,
        to: Option<&str>,
        command: Option<&str>,
        capability: Option<&str>,
    ) -> ApiResult<Call> {
        let call = call_to(to, command, capability)?;
        self.target(to, command, capability)?;
        Ok(match &self.token {
            Some(t) => call.token(t),
            None => call,
        })
    }
}

/// The caller's edge identity, from its credentials, if its scopes grant `route`: the
/// identity's edge and what the credentials carry.
pub(crate) fn edge<'a>(
    state: &'a GatewayState,
    headers: &HeaderMap,
    route: Route,
) -> ApiResult<(&'a Edge, Credential)> {
    let caller = state.auth.authenticate(headers)?;
    caller_edge(state, caller, route)
}

/// The edge of an authenticated `caller`, if its scopes grant `route`.
pub(crate) fn caller_edge(
    state: &GatewayState,
    caller: crate::auth::Caller,
    route: Route,
) -> ApiResult<(&Edge, Credential)> {
    let credential = Credential {
        token: caller.token,
        grants: state.scopes.grants(&caller.scopes),
    };
    credential.route(route)?;
    match state.edges.get(&caller.identity) {
        Some(edge) => {
            state.limits.admit(&caller.identity)?;
            Ok((edge, credential))
        }
        None => Err(ApiError::from(AuthError::UnknownIdentity(caller.identity))),
    }
}

/// Whole numbers as JSON Schema counts them: `5010.0` is the integer 5010, as the document's
/// `integer` allows; a fraction or a negative is refused.
pub(crate) mod whole {
    use serde::{Deserialize, Deserializer, de::Error as _};

    fn read(n: &serde_json::Number) -> Option<u64> {
        n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0)
                .and_then(|f| format!("{f:.0}").parse().ok())
        })
    }

    pub(crate) fn opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        Option::<serde_json::Number>::deserialize(d)?
            .map(|n| read(&n).ok_or_else(|| D::Error::custom(format!("{n} is not a whole number"))))
            .transpose()
    }

    pub(crate) fn opt_u16<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u16>, D::Error> {
        opt_u64(d)?
            .map(|n| u16::try_from(n).map_err(|_| D::Error::custom(format!("{n} is too large"))))
            .transpose()
    }
}

pub(crate) fn body<T: DeserializeOwned>(bytes: &Bytes) -> ApiResult<T> {
    body_borrowed(bytes)
}

/// The body read as `T`, which may borrow from it.
pub(crate) fn body_borrowed<'a, T: Deserialize<'a>>(bytes: &'a Bytes) -> ApiResult<T> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::new(StatusCode::DATA_FORMAT, format!("the body: {e}")))
}

pub(crate) fn query<T: DeserializeOwned + Default>(raw: Option<String>) -> ApiResult<T> {
    match raw {
        None => Ok(T::default()),
        Some(q) => serde_urlencoded::from_str(&q)
            .map_err(|e| ApiError::bad_request(format!("the query: {e}"))),
    }
}

pub(crate) fn name<'a>(what: &str, value: &'a str) -> ApiResult<&'a str> {
    chorus_sdk::subject::validate_token("name", value)
        .map_err(|e| ApiError::bad_request(format!("{what}: {e}")))?;
    Ok(value)
}

pub(crate) fn dotted<'a>(what: &str, value: &'a str) -> ApiResult<&'a str> {
    chorus_sdk::subject::validate_dotted("name", value)
        .map_err(|e| ApiError::bad_request(format!("{what}: {e}")))?;
    Ok(value)
}

// ---------------------------------------------------------------------------------------
// GET /v1/agents

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentsQuery {
    capability: Option<String>,
    group: Option<String>,
    #[serde(default)]
    available_only: bool,
}

#[derive(Serialize)]
pub(crate) struct AgentView {
    id: String,
    instance: String,
    capabilities: Vec<String>,
    commands: Vec<String>,
    groups: Vec<String>,
    load: f32,
    availability: String,
    last_seen_ms: u64,
}

#[derive(Serialize)]
pub(crate) struct AgentsBody {
    agents: Vec<AgentView>,
}

pub(crate) async fn agents(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<AgentsBody>> {
    let (edge, _) = edge(&state, &headers, Route::Agents)?;
    let q: AgentsQuery = query(raw)?;
    if let Some(c) = &q.capability {
        dotted("capability", c)?;
    }
    if let Some(g) = &q.group {
        name("group", g)?;
    }
    let records = edge
        .agent
        .discover(&DiscoverQuery {
            capability: q.capability,
            group: q.group,
            available_only: q.available_only,
            ..DiscoverQuery::default()
        })
        .await?;
    let agents = records
        .into_iter()
        .map(|r| AgentView {
            id: r.manifest.agent,
            instance: r.manifest.instance,
            capabilities: r
                .manifest
                .capabilities
                .into_iter()
                .map(|c| c.name)
                .collect(),
            commands: r.manifest.commands,
            groups: r.manifest.groups,
            load: if r.manifest.load.is_finite() {
                r.manifest.load
            } else {
                0.0
            },
            availability: format!("{:?}", r.manifest.availability).to_lowercase(),
            last_seen_ms: r.last_seen_ms,
        })
        .collect();
    Ok(Json(AgentsBody { agents }))
}

// ---------------------------------------------------------------------------------------
// POST /v1/messages

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SendBody {
    to: Option<String>,
    command: Option<String>,
    topic: Option<String>,
    #[serde(default)]
    payload: serde_json::Value,
    delivery: Option<String>,
    priority: Option<String>,
    #[serde(default, deserialize_with = "whole::opt_u64")]
    ttl_ms: Option<u64>,
}

#[derive(Serialize)]
pub(crate) struct SentBody {
    id: Option<Uuid>,
    kind: &'static str,
    delivery: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_seq: Option<u64>,
    duplicate: bool,
}

fn delivery(value: Option<&str>) -> ApiResult<DeliveryClass> {
    let Some(text) = value else {
        return Ok(DeliveryClass::AtMostOnce);
    };
    match text.parse::<DeliveryClass>() {
        Ok(DeliveryClass::Unknown) | Err(_) => Err(ApiError::bad_request(format!(
            "delivery {text:?}: at_most_once, at_least_once or exactly_once"
        ))),
        Ok(class) => Ok(class),
    }
}

fn priority(value: Option<&str>) -> ApiResult<Priority> {
    let Some(text) = value else {
        return Ok(Priority::Normal);
    };
    match text.parse::<Priority>() {
        Ok(Priority::Unknown) | Err(_) => Err(ApiError::bad_request(format!(
            "priority {text:?}: low, normal, high or critical"
        ))),
        Ok(p) => Ok(p),
    }
}

/// `POST /v1/messages`: the gateway's own body, or an IACP envelope (`version` and
/// `message`: `iacp.rs`).
pub(crate) async fn send(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    let (edge, credential) = edge(&state, &headers, Route::Messages)?;
    let value: serde_json::Value = body(&bytes)?;
    if crate::iacp::is_envelope(&value) {
        let sent = crate::iacp::send(&state, edge, &credential, &headers, value).await?;
        return Ok((Http::ACCEPTED, Json(sent)).into_response());
    }
    let b: SendBody = serde_json::from_value(value)
        .map_err(|e| ApiError::new(StatusCode::DATA_FORMAT, format!("the body: {e}")))?;
    Ok((Http::ACCEPTED, Json(send_as(edge, &credential, b).await?)).into_response())
}

/// Sends what `b` describes as `edge`: an event, or a command in a delivery class (with the
/// credential's token, if the caller came with one, and if its scopes grant the target).
pub(crate) async fn send_as(
    edge: &Edge,
    credential: &Credential,
    b: SendBody,
) -> ApiResult<SentBody> {
    match (b.topic.as_deref(), b.to.as_deref(), b.command.as_deref()) {
        (Some(topic), None, None) => {
            if b.delivery.is_some() || b.ttl_ms.is_some() {
                return Err(ApiError::bad_request(
                    "an event (topic) takes no delivery or ttl_ms: events are at most once",
                ));
            }
            let topic = dotted("topic", topic)?;
            edge.agent.publish(topic, &b.payload).await?;
            Ok(SentBody {
                id: None,
                kind: "event",
                delivery: DeliveryClass::AtMostOnce.as_str(),
                stream_seq: None,
                duplicate: false,
            })
        }
        (None, Some(to), Some(command)) => {
            let mut call = credential
                .call(Some(to), Some(command), None)?
                .json_payload(&b.payload)?
                .delivery(delivery(b.delivery.as_deref())?)
                .priority(priority(b.priority.as_deref())?);
            if let Some(ttl) = b.ttl_ms {
                if ttl == 0 {
                    return Err(ApiError::bad_request("ttl_ms must be positive"));
                }
                call = call.ttl(Duration::from_millis(ttl));
            }
            let receipt = edge.agent.send(call).await?;
            Ok(SentBody {
                id: Some(receipt.id),
                kind: "command",
                delivery: receipt.delivery.as_str(),
                stream_seq: receipt.stream_seq,
                duplicate: receipt.duplicate,
            })
        }
        _ => Err(ApiError::bad_request(
            "give either topic (an event) or to with command (a command)",
        )),
    }
}

// ---------------------------------------------------------------------------------------
// GET /v1/messages

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PollQuery {
    pub(crate) recipient: Option<String>,
    pub(crate) wait_ms: Option<u64>,
    pub(crate) max: Option<usize>,
}

impl PollQuery {
    /// The wait and the batch size it asks for, checked against the gateway's limits; 403 if
    /// it names a recipient other than `me`.
    pub(crate) fn checked(&self, state: &GatewayState, me: &str) -> ApiResult<(Duration, usize)> {
        if let Some(recipient) = &self.recipient
            && recipient != me
        {
            return Err(ApiError::new(
                StatusCode::ACCESS,
                format!("{me} may poll only its own inbox"),
            ));
        }
        let wait = Duration::from_millis(self.wait_ms.unwrap_or(0));
        if wait > state.config.max_wait() {
            return Err(ApiError::bad_request(format!(
                "wait_ms is at most {}",
                state.config.max_wait_ms
            )));
        }
        let max = self.max.unwrap_or(10);
        if !(1..=MAX_POLL_BATCH).contains(&max) {
            return Err(ApiError::bad_request(format!(
                "max is between 1 and {MAX_POLL_BATCH}"
            )));
        }
        Ok((wait, max))
    }
}

/// The most messages one poll returns.
pub(crate) const MAX_POLL_BATCH: usize = 100;

#[derive(Serialize)]
pub(crate) struct PolledBody {
    messages: Vec<PolledMessage>,
}

/// `GET /v1/messages`: `{"messages": [...]}`, or with an `X-Agent-ID` header IACP's inbox, a
/// JSON list of envelopes (`iacp.rs`).
pub(crate) async fn poll(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let (edge, _) = edge(&state, &headers, Route::Messages)?;
    let q: PollQuery = query(raw)?;
    if headers.contains_key(crate::iacp::AGENT_ID_HEADER) {
        let inbox = crate::iacp::poll(&state, edge, &headers, &q).await?;
        return Ok(Json(inbox).into_response());
    }
    let (wait, max) = q.checked(&state, edge.agent.id())?;
    let messages = edge.inbox.take(max, wait).await;
    Ok(Json(PolledBody { messages }).into_response())
}

// ---------------------------------------------------------------------------------------
// POST /v1/replies

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReplyBody {
    in_reply_to: Uuid,
    #[serde(default)]
    payload: serde_json::Value,
    #[serde(default, deserialize_with = "whole::opt_u16")]
    status: Option<u16>,
    reason: Option<String>,
}

#[derive(Serialize)]
pub(crate) struct RepliedBody {
    delivered: bool,
}

pub(crate) async fn reply(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<(Http, Json<RepliedBody>)> {
    let (edge, _) = edge(&state, &headers, Route::Messages)?;
    let b: ReplyBody = body(&bytes)?;
    reply_as(edge, b)?;
    Ok((Http::ACCEPTED, Json(RepliedBody { delivered: true })))
}

/// Hands `b` to the sender waiting for it.
pub(crate) fn reply_as(edge: &Edge, b: ReplyBody) -> ApiResult<()> {
    let status = StatusCode(b.status.unwrap_or(StatusCode::OK.0));
    if !(5001..=5099).contains(&status.0) {
        return Err(ApiError::bad_request("status is a Chorus code, 5001-5099"));
    }
    let delivered = edge.inbox.reply(
        b.in_reply_to,
        EdgeReply {
            status,
            reason: b.reason.unwrap_or_default(),
            payload: b.payload,
        },
    );
    if !delivered {
        return Err(ApiError::new(
            StatusCode::INVALID_ARGUMENT,
            format!("no request {} waits for a reply", b.in_reply_to),
        )
        .with_http(Http::NOT_FOUND));
    }
    Ok(())
}

impl ApiError {
    pub(crate) fn with_http(mut self, http: Http) -> Self {
        self.http = http;
        self
    }
}

// ---------------------------------------------------------------------------------------
// POST /v1/requests

/// A request: its payload a JSON value (`serde_json::Value`, from a WebSocket frame already
/// read), or the JSON text of an HTTP body as it came (`Option<&RawValue>`), which is sent on
/// without being parsed into a tree and written again.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RequestBody<P = serde_json::Value> {
    to: Option<String>,
    command: Option<String>,
    capability: Option<String>,
    #[serde(default)]
    payload: P,
    #[serde(default, deserialize_with = "whole::opt_u64")]
    timeout_ms: Option<u64>,
}

/// How a request's payload goes on the bus.
pub(crate) trait RequestPayload {
    /// `call` carrying this payload, as JSON.
    fn onto(&self, call: Call) -> ApiResult<Call>;
}

impl RequestPayload for serde_json::Value {
    fn onto(&self, call: Call) -> ApiResult<Call> {
        Ok(call.json_payload(self)?)
    }
}

/// The payload's text within the HTTP body `body` (it borrows from it: no copy).
pub(crate) struct RawPayload<'a> {
    body: &'a Bytes,
    raw: Option<&'a RawValue>,
}

impl RequestPayload for RawPayload<'_> {
    fn onto(&self, call: Call) -> ApiResult<Call> {
        let payload = match self.raw {
            Some(raw) => self.body.slice_ref(raw.get().as_bytes()),
            None => Bytes::from_static(b"null"),
        };
        Ok(call.raw_payload(payload, CONTENT_TYPE_JSON))
    }
}

#[derive(Serialize)]
pub(crate) struct ReplyView {
    pub(crate) status: u16,
    pub(crate) label: &'static str,
    pub(crate) from: String,
    /// The reply's payload as JSON text: a JSON payload as it came (checked to be JSON, not
    /// parsed into a tree), another encoding read and written as JSON.
    pub(crate) payload: Box<RawValue>,
}

pub(crate) fn timeout(state: &GatewayState, ms: Option<u64>) -> ApiResult<Duration> {
    let ms = ms.unwrap_or(state.config.request_timeout_ms);
    if ms == 0 || ms > state.config.max_request_timeout_ms {
        return Err(ApiError::bad_request(format!(
            "timeout_ms is between 1 and {}",
            state.config.max_request_timeout_ms
        )));
    }
    Ok(Duration::from_millis(ms))
}

/// Asks `call` with `payload` as `edge` and reads the reply's payload as JSON.
pub(crate) async fn ask(
    edge: &Edge,
    call: Call,
    payload: &impl RequestPayload,
) -> ApiResult<ReplyView> {
    let reply = edge.agent.call(payload.onto(call)?).await?;
    let unreadable = |e: &dyn std::fmt::Display| {
        ApiError::new(
            StatusCode::DATA_FORMAT,
            format!("the reply's payload does not read as JSON: {e}"),
        )
        .with_http(Http::BAD_GATEWAY)
    };
    let payload = if reply.payload().is_empty() {
        RawValue::NULL.to_owned()
    } else if reply.envelope.content_type.as_str() == CONTENT_TYPE_JSON {
        serde_json::from_slice::<&RawValue>(reply.payload())
            .map_err(|e| unreadable(&e))?
            .to_owned()
    } else {
        let value = reply
            .payload_as::<serde_json::Value>()
            .map_err(|e| unreadable(&e))?;
        serde_json::value::to_raw_value(&value).map_err(|e| unreadable(&e))?
    };
    Ok(ReplyView {
        status: reply.status().0,
        label: reply.status().label(),
        from: reply.envelope.from.into(),
        payload,
    })
}

pub(crate) async fn request(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Json<ReplyView>> {
    let (edge, credential) = edge(&state, &headers, Route::Requests)?;
    let b: RequestBody<Option<&RawValue>> = body_borrowed(&bytes)?;
    let payload = RawPayload {
        body: &bytes,
        raw: b.payload,
    };
    let b = RequestBody {
        payload,
        to: b.to,
        command: b.command,
        capability: b.capability,
        timeout_ms: b.timeout_ms,
    };
    Ok(Json(request_as(&state, edge, &credential, b).await?))
}

/// The call `to` with `command`, or `capability` (at `to` if given), names.
pub(crate) fn call_to(
    to: Option<&str>,
    command: Option<&str>,
    capability: Option<&str>,
) -> ApiResult<Call> {
    match (to, command, capability) {
        (Some(to), Some(command), None) => {
            Ok(Call::agent(name("to", to)?, name("command", command)?))
        }
        (None, None, Some(capability)) => Ok(Call::capability(dotted("capability", capability)?)),
        (Some(to), None, Some(capability)) => Ok(Call::capability_at(
            name("to", to)?,
            dotted("capability", capability)?,
        )),
        _ => Err(ApiError::bad_request(
            "give to with command, or capability (and to for one holder of it)",
        )),
    }
}

/// Asks what `b` names as `edge` and waits for the reply.
pub(crate) async fn request_as<P: RequestPayload>(
    state: &GatewayState,
    edge: &Edge,
    credential: &Credential,
    b: RequestBody<P>,
) -> ApiResult<ReplyView> {
    let (to, command, capability) = (
        b.to.as_deref(),
        b.command.as_deref(),
        b.capability.as_deref(),
    );
    let call = credential
        .call(to, command, capability)?
        .timeout(timeout(state, b.timeout_ms)?);
    ask(edge, call, &b.payload).await
}

/// `GET /openapi.json`.
pub(crate) async fn openapi(State(state): State<Arc<GatewayState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        state.openapi.clone(),
    )
}

/// Anything else: 404 in the same JSON shape.
pub(crate) async fn not_found() -> ApiError {
    ApiError::new(StatusCode::INVALID_ARGUMENT, "no such route").with_http(Http::NOT_FOUND)
}

/// A route asked with a method it does not take: 405 in the documented body.
pub(crate) async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError::new(
        StatusCode::INVALID_ARGUMENT,
        format!("this route does not take {method}"),
    )
    .with_http(Http::METHOD_NOT_ALLOWED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_an_http_status_that_says_the_same() {
        assert_eq!(http_status(StatusCode::OK), Http::OK);
        assert_eq!(http_status(StatusCode::UNAUTHORIZED), Http::UNAUTHORIZED);
        assert_eq!(http_status(StatusCode::ACCESS), Http::FORBIDDEN);
        assert_eq!(http_status(StatusCode::TIMEOUT), Http::GATEWAY_TIMEOUT);
        assert_eq!(http_status(StatusCode::NO_RESPONDERS), Http::NOT_FOUND);
        assert_eq!(
            http_status(StatusCode::RATE_LIMITED),
            Http::TOO_MANY_REQUESTS
        );
        assert_eq!(http_status(StatusCode::HANDLER_FAILED), Http::BAD_GATEWAY);
        assert_eq!(
            http_status(StatusCode::INTERNAL),
            Http::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn delivery_and_priority_refuse_unknown_words() {
        assert_eq!(delivery(None).ok(), Some(DeliveryClass::AtMostOnce));
        assert_eq!(
            delivery(Some("at_least_once")).ok(),
            Some(DeliveryClass::AtLeastOnce)
        );
        assert!(delivery(Some("twice")).is_err());
        assert!(priority(Some("urgent")).is_err());
    }
}
