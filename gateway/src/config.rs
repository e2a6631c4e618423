//! `[gateway]` in the coordinator's configuration: where the gateway listens, who may call it
//! (edge identities, their API keys and the JWTs it accepts) and its limits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

/// `[circuit_breaker]`: after `failures` failures in a row to one destination, calls to it are
/// refused at once (5019, HTTP 503 at the gateway) for `open_ms`, then one may try again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitBreakerConfig {
    /// Failures in a row that open a destination's breaker.
    #[serde(default = "default_breaker_failures")]
    pub failures: u32,
    /// How long it stays open, in milliseconds.
    #[serde(default = "default_breaker_open_ms")]
    pub open_ms: u64,
}

fn default_breaker_failures() -> u32 {
    chorus_sdk::DEFAULT_BREAKER_FAILURES
}

fn default_breaker_open_ms() -> u64 {
    u64::try_from(chorus_sdk::DEFAULT_BREAKER_OPEN_FOR.as_millis()).unwrap_or(u64::MAX)
}

impl CircuitBreakerConfig {
    /// The SDK's policy.
    pub fn policy(&self) -> chorus_sdk::BreakerPolicy {
        chorus_sdk::BreakerPolicy::new(self.failures, Duration::from_millis(self.open_ms))
    }
}

/// The longest request body the gateway reads by default (1 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;
/// The longest a poll may wait for a message by default.
pub const DEFAULT_MAX_WAIT_MS: u64 = 30_000;
/// How long a request through the gateway waits for its reply unless the caller says.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 5_000;
/// The longest timeout a caller may ask for.
pub const DEFAULT_MAX_REQUEST_TIMEOUT_MS: u64 = 60_000;
/// How long a message to an edge identity is held for a poll before its sender is told 5019
/// (a durable one stays stored and is delivered again by its retry policy).
pub const DEFAULT_HOLD_MS: u64 = 30_000;
/// Messages held for one edge identity at once.
pub const DEFAULT_INBOX_CAPACITY: usize = 1_000;
/// Requests a second each edge identity may make, sustained.
pub const DEFAULT_RATE_PER_SECOND: f64 = 100.0;
/// Requests an edge identity may make at once, beyond its sustained rate.
pub const DEFAULT_RATE_BURST: f64 = 200.0;
/// Requests the gateway handles at once.
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = 1_024;
/// Requests without valid credentials handled at once (the public cards and documents, and
/// refusals).
pub const DEFAULT_MAX_UNAUTHENTICATED_REQUESTS: usize = 64;
/// Connections one peer may hold before any of them carried an authenticated request.
pub const DEFAULT_MAX_UNPROVEN_CONNECTIONS_PER_PEER: usize = 256;
/// WebSockets open at once.
pub const DEFAULT_MAX_WEBSOCKETS: usize = 256;
/// Clock skew allowed on a JWT's `exp` and `nbf`.
pub const DEFAULT_JWT_LEEWAY_SECS: u64 = 30;
/// The session an SAP binding serves unless it names one.
pub const DEFAULT_SAP_SESSION: &str = "default";
/// Seconds between an SAP binding's heartbeats.
pub const DEFAULT_SAP_HEARTBEAT_SECS: u64 = 10;
/// The longest an SAP prompt's task may run before the gateway cancels it (10 minutes, the
/// SAP client's own default ceiling).
pub const DEFAULT_SAP_MAX_PROMPT_MS: u64 = 600_000;

