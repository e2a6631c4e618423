//! The gateway's own limits, so no edge caller can take more than its share: a request rate
//! per identity (a token bucket; 429 with 5013 beyond it), requests handled at once, counted
//! per identity once its credentials are checked and in a pool of their own for requests
//! without valid ones (503 with 5019 beyond either), a deadline for each request's body (408
//! with 5005), and WebSockets open at once (503 with 5008). Half-open or slow requests without
//! credentials so wait in their own pool and time out; they never take an authenticated
//! caller's place.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::StatusCode as Http;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use chorus_sdk::StatusCode;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::GatewayState;
use super::api::ApiError;
use super::config::GatewayConfig;
use crate::metrics::count_refusal;

/// How long a client has to send a request's whole body.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The limits of one gateway.
pub(crate) struct Limits {
    per_second: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
    /// Requests handled at once, per authenticated identity.
    per_identity: usize,
    requests: Mutex<HashMap<String, Arc<Semaphore>>>,
    /// Requests without valid credentials handled at once.
    unauthenticated: Arc<Semaphore>,
    max_body_bytes: usize,
    websockets: Arc<Semaphore>,
}

impl std::fmt::Debug for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limits")
            .field("per_second", &self.per_second)
            .field("burst", &self.burst)
            .finish_non_exhaustive()
    }
}

impl Limits {
    pub(crate) fn new(config: &GatewayConfig) -> Self {
        Limits {
            per_second: config.rate_per_second,
            burst: config.rate_burst,
            buckets: Mutex::new(HashMap::new()),
            per_identity: config.max_concurrent_requests,
            requests: Mutex::new(HashMap::new()),
            unauthenticated: Arc::new(Semaphore::new(config.max_unauthenticated_requests)),
            max_body_bytes: config.max_body_bytes,
            websockets: Arc::new(Semaphore::new(config.max_websockets)),
        }
    }

    /// Takes one request from `identity`'s bucket, or says it is over its rate.
    pub(crate) fn admit(&self, identity: &str) -> Result<(), ApiError> {
        let now = Instant::now();
        let mut buckets = self
            .buckets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let bucket = buckets.entry(identity.to_owned()).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        let refill = now.duration_since(bucket.at).as_secs_f64() * self.per_second;
        bucket.tokens = (bucket.tokens + refill).min(self.burst);
        bucket.at = now;
        if bucket.tokens < 1.0 {
            return Err(ApiError::new(
                StatusCode::RATE_LIMITED,
                format!(
                    "{identity} is over the gateway's rate of {} requests a second",
                    self.per_second
                ),
            ));
        }
        bucket.tokens -= 1.0;
        Ok(())
    }

    /// A place for one more WebSocket, held while it is open.
    pub(crate) fn websocket(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        Arc::clone(&self.websockets)
            .try_acquire_owned()
            .map_err(|_| {
                ApiError::new(
                    StatusCode::CONNECTION_LIMIT,
                    "the gateway has as many WebSockets open as it takes",
                )
                .with_http(Http::SERVICE_UNAVAILABLE)
            })
    }
}

impl Limits {
    /// A place for one more request of `identity` (an identity the gateway serves), or of a
    /// caller without valid credentials (`None`).
    fn place(&self, identity: Option<&str>) -> Result<OwnedSemaphorePermit, ApiError> {
        let (pool, reason) = match identity {
            Some(identity) => {
                let mut requests = self
                    .requests
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let pool = requests
                    .entry(identity.to_owned())
                    .or_insert_with(|| Arc::new(Semaphore::new(self.per_identity)));
                (Arc::clone(pool), "busy")
            }
            None => (Arc::clone(&self.unauthenticated), "unauthenticated_busy"),
        };
        pool.try_acquire_owned().map_err(|_| {
            count_refusal(reason);
            ApiError::new(
                StatusCode::UNAVAILABLE,
                match identity {
                    Some(identity) => {
                        format!("{identity} has as many requests in the gateway as it may; retry")
                    }
                    None => "the gateway is handling as many requests without credentials as it \
                             takes; retry"
                        .to_owned(),
                },
            )
        })
    }
}

/// The identity a request's credentials name, if they are valid and the gateway serves it:
/// from its headers, or a browser WebSocket's `?access_token=`.
fn identity_of(state: &GatewayState, request: &Request) -> Option<String> {
    let caller = state
        .auth
        .authenticate(request.headers())
        .ok()
        .or_else(|| {
            let query = request.uri().query()?;
            let token = serde_urlencoded::from_str::<Vec<(String, String)>>(query)
                .ok()?
                .into_iter()
                .find_map(|(k, v)| (k == "access_token").then_some(v))?;
            state.auth.bearer(&token).ok()
        })?;
    state
        .edges
        .contains_key(&caller.identity)
        .then_some(caller.identity)
}

