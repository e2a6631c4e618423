//! The scenarios one run of the demo acts out, in order, narrated through `say`.

use std::time::Duration;

use chorus_sdk::negotiate::{Negotiation, Policy};
use chorus_sdk::task::{TaskMessage, Verification};
use chorus_sdk::{BroadcastTarget, Call, SdkError, StatusCode};
use futures::StreamExt;

use super::model::{
    Calculation, DemoReport, OcrReport, Posting, ScannedDocument, Summary, TaskScenes,
};
use super::{Demo, ORCHESTRATOR, RELAY_HOP_LIMIT, WATCHERS};
use chorus_sdk::durable::DeadLetterQueue;

/// How long the orchestrator waits for each watcher's copy of the event.
const EVENT_WAIT: Duration = Duration::from_secs(5);
/// Between two looks at state the coordinator learns from heartbeats (who offers OCR, which
/// watchers there are) or from the ledger's retries (the dead letter).
const RETRY_EVERY: Duration = Duration::from_millis(100);
/// Looks at discovery before giving up: five seconds.
const DISCOVERY_TRIES: usize = 50;
/// Broadcasts sent before giving up on reaching every watcher: two seconds of retries.
const BROADCAST_TRIES: usize = 20;
/// How long each watcher has to answer the broadcast.
const BROADCAST_TIMEOUT: Duration = Duration::from_secs(2);
/// Looks at the dead-letter queue before giving up: ten seconds, past the ledger's retries.
const DEAD_LETTER_TRIES: usize = 100;
/// Progress reports the orchestrator waits for before it cancels the research.
const CANCEL_AFTER_PROGRESS: usize = 3;
/// Dead letters read per look.
const DEAD_LETTER_PAGE: usize = 1_000;

