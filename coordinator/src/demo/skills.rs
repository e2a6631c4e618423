//! The demo agents' own work, free of any messaging: text analysis and arithmetic.

use std::collections::HashMap;

use agent_sdk::HandlerError;

use super::model::{Analysis, Calculation};

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

#[cfg(test)]
mod tests {
    use super::*;
    use agent_sdk::StatusCode;

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
