//! Broadcast: one command (or notification, pushed without waiting for an answer) to every
//! live agent of a target, with a report per recipient.
//!
//! Broadcast requests arrive on `<root>.bcast.>` in the coordinators' queue group, so each is
//! fanned out by exactly one coordinator however many run.
//!
//! A signed request is verified against its sender's key first (and an unsigned one refused
//! where `require_signed_broadcasts` says so). Each copy is a new message the coordinator
//! sends: its `from` is `coordinator`, the sender is named in the [`ORIGIN_HEADER`] header,
//! and it is signed with the coordinator's key when it has one, so a receiver that requires
//! signatures and trusts the coordinator's key takes it.

use std::time::Duration;

use chorus_broker_adapter::ErrorKind;
use chorus_sdk::Report;
use chorus_sdk::codec::{self, encode_payload};
use chorus_sdk::durable::{DeadLetter, DeadLetterReason, write_dead_letter};
use chorus_sdk::envelope::now_ms;
use chorus_sdk::registry::RecipientReport;
use chorus_sdk::{
    BroadcastReport, BroadcastTarget, DeliveryClass, DiscoverQuery, Envelope, HandlerError, Kind,
    Outcome, Output, Priority, StatusCode,
};
use futures::StreamExt;
use uuid::Uuid;

use super::metrics::metrics;
use super::{COORDINATOR_ID, Shared};

/// Header of a broadcast copy naming the agent that asked for the broadcast (the copy's `from`
/// is the coordinator, which vouches for it: it verified the request's signature, if any).
pub const ORIGIN_HEADER: &str = "chorus-origin";

/// Refuses a broadcast request whose sender is not who it claims: a signature that does not
/// verify against the key of its `from` (5004), a replay (5015), or no signature where the
/// coordinator requires one (5014).
fn check_sender(shared: &Shared, request: &Envelope, subject: &str) -> Result<(), HandlerError> {
    let verifier = &shared.broadcast_verifier;
    if request.signature.is_some() {
        let key = shared
            .config
            .trusted_keys
            .get(request.from.as_str())
            .cloned()
            .or_else(|| shared.registry.public_key_of(&request.from));
        match key {
            Some(key) => verifier.trust(&request.from, &key),
            None => verifier.forget(&request.from),
        }
    }
    verifier
        .verify(subject, request, now_ms())
        .map_err(|(status, reason)| {
            metrics()
                .messages
                .with_label_values(&["command", status.label()])
                .inc();
            tracing::warn!(from = %request.from, id = %request.id, %status, %reason, "broadcast request refused");
            HandlerError::new(status, reason)
        })
}

/// Handles one broadcast request (admitted by the inbound pipeline): the report, encoded in
/// the request's content type, or why it was refused.
pub(crate) async fn on_broadcast(
    shared: &Shared,
    request: &Envelope,
    subject: &str,
) -> Result<Output, HandlerError> {
    check_sender(shared, request, subject)?;
    let result = fan_out(shared, request, subject).await;
    let status = result
        .as_ref()
        .map_or_else(|e| e.status, |_| StatusCode::OK);
    metrics()
        .messages
        .with_label_values(&["command", status.label()])
        .inc();
    let report = result.inspect_err(
        |e| tracing::debug!(status = %e.status, reason = %e.reason, "broadcast refused"),
    )?;
    Ok(Output {
        payload: encode_payload(&report, &request.content_type)?,
        content_type: request.content_type.clone(),
    })
}

