//! Reading the dead-letter stream back, and waiting for the inbox to drain.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use chorus_broker_adapter::{ErrorKind, JetStream};
use chorus_sdk::Subjects;
use chorus_sdk::codec;
use chorus_sdk::durable::{DLQ_STREAM, DeadLetter, INBOX_STREAM};

use crate::ledger::Letter;

/// How often a wait polls the server.
const POLL: Duration = Duration::from_millis(100);
/// How long the dead-letter stream may go unanswered (a leader being elected) before reading
/// it fails.
const READ_DEADLINE: Duration = Duration::from_secs(30);

/// Every dead letter in the stream, with the message id its payload decodes to (none for a
/// foreign or undecodable message).
pub(crate) async fn letters(js: &JetStream, subjects: &Subjects) -> anyhow::Result<Vec<Letter>> {
    let stream = subjects.stream_name(DLQ_STREAM);
    // A cluster still electing the stream's leader after a fault (slow on a loaded machine)
    // times a request out: asked again, up to a deadline.
    let deadline = Instant::now() + READ_DEADLINE;
    let state = loop {
        match js.stream_state(&stream).await {
            Ok(s) => break s,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e)
                if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::NoResponders)
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(POLL).await;
            }
            Err(e) => return Err(e).context("cannot read the dead-letter stream"),
        }
    };
    let mut out = Vec::new();
    if state.messages == 0 {
        return Ok(out);
    }
    for seq in state.first_seq..=state.last_seq {
        let stored = match js.get_message(&stream, seq).await {
            Ok(m) => m,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(e).context(format!("cannot read dead letter {seq}")),
        };
        let Ok(letter) = DeadLetter::from_stored(&stored.headers, stored.payload) else {
            continue;
        };
        let id = codec::decode(&letter.envelope).ok().and_then(|(env, _)| {
            codec::decode_payload::<u64>(&env.payload, &env.content_type).ok()
        });
        out.push(Letter {
            id,
            reason: letter.reason,
            status: letter.status,
        });
    }
    Ok(out)
}

/// Waits until the inbox stream holds nothing (every stored command acked, or dead-lettered
/// and removed), up to `limit`. Returns how long it took, or `None` if it did not drain.
pub(crate) async fn drained(
    js: &JetStream,
    subjects: &Subjects,
    limit: Duration,
) -> Option<Duration> {
    let inbox = subjects.stream_name(INBOX_STREAM);
    let started = Instant::now();
    tokio::time::timeout(limit, async {
        loop {
            if let Ok(state) = js.stream_state(&inbox).await
                && state.messages == 0
            {
                return;
            }
            tokio::time::sleep(POLL).await;
        }
    })
    .await
    .ok()
    .map(|()| started.elapsed())
}

/// Messages left in the inbox stream, if it can be read.
pub(crate) async fn inbox_depth(js: &JetStream, subjects: &Subjects) -> Option<u64> {
    js.stream_state(&subjects.stream_name(INBOX_STREAM))
        .await
        .ok()
        .map(|s| s.messages)
}
