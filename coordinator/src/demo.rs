//! The demo behind `chorus up`: small agents acting out the source documents' own scenarios.
//!
//! - AIXP: an OCR agent reads a scanned document and hands the text to an NLP agent, which
//!   answers with a word count, the most common word and a sentiment.
//! - Agentify: an orchestrator asks the calculator agent (`agent.calculator.calculation`) to
//!   compute, including a division by zero that comes back as a coded error.
//! - Events: the orchestrator announces a finished task; three watchers each receive it.
//! - Loop protection: two agents that relay to each other forever are stopped at the hop limit.
//! - Coordinator: discovery of the OCR capability, a broadcast to the watcher group with its
//!   per-recipient report, and a poison durable command retried and then dead-lettered.

use std::collections::HashMap;
use std::time::Duration;

use agent_sdk::durable::DeadLetter;
use agent_sdk::{
    Agent, AgentOptions, BroadcastReport, BroadcastTarget, Call, Context, HandlerError,
    RetryPolicies, RetryPolicy, SdkError, StatusCode,
};

use crate::service::dlq::DeadLetterQueue;
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, mpsc};

/// A scanned page, as the OCR agent receives it. The "image" is its lines of text.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScannedDocument {
    /// File name.
    pub name: String,
    /// What the scanner saw, line by line.
    pub lines: Vec<String>,
}

/// The NLP agent's analysis (the fields of AIXP's text-analysis example).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Analysis {
    /// Number of words.
    pub word_count: usize,
    /// The most frequent word (lower case; ties go to the alphabetically first).
    pub most_common_word: String,
    /// `positive`, `negative` or `neutral`.
    pub sentiment: String,
}

/// What the OCR agent returns: the text it read and the NLP agent's analysis of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OcrReport {
    /// The document's name.
    pub document: String,
    /// The recognised text.
    pub text: String,
    /// The analysis.
    pub analysis: Analysis,
    /// Who analysed it.
    pub analysed_by: String,
}

/// Agentify's calculation request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Calculation {
    /// `add`, `subtract`, `multiply` or `divide`.
    pub operation: String,
    /// The operands, applied left to right.
    pub operands: Vec<f64>,
}

/// What one run of the scenarios produced.
#[derive(Debug, Clone)]
pub struct DemoReport {
    /// The AIXP hand-off's result.
    pub ocr: OcrReport,
    /// Each calculation asked and its result or error code.
    pub calculations: Vec<(String, Result<f64, StatusCode>)>,
    /// Which watchers received the task event.
    pub event_receivers: Vec<String>,
    /// The status the relay loop ended with.
    pub loop_status: StatusCode,
    /// Agents discovered for capability `ocr`, least loaded first.
    pub discovered: Vec<String>,
    /// The broadcast to the watchers.
    pub broadcast: BroadcastReport,
    /// The poison command's dead letter.
    pub dead_letter: Option<DeadLetter>,
}

/// A ledger entry; a negative amount is poison.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Posting {
    /// Account.
    pub account: String,
    /// Amount in cents.
    pub amount: i64,
}

const WATCHERS: [&str; 3] = ["audit", "dashboard", "notifier"];
const RELAY_HOP_LIMIT: u8 = 8;
/// Attempts the ledger makes before a poison posting is dead-lettered.
pub const LEDGER_ATTEMPTS: u32 = 3;

/// The running demo agents.
#[derive(Debug)]
pub struct Demo {
    agents: Vec<Agent>,
    orchestrator: Agent,
    events: Mutex<mpsc::UnboundedReceiver<(String, String)>>,
}

