//! What the coordinator makes sure exists before it starts any task: the inbox, dead-letter,
//! advisory and task streams, the registry, config, deployments and hosts buckets, the object store bucket of
//! payloads carried by reference, and the retry policies agents read.
//! Every step is idempotent, so coordinators starting side by side do not conflict.

use bytes::Bytes;
use chorus_broker_adapter::{JetStream, Kv, KvSpec};
use chorus_sdk::Subjects;
use chorus_sdk::durable::{self, CONFIG_BUCKET, RETRY_KEY};

use super::REGISTRY_BUCKET;
use crate::config::CoordinatorConfig;
use crate::error::{Error, ErrorKind, Result};

/// The buckets the coordinator's tasks use.
pub(super) struct Buckets {
    /// Agent manifests by agent id.
    pub(super) registry: Kv,
    /// Hosted agents' desired state, by deployment id.
    pub(super) deployments: Kv,
    /// The hosts' latest reports, by host name.
    pub(super) hosts: Kv,
}

/// Creates (or checks) the streams and buckets and publishes `config.retry` to agents.
pub(super) async fn provision(
    config: &CoordinatorConfig,
    subjects: &Subjects,
    js: &JetStream,
) -> Result<Buckets> {
    for stream in [
        durable::inbox_stream(subjects, &config.inbox),
        durable::dlq_stream(subjects, config.replicas),
        durable::advisory_stream(subjects, config.replicas),
        chorus_sdk::task::task_stream(subjects, config.replicas),
        chorus_sdk::usage::usage_stream(subjects, config.replicas),
        chorus_sdk::audit::audit_stream(subjects, config.replicas),
    ] {
        js.ensure_stream(&stream).await.map_err(Error::wrap(
            ErrorKind::Broker,
            format!("cannot set up stream {}", stream.name),
        ))?;
    }
    let payloads = chorus_sdk::payload::payload_bucket(subjects, config.replicas);
    js.ensure_kv(&payloads).await.map_err(Error::wrap(
        ErrorKind::Broker,
        format!("cannot set up the payload bucket {}", payloads.bucket),
    ))?;
    let registry = bucket(
        js,
        subjects,
        config,
        REGISTRY_BUCKET,
        "Chorus agent registry",
    )
    .await?;
    let shared_config = bucket(
        js,
        subjects,
        config,
        CONFIG_BUCKET,
        "Chorus configuration shared with agents",
    )
    .await?;
    let retry = serde_json::to_vec(&config.retry).map_err(Error::wrap(
        ErrorKind::Config,
        "retry policies do not encode",
    ))?;
    shared_config
        .put(RETRY_KEY, Bytes::from(retry))
        .await
        .map_err(Error::wrap(
            ErrorKind::Broker,
            "cannot publish the retry policies",
        ))?;
    let deployments = bucket(
        js,
        subjects,
        config,
        chorus_hosting::protocol::DEPLOYMENTS_BUCKET,
        "Chorus hosted agents: desired state",
    )
    .await?;
    let hosts = bucket(
        js,
        subjects,
        config,
        chorus_hosting::protocol::HOSTS_BUCKET,
        "Chorus hosts: their latest reports",
    )
    .await?;
    Ok(Buckets {
        registry,
        deployments,
        hosts,
    })
}

async fn bucket(
    js: &JetStream,
    subjects: &Subjects,
    config: &CoordinatorConfig,
    suffix: &str,
    description: &str,
) -> Result<Kv> {
    let mut spec = KvSpec::new(subjects.bucket_name(suffix));
    spec.replicas = config.replicas;
    spec.description = description.into();
    js.ensure_kv(&spec).await.map_err(Error::wrap(
        ErrorKind::Broker,
        format!("cannot set up bucket {}", spec.bucket),
    ))
}