impl Demo {
    /// Runs every scenario once, printing what happens through `say`.
    pub async fn run(&self, say: fn(&str)) -> Result<DemoReport, SdkError> {
        let o = &self.orchestrator;

        let doc = ScannedDocument {
            name: "invoice-7.png".into(),
            lines: vec![
                "Invoice 7 for the design work".into(),
                "Paid on time, thanks for the great work".into(),
                "The balance is zero".into(),
            ],
        };
        say(&format!(
            "[AIXP] orchestrator -> capability ocr: scan {:?}",
            doc.name
        ));
        let ocr: OcrReport = o.request_capability("ocr", &doc).await?;
        say(&format!(
            "[AIXP] result ({}): {} words, most common {:?}, sentiment {} (analysed by {})",
            StatusCode::OK,
            ocr.analysis.word_count,
            ocr.analysis.most_common_word,
            ocr.analysis.sentiment,
            ocr.analysed_by
        ));

        let mut calculations = Vec::new();
        for (operation, operands) in [
            ("add", vec![2.0, 3.0, 5.0]),
            ("multiply", vec![6.0, 7.0]),
            ("divide", vec![1.0, 0.0]),
        ] {
            let label = format!("{operation} {operands:?}");
            let c = Calculation {
                operation: operation.into(),
                operands,
            };
            let result = o
                .command::<_, f64>("calculator", "calculation", &c)
                .await
                .map_err(|e| e.status());
            match &result {
                Ok(v) => say(&format!("[Agentify] calculator: {label} = {v}")),
                Err(code) => say(&format!(
                    "[Agentify] calculator: {label} refused with {code}"
                )),
            }
            calculations.push((label, result));
        }

        say("[events] orchestrator publishes task.completed to every watcher");
        let mut rx = self.events.lock().await;
        // What a round before this one left unheard is not this round's.
        while rx.try_recv().is_ok() {}
        o.publish("task.completed", "invoice-7 processed").await?;
        let mut event_receivers = Vec::new();
        while event_receivers.len() < WATCHERS.len() {
            match tokio::time::timeout(EVENT_WAIT, rx.recv()).await {
                Ok(Some(seen)) => {
                    say(&format!("[events]   {} got {}", seen.watcher, seen.event));
                    event_receivers.push(seen.watcher);
                }
                _ => break,
            }
        }
        drop(rx);

        let loop_status = match o.request::<_, u32>("relay-a", "relay", &0u32).await {
            Ok(_) => StatusCode::OK,
            Err(e) => e.status(),
        };
        say(&format!(
            "[loop] relay-a <-> relay-b bounce a message forever; stopped at hop {RELAY_HOP_LIMIT} with {loop_status}"
        ));

        // Discovery: the coordinator knows who offers OCR (it may need a heartbeat to learn).
        let mut discovered = Vec::new();
        for _ in 0..DISCOVERY_TRIES {
            discovered = o
                .discover_capability("ocr")
                .await?
                .into_iter()
                .map(|r| r.manifest.agent)
                .collect();
            if !discovered.is_empty() {
                break;
            }
            tokio::time::sleep(RETRY_EVERY).await;
        }
        say(&format!("[coordinator] discover ocr -> {discovered:?}"));

        // The coordinator may need a heartbeat to learn of every watcher: ask again until it has.
        let watchers = BroadcastTarget::Group("watchers".into());
        let mut broadcast = o
            .broadcast(&watchers, "status", &(), BROADCAST_TIMEOUT)
            .await?;
        for _ in 0..BROADCAST_TRIES {
            if broadcast.recipients.len() >= WATCHERS.len() {
                break;
            }
            tokio::time::sleep(RETRY_EVERY).await;
            broadcast = o
                .broadcast(&watchers, "status", &(), BROADCAST_TIMEOUT)
                .await?;
        }
        say(&format!(
            "[coordinator] broadcast status to group watchers: {} delivered, {} failed, {} timed out",
            broadcast.count(chorus_sdk::Outcome::Delivered),
            broadcast.count(chorus_sdk::Outcome::Failed),
            broadcast.count(chorus_sdk::Outcome::TimedOut)
        ));

        let receipt = o
            .send_durable(Call::agent("ledger", "post").command().payload(&Posting {
                account: "acme".into(),
                amount: -500,
            })?)
            .await?;
        say(&format!(
            "[dlq] orchestrator stores a poison posting for the ledger (message {})",
            receipt.id
        ));
        let dlq = DeadLetterQueue::new(o.broker().clone(), o.subjects().clone());
        let mut dead_letter = None;
        for _ in 0..DEAD_LETTER_TRIES {
            let entries = dlq.list(DEAD_LETTER_PAGE).await.map_err(SdkError::Broker)?;
            if let Some(e) = entries
                .into_iter()
                .find(|e| e.letter.message_id == Some(receipt.id))
            {
                say(&format!(
                    "[dlq] dead-lettered after {} attempts: {} ({}: {}); `chorus dlq show {}` shows it",
                    e.letter.attempts,
                    e.letter.reason.as_str(),
                    e.letter.status,
                    e.letter.detail,
                    e.id
                ));
                let newest = e.id;
                dead_letter = Some(e.letter);
                // The demo repeats every few seconds: it keeps only its newest dead letter, so
                // the queue (and its alert) shows what others leave, not one per round.
                for old in dlq.list(DEAD_LETTER_PAGE).await.map_err(SdkError::Broker)? {
                    if old.id != newest && is_demos(&old.letter, o.subjects()) {
                        dlq.remove(old.id).await.map_err(SdkError::Broker)?;
                    }
                }
                break;
            }
            tokio::time::sleep(RETRY_EVERY).await;
        }

        let tasks = self.tasks(say).await?;

        Ok(DemoReport {
            ocr,
            calculations,
            event_receivers,
            loop_status,
            discovered,
            broadcast,
            dead_letter,
            tasks,
        })
    }

