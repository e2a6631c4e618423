//! `clock-skew`: signed durable commands from a sender whose clock runs ahead or behind. The
//! SDK has no hook to skew an agent's clock, so the envelopes are made by hand, signed with
//! the sender's identity and published to the worker's inbox as the SDK would. Within the
//! worker's tolerance every one is handled; beyond it every one is refused with 5015 and
//! dead-lettered, none handled.

use std::time::Duration;

use chorus_broker_adapter::BatchMessage;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::security::{Identity, SignaturePolicy};
use chorus_sdk::{DeliveryClass, Envelope, Kind, Performative};

use super::{
    Harness, Scale, Scenario, WORKER, checker, connect, coordinator, shutdown, worker_options,
};
use crate::ledger::Class;
use crate::report::ScenarioReport;
use crate::worker::WORK;
use crate::{ChaosOptions, WAIT};

/// The worker's tolerance for a signed message's timestamp.
const TOLERANCE: Duration = Duration::from_secs(30);
/// The sending agent's id, whose key the worker trusts.
const SENDER: &str = "skewed";
/// Acks outstanding at once while publishing.
const ACKS_IN_FLIGHT: usize = 64;

/// A signed `work` command for message `id`, stamped `skew_ms` away from now.
fn skewed(
    identity: &Identity,
    subject: &str,
    id: u64,
    delivery: DeliveryClass,
    skew_ms: i64,
) -> anyhow::Result<(Envelope, bytes::Bytes)> {
    let mut env = Envelope::new(Kind::Request, Performative::Request, SENDER);
    env.to = vec![WORKER.to_owned()];
    env.name = Some(WORK.to_owned());
    env.delivery = delivery;
    env.payload = codec::encode_payload(&id, "application/msgpack")
        .map_err(|e| anyhow::anyhow!("payload: {e}"))?;
    env.timestamp_ms = env.timestamp_ms.saturating_add_signed(skew_ms);
    identity.sign(subject, &mut env);
    let bytes = codec::encode(&env, Encoding::MsgPack).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((env, bytes))
}

pub(crate) async fn run(scale: &Scale, opts: &ChaosOptions) -> anyhow::Result<ScenarioReport> {
    let mut h = Harness::new(Scenario::ClockSkew);
    let server = super::server_kill::durable_server().await?;
    let urls = vec![server.url().to_owned()];
    let coordinator = coordinator(opts, &urls).await?;
    let identity = Identity::generate();
    let worker = connect(
        worker_options(&urls)
            .verify_signatures(SignaturePolicy {
                require_signed: true,
                tolerance: TOLERANCE,
            })
            .trust(SENDER, identity.public_key()),
        WAIT,
    )
    .await?;
    crate::worker::serve(&worker, &h.probe, Duration::ZERO).await?;
    h.nats_server = worker.broker().server_version();
    let (_checker, js) = checker(&urls).await?;
    let subject = worker.subjects().durable(WORKER, WORK, false)?;
    js.ensure_stream_exists(&chorus_sdk::durable::inbox_stream(
        worker.subjects(),
        &Default::default(),
    ))
    .await?;

    let tolerance_ms = i64::try_from(TOLERANCE.as_millis()).unwrap_or(i64::MAX);
    // Half the tolerance either way is accepted; twice it either way is stale.
    let within = [-tolerance_ms / 2, tolerance_ms / 2];
    let beyond = [-2 * tolerance_ms, 2 * tolerance_ms];
    let mut ids = Vec::new();
    let mut batch = Vec::new();
    for i in 0..scale.skewed * 2 {
        let delivery = if i % 2 == 0 {
            DeliveryClass::AtLeastOnce
        } else {
            DeliveryClass::ExactlyOnce
        };
        let skew = (i / 2) % 2;
        for (class, skew_ms) in [
            (
                if delivery == DeliveryClass::ExactlyOnce {
                    Class::ExactlyOnce
                } else {
                    Class::AtLeastOnce
                },
                within[skew],
            ),
            (Class::Stale, beyond[skew]),
        ] {
            let id = h.ledger.issue(class);
            let (env, payload) = skewed(&identity, &subject, id, delivery, skew_ms)?;
            ids.push(id);
            batch.push(BatchMessage {
                subject: subject.clone(),
                msg_id: (delivery == DeliveryClass::ExactlyOnce).then(|| env.id.to_string()),
                payload,
            });
        }
    }
    for (id, ack) in ids
        .into_iter()
        .zip(js.publish_batch(batch, ACKS_IN_FLIGHT).await)
    {
        h.ledger.record(id, ack.is_ok());
    }
    h.note(format!(
        "tolerance {} s; skews of ±{} s accepted, ±{} s stale",
        TOLERANCE.as_secs(),
        tolerance_ms / 2000,
        tolerance_ms / 500
    ));
    let report = h
        .finish(
            &js,
            scale,
            &[Class::AtLeastOnce, Class::ExactlyOnce, Class::Stale],
        )
        .await;
    let refused = worker.stats().security_refused;
    shutdown([worker]).await;
    coordinator.shutdown().await;
    drop(server);
    let mut report = report?;
    report
        .notes
        .push(format!("the worker's signature check refused {refused}"));
    Ok(report)
}