/// The gateway's settings. Without `listen` there is no HTTP gateway; without `listen` and
/// `sap`, no gateway at all.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Where the HTTP gateway listens (for example `127.0.0.1:8480`); unset: no gateway.
    pub listen: Option<SocketAddr>,
    /// HTTPS and WSS instead of plain HTTP. Without it, `listen` must be a loopback address
    /// unless `allow_plain_http` says otherwise.
    pub tls: Option<GatewayTls>,
    /// Plain HTTP on an address off loopback: API keys, tokens and payloads then cross the
    /// network in clear (a warning is logged). For a gateway behind a TLS-terminating proxy.
    pub allow_plain_http: bool,
    /// A2A agent cards served without credentials (every call still needs them), so a client
    /// can read from a card how to authenticate.
    pub public_cards: bool,
    /// The A2A agent whose card the gateway's own `/.well-known/agent-card.json` serves (the
    /// spec's well-known URI): `agents/<agent>/<command>` or `capabilities/<capability>`, as
    /// under `/a2a/`. Unset: that URI is 404 and only the per-agent cards exist.
    pub a2a_default: Option<String>,
    /// A2A push notifications: webhooks the gateway posts task updates to. Unset: none (the
    /// push methods answer -32003).
    pub push: Option<PushConfig>,
    /// The longest request body, in bytes (413 and 5006 beyond it).
    pub max_body_bytes: usize,
    /// The longest a poll (`GET /v1/messages?wait_ms=`) waits, in milliseconds.
    pub max_wait_ms: u64,
    /// A request's reply timeout when the caller gives none, in milliseconds.
    pub request_timeout_ms: u64,
    /// The longest reply timeout a caller may ask for, in milliseconds.
    pub max_request_timeout_ms: u64,
    /// How long a message to an edge identity waits for a poll, in milliseconds.
    pub hold_ms: u64,
    /// Messages held for one edge identity at once; beyond it senders get 5019.
    pub inbox_capacity: usize,
    /// Requests a second each identity may make, sustained (429 and 5013 beyond it).
    pub rate_per_second: f64,
    /// Requests an identity may make at once beyond its rate.
    pub rate_burst: f64,
    /// Requests handled at once for each identity, counted once its credentials check (503
    /// and 5019 beyond it).
    pub max_concurrent_requests: usize,
    /// Requests without valid credentials handled at once, in a pool of their own (503 and
    /// 5019 beyond it): the public cards and documents, and refusals.
    pub max_unauthenticated_requests: usize,
    /// Connections one peer (an IP address) may hold before any of them carried an
    /// authenticated request; one more closes its oldest such connection.
    pub max_unproven_connections_per_peer: usize,
    /// WebSockets open at once (503 and 5008 beyond it).
    pub max_websockets: usize,
    /// The agent identities edge callers act as.
    pub identities: Vec<EdgeIdentity>,
    /// API keys, each for one identity.
    pub api_keys: Vec<ApiKey>,
    /// Bearer JWTs accepted, if any.
    pub jwt: Option<JwtConfig>,
    /// Scopes credentials can carry; none: credentials reach everything.
    pub scopes: Vec<ScopeConfig>,
    /// Tenants: isolated parts of the bus, each under its own root.
    pub tenants: Vec<Tenant>,
    /// Chorus agents (or capabilities) offered as Synadia Agent Protocol 0.3 agents.
    pub sap: Vec<SapBinding>,
    /// The MCP server at `/mcp`.
    pub mcp: McpConfig,
    /// The web console (`docs/CONSOLE.md`): its own listener, the same credentials and TLS.
    pub console: ConsoleConfig,
}

/// How long an unused console session is kept by default (30 minutes).
pub const DEFAULT_CONSOLE_SESSION_IDLE_SECS: u64 = 1800;

/// `[gateway.console]`: the web console, served on its own address behind the gateway's
/// credentials (`[[gateway.api_keys]]`, `[gateway.jwt]`) and `[gateway.tls]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsoleConfig {
    /// Where the console listens (for example `127.0.0.1:8490`); unset: no console. Without
    /// `[gateway.tls]` it must be a loopback address unless `allow_plain_http` is set.
    pub listen: Option<SocketAddr>,
    /// How long a browser session unused is kept, in seconds.
    pub session_idle_secs: u64,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            listen: None,
            session_idle_secs: DEFAULT_CONSOLE_SESSION_IDLE_SECS,
        }
    }
}

/// The longest an MCP `tools/call` follows a task before answering that it still runs.
pub const DEFAULT_MCP_MAX_TASK_WAIT_MS: u64 = 600_000;
/// MCP sessions open at once.
pub const DEFAULT_MCP_MAX_SESSIONS: usize = 1024;
/// How long an unused MCP session is kept.
pub const DEFAULT_MCP_SESSION_IDLE_SECS: u64 = 3600;

