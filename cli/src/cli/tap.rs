//! `chorus tap`: every message on the bus, decoded, as it passes: commands, requests,
//! replies, events, heartbeats, with their ids, correlation, hops, status, trace id, and the
//! session and customer they are for. Like `nats sub '>'`, but it reads the envelopes.

use std::process::ExitCode;

use chorus_sdk::Envelope;
use futures::StreamExt;

use super::{ConnectionArgs, print_json};

/// The connection name of `chorus tap`.
const CONNECTION_NAME: &str = "chorus-tap";

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Subject pattern under the bus's root (`*` one token, `>` the rest): `agent.calc.>`
    /// for one agent's commands and requests, `evt.>` for events, `cap.>` for capability
    /// requests. With `>` every reply is shown too; with another pattern, only the replies to
    /// requests it showed.
    #[arg(default_value = ">")]
    pattern: String,
    /// Print each message as one JSON line.
    #[arg(long)]
    json: bool,
    /// Exit after this many messages.
    #[arg(long)]
    count: Option<usize>,
}

/// One tapped message as `--json` prints it.
#[derive(Debug, serde::Serialize)]
struct Line<'a> {
    subject: &'a str,
    kind: &'a str,
    performative: &'a str,
    from: &'a str,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    to: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    topic: Option<&'a str>,
    id: uuid::Uuid,
    correlation_id: uuid::Uuid,
    #[serde(skip_serializing_if = "Option::is_none")]
    in_reply_to: Option<uuid::Uuid>,
    hops: u8,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    trace_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    session_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    customer_id: Option<&'a str>,
    /// What the sender asked for in words (Agentify's `task`, carried in a header).
    #[serde(skip_serializing_if = "Option::is_none")]
    task: Option<&'a str>,
    delivery: &'a str,
    timestamp_ms: u64,
    /// The timestamp as RFC 3339 (UTC).
    time: String,
    size: usize,
}

impl<'a> Line<'a> {
    fn of(subject: &'a str, env: &'a Envelope, size: usize) -> Line<'a> {
        Line {
            subject,
            kind: env.kind.as_str(),
            performative: env.performative.as_str(),
            from: &env.from,
            to: &env.to,
            name: env.name.as_deref(),
            topic: env.topic.as_deref(),
            id: env.id,
            correlation_id: env.conversation(),
            in_reply_to: env.in_reply_to,
            hops: env.hops,
            status: env.status.map(|s| s.0),
            trace_id: env.trace.as_ref().and_then(|t| {
                t.traceparent
                    .with_text(|text| text.split('-').nth(1).map(str::to_owned))
            }),
            session_id: env.session_id.as_deref(),
            customer_id: env.customer_id.as_deref(),
            task: env
                .headers
                .get(chorus_gateway::AGENTIFY_TASK_HEADER)
                .map(String::as_str),
            delivery: env.delivery.as_str(),
            timestamp_ms: env.timestamp_ms,
            time: rfc3339(env.timestamp_ms),
            size,
        }
    }
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let subjects = conn.subjects()?;
    chorus_sdk::subject::validate_pattern(&args.pattern)?;
    let everything = args.pattern == ">";
    let pattern = format!("{}.{}", subjects.root(), args.pattern);
    let broker = conn.broker(CONNECTION_NAME).await?;
    let mut bus = broker.subscribe(&pattern).await?;
    // Replies travel on each requester's inbox, outside the root.
    let mut replies = broker.subscribe("_INBOX.>").await?;
    broker.flush().await?;
    let _notices = super::connection_notices(&broker, conn.url());
    if everything {
        eprintln!(
            "tapping {pattern} and every reply at {} (Ctrl-C to stop)",
            conn.url()
        );
    } else {
        eprintln!(
            "tapping {pattern} and the replies to its requests at {} (Ctrl-C to stop)",
            conn.url()
        );
    }
    let stop = crate::shutdown_signal();
    tokio::pin!(stop);
    let mut asked = Asked::default();
    let mut seen = 0usize;
    loop {
        // In this order: a request reaches this connection before its reply (the reply is sent
        // after the request was received), so it is in `bus` by the time its reply is in
        // `replies`; taken first, it is known when its reply is looked at.
        let (msg, reply) = tokio::select! {
            biased;
            _ = &mut stop => break,
            m = bus.next() => (m, false),
            m = replies.next() => (m, true),
        };
        let Some(msg) = msg else { break };
        // Anything that is not an envelope (JetStream's own traffic, a foreign client) is not
        // Chorus's to show.
        let implied = subjects.implied(msg.subject());
        let Ok((env, _)) = chorus_sdk::codec::decode_on(msg.payload(), &implied) else {
            continue;
        };
        if reply {
            // A reply to a request the pattern did not show is other traffic.
            if !everything && !env.in_reply_to.is_some_and(|id| asked.contains(&id)) {
                continue;
            }
        } else if !everything && msg.reply().is_some() {
            asked.insert(env.id);
        }
        let line = Line::of(msg.subject(), &env, msg.payload().len());
        if args.json {
            print_json(&line)?;
        } else {
            outln!(
                "{} {:<9} {:<10} {} -> {} {} id={} corr={} hops={}{}{}{}{}{}",
                clock(env.timestamp_ms),
                line.kind,
                line.performative,
                line.from,
                if line.to.is_empty() {
                    "*".to_owned()
                } else {
                    line.to.join(",")
                },
                line.subject,
                short(&line.id),
                short(&line.correlation_id),
                line.hops,
                line.status
                    .map(|s| format!(" status={s}"))
                    .unwrap_or_default(),
                line.trace_id
                    .map(|t| format!(" trace={t}"))
                    .unwrap_or_default(),
                line.session_id
                    .map(|s| format!(" session={s}"))
                    .unwrap_or_default(),
                line.customer_id
                    .map(|c| format!(" customer={c}"))
                    .unwrap_or_default(),
                line.task
                    .map(|t| format!(" task={t:?}"))
                    .unwrap_or_default(),
            );
        }
        seen += 1;
        if args.count.is_some_and(|n| seen >= n) {
            break;
        }
    }
    let _ = broker.drain().await;
    Ok(ExitCode::SUCCESS)
}

