//! What the demo agents exchange, and what one run of the scenarios reports.

use chorus_sdk::durable::DeadLetter;
use chorus_sdk::{BroadcastReport, StatusCode, TaskState};
use serde::{Deserialize, Serialize};

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

/// A watcher's word to the orchestrator that it got one of its events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seen {
    /// The watcher's id.
    pub watcher: String,
    /// The event: its topic and payload.
    pub event: String,
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
    /// The task scenarios.
    pub tasks: TaskScenes,
}

/// What a summarizer answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// The summary.
    pub summary: String,
}

/// What the task scenarios showed.
#[derive(Debug, Clone)]
pub struct TaskScenes {
    /// The writer's streamed draft, chunk by chunk, in order.
    pub streamed: Vec<String>,
    /// Milliseconds from submitting the draft to its first chunk.
    pub first_chunk_ms: u64,
    /// How the long research task ended after its cancel.
    pub cancelled: TaskState,
    /// Progress reports the research made before it was cancelled.
    pub research_progress: usize,
    /// The verified summary's attempts: agent and verdict, in order.
    pub summary_attempts: Vec<(String, Option<bool>)>,
    /// The summary accepted.
    pub summary: String,
    /// The contract-net round: its winner and how many bid.
    pub negotiated: (String, usize),
}

/// A ledger entry; a negative amount is poison.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Posting {
    /// Account.
    pub account: String,
    /// Amount in cents.
    pub amount: i64,
}
