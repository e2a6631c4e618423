//! The gateway's own limits, so no edge caller can take more than its share: a request rate
//! per identity (a token bucket; 429 with 5013 beyond it), requests handled at once (503 with
//! 5019 beyond it) and WebSockets open at once (503 with 5008).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::StatusCode as Http;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use chorus_sdk::StatusCode;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::GatewayState;
use super::api::ApiError;
use super::config::GatewayConfig;

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The limits of one gateway.
pub(crate) struct Limits {
    per_second: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
    requests: Arc<Semaphore>,
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
            requests: Arc::new(Semaphore::new(config.max_concurrent_requests)),
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

/// Middleware: at most `max_concurrent_requests` handled at once; beyond it, 503 at once.
pub(crate) async fn concurrency(
    State(state): State<Arc<GatewayState>>,
    request: Request,
    next: Next,
) -> Response {
    let Ok(_permit) = Arc::clone(&state.limits.requests).try_acquire_owned() else {
        return ApiError::new(
            StatusCode::UNAVAILABLE,
            "the gateway is handling as many requests as it takes; retry",
        )
        .into_response();
    };
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

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