fn analyse(text: &str) -> Analysis {
    const POSITIVE: [&str; 6] = ["good", "great", "paid", "thanks", "excellent", "on-time"];
    const NEGATIVE: [&str; 5] = ["late", "overdue", "error", "bad", "missing"];
    let words: Vec<String> = text
        .split_whitespace()
        .map(|w| {
            w.trim_matches(|c: char| !c.is_alphanumeric() && c != '-')
                .to_lowercase()
        })
        .filter(|w| !w.is_empty())
        .collect();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for w in &words {
        *counts.entry(w.as_str()).or_default() += 1;
    }
    let most_common_word = counts
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
        .map(|(w, _)| (*w).to_owned())
        .unwrap_or_default();
    let score: i32 = words
        .iter()
        .map(|w| {
            i32::from(POSITIVE.contains(&w.as_str())) - i32::from(NEGATIVE.contains(&w.as_str()))
        })
        .sum();
    let sentiment = match score {
        s if s > 0 => "positive",
        s if s < 0 => "negative",
        _ => "neutral",
    };
    Analysis {
        word_count: words.len(),
        most_common_word,
        sentiment: sentiment.to_owned(),
    }
}

fn calculate(c: &Calculation) -> Result<f64, HandlerError> {
    let (first, rest) = c
        .operands
        .split_first()
        .ok_or_else(|| HandlerError::invalid_argument("no operands"))?;
    rest.iter()
        .try_fold(*first, |acc, x| match c.operation.as_str() {
            "add" => Ok(acc + x),
            "subtract" => Ok(acc - x),
            "multiply" => Ok(acc * x),
            "divide" if *x == 0.0 => Err(HandlerError::invalid_argument("division by zero")),
            "divide" => Ok(acc / x),
            other => Err(HandlerError::invalid_argument(format!(
                "unknown operation {other:?}"
            ))),
        })
}

impl Demo {
    /// Connects the demo agents to `servers` and registers their handlers.
    pub async fn start(servers: &str, say: fn(&str)) -> Result<Demo, SdkError> {
        let connect = |id: &str| AgentOptions::new(id).servers([servers]).connect();

        let ocr = connect("ocr-agent").await?;
        ocr.on_capability("ocr", move |ctx: Context, doc: ScannedDocument| async move {
            let text = doc.lines.join(" ");
            say(&format!(
                "[AIXP]   ocr-agent read {:?}: {} lines -> handing the text to capability nlp.analyze",
                doc.name,
                doc.lines.len()
            ));
            let reply = ctx
                .call(agent_sdk::Call::capability("nlp.analyze").payload(&text)?)
                .await?;
            Ok::<_, HandlerError>(OcrReport {
                document: doc.name,
                text,
                analysis: reply.payload_as()?,
                analysed_by: reply.envelope.from,
            })
        })
        .await?;

        let nlp = connect("nlp-agent").await?;
        nlp.on_capability(
            "nlp.analyze",
            move |ctx: Context, text: String| async move {
                let analysis = analyse(&text);
                say(&format!(
                    "[AIXP]   nlp-agent analysed text from {} (hop {}): {} words",
                    ctx.from(),
                    ctx.message().hops,
                    analysis.word_count
                ));
                Ok::<_, HandlerError>(analysis)
            },
        )
        .await?;

        let calculator = connect("calculator").await?;
        calculator
            .on_command("calculation", |_ctx: Context, c: Calculation| async move {
                calculate(&c)
            })
            .await?;

        // Two agents that relay to each other: a loop the hop limit cuts.
        let mut relays = Vec::new();
        for (me, peer) in [("relay-a", "relay-b"), ("relay-b", "relay-a")] {
            let relay = AgentOptions::new(me)
                .servers([servers])
                .hop_limit(RELAY_HOP_LIMIT)
                .connect()
                .await?;
            relay
                .on_command("relay", move |ctx: Context, n: u32| async move {
                    Ok::<u32, HandlerError>(ctx.request(peer, "relay", &(n + 1)).await?)
                })
                .await?;
            relays.push(relay);
        }

        // The ledger takes postings through its durable inbox; a negative amount always fails.
        let ledger = AgentOptions::new("ledger")
            .servers([servers])
            .durable_inbox(true)
            .retry_policies(RetryPolicies {
                default: RetryPolicy {
                    max_attempts: LEDGER_ATTEMPTS,
                    initial_backoff_ms: 200,
                    max_backoff_ms: 1_000,
                    ..RetryPolicy::default()
                },
                rules: Vec::new(),
            })
            .connect()
            .await?;
        ledger
            .on_command("post", move |ctx: Context, p: Posting| async move {
                if p.amount < 0 {
                    say(&format!(
                        "[dlq]   ledger refuses posting {} of {} (attempt from {})",
                        p.account,
                        p.amount,
                        ctx.from()
                    ));
                    return Err(HandlerError::failed("negative amount"));
                }
                Ok(())
            })
            .await?;

        let (tx, rx) = mpsc::unbounded_channel();
        let mut watchers = Vec::new();
        for name in WATCHERS {
            let watcher = AgentOptions::new(name)
                .servers([servers])
                .group("watchers")
                .connect()
                .await?;
            watcher
                .on_command("status", |ctx: Context, (): ()| async move {
                    Ok::<_, HandlerError>(format!("{} ok", ctx.agent_id()))
                })
                .await?;
            let tx = tx.clone();
            watcher
                .on_event("task.>", move |ctx: Context, task: String| {
                    let tx = tx.clone();
                    async move {
                        let topic = ctx.message().topic.clone().unwrap_or_default();
                        let _ = tx.send((name.to_owned(), format!("{topic}: {task}")));
                        Ok(())
                    }
                })
                .await?;
            watchers.push(watcher);
        }

        let orchestrator = connect("orchestrator").await?;
        let mut agents = vec![ocr, nlp, calculator, ledger];
        agents.extend(relays);
        agents.extend(watchers);
        agents.push(orchestrator.clone());
        Ok(Demo {
            agents,
            orchestrator,
            events: Mutex::new(rx),
        })
    }

