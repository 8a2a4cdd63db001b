//! `churn`: a new connection per request (connect, send, read the echo, close) from several
//! concurrent clients. Reports connections per second and connect+first-byte latency. With
//! `--tls` every connection makes a full TLS handshake with the TLS echo backend, end to end
//! through the target, as kube-apiserver clients do.

use std::net::SocketAddr;
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::time::Instant;

use super::closed_loop::{ClosedLoop, Loop};
use crate::backend::TlsClient;
use crate::client::{churn_request, Window};
use crate::options::ChurnArgs;
use crate::stats::{latency_histogram, record};

impl ClosedLoop for ChurnArgs {
    const NAME: &'static str = "churn";
    const RATE: (&'static str, &'static str) = ("connections_per_s", "connections/s");

    fn description(&self) -> String {
        format!(
            "new {}connection per {}-byte request, {} concurrent clients",
            if self.tls { "TLS " } else { "" },
            self.size,
            self.clients
        )
    }

    fn clients(&self) -> (usize, bool) {
        (self.clients, self.tls)
    }

    fn client(&self, addr: SocketAddr, tls: Option<TlsClient>, window: Window) -> Loop {
        Box::pin(client(addr, self.size.clamp(2, 255), tls, window))
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
