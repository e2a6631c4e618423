//! Who is calling: an API key (`X-API-Key: <key>` or `Authorization: Bearer <key>`) or a
//! bearer JWT (HS256 or EdDSA), each mapped to one configured edge identity. Nothing reaches
//! the bus before this says who the caller is.

use std::collections::HashSet;

use axum::http::HeaderMap;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::config::GatewayConfig;
use crate::error::{Error, ErrorKind, Result};

/// The identity a request acts as, and the JWT it came with (relayed in the envelope's
/// `token` for agents that require one; an API key is never relayed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Caller {
    pub(crate) identity: String,
    pub(crate) token: Option<String>,
    /// The scopes the credentials carry (a JWT's `scope`/`scp` claims, an API key's `scopes`).
    pub(crate) scopes: Vec<String>,
}

/// Why a request was refused before it reached the bus (401 with 5014, or 5004 for an
/// identity the gateway does not serve).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AuthError {
    #[error("no credentials: send Authorization: Bearer <token> or X-API-Key")]
    Missing,
    #[error("the API key is not known")]
    UnknownKey,
    #[error("the token has expired")]
    Expired,
    #[error("the token is not valid: {0}")]
    InvalidToken(String),
    #[error("the token's subject {0:?} is not an identity of this gateway")]
    UnknownIdentity(String),
}

#[derive(Debug, Deserialize)]
struct Claims {
    sub: String,
    #[serde(default)]
    scope: Option<serde_json::Value>,
    #[serde(default)]
    scp: Option<serde_json::Value>,
}

/// One kind of JWT the gateway accepts.
struct JwtKey {
    key: DecodingKey,
    validation: Validation,
}

/// Where a key set comes from.
enum JwksSource {
    /// A file, read again when it changes.
    File(std::path::PathBuf),
    /// A URL, fetched by [`Jwks::refresh`] (a task the gateway runs) now and then, and soon
    /// after a token names a key the set lacks.
    Url {
        url: url::Url,
        client: reqwest::Client,
        every: std::time::Duration,
        /// Woken when a token names a key the set lacks.
        wanted: tokio::sync::Notify,
    },
}

/// The keys of a JSON Web Key Set, by `kid`.
pub(crate) struct Jwks {
    source: JwksSource,
    issuer: String,
    audience: String,
    leeway: u64,
    state: std::sync::Mutex<JwksState>,
}

/// The longest key set document fetched.
const MAX_JWKS_BYTES: usize = 1 << 20;
/// The shortest wait between two fetches a token asked for.
const MIN_REFETCH: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Default)]
struct JwksState {
    /// The file's modification time and length when it was last read.
    stamp: Option<(std::time::SystemTime, u64)>,
    keys: std::collections::HashMap<String, std::sync::Arc<JwtKey>>,
}

