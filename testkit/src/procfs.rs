//! What Linux' `/proc` says about a process and the machine: resident
//! memory, CPU time, load average, where the machine's time went. The
//! benchmarks read them beside a run; the fault suite logs the last to
//! tell a stalled machine from a stalled node.

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

/// The machine's CPU time so far, summed over its CPUs (the `cpu` line of
/// `/proc/stat`, in clock ticks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MachineTicks {
    /// Running anything: user, nice, system, irq, softirq.
    pub busy: u64,
    /// Idle with I/O outstanding.
    pub iowait: u64,
    /// Taken by the hypervisor for other guests while this one could run.
    pub steal: u64,
    /// All of it, idle included.
    pub total: u64,
}

impl MachineTicks {
    /// Now, or `None` off Linux.
    pub fn now() -> Option<MachineTicks> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    fn parse(stat: &str) -> Option<MachineTicks> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal (guest time is
        // already counted in user and nice).
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        Some(MachineTicks {
            busy: at(0) + at(1) + at(2) + at(5) + at(6),
            iowait: at(4),
            steal: at(7),
            total: (0..8).map(at).sum(),
        })
    }

    /// Where the machine's time went since `earlier`, in percent:
    /// `"busy 97%, iowait 0%, steal 2%"`.
    pub fn since(&self, earlier: &MachineTicks) -> String {
        let total = self.total.saturating_sub(earlier.total).max(1) as f64;
        let pct = |now: u64, then: u64| 100.0 * now.saturating_sub(then) as f64 / total;
        format!(
            "busy {:.0}%, iowait {:.0}%, steal {:.0}%",
            pct(self.busy, earlier.busy),
            pct(self.iowait, earlier.iowait),
            pct(self.steal, earlier.steal)
        )
    }
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

    #[test]
    fn the_machines_time_splits_into_busy_iowait_and_steal() {
        let then = MachineTicks::parse("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3\n").unwrap();
        let now = MachineTicks::parse("cpu  160 10 80 850 20 0 0 80 0 0\n").unwrap();
        assert_eq!(
            (then.busy, then.iowait, then.steal, then.total),
            (150, 10, 40, 1000)
        );
        // 200 ticks: 100 busy, 10 iowait, 40 steal, 50 idle.
        assert_eq!(now.since(&then), "busy 50%, iowait 5%, steal 20%");
        assert_eq!(MachineTicks::parse("intr 1 2\n"), None);
        assert!(MachineTicks::now().is_some_and(|m| m.total > 0));
    }
}
