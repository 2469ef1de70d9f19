//! Calendar periods of the global tier: hour, day, ISO week and calendar
//! month, in UTC.
//!
//! A global counter is kept per (tenant, period). A period is named by its
//! kind and its **index**: hours, days, ISO weeks or calendar months since
//! the Unix epoch. The index is what every layer stores and sends (Redis
//! fields, Kafka keys, wire records), because it is small, orders like time
//! and is cheap to compare; its bounds in ms come from [`Period::start_ms`]
//! and [`Period::end_ms`], computed here only (the decision script is handed
//! the bounds by the node and never does calendar arithmetic: logic lives in
//! Rust).
//!
//! Why indexes and not "the period containing t" recomputed everywhere: a
//! decision belongs to the period of the one clock that decides (Redis'
//! TIME, `decision.rs`), and every later step (publish, merge, broadcast,
//! view, refund) must agree on it without a clock of its own. The index is
//! that agreement.
//!
//! **Time zones** (`zone.rs`): a period may be counted in an IANA zone. Its
//! index is then counted on the zone's own calendar (local days, ISO weeks
//! and months since 1970-01-01 local), so a period's id is its local start
//! and a day with a daylight-saving change is 23 or 25 hours long. An hour
//! in a zone is the zone's clock hour: in a zone whose offset is a whole
//! number of hours (Europe/Berlin, America/New_York) the UTC hour, in
//! Asia/Kolkata the hour from :30 UTC; hours are numbered since the epoch
//! either way, so an hour repeated when clocks go back is two periods.
//! The zone is part of the period (`label` appends `@<zone>`), so a UTC
//! period is byte for byte what it was before zones existed.
//!
//! The day's label is the bare day number, so today's UTC-day counters keep
//! byte-identical Redis fields (`g:<day>:`) and Kafka keys
//! (`tenant|day|actor|node`) through the upgrade; the other kinds take a
//! letter (`h`, `w`, `m`) that no day number starts with.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::zone::Zone;

const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 86_400_000;
/// 1970-01-01 was a Thursday: ISO week 0 (of this numbering) starts on
/// Monday 1969-12-29, three days earlier.
const WEEK_OFFSET_DAYS: i64 = 3;

/// The length of a global tier's period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PeriodKind {
    Hour,
    Day,
    /// ISO week: Monday 00:00 to the next Monday 00:00.
    Week,
    /// Calendar month: the 1st 00:00 to the next month's 1st 00:00.
    Month,
}

impl PeriodKind {
    pub const ALL: [PeriodKind; 4] = [
        PeriodKind::Hour,
        PeriodKind::Day,
        PeriodKind::Week,
        PeriodKind::Month,
    ];

