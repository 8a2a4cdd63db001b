//! Faults planted on purpose, so that the real-cluster tier can prove it catches them: its
//! self-test (`tests/cluster/run`, docs/testing.md) builds the proxy with `--features
//! planted-faults`, rolls pods that run `--planted-fault=KIND` under the client-go load, and
//! requires that every one of them fails the tier's pass criteria. A build without the feature
//! has neither this module nor the flag.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A fault to plant (`--planted-fault`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// Every 25th accepted connection is read once and closed cleanly, unanswered.
    CloseEvery25th,
    /// While draining, the instance goes on accepting, and closes every connection it accepts
    /// unanswered instead of leaving it to the successor or holding it.
    CloseWhileDraining,
    /// At the start of the drain every established connection is cut.
    CutAtHandoff,
}

static PLANTED: OnceLock<Fault> = OnceLock::new();

/// Plants `fault` for the rest of the process (once).
pub fn plant(fault: Option<Fault>) {
    if let Some(f) = fault {
        tracing::warn!(fault = ?f, "PLANTED FAULT: this build misbehaves on purpose (tier self-test)");
        let _ = PLANTED.set(f);
    }
}

fn planted() -> Option<Fault> {
    PLANTED.get().copied()
}

/// In the accept loop: whether this accepted connection is one to close unanswered.
pub fn close_accepted() -> bool {
    static ACCEPTED: AtomicU64 = AtomicU64::new(0);
    planted() == Some(Fault::CloseEvery25th) && ACCEPTED.fetch_add(1, Ordering::Relaxed) % 25 == 24
}

/// Closes a client cleanly without an answer: reads what it sent first, sends FIN, and waits
/// (a few seconds at most) for its own close, so that neither side resets.
pub async fn close_unanswered(mut stream: TcpStream) {
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf)).await;
    let _ = stream.shutdown().await;
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// At the start of the drain, before the listening sockets are handed over: `cut` cuts every
/// established connection, `listening` duplicates the listening sockets.
pub fn at_drain(
    cut: &CancellationToken,
    listening: impl FnOnce() -> io::Result<Vec<OwnedFd>>,
    deadline: Instant,
) {
    match planted() {
        Some(Fault::CutAtHandoff) => {
            tracing::warn!("PLANTED FAULT: cutting every established connection at the handoff");
            cut.cancel();
        }
        Some(Fault::CloseWhileDraining) => {
            let Ok(sockets) = listening() else {
                return;
            };
            tracing::warn!(
                sockets = sockets.len(),
                "PLANTED FAULT: accepting and closing while draining"
            );
            for fd in sockets {
                let std = std::net::TcpListener::from(fd);
                if std.set_nonblocking(true).is_err() {
                    continue;
                }
                let Ok(listener) = tokio::net::TcpListener::from_std(std) else {
                    continue;
                };
                tokio::spawn(async move {
                    while let Ok(Ok((stream, _))) =
                        tokio::time::timeout_at(deadline, listener.accept()).await
                    {
                        tokio::spawn(close_unanswered(stream));
                    }
                });
            }
        }
        Some(Fault::CloseEvery25th) | None => {}
    }
}
