//! The scenarios one run of the demo acts out, in order, narrated through `say`.

use std::time::Duration;

use agent_sdk::{BroadcastTarget, Call, SdkError, StatusCode};

use super::model::{Calculation, DemoReport, OcrReport, Posting, ScannedDocument};
use super::{Demo, ORCHESTRATOR, RELAY_HOP_LIMIT, WATCHERS};
use crate::service::dlq::DeadLetterQueue;

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
        o.publish("task.completed", "invoice-7 processed").await?;
        let mut event_receivers = Vec::new();
        let mut rx = self.events.lock().await;
        while event_receivers.len() < WATCHERS.len() {
            match tokio::time::timeout(EVENT_WAIT, rx.recv()).await {
                Ok(Some((who, what))) => {
                    say(&format!("[events]   {who} got {what}"));
                    event_receivers.push(who);
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
            broadcast.count(agent_sdk::Outcome::Delivered),
            broadcast.count(agent_sdk::Outcome::Failed),
            broadcast.count(agent_sdk::Outcome::TimedOut)
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
                    if old.id != newest && is_demos(&old.letter) {
                        dlq.remove(old.id).await.map_err(SdkError::Broker)?;
                    }
                }
                break;
            }
            tokio::time::sleep(RETRY_EVERY).await;
        }

        Ok(DemoReport {
            ocr,
            calculations,
            event_receivers,
            loop_status,
            discovered,
            broadcast,
            dead_letter,
        })
    }
}

/// Whether a dead letter is one the demo left: its poison posting from its own orchestrator.
fn is_demos(letter: &agent_sdk::durable::DeadLetter) -> bool {
    letter.agent == "ledger"
        && agent_sdk::codec::decode(&letter.envelope)
            .is_ok_and(|(env, _)| env.from == ORCHESTRATOR && env.name.as_deref() == Some("post"))
}
