//! Placing a decision in a fixed window from what its reply says.
//!
//! A client cannot read the server's window from its own clock alone (the
//! request takes time, and the window edge may fall inside it); the reply's
//! `reset_ms` pins the window's end to a point the client can bracket. The
//! tests' history checker and the bench's near-the-limit run both count
//! allowed units per window this way.

use std::time::{SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch on this machine's clock, which every
/// server started here (each region's Redis included) shares: the client's
/// side of the time bracket [`windows_of`] reads.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// The windows a decision may have fallen in, first and last (the same
/// unless the request took longer than a window); an error if none.
pub fn windows_of(start_us: u64, end_us: u64, reset_ms: u64, w: u64) -> Result<(u64, u64), String> {
    let lo = start_us / 1000 + reset_ms;
    let hi = end_us.div_ceil(1000) + reset_ms;
    let first = lo.div_ceil(w);
    let last = hi / w;
    if last < first {
        return Err(format!(
            "no window end in [{lo}, {hi}] ms (w {w} ms): the server's clock disagrees with ours"
        ));
    }
    Ok((first - 1, last - 1))
}
