//! Small statistics: median and range over rounds, latency percentiles.

use hdrhistogram::Histogram;
use serde::Serialize;

/// Median, minimum and maximum of a set of values.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    /// Summarises `values`; `None` when empty (or all NaN).
    pub fn of(values: &[f64]) -> Option<Self> {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Self {
            median,
            min: sorted[0],
            max: sorted[n - 1],
        })
    }
}

/// A latency histogram in microseconds, 1 µs to 100 s, 3 significant digits.
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000, 3).expect("valid histogram bounds")
}

/// Records a latency, clamped into the histogram's range.
pub fn record(histogram: &mut Histogram<u64>, latency: std::time::Duration) {
    let micros = (latency.as_micros() as u64).clamp(1, 100_000_000);
    histogram.saturating_record(micros);
}

/// The latency percentiles the reports use, in microseconds: p50, p90, p99, p99.9.
pub const PERCENTILES: [(&str, f64); 4] = [
    ("p50_us", 50.0),
    ("p90_us", 90.0),
    ("p99_us", 99.0),
    ("p999_us", 99.9),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        let s = Summary::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        let s = Summary::of(&[4.0, 1.0, 2.0, 3.0]).unwrap();
        assert_eq!(s.median, 2.5);
        assert!(Summary::of(&[]).is_none());
    }
}