/// `[gateway.mcp]`: the MCP server at `/mcp` (on whenever the gateway listens).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    /// Browser origins (`https://app.example.com`) allowed to call it besides this machine's
    /// own (`localhost`, loopback addresses); any other `Origin` is refused 403.
    pub allowed_origins: Vec<String>,
    /// Sessions open at once; an `initialize` beyond it is answered 503.
    pub max_sessions: usize,
    /// How long an unused session is kept, in seconds.
    pub session_idle_secs: u64,
    /// The longest a `tools/call` follows a task before answering that it still runs (the
    /// task goes on), in milliseconds.
    pub max_task_wait_ms: u64,
    /// The identity an MCP client without credentials acts as, for a local MCP host on this
    /// machine (a desktop assistant, an IDE). Only on a loopback listener; unset: every
    /// client needs credentials, as at every other route.
    pub anonymous_identity: Option<String>,
    /// The scopes such a client holds, when `[[gateway.scopes]]` are configured.
    pub anonymous_scopes: Vec<String>,
}

impl Default for McpConfig {
    fn default() -> Self {
        McpConfig {
            allowed_origins: Vec::new(),
            max_sessions: DEFAULT_MCP_MAX_SESSIONS,
            session_idle_secs: DEFAULT_MCP_SESSION_IDLE_SECS,
            max_task_wait_ms: DEFAULT_MCP_MAX_TASK_WAIT_MS,
            anonymous_identity: None,
            anonymous_scopes: Vec::new(),
        }
    }
}

/// The gateway's certificate, and optionally the CA whose client certificates it requires
/// (`[gateway.tls]`; `chorus certs --host <name>` makes a development CA and certificate).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayTls {
    /// PEM file of the certificate chain, the gateway's own first.
    pub cert_file: PathBuf,
    /// PEM file of its private key.
    pub key_file: PathBuf,
    /// PEM file of the CA that signs callers' client certificates: when set, a caller without
    /// one is refused during the handshake (mutual TLS).
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

/// `[gateway.push]`: where A2A push notifications may go, and how hard the gateway tries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PushConfig {
    /// Webhook URLs a client may register, as prefixes (`https://hooks.example.com/a2a/`):
    /// a webhook must have the same scheme, host and port and a path under one. Nothing else
    /// is ever requested (no internal addresses a client names).
    pub allow: Vec<String>,
    /// Deliveries of one update before it is dead-lettered.
    pub max_attempts: u32,
    /// The wait before the second delivery, in milliseconds; it doubles each time.
    pub first_backoff_ms: u64,
    /// The longest wait between deliveries, in milliseconds.
    pub max_backoff_ms: u64,
    /// How long one delivery may take, in milliseconds.
    pub timeout_ms: u64,
    /// A file holding the secret deliveries are signed with (HMAC-SHA256 of
    /// `<timestamp>.<body>` in `X-Chorus-Signature: sha256=<hex>`, with
    /// `X-Chorus-Timestamp`). Unset: deliveries are not signed.
    pub signing_secret_file: Option<PathBuf>,
    /// PEM file of CAs trusted for `https` webhooks besides the system's.
    pub ca_file: Option<PathBuf>,
    /// Push configs one task may have.
    pub max_configs_per_task: usize,
}

impl Default for PushConfig {
    fn default() -> Self {
        PushConfig {
            allow: Vec::new(),
            max_attempts: 5,
            first_backoff_ms: 500,
            max_backoff_ms: 30_000,
            timeout_ms: 10_000,
            signing_secret_file: None,
            ca_file: None,
            max_configs_per_task: 10,
        }
    }
}

impl PushConfig {
    fn validate(&self) -> Result<()> {
        if self.allow.is_empty() {
            return Err(invalid(
                "[gateway.push] allow: give the webhook URL prefixes clients may register".into(),
            ));
        }
        for prefix in &self.allow {
            crate::webhook::Webhook::prefix(prefix)
                .map_err(|e| invalid(format!("[gateway.push] allow {prefix:?}: {e}")))?;
        }
        if self.max_attempts == 0 || self.timeout_ms == 0 || self.max_configs_per_task == 0 {
            return Err(invalid(
                "[gateway.push] max_attempts, timeout_ms and max_configs_per_task must be positive"
                    .into(),
            ));
        }
        if self.first_backoff_ms > self.max_backoff_ms {
            return Err(invalid(
                "[gateway.push] first_backoff_ms must be at most max_backoff_ms".into(),
            ));
        }
        Ok(())
    }
}

