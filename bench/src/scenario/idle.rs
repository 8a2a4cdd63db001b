//! `idle`: N connections through the target, each after one small exchange, then held idle.
//! Reports the target's resident memory per connection: (RSS with N idle − RSS before) / N,
//! and the CPU it uses while all are held idle for the round's duration (timers, keepalives:
//! what N watches cost when nothing is sent).
//! `direct` has no target process; its row only shows how long opening N connections takes.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{ensure, Result};
use serde_json::json;
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::Scenario;
use crate::backend::BackendProcess;
use crate::client::{connect, exchange};
use crate::options::{IdleArgs, Timing};
use crate::outcome::FailureKind;
use crate::procstat;
use crate::report::{MetricSpec, Metrics, Unit};
use crate::target::Running;

impl Scenario for IdleArgs {
    const NAME: &'static str = "idle";

    fn description(&self) -> String {
        format!(
            "{} idle connections after one 16-byte exchange each",
            self.connections
        )
    }

    fn parameters(&self) -> serde_json::Value {
        json!(self)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::new(
                "rss_per_conn_bytes",
                "target RSS per idle connection",
                Unit::Bytes,
            )
            .charted(),
            MetricSpec::new("rss_before_bytes", "target RSS before", Unit::Bytes),
            MetricSpec::new("rss_after_bytes", "target RSS with all idle", Unit::Bytes),
            MetricSpec::new(
                "idle_cpu_seconds",
                "target CPU while all idle",
                Unit::CpuSeconds,
            ),
            MetricSpec::new(
                "open_us_per_conn",
                "time to open, per connection",
                Unit::Micros,
            ),
        ]
    }

    async fn measure(
        &self,
        target: &Running,
        _backend: &BackendProcess,
        timing: &Timing,
    ) -> Result<Metrics> {
        let n = self.connections.max(1);
        let limit = procstat::nofile_limit() as usize;
        ensure!(
            n + 100 < limit,
            "{n} connections need more open files than the limit ({limit})"
        );
        tokio::time::sleep(timing.warmup).await;
        let before = target.sample()?;
        let began = Instant::now();
        let held = open(target.addr, n, self.ramp.max(1)).await?;
        let open_time = began.elapsed();
        tokio::time::sleep(timing.warmup).await;
        let after = target.sample()?;
        tokio::time::sleep(timing.duration).await;
        let idled = target.sample()?;
        let mut metrics = Metrics::new();
        if let (Some(after), Some(idled)) = (after, idled) {
            let cpu = idled.cpu.saturating_sub(after.cpu);
            metrics.insert("idle_cpu_seconds".into(), cpu.as_secs_f64());
        }
        metrics.insert(
            "open_us_per_conn".into(),
            open_time.as_micros() as f64 / n as f64,
        );
        if let (Some(before), Some(after)) = (before, after) {
            let delta = after.rss_bytes as f64 - before.rss_bytes as f64;
            metrics.insert("rss_per_conn_bytes".into(), delta / n as f64);
            metrics.insert("rss_before_bytes".into(), before.rss_bytes as f64);
            metrics.insert("rss_after_bytes".into(), after.rss_bytes as f64);
        }
        drop(held);
        Ok(metrics)
    }
}

/// Opens `n` connections, `ramp` at a time, each after one exchange.
async fn open(addr: SocketAddr, n: usize, ramp: usize) -> Result<Vec<TcpStream>> {
    let mut held = Vec::with_capacity(n);
    let mut pending = JoinSet::new();
    let mut started = 0;
    while held.len() < n {
        while started < n && pending.len() < ramp {
            started += 1;
            pending.spawn(async move {
                let timeout = Duration::from_secs(5);
                let mut stream = connect(addr, timeout).await?;
                let mut answer = [0u8; 16];
                exchange(&mut stream, &[0x44; 16], &mut answer, timeout).await?;
                Ok::<_, FailureKind>(stream)
            });
        }
        match pending.join_next().await {
            Some(Ok(Ok(stream))) => held.push(stream),
            Some(Ok(Err(kind))) => anyhow::bail!(
                "idle connection {} of {n} failed: {}",
                held.len() + 1,
                kind.name()
            ),
            Some(Err(err)) => return Err(err.into()),
            None => break,
        }
    }
    Ok(held)
}
