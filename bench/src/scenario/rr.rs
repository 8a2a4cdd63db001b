//! `rr`: many persistent connections, each sending a small request and waiting for the echo
//! before the next (closed loop). Reports requests per second and latency percentiles. With
//! `--tls` the connections speak TLS end to end (through the target) to the TLS echo backend;
//! the handshakes happen before the measured window.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use hdrhistogram::Histogram;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

use super::{cpu_over, Scenario};
use crate::backend::{BackendAddrs, BackendProcess, TlsClient};
use crate::client::{connect, exchange, handshake, Window};
use crate::options::{RrArgs, Timing};
use crate::report::{MetricSpec, Metrics};
use crate::stats::{latency_histogram, record};
use crate::target::Running;

impl Scenario for RrArgs {
    const NAME: &'static str = "rr";

    fn description(&self) -> String {
        format!(
            "{} persistent {}connections, {}-byte request/response",
            self.connections,
            if self.tls { "TLS " } else { "" },
            self.size
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
        super::rate_and_latency_specs("requests_per_s", "requests/s")
    }

    async fn measure(
        &self,
        target: &Running,
        backend: &BackendProcess,
        timing: &Timing,
    ) -> Result<Metrics> {
        let window = Window::from_now(timing);
        let size = self.size.clamp(1, 256);
        let tls = self.tls.then(|| backend.tls_client());
        let tasks: Vec<_> = (0..self.connections.max(1))
            .map(|_| tokio::spawn(client(target.addr, size, tls.clone(), window)))
            .collect();
        let mut metrics = cpu_over(&window, target, backend).await?;
        super::collect_clients(tasks, &window, "requests_per_s", &mut metrics).await?;
        Ok(metrics)
    }
}

/// One connection's closed loop (reconnecting after a failure); returns its latencies and
/// failure count.
async fn client(
    addr: SocketAddr,
    size: usize,
    tls: Option<TlsClient>,
    window: Window,
) -> (Histogram<u64>, u64) {
    let mut histogram = latency_histogram();
    let mut failed = 0;
    let timeout = Duration::from_secs(5);
    while !window.is_over() {
        let stream = match connect(addr, timeout).await {
            Ok(stream) => stream,
            Err(_) => {
                failed += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let result = match &tls {
            None => exchanges(stream, size, window, &mut histogram).await,
            Some(tls) => match handshake(tls, stream, timeout).await {
                Ok(stream) => exchanges(stream, size, window, &mut histogram).await,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    Err(())
                }
            },
        };
        if result.is_err() {
            failed += 1;
        }
    }
    (histogram, failed)
}

/// Requests on one connection until the window ends (`Ok`) or an exchange fails (`Err`).
async fn exchanges<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    size: usize,
    window: Window,
    histogram: &mut Histogram<u64>,
) -> Result<(), ()> {
    let request = vec![0x42u8; size];
    let mut answer = vec![0u8; size];
    let timeout = Duration::from_secs(5);
    while !window.is_over() {
        let began = Instant::now();
        if exchange(&mut stream, &request, &mut answer, timeout)
            .await
            .is_err()
        {
            return Err(());
        }
        let ended = Instant::now();
        if window.contains(began, ended) {
            record(histogram, ended - began);
        }
    }
    Ok(())
}