/// One Synadia Agent Protocol 0.3 agent the gateway registers (an `agents` micro service
/// with `prompt` and `status` endpoints and `agents.hb` heartbeats): each prompt becomes a
/// task of the Chorus command `to`/`command` (or of `capability`), submitted as `identity`,
/// and its chunks and result stream back as the SAP response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SapBinding {
    /// The SAP agent name: lowercase letters, digits and hyphens.
    pub agent: String,
    /// Who runs it: lowercase letters, digits, `_` and `-`.
    pub owner: String,
    /// The session it serves (the fifth token of its subjects).
    #[serde(default = "default_sap_session")]
    pub session: String,
    /// The edge identity the tasks are submitted as (one of `identities`).
    pub identity: String,
    /// The Chorus agent whose `command` runs each prompt.
    #[serde(default)]
    pub to: Option<String>,
    /// The command of `to`.
    #[serde(default)]
    pub command: Option<String>,
    /// Or: the capability any of whose holders runs each prompt.
    #[serde(default)]
    pub capability: Option<String>,
    /// What the SAP client shows as the agent's description.
    #[serde(default)]
    pub description: Option<String>,
    /// Seconds between heartbeats on `agents.hb.<agent>.<owner>.<session>`.
    #[serde(default = "default_sap_heartbeat")]
    pub heartbeat_interval_s: u64,
    /// The longest a prompt's task may run, in milliseconds: then it is cancelled and the
    /// prompt answered 504.
    #[serde(default = "default_sap_max_prompt")]
    pub max_prompt_ms: u64,
}

fn default_sap_session() -> String {
    DEFAULT_SAP_SESSION.to_owned()
}

fn default_sap_heartbeat() -> u64 {
    DEFAULT_SAP_HEARTBEAT_SECS
}

fn default_sap_max_prompt() -> u64 {
    DEFAULT_SAP_MAX_PROMPT_MS
}

/// Whether `token` is made only of lowercase ASCII letters, digits and the `extra` characters.
fn sap_token(token: &str, extra: &str) -> bool {
    !token.is_empty()
        && token
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || extra.contains(c))
}

impl SapBinding {
    fn validate(&self, identities: &std::collections::HashSet<&str>) -> Result<()> {
        let name = format!("sap {}.{}.{}", self.agent, self.owner, self.session);
        if !sap_token(&self.agent, "-") {
            return Err(invalid(format!(
                "{name}: agent takes lowercase letters, digits and hyphens"
            )));
        }
        if !sap_token(&self.owner, "-_") || !sap_token(&self.session, "-_") {
            return Err(invalid(format!(
                "{name}: owner and session take lowercase letters, digits, '_' and '-'"
            )));
        }
        if !identities.contains(self.identity.as_str()) {
            return Err(invalid(format!(
                "{name}: identity {} is not in identities",
                self.identity
            )));
        }
        match (&self.to, &self.command, &self.capability) {
            (Some(to), Some(command), None) => {
                chorus_sdk::subject::validate_token("to", to)
                    .and_then(|()| chorus_sdk::subject::validate_token("command", command))
                    .map_err(|e| invalid(format!("{name}: {e}")))?;
            }
            (None, None, Some(capability)) => {
                chorus_sdk::subject::validate_dotted("capability", capability)
                    .map_err(|e| invalid(format!("{name}: {e}")))?;
            }
            _ => {
                return Err(invalid(format!(
                    "{name}: give to with command, or capability"
                )));
            }
        }
        if self.heartbeat_interval_s == 0 || self.max_prompt_ms == 0 {
            return Err(invalid(format!(
                "{name}: heartbeat_interval_s and max_prompt_ms must be positive"
            )));
        }
        Ok(())
    }
}

/// An agent identity an edge caller acts as: messages it sends are from this id, and
/// messages sent to this id wait at the gateway for its polls.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeIdentity {
    /// The agent id.
    pub id: String,
    /// File holding the identity's nkey seed (`chorus creds`): its connection authenticates
    /// and its messages are signed with it. Unset: the coordinator's connection settings,
    /// unsigned messages.
    #[serde(default)]
    pub nkey_seed_file: Option<PathBuf>,
    /// The tenant it belongs to (a `[[gateway.tenants]]` name): it then lives under the
    /// tenant's root, and its callers reach that tenant's agents and tasks only.
    #[serde(default)]
    pub tenant: Option<String>,
}

