//! Answers to NATS's own service discovery (`$SRV.PING`, `$SRV.INFO`, `$SRV.STATS`, the
//! micro-service JSON of ADR-32), so standard NATS tooling (`nats micro ls`) lists Chorus
//! agents.

use crate::Report;
use std::sync::Arc;

use bytes::Bytes;
use chorus_broker_adapter::{Message, Subscription};
use serde_json::json;
use tokio_util::task::TaskTracker;

use super::Presence;
use crate::subject::SubjectError;
use crate::sync::lock;

impl Presence {
    /// Answers `$SRV` requests from `sub` until the agent stops.
    pub(crate) fn serve_discovery(self: &Arc<Self>, tracker: &TaskTracker, mut sub: Subscription) {
        let this = Arc::clone(self);
        tracker.spawn(async move {
            while let Some(msg) = sub.next_until(this.stop.cancelled()).await {
                this.answer_service(&msg).await;
            }
        });
    }

    /// The `$SRV` subjects this agent answers on.
    pub(crate) fn service_subjects(&self) -> Result<[String; 3], SubjectError> {
        self.link
            .subjects
            .service_discovery(&self.link.id, &self.instance)
    }

    /// Answers a `$SRV.PING|INFO|STATS` request with the micro-service JSON of ADR-32.
    pub(crate) async fn answer_service(&self, msg: &Message) {
        let Some(reply) = msg.reply() else { return };
        let verb = msg.subject().split('.').nth(1).unwrap_or_default();
        let mut body = json!({
            "name": self.link.id,
            "id": self.instance,
            "version": env!("CARGO_PKG_VERSION"),
            "metadata": {
                "chorus.root": self.link.subjects.root(),
                "chorus.capabilities": lock(&self.capabilities).join(","),
            },
        });
        let endpoints = self.endpoints.all();
        match verb {
            "PING" => body["type"] = json!("io.nats.micro.v1.ping_response"),
            "INFO" => {
                body["type"] = json!("io.nats.micro.v1.info_response");
                body["description"] = json!(format!("Chorus agent {}", self.link.id));
                body["endpoints"] = endpoints
                    .iter()
                    .map(|e| {
                        json!({
                            "name": e.name,
                            "subject": e.subject,
                            "queue_group": e.queue_group.clone().unwrap_or_default(),
                            "metadata": {},
                        })
                    })
                    .collect();
            }
            "STATS" => {
                body["type"] = json!("io.nats.micro.v1.stats_response");
                body["started"] = json!(crate::protocol::envelope::rfc3339(self.started_ms));
                body["endpoints"] = endpoints
                    .iter()
                    .map(|e| {
                        let stats = e.stats();
                        let (n, ns) = (stats.requests, stats.processing_ns);
                        json!({
                            "name": e.name,
                            "subject": e.subject,
                            "queue_group": e.queue_group.clone().unwrap_or_default(),
                            "num_requests": n,
                            "num_errors": stats.errors,
                            "last_error": stats.last_error,
                            "processing_time": ns,
                            "average_processing_time": ns.checked_div(n).unwrap_or(0),
                        })
                    })
                    .collect();
            }
            _ => return,
        }
        let bytes = Bytes::from(body.to_string());
        if let Err(err) = self.link.broker.publish(reply, bytes).await {
            tracing::debug!(agent = %self.link.id, error = %Report(&err), "service discovery answer not sent");
        }
    }
}
