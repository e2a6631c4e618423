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
}

/// One kind of JWT the gateway accepts.
struct JwtKey {
    key: DecodingKey,
    validation: Validation,
}

/// Checks credentials against the gateway's configuration.
pub(crate) struct Authenticator {
    /// SHA-256 of each key, with its identity.
    api_keys: Vec<([u8; 32], String)>,
    hs256: Option<JwtKey>,
    eddsa: Option<JwtKey>,
    identities: HashSet<String>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("api_keys", &self.api_keys.len())
            .field("hs256", &self.hs256.is_some())
            .field("eddsa", &self.eddsa.is_some())
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
            api_keys.push((digest, key.identity.clone()));
        }
        let (mut hs256, mut eddsa) = (None, None);
        if let Some(jwt) = &config.jwt {
            let validation = |alg: Algorithm| {
                let mut v = Validation::new(alg);
                v.set_issuer(&[jwt.issuer.as_str()]);
                v.set_audience(&[jwt.audience.as_str()]);
                v.set_required_spec_claims(&["exp", "sub", "iss", "aud"]);
                v.leeway = jwt.leeway_secs;
                v.validate_nbf = true;
                v
            };
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
            identities: config.identities.iter().map(|i| i.id.clone()).collect(),
        })
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
        for (known, identity) in &self.api_keys {
            let same = known
                .iter()
                .zip(digest.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
            if same {
                found = Some(identity);
            }
        }
        found
            .map(|identity| Caller {
                identity: identity.clone(),
                token: None,
            })
            .ok_or(AuthError::UnknownKey)
    }

    fn jwt(&self, token: &str) -> std::result::Result<Caller, AuthError> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|e| AuthError::InvalidToken(e.to_string()))?;
        let key = match header.alg {
            Algorithm::HS256 => self.hs256.as_ref(),
            Algorithm::EdDSA => self.eddsa.as_ref(),
            _ => None,
        }
        .ok_or_else(|| {
            AuthError::InvalidToken(format!("algorithm {:?} is not accepted", header.alg))
        })?;
        let data = jsonwebtoken::decode::<Claims>(token, &key.key, &key.validation).map_err(
            |e| match e.kind() {
                jsonwebtoken::errors::ErrorKind::ExpiredSignature => AuthError::Expired,
                _ => AuthError::InvalidToken(e.to_string()),
            },
        )?;
        let identity = data.claims.sub;
        if !self.identities.contains(&identity) {
            return Err(AuthError::UnknownIdentity(identity));
        }
        Ok(Caller {
            identity,
            token: Some(token.to_owned()),
        })
    }
}
