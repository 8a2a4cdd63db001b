//! The Prometheus toolkit every layer registers its own metrics with: the name prefix, counter
//! and gauge constructors that register on a passed-in registry, per-thread counters exported
//! at gathering ([`PerThread`]), gauges read at gathering ([`ReadGauge`]), and the process's own
//! gauges ([`ProcessGauges`]: build, tasks, descriptors).
//!
//! Each layer owns its metrics (data/metrics.rs, backends/metrics.rs, handoff/metrics.rs, the
//! lifecycle, the admin endpoint, the node agents): their names, help texts and handles live
//! beside the code that counts, so a new metric is added where it is counted. The hot path
//! holds pre-resolved handles (no label lookups per connection).

use std::sync::{Arc, Mutex};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::base::shard;

/// Prefix of every metric name.
pub const PREFIX: &str = "kube_apiserver_proxy";

pub const BUILD_INFO: &str = "build_info";
pub const RUNTIME_ALIVE_TASKS: &str = "runtime_alive_tasks";
pub const OPEN_FDS: &str = "open_fds";

/// `name` under [`PREFIX`], with `help`.
pub fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help).namespace(PREFIX)
}

/// Registers `collector` on `r` and returns it (a name registered twice is a bug).
pub fn register<C: Collector + Clone + 'static>(r: &Registry, collector: C) -> C {
    r.register(Box::new(collector.clone()))
        .expect("metric registered once");
    collector
}

/// A counter named `name`, registered on `r`.
pub fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    register(
        r,
        IntCounter::with_opts(opts(name, help)).expect("metric definition is valid"),
    )
}

/// A gauge named `name`, registered on `r`.
pub fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    register(
        r,
        IntGauge::with_opts(opts(name, help)).expect("metric definition is valid"),
    )
}

/// A counter with `labels`, registered on `r`.
pub fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(
        r,
        IntCounterVec::new(opts(name, help), labels).expect("metric definition is valid"),
    )
}

/// A gauge with `labels`, registered on `r`.
pub fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    register(
        r,
        IntGaugeVec::new(opts(name, help), labels).expect("metric definition is valid"),
    )
}

/// A histogram with `labels` and `buckets`, registered on `r`.
pub fn histogram_vec(
    r: &Registry,
    name: &str,
    help: &str,
    buckets: Vec<f64>,
    labels: &[&str],
) -> HistogramVec {
    register(
        r,
        HistogramVec::new(
            HistogramOpts::from(opts(name, help)).buckets(buckets),
            labels,
        )
        .expect("metric definition is valid"),
    )
}

/// Exports counters that the data path keeps per thread: at each gathering, every series is
/// brought up to the sum of its per-thread counter, then gathered as usual.
pub struct PerThread {
    exported: IntCounterVec,
    sources: Vec<(IntCounter, Arc<shard::Counter>)>,
    /// Two gatherings at once must not both add the same difference.
    sync: Mutex<()>,
}

impl PerThread {
    /// Registers `name{label}` on `r`, one series a value of `label`, each fed from a per-thread
    /// counter, which are returned in the order of `values`.
    pub fn register(
        r: &Registry,
        name: &str,
        help: &str,
        label: &str,
        values: &[&str],
    ) -> Vec<Arc<shard::Counter>> {
        let exported =
            IntCounterVec::new(opts(name, help), &[label]).expect("metric definition is valid");
        let counters: Vec<Arc<shard::Counter>> = values
            .iter()
            .map(|_| Arc::new(shard::Counter::default()))
            .collect();
        let sources = values
            .iter()
            .zip(&counters)
            .map(|(v, c)| (exported.with_label_values(&[v]), c.clone()))
            .collect();
        r.register(Box::new(PerThread {
            exported,
            sources,
            sync: Mutex::new(()),
        }))
        .expect("metric registered once");
        counters
    }
}

impl Collector for PerThread {
    fn desc(&self) -> Vec<&Desc> {
        self.exported.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        {
            let _sync = self.sync.lock().expect("metrics sync lock");
            for (series, source) in &self.sources {
                let (now, shown) = (source.get(), series.get());
                if now > shown {
                    series.inc_by(now - shown);
                }
            }
        }
        self.exported.collect()
    }
}

/// A gauge whose value its owner reads at every gathering (a pool's size, which the pool
/// keeps).
pub struct ReadGauge {
    gauge: IntGauge,
    read: Box<dyn Fn() -> usize + Send + Sync>,
}

impl ReadGauge {
    /// Registers `name` on `r`, read from `read` at every gathering.
    pub fn register(
        r: &Registry,
        name: &str,
        help: &str,
        read: impl Fn() -> usize + Send + Sync + 'static,
    ) {
        let gauge = IntGauge::with_opts(opts(name, help)).expect("metric definition is valid");
        r.register(Box::new(ReadGauge {
            gauge,
            read: Box::new(read),
        }))
        .expect("metric registered once");
    }
}

impl Collector for ReadGauge {
    fn desc(&self) -> Vec<&Desc> {
        self.gauge.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.gauge.set((self.read)() as i64);
        self.gauge.collect()
    }
}

/// The process's own gauges: its build (set once), its runtime's tasks and its descriptors
/// (read at every scrape: [`ProcessGauges::refresh`]).
#[derive(Clone)]
pub struct ProcessGauges {
    runtime_alive_tasks: IntGauge,
    open_fds: IntGauge,
}

impl ProcessGauges {
    /// Registers `build_info{version}` (set to 1) and the process's gauges on `r`.
    pub fn register(r: &Registry) -> Self {
        gauge_vec(r, BUILD_INFO, "Build information, value 1.", &["version"])
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        ProcessGauges {
            runtime_alive_tasks: gauge(
                r,
                RUNTIME_ALIVE_TASKS,
                "Tasks alive in the async runtime (read at scrape).",
            ),
            open_fds: gauge(
                r,
                OPEN_FDS,
                "Open file descriptors of the process (read at scrape).",
            ),
        }
    }

    /// Refreshes the gauges that are read rather than counted (call before gathering). The
    /// descriptor count walks `/proc/self/fd`, so it is done on the blocking pool.
    pub async fn refresh(&self) {
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            self.runtime_alive_tasks
                .set(handle.metrics().num_alive_tasks() as i64);
        }
        let count = tokio::task::spawn_blocking(|| {
            // Minus the descriptor of the directory being read.
            std::fs::read_dir("/proc/self/fd").map(|dir| dir.count() as i64 - 1)
        });
        if let Ok(Ok(n)) = count.await {
            self.open_fds.set(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_thread_counters_and_read_gauges_are_exported_at_gathering() {
        let r = Registry::new();
        let counters = PerThread::register(&r, "t_total", "t", "dir", &["a", "b"]);
        counters[1].add(5);
        ReadGauge::register(&r, "pool", "p", || 7);
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&r.gather())
            .unwrap();
        assert!(
            text.contains("kube_apiserver_proxy_t_total{dir=\"a\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("kube_apiserver_proxy_t_total{dir=\"b\"} 5"),
            "{text}"
        );
        assert!(text.contains("kube_apiserver_proxy_pool 7"), "{text}");
    }
}