impl Jwks {
    /// The key `kid` names, from the file as it is now (a changed file is read again; one that
    /// no longer reads keeps the keys read before, and says why once).
    fn key(&self, kid: &str) -> Option<std::sync::Arc<JwtKey>> {
        let path = match &self.source {
            JwksSource::File(path) => path,
            JwksSource::Url { wanted, .. } => {
                let found = self
                    .state
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .keys
                    .get(kid)
                    .cloned();
                if found.is_none() {
                    // A key the set lacks: perhaps rotated in; fetch again soon.
                    wanted.notify_one();
                }
                return found;
            }
        };
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let stamp = std::fs::metadata(path)
            .ok()
            .map(|m| (m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len()));
        if stamp.is_some() && stamp != state.stamp {
            state.stamp = stamp;
            match std::fs::read(path)
                .map_err(|e| e.to_string())
                .and_then(|bytes| self.parse(&bytes))
            {
                Ok(keys) => {
                    tracing::info!(file = %path.display(), keys = keys.len(), "gateway: JWKS read");
                    state.keys = keys;
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "gateway: JWKS unreadable; keeping the keys read before");
                }
            }
        }
        state.keys.get(kid).cloned()
    }

    /// Fetches the key set at its URL now and then until `stop`: at once, every `every`, and
    /// when a token names a key the set lacks (at most once every [`MIN_REFETCH`]). A fetch
    /// that fails keeps the keys fetched before, and says why.
    pub(crate) async fn refresh(
        self: std::sync::Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let JwksSource::Url {
            url,
            client,
            every,
            wanted,
        } = &self.source
        else {
            return;
        };
        loop {
            match self.fetch(client, url).await {
                Ok(keys) => {
                    tracing::debug!(%url, keys = keys.len(), "gateway: JWKS fetched");
                    self.state
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .keys = keys;
                }
                Err(e) => {
                    tracing::warn!(%url, error = %e, "gateway: JWKS not fetched; keeping the keys fetched before");
                }
            }
            // Not again before MIN_REFETCH, whatever tokens ask; then at `every`, or sooner
            // when a token names an unknown key.
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(MIN_REFETCH.min(*every)) => {}
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(every.saturating_sub(MIN_REFETCH)) => {}
                () = wanted.notified() => {}
            }
        }
    }

    async fn fetch(
        &self,
        client: &reqwest::Client,
        url: &url::Url,
    ) -> std::result::Result<std::collections::HashMap<String, std::sync::Arc<JwtKey>>, String>
    {
        let mut answer = client
            .get(url.clone())
            .header("accept", "application/json")
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !answer.status().is_success() {
            return Err(format!("HTTP {}", answer.status()));
        }
        let mut body = Vec::new();
        while let Some(chunk) = answer.chunk().await.map_err(|e| e.to_string())? {
            if body.len() + chunk.len() > MAX_JWKS_BYTES {
                return Err(format!("larger than {MAX_JWKS_BYTES} bytes"));
            }
            body.extend_from_slice(&chunk);
        }
        self.parse(&body)
    }

    fn parse(
        &self,
        bytes: &[u8],
    ) -> std::result::Result<std::collections::HashMap<String, std::sync::Arc<JwtKey>>, String>
    {
        let set: jsonwebtoken::jwk::JwkSet =
            serde_json::from_slice(bytes).map_err(|e| format!("not a JWK set: {e}"))?;
        let mut keys = std::collections::HashMap::new();
        for jwk in &set.keys {
            let Some(kid) = jwk.common.key_id.clone() else {
                continue;
            };
            let Some(alg) = jwk_algorithm(jwk) else {
                tracing::warn!(
                    kid,
                    "gateway: JWKS key of an algorithm not accepted; skipped"
                );
                continue;
            };
            let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("key {kid}: {e}"))?;
            keys.insert(
                kid,
                std::sync::Arc::new(JwtKey {
                    key,
                    validation: validation(&self.issuer, &self.audience, self.leeway, alg),
                }),
            );
        }
        Ok(keys)
    }
}

/// The one algorithm a published key may verify: its `alg`, or the one its type implies.
/// Symmetric (`oct`) keys are refused: a shared secret has no place in a published key set.
fn jwk_algorithm(jwk: &jsonwebtoken::jwk::Jwk) -> Option<Algorithm> {
    use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve};
    let implied = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => Algorithm::ES256,
            EllipticCurve::P384 => Algorithm::ES384,
            _ => return None,
        },
        AlgorithmParameters::OctetKeyPair(_) => Algorithm::EdDSA,
        // Symmetric keys, and kinds a later version adds.
        _ => return None,
    };
    let Some(named) = jwk.common.key_algorithm else {
        return Some(implied);
    };
    let alg: Algorithm = named.to_string().parse().ok()?;
    // The named algorithm must be one the key's type can verify.
    let family = |a: Algorithm| match a {
        Algorithm::RS256
        | Algorithm::RS384
        | Algorithm::RS512
        | Algorithm::PS256
        | Algorithm::PS384
        | Algorithm::PS512 => 1,
        Algorithm::ES256 | Algorithm::ES384 => 2,
        Algorithm::EdDSA => 3,
        _ => 0,
    };
    (family(alg) != 0 && family(alg) == family(implied)).then_some(alg)
}

/// What a token must carry to be accepted with algorithm `alg`.
fn validation(issuer: &str, audience: &str, leeway: u64, alg: Algorithm) -> Validation {
    let mut v = Validation::new(alg);
    v.set_issuer(&[issuer]);
    v.set_audience(&[audience]);
    v.set_required_spec_claims(&["exp", "sub", "iss", "aud"]);
    v.leeway = leeway;
    v.validate_nbf = true;
    v
}

/// Checks credentials against the gateway's configuration.
pub(crate) struct Authenticator {
    /// SHA-256 of each key, with its identity.
    api_keys: Vec<([u8; 32], String, Vec<String>)>,
    hs256: Option<JwtKey>,
    eddsa: Option<JwtKey>,
    jwks: Option<std::sync::Arc<Jwks>>,
    identities: HashSet<String>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("api_keys", &self.api_keys.len())
            .field("hs256", &self.hs256.is_some())
            .field("eddsa", &self.eddsa.is_some())
            .field(
                "jwks",
                &self.jwks.as_ref().map(|j| match &j.source {
                    JwksSource::File(path) => path.display().to_string(),
                    JwksSource::Url { url, .. } => url.to_string(),
                }),
            )
            .finish_non_exhaustive()
    }
}

fn read_file(path: &std::path::Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(Error::wrap(
        ErrorKind::Io,
        format!("gateway: cannot read the {what} {}", path.display()),
    ))
}