async fn fan_out(
    shared: &Shared,
    request: &Envelope,
    subject: &str,
) -> Result<BroadcastReport, HandlerError> {
    let refuse = |status, reason: &str| Err(HandlerError::new(status, reason));
    let Some(target) = shared.subjects.broadcast_target(subject) else {
        return refuse(StatusCode::INVALID_ARGUMENT, "not a broadcast subject");
    };
    let Some(command) = request.name.clone() else {
        return refuse(
            StatusCode::INVALID_ARGUMENT,
            if request.kind == Kind::Notification {
                "a notification names itself"
            } else {
                "a broadcast names its command"
            },
        );
    };
    let hops = request.hops.saturating_add(1);
    if hops > request.hop_limit {
        return refuse(StatusCode::LOOP_DETECTED, "hop limit reached");
    }
    let timeout = request
        .expect
        .as_ref()
        .map(|e| Duration::from_millis(e.timeout_ms))
        .unwrap_or(shared.config.broadcast_timeout());
    let query = match &target {
        BroadcastTarget::All => DiscoverQuery::default(),
        BroadcastTarget::Group(g) => DiscoverQuery {
            group: Some(g.clone()),
            ..DiscoverQuery::default()
        },
        BroadcastTarget::Capability(c) => DiscoverQuery::capability(c.clone()),
    };
    let recipients: Vec<String> = shared
        .registry
        .discover(&query)
        .into_iter()
        .map(|r| r.manifest.agent)
        .collect();
    metrics().broadcasts.inc();
    let notification = request.kind == Kind::Notification;
    let command = &command;
    let mut lines: Vec<RecipientReport> = futures::stream::iter(recipients)
        .map(|agent| async move {
            if notification {
                notify(shared, request, hops, agent).await
            } else {
                deliver(shared, request, command, hops, agent, timeout).await
            }
        })
        .buffer_unordered(shared.config.broadcast_concurrency)
        .collect()
        .await;
    lines.sort_by(|a, b| a.agent.cmp(&b.agent));
    for line in &lines {
        let label = match line.outcome {
            Outcome::Delivered => "delivered",
            Outcome::Failed => "failed",
            Outcome::TimedOut => "timed_out",
            Outcome::Stored => "stored",
        };
        metrics()
            .broadcast_recipients
            .with_label_values(&[label])
            .inc();
    }
    let report = BroadcastReport {
        broadcast_id: request.id,
        target,
        recipients: lines,
    };
    tracing::info!(
        id = %request.id,
        command,
        delivered = report.count(Outcome::Delivered),
        failed = report.count(Outcome::Failed),
        timed_out = report.count(Outcome::TimedOut),
        stored = report.count(Outcome::Stored),
        notification,
        "broadcast done"
    );
    Ok(report)
}

/// A copy of a broadcast request for `agent`, from the coordinator (which names the sender
/// in [`ORIGIN_HEADER`]), signed for `subject` when the coordinator signs.
fn copy_for(shared: &Shared, request: &Envelope, hops: u8, agent: &str, subject: &str) -> Envelope {
    let mut copy = request.clone();
    copy.from = COORDINATOR_ID.into();
    copy.headers
        .insert(ORIGIN_HEADER.to_owned(), request.from.to_string());
    copy.signature = None;
    copy.id = Uuid::now_v7();
    copy.correlation_id = Some(request.conversation());
    copy.to = vec![agent.to_owned()];
    copy.hops = hops;
    copy.timestamp_ms = now_ms();
    if let Some(identity) = &shared.identity {
        identity.sign(subject, &mut copy);
    }
    copy
}

