//! Durations on the command line: `250ms`, `5s`, `2m`, `1h`.

use std::time::Duration;

/// A duration that does not parse: what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DurationError(String);

/// Parses `<number><unit>` with unit `ms`, `s`, `m` or `h`.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    parse(text).map_err(DurationError)
}

/// Parses a timeout: a duration as [`parse_duration`] reads it, and longer than zero (a zero
/// timeout would give up before anything could answer).
pub fn parse_timeout(text: &str) -> Result<Duration, DurationError> {
    let duration = parse_duration(text)?;
    if duration.is_zero() {
        return Err(DurationError(format!(
            "{:?} is no time to wait: give a timeout above zero",
            text.trim()
        )));
    }
    Ok(duration)
}

fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .ok_or_else(|| format!("{text:?} has no unit (use ms, s, m or h)"))?;
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} does not start with a number"))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        other => return Err(format!("unknown unit {other:?} (use ms, s, m or h)")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("{text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_refuses_nonsense() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("1.5m"), Ok(Duration::from_secs(90)));
        for bad in ["", "5", "s", "5 parsecs", "-1s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for zero in ["0s", "0ms", "0.0h"] {
            let err = parse_timeout(zero).expect_err("zero refused");
            assert!(err.to_string().contains("above zero"), "{err}");
        }
        assert_eq!(parse_timeout("1ms"), Ok(Duration::from_millis(1)));
    }
}