/// `[[gateway.tenants]]`: an isolated part of the bus, as A2A's `tenant` names it. A tenant
/// has its own subject root, so its own registry, tasks and streams (its agents run under that
/// root, with a coordinator of their own for discovery); the identities that belong to it reach
/// nothing outside it, and nothing outside reaches in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    /// Its name, as A2A requests carry it (`tenant`, or the REST path's first segment).
    pub name: String,
    /// Its subject root.
    pub root: String,
}

/// An API key: only its SHA-256 is configured (`printf %s "$KEY" | sha256sum`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// The identity the key acts as.
    pub identity: String,
    /// The key's SHA-256, 64 hex digits.
    pub sha256: String,
    /// The scopes the key carries (names of `[[gateway.scopes]]`); checked only when the
    /// gateway has scopes.
    #[serde(default)]
    pub scopes: Vec<String>,
}

pub use crate::scopes::ScopeConfig;

/// Which JWTs the gateway accepts as bearer tokens: signed with HS256 by the shared secret or
/// with EdDSA (Ed25519) by the public key's private half, from `issuer` for `audience`,
/// not expired. The `sub` claim names the identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// The `iss` a token must carry.
    pub issuer: String,
    /// The `aud` a token must carry.
    pub audience: String,
    /// File holding the HS256 secret (its bytes, trailing newline removed).
    #[serde(default)]
    pub hs256_secret_file: Option<PathBuf>,
    /// PEM file of the Ed25519 public key EdDSA tokens are checked with.
    #[serde(default)]
    pub eddsa_public_key_file: Option<PathBuf>,
    /// A JSON Web Key Set file, as an OAuth 2 / OIDC provider publishes its signing keys
    /// (RS256/384/512, PS256/384/512, ES256/384 and EdDSA public keys, each with its `kid`): a
    /// token names its key in its header's `kid`. The file is read again when it changes, so
    /// rotating keys needs no restart.
    #[serde(default)]
    pub jwks_file: Option<PathBuf>,
    /// The identity provider's key set URL (its `jwks_uri`; `https`, or `http` on loopback):
    /// fetched at start, again every `jwks_refresh_secs`, and soon after a token names a key
    /// it does not have (a rotation), at most once every ten seconds.
    #[serde(default)]
    pub jwks_url: Option<String>,
    /// How often the key set at `jwks_url` is fetched again, in seconds.
    #[serde(default = "default_jwks_refresh")]
    pub jwks_refresh_secs: u64,
    /// PEM file of CAs trusted for `jwks_url` besides the system's.
    #[serde(default)]
    pub jwks_ca_file: Option<PathBuf>,
    /// Clock skew allowed on `exp` and `nbf`, in seconds.
    #[serde(default = "default_leeway")]
    pub leeway_secs: u64,
    /// Where a client gets a token (an OAuth 2 client-credentials token endpoint, `https`):
    /// the cards then declare an `oauth2` scheme with this flow beside the bearer scheme.
    #[serde(default)]
    pub token_url: Option<String>,
    /// The issuer's OAuth 2 authorization server metadata (RFC 8414, `https`), declared in
    /// the `oauth2` scheme as `oauth2MetadataUrl`.
    #[serde(default)]
    pub metadata_url: Option<String>,
}

impl Default for JwtConfig {
    fn default() -> Self {
        JwtConfig {
            issuer: String::new(),
            audience: String::new(),
            hs256_secret_file: None,
            eddsa_public_key_file: None,
            jwks_file: None,
            jwks_url: None,
            jwks_refresh_secs: DEFAULT_JWKS_REFRESH_SECS,
            jwks_ca_file: None,
            leeway_secs: DEFAULT_JWT_LEEWAY_SECS,
            token_url: None,
            metadata_url: None,
        }
    }
}

