//! `[gateway]` in the coordinator's configuration: where the gateway listens, who may call it
//! (edge identities, their API keys and the JWTs it accepts) and its limits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

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
/// WebSockets open at once.
pub const DEFAULT_MAX_WEBSOCKETS: usize = 256;
/// Clock skew allowed on a JWT's `exp` and `nbf`.
pub const DEFAULT_JWT_LEEWAY_SECS: u64 = 30;

/// The gateway's settings. Without `listen`, there is no gateway.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Where the HTTP gateway listens (for example `127.0.0.1:8480`); unset: no gateway.
    pub listen: Option<SocketAddr>,
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
    /// Requests handled at once (503 and 5019 beyond it).
    pub max_concurrent_requests: usize,
    /// WebSockets open at once (503 and 5008 beyond it).
    pub max_websockets: usize,
    /// The agent identities edge callers act as.
    pub identities: Vec<EdgeIdentity>,
    /// API keys, each for one identity.
    pub api_keys: Vec<ApiKey>,
    /// Bearer JWTs accepted, if any.
    pub jwt: Option<JwtConfig>,
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
}

/// An API key: only its SHA-256 is configured (`printf %s "$KEY" | sha256sum`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// The identity the key acts as.
    pub identity: String,
    /// The key's SHA-256, 64 hex digits.
    pub sha256: String,
}

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
    /// Clock skew allowed on `exp` and `nbf`, in seconds.
    #[serde(default = "default_leeway")]
    pub leeway_secs: u64,
}

fn default_leeway() -> u64 {
    DEFAULT_JWT_LEEWAY_SECS
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_wait_ms: DEFAULT_MAX_WAIT_MS,
            request_timeout_ms: DEFAULT_REQUEST_TIMEOUT_MS,
            max_request_timeout_ms: DEFAULT_MAX_REQUEST_TIMEOUT_MS,
            hold_ms: DEFAULT_HOLD_MS,
            inbox_capacity: DEFAULT_INBOX_CAPACITY,
            rate_per_second: DEFAULT_RATE_PER_SECOND,
            rate_burst: DEFAULT_RATE_BURST,
            max_concurrent_requests: DEFAULT_MAX_CONCURRENT_REQUESTS,
            max_websockets: DEFAULT_MAX_WEBSOCKETS,
            identities: Vec::new(),
            api_keys: Vec::new(),
            jwt: None,
        }
    }
}

fn invalid(what: String) -> Error {
    Error::new(ErrorKind::Config, format!("gateway: {what}"))
}

impl GatewayConfig {
    /// Checks values that parse but cannot work, naming the key.
    pub fn validate(&self) -> Result<()> {
        if self.listen.is_none() {
            return Ok(());
        }
        if self.max_body_bytes < 1024 {
            return Err(invalid("max_body_bytes must be at least 1024".into()));
        }
        if self.request_timeout_ms == 0 || self.request_timeout_ms > self.max_request_timeout_ms {
            return Err(invalid(
                "request_timeout_ms must be positive and at most max_request_timeout_ms".into(),
            ));
        }
        if self.hold_ms == 0 || self.inbox_capacity == 0 {
            return Err(invalid(
                "hold_ms and inbox_capacity must be positive".into(),
            ));
        }
        if self.identities.is_empty() {
            return Err(invalid(
                "no identities: add [[gateway.identities]] for the callers to act as".into(),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for identity in &self.identities {
            agent_sdk::subject::validate_token("identity", &identity.id)
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
        {
            return Err(invalid(
                "jwt: set hs256_secret_file or eddsa_public_key_file".into(),
            ));
        }
        if self.api_keys.is_empty() && self.jwt.is_none() {
            return Err(invalid(
                "no way to authenticate: add [[gateway.api_keys]] or [gateway.jwt]".into(),
            ));
        }
        Ok(())
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
