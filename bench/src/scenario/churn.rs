//! `churn`: a new connection per request (connect, send, read the echo, close) from several
//! concurrent clients. Reports connections per second and connect+first-byte latency. With
//! `--tls` every connection makes a full TLS handshake with the TLS echo backend, end to end
//! through the target, as kube-apiserver clients do.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use hdrhistogram::Histogram;
use serde_json::json;
use tokio::time::Instant;

use super::{cpu_over, Scenario};
use crate::backend::{BackendAddrs, BackendProcess, TlsClient};
use crate::client::{churn_request, Window};
use crate::options::{ChurnArgs, Timing};
use crate::report::{MetricSpec, Metrics};
use crate::stats::{latency_histogram, record};
use crate::target::Running;

impl Scenario for ChurnArgs {
    const NAME: &'static str = "churn";

    fn description(&self) -> String {
        format!(
            "new {}connection per {}-byte request, {} concurrent clients",
            if self.tls { "TLS " } else { "" },
            self.size,
            self.clients
        )
    }

    fn stem(&self) -> String {
        super::stem(Self::NAME, self.tls)
    }

    fn parameters(&self) -> serde_json::Value {
        json!(self)
    }

    fn backend(&self, addrs: &BackendAddrs) -> SocketAddr {
        super::echo_backend(addrs, self.tls)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        super::rate_and_latency_specs("connections_per_s", "connections/s")
    }

    async fn measure(
        &self,
        target: &Running,
        backend: &BackendProcess,
        timing: &Timing,
    ) -> Result<Metrics> {
        let window = Window::from_now(timing);
        let size = self.size.clamp(2, 255);
        let tls = self.tls.then(|| backend.tls_client());
        let tasks: Vec<_> = (0..self.clients.max(1))
            .map(|_| tokio::spawn(client(target.addr, size, tls.clone(), window)))
            .collect();
        let mut metrics = cpu_over(&window, target, backend).await?;
        super::collect_clients(tasks, &window, "connections_per_s", &mut metrics).await?;
        Ok(metrics)
    }
}

/// One client's loop; returns its latencies and failures inside the window.
async fn client(
    addr: SocketAddr,
    size: usize,
    tls: Option<TlsClient>,
    window: Window,
) -> (Histogram<u64>, u64) {
    let mut histogram = latency_histogram();
    let mut failed = 0;
    while !window.is_over() {
        let began = Instant::now();
        let result = churn_request(addr, size, Duration::from_secs(5), tls.as_ref()).await;
        let ended = Instant::now();
        if !window.contains(began, ended) {
            continue;
        }
        match result {
            Ok(latency) => record(&mut histogram, latency),
            Err(_) => failed += 1,
        }
    }
    (histogram, failed)
}