impl Authenticator {
    /// Reads the keys `config` names.
    pub(crate) fn new(config: &GatewayConfig) -> Result<Authenticator> {
        let mut api_keys = Vec::new();
        for key in &config.api_keys {
            let mut digest = [0u8; 32];
            hex::decode_to_slice(&key.sha256, &mut digest).map_err(|_| {
                Error::new(
                    ErrorKind::Config,
                    format!("gateway: api key of {} is not hex", key.identity),
                )
            })?;
            api_keys.push((digest, key.identity.clone(), key.scopes.clone()));
        }
        let (mut hs256, mut eddsa, mut jwks) = (None, None, None);
        if let Some(jwt) = &config.jwt {
            let validation =
                |alg: Algorithm| validation(&jwt.issuer, &jwt.audience, jwt.leeway_secs, alg);
            if let Some(url) = &jwt.jwks_url {
                let url = url::Url::parse(url).map_err(|e| {
                    Error::new(ErrorKind::Config, format!("gateway: jwt.jwks_url: {e}"))
                })?;
                let client = crate::https::client(
                    jwt.jwks_ca_file.as_deref(),
                    std::time::Duration::from_secs(10),
                )
                .map_err(|e| {
                    Error::new(ErrorKind::Config, format!("gateway: jwt.jwks_ca_file {e}"))
                })?;
                jwks = Some(std::sync::Arc::new(Jwks {
                    source: JwksSource::Url {
                        url,
                        client,
                        every: std::time::Duration::from_secs(jwt.jwks_refresh_secs),
                        wanted: tokio::sync::Notify::new(),
                    },
                    issuer: jwt.issuer.clone(),
                    audience: jwt.audience.clone(),
                    leeway: jwt.leeway_secs,
                    state: std::sync::Mutex::default(),
                }));
            }
            if let Some(path) = &jwt.jwks_file {
                let set = Jwks {
                    source: JwksSource::File(path.clone()),
                    issuer: jwt.issuer.clone(),
                    audience: jwt.audience.clone(),
                    leeway: jwt.leeway_secs,
                    state: std::sync::Mutex::default(),
                };
                // Read once at start: a file that does not read stops the start, named.
                let keys = std::fs::read(path)
                    .map_err(|e| e.to_string())
                    .and_then(|bytes| set.parse(&bytes))
                    .map_err(|e| {
                        Error::new(
                            ErrorKind::Config,
                            format!("gateway: jwt.jwks_file {}: {e}", path.display()),
                        )
                    })?;
                let stamp = std::fs::metadata(path)
                    .ok()
                    .map(|m| (m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len()));
                *set.state
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = JwksState { stamp, keys };
                jwks = Some(std::sync::Arc::new(set));
            }
            if let Some(path) = &jwt.hs256_secret_file {
                let mut secret = read_file(path, "HS256 secret")?;
                while secret.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                    secret.pop();
                }
                if secret.len() < 32 {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!(
                            "gateway: the HS256 secret in {} is shorter than 32 bytes",
                            path.display()
                        ),
                    ));
                }
                hs256 = Some(JwtKey {
                    key: DecodingKey::from_secret(&secret),
                    validation: validation(Algorithm::HS256),
                });
            }
            if let Some(path) = &jwt.eddsa_public_key_file {
                let pem = read_file(path, "EdDSA public key")?;
                let key = DecodingKey::from_ed_pem(&pem).map_err(|e| {
                    Error::new(
                        ErrorKind::Config,
                        format!(
                            "gateway: {} is not an Ed25519 public key in PEM: {e}",
                            path.display()
                        ),
                    )
                })?;
                eddsa = Some(JwtKey {
                    key,
                    validation: validation(Algorithm::EdDSA),
                });
            }
        }
        Ok(Authenticator {
            api_keys,
            hs256,
            eddsa,
            jwks,
            identities: config.identities.iter().map(|i| i.id.clone()).collect(),
        })
    }

    /// The task that keeps a key set URL's keys current (none for a file), to run until
    /// `stop`.
    pub(crate) fn jwks_refresh(
        &self,
        stop: tokio_util::sync::CancellationToken,
    ) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let jwks = self.jwks.as_ref()?;
        matches!(jwks.source, JwksSource::Url { .. })
            .then(|| std::sync::Arc::clone(jwks).refresh(stop))
    }

    /// The caller named by `headers`' credentials.
    pub(crate) fn authenticate(
        &self,
        headers: &HeaderMap,
    ) -> std::result::Result<Caller, AuthError> {
        if let Some(key) = headers.get("x-api-key") {
            return self.api_key(key.as_bytes());
        }
        let Some(value) = headers.get(axum::http::header::AUTHORIZATION) else {
            return Err(AuthError::Missing);
        };
        let value = value.to_str().map_err(|_| AuthError::UnknownKey)?;
        let token = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(str::trim)
            .ok_or(AuthError::Missing)?;
        self.bearer(token)
    }

    /// The caller a bearer credential (a JWT or an API key) names: what a browser's
    /// WebSocket, which cannot set headers, passes as `?access_token=`.
    pub(crate) fn bearer(&self, token: &str) -> std::result::Result<Caller, AuthError> {
        // A JWT has three dot-separated parts; an API key has none.
        if token.split('.').count() == 3 {
            self.jwt(token)
        } else {
            self.api_key(token.as_bytes())
        }
    }

    fn api_key(&self, key: &[u8]) -> std::result::Result<Caller, AuthError> {
        let digest: [u8; 32] = Sha256::digest(key).into();
        // Every configured key is compared, all of its bytes, whichever matches.
        let mut found = None;
        for (known, identity, scopes) in &self.api_keys {
            let same = known
                .iter()
                .zip(digest.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
            if same {
                found = Some((identity, scopes));
            }
        }
        found
            .map(|(identity, scopes)| Caller {
                identity: identity.clone(),
                token: None,
                scopes: scopes.clone(),
            })
            .ok_or(AuthError::UnknownKey)
    }

    fn jwt(&self, token: &str) -> std::result::Result<Caller, AuthError> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|e| AuthError::InvalidToken(e.to_string()))?;
        // A token that names its key (`kid`) is checked against the key set; the configured
        // single keys take the others.
        let published = match (&header.kid, &self.jwks) {
            (Some(kid), Some(jwks)) => Some(jwks.key(kid).ok_or_else(|| {
                AuthError::InvalidToken(format!("no key {kid:?} in the gateway's key set"))
            })?),
            _ => None,
        };
        let key = match &published {
            Some(key) => Some(key.as_ref()),
            None => match header.alg {
                Algorithm::HS256 => self.hs256.as_ref(),
                Algorithm::EdDSA => self.eddsa.as_ref(),
                _ => None,
            },
        }
        .ok_or_else(|| {
            AuthError::InvalidToken(format!(
                "algorithm {:?} is not accepted{}",
                header.alg,
                if self.jwks.is_some() {
                    " without a key id (kid) from the key set"
                } else {
                    ""
                }
            ))
        })?;
        if key.validation.algorithms != [header.alg] {
            return Err(AuthError::InvalidToken(format!(
                "algorithm {:?} is not the key's",
                header.alg
            )));
        }
        let data = jsonwebtoken::decode::<Claims>(token, &key.key, &key.validation).map_err(
            |e| match e.kind() {
                jsonwebtoken::errors::ErrorKind::ExpiredSignature => AuthError::Expired,
                _ => AuthError::InvalidToken(e.to_string()),
            },
        )?;
        let scopes =
            crate::scopes::from_claims(data.claims.scope.as_ref(), data.claims.scp.as_ref());
        let identity = data.claims.sub;
        if !self.identities.contains(&identity) {
            return Err(AuthError::UnknownIdentity(identity));
        }
        Ok(Caller {
            identity,
            token: Some(token.to_owned()),
            scopes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwk(value: serde_json::Value) -> jsonwebtoken::jwk::Jwk {
        serde_json::from_value(value).expect("a JWK")
    }

    /// A published key verifies one algorithm: the one it names, if its type can, else the
    /// one its type implies; never a shared secret.
    #[test]
    fn a_published_key_verifies_the_algorithm_its_type_allows() {
        let rsa = |alg: Option<&str>| {
            let mut v = serde_json::json!({"kty": "RSA", "n": "sXch", "e": "AQAB", "kid": "r"});
            if let Some(alg) = alg {
                v["alg"] = alg.into();
            }
            jwk(v)
        };
        assert_eq!(jwk_algorithm(&rsa(None)), Some(Algorithm::RS256));
        assert_eq!(jwk_algorithm(&rsa(Some("PS384"))), Some(Algorithm::PS384));
        assert_eq!(jwk_algorithm(&rsa(Some("ES256"))), None);
        assert_eq!(jwk_algorithm(&rsa(Some("HS256"))), None);
        let ec = jwk(serde_json::json!({"kty": "EC", "crv": "P-384", "x": "AA", "y": "AA"}));
        assert_eq!(jwk_algorithm(&ec), Some(Algorithm::ES384));
        let ed = jwk(serde_json::json!({"kty": "OKP", "crv": "Ed25519", "x": "AA"}));
        assert_eq!(jwk_algorithm(&ed), Some(Algorithm::EdDSA));
        let oct = jwk(serde_json::json!({"kty": "oct", "k": "c2VjcmV0", "alg": "HS256"}));
        assert_eq!(jwk_algorithm(&oct), None);
    }
}
