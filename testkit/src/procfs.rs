//! What Linux' `/proc` says about a process and the machine: resident
//! memory, CPU time, load average. The benchmarks read them beside a run.

/// Resident set size of process `pid` in KiB (`VmRSS` of
/// `/proc/PID/status`), `None` if the process is gone.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// CPU time process `pid` has used so far, user + system, in clock ticks
/// (1/100 s on Linux): fields 14 and 15 of `/proc/PID/stat`. `None` if the
/// process is gone.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces:
    // count fields after its closing parenthesis (field 3 is the first).
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// The machine's load averages over 1, 5 and 15 minutes, as `/proc/loadavg`
/// writes them (`"1.70 2.15 1.74"`).
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_memory_and_cpu_time_and_the_machine_a_load() {
        let me = std::process::id();
        assert!(rss_kib(me).is_some_and(|kib| kib > 0));
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(50) {
            std::hint::black_box(0u64);
        }
        assert!(cpu_ticks(me).is_some());
        assert_eq!(load_average().split(' ').count(), 3);
        assert_eq!(rss_kib(u32::MAX), None);
        assert_eq!(cpu_ticks(u32::MAX), None);
    }
}
