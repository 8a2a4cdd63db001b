//! CPU time and resident memory: of child processes from `/proc/PID/stat` and
//! `/proc/PID/status`, of this process (the load generator) from `getrusage`.

use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::resource::{getrlimit, getrusage, setrlimit, Resource, UsageWho};
use nix::unistd::{sysconf, SysconfVar};
use serde::Serialize;

/// A snapshot of one process.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ProcSample {
    /// User plus system CPU time.
    pub cpu: Duration,
    /// Resident set size (`VmRSS`).
    pub rss_bytes: u64,
}

/// Reads CPU time (utime + stime, all threads) and RSS of `pid`.
pub fn sample(pid: u32) -> Result<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("cannot read /proc/{pid}/stat"))?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("cannot read /proc/{pid}/status"))?;
    Ok(ProcSample {
        cpu: parse_stat_cpu(&stat, clock_ticks())?,
        rss_bytes: parse_status_rss(&status)?,
    })
}

/// Open file descriptors of `pid` (entries of `/proc/PID/fd`).
pub fn open_fds(pid: u32) -> Result<u64> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("cannot read /proc/{pid}/fd"))?;
    Ok(dir.count() as u64)
}

/// CPU time used by this process so far (user + system).
pub fn self_cpu() -> Duration {
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(usage) => {
            let user = usage.user_time();
            let system = usage.system_time();
            let micros =
                (user.tv_sec() + system.tv_sec()) * 1_000_000 + (user.tv_usec() + system.tv_usec());
            Duration::from_micros(micros.max(0) as u64)
        }
        Err(_) => Duration::ZERO,
    }
}

/// Raises the soft open-files limit to the hard limit (children inherit it), so that the idle
/// scenario can hold thousands of connections.
pub fn raise_nofile_limit() {
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

/// The open-files soft limit.
pub fn nofile_limit() -> u64 {
    getrlimit(Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft)
        .unwrap_or(1024)
}

fn clock_ticks() -> u64 {
    match sysconf(SysconfVar::CLK_TCK) {
        Ok(Some(ticks)) if ticks > 0 => ticks as u64,
        _ => 100,
    }
}

fn parse_stat_cpu(stat: &str, ticks: u64) -> Result<Duration> {
    // The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("malformed stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); utime and stime are fields 14 and 15.
    let field = |n: usize| -> Result<u64> {
        fields
            .get(n - 3)
            .context("short stat")?
            .parse::<u64>()
            .context("bad stat field")
    };
    let total = field(14)? + field(15)?;
    Ok(Duration::from_micros(total * 1_000_000 / ticks))
}

fn parse_status_rss(status: &str) -> Result<u64> {
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS")?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .context("malformed VmRSS")?
        .parse()?;
    Ok(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat() {
        let stat = "1234 (a (weird) name) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0";
        assert_eq!(parse_stat_cpu(stat, 100).unwrap(), Duration::from_secs(3));
    }

    #[test]
    fn parses_status() {
        let status = "Name:\tx\nVmRSS:\t    2048 kB\nThreads:\t1\n";
        assert_eq!(parse_status_rss(status).unwrap(), 2048 * 1024);
    }

    #[test]
    fn samples_self() {
        let sample = sample(std::process::id()).unwrap();
        assert!(sample.rss_bytes > 0);
        assert!(open_fds(std::process::id()).unwrap() >= 3);
    }
}
