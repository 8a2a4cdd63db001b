//! `throughput`: bulk bytes both ways over a few connections to the echo backend. Reports the
//! echoed bytes per second (each byte crosses the target twice, once each way) and the target's
//! CPU seconds per GiB echoed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::Result;
use serde_json::json;

use super::{cpu_over, Scenario};
use crate::backend::BackendProcess;
use crate::client::{bulk, Window};
use crate::options::{ThroughputArgs, Timing};
use crate::report::{MetricSpec, Metrics, Unit};
use crate::target::Running;

impl Scenario for ThroughputArgs {
    const NAME: &'static str = "throughput";

    fn description(&self) -> String {
        format!(
            "bulk echo both ways, {} connections, {} KiB writes",
            self.connections,
            self.chunk / 1024
        )
    }

    fn parameters(&self) -> serde_json::Value {
        json!(self)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::new("bytes_per_s", "echoed bytes/s", Unit::BytesPerSec)
                .higher_is_better()
                .charted(),
            MetricSpec::new(
                "target_cpu_s_per_gib",
                "target CPU per GiB",
                Unit::CpuSecondsPerGib,
            ),
            MetricSpec::new("failed", "failed connections", Unit::Count),
        ]
    }

    async fn measure(
        &self,
        target: &Running,
        backend: &BackendProcess,
        timing: &Timing,
    ) -> Result<Metrics> {
        let window = Window::from_now(timing);
        let received = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..self.connections.max(1))
            .map(|_| tokio::spawn(bulk(target.addr, self.chunk, window, received.clone())))
            .collect();
        let mut metrics = cpu_over(&window, target, backend).await?;
        let mut failed = 0u32;
        for task in tasks {
            if !matches!(task.await, Ok(Ok(()))) {
                failed += 1;
            }
        }
        let bytes = received.load(Ordering::Relaxed) as f64;
        metrics.insert("bytes_per_s".into(), bytes / window.seconds());
        metrics.insert("failed".into(), failed.into());
        if let Some(&cpu) = metrics.get("target_cpu_s") {
            if bytes > 0.0 {
                let gib = bytes / (1u64 << 30) as f64;
                metrics.insert("target_cpu_s_per_gib".into(), cpu / gib);
            }
        }
        Ok(metrics)
    }
}