    /// Tasks: a streamed result, a long task cancelled, a result that fails verification and
    /// is reassigned.
    async fn tasks(&self, say: fn(&str)) -> Result<TaskScenes, SdkError> {
        let o = &self.orchestrator;

        say("[tasks] orchestrator -> writer: draft \"agents\" (a task streaming its result)");
        let started = std::time::Instant::now();
        let draft = o
            .submit(Call::agent("writer", "draft").payload(&"agents")?)
            .await?;
        let mut updates = draft.updates().await?;
        let mut streamed = Vec::new();
        let mut first_chunk_ms = 0;
        while let Some(update) = updates.next().await {
            let update = update?;
            if update.chunk().is_some() {
                if streamed.is_empty() {
                    first_chunk_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(0);
                }
                streamed.push(update.payload_as::<String>()?);
            }
        }
        say(&format!(
            "[tasks]   {} chunks in order, the first after {first_chunk_ms} ms: {}",
            streamed.len(),
            streamed.join(" ")
        ));

        say("[tasks] orchestrator -> researcher: research (a long task), then cancels it");
        let research = o
            .submit(Call::agent("researcher", "research").payload(&"message buses")?)
            .await?;
        let mut updates = research.updates().await?;
        let mut research_progress = 0;
        while let Some(update) = updates.next().await {
            let update = update?;
            if update.kind == TaskMessage::Progress {
                research_progress += 1;
                say(&format!(
                    "[tasks]   progress {:.0}%: {}",
                    update.fraction().unwrap_or_default() * 100.0,
                    update.text().unwrap_or_default()
                ));
                if research_progress == CANCEL_AFTER_PROGRESS {
                    break;
                }
            }
        }
        let cancelled = research.cancel().await?;
        say(&format!(
            "[tasks]   cancelled: the task is {} ({}); `chorus task show {}` shows it",
            cancelled.state, cancelled.status, cancelled.id
        ));

        say(
            "[tasks] orchestrator -> summarize (verified: a summary of 10 characters or more), first at summarizer-fast",
        );
        let schema = serde_json::json!({
            "type": "object",
            "required": ["summary"],
            "properties": {"summary": {"type": "string", "minLength": 10}}
        });
        let verification = Verification::schema(&schema)?.max_attempts(3);
        let summary_task = o
            .submit_verified(Call::capability_at("summarizer-fast", "summarize").payload(
                &"Agents hand long work to each other as tasks. Each result is checked.",
            )?)
            .await?;
        let report = o.verify(&summary_task, &verification).await?;
        for (i, attempt) in report.attempts.iter().enumerate() {
            say(&format!(
                "[tasks]   attempt {} by {}: {}{}",
                i + 1,
                attempt.agent,
                match attempt.verified {
                    Some(true) => "passed",
                    Some(false) => "failed verification",
                    None => attempt.state.as_str(),
                },
                attempt
                    .note
                    .as_deref()
                    .map(|n| format!(" ({n})"))
                    .unwrap_or_default()
            ));
        }
        let summary: Summary = report.output_as()?;
        say(&format!("[tasks]   accepted: {:?}", summary.summary));

        say("[negotiate] orchestrator calls for proposals on summarize, the most confident wins");
        let award = o
            .negotiate(
                Negotiation::capability("summarize")
                    .payload(&"Bids are compared. The best one gets the work.")?
                    .bidders(["summarizer-fast", "summarizer-careful"])
                    .policy(Policy::MostConfident),
            )
            .await?;
        for bid in &award.bids {
            if let Some(p) = bid.proposal() {
                say(&format!(
                    "[negotiate]   {} proposes price {}, eta {} ms, confidence {}",
                    bid.agent,
                    p.price.unwrap_or_default(),
                    p.eta_ms.unwrap_or_default(),
                    p.confidence.unwrap_or_default()
                ));
            }
        }
        let awarded = award.task.result().await?;
        let awarded_summary: Summary = awarded.output_as()?;
        say(&format!(
            "[negotiate]   awarded to {} (task {}): {:?}; settlement on negotiation.settled",
            award.winner,
            award.task.id(),
            awarded_summary.summary
        ));
        if let Some(entry) = o.ledger().await?.entry(award.round).await? {
            say(&format!(
                "[negotiate]   {} credits from {} to {} in the ledger (`chorus credits` sums them)",
                entry.price, entry.payer, entry.payee
            ));
        }
        Ok(TaskScenes {
            streamed,
            first_chunk_ms,
            cancelled: cancelled.state,
            research_progress,
            summary_attempts: report
                .attempts
                .iter()
                .map(|a| (a.agent.clone(), a.verified))
                .collect(),
            summary: summary.summary,
            negotiated: (award.winner, award.bids.len()),
        })
    }
}

/// Whether a dead letter is one the demo left: its poison posting from its own orchestrator.
/// The envelope is read with what its subject implies: a compact one leaves out the command's
/// name, which its subject carries.
fn is_demos(letter: &chorus_sdk::durable::DeadLetter, subjects: &chorus_sdk::Subjects) -> bool {
    let implied = subjects.implied(&letter.subject);
    letter.agent == "ledger"
        && chorus_sdk::codec::decode_on(&letter.envelope, &implied)
            .is_ok_and(|(env, _)| env.from == ORCHESTRATOR && env.name.as_deref() == Some("post"))
}
