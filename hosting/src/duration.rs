//! Durations as people write them: `250ms`, `5s`, `2m`, `1h`. The `chorus` command reads its
//! options with these, and agent manifests (`crate::manifest`) write their durations so, which
//! is why the parser lives here and the CLI re-exports it.

use std::time::Duration;

/// A duration that does not parse: what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DurationError(String);

/// Parses `<number><unit>` with unit `ms`, `s`, `m` or `h`.
///
/// # Errors
/// [`DurationError`] when `text` has no number, no unit or an unknown one, or is negative or
/// too long for a [`Duration`].
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    parse(text).map_err(DurationError)
}

/// Parses a timeout: a duration as [`parse_duration`] reads it, and longer than zero (a zero
/// timeout would give up before anything could answer).
///
/// # Errors
/// [`DurationError`] as [`parse_duration`] fails, and when the duration is zero.
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

/// Writes `duration` in the syntax [`parse_duration`] reads, in the largest unit that holds it
/// exactly (`10m`, `30s`, `500ms`), so that parsing the text gives `duration` back. A duration
/// finer than a millisecond is written in seconds with nine decimals (`0.000001500s`), which
/// parses back exactly up to about 100 days (the precision of an `f64`).
///
/// ```
/// use std::time::Duration;
/// use chorus_hosting::duration::{format_duration, parse_duration};
///
/// assert_eq!(format_duration(Duration::from_secs(600)), "10m");
/// assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
/// assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
/// ```
pub fn format_duration(duration: Duration) -> String {
    const MINUTE: u64 = 60;
    const HOUR: u64 = 3600;
    let secs = duration.as_secs();
    let nanos = duration.subsec_nanos();
    if nanos == 0 {
        if secs == 0 {
            "0s".to_owned()
        } else if secs.is_multiple_of(HOUR) {
            format!("{}h", secs / HOUR)
        } else if secs.is_multiple_of(MINUTE) {
            format!("{}m", secs / MINUTE)
        } else {
            format!("{secs}s")
        }
    } else if nanos.is_multiple_of(1_000_000) {
        format!("{}ms", duration.as_millis())
    } else {
        format!("{secs}.{nanos:09}s")
    }
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

    #[test]
    fn formats_in_the_largest_exact_unit_and_parses_back() {
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_millis(1), "1ms"),
            (Duration::from_millis(500), "500ms"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(600), "10m"),
            (Duration::from_secs(7200), "2h"),
            (Duration::from_nanos(1_500), "0.000001500s"),
            (Duration::new(86_399, 999_999_999), "86399.999999999s"),
        ];
        for (duration, text) in cases {
            assert_eq!(format_duration(duration), text);
            assert_eq!(parse_duration(text), Ok(duration), "{text}");
        }
        // Any millisecond count up to a day, and nanosecond counts, come back exact.
        for millis in (0..86_400_000u64).step_by(7_919) {
            let duration = Duration::from_millis(millis);
            assert_eq!(parse_duration(&format_duration(duration)), Ok(duration));
        }
        for nanos in (0..86_400_000_000_000u64).step_by(7_919_000_017) {
            let duration = Duration::from_nanos(nanos);
            assert_eq!(parse_duration(&format_duration(duration)), Ok(duration));
        }
    }
}
