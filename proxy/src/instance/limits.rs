//! The descriptor limit. A pod's soft `RLIMIT_NOFILE` may be 1024 while `--max-connections`
//! allows 10000 connections of two descriptors each; the hard limit is what the operator
//! granted, so the soft limit is raised to it at start, and a limit still too low is said
//! once, naming the flag.

use std::io;

use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// Descriptors kept aside besides the connections: listeners, health checks, admin, handoff,
/// splice pipes, the runtime's own.
const HEADROOM: u64 = 256;

/// The limit before and after raising it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NofileLimit {
    pub before: u64,
    pub soft: u64,
    pub hard: u64,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit.
pub fn raise_nofile() -> io::Result<NofileLimit> {
    let (before, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if before < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    Ok(NofileLimit { before, soft, hard })
}

/// Descriptors `max_connections` proxied connections need (two each, plus headroom). Pure.
pub fn needed(max_connections: u32) -> u64 {
    2 * u64::from(max_connections) + HEADROOM
}

/// Raises the limit and logs the outcome: one line, a warning when it stays below what
/// `max_connections` needs.
pub fn raise_and_report(max_connections: u32) {
    match raise_nofile() {
        Ok(limit) => {
            let need = needed(max_connections);
            if limit.soft < need {
                tracing::warn!(
                    soft = limit.soft,
                    hard = limit.hard,
                    needed = need,
                    max_connections,
                    "RLIMIT_NOFILE is below what --max-connections needs (two descriptors per connection): raise the hard limit or lower --max-connections"
                );
            } else {
                tracing::info!(
                    before = limit.before,
                    soft = limit.soft,
                    "RLIMIT_NOFILE raised to the hard limit"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot raise RLIMIT_NOFILE"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_descriptors_per_connection_plus_headroom() {
        assert_eq!(needed(10_000), 20_256);
        assert_eq!(needed(1), 258);
    }
}