/// Middleware: the caller's place among the requests handled at once (its identity's, once
/// its credentials check, or the pool of requests without them), then its body read whole
/// within [`BODY_READ_TIMEOUT`] and `max_body_bytes`. A connection that carried an
/// authenticated request is proven (`conn`): never closed to make room for its peer's others.
pub(crate) async fn concurrency(
    State(state): State<Arc<GatewayState>>,
    request: Request,
    next: Next,
) -> Response {
    // A kept-alive connection's credential is checked once here; its handler checks it on
    // every request as always.
    let conn = request.extensions().get::<crate::conn::Conn>().cloned();
    let credential = request
        .headers()
        .get("x-api-key")
        .or_else(|| request.headers().get(axum::http::header::AUTHORIZATION))
        .map(|v| v.as_bytes().to_vec());
    let identity = match (&conn, &credential) {
        (Some(conn), Some(credential)) => conn.known(credential),
        _ => None,
    }
    .or_else(|| {
        let identity = identity_of(&state, &request)?;
        if let Some(conn) = &conn {
            conn.prove(credential.as_deref(), &identity);
        }
        Some(identity)
    });
    let _permit = match state.limits.place(identity.as_deref()) {
        Ok(permit) => permit,
        Err(refused) => return refused.into_response(),
    };
    let mcp = request.uri().path() == "/mcp";
    // A write by a known identity goes to the audit stream with what it was answered
    // (its path only: a query may carry a token).
    let audited = (!matches!(
        *request.method(),
        axum::http::Method::GET | axum::http::Method::HEAD | axum::http::Method::OPTIONS
    ))
    .then(|| identity.clone())
    .flatten()
    .map(|identity| {
        (
            identity,
            format!("{} {}", request.method(), request.uri().path()),
        )
    });
    let request = match read_body(request, state.limits.max_body_bytes).await {
        Ok(request) => request,
        // MCP's transport answers in JSON-RPC (id null), as it does every message it cannot read.
        Err(refused) if mcp => {
            return crate::mcp::transport_refusal(refused.http(), refused.reason().to_owned());
        }
        Err(refused) => return refused.into_response(),
    };
    let response = next.run(request).await;
    if let Some((identity, action)) = audited
        && let Some(edge) = state.edges.get(&identity)
    {
        let status = response.status();
        let outcome = if status.is_success() || status.is_redirection() {
            "ok"
        } else if status.is_client_error() {
            "refused"
        } else {
            "failed"
        };
        edge.audit.record(
            chorus_sdk::audit::AuditRecord::new("gateway", identity, action, outcome)
                .status(status.as_u16()),
        );
    }
    response
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::DATA_FORMAT,
        format!("the request body is over the gateway's {limit} bytes"),
    )
    .with_http(Http::PAYLOAD_TOO_LARGE)
}

/// `request` with its body read whole, within the deadline and the size limit. A WebSocket
/// upgrade (no body) passes as it is.
async fn read_body(request: Request, limit: usize) -> Result<Request, ApiError> {
    use axum::body::HttpBody as _;
    if request.body().is_end_stream() {
        return Ok(request);
    }
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        count_refusal("body_too_large");
        return Err(too_large(limit));
    }
    let (parts, body) = request.into_parts();
    match tokio::time::timeout(BODY_READ_TIMEOUT, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => Ok(Request::from_parts(parts, axum::body::Body::from(bytes))),
        Ok(Err(err)) => {
            let over = std::error::Error::source(&err)
                .is_some_and(|e| e.is::<http_body_util::LengthLimitError>());
            if over {
                count_refusal("body_too_large");
                Err(too_large(limit))
            } else {
                Err(ApiError::new(
                    StatusCode::DATA_FORMAT,
                    format!("the request body could not be read: {err}"),
                )
                .with_http(Http::BAD_REQUEST))
            }
        }
        Err(_) => {
            count_refusal("body_timeout");
            Err(ApiError::new(
                StatusCode::TIMEOUT,
                format!(
                    "the request body did not arrive within {} s",
                    BODY_READ_TIMEOUT.as_secs()
                ),
            )
            .with_http(Http::REQUEST_TIMEOUT))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_body_late_is_408_one_declared_too_large_is_413_unread_and_one_in_time_is_kept() {
        let never = || {
            axum::body::Body::from_stream(futures::stream::pending::<
                Result<bytes::Bytes, std::io::Error>,
            >())
        };
        let post = |body| {
            Request::builder()
                .method("POST")
                .uri("/v1/requests")
                .body(body)
                .expect("request")
        };
        let late = read_body(post(never()), 1024)
            .await
            .expect_err("a body that never arrives");
        assert_eq!(late.http(), Http::REQUEST_TIMEOUT);
        assert_eq!(late.body()["status"], 5005);
        let mut declared = post(never());
        declared
            .headers_mut()
            .insert(axum::http::header::CONTENT_LENGTH, 4096.into());
        let big = read_body(declared, 1024)
            .await
            .expect_err("a length over the limit");
        assert_eq!(big.http(), Http::PAYLOAD_TOO_LARGE);
        assert_eq!(big.body()["status"], 5006);
        let over = read_body(post(axum::body::Body::from(vec![b'x'; 2048])), 1024)
            .await
            .expect_err("a body over the limit without a declared length");
        assert_eq!(over.http(), Http::PAYLOAD_TOO_LARGE);
        let kept = read_body(post(axum::body::Body::from("{}")), 1024)
            .await
            .expect("a body in time");
        let bytes = axum::body::to_bytes(kept.into_body(), 1024)
            .await
            .expect("bytes");
        assert_eq!(&bytes[..], b"{}");
    }

    #[test]
    fn a_bucket_lets_a_burst_through_then_refuses_until_it_refills() {
        let limits = Limits::new(&GatewayConfig {
            rate_per_second: 1.0,
            rate_burst: 3.0,
            ..GatewayConfig::default()
        });
        for _ in 0..3 {
            assert!(limits.admit("a").is_ok());
        }
        let refused = limits.admit("a").expect_err("over the burst");
        assert_eq!(refused.body()["status"], 5013);
        // Each identity has its own bucket.
        assert!(limits.admit("b").is_ok());
    }
}