    /// The name used in configuration, metrics labels and headers.
    pub fn name(self) -> &'static str {
        match self {
            PeriodKind::Hour => "hour",
            PeriodKind::Day => "day",
            PeriodKind::Week => "week",
            PeriodKind::Month => "month",
        }
    }

    /// The wire code (v3): stable, never reused.
    pub fn code(self) -> u8 {
        match self {
            PeriodKind::Hour => 1,
            PeriodKind::Day => 2,
            PeriodKind::Week => 3,
            PeriodKind::Month => 4,
        }
    }

    pub fn from_code(code: u8) -> Option<PeriodKind> {
        Some(match code {
            1 => PeriodKind::Hour,
            2 => PeriodKind::Day,
            3 => PeriodKind::Week,
            4 => PeriodKind::Month,
            _ => return None,
        })
    }

    pub fn parse(s: &str) -> Option<PeriodKind> {
        PeriodKind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// The letter a non-day period's label starts with (the day has none:
    /// its label is the bare day number, as before periods existed).
    fn letter(self) -> &'static str {
        match self {
            PeriodKind::Hour => "h",
            PeriodKind::Day => "",
            PeriodKind::Week => "w",
            PeriodKind::Month => "m",
        }
    }

    /// The longest a period of this kind lasts, ms (a month: 31 days).
    pub fn max_len_ms(self) -> u64 {
        match self {
            PeriodKind::Hour => HOUR_MS as u64,
            PeriodKind::Day => DAY_MS as u64,
            PeriodKind::Week => 7 * DAY_MS as u64,
            PeriodKind::Month => 31 * DAY_MS as u64,
        }
    }

    /// The period of this kind containing `ms` (Unix time), in UTC.
    pub fn at(self, ms: u64) -> Period {
        self.at_in(Zone::UTC, ms)
    }

    /// The period of this kind containing `ms` (Unix time) on `zone`'s
    /// calendar.
    pub fn at_in(self, zone: Zone, ms: u64) -> Period {
        let ms = ms as i64;
        let offset = zone.offset_ms(ms);
        let local = ms + offset;
        let index = match self {
            // The zone's clock hour starts `offset mod 1 h` before a UTC
            // hour; it takes that UTC hour's number.
            PeriodKind::Hour => (ms + offset.rem_euclid(HOUR_MS)).div_euclid(HOUR_MS),
            PeriodKind::Day => local.div_euclid(DAY_MS),
            PeriodKind::Week => (local.div_euclid(DAY_MS) + WEEK_OFFSET_DAYS).div_euclid(7),
            PeriodKind::Month => {
                let (y, m, _) = civil_from_days(local.div_euclid(DAY_MS));
                (y - 1970) * 12 + (m as i64 - 1)
            }
        };
        Period {
            kind: self,
            index: index.clamp(0, u32::MAX as i64) as u32,
            zone,
        }
    }
}

impl fmt::Display for PeriodKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One period: its kind, its index since the Unix epoch on its zone's
/// calendar, and the zone (UTC unless a tier names one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Period {
    pub kind: PeriodKind,
    pub index: u32,
    #[serde(default, skip_serializing_if = "Zone::is_utc_ref")]
    pub zone: Zone,
}

impl Period {
    /// The UTC day `day` (days since 1970-01-01): the global tier before
    /// periods existed, and still the default one.
    pub fn day(day: u32) -> Period {
        Period::utc(PeriodKind::Day, day)
    }

    /// The UTC period of `kind` numbered `index`.
    pub fn utc(kind: PeriodKind, index: u32) -> Period {
        Period {
            kind,
            index,
            zone: Zone::UTC,
        }
    }

    /// Start, ms since the epoch. Negative only for UTC week 0, which
    /// starts on 1969-12-29.
    pub fn start_ms(self) -> i64 {
        let i = self.index as i64;
        match self.kind {
            // `at_in`'s inverse: the clock hour starts `offset mod 1 h`
            // before the UTC hour numbered `index`.
            PeriodKind::Hour => i * HOUR_MS - self.zone.offset_ms(i * HOUR_MS).rem_euclid(HOUR_MS),
            PeriodKind::Day => self.zone.day_start_ms(i),
            PeriodKind::Week => self.zone.day_start_ms(i * 7 - WEEK_OFFSET_DAYS),
            PeriodKind::Month => {
                let y = 1970 + i.div_euclid(12);
                let m = (i.rem_euclid(12) + 1) as u32;
                self.zone.day_start_ms(days_from_civil(y, m, 1))
            }
        }
    }

    /// End (exclusive), ms: the next period's start.
    pub fn end_ms(self) -> i64 {
        self.next().start_ms()
    }

    pub fn len_ms(self) -> u64 {
        (self.end_ms() - self.start_ms()) as u64
    }

    pub fn next(self) -> Period {
        Period {
            index: self.index.saturating_add(1),
            ..self
        }
    }

    pub fn prev(self) -> Period {
        Period {
            index: self.index.saturating_sub(1),
            ..self
        }
    }

    /// Whether `ms` falls in this period.
    pub fn contains(self, ms: u64) -> bool {
        let ms = ms as i64;
        self.start_ms() <= ms && ms < self.end_ms()
    }

