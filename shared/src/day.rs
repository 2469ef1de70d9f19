//! UTC calendar days, the unit of the global tier.
//!
//! A day is the number of whole days since the Unix epoch (`u32`), which keeps
//! keys short and arithmetic trivial; it is rendered as `YYYY-MM-DD` for
//! humans (HTTP, dashboards) only.

/// Seconds in a UTC day (no leap seconds in Unix time).
pub const SECS_PER_DAY: u64 = 86_400;

/// The day number of a Unix timestamp in seconds.
pub fn of_unix_secs(secs: u64) -> u32 {
    (secs / SECS_PER_DAY) as u32
}

/// Today's day number from the local clock (used only where Redis' clock is
/// not at hand: the aggregator and the broadcast view).
pub fn today() -> u32 {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    of_unix_secs(secs)
}

/// Seconds from `secs` until the end of its UTC day.
pub fn secs_until_end(secs: u64) -> u64 {
    SECS_PER_DAY - secs % SECS_PER_DAY
}

/// `YYYY-MM-DD` of a day number (proleptic Gregorian, civil-from-days).
pub fn to_iso(day: u32) -> String {
    // Howard Hinnant's civil_from_days.
    let z = day as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso_dates() {
        assert_eq!(to_iso(0), "1970-01-01");
        assert_eq!(to_iso(of_unix_secs(951_782_400)), "2000-02-29");
        assert_eq!(to_iso(of_unix_secs(1_795_219_200)), "2026-11-21");
    }

    #[test]
    fn end_of_day() {
        assert_eq!(secs_until_end(0), 86_400);
        assert_eq!(secs_until_end(86_399), 1);
    }
}
