//! `rr`: many persistent connections, each sending a small request and waiting for the echo
//! before the next (closed loop). Reports requests per second and latency percentiles. With
//! `--tls` the connections speak TLS end to end (through the target) to the TLS echo backend;
//! the handshakes happen before the measured window.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use hdrhistogram::Histogram;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

use super::closed_loop::{ClosedLoop, Loop};
use crate::backend::TlsClient;
use crate::client::{connect, exchange, handshake, Window};
use crate::options::RrArgs;
use crate::stats::{latency_histogram, record};

impl ClosedLoop for RrArgs {
    const NAME: &'static str = "rr";
    const RATE: (&'static str, &'static str) = ("requests_per_s", "requests/s");

    fn description(&self) -> String {
        format!(
            "{} persistent {}connections, {}-byte request/response",
            self.connections,
            if self.tls { "TLS " } else { "" },
            self.size
        )
    }

    fn clients(&self) -> (usize, bool) {
        (self.connections, self.tls)
    }

    fn client(&self, addr: SocketAddr, tls: Option<TlsClient>, window: Window) -> Loop {
        Box::pin(client(addr, self.size.clamp(1, 256), tls, window))
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