    /// Ms left in the period at `ms` (0 once it has ended).
    pub fn left_ms(self, ms: u64) -> u64 {
        (self.end_ms() - ms as i64).max(0) as u64
    }

    /// The label stored in Redis fields (`g:<label>:`), dirty-set members
    /// (`T|<label>`) and Kafka keys: the bare day number for a day (as
    /// before periods existed), a letter and the index otherwise, and
    /// `@<zone>` after it in a zone other than UTC (`20419@Europe/Berlin`).
    /// IANA names hold no `|`, `:` or `@`, which the keys split on.
    pub fn label(self) -> String {
        if self.zone.is_utc() {
            format!("{}{}", self.kind.letter(), self.index)
        } else {
            format!("{}{}@{}", self.kind.letter(), self.index, self.zone)
        }
    }

    /// Parses a [`label`](Self::label).
    pub fn parse_label(s: &str) -> Option<Period> {
        let (s, zone) = match s.split_once('@') {
            Some((s, name)) => match Zone::named(name) {
                Ok(z) if !z.is_utc() => (s, z),
                _ => return None,
            },
            None => (s, Zone::UTC),
        };
        let (kind, digits) = match s.as_bytes().first()? {
            b'h' => (PeriodKind::Hour, &s[1..]),
            b'w' => (PeriodKind::Week, &s[1..]),
            b'm' => (PeriodKind::Month, &s[1..]),
            b'0'..=b'9' => (PeriodKind::Day, s),
            _ => return None,
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(Period {
            kind,
            index: digits.parse().ok()?,
            zone,
        })
    }

    /// A human name on the period's own calendar: `2026-11-27T15`
    /// (hour), `2026-11-27` (day), `2026-W48` (ISO week), `2026-11`
    /// (month); an hour in a zone other than UTC adds its offset
    /// (`2026-10-25T02+01:00`: that hour happens twice in Berlin). For
    /// headers, the API and logs; never parsed back.
    pub fn human(self) -> String {
        let utc_start = self.start_ms();
        let offset = self.zone.offset_ms(utc_start);
        let start = utc_start + offset;
        let (y, m, d) = civil_from_days(start.div_euclid(DAY_MS));
        match self.kind {
            PeriodKind::Hour if !self.zone.is_utc() => {
                let sign = if offset < 0 { '-' } else { '+' };
                let a = offset.abs() / 60_000;
                format!(
                    "{y:04}-{m:02}-{d:02}T{:02}{sign}{:02}:{:02}",
                    start.rem_euclid(DAY_MS) / HOUR_MS,
                    a / 60,
                    a % 60
                )
            }
            PeriodKind::Hour => format!(
                "{y:04}-{m:02}-{d:02}T{:02}",
                start.rem_euclid(DAY_MS) / HOUR_MS
            ),
            PeriodKind::Day => format!("{y:04}-{m:02}-{d:02}"),
            PeriodKind::Week => {
                // The ISO year is the year of the week's Thursday.
                let (iy, _, _) = civil_from_days(start.div_euclid(DAY_MS) + 3);
                let jan4 = days_from_civil(iy, 1, 4);
                let week1_monday = jan4 - (jan4 + WEEK_OFFSET_DAYS).rem_euclid(7);
                let n = (start.div_euclid(DAY_MS) - week1_monday) / 7 + 1;
                format!("{iy:04}-W{n:02}")
            }
            PeriodKind::Month => format!("{y:04}-{m:02}"),
        }
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.kind, self.human())?;
        if !self.zone.is_utc() {
            write!(f, " {}", self.zone)?;
        }
        Ok(())
    }
}

