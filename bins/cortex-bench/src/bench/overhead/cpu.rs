//! CPU time spent by a set of threads, from `/proc/<pid>/task/<tid>/schedstat` (nanoseconds on
//! CPU), to report each proxy's CPU per request next to its latency. On a shared machine
//! latency moves with the neighbours' load; CPU time per request barely does.

use std::path::Path;

/// Which threads count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Threads {
    /// Threads of this process whose name starts with one of these prefixes.
    Named(Vec<String>),
    /// Every thread of another process.
    Process(u32),
}

impl Threads {
    /// Total nanoseconds on CPU of the selected threads so far (0 where `/proc` is missing).
    #[must_use]
    pub fn cpu_ns(&self) -> u64 {
        match self {
            Threads::Named(prefixes) => sum(Path::new("/proc/self/task"), |comm| {
                prefixes.iter().any(|p| comm.starts_with(p.as_str()))
            }),
            Threads::Process(pid) => sum(&Path::new("/proc").join(pid.to_string()).join("task"), |_| true),
        }
    }
}

fn sum(tasks: &Path, keep: impl Fn(&str) -> bool) -> u64 {
    let Ok(entries) = std::fs::read_dir(tasks) else { return 0 };
    let mut total = 0;
    for e in entries.flatten() {
        let dir = e.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !keep(comm.trim()) {
            continue;
        }
        total += std::fs::read_to_string(dir.join("schedstat")).ok().as_deref().map_or(0, on_cpu_ns);
    }
    total
}

/// The first field of a `schedstat` line: time spent on the CPU, in ns.
#[must_use]
pub fn on_cpu_ns(schedstat: &str) -> u64 {
    schedstat.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_and_own_threads() {
        assert_eq!(on_cpu_ns("123456 789 10\n"), 123_456);
        assert_eq!(on_cpu_ns(""), 0);
        let t = std::thread::Builder::new()
            .name("cpu-test-spin".to_owned())
            .spawn(|| {
                let mut x = 0u64;
                for i in 0..20_000_000u64 {
                    x = x.wrapping_mul(31).wrapping_add(i);
                }
                std::hint::black_box(x);
                Threads::Named(vec!["cpu-test-spin".to_owned()]).cpu_ns()
            })
            .unwrap();
        let spent = t.join().unwrap();
        if Path::new("/proc/self/task").exists() {
            assert!(spent > 0, "a spinning thread has spent CPU");
        }
        assert_eq!(Threads::Named(vec!["no-such-thread".to_owned()]).cpu_ns(), 0);
    }
}
