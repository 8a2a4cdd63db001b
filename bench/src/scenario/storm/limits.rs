//! Descriptors and ports, the per-process and per-destination limits that bound a storm's N:
//! how many processes per role N needs at a descriptor limit, and how many ephemeral ports
//! the kernel gives one destination.

use anyhow::{bail, Result};

/// Descriptors one process needs besides its connections (listeners, pipes, logs, the
/// runtime's own).
pub const SPARE_DESCRIPTORS: u64 = 200;

/// Descriptors one target process needs for `n` connections spread over `k` processes: two per
/// connection, plus a tenth for an uneven spread by SO_REUSEPORT when `k > 1`, plus
/// [`SPARE_DESCRIPTORS`].
pub fn target_descriptors(n: usize, k: usize) -> u64 {
    let k = k.max(1) as u64;
    let share = (n as u64).div_ceil(k);
    let share = if k > 1 {
        share + share.div_ceil(10)
    } else {
        share
    };
    2 * share + SPARE_DESCRIPTORS
}

/// The fewest processes per role whose descriptor `limit` holds `n` connections
/// ([`target_descriptors`] below the limit).
pub fn processes_for(n: usize, limit: u64) -> Option<usize> {
    (1..=n.max(1)).find(|&k| target_descriptors(n, k) < limit)
}

/// Checks `--processes` against the descriptor limit, or picks the fewest processes that fit.
pub fn choose_processes(n: usize, asked: Option<usize>, limit: u64) -> Result<usize> {
    let fewest = processes_for(n, limit);
    match asked {
        Some(0) => bail!("--processes must be at least 1"),
        Some(k) if target_descriptors(n, k) < limit => Ok(k),
        Some(k) => bail!(
            "{n} connections over {k} processes need {} descriptors in each target process, \
             over the limit ({limit}){}",
            target_descriptors(n, k),
            fewest.map_or(String::new(), |f| format!("; use --processes {f} or more"))
        ),
        None => fewest.ok_or_else(|| {
            anyhow::anyhow!(
                "{n} connections need {} descriptors in the target, over the limit ({limit}), \
                 however many processes",
                target_descriptors(n, 1)
            )
        }),
    }
}

/// The ports `net.ipv4.ip_local_port_range` gives each destination, if readable.
pub fn ephemeral_ports() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut bounds = text.split_whitespace().map(|w| w.parse::<u64>().ok());
    let (low, high) = (bounds.next()??, bounds.next()??);
    Some(high.saturating_sub(low) + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_up_to_the_limit_as_before() {
        // 2 n + 200 below the limit: one process, as before the spread.
        assert_eq!(processes_for(1000, 20_000), Some(1));
        assert_eq!(processes_for(9000, 20_000), Some(1));
        assert_eq!(processes_for(9899, 20_000), Some(1));
        assert_eq!(processes_for(9900, 20_000), Some(2));
    }

    #[test]
    fn twenty_thousand_need_three_processes_at_a_limit_of_twenty_thousand() {
        // Two would need 2 × 11,000 + 200 descriptors each.
        assert_eq!(target_descriptors(20_000, 2), 22_200);
        assert_eq!(processes_for(20_000, 20_000), Some(3));
        assert_eq!(processes_for(20_000, 1_048_576), Some(1));
        assert_eq!(processes_for(10, 100), None);
    }

    #[test]
    fn asked_processes_are_checked_against_the_limit() {
        assert_eq!(choose_processes(50, Some(2), 20_000).unwrap(), 2);
        assert_eq!(choose_processes(9000, None, 20_000).unwrap(), 1);
        let err = choose_processes(20_000, Some(2), 20_000).unwrap_err();
        assert_eq!(
            err.to_string(),
            "20000 connections over 2 processes need 22200 descriptors in each target process, \
             over the limit (20000); use --processes 3 or more"
        );
        assert!(choose_processes(50, Some(0), 20_000).is_err());
        assert!(choose_processes(10, Some(1), 100).is_err());
    }
}