/// The ids of the requests shown whose replies are still to come, the oldest forgotten first
/// beyond [`Asked::LIMIT`] (a request never answered must not hold memory for ever).
#[derive(Default)]
struct Asked {
    ids: std::collections::HashSet<uuid::Uuid>,
    order: std::collections::VecDeque<uuid::Uuid>,
}

impl Asked {
    const LIMIT: usize = 10_000;

    fn insert(&mut self, id: uuid::Uuid) {
        if self.ids.insert(id) {
            self.order.push_back(id);
        }
        while self.order.len() > Self::LIMIT {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
    }

    /// Whether `id` was asked (a stream of replies to one request shows each of them).
    fn contains(&self, id: &uuid::Uuid) -> bool {
        self.ids.contains(id)
    }
}

/// The last 12 hex digits of an id: the random part of a UUIDv7, enough to follow one by eye.
fn short(id: &uuid::Uuid) -> String {
    let s = id.simple().to_string();
    s[s.len() - 12..].to_owned()
}

/// A timestamp as the time of day, UTC, to the millisecond (`17:45:07.123Z`).
fn clock(ms: u64) -> String {
    const FORMAT: &[time::format_description::FormatItem<'static>] =
        time::macros::format_description!("[hour]:[minute]:[second].[subsecond digits:3]Z");
    at(ms)
        .and_then(|t| t.format(FORMAT).ok())
        .unwrap_or_else(|| ms.to_string())
}

/// A timestamp as RFC 3339, UTC (`2026-11-26T17:45:07.123Z`).
fn rfc3339(ms: u64) -> String {
    at(ms)
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| ms.to_string())
}

fn at(ms: u64) -> Option<time::OffsetDateTime> {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_as_times() {
        assert_eq!(clock(1_764_179_107_123), "17:45:07.123Z");
        assert_eq!(rfc3339(1_764_179_107_123), "2025-11-26T17:45:07.123Z");
    }

    #[test]
    fn asked_ids_are_bounded() {
        let mut asked = Asked::default();
        let first = uuid::Uuid::now_v7();
        asked.insert(first);
        for _ in 0..Asked::LIMIT {
            asked.insert(uuid::Uuid::now_v7());
        }
        assert!(!asked.contains(&first));
        assert_eq!(asked.ids.len(), Asked::LIMIT);
    }

    #[test]
    fn an_agentify_task_is_shown_and_a_message_without_one_shows_none() {
        use chorus_sdk::{Kind, Performative};
        let mut env = Envelope::new(Kind::Request, Performative::Request, "app");
        let plain = serde_json::to_value(Line::of("s", &env, 1)).expect("json");
        assert_eq!(plain.get("task"), None);
        env.headers.insert(
            chorus_gateway::AGENTIFY_TASK_HEADER.to_owned(),
            "Calculate 5 + 3".to_owned(),
        );
        let line = Line::of("s", &env, 1);
        assert_eq!(line.task, Some("Calculate 5 + 3"));
        assert_eq!(
            serde_json::to_value(&line).expect("json")["task"],
            "Calculate 5 + 3"
        );
    }
}
