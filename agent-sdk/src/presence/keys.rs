//! Keys other agents announce in the registry: their signing keys (for the signature check)
//! and their encryption keys (for sealing payloads to them), kept in step as they come and go.

use std::sync::Arc;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::outbound::Outbound;
use crate::protocol::registry::{AgentRecord, REGISTRY_BUCKET};
use crate::security::Verifier;

/// Follows the registry until `stop`, trusting each agent's announced keys.
pub(crate) async fn watch_registered_keys(
    out: Arc<Outbound>,
    verifier: Option<Arc<Verifier>>,
    stop: CancellationToken,
) {
    let bucket = out.link.subjects.bucket_name(REGISTRY_BUCKET);
    let Ok(kv) = out.link.js.open_kv(&bucket).await else {
        tracing::debug!(agent = %out.link.id, "no registry bucket: only explicitly trusted keys are known");
        return;
    };
    let Ok(mut watch) = kv.watch().await else {
        return;
    };
    loop {
        let change = tokio::select! {
            change = watch.next() => change,
            _ = stop.cancelled() => break,
        };
        let Some(Ok(entry)) = change else { break };
        match entry.op {
            chorus_broker_adapter::KvOp::Put => {
                let Ok(record) = serde_json::from_slice::<AgentRecord>(&entry.value) else {
                    continue;
                };
                if let (Some(verifier), Some(key)) = (&verifier, record.manifest.public_key) {
                    verifier.trust(&entry.key, &key);
                }
                if let Some(key) = record.manifest.encryption_key {
                    out.learn_encryption_key(&entry.key, key);
                }
            }
            chorus_broker_adapter::KvOp::Delete => {
                if let Some(verifier) = &verifier {
                    verifier.forget(&entry.key);
                }
            }
        }
    }
}
