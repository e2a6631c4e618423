//! `chorus usage`: what the agents handled, per customer, session, agent, endpoint or kind,
//! over a time window, summed from the usage stream (PROTOCOL.md section 7.13). The stream
//! keeps every agent's reports, so the answer is the same after any restart of the
//! coordinator; this room only reads the window and folds it (`chorus_sdk::usage::summarize`).
//! It also follows the reports stored from its start into `chorus_usage_messages_total` and
//! `chorus_usage_bytes_total`.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::StreamExt;

use chorus_sdk::usage::{
    MAX_USAGE_REPORTS, USAGE_COMMAND, USAGE_STREAM, UsageQuery, UsageReport, UsageSummary,
    summarize,
};
use chorus_sdk::{Agent, Context, HandlerError, Report, SdkError, StatusCode, Typed};

use super::Shared;
use super::guard::authorize;
use crate::authority::Action;

async fn usage(shared: &Shared, query: UsageQuery) -> Result<UsageSummary, HandlerError> {
    let until = query.until_ms.unwrap_or(u64::MAX);
    if query.since_ms > until {
        return Err(HandlerError::new(
            StatusCode::INVALID_ARGUMENT,
            "since is after until",
        ));
    }
    let stored = shared
        .js
        .scan_since(
            &shared.subjects.stream_name(USAGE_STREAM),
            None,
            query.since_ms,
            MAX_USAGE_REPORTS,
        )
        .await
        .map_err(|err| {
            HandlerError::new(
                StatusCode::UNAVAILABLE,
                format!("cannot read the usage stream: {}", Report(&err)),
            )
        })?;
    let reports: Vec<UsageReport> = stored
        .iter()
        .filter(|m| m.stored_ms <= until)
        .filter_map(|m| serde_json::from_slice(&m.payload).ok())
        .collect();
    Ok(summarize(&reports, &query))
}

fn upgrade(shared: &Weak<Shared>) -> Result<Arc<Shared>, HandlerError> {
    shared.upgrade().ok_or_else(|| {
        HandlerError::new(StatusCode::UNAVAILABLE, "the coordinator is shutting down")
    })
}

/// Serves `usage` as a command of the agent `coordinator`, in the coordinators' queue group.
pub(super) async fn serve(agent: &Agent, shared: &Arc<Shared>) -> Result<(), SdkError> {
    let weak = Arc::downgrade(shared);
    agent
        .handle_subject(
            &shared
                .subjects
                .command(super::COORDINATOR_ID, USAGE_COMMAND)?,
            Some(&shared.subjects.coordinator_group()),
            Typed::new(move |ctx: Context, query: UsageQuery| {
                let weak = weak.clone();
                async move {
                    let shared = upgrade(&weak)?;
                    authorize(&shared, &ctx, Action::Usage)?;
                    usage(&shared, query).await
                }
            }),
        )
        .await
}

/// How long the metrics follower waits before following the stream again after an error.
const FOLLOW_RETRY: Duration = Duration::from_secs(5);

/// Counts every usage report stored from now on into the usage metrics, until the coordinator
/// stops; following again (from the last report counted) after an error.
pub(super) fn spawn_metrics(shared: &Arc<Shared>) {
    let s = Arc::clone(shared);
    shared.tracker.spawn(async move {
        let stream = s.subjects.stream_name(USAGE_STREAM);
        let filters = [s.subjects.usage_all()];
        let mut after = match s.js.stream_state(&stream).await {
            Ok(state) => state.last_seq,
            Err(err) => {
                tracing::debug!(error = %Report(&err), "usage stream not read: no usage metrics");
                return;
            }
        };
        loop {
            match s.js.follow(&stream, &filters, after).await {
                Ok(mut follow) => loop {
                    let next = tokio::select! {
                        next = follow.next() => next,
                        () = s.stop.cancelled() => {
                            follow.close().await;
                            return;
                        }
                    };
                    match next {
                        Some(Ok(stored)) => {
                            after = stored.sequence;
                            if let Ok(report) =
                                serde_json::from_slice::<UsageReport>(&stored.payload)
                            {
                                count(&report);
                            }
                        }
                        Some(Err(err)) => {
                            tracing::debug!(error = %Report(&err), "usage follow interrupted");
                            break;
                        }
                        None => break,
                    }
                },
                Err(err) => tracing::debug!(error = %Report(&err), "usage stream not followed"),
            }
            tokio::select! {
                () = tokio::time::sleep(FOLLOW_RETRY) => {}
                () = s.stop.cancelled() => return,
            }
        }
    });
}

fn count(report: &UsageReport) {
    let m = super::metrics::metrics();
    for row in &report.rows {
        let (agent, customer, kind) = (
            report.agent.as_str(),
            row.customer.as_str(),
            row.kind.as_str(),
        );
        m.usage_messages
            .with_label_values(&[agent, customer, kind, "ok"])
            .inc_by(row.handled.saturating_sub(row.failed));
        m.usage_messages
            .with_label_values(&[agent, customer, kind, "failed"])
            .inc_by(row.failed);
        m.usage_bytes
            .with_label_values(&[agent, customer, "in"])
            .inc_by(row.bytes_in);
        m.usage_bytes
            .with_label_values(&[agent, customer, "out"])
            .inc_by(row.bytes_out);
    }
}
