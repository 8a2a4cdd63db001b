//! What `rr` and `churn` share: closed-loop clients against the echo backend (plain, or TLS with
//! `--tls`), each sending a request and waiting for its answer before the next, for the
//! measured window. A [`ClosedLoop`] scenario says how one client loops; the [`Scenario`]
//! around it (backend, figures, measurement) is written once here. The figures: a rate per
//! second, latency percentiles (from send to the last byte of the answer) and failures.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;

use anyhow::Result;
use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::task::JoinHandle;

use super::{cpu_over, Scenario};
use crate::backend::{BackendAddrs, BackendProcess, TlsClient};
use crate::client::Window;
use crate::options::Timing;
use crate::report::{MetricSpec, Metrics, Unit};
use crate::target::Running;

/// A closed-loop scenario: its name, its rate figure and one client's loop.
pub trait ClosedLoop: Serialize {
    /// Subcommand name.
    const NAME: &'static str;
    /// Key and label of the headline rate (per second): one per answered request.
    const RATE: (&'static str, &'static str);
    /// One line describing the workload with its parameters.
    fn description(&self) -> String;
    /// Concurrent clients (at least one is run), and whether they speak TLS end to end to
    /// the TLS echo backend.
    fn clients(&self) -> (usize, bool);
    /// One client's loop against `addr` until `window` ends (`tls` set with `--tls`).
    fn client(&self, addr: SocketAddr, tls: Option<TlsClient>, window: Window) -> Loop;
}

/// One client's loop: its latencies and failure count inside the window.
pub type Loop = Pin<Box<dyn Future<Output = (Histogram<u64>, u64)> + Send>>;

impl<T: ClosedLoop> Scenario for T {
    const NAME: &'static str = T::NAME;

    fn description(&self) -> String {
        ClosedLoop::description(self)
    }

    /// `-tls` for the TLS variant, so that it does not overwrite the plain run's files.
    fn stem(&self) -> String {
        if self.clients().1 {
            format!("{}-tls", T::NAME)
        } else {
            T::NAME.to_owned()
        }
    }

    fn parameters(&self) -> serde_json::Value {
        serde_json::json!(self)
    }

    fn backend(&self, addrs: &BackendAddrs) -> SocketAddr {
        echo_backend(addrs, self.clients().1)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        rate_and_latency_specs(T::RATE.0, T::RATE.1)
    }

    async fn measure(
        &self,
        target: &Running,
        backend: &BackendProcess,
        timing: &Timing,
    ) -> Result<Metrics> {
        let window = Window::from_now(timing);
        let tls = self.clients().1.then(|| backend.tls_client());
        let tasks: Vec<_> = (0..self.clients().0.max(1))
            .map(|_| tokio::spawn(self.client(target.addr, tls.clone(), window)))
            .collect();
        let mut metrics = cpu_over(&window, target, backend).await?;
        collect_clients(tasks, &window, T::RATE.0, &mut metrics).await?;
        Ok(metrics)
    }
}

/// Latency percentiles (closed loop, from send to the last byte of the answer).
const LATENCY_METRICS: [MetricSpec; 4] = [
    MetricSpec::new("p50_us", "latency p50", Unit::Micros),
    MetricSpec::new("p90_us", "latency p90", Unit::Micros),
    MetricSpec::new("p99_us", "latency p99", Unit::Micros).charted(),
    MetricSpec::new("p999_us", "latency p99.9", Unit::Micros),
];

/// Failed connections or requests inside the window.
const FAILED_METRIC: MetricSpec = MetricSpec::new("failed", "failed", Unit::Count);

/// The [`LATENCY_METRICS`] of `histogram` (empty if it is).
fn latency_metrics(histogram: &hdrhistogram::Histogram<u64>) -> Metrics {
    if histogram.is_empty() {
        return Metrics::new();
    }
    crate::stats::PERCENTILES
        .iter()
        .map(|&(key, q)| {
            (
                key.to_owned(),
                histogram.value_at_quantile(q / 100.0) as f64,
            )
        })
        .collect()
}

/// The echo backend a closed-loop scenario talks to: plain, or TLS with `--tls`.
fn echo_backend(addrs: &BackendAddrs, tls: bool) -> SocketAddr {
    if tls {
        addrs.echo_tls
    } else {
        addrs.echo
    }
}

/// The figures of a closed-loop scenario: a rate (`rate_key`, per second), the latency
/// percentiles and the failure count.
fn rate_and_latency_specs(rate_key: &'static str, rate_label: &'static str) -> Vec<MetricSpec> {
    let mut specs = vec![MetricSpec::new(rate_key, rate_label, Unit::PerSec)
        .higher_is_better()
        .charted()];
    specs.extend(LATENCY_METRICS);
    specs.push(FAILED_METRIC);
    specs
}

/// Waits for the clients of a closed-loop scenario (each returning its latency histogram and
/// failure count) and adds the figures of [`rate_and_latency_specs`] to `metrics`.
async fn collect_clients(
    tasks: Vec<JoinHandle<(Histogram<u64>, u64)>>,
    window: &Window,
    rate_key: &str,
    metrics: &mut Metrics,
) -> Result<()> {
    let mut histogram = crate::stats::latency_histogram();
    let mut failed = 0u64;
    for task in tasks {
        let (h, f) = task.await?;
        histogram.add(&h)?;
        failed += f;
    }
    metrics.insert(rate_key.into(), histogram.len() as f64 / window.seconds());
    metrics.extend(latency_metrics(&histogram));
    metrics.insert("failed".into(), failed as f64);
    Ok(())
}
