//! What a benchmark ran on and when: CPU model and cores from `/proc/cpuinfo`, load average,
//! date, commit and toolchain. Printed with every generated table, because on a shared 2-core
//! machine a number means little without them.

use std::path::Path;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// The machine and the moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Machine {
    /// CPU model name.
    pub cpu: String,
    /// Logical cores.
    pub cores: usize,
    /// 1-minute load average at the start of the run.
    pub load_start: Option<f64>,
    /// 1-minute load average at the end of the run (filled at the end).
    pub load_end: Option<f64>,
    /// UTC date and time, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
    /// `git` commit (short), with `+changes` if the tree had uncommitted changes.
    pub commit: String,
    /// `rustc --version`.
    pub rustc: String,
}

impl Machine {
    /// Reads everything now.
    #[must_use]
    pub fn now(root: &Path) -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let (cpu, cores) = parse_cpuinfo(&cpuinfo);
        let cores = if cores == 0 {
            std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
        } else {
            cores
        };
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let git = |args: &[&str]| {
            Command::new("git")
                .args(args)
                .current_dir(root)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        };
        let mut commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".to_owned());
        if git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty()) {
            commit.push_str("+changes");
        }
        let rustc = Command::new("rustc")
            .arg("--version")
            .current_dir(root)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default();
        Machine { cpu, cores, load_start: load_average(), load_end: None, date: utc(secs), commit, rustc }
    }

    /// One line for a table caption.
    #[must_use]
    pub fn line(&self) -> String {
        let load = match (self.load_start, self.load_end) {
            (Some(a), Some(b)) => format!(", load average {a:.1} → {b:.1}"),
            (Some(a), None) => format!(", load average {a:.1}"),
            _ => String::new(),
        };
        format!(
            "{}, {} cores{load}; {}; commit {}; {}",
            self.cpu, self.cores, self.date, self.commit, self.rustc
        )
    }
}

/// (model name, logical cores) from `/proc/cpuinfo`.
#[must_use]
pub fn parse_cpuinfo(text: &str) -> (String, usize) {
    let mut model = None;
    let mut cores = 0;
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else { continue };
        match k.trim() {
            "processor" => cores += 1,
            "model name" if model.is_none() => model = Some(v.trim().to_owned()),
            _ => {}
        }
    }
    (model.unwrap_or_else(|| "unknown CPU".to_owned()), cores)
}

/// The 1-minute load average.
#[must_use]
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// `YYYY-MM-DD HH:MM UTC` for seconds since the Unix epoch (proleptic Gregorian calendar).
#[must_use]
pub fn utc(secs: u64) -> String {
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02} UTC", rem / 3600, rem % 3600 / 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(utc(0), "1970-01-01 00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00 UTC");
        assert_eq!(utc(1_700_000_000), "2023-11-14 22:13 UTC");
        assert_eq!(utc(4_102_444_799), "2099-12-31 23:59 UTC");
    }

    #[test]
    fn cpuinfo() {
        let text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t: sse\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\n";
        assert_eq!(parse_cpuinfo(text), ("AMD EPYC".to_owned(), 2));
        assert_eq!(parse_cpuinfo(""), ("unknown CPU".to_owned(), 0));
    }
}