impl JwtConfig {
    /// The OAuth 2 URLs, when given, are `https` URLs; a key set URL is `https`, or `http` on
    /// a loopback address; one key set source at most.
    fn validate(&self) -> Result<()> {
        if let Some(url) = &self.jwks_url {
            if self.jwks_file.is_some() {
                return Err(invalid(
                    "[gateway.jwt] give jwks_file or jwks_url, not both".into(),
                ));
            }
            let parsed = url::Url::parse(url)
                .map_err(|e| invalid(format!("[gateway.jwt] jwks_url {url:?}: {e}")))?;
            let loopback = match parsed.host() {
                Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
                Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
                Some(url::Host::Domain(d)) => d == "localhost",
                None => false,
            };
            if !(parsed.scheme() == "https" || (parsed.scheme() == "http" && loopback)) {
                return Err(invalid(format!(
                    "[gateway.jwt] jwks_url {url:?}: https (plain http only on loopback)"
                )));
            }
            if self.jwks_refresh_secs == 0 {
                return Err(invalid(
                    "[gateway.jwt] jwks_refresh_secs must be positive".into(),
                ));
            }
        }
        for (name, url) in [
            ("token_url", &self.token_url),
            ("metadata_url", &self.metadata_url),
        ] {
            if let Some(url) = url
                && !url::Url::parse(url).is_ok_and(|u| u.scheme() == "https" && u.host().is_some())
            {
                return Err(invalid(format!(
                    "[gateway.jwt] {name} {url:?}: an https URL"
                )));
            }
        }
        Ok(())
    }
}

fn default_leeway() -> u64 {
    DEFAULT_JWT_LEEWAY_SECS
}

/// How often a key set URL is fetched again unless a token asks sooner, in seconds.
pub const DEFAULT_JWKS_REFRESH_SECS: u64 = 300;

fn default_jwks_refresh() -> u64 {
    DEFAULT_JWKS_REFRESH_SECS
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: None,
            tls: None,
            allow_plain_http: false,
            public_cards: false,
            a2a_default: None,
            push: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_wait_ms: DEFAULT_MAX_WAIT_MS,
            request_timeout_ms: DEFAULT_REQUEST_TIMEOUT_MS,
            max_request_timeout_ms: DEFAULT_MAX_REQUEST_TIMEOUT_MS,
            hold_ms: DEFAULT_HOLD_MS,
            inbox_capacity: DEFAULT_INBOX_CAPACITY,
            rate_per_second: DEFAULT_RATE_PER_SECOND,
            rate_burst: DEFAULT_RATE_BURST,
            max_concurrent_requests: DEFAULT_MAX_CONCURRENT_REQUESTS,
            max_unauthenticated_requests: DEFAULT_MAX_UNAUTHENTICATED_REQUESTS,
            max_unproven_connections_per_peer: DEFAULT_MAX_UNPROVEN_CONNECTIONS_PER_PEER,
            max_websockets: DEFAULT_MAX_WEBSOCKETS,
            identities: Vec::new(),
            api_keys: Vec::new(),
            scopes: Vec::new(),
            tenants: Vec::new(),
            jwt: None,
            sap: Vec::new(),
            mcp: McpConfig::default(),
            console: ConsoleConfig::default(),
        }
    }
}

fn invalid(what: String) -> Error {
    Error::new(ErrorKind::Config, format!("gateway: {what}"))
}

