//! Human durations in config ("250ms", "1s", "30s", "5m", "1h", "1d").
//!
//! We parse these ourselves instead of pulling in `humantime`: the accepted
//! grammar is part of the config contract, and it is deliberately small (one
//! number, one unit) so that a typo is an error rather than a surprise.

use std::time::Duration;

/// Parses `"<integer><unit>"` where unit is one of `ms`, `s`, `m`, `h`, `d`.
pub fn parse(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{s:?} has no unit (use ms, s, m, h or d)"))?;
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(format!("{s:?} does not start with a number"));
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: number too large"))?;
    let ms_per = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (use ms, s, m, h or d)"
            ))
        }
    };
    let ms = n
        .checked_mul(ms_per)
        .ok_or_else(|| format!("{s:?}: duration too large"))?;
    Ok(Duration::from_millis(ms))
}

/// Formats a duration the way the config accepts it (largest exact unit).
pub fn format(d: Duration) -> String {
    let ms = d.as_millis() as u64;
    for (unit, per) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= per && ms.is_multiple_of(per) {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

/// Serde adapter: a `Duration` written as a human string.
pub mod serde_human {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        super::parse(&s).map_err(serde::de::Error::custom)
    }

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format(*d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse("1s").unwrap(), Duration::from_secs(1));
        assert_eq!(parse("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse("1d").unwrap(), Duration::from_secs(86400));
        assert_eq!(parse(" 7s ").unwrap(), Duration::from_secs(7));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "s",
            "10",
            "1.5s",
            "10 s",
            "-1s",
            "3w",
            "1sm",
            "99999999999999999999d",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn format_round_trips() {
        for s in ["250ms", "1s", "90s", "5m", "1h", "1d", "1500ms"] {
            assert_eq!(format(parse(s).unwrap()), s);
        }
    }
}