    /// The agents' ids.
    pub fn agent_ids(&self) -> Vec<String> {
        self.agents.iter().map(|a| a.id().to_owned()).collect()
    }

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
            match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
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
        for _ in 0..50 {
            discovered = o
                .discover_capability("ocr")
                .await?
                .into_iter()
                .map(|r| r.manifest.agent)
                .collect();
            if !discovered.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        say(&format!("[coordinator] discover ocr -> {discovered:?}"));

        // The coordinator may need a heartbeat to learn of every watcher: ask again until it has.
        let watchers = BroadcastTarget::Group("watchers".into());
        let mut broadcast = o
            .broadcast(&watchers, "status", &(), Duration::from_secs(2))
            .await?;
        for _ in 0..20 {
            if broadcast.recipients.len() >= WATCHERS.len() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            broadcast = o
                .broadcast(&watchers, "status", &(), Duration::from_secs(2))
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
        for _ in 0..100 {
            let entries = dlq.list(1_000).await.map_err(SdkError::Broker)?;
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
                dead_letter = Some(e.letter);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
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

    /// Shuts every demo agent down gracefully.
    pub async fn shutdown(self) {
        for agent in &self.agents {
            agent.shutdown().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn analysis_matches_the_aixp_example() {
        let a = analyse("The quick brown fox jumps over the lazy dog.");
        assert_eq!(a.word_count, 9);
        assert_eq!(a.most_common_word, "the");
        assert_eq!(a.sentiment, "neutral");
    }

    #[test]
    fn calculation_follows_agentify() {
        let c = |op: &str, v: Vec<f64>| {
            calculate(&Calculation {
                operation: op.into(),
                operands: v,
            })
        };
        assert_eq!(c("add", vec![1.0, 2.0, 3.0]), Ok(6.0));
        assert_eq!(
            c("divide", vec![1.0, 0.0]).map_err(|e| e.status),
            Err(StatusCode::INVALID_ARGUMENT)
        );
        assert!(c("add", vec![]).is_err());
    }
}