/// (year, month 1..=12, day 1..=31) of a day number (days since
/// 1970-01-01), proleptic Gregorian. Howard Hinnant's `civil_from_days`.
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// The day number of (year, month, day), proleptic Gregorian. Howard
/// Hinnant's `days_from_civil`.
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(y: i64, m: u32, d: u32, h: i64) -> u64 {
        (days_from_civil(y, m, d) * DAY_MS + h * HOUR_MS) as u64
    }

    #[test]
    fn month_lengths_follow_the_calendar() {
        for (y, m, days) in [
            (2026, 11, 30),
            (2026, 12, 31),
            (2027, 1, 31),
            (2027, 2, 28),
            (2028, 2, 29),
            (2100, 2, 28),
            (2000, 2, 29),
            (2026, 4, 30),
        ] {
            let p = PeriodKind::Month.at(ms(y, m, 15, 12));
            assert_eq!(p.len_ms(), days * DAY_MS as u64, "{y}-{m}");
            assert_eq!(p.start_ms() as u64, ms(y, m, 1, 0));
            assert_eq!(p.human(), format!("{y:04}-{m:02}"));
        }
        // December → January: the next month is the next year's first.
        let dec = PeriodKind::Month.at(ms(2026, 12, 31, 23));
        assert_eq!(dec.next().human(), "2027-01");
        assert_eq!(dec.end_ms() as u64, ms(2027, 1, 1, 0));
        assert_eq!(PeriodKind::Month.at(ms(2027, 1, 1, 0)), dec.next());
    }

    #[test]
    fn iso_weeks_start_on_monday_across_a_year_end() {
        // 2026-12-28 is a Monday; its week is 2026-W53 (2026 has 53 ISO
        // weeks), and the next Monday, 2027-01-04, starts 2027-W01.
        let w = PeriodKind::Week.at(ms(2026, 12, 31, 12));
        assert_eq!(w.start_ms() as u64, ms(2026, 12, 28, 0));
        assert_eq!(w.human(), "2026-W53");
        assert_eq!(PeriodKind::Week.at(ms(2027, 1, 3, 23)), w);
        assert_eq!(PeriodKind::Week.at(ms(2027, 1, 4, 0)).human(), "2027-W01");
        // 2024-12-30 (Monday) starts 2025-W01.
        assert_eq!(PeriodKind::Week.at(ms(2024, 12, 31, 0)).human(), "2025-W01");
        assert_eq!(PeriodKind::Week.at(ms(2026, 11, 27, 0)).human(), "2026-W48");
    }

    #[test]
    fn the_day_label_is_the_bare_day_number() {
        let p = Period::day(20_419);
        assert_eq!(p.label(), "20419");
        assert_eq!(Period::parse_label("20419"), Some(p));
        assert_eq!(
            PeriodKind::Hour.at(ms(2026, 11, 27, 15)).human(),
            "2026-11-27T15"
        );
        for bad in ["", "x1", "h", "m-1", "d12", "h1x", "w 3"] {
            assert_eq!(Period::parse_label(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_hour_tier_crosses_midnight() {
        let before = PeriodKind::Hour.at(ms(2026, 11, 27, 23) + 3_599_999);
        let after = PeriodKind::Hour.at(ms(2026, 11, 28, 0));
        assert_eq!(before.next(), after);
        assert_eq!(before.human(), "2026-11-27T23");
        assert_eq!(after.human(), "2026-11-28T00");
    }

    fn z(name: &str) -> Zone {
        Zone::named(name).unwrap()
    }

    /// Unix ms of a UTC civil time.
    fn utc(y: i64, m: u32, d: u32, h: i64, min: i64) -> u64 {
        ms(y, m, d, h) + (min * 60_000) as u64
    }

    const H: u64 = HOUR_MS as u64;
    const D: u64 = DAY_MS as u64;

    #[test]
    fn a_day_in_a_zone_is_23_or_25_hours_across_daylight_saving() {
        // Berlin: 2027-03-28 02:00 CET → 03:00 CEST (spring forward);
        // 2027-10-31 03:00 CEST → 02:00 CET (fall back).
        let berlin = z("Europe/Berlin");
        let spring = PeriodKind::Day.at_in(berlin, utc(2027, 3, 28, 12, 0));
        assert_eq!(spring.human(), "2027-03-28");
        assert_eq!(spring.len_ms(), 23 * H);
        assert_eq!(spring.start_ms() as u64, utc(2027, 3, 27, 23, 0));
        let fall = PeriodKind::Day.at_in(berlin, utc(2027, 10, 31, 12, 0));
        assert_eq!(fall.len_ms(), 25 * H);
        assert_eq!(fall.start_ms() as u64, utc(2027, 10, 30, 22, 0));
        // New York: 2027-03-14 02:00 EST → 03:00 EDT; 2027-11-07 02:00 EDT
        // → 01:00 EST.
        let ny = z("America/New_York");
        let spring = PeriodKind::Day.at_in(ny, utc(2027, 3, 14, 18, 0));
        assert_eq!(
            (spring.human().as_str(), spring.len_ms()),
            ("2027-03-14", 23 * H)
        );
        assert_eq!(spring.start_ms() as u64, utc(2027, 3, 14, 5, 0));
        let fall = PeriodKind::Day.at_in(ny, utc(2027, 11, 7, 18, 0));
        assert_eq!(
            (fall.human().as_str(), fall.len_ms()),
            ("2027-11-07", 25 * H)
        );
        assert_eq!(fall.end_ms() as u64, utc(2027, 11, 8, 5, 0));
        // Local midnight, not UTC's: 23:30Z on the 6th is already the 7th in
        // Berlin, and 03:00Z on the 8th is still the 7th in New York.
        let at = |zone, t| PeriodKind::Day.at_in(zone, t).human();
        assert_eq!(at(berlin, utc(2027, 11, 6, 23, 30)), "2027-11-07");
        assert_eq!(at(ny, utc(2027, 11, 8, 3, 0)), "2027-11-07");
    }

    #[test]
    fn hours_in_a_zone_across_daylight_saving() {
        let berlin = z("Europe/Berlin");
        // Fall back: local 02:00–03:00 happens twice; two periods of one
        // hour each, told apart by their offset.
        let first = PeriodKind::Hour.at_in(berlin, utc(2027, 10, 31, 0, 30));
        let second = PeriodKind::Hour.at_in(berlin, utc(2027, 10, 31, 1, 30));
        assert_ne!(first, second);
        assert_eq!(first.next(), second);
        assert_eq!(first.human(), "2027-10-31T02+02:00");
        assert_eq!(second.human(), "2027-10-31T02+01:00");
        assert_eq!((first.len_ms(), second.len_ms()), (H, H));
        // Spring forward in New York: 01:00 EST is followed by 03:00 EDT.
        let ny = z("America/New_York");
        let before = PeriodKind::Hour.at_in(ny, utc(2027, 3, 14, 6, 59));
        let after = PeriodKind::Hour.at_in(ny, utc(2027, 3, 14, 7, 0));
        assert_eq!(before.human(), "2027-03-14T01-05:00");
        assert_eq!(after.human(), "2027-03-14T03-04:00");
        assert_eq!(before.next(), after);
        // A half-hour zone's clock hour starts at :30 UTC.
        let kolkata = z("Asia/Kolkata");
        let h = PeriodKind::Hour.at_in(kolkata, utc(2027, 1, 5, 4, 45));
        assert_eq!(h.start_ms() as u64, utc(2027, 1, 5, 4, 30));
        assert_eq!(h.human(), "2027-01-05T10+05:30");
        assert!(h.contains(utc(2027, 1, 5, 5, 29)) && !h.contains(utc(2027, 1, 5, 5, 30)));
    }

    #[test]
    fn a_month_in_a_zone_whose_offset_changes_during_it() {
        // March 2027 in Berlin: from 2027-02-28 23:00Z (CET) to 2027-03-31
        // 22:00Z (CEST): 31 days less the hour clocks went forward.
        let berlin = z("Europe/Berlin");
        let march = PeriodKind::Month.at_in(berlin, utc(2027, 3, 15, 0, 0));
        assert_eq!(march.human(), "2027-03");
        assert_eq!(march.start_ms() as u64, utc(2027, 2, 28, 23, 0));
        assert_eq!(march.end_ms() as u64, utc(2027, 3, 31, 22, 0));
        assert_eq!(march.len_ms(), 31 * D - H);
        // The first instant of March in Berlin is still February in UTC.
        assert_eq!(
            PeriodKind::Month.at_in(berlin, utc(2027, 2, 28, 23, 0)),
            march
        );
        assert_eq!(
            PeriodKind::Month.at(utc(2027, 2, 28, 23, 0)).human(),
            "2027-02"
        );
        // November in New York gains the hour back.
        let nov = PeriodKind::Month.at_in(z("America/New_York"), utc(2027, 11, 15, 0, 0));
        assert_eq!(nov.len_ms(), 30 * D + H);
        // An ISO week in a zone starts at local Monday midnight.
        let w = PeriodKind::Week.at_in(berlin, utc(2027, 3, 31, 12, 0));
        assert_eq!(w.start_ms() as u64, utc(2027, 3, 28, 22, 0));
        assert_eq!(w.human(), "2027-W13");
    }

    #[test]
    fn zoned_labels_keep_the_zone_and_utc_labels_are_unchanged() {
        let berlin = z("Europe/Berlin");
        let d = PeriodKind::Day.at_in(berlin, utc(2026, 11, 27, 12, 0));
        assert_eq!(d.label(), format!("{}@Europe/Berlin", d.index));
        assert_eq!(Period::parse_label(&d.label()), Some(d));
        let m = PeriodKind::Month.at_in(berlin, utc(2026, 11, 27, 12, 0));
        assert_eq!(Period::parse_label(&m.label()), Some(m));
        assert_ne!(m, PeriodKind::Month.at(utc(2026, 11, 27, 12, 0)));
        let today = PeriodKind::Day.at_in(Zone::UTC, utc(2026, 11, 27, 12, 0));
        assert_eq!(today.label(), "20784");
        for bad in [
            "20419@",
            "20419@Nowhere/Else",
            "20419@UTC",
            "@Europe/Berlin",
        ] {
            assert_eq!(Period::parse_label(bad), None, "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn every_instant_is_in_its_period_and_labels_round_trip(t in 0u64..8_000_000_000_000, k in 0usize..4) {
            let kind = PeriodKind::ALL[k];
            let p = kind.at(t);
            prop_assert!(p.contains(t));
            prop_assert!(!p.prev().contains(t) || p.index == 0);
            prop_assert!(!p.next().contains(t));
            prop_assert_eq!(p.end_ms(), p.next().start_ms());
            prop_assert!(p.len_ms() <= kind.max_len_ms());
            prop_assert_eq!(Period::parse_label(&p.label()), Some(p));
            prop_assert_eq!(PeriodKind::from_code(kind.code()), Some(kind));
        }

        #[test]
        fn every_instant_is_in_its_zoned_period(t in 0u64..4_000_000_000_000, k in 0usize..4, zi in 0usize..4) {
            let names = ["Europe/Berlin", "America/New_York", "Asia/Kolkata", "Australia/Sydney"];
            let zone = z(names[zi]);
            let kind = PeriodKind::ALL[k];
            let p = kind.at_in(zone, t);
            prop_assert!(p.contains(t), "{} {}", p, t);
            prop_assert!(!p.next().contains(t));
            prop_assert_eq!(p.next().prev(), p);
            prop_assert_eq!(kind.at_in(zone, p.start_ms() as u64), p);
            prop_assert_eq!(kind.at_in(zone, p.end_ms() as u64), p.next());
            prop_assert_eq!(Period::parse_label(&p.label()), Some(p));
        }

        #[test]
        fn civil_days_round_trip(z in -1_000_000i64..1_000_000) {
            let (y, m, d) = civil_from_days(z);
            prop_assert_eq!(days_from_civil(y, m, d), z);
        }
    }
}
