//! Per-thread structures for the data path, so that connections on different worker threads
//! share no cache line that they write to.
//!
//! - [`thread_index`]: a small number per thread, fixed for the thread's life.
//! - [`Counter`]: a counter kept as one padded cell per thread slot; adding to it writes only
//!   the calling thread's cell, reading it sums the cells. The byte counters, which every burst
//!   of every connection adds to, are these.
//! - [`Gauge`]: the same for a value that goes up and down (the idle splice pipes).

use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};

/// Thread slots per counter: threads beyond this share slots (still correct, only shared).
/// Worker threads are numbered first, as they are the first to count.
const SLOTS: usize = 16;

static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// This thread's number: 0, 1, 2, … in the order threads first ask.
#[inline]
pub fn thread_index() -> usize {
    INDEX.with(|i| {
        let v = i.get();
        if v != usize::MAX {
            return v;
        }
        let v = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
        i.set(v);
        v
    })
}

/// One cell per cache line pair (adjacent-line prefetch pulls lines in twos).
#[repr(align(128))]
#[derive(Default)]
struct Padded<T>(T);

/// A monotonic counter written per thread and summed when read.
pub struct Counter {
    cells: [Padded<AtomicU64>; SLOTS],
}

impl Default for Counter {
    fn default() -> Self {
        Counter {
            cells: std::array::from_fn(|_| Padded::default()),
        }
    }
}

impl Counter {
    /// Adds `n` to the calling thread's cell.
    #[inline]
    pub fn add(&self, n: u64) {
        self.cells[thread_index() % SLOTS]
            .0
            .fetch_add(n, Ordering::Relaxed);
    }

    /// The sum over all threads.
    pub fn get(&self) -> u64 {
        self.cells
            .iter()
            .map(|c| c.0.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

/// A gauge written per thread and summed when read; one thread may add what another
/// subtracts (only the sum means anything).
pub struct Gauge {
    cells: [Padded<AtomicI64>; SLOTS],
}

impl Gauge {
    pub const fn new() -> Self {
        // A `const` array element is copied, not shared: each cell is its own atomic.
        #[allow(clippy::declare_interior_mutable_const)]
        const ZERO: Padded<AtomicI64> = Padded(AtomicI64::new(0));
        Gauge {
            cells: [ZERO; SLOTS],
        }
    }

    #[inline]
    pub fn add(&self, n: i64) {
        self.cells[thread_index() % SLOTS]
            .0
            .fetch_add(n, Ordering::Relaxed);
    }

    /// The sum over all threads.
    pub fn get(&self) -> i64 {
        self.cells.iter().map(|c| c.0.load(Ordering::Relaxed)).sum()
    }
}

impl Default for Gauge {
    fn default() -> Self {
        Gauge::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn sums_what_every_thread_added() {
        let counter = Arc::new(Counter::default());
        let gauge = Arc::new(Gauge::new());
        let threads: Vec<_> = (0..40)
            .map(|t| {
                let (counter, gauge) = (counter.clone(), gauge.clone());
                std::thread::spawn(move || {
                    for i in 0..1000u64 {
                        counter.add(i + t);
                        gauge.add(if i % 2 == 0 { 3 } else { -1 });
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let expected: u64 = (0..40u64)
            .map(|t| (0..1000).map(|i| i + t).sum::<u64>())
            .sum();
        assert_eq!(counter.get(), expected);
        assert_eq!(gauge.get(), 40 * 500 * 2);
    }

    #[test]
    fn a_thread_keeps_its_index() {
        let a = thread_index();
        assert_eq!(a, thread_index());
        let other = std::thread::spawn(thread_index).join().unwrap();
        assert_ne!(a, other);
    }
}
