//! The demo agents' own work, free of any messaging: text analysis and arithmetic.

use std::collections::HashMap;

use chorus_sdk::HandlerError;

use super::model::{Analysis, Calculation, Summary};

pub(super) fn analyse(text: &str) -> Analysis {
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

pub(super) fn calculate(c: &Calculation) -> Result<f64, HandlerError> {
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

/// The writer's draft on `topic`, word by word: a haiku it streams.
pub(super) fn draft(topic: &str) -> Vec<String> {
    format!("{topic} on the wire / each token finds its listener / the stream never gaps")
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// A summary of `text`: the careful summarizer keeps the first sentence whole, the fast one
/// only its first word (too short for the orchestrator's check).
pub(super) fn summarize(text: &str, careful: bool) -> Summary {
    let first = text.split('.').next().unwrap_or_default().trim();
    let summary = if careful {
        first.to_owned()
    } else {
        first
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    Summary { summary }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_sdk::StatusCode;

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

    #[test]
    fn the_fast_summary_is_too_short_and_the_careful_one_keeps_the_sentence() {
        let text = "Chorus carries tasks with progress and results. The rest is detail.";
        assert_eq!(summarize(text, false).summary, "Chorus");
        assert_eq!(
            summarize(text, true).summary,
            "Chorus carries tasks with progress and results"
        );
        assert_eq!(draft("bus").len(), 15);
    }
}
