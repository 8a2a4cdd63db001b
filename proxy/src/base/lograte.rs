//! Rate limits for log lines that client traffic can trigger, so a failure storm (a backend
//! down under thousands of connections) cannot flood the logs: at most one line per interval,
//! carrying how many were suppressed since the last one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// One rate-limited log site.
pub struct LogRate {
    every: Duration,
    /// Milliseconds since `epoch()` of the last line emitted (0: never).
    last: AtomicU64,
    suppressed: AtomicU64,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl LogRate {
    pub const fn new(every: Duration) -> Self {
        LogRate {
            every,
            last: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(suppressed)` when a line may be emitted now, `None` when it is to be dropped.
    pub fn allow(&self) -> Option<u64> {
        let now = epoch().elapsed().as_millis() as u64 + 1;
        let last = self.last.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < self.every.as_millis() as u64 {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if self
            .last
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_of_the_rest() {
        let rate = LogRate::new(Duration::from_secs(3600));
        assert_eq!(rate.allow(), Some(0));
        for _ in 0..5 {
            assert_eq!(rate.allow(), None);
        }
        let fast = LogRate::new(Duration::ZERO);
        assert_eq!(fast.allow(), Some(0));
        assert_eq!(fast.allow(), Some(0));
    }
}