impl GatewayConfig {
    /// Checks values that parse but cannot work, naming the key.
    ///
    /// # Errors
    /// A configuration error naming the first key that cannot work: a limit out of range, a
    /// missing, repeated or malformed identity, a bad API key, a JWT without a key file, a bad SAP
    /// binding, or a listener with no way to authenticate.
    pub fn validate(&self) -> Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        if let Some(push) = &self.push {
            push.validate()?;
        }
        if self.mcp.max_sessions == 0
            || self.mcp.session_idle_secs == 0
            || self.mcp.max_task_wait_ms == 0
        {
            return Err(invalid(
                "[gateway.mcp] max_sessions, session_idle_secs and max_task_wait_ms are positive"
                    .into(),
            ));
        }
        if let Some(anonymous) = &self.mcp.anonymous_identity {
            if !self.identities.iter().any(|i| &i.id == anonymous) {
                return Err(invalid(format!(
                    "[gateway.mcp] anonymous_identity {anonymous:?} is not one of [[gateway.identities]]"
                )));
            }
            if !self.listen.is_some_and(|a| a.ip().is_loopback()) {
                return Err(invalid(
                    "[gateway.mcp] anonymous_identity needs a loopback listen address: clients \
                     without credentials are taken only from this machine"
                        .into(),
                ));
            }
        }
        if let Some(jwt) = &self.jwt {
            jwt.validate()?;
        }
        let mut tenants = std::collections::HashSet::new();
        for tenant in &self.tenants {
            chorus_sdk::subject::validate_token("tenant", &tenant.name)
                .map_err(|e| invalid(format!("[[gateway.tenants]] {:?}: {e}", tenant.name)))?;
            chorus_sdk::Subjects::new(&tenant.root).map_err(|e| {
                invalid(format!(
                    "[[gateway.tenants]] {}: root {:?}: {e}",
                    tenant.name, tenant.root
                ))
            })?;
            if !tenants.insert(tenant.name.as_str()) {
                return Err(invalid(format!(
                    "[[gateway.tenants]] {} is given twice",
                    tenant.name
                )));
            }
        }
        if let Some(identity) = self
            .identities
            .iter()
            .find(|i| i.tenant.as_deref().is_some_and(|t| !tenants.contains(t)))
        {
            return Err(invalid(format!(
                "identity {}: tenant {:?} is not in [[gateway.tenants]]",
                identity.id,
                identity.tenant.as_deref().unwrap_or_default()
            )));
        }
        let mut names = std::collections::HashSet::new();
        for scope in &self.scopes {
            if scope.name.is_empty() || scope.name.chars().any(char::is_whitespace) {
                return Err(invalid(format!(
                    "[[gateway.scopes]] name {:?}: one word, as a token's scope claim carries it",
                    scope.name
                )));
            }
            if !names.insert(scope.name.as_str()) {
                return Err(invalid(format!(
                    "[[gateway.scopes]] {} is given twice",
                    scope.name
                )));
            }
            let known = crate::scopes::Route::ALL.map(crate::scopes::Route::name);
            if let Some(route) = scope
                .routes
                .iter()
                .find(|r| *r != "*" && !known.contains(&r.as_str()))
            {
                return Err(invalid(format!(
                    "[[gateway.scopes]] {}: route {route:?} is not one of {}, or *",
                    scope.name,
                    known.join(", ")
                )));
            }
        }
        for key in &self.api_keys {
            if let Some(unknown) = key.scopes.iter().find(|s| !names.contains(s.as_str())) {
                return Err(invalid(format!(
                    "api key of {}: scope {unknown:?} is not in [[gateway.scopes]]",
                    key.identity
                )));
            }
        }
        if let Some(default) = &self.a2a_default {
            a2a_path(default).map_err(|e| invalid(format!("a2a_default {default:?}: {e}")))?;
        }
        if self.max_body_bytes < 1024 {
            return Err(invalid("max_body_bytes must be at least 1024".into()));
        }
        if self.request_timeout_ms == 0 || self.request_timeout_ms > self.max_request_timeout_ms {
            return Err(invalid(
                "request_timeout_ms must be positive and at most max_request_timeout_ms".into(),
            ));
        }
        if self.max_concurrent_requests == 0
            || self.max_unauthenticated_requests == 0
            || self.max_unproven_connections_per_peer == 0
        {
            return Err(invalid(
                "max_concurrent_requests, max_unauthenticated_requests and \
                 max_unproven_connections_per_peer must be positive"
                    .into(),
            ));
        }
        if self.hold_ms == 0 || self.inbox_capacity == 0 {
            return Err(invalid(
                "hold_ms and inbox_capacity must be positive".into(),
            ));
        }
        if self.console.session_idle_secs == 0 {
            return Err(invalid(
                "[gateway.console] session_idle_secs must be positive".into(),
            ));
        }
        if let Some(listen) = self.console.listen
            && self.tls.is_none()
            && !listen.ip().is_loopback()
            && !self.allow_plain_http
        {
            return Err(invalid(format!(
                "[gateway.console] listen {listen} is off loopback without TLS: add \
                 [gateway.tls] with cert_file and key_file, or set allow_plain_http = true \
                 behind a proxy that terminates TLS"
            )));
        }
        if let (Some(console), Some(listen)) = (self.console.listen, self.listen)
            && console == listen
            && console.port() != 0
        {
            return Err(invalid(format!(
                "[gateway.console] listen {console} is the gateway's own listen address: give \
                 the console an address of its own"
            )));
        }
        if let Some(listen) = self.listen
            && self.tls.is_none()
            && !listen.ip().is_loopback()
            && !self.allow_plain_http
        {
            return Err(invalid(format!(
                "listen {listen} is off loopback without TLS: add [gateway.tls] with cert_file \
                 and key_file (`chorus certs --host <name>` makes a development certificate), or \
                 set allow_plain_http = true behind a proxy that terminates TLS"
            )));
        }
        if self.identities.is_empty() {
            return Err(invalid(
                "no identities: add [[gateway.identities]] for the callers to act as".into(),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for identity in &self.identities {
            chorus_sdk::subject::validate_token("identity", &identity.id)
                .map_err(|e| invalid(format!("identities: {e}")))?;
            if !seen.insert(identity.id.as_str()) {
                return Err(invalid(format!("identities: {} twice", identity.id)));
            }
        }
        for key in &self.api_keys {
            if !seen.contains(key.identity.as_str()) {
                return Err(invalid(format!(
                    "api_keys: identity {} is not in identities",
                    key.identity
                )));
            }
            if key.sha256.len() != 64 || hex::decode(&key.sha256).is_err() {
                return Err(invalid(format!(
                    "api_keys: the sha256 of {}'s key is not 64 hex digits",
                    key.identity
                )));
            }
        }
        if let Some(jwt) = &self.jwt
            && jwt.hs256_secret_file.is_none()
            && jwt.eddsa_public_key_file.is_none()
            && jwt.jwks_file.is_none()
            && jwt.jwks_url.is_none()
        {
            return Err(invalid(
                "jwt: set hs256_secret_file, eddsa_public_key_file, jwks_file or jwks_url".into(),
            ));
        }
        let mut sap = std::collections::HashSet::new();
        for binding in &self.sap {
            binding.validate(&seen)?;
            if !sap.insert((&binding.agent, &binding.owner, &binding.session)) {
                return Err(invalid(format!(
                    "sap {}.{}.{} twice",
                    binding.agent, binding.owner, binding.session
                )));
            }
        }
        if (self.listen.is_some() || self.console.listen.is_some())
            && self.api_keys.is_empty()
            && self.jwt.is_none()
        {
            return Err(invalid(
                "no way to authenticate: add [[gateway.api_keys]] or [gateway.jwt]".into(),
            ));
        }
        Ok(())
    }

    /// Whether the gateway runs: it listens for HTTP, offers SAP agents or serves the console
    /// (the console may run alone, without the HTTP API).
    pub fn enabled(&self) -> bool {
        self.listen.is_some() || !self.sap.is_empty() || self.console.listen.is_some()
    }

    /// The longest poll wait.
    pub fn max_wait(&self) -> Duration {
        Duration::from_millis(self.max_wait_ms)
    }

    /// How long a message waits for a poll.
    pub fn hold(&self) -> Duration {
        Duration::from_millis(self.hold_ms)
    }
}

/// An A2A endpoint under `/a2a/`, as `a2a_default` names it: the agent and command, or the
/// capability.
pub(crate) fn a2a_path(path: &str) -> std::result::Result<Target, String> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    match parts.as_slice() {
        ["agents", agent, command] => {
            chorus_sdk::subject::validate_token("agent", agent)
                .and_then(|()| chorus_sdk::subject::validate_token("command", command))
                .map_err(|e| e.to_string())?;
            Ok(Target::Command {
                agent: (*agent).to_owned(),
                command: (*command).to_owned(),
            })
        }
        ["capabilities", capability] => {
            chorus_sdk::subject::validate_dotted("capability", capability)
                .map_err(|e| e.to_string())?;
            Ok(Target::Capability((*capability).to_owned()))
        }
        _ => Err("give agents/<agent>/<command> or capabilities/<capability>".into()),
    }
}

/// What an edge endpoint stands for: one agent's command, or a capability (an A2A endpoint
/// under `/a2a/`, as [`a2a_path`] reads it; an MCP tool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    Command { agent: String, command: String },
    Capability(String),
}

impl Target {
    /// Its names as the gateway's routes take them: `to`, `command`, `capability`.
    pub(crate) fn names(&self) -> (Option<&str>, Option<&str>, Option<&str>) {
        match self {
            Target::Command { agent, command } => (Some(agent), Some(command), None),
            Target::Capability(c) => (None, None, Some(c)),
        }
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