/// Pushes one notification copy to `agent` (PROTOCOL.md section 7.14): published on its
/// notification subject (`delivered`: nothing answers a notification), or stored in its
/// durable inbox when the request asked for a durable class (`stored`, once the stream acks).
async fn notify(shared: &Shared, request: &Envelope, hops: u8, agent: String) -> RecipientReport {
    let line = |outcome, status, reason: Option<String>| RecipientReport {
        agent: agent.clone(),
        outcome,
        status,
        reason,
    };
    let durable = request.delivery != DeliveryClass::AtMostOnce;
    let high = matches!(request.priority, Priority::High | Priority::Critical);
    let subject = if durable {
        shared.subjects.durable_notification(&agent, high)
    } else {
        shared.subjects.notification(&agent)
    };
    let subject = match subject {
        Ok(s) => s,
        Err(e) => {
            return line(
                Outcome::Failed,
                StatusCode::INVALID_ARGUMENT,
                Some(e.to_string()),
            );
        }
    };
    let mut copy = request.clone();
    // Each copy expires by the request's deadline only (a durable one waits for its agent
    // until then), not by how long the sender waits for this report.
    copy.ttl_ms = None;
    copy.expect = None;
    let copy = copy_for(shared, &copy, hops, &agent, &subject);
    let Ok(bytes) = codec::encode(&copy, codec::Encoding::MsgPack) else {
        return line(
            Outcome::Failed,
            StatusCode::INTERNAL,
            Some("copy does not encode".into()),
        );
    };
    if !durable {
        return match shared.broker.publish(&subject, bytes).await {
            Ok(()) => line(Outcome::Delivered, StatusCode::OK, None),
            Err(e) => line(
                Outcome::Failed,
                StatusCode::UNEXPECTED_DISCONNECT,
                Some(e.to_string()),
            ),
        };
    }
    let msg_id = (request.delivery == DeliveryClass::ExactlyOnce).then(|| copy.id.to_string());
    match shared
        .js
        .publish(&subject, None, msg_id.as_deref(), None, bytes)
        .await
    {
        Ok(_) => line(Outcome::Stored, StatusCode::OK, None),
        Err(e) => {
            let status = if e.kind() == ErrorKind::TimedOut {
                StatusCode::TIMEOUT
            } else {
                StatusCode::UNAVAILABLE
            };
            line(Outcome::Failed, status, Some(e.to_string()))
        }
    }
}

async fn deliver(
    shared: &Shared,
    request: &Envelope,
    command: &str,
    hops: u8,
    agent: String,
    timeout: Duration,
) -> RecipientReport {
    let line = |outcome, status, reason: Option<String>| RecipientReport {
        agent: agent.clone(),
        outcome,
        status,
        reason,
    };
    let subject = match shared.subjects.command(&agent, command) {
        Ok(s) => s,
        Err(e) => {
            return line(
                Outcome::Failed,
                StatusCode::INVALID_ARGUMENT,
                Some(e.to_string()),
            );
        }
    };
    let mut copy = request.clone();
    copy.ttl_ms = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
    let copy = copy_for(shared, &copy, hops, &agent, &subject);
    let Ok(bytes) = codec::encode(&copy, codec::Encoding::MsgPack) else {
        return line(
            Outcome::Failed,
            StatusCode::INTERNAL,
            Some("copy does not encode".into()),
        );
    };
    match shared
        .broker
        .request(&subject, None, bytes.clone(), timeout)
        .await
    {
        Ok(reply) => match codec::decode(reply.payload()) {
            Ok((env, _)) => match env.status {
                Some(s) if !s.is_success() => line(Outcome::Failed, s, env.reason),
                _ => line(Outcome::Delivered, StatusCode::OK, None),
            },
            Err(e) => line(
                Outcome::Failed,
                StatusCode::DATA_FORMAT,
                Some(e.to_string()),
            ),
        },
        Err(e) if e.kind() == ErrorKind::TimedOut => {
            line(Outcome::TimedOut, StatusCode::TIMEOUT, None)
        }
        Err(e) => {
            let status = if e.kind() == ErrorKind::NoResponders {
                StatusCode::NO_RESPONDERS
            } else {
                StatusCode::UNEXPECTED_DISCONNECT
            };
            // Nobody could take this copy: keep it.
            let letter = DeadLetter {
                reason: DeadLetterReason::Undeliverable,
                status,
                detail: e.to_string(),
                agent: agent.clone(),
                subject,
                envelope: bytes,
                headers: Vec::new(),
                message_id: Some(copy.id),
                attempts: 1,
                stored_ms: copy.timestamp_ms,
                dead_lettered_ms: now_ms(),
                source: None,
                omitted: None,
            };
            let max_payload = shared.broker.max_payload();
            match write_dead_letter(&shared.js, &shared.subjects, &letter, max_payload).await {
                Ok(ack) if !ack.duplicate => {
                    metrics()
                        .dead_letters
                        .with_label_values(&[DeadLetterReason::Undeliverable.as_str()])
                        .inc();
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(agent, error = %Report(&err), "undeliverable broadcast not dead-lettered")
                }
            }
            line(Outcome::Failed, status, Some(e.to_string()))
        }
    }
}
